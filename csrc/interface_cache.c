/* The records kept of validated ready interface dicts: a conversion of an unchanged dict reuses what the
 * last one read instead of reading and checking it again. Every rule of when a record is kept, found and
 * dropped is here; cai_to_dlpack.c asks cdl_cache_find before reading a dict and cdl_cache_store after. */
#include "cdl_internal.h"

#include <string.h>
#include <time.h>

/* An object that holds its interface as a ready dict hands the same dict to every conversion. The record
 * read from it is kept, per dict, and reused while the dict is unchanged: reading and checking the dict is
 * most of a conversion. Kept only when nothing in the record can change without the dict changing: the
 * values read are immutable (tuples, ints, str), the type comes from the typestr alone (not from a descr
 * list or the object), the data is a (pointer, read_only) pair (not a buffer), and no dtype= was asked.
 * "Unchanged" is the dict's version tag on 3.11 (every change gives a dict a new one, never reused) and a
 * dict watcher on 3.12 and later (a change or the dict's end empties its slot). A dict only this call
 * holds (a property's fresh dict) is never kept: it is about to go. A CAI pointer's device is asked again
 * on every conversion. On 3.12+ off in interpreters other than the main one, and on CPython 3.13.0, whose
 * watchers miss changes (below).
 *
 * Free-threaded builds: each slot has a lock, and a count of the events of the dicts it may hold. A dict's
 * record is read between one thread's reading of the dict and its store, while another changes the dict: the
 * event (sent before the change is made, inside the dict's critical section) empties the slot, but the store
 * that follows it would keep the state from before the change. So the reader watches the dict and takes the
 * slot's count inside the dict's critical section, before reading it (cdl_cache_ticket), and stores only if the
 * count is unchanged. A slot's lock is a spin lock, held only to copy a record: the event comes inside the
 * critical section of the dict that changes, and a PyMutex that has to wait detaches the thread, which lets go
 * of that section halfway through a change (dict.update sends an event per key), for another thread to read
 * the dict half changed. */
#define CDL_INTERFACE_CACHE 1
#define CDL_CACHE_SLOTS 4 /* a power of two: a slot is picked by bits of the dict's address */

typedef struct {
    PyObject *dict; /* identity only, no reference; NULL: empty */
#if PY_VERSION_HEX < 0x030C0000
    uint64_t version; /* the dict's version tag when it was read */
#endif
#ifdef Py_GIL_DISABLED
    char busy;        /* the lock over every field; dict is also read without it, to miss at once */
    uint64_t changes; /* events of any dict of this slot: a store's ticket is this count when it read its dict */
#endif
    cdl_source source;
    cdl_array array; /* device fields unset for a CAI: asked again each time */
} cdl_cache_slot;

static cdl_cache_slot cdl_cache[CDL_CACHE_SLOTS];
static Py_ssize_t cdl_cache_hits, cdl_cache_stores;
static int cdl_cache_off; /* _set_interface_cache(False): benchmarks and tests of the uncached path */
/* _set_record_store_delay: microseconds each store waits on free-threaded builds, for tests (0: none). */
static long cdl_cache_store_delay;
#if PY_VERSION_HEX >= 0x030C0000
static int cdl_cache_watcher = -1;                  /* -1: no watcher, nothing is kept */
static PyInterpreterState *cdl_cache_interpreter; /* the watcher's (the main one); others keep and find nothing */
#endif

#ifdef Py_GIL_DISABLED
static inline void cdl_slot_lock(cdl_cache_slot *slot)
{
    while (__atomic_exchange_n(&slot->busy, 1, __ATOMIC_ACQUIRE)) {
        while (__atomic_load_n(&slot->busy, __ATOMIC_RELAXED)) {
#if defined(__x86_64__) || defined(__i386__)
            __builtin_ia32_pause();
#elif defined(__aarch64__)
            __asm__ __volatile__("yield");
#endif
        }
    }
}
#define CDL_SLOT_LOCK(slot) cdl_slot_lock(slot)
#define CDL_SLOT_UNLOCK(slot) __atomic_store_n(&(slot)->busy, 0, __ATOMIC_RELEASE)
#define CDL_COUNT(counter) __atomic_fetch_add(&(counter), 1, __ATOMIC_RELAXED)
/* A ticket no count reaches: the dict could not be watched, or records are not kept. */
#define CDL_NO_TICKET UINT64_MAX
#else
#define CDL_SLOT_LOCK(slot) ((void)0)
#define CDL_SLOT_UNLOCK(slot) ((void)0)
#define CDL_COUNT(counter) ((counter)++)
#endif

static inline cdl_cache_slot *cdl_cache_slot_of(PyObject *dict)
{
    return &cdl_cache[((uintptr_t)dict >> 6) & (CDL_CACHE_SLOTS - 1)];
}

