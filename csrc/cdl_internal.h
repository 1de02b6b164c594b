/* Declarations shared by the files of the C core: the neutral array record that both directions
 * pass through, and the entry points each csrc/ file offers the others. Nothing here is exported. */
#ifndef CDL_INTERNAL_H
#define CDL_INTERNAL_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <cai_dlpack/dlpack_abi.h> /* ours, or <dlpack/dlpack.h> when built with DLPACK_INCLUDE_DIR */
#include <stdint.h>

/* The most dimensions an array may have (NumPy's limit); keeps a record on the stack. */
#define CDL_MAX_NDIM 64

/* Consumer stream values of the array API: -1 asks for no synchronization; None means the
 * legacy default stream, which is 1 (cudaStreamLegacy). */
#define CDL_STREAM_NO_SYNC (-1)
#define CDL_STREAM_LEGACY 1
#define CDL_STREAM_PER_THREAD 2

#if PY_VERSION_HEX >= 0x030D0000
#define cdl_interpreter_finalizing() Py_IsFinalizing()
#define cdl_lookup_attribute PyObject_GetOptionalAttr
#else
#define cdl_interpreter_finalizing() _Py_IsFinalizing()
/* 1 with *result set, 0 when absent (no AttributeError built), -1 on error. */
#define cdl_lookup_attribute _PyObject_LookupAttr
#endif

/* type.<name> through its MRO as a new reference, or NULL when absent (never an exception: name is an
 * interned str). _PyType_Lookup's result is borrowed from the type's dict, which another thread may change
 * (freeing it) on a free-threaded build: anything read from the result holds it, through the interpreter's
 * own safe lookup on 3.13+ (the GIL keeps it alive before). Asking only whether a name is there
 * (_PyType_Lookup(...) != NULL, the pointer never read) is safe as it is. */
static inline PyObject *cdl_type_lookup(PyTypeObject *type, PyObject *name)
{
#if PY_VERSION_HEX >= 0x030D0000
    return _PyType_LookupRef(type, name);
#else
    return Py_XNewRef(_PyType_Lookup(type, name));
#endif
}

/* A critical section on one object (3.13+): without the GIL, a list, dict or capsule another thread may change
 * is read whole or not at all. With the GIL (and before 3.13) a plain block. Never left by return or goto. */
#if PY_VERSION_HEX >= 0x030D0000
#define CDL_BEGIN_CRITICAL_SECTION(object) Py_BEGIN_CRITICAL_SECTION(object)
#define CDL_END_CRITICAL_SECTION() Py_END_CRITICAL_SECTION()
#else
#define CDL_BEGIN_CRITICAL_SECTION(object) {
#define CDL_END_CRITICAL_SECTION() }
#endif

/* An exception set before code that may clear or replace it (a deleter, a runtime load), put back after. */
typedef struct {
#if PY_VERSION_HEX >= 0x030C0000
    PyObject *raised;
#else
    PyObject *type, *value, *traceback;
#endif
} cdl_pending_error;

static inline void cdl_error_stash(cdl_pending_error *pending)
{
#if PY_VERSION_HEX >= 0x030C0000
    pending->raised = PyErr_GetRaisedException();
#else
    PyErr_Fetch(&pending->type, &pending->value, &pending->traceback);
#endif
}

static inline void cdl_error_unstash(cdl_pending_error *pending)
{
#if PY_VERSION_HEX >= 0x030C0000
    PyErr_SetRaisedException(pending->raised);
#else
    PyErr_Restore(pending->type, pending->value, pending->traceback);
#endif
}

/* Drops a stashed exception that is no longer wanted. */
static inline void cdl_error_discard(cdl_pending_error *pending)
{
#if PY_VERSION_HEX >= 0x030C0000
    Py_XDECREF(pending->raised);
#else
    Py_XDECREF(pending->type);
    Py_XDECREF(pending->value);
    Py_XDECREF(pending->traceback);
#endif
}

/* One array as both protocols see it. Fields follow DLTensor; strides are in elements and are
 * always explicit. */
typedef struct {
    void *data;                      /* first element; any byte offset already folded in */
    DLDataType dtype;
    int32_t ndim;
    int64_t shape[CDL_MAX_NDIM];
    int64_t strides[CDL_MAX_NDIM];
    DLDevice device;
    /* The device the legacy and per-thread streams of this memory are ordered on: device.device_id,
     * except for pinned and managed memory, whose DLPack device_id is 0 (any device may use them),
     * where it is the device CUDA reports the allocation under. */
    int32_t home_device;
    int read_only;
    int64_t stream;                  /* producer's CAI stream; 0 means none was given */
} cdl_array;

/* Element strides of a C-contiguous array of this shape (a dimension of 0 or 1 advances nothing).
 * Returns 0, or -1 when they overflow 64 bits (the strides then wrap: no undefined behaviour). */
static inline int cdl_contiguous_strides(int32_t ndim, const int64_t *shape, int64_t *strides)
{
    int64_t stride = 1;
    int overflow = 0;
    for (int32_t i = ndim - 1; i >= 0; i--) {
        strides[i] = stride;
        overflow |= __builtin_mul_overflow(stride, shape[i] > 1 ? shape[i] : 1, &stride);
    }
    return overflow ? -1 : 0;
}

