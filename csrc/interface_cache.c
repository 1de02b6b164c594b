/* The records kept of validated ready interface dicts: a conversion of an unchanged dict reuses what the
 * last one read instead of reading and checking it again. Every rule of when a record is kept, found and
 * dropped is here; cai_to_dlpack.c asks cdl_cache_find before reading a dict and cdl_cache_store after. */
#include "cdl_internal.h"

#include <string.h>

/* An object that holds its interface as a ready dict hands the same dict to every conversion. The record
 * read from it is kept, per dict, and reused while the dict is unchanged: reading and checking the dict is
 * most of a conversion. Kept only when nothing in the record can change without the dict changing: the
 * values read are immutable (tuples, ints, str), the type comes from the typestr alone (not from a descr
 * list or the object), the data is a (pointer, read_only) pair (not a buffer), and no dtype= was asked.
 * "Unchanged" is the dict's version tag on 3.11 (every change gives a dict a new one, never reused) and a
 * dict watcher on 3.12 and later (a change or the dict's end empties its slot). A dict only this call
 * holds (a property's fresh dict) is never kept: it is about to go. A CAI pointer's device is asked again
 * on every conversion. Off on free-threaded builds, where the slots would need a lock; on 3.12+ off in
 * interpreters other than the main one, and on CPython 3.13.0, whose watchers miss changes (below). */
#ifndef Py_GIL_DISABLED
#define CDL_INTERFACE_CACHE 1
#define CDL_CACHE_SLOTS 4 /* a power of two: a slot is picked by bits of the dict's address */

typedef struct {
    PyObject *dict; /* identity only, no reference; NULL: empty */
#if PY_VERSION_HEX < 0x030C0000
    uint64_t version; /* the dict's version tag when it was read */
#endif
    cdl_source source;
    cdl_array array; /* device fields unset for a CAI: asked again each time */
} cdl_cache_slot;

static cdl_cache_slot cdl_cache[CDL_CACHE_SLOTS];
static Py_ssize_t cdl_cache_hits, cdl_cache_stores;
static int cdl_cache_off; /* _set_interface_cache(False): benchmarks and tests of the uncached path */
#if PY_VERSION_HEX >= 0x030C0000
static int cdl_cache_watcher = -1;                  /* -1: no watcher, nothing is kept */
static PyInterpreterState *cdl_cache_interpreter; /* the watcher's (the main one); others keep and find nothing */
#endif

static inline cdl_cache_slot *cdl_cache_slot_of(PyObject *dict)
{
    return &cdl_cache[((uintptr_t)dict >> 6) & (CDL_CACHE_SLOTS - 1)];
}

uint64_t cdl_cache_version(PyObject *dict)
{
#if PY_VERSION_HEX < 0x030C0000
    return ((PyDictObject *)dict)->ma_version_tag;
#else
    (void)dict;
    return 0; /* the watcher, not a version, says when a dict changed */
#endif
}

#if PY_VERSION_HEX >= 0x030C0000
/* Whether a watcher other than ours watches the dict: its bits are the low 8 of the 64-bit tag after ma_used
 * (ma_version_tag on 3.12 and 3.13, _ma_watcher_tag from 3.14). CPython calls a dict's watchers before the change
 * is made. One called after ours may let the changing thread wait (a callback that runs Python code lets go of
 * the GIL); a reader then reads the state from before, and no event follows the change to drop what it keeps. */
static inline int cdl_cache_others_watch(PyObject *dict)
{
#if PY_VERSION_HEX >= 0x030E0000
    uint64_t tag = ((PyDictObject *)dict)->_ma_watcher_tag;
#else
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
    uint64_t tag = ((PyDictObject *)dict)->ma_version_tag;
#pragma GCC diagnostic pop
#endif
    return (tag & 0xFF & ~(UINT64_C(1) << cdl_cache_watcher)) != 0;
}

/* Any event of a watched dict (a change, a clear, its deallocation) empties its slot. */
static int cdl_cache_on_dict_event(PyDict_WatchEvent event, PyObject *dict, PyObject *key, PyObject *value)
{
    (void)event, (void)key, (void)value;
    cdl_cache_slot *slot = cdl_cache_slot_of(dict);
    if (slot->dict == dict)
        slot->dict = NULL;
    return 0;
}
#endif

int cdl_cache_find(PyObject *dict, cdl_source source, cdl_array *out)
{
    const cdl_cache_slot *slot = cdl_cache_slot_of(dict);
    if (slot->dict != dict || slot->source != source || cdl_cache_off)
        return 0;
#if PY_VERSION_HEX < 0x030C0000
    if (slot->version != cdl_cache_version(dict))
        return 0;
#else
    /* A dict's watched bits name watchers of the interpreter that runs: only the watcher's own sees changes. */
    if (PyInterpreterState_Get() != cdl_cache_interpreter)
        return 0;
#endif
    out->data = slot->array.data;
    out->dtype = slot->array.dtype;
    out->ndim = slot->array.ndim;
    out->read_only = slot->array.read_only;
    out->stream = slot->array.stream;
    memcpy(out->shape, slot->array.shape, (size_t)out->ndim * sizeof(int64_t));
    memcpy(out->strides, slot->array.strides, (size_t)out->ndim * sizeof(int64_t));
    cdl_cache_hits++;
    return 1;
}

