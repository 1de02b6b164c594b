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
 * A dict only this call holds (a property's fresh dict) is never kept: it is about to go. A CAI pointer's
 * device is asked again on every conversion.
 *
 * "Unchanged" is the dict's version tag: the change itself writes a new one (never reused) as it lands, so a
 * record read before a change is never found after it, whatever ran between the read and the change. Dict
 * watchers were tried for this on 3.12+ and left: CPython calls them before the change, and another watcher's
 * callback that runs Python code lets a reader keep the state from before with no event to come. From 3.14 a
 * dict has no version tag, so nothing is kept there. Nor on 3.12 and 3.13 is a dict over an object's inline
 * values (a split table: ma_values set) kept: an attribute stored into those gives the dict no new tag (3.13.5).
 * From 3.12 only the main interpreter keeps records: the slots are one set for the process, and another
 * interpreter may run beside it under a GIL of its own, with version tags of its own.
 *
 * Free-threaded builds (3.13t): each slot has a spin lock, held only to copy a record in or out. The tag is read
 * inside the dict's critical section before the dict is read (cdl_cache_ticket), so it is the tag of what was
 * read; a find compares it with the dict's tag then. A PyMutex would detach a thread that has to wait for it,
 * which lets go of the critical section it may hold. */
#define CDL_NO_TICKET UINT64_MAX /* no tag reaches it: the dict is not to be kept */

#if PY_VERSION_HEX < 0x030E0000
#define CDL_INTERFACE_CACHE 1
#define CDL_CACHE_SLOTS 4 /* a power of two: a slot is picked by bits of the dict's address */

typedef struct {
    PyObject *dict;   /* identity only, no reference; NULL: empty */
    uint64_t version; /* the dict's version tag when it was read */
#ifdef Py_GIL_DISABLED
    char busy; /* the lock over every field; dict is also read without it, to miss at once */
#endif
    cdl_source source;
    cdl_array array; /* device fields unset for a CAI: asked again each time */
} cdl_cache_slot;

static cdl_cache_slot cdl_cache[CDL_CACHE_SLOTS];
static Py_ssize_t cdl_cache_hits, cdl_cache_stores;
static int cdl_cache_off; /* _set_interface_cache(False): benchmarks and tests of the uncached path */
#if PY_VERSION_HEX >= 0x030C0000
static PyInterpreterState *cdl_cache_interpreter; /* the main one, the only one that keeps and finds records */
#define CDL_CACHE_HERE() (PyInterpreterState_Get() == cdl_cache_interpreter)
#else
#define CDL_CACHE_HERE() 1 /* one GIL and one version counter for every interpreter */
#endif
#ifdef Py_GIL_DISABLED
#define CDL_CACHE_HERE_GIL() 1 /* asked before the lock */
#else
#define CDL_CACHE_HERE_GIL() CDL_CACHE_HERE()
#endif

#ifdef Py_GIL_DISABLED
/* _set_record_store_delay: microseconds each store waits on free-threaded builds, for tests (0: none). */
static long cdl_cache_store_delay;

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
#else
#define CDL_SLOT_LOCK(slot) ((void)0)
#define CDL_SLOT_UNLOCK(slot) ((void)0)
#define CDL_COUNT(counter) ((counter)++)
#endif

static inline cdl_cache_slot *cdl_cache_slot_of(PyObject *dict)
{
    return &cdl_cache[((uintptr_t)dict >> 6) & (CDL_CACHE_SLOTS - 1)];
}

/* The dict's version tag (on 3.12 and 3.13 a deprecated field; its low bits also name the dict's watchers and,
 * on 3.13, count their changes: a tag that moves for those only costs a read afresh). */
static inline uint64_t cdl_dict_tag(PyObject *dict)
{
#if PY_VERSION_HEX >= 0x030C0000
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
#endif
    return __atomic_load_n(&((PyDictObject *)dict)->ma_version_tag, __ATOMIC_ACQUIRE);
#if PY_VERSION_HEX >= 0x030C0000
#pragma GCC diagnostic pop
#endif
}

/* Whether records are kept here and now: not turned off, and from 3.12 in the main interpreter. */
static int cdl_cache_keeps(void)
{
    return CDL_CACHE_HERE() && !__atomic_load_n(&cdl_cache_off, __ATOMIC_ACQUIRE);
}

uint64_t cdl_cache_ticket(PyObject *dict)
{
#if PY_VERSION_HEX >= 0x030C0000
    if (((PyDictObject *)dict)->ma_values != NULL)
        return CDL_NO_TICKET; /* a split table, over an object's inline values on 3.13 (above) */
#endif
    return cdl_dict_tag(dict);
}

#ifdef Py_GIL_DISABLED
/* _set_record_store_delay's wait (tests only; none by default). Detached when holding nothing, so another thread's
 * collection need not wait for it; holding a slot's spin lock it stays attached: a thread spinning on that lock
 * cannot detach, and a stop-the-world would wait for it while the sleeper waited for the stop to end. */
static void cdl_cache_wait(int detach)
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

void cdl_cache_read_wait(void)
{
    cdl_cache_wait(1);
}
#endif

int cdl_cache_find(PyObject *dict, cdl_source source, cdl_array *out)
{
    cdl_cache_slot *slot = cdl_cache_slot_of(dict);
#ifdef Py_GIL_DISABLED
    if (__atomic_load_n(&slot->dict, __ATOMIC_RELAXED) != dict || !CDL_CACHE_HERE())
        return 0; /* a miss without the lock; a find is then checked again under it */
#endif
    int found = 0;
    CDL_SLOT_LOCK(slot);
    if (slot->dict != dict || !CDL_CACHE_HERE_GIL() || slot->source != source ||
        __atomic_load_n(&cdl_cache_off, __ATOMIC_RELAXED) || slot->version != cdl_dict_tag(dict))
        goto done;
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
    if (ticket == CDL_NO_TICKET || !CDL_CACHE_HERE())
        return;
    CDL_SLOT_LOCK(slot);
    /* Keeping turned off, asked only here: cdl_set_interface_cache sets the flag before it empties the slots under
     * their locks, so a store is either refused here or emptied after. */
    if (__atomic_load_n(&cdl_cache_off, __ATOMIC_ACQUIRE)) {
        CDL_SLOT_UNLOCK(slot);
        return;
    }
    slot->source = source;
    slot->array = *arr;
#ifdef Py_GIL_DISABLED
    /* The test hook's second wait, with the record half written (the last record's dict and tag, this one's
     * fields): a find that did not wait for the lock would copy a torn record. */
    cdl_cache_wait(0);
#endif
    slot->version = ticket;
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
#else /* 3.14+: no version tag, nothing is kept */
int cdl_cache_find(PyObject *dict, cdl_source source, cdl_array *out)
{
    (void)dict, (void)source, (void)out;
    return 0;
}

uint64_t cdl_cache_ticket(PyObject *dict)
{
    (void)dict;
    return CDL_NO_TICKET;
}

void cdl_cache_store(PyObject *dict, cdl_source source, uint64_t ticket, const cdl_array *arr)
{
    (void)dict, (void)source, (void)ticket, (void)arr;
}
#endif

int cdl_interface_cache_init(void)
{
#ifdef CDL_INTERFACE_CACHE
    /* A new interpreter (the module is made again after Py_Finalize, or in another interpreter) starts empty:
     * an old interpreter's slots may name its freed dicts. */
#if PY_VERSION_HEX >= 0x030C0000
    if (PyInterpreterState_Get() != PyInterpreterState_Main())
        return 0; /* the main interpreter's records stay its own */
    cdl_cache_interpreter = PyInterpreterState_Get();
#endif
    cdl_cache_clear();
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
        cdl_cache_clear();
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
#if defined(CDL_INTERFACE_CACHE) && defined(Py_GIL_DISABLED)
    __atomic_store_n(&cdl_cache_store_delay, delay, __ATOMIC_RELAXED);
#endif
    Py_RETURN_NONE;
}