/* Which protocol a dict came from: a CAI dict describes device memory, an array interface
 * (NumPy's __array_interface__) host memory. */
typedef enum { CDL_SOURCE_CAI, CDL_SOURCE_ARRAY_INTERFACE } cdl_source;

/* (device_type, device_id) as a tuple. */
static inline PyObject *cdl_device_tuple(DLDevice device)
{
    return Py_BuildValue("(ii)", (int)device.device_type, (int)device.device_id);
}

/* Where a conversion's element count and byte extent lie, relative to its first element. */
typedef enum {
    CDL_EXTENT_OK,             /* low and high are set */
    CDL_EXTENT_EMPTY,          /* no elements: nothing is reached */
    CDL_EXTENT_COUNT_OVERFLOW, /* the element count does not fit in 64 bits */
    CDL_EXTENT_OVERFLOW,       /* the byte extent does not fit in 64 bits */
} cdl_extent_status;

/* The bytes [low, high) an array reaches from its data pointer (low <= 0 < high), in one pass over the
 * dimensions. A count that overflows is reported before an extent that does; an extent that overflows
 * matters only when the array has elements. */
static inline cdl_extent_status cdl_measure_extent(const cdl_array *arr, int64_t itemsize, int64_t *low,
                                                   int64_t *high)
{
    int64_t count = 1;
    int count_overflow = 0, extent_overflow = 0;
    *low = *high = 0;
    for (int32_t i = 0; i < arr->ndim; i++) {
        int64_t step;
        count_overflow |= __builtin_mul_overflow(count, arr->shape[i], &count);
        extent_overflow |= __builtin_mul_overflow(arr->shape[i] - 1, arr->strides[i], &step) ||
                           __builtin_mul_overflow(step, itemsize, &step) ||
                           (step < 0 ? __builtin_add_overflow(*low, step, low)
                                     : __builtin_add_overflow(*high, step, high));
    }
    if (count_overflow)
        return CDL_EXTENT_COUNT_OVERFLOW;
    if (count == 0)
        return CDL_EXTENT_EMPTY;
    if (extent_overflow || __builtin_add_overflow(*high, itemsize, high))
        return CDL_EXTENT_OVERFLOW;
    return CDL_EXTENT_OK;
}

/* Whether the bytes [low, high) around address lie inside the address space. */
static inline int cdl_extent_fits(uintptr_t address, int64_t low, int64_t high)
{
    return !(0 - (uint64_t)low > address || (uint64_t)high - 1 > UINTPTR_MAX - address);
}

/* names.c: the strings, argument parsing and error type every file shares ----------------------------------- */
/* The slots of the keys the fused dict reader takes (cai_to_dlpack.c), in the order CuPy's ndarray builds its dict
 * (cupy/_core/core.pyx): each key is first compared with the one after the last found, one comparison per key for
 * CuPy's dicts, then with the others. (The descr is found only to be passed over: a typestr alone names the type.) */
enum { CDL_FRESH_SHAPE, CDL_FRESH_TYPESTR, CDL_FRESH_DESCR, CDL_FRESH_STREAM, CDL_FRESH_VERSION, CDL_FRESH_STRIDES,
       CDL_FRESH_DATA, CDL_FRESH_KEYS };
/* Interned strings for the keys and attribute names read on hot paths. */
typedef struct {
    PyObject *shape, *typestr, *data, *strides, *version, *mask, *stream, *offset, *descr;
    PyObject *cuda_array_interface, *array_interface, *dlpack, *dlpack_device;
    PyObject *max_version, *dl_device, *copy, *owner, *sync, *export_stream, *trust_streams, *dtype, *name, *cuda_stream, *obj;
    PyObject *exchange_api, *exchange_api_address; /* DLPack 1.3's capsule and 1.2's int on a type */
    PyObject *requires_grad, *is_conj, *is_neg;     /* what torch's __dlpack__ checks and its table does not */
    /* The fused reader's key names by the CDL_FRESH_ slots above, then NULL, which no key is. */
    PyObject *fresh_keys[CDL_FRESH_KEYS + 1];
} cdl_names;
extern cdl_names cdl_name;
/* cai_dlpack.UnsupportedArrayError (a BufferError and a ValueError): valid data that DLPack, or an array
 * interface, cannot describe. Malformed arguments and interfaces raise TypeError / ValueError. */
extern PyObject *cdl_UnsupportedError;
int cdl_names_init(void);
/* Keyword-only argument parsing for vectorcall methods: names[i] matched into values[i]
 * (borrowed; untouched when absent). Returns 0, or -1 with TypeError. */
int cdl_parse_keywords(const char *func, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames,
                       Py_ssize_t npositional, PyObject *const *names, PyObject **values, int count);
/* The keywords of __dlpack__ (stream, max_version, dl_device, copy) into values[0..3], values cleared first. */
int cdl_parse_dlpack_keywords_general(PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames, PyObject **values);
static inline int cdl_parse_dlpack_keywords(PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames,
                                            PyObject **values)
{
    /* torch.from_dlpack's call for host memory, __dlpack__(max_version=...), inline: no call, no frame. */
    if (nargs == 0 && kwnames != NULL && PyTuple_GET_SIZE(kwnames) == 1 &&
        PyTuple_GET_ITEM(kwnames, 0) == cdl_name.max_version) {
        values[0] = values[2] = values[3] = NULL;
        values[1] = args[0];
        return 0;
    }
    return cdl_parse_dlpack_keywords_general(args, nargs, kwnames, values);
}