/* Whether records are kept here and now: not turned off, and on 3.12+ in the interpreter of a watcher. */
static int cdl_cache_keeps(void)
{
#if PY_VERSION_HEX >= 0x030C0000
    if (cdl_cache_watcher < 0 || PyInterpreterState_Get() != cdl_cache_interpreter)
        return 0;
#endif
    return !__atomic_load_n(&cdl_cache_off, __ATOMIC_RELAXED);
}

#if PY_VERSION_HEX >= 0x030C0000
/* Whether a watcher other than ours watches the dict: its bits are the low 8 of the 64-bit tag after ma_used
 * (ma_version_tag on 3.12 and 3.13, _ma_watcher_tag from 3.14). CPython calls a dict's watchers before the change
 * is made. One called after ours may let the changing thread wait (a callback that runs Python code lets go of
 * the GIL, or on free-threaded builds detaches and so suspends the dict's critical section); a reader then reads
 * the state from before, and no event follows the change to drop what it keeps. Such a dict is never kept. A
 * record kept before another watcher came is still safe: our event empties it, and another watcher's wait either
 * follows that event or, for a watcher called before ours, comes while the old state is still the dict's. */
static inline int cdl_cache_others_watch(PyObject *dict)
{
#if PY_VERSION_HEX >= 0x030E0000
    uint64_t tag = __atomic_load_n(&((PyDictObject *)dict)->_ma_watcher_tag, __ATOMIC_RELAXED);
#else
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
    uint64_t tag = __atomic_load_n(&((PyDictObject *)dict)->ma_version_tag, __ATOMIC_RELAXED);
#pragma GCC diagnostic pop
#endif
    return (tag & 0xFF & ~(UINT64_C(1) << cdl_cache_watcher)) != 0;
}
#endif

uint64_t cdl_cache_ticket(PyObject *dict)
{
#if PY_VERSION_HEX < 0x030C0000
    return ((PyDictObject *)dict)->ma_version_tag;
#elif defined(Py_GIL_DISABLED)
    /* Watched from here on (inside its critical section: a change writes the same word), so every change after
     * this read sends the event that moves the count. */
    if (!cdl_cache_keeps() || cdl_cache_others_watch(dict))
        return CDL_NO_TICKET;
    if (PyDict_Watch(cdl_cache_watcher, dict) < 0) {
        PyErr_Clear(); /* cannot fail for a dict and our own watcher */
        return CDL_NO_TICKET;
    }
    return __atomic_load_n(&cdl_cache_slot_of(dict)->changes, __ATOMIC_ACQUIRE);
#else
    (void)dict;
    return 0; /* the watcher, not a version, says when a dict changed */
#endif
}

#ifdef Py_GIL_DISABLED
/* _set_record_store_delay's wait (tests only; none by default). Detached when holding nothing, so another thread's
 * collection need not wait for it; holding a slot's spin lock it stays attached: a thread spinning on that lock
 * cannot detach, and a stop-the-world would wait for it while the sleeper waited for the stop to end. */
static void cdl_cache_store_wait(int detach)
{
    const long delay = __atomic_load_n(&cdl_cache_store_delay, __ATOMIC_RELAXED);
    if (delay > 0) {
        struct timespec wait = {delay / 1000000, delay % 1000000 * 1000};
        if (detach) {
            Py_BEGIN_ALLOW_THREADS
            nanosleep(&wait, NULL);
            Py_END_ALLOW_THREADS
        }
        else
            nanosleep(&wait, NULL);
    }
}
#endif

#if PY_VERSION_HEX >= 0x030C0000
/* Any event of a watched dict (a change, a clear, its deallocation) empties its slot. */
static int cdl_cache_on_dict_event(PyDict_WatchEvent event, PyObject *dict, PyObject *key, PyObject *value)
{
    (void)event, (void)key, (void)value;
    cdl_cache_slot *slot = cdl_cache_slot_of(dict);
    CDL_SLOT_LOCK(slot);
    if (slot->dict == dict)
        __atomic_store_n(&slot->dict, NULL, __ATOMIC_RELAXED);
#ifdef Py_GIL_DISABLED
    __atomic_store_n(&slot->changes, slot->changes + 1, __ATOMIC_RELEASE);
#endif
    CDL_SLOT_UNLOCK(slot);
    return 0;
}
#endif