/* Whether records are kept here and now: not turned off, and on 3.12+ in the interpreter of a watcher. */
static int cdl_cache_keeps(void)
{
#if PY_VERSION_HEX >= 0x030C0000
    if (cdl_cache_watcher < 0 || PyInterpreterState_Get() != cdl_cache_interpreter)
        return 0;
#endif
    return !cdl_cache_off;
}

void cdl_cache_store(PyObject *dict, cdl_source source, uint64_t version, const cdl_array *arr)
{
    cdl_cache_slot *slot = cdl_cache_slot_of(dict);
    if (!cdl_cache_keeps())
        return;
#if PY_VERSION_HEX < 0x030C0000
    slot->version = version;
#else
    (void)version;
    /* Another watcher's callback may be holding up a change this read missed (above): such a dict is not kept.
     * It is checked here only: a record kept earlier is emptied by our event, which another watcher's wait
     * follows or, for a watcher called before ours, precedes with the old state still the dict's. */
    if (cdl_cache_others_watch(dict))
        return;
    if (slot->dict != NULL && slot->dict != dict && PyDict_Unwatch(cdl_cache_watcher, slot->dict) < 0)
        PyErr_Clear(); /* cannot fail for a live dict and our own watcher; it only stays watched */
    slot->dict = NULL;
    if (PyDict_Watch(cdl_cache_watcher, dict) < 0) {
        PyErr_Clear();
        return;
    }
#endif
    slot->dict = dict;
    slot->source = source;
    slot->array = *arr;
    cdl_cache_stores++;
}
#else /* Py_GIL_DISABLED: nothing is kept */
int cdl_cache_find(PyObject *dict, cdl_source source, cdl_array *out)
{
    (void)dict, (void)source, (void)out;
    return 0;
}

void cdl_cache_store(PyObject *dict, cdl_source source, uint64_t version, const cdl_array *arr)
{
    (void)dict, (void)source, (void)version, (void)arr;
}

uint64_t cdl_cache_version(PyObject *dict)
{
    (void)dict;
    return 0;
}
#endif /* Py_GIL_DISABLED */

int cdl_interface_cache_init(void)
{
#ifdef CDL_INTERFACE_CACHE
    /* A new interpreter (the module is made again after Py_Finalize, or in another interpreter) starts empty:
     * an old interpreter's watchers went before its last dicts did, so its slots may name freed dicts. */
    memset(cdl_cache, 0, sizeof(cdl_cache));
#if PY_VERSION_HEX >= 0x030C0000
    cdl_cache_watcher = -1;
    cdl_cache_interpreter = PyInterpreterState_Get();
    /* Only the main interpreter keeps records. CPython 3.13.0 sends no event for an attribute stored into an
     * object's inline values, which its __dict__ then shows (fixed in 3.13.1): a module built against later
     * 3.13 headers loads there too, so the running version decides. */
    if (cdl_cache_interpreter != PyInterpreterState_Main() || (Py_Version >= 0x030D0000 && Py_Version < 0x030D01F0))
        return 0;
    cdl_cache_watcher = PyDict_AddWatcher(cdl_cache_on_dict_event);
    if (cdl_cache_watcher < 0)
        PyErr_Clear(); /* every watcher id is taken: conversions read every dict afresh */
#endif
#endif
    return 0;
}

PyObject *cdl_interface_cache_info(PyObject *module, PyObject *unused)
{
    (void)module, (void)unused;
    int enabled = 0;
    Py_ssize_t hits = 0, stores = 0;
#ifdef CDL_INTERFACE_CACHE
    enabled = cdl_cache_keeps();
    hits = cdl_cache_hits;
    stores = cdl_cache_stores;
#endif
    return Py_BuildValue("{s:O,s:n,s:n}", "enabled", enabled ? Py_True : Py_False, "hits", hits, "stores", stores);
}

PyObject *cdl_set_interface_cache(PyObject *module, PyObject *enabled)
{
    (void)module;
    int on = PyObject_IsTrue(enabled);
    if (on < 0)
        return NULL;
#ifdef CDL_INTERFACE_CACHE
    cdl_cache_off = !on;
    if (!on)
        memset(cdl_cache, 0, sizeof(cdl_cache)); /* on 3.12+ the dicts stay watched; their events find no slot */
#endif
    return cdl_interface_cache_info(module, NULL);
}