/* dtype.c: every fact about element types (and DLPack's names of codes) ------------------------------------------------------- */
/* Returns 0 with *out filled, or -1 naming where (the interface) and the typestr: TypeError for a non-str,
 * UnsupportedArrayError for a type DLPack cannot describe. */
int cdl_parse_typestr(PyObject *typestr, const char *where, DLDataType *out);
/* cdl_parse_typestr of a compact ASCII str (the caller checks), without an exception and without calling into
 * anything (three characters by a table, else split): 0 with *out filled, or -1 where the parser would refuse
 * (and say why). */
int cdl_name_ascii_typestr(PyObject *typestr, DLDataType *out);
/* The type of an interface: its typestr, or for a type no typestr names (bfloat16, float8, ...), the
 * name in its one-field descr or the name of obj's NumPy dtype (obj may be NULL); requested (NULL: none)
 * is the caller's dtype= and wins, if the typestr's item size matches. Returns 0 for a type the typestr
 * alone names, 1 for one from the descr, obj or requested, or -1 as cdl_parse_typestr, or ValueError for
 * a requested type of another size. */
int cdl_parse_interface_dtype(PyObject *typestr, PyObject *descr, PyObject *obj, const DLDataType *requested,
                              const char *where, DLDataType *out);
/* A dtype= argument (a name, a NumPy / ml_dtypes dtype or type, a torch.dtype) as a DLPack type; 0, or -1
 * with ValueError naming it. */
int cdl_dtype_from_request(PyObject *requested, DLDataType *out);
/* Whether dtype is a type no typestr names, whose interfaces carry a descr [(name, typestr)]. */
int cdl_dtype_is_named(DLDataType dtype);
/* That descr, a new list each call (its receiver may change it), or NULL with an exception. */
PyObject *cdl_descr_new(DLDataType dtype);
/* The type of one native-order item of a buffer-protocol format (NULL: plain bytes) of itemsize bytes:
 * 0, or -1 (no exception set) when the table has none. */
int cdl_dtype_from_format(const char *format, Py_ssize_t itemsize, DLDataType *out);
/* The buffer-protocol format of dtype (native order and sizes), or NULL when the table has none. */
const char *cdl_format_from_dtype(DLDataType dtype);
/* The table's name of dtype ("bfloat16", "float32", ...). */
const char *cdl_name_of_dtype(DLDataType dtype);
/* The specification's name of a DLDataTypeCode ("kDLBcomplex") or a DLDeviceType ("kDLTPU"), for messages;
 * "an unknown code" / "an unknown device type" for a value DLPack 1.4 does not define. */
const char *cdl_type_code_name(int code);
const char *cdl_device_type_name(int device_type);
/* Returns a new reference to the typestr of dtype, or NULL with UnsupportedArrayError naming code/bits/lanes. */
PyObject *cdl_typestr_from_dtype(DLDataType dtype);
/* 0 when an array interface can describe dtype, else -1 with the UnsupportedArrayError above. */
int cdl_check_dtype(DLDataType dtype);
/* Bytes per element of a dtype the table knows. */
static inline int64_t cdl_itemsize(DLDataType dtype) { return ((int64_t)dtype.bits * dtype.lanes + 7) / 8; }
int cdl_dtype_init(void);

/* cuda_runtime.c: the runtime opened at run time, device scopes, CUDA errors -------------------- */
/* A lock for state that threads share without the GIL (free-threaded builds; deleters and the exchange
 * allocator on any thread): the runtime table's publication here, the event pool in stream_sync.c. It
 * is held only around C code and CUDA calls, never while calling into Python or taking the GIL, so it
 * cannot deadlock against either. PyMutex from 3.13 (a waiter detaches from the interpreter, so a
 * free-threaded stop-the-world pause is not held up), a POSIX mutex before. */
#if PY_VERSION_HEX >= 0x030D0000
typedef PyMutex cdl_lock;
#define CDL_LOCK_INITIALIZER {0}
static inline void cdl_lock_acquire(cdl_lock *lock) { PyMutex_Lock(lock); }
static inline void cdl_lock_release(cdl_lock *lock) { PyMutex_Unlock(lock); }
#else
#include <pthread.h>
typedef pthread_mutex_t cdl_lock;
#define CDL_LOCK_INITIALIZER PTHREAD_MUTEX_INITIALIZER
static inline void cdl_lock_acquire(cdl_lock *lock) { (void)pthread_mutex_lock(lock); }
static inline void cdl_lock_release(cdl_lock *lock) { (void)pthread_mutex_unlock(lock); }
#endif
/* cai_dlpack.CudaError: CUDA runtime failures (made by cdl_cuda_errors_init). */
extern PyObject *cdl_CudaError;
int cdl_cuda_errors_init(void);
/* Fills *device from the runtime's pointer attributes of ptr (the current device for NULL), with
 * device_id 0 for pinned and managed memory as DLPack asks, and *home with the device CUDA reports.
 * Returns 0, or -1 with an exception set (runtime missing, CUDA error, memory CUDA does not know). */