int cdl_cache_find(PyObject *dict, cdl_source source, cdl_array *out)
{
    cdl_cache_slot *slot = cdl_cache_slot_of(dict);
    if (__atomic_load_n(&slot->dict, __ATOMIC_RELAXED) != dict)
        return 0;
#if PY_VERSION_HEX >= 0x030C0000
    /* A dict's watched bits name watchers of the interpreter that runs: only the watcher's own sees changes. */
    if (PyInterpreterState_Get() != cdl_cache_interpreter)
        return 0;
#endif
    int found = 0;
    CDL_SLOT_LOCK(slot);
    if (slot->dict != dict || slot->source != source || __atomic_load_n(&cdl_cache_off, __ATOMIC_RELAXED))
        goto done;
#if PY_VERSION_HEX < 0x030C0000
    if (slot->version != cdl_cache_ticket(dict))
        goto done;
#endif
    out->data = slot->array.data;
    out->dtype = slot->array.dtype;
    out->ndim = slot->array.ndim;
    out->read_only = slot->array.read_only;
    out->stream = slot->array.stream;
    memcpy(out->shape, slot->array.shape, (size_t)out->ndim * sizeof(int64_t));
    memcpy(out->strides, slot->array.strides, (size_t)out->ndim * sizeof(int64_t));
    CDL_COUNT(cdl_cache_hits);
    found = 1;
done:
    CDL_SLOT_UNLOCK(slot);
    return found;
}

void cdl_cache_store(PyObject *dict, cdl_source source, uint64_t ticket, const cdl_array *arr)
{
    cdl_cache_slot *slot = cdl_cache_slot_of(dict);
    if (!cdl_cache_keeps())
        return;
#if PY_VERSION_HEX < 0x030C0000
    slot->version = ticket;
#elif defined(Py_GIL_DISABLED)
    /* The test hook's wait, before the lock and again inside it: a change may land between the read and the
     * ticket's check, and (an event that did not take the lock) between the check and the store. */
    cdl_cache_store_wait(1);
    /* The dict stays watched when its record goes: another's unwatch would write its watched bits outside its
     * critical section. Its later changes cost an event that finds no slot. */
    CDL_SLOT_LOCK(slot);
    /* Keeping turned off since cdl_cache_keeps() was asked: cdl_set_interface_cache sets the flag before it
     * empties the slots under their locks, so a store is either refused here or emptied after. */
    if (ticket != slot->changes || __atomic_load_n(&cdl_cache_off, __ATOMIC_ACQUIRE)) {
        CDL_SLOT_UNLOCK(slot);
        return; /* the dict may have changed since it was read (or could not be watched) */
    }
    cdl_cache_store_wait(0);
#else
    (void)ticket;
    if (cdl_cache_others_watch(dict))
        return; /* another watcher's callback may hold up a change this read missed (above) */
    if (slot->dict != NULL && slot->dict != dict && PyDict_Unwatch(cdl_cache_watcher, slot->dict) < 0)
        PyErr_Clear(); /* cannot fail for a live dict and our own watcher; it only stays watched */
    slot->dict = NULL;
    if (PyDict_Watch(cdl_cache_watcher, dict) < 0) {
        PyErr_Clear();
        return;
    }
#endif
    slot->source = source;
    slot->array = *arr;
    __atomic_store_n(&slot->dict, dict, __ATOMIC_RELAXED);
    CDL_COUNT(cdl_cache_stores);
    CDL_SLOT_UNLOCK(slot);
}

/* Empties every slot (a new interpreter, or keeping turned off). */
static void cdl_cache_clear(void)
{
    for (int i = 0; i < CDL_CACHE_SLOTS; i++) {
        cdl_cache_slot *slot = &cdl_cache[i];
        CDL_SLOT_LOCK(slot);
        __atomic_store_n(&slot->dict, NULL, __ATOMIC_RELAXED);
        CDL_SLOT_UNLOCK(slot);
    }
}

int cdl_interface_cache_init(void)
{
#ifdef CDL_INTERFACE_CACHE
    /* A new interpreter (the module is made again after Py_Finalize, or in another interpreter) starts empty:
     * an old interpreter's watchers went before its last dicts did, so its slots may name freed dicts. */
    cdl_cache_clear();
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
    hits = __atomic_load_n(&cdl_cache_hits, __ATOMIC_RELAXED);
    stores = __atomic_load_n(&cdl_cache_stores, __ATOMIC_RELAXED);
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
    __atomic_store_n(&cdl_cache_off, !on, __ATOMIC_RELEASE);
    if (!on)
        cdl_cache_clear(); /* on 3.12+ the dicts stay watched; their events find no slot */
#endif
    return cdl_interface_cache_info(module, NULL);
}

PyObject *cdl_set_record_store_delay(PyObject *module, PyObject *microseconds)
{
    (void)module;
    long delay = PyLong_AsLong(microseconds);
    if (delay == -1 && PyErr_Occurred())
        return NULL;
    if (delay < 0 || delay > 1000000) {
        PyErr_Format(PyExc_ValueError, "_set_record_store_delay: microseconds must be 0 to 1000000, not %ld", delay);
        return NULL;
    }
    __atomic_store_n(&cdl_cache_store_delay, delay, __ATOMIC_RELAXED);
    Py_RETURN_NONE;
}