int cdl_device_of_pointer(const void *ptr, DLDevice *device, int32_t *home);
/* Sets cdl_CudaError for a failed runtime call and clears the runtime's last error. Returns -1. */
__attribute__((noinline)) int cdl_raise_cuda_error(const char *call, int code);
/* Function table of the loaded runtime; NULL with RuntimeError saying what was searched. Threads may
 * search at once; the first runtime published is the one every thread uses from then on. */
struct cdl_cudart;
const struct cdl_cudart *cdl_cudart_get(void);
/* The runtime if it is already loaded, else NULL; touches no Python state (any thread, no GIL). */
const struct cdl_cudart *cdl_cudart_loaded(void);
/* The runtime, loaded now if need be (taking the GIL for it); NULL when there is none. Any thread;
 * sets no exception, and one already pending survives. */
const struct cdl_cudart *cdl_cudart_get_any_thread(void);
PyObject *cdl_cuda_runtime_info(PyObject *module, PyObject *unused);

/* exchange_alloc.c: tensors the DLPack exchange API asks us to make ------------------------------ */
/* DLPackExchangeAPI.managed_tensor_allocator: a C-contiguous tensor like prototype on its device.
 * Runs without the GIL; errors go through set_error. */
int cdl_exchange_allocate(DLTensor *prototype, DLManagedTensorVersioned **out, void *error_ctx,
                          void (*set_error)(void *error_ctx, const char *kind, const char *message));

/* stream_sync.c: ordering a producer's stream before a consumer's -------------------------------- */
/* Process-wide switches of the CAI spec's opt-outs; atomic, since options() may set them while other
 * threads convert (a plain read is an atomic load). */
extern _Atomic int cdl_option_sync;            /* 0: consumers ignore producer streams */
extern _Atomic int cdl_option_export_stream;   /* 0: producers export "stream": None */
extern _Atomic int cdl_option_trust_streams;   /* 1: a stream named by handle outlives what was made for it */
/* Parses a stream value named what: a consumer's argument (None -> 1, -1, 1, 2, a handle, or an object
 * of the CUDA stream protocol, __cuda_stream__() -> (version, handle), a NULL handle -> 1) when
 * consumer is 1, a CAI 'stream' entry (None -> 0, 1, 2 or a handle) when 0. Returns 0 or -1. */
int cdl_parse_stream(PyObject *value, const char *what, int consumer, int64_t *out);
/* cdl_order_streams where two streams may be involved: everything it does past its inline answers. */
__attribute__((noinline)) int cdl_order_streams_by_runtime(const cdl_array *arr, int64_t consumer);
/* Orders the consumer stream after arr's producer stream on its device, host not blocked (nothing to do
 * for an array without elements). Inside CUDA graph captures it does what the README's table says: a
 * wait inside one capture, an external wait for work made outside the consumer's capture, or CudaError
 * naming the capture where no ordering keeps it whole (nothing is then called that would break it).
 * Returns 0, or -1 with an exception set; the caller's current device is unchanged either way. */
static inline int cdl_order_streams(const cdl_array *arr, int64_t consumer)
{
    /* What needs no runtime call is answered inline, since most conversions end here (no ordering asked, host
     * data, or the producer's own stream): the call would cost more than the answer. One handle is one stream
     * except a legacy or per-thread handle for pinned or managed memory, which names the caller's device's
     * stream (cdl_order_streams_by_runtime says why). */
    const int64_t producer = arr->stream;
    const DLDeviceType type = arr->device.device_type;
    if (!cdl_option_sync || producer == 0 || consumer == CDL_STREAM_NO_SYNC || type == kDLCPU)
        return 0;
    if (producer == consumer &&
        (type == kDLCUDA || (consumer != CDL_STREAM_LEGACY && consumer != CDL_STREAM_PER_THREAD)))
        return 0;
    return cdl_order_streams_by_runtime(arr, consumer);
}
/* The stream a view exports in its CAI (0 for None): stream, or 0 while it is capturing a graph (or is the
 * legacy stream and a blocking stream of device captures), since CAI consumers synchronize the stream they
 * are given and a capture forbids that. One capture query; none for stream 0 or host memory. 0 or -1. */
int cdl_stream_to_export(int64_t stream, DLDevice device, int64_t *out);
/* The consumer stream a DLPackView was made for, kept so that any thread, on any current device, waits for
 * that stream, not for the one its handle names there: 1 and 2 name the legacy / per-thread default stream of
 * a device (the data's; for pinned and managed memory the caller's current one) and 2 that of the calling
 * thread. Decided when the view is made, after its producer was ordered before the stream. */
typedef struct {
    int64_t stream;             /* the view's stream when a host read must wait for it; 0: for nothing */
    int32_t device;             /* the device whose stream the handles 1 and 2 named */
    unsigned long long thread;  /* for 2, the making thread's serial; else 0 */
    void *event;                /* for 2, a cudaEvent_t recorded on that stream when the view was made (NULL
                                 * while it captured a graph): what other threads wait for; else NULL */
} cdl_view_stream;
/* Fills point for a view of arr made for consumer (stream 0 when nothing orders it: -1, sync=False, host
 * memory, no elements). 0, or -1 with an exception (nothing to clear). */
int cdl_view_stream_set(cdl_view_stream *point, int64_t consumer, const cdl_array *arr);
/* Destroys point's event, if any. Any thread. */
void cdl_view_stream_clear(cdl_view_stream *point);
/* Before a re-export: on a thread other than the one that made a per-thread-stream view, this thread's
 * per-thread stream waits for the view's event and *producer becomes 2 (this thread's); BufferError where
 * there is no event. Nothing elsewhere. 0 or -1. */
int cdl_view_stream_join(const cdl_view_stream *point, int64_t *producer);
/* Makes a host read of device-accessible memory (pinned, managed) safe: waits (host blocked, GIL released) for
 * point's stream, on which a DLPackView's producer made the data ready, since host readers (the array
 * interface, the buffer protocol, a host consumer's __dlpack__) know no stream: its event where it has one,
 * else the stream in the device it was made for. Nothing for stream 0 or host memory; CudaError, nothing
 * called, while the stream captures a graph. 0 or -1. */
int cdl_wait_for_host_read(const cdl_view_stream *point, DLDevice device);
/* Refuses the legacy default stream of a device (device_type, device_id as DLPack gives them; the caller's
 * device for pinned and managed memory) with CudaError naming what (for example "the exchange API's work
 * stream is") while a blocking stream there captures a graph. 0 or -1. */
int cdl_check_legacy_stream(DLDeviceType device_type, int32_t device_id, const char *what);
/* Whether the legacy default stream of the caller's current device is unusable now (a blocking stream there
 * captures a graph): 1 or 0, or -1 with an exception. Asks only a runtime already loaded (none: 0). */
int cdl_legacy_stream_unusable(void);
/* The exchange API's current work stream of a device: NULL (the legacy default stream) for CUDA memory,
 * or -1 with CudaError while a blocking stream of that device captures a graph (launching on the legacy
 * stream would invalidate the capture); NULL without a call for other devices. */
int cdl_current_work_stream(DLDeviceType device_type, int32_t device_id, void **out);
/* The calling thread's serial: a number no other thread of the process ever has, unlike its ident, which
 * the OS reuses once a thread exits. Never 0. */
unsigned long long cdl_thread_serial(void);
void cdl_stream_options_init(void);
PyObject *cdl_options(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames);

/* ordered_release.c: releases ordered after a consumer's stream ------------------------------------ */
/* Where a release is ordered: after the work queued so far on a consumer's stream. stream 0: at once. */
typedef struct {
    int64_t stream;             /* the consumer's stream (1, 2 or a handle), or 0 for none */
    int32_t device;             /* the device whose primary context the handles 1 and 2 are taken in */
    unsigned long long thread;  /* for stream 2, the serial of the thread whose per-thread stream it is */
} cdl_release_point;
/* How many releases may wait for their events; past that the oldest waits for its event (the README). */
#define CDL_PENDING_LIMIT 1024
/* A release of memory a consumer may still use: called once, on any thread, with or without the GIL. */
typedef void (*cdl_release_fn)(void *argument);
/* The point after a conversion of arr with consumer stream consumer: none for -1, host memory, an array
 * without elements, a runtime without events, or ordered release switched off. Any thread. */
void cdl_release_point_set(cdl_release_point *point, int64_t consumer, const cdl_array *arr);
/* The release point of what is made for a consumer and dropped later: as cdl_release_point_set, except that a
 * stream named by handle counts only under trust_streams (the handle may be dead by the drop). */
void cdl_release_point_for_drop(cdl_release_point *point, int64_t consumer, const cdl_array *arr);
/* Whether stream is a handle that nothing may use after the call that received it: one not covered by the
 * caller's promise (trust_streams). The legacy and per-thread streams never go. */
static inline int cdl_handle_untrusted(int64_t stream)
{
    return stream > CDL_STREAM_PER_THREAD && !cdl_option_trust_streams;
}
/* Calls release(argument) once an event recorded now on point's stream has completed: at a later conversion,
 * release or pending call of the interpreter (scheduled also when the stream reaches the event), never waiting
 * for the device (but past CDL_PENDING_LIMIT, where the oldest pending release with an event waits, and stays
 * pending if the wait is refused). While point's stream captures a graph the event is recorded by the first
 * collection that finds it outside the capture. At once where nothing is to be waited for: point's stream is
 * 0, or the runtime refuses the event. Any thread, with or without the GIL, also while the interpreter shuts
 * down. */
void cdl_release_after(const cdl_release_point *point, cdl_release_fn release, void *argument);
/* Whether the calling thread is making the release of argument (given to cdl_release_after) because the event
 * recorded at its point completed: the stream ran everything queued before it was dropped. */
int cdl_release_reached(const void *argument);
/* Releases new references to a and b (either may be NULL) after point, as cdl_release_after. */
void cdl_release_objects_after(const cdl_release_point *point, PyObject *a, PyObject *b);
/* The calling thread's attached thread state, or NULL (none, or the interpreter finalizes): one that holds
 * the GIL detaches around a wait (PyEval_SaveThread / PyEval_RestoreThread). */
PyThreadState *cdl_attached_thread_state(void);
/* Python objects of one interpreter released from any thread: its GIL taken (the calling thread's state in
 * another interpreter detached meanwhile) unless this thread already runs it. */
typedef struct {
    PyThreadState *detached; /* the calling thread's state in another interpreter, reattached at the end */
    PyThreadState *made;     /* a state of the main interpreter made for the release, deleted at the end */
    PyGILState_STATE gil;
    int ensured;             /* gil came from PyGILState_Ensure */
} cdl_interpreter_scope;
/* 1 with owner (PyInterpreterState_Get() when the objects were taken) entered: its objects may be released,
 * then cdl_interpreter_leave. 0 where they must be left behind: the interpreter is gone or finalizing, or
 * owner is a subinterpreter this thread is not running (written as unraisable). Any thread. */
int cdl_interpreter_enter(PyInterpreterState *owner, cdl_interpreter_scope *scope);
void cdl_interpreter_leave(cdl_interpreter_scope *scope);
/* Makes the releases whose events have completed, oldest first; never waits. Any thread. */
void cdl_release_completed(void);
/* Registers the bounded wait at interpreter exit. 0 or -1. */
int cdl_ordered_release_init(PyObject *module);
/* _pending_releases() and _set_ordered_release(enabled), the tests' view and switch. */
PyObject *cdl_pending_releases(PyObject *module, PyObject *unused);
PyObject *cdl_set_ordered_release(PyObject *module, PyObject *enabled);

/* managed_tensor.c: DLPack managed tensors of either layout -------------------------------------- */
/* The capsule names of the DLPack Python specification, defined once. */
extern const char cdl_capsule_name_legacy[];      /* "dltensor" */
extern const char cdl_capsule_name_versioned[];   /* "dltensor_versioned" */

/* A managed tensor of either layout. Which one is decided where the handle is made (a capsule's name,
 * a caller's choice); everything else asks the accessors. */
typedef struct {
    void *pointer;  /* DLManagedTensorVersioned * when versioned, else DLManagedTensor *; NULL: none */
    int versioned;  /* which layout pointer has */
} cdl_managed;

static inline cdl_managed cdl_managed_versioned(DLManagedTensorVersioned *pointer)
{
    cdl_managed managed = {pointer, 1};
    return managed;
}

static inline DLTensor *cdl_managed_tensor(cdl_managed managed)
{
    return managed.versioned ? &((DLManagedTensorVersioned *)managed.pointer)->dl_tensor
                             : &((DLManagedTensor *)managed.pointer)->dl_tensor;
}

/* The DLPACK_FLAG_BITMASK_* flags (a legacy tensor has none). */
static inline uint64_t cdl_managed_flags(cdl_managed managed)
{
    return managed.versioned ? ((DLManagedTensorVersioned *)managed.pointer)->flags : 0;
}

/* Runs the deleter of *managed (if any) once and clears the handle. The deleter may run Python code: an
 * exception already set survives it. */
void cdl_managed_delete(cdl_managed *managed);
/* Our export of arr in one allocation (the managed tensor, shape and strides), whose deleter releases
 * owner and keepalive (new references taken here). A NULL pointer with an exception set on failure. */
cdl_managed cdl_managed_from_array(const cdl_array *arr, PyObject *owner, PyObject *keepalive, int versioned);
/* The same, in a capsule named for its layout that frees an unconsumed tensor, its consumer's release ordered
 * at release_at (NULL, or a point of stream 0: at once). NULL with an exception. */
PyObject *cdl_capsule_from_array(const cdl_array *arr, PyObject *owner, PyObject *keepalive, int versioned,
                                 const cdl_release_point *release_at);
/* Frees data of an export that owns it; called once, on any thread, with or without the GIL, also while the
 * interpreter shuts down, so it touches no Python state. */
typedef void (*cdl_data_release)(void *data, DLDevice device, int64_t stream);
/* A capsule like the above whose tensor owns arr->data (a copy): release_data frees it with the tensor, and a
 * versioned tensor's flags carry DLPACK_FLAG_BITMASK_IS_COPIED. The data is owned from the call on: on failure
 * (NULL with an exception) it has been released already. */
PyObject *cdl_capsule_owning_data(const cdl_array *arr, cdl_data_release release_data, int versioned);
/* Orders the release of our export (managed, or the tensor of one of our capsules) after the point at: its
 * deleter then releases owner, keepalive and data once the consumer's work queued by then has run.
 * data_stream_ordered: the owned data was made by cudaMallocAsync and is freed by cudaFreeAsync on at's
 * stream, without waiting for an event. */
void cdl_managed_order_release(cdl_managed managed, const cdl_release_point *at, int data_stream_ordered);
void cdl_capsule_order_release(PyObject *capsule, const cdl_release_point *at, int data_stream_ordered);
/* Deletes *managed (a producer's tensor a view held) after the point at, as cdl_release_after; at once for
 * stream 0. The handle is emptied. */
void cdl_managed_delete_after(cdl_managed *managed, const cdl_release_point *at);
/* Takes the tensor out of a DLPack capsule, renaming it used_* so nobody else can. Returns 0, or -1 with
 * BufferError (already consumed) or TypeError (not a DLPack capsule). */
int cdl_managed_from_capsule(PyObject *capsule, cdl_managed *out);
/* Validates a foreign tensor into *out (byte offset folded in, strides in elements and explicit, home
 * device = device_id, no producer stream). Returns 0, or -1 with BufferError naming what an array
 * interface cannot describe; the tensor is not deleted either way. */
int cdl_array_from_managed(cdl_managed managed, cdl_array *out);
/* The same for a bare tensor with these DLPACK_FLAG_BITMASK_* flags (a borrowed DLTensor has none). */
int cdl_array_from_tensor(const DLTensor *t, uint64_t flags, cdl_array *out);
/* Device types an array interface can describe: host-accessible ones through __array_interface__,
 * device-accessible ones through __cuda_array_interface__. */
static inline int cdl_host_accessible(DLDeviceType type)
{
    return type == kDLCPU || type == kDLCUDAHost || type == kDLCUDAManaged;
}
static inline int cdl_device_accessible(DLDeviceType type)
{
    return type == kDLCUDA || type == kDLCUDAHost || type == kDLCUDAManaged;
}

/* interface_cache.c: the records kept of unchanged ready interface dicts ------------------------ */
/* 1 with *out filled (all but the device fields) from the record kept of dict, unchanged since, else 0. */
int cdl_cache_find(PyObject *dict, cdl_source source, cdl_array *out);
/* What cdl_cache_store needs to know the dict was unchanged since it was read: its version tag (none: 3.14+, or a
 * split table), asked before its entries are read (on free-threaded builds inside the dict's critical section). */
uint64_t cdl_cache_ticket(PyObject *dict);
/* Keeps arr as what dict, read under ticket, says (when records are kept here and now); found only while the
 * dict's tag is still the ticket. */
void cdl_cache_store(PyObject *dict, cdl_source source, uint64_t ticket, const cdl_array *arr);
#if defined(Py_GIL_DISABLED) && PY_VERSION_HEX < 0x030E0000
/* The test hook's first wait (_set_record_store_delay), detached: called between a held dict's read and its store,
 * where a change may land. */
void cdl_cache_read_wait(void);
#define CDL_CACHE_READ_WAIT() cdl_cache_read_wait()
#else
#define CDL_CACHE_READ_WAIT() ((void)0)
#endif
/* Sets up the kept records of validated interface dicts (empty, and from 3.12 whose interpreter keeps them); 0. */
int cdl_interface_cache_init(void);
/* _core._interface_cache_info(): {"enabled": bool, "hits": int, "stores": int}, for tests. */
PyObject *cdl_interface_cache_info(PyObject *module, PyObject *unused);
/* _core._set_interface_cache(enabled): turns the kept records on or off (off: every dict read afresh);
 * returns the info above. */
PyObject *cdl_set_interface_cache(PyObject *module, PyObject *enabled);
/* _core._set_record_store_delay(microseconds): on free-threaded builds, a wait before each store (tests). */
PyObject *cdl_set_record_store_delay(PyObject *module, PyObject *microseconds);

/* cai_to_dlpack.c: interface dicts (and buffers) into the record, the record out as a capsule --- */
/* Reads an interface dict into *out (obj: its object, or NULL; requested: the caller's dtype=, or
 * NULL). For an array interface whose data is a buffer object,
 * *keepalive receives a new reference that must outlive the data pointer. Returns 0 or -1. */
int cdl_array_from_interface(PyObject *iface, cdl_source source, PyObject *obj, const DLDataType *requested,
                             cdl_array *out, PyObject **keepalive);
/* Reads obj's __cuda_array_interface__ (else __array_interface__; a dict is a CAI dict) into *out,
 * device included, its type the caller's requested one when not NULL. Same contract as above. */
int cdl_array_from_object(PyObject *obj, const DLDataType *requested, cdl_array *out, PyObject **keepalive);
/* The same, for an object whose __cuda_array_interface__ was just found missing by the caller on this thread
 * (a shim's __dlpack_device__): its array interface (or buffer) is read without asking for the CUDA one again. */
int cdl_array_from_host_object(PyObject *obj, const DLDataType *requested, cdl_array *out, PyObject **keepalive);
/* _core._fused_reads(): how many interface dicts the fused reader has read (for tests that real producers' dicts
 * take the fast path). */
PyObject *cdl_fused_reads_count(PyObject *module, PyObject *unused);
/* _core._set_held_fused_reads(enabled): off, on a free-threaded build a dict held elsewhere goes to the general
 * reader (the tests' reference; with the GIL it always does, less its kept record). */
PyObject *cdl_set_held_fused_reads(PyObject *module, PyObject *enabled);
/* The object whose buffer a keepalive of cdl_array_from_object holds (a memoryview, or a buffer hold of a native
 * array's own buffer); borrowed. */
PyObject *cdl_keepalive_exporter(PyObject *keepalive);
/* The whole export: checks the consumer's requests, orders streams, builds the capsule. */
PyObject *cdl_export(const cdl_array *arr, PyObject *owner, PyObject *keepalive, PyObject *stream,
                     PyObject *max_version, PyObject *dl_device, PyObject *copy);
/* cai2dlpack(obj) with no keyword, the common call: obj read (not a dict) and exported in one function. */
PyObject *cdl_cai2dlpack_plain(PyObject *obj);

/* copy.c: the copies a consumer asks __dlpack__ for --------------------------------------------------- */
/* A capsule owning a new C-contiguous copy of arr (same type and shape, writable, flagged IS_COPIED) on target:
 * arr's own device (copy=True), or (kDLCPU, 0) for any source. A copy of CUDA memory onto its device is ordered
 * after the producer's stream and issued on consumer's (not waited for); a host copy of CUDA memory is issued on
 * the producer's stream and complete on return, made in relaxed capture mode. NULL with an exception:
 * BufferError naming a layout the runtime's memcpy calls cannot copy on the device, or a consumer stream that
 * captures a graph (host copies), CudaError, MemoryError. The source's owner and keepalive are held (new
 * references) until the copy has run, and the producer's stream is ordered after it. */
PyObject *cdl_export_copy(const cdl_array *arr, DLDevice target, int64_t consumer, PyObject *owner,
                          PyObject *keepalive, int versioned);

/* dlpack_to_cai.c: DLPackView, a managed tensor behind the array interfaces ---------------------- */
extern PyTypeObject cdl_view_type;
int cdl_view_type_init(void);
/* A view owning managed (stolen: on failure its deleter has run), its data ready on stream. */
PyObject *cdl_view_new(cdl_managed managed, int64_t stream);
/* A view's tensor as a record (byte offset folded in, strides explicit), its stream the one the view was made
 * for as this thread and device can name it (cdl_view_stream_join); 0 or -1. And the tensor itself. */
int cdl_array_from_view(PyObject *view, cdl_array *arr);
const DLTensor *cdl_view_tensor(PyObject *view);
/* dlpack2cai: a new view of obj, or NULL with an exception set. A capsule is consumed; an object whose type
 * publishes a DLPack C exchange API table (not ours) is taken through it when exchange is set (see
 * cdl_view_from_exchange_api); otherwise obj.__dlpack__(stream=..., max_version=...) is called. */
PyObject *cdl_view_from_object(PyObject *obj, PyObject *stream, int exchange);
/* The DLPack C exchange API table obj's type publishes (1.3's capsule __dlpack_c_exchange_api__, else 1.2's
 * int __c_dlpack_exchange_api__) in a major version this build reads, walking prev_api to one; NULL when
 * there is none, it is ours (DLPackShim, DLPackView), or it lacks a function we call. Sets no exception. */
const DLPackExchangeAPI *cdl_producer_exchange_api(PyObject *obj);
/* Whether obj, whose table gave a tensor of dtype, may be taken that way: 1, or 0 where its __dlpack__ must
 * decide (a torch tensor that requires grad or has its conjugate bit set, which __dlpack__ refuses and the
 * table exports anyway); -1 with UnsupportedArrayError for a tensor whose negative bit is set (the memory holds the
 * negation of its values; torch's __dlpack__ exports it as it is), or another exception. */
int cdl_exchange_usable(PyObject *obj, DLDataType dtype);
/* Orders the producer's current work stream on arr's device (api->current_work_stream; NULL is the legacy
 * stream) before the consumer stream, as cdl_order_streams does (nothing for consumer -1 or host memory);
 * sets arr->stream to it. Returns 0, or -1 with an exception set. */
int cdl_order_exchange_producer(const DLPackExchangeAPI *api, PyObject *obj, cdl_array *arr, int64_t consumer);
/* dlpack2cai through obj's exchange table: managed_tensor_from_py_object_no_sync, then the producer's
 * work ordered before consumer by cdl_order_exchange_producer. Returns 1 with *view set, 0 when the caller
 * should call __dlpack__ instead (no table, one cdl_exchange_usable turns down, or a table call that raised:
 * __dlpack__ is the producer's reference path and says why in its own words), or -1 with an exception set. */
int cdl_view_from_exchange_api(PyObject *obj, int64_t consumer, PyObject **view);

/* shim.c: DLPackShim, the DLPack protocol for an interface object --------------------------------- */
typedef struct cdl_shim_reading cdl_shim_reading;
typedef struct {
    PyObject_HEAD
    PyObject *obj;         /* the wrapped CAI or array-interface object; NULL once tp_clear ran */
    PyObject *weakreflist;
    int64_t *dims;         /* shape and strides lent by the exchange API's DLTensor call; made on first use */
    DLDataType dtype;      /* the dtype= the shim was made with; bits 0: none */
    /* The read-once rule: what __dlpack_device__ read of a CAI object, or its finding that the object has none
     * but an array interface (a mark, shim.c), taken (atomically) by the next __dlpack__ on the same thread; any
     * other conversion of the shim drops it and reads afresh. */
    cdl_shim_reading *pending;
} cdl_shim;
extern PyTypeObject cdl_shim_type;
/* The shim's dtype=, or NULL. */
static inline const DLDataType *cdl_shim_dtype(const cdl_shim *shim) { return shim->dtype.bits ? &shim->dtype : NULL; }
/* The wrapped object (borrowed), or NULL with BufferError once the garbage collector has cleared the shim
 * (tp_clear, breaking a reference cycle; C code may still reach it there). */
PyObject *cdl_shim_wrapped(cdl_shim *shim);
/* Drops what __dlpack_device__ read, if anything: a conversion other than __dlpack__ is starting. */
void cdl_shim_drop_reading(cdl_shim *shim);
int cdl_shim_type_init(void);

/* c_api.c: the C doors ----------------------------------------------------------------------------- */
/* Adds the C API capsule to the module and the exchange API to our types. Returns 0 or -1. */
int cdl_c_api_init(PyObject *module);

#endif
