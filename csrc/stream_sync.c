/* Stream ordering between a producer and a consumer: an event recorded on the producer's stream
 * and waited on by the consumer's, so the device orders the work and the host never blocks; inside
 * CUDA graph captures, the ordering a capture allows, or an error where there is none. The one wait
 * of the host is a view's host read of pinned or managed memory (host readers know no stream). */
#include "cdl_internal.h"
#include "cuda_runtime_table.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

_Atomic int cdl_option_sync = 1;
_Atomic int cdl_option_export_stream = 1;
_Atomic int cdl_option_trust_streams = 0;

/* Reusable events, one per context (keyed by the context's id, unique for the process's lifetime), or
 * per device where the driver's calls are missing. A stream that waits on an event captures the
 * event's state at cudaStreamWaitEvent time, so the event can be recorded again at once; the pool's
 * lock, held from the record to the wait, keeps two conversions from sharing one between those calls
 * (the GIL does not, on a free-threaded build). A device reset destroys a context and its events: the next conversion sees another id and makes a
 * new event. At most CDL_POOL_LIMIT are kept; past that the oldest entry is given up (not destroyed:
 * its context may be gone).
 * A capture's external wait is different: the graph keeps the event and waits, at each launch, on its
 * latest record. Such events are kept apart, one per context and producer stream, and recorded only
 * on that stream outside any capture, so a graph waits at most on later work of the same stream. The
 * per-thread default stream is one value (2) for every thread but a different stream in each: its events
 * are kept per thread too, or another thread's record would move what this thread's graph waits on. */
typedef struct {
    unsigned long long key;
    int64_t external_for; /* the producer stream of an external wait's event; 0 for the shared one */
    unsigned long long thread; /* for external_for 2, the serial of the thread whose stream it is; else 0 */
    cudaEvent_t event;
} cdl_pool_entry;
#define CDL_POOL_LIMIT 64
static cdl_pool_entry cdl_event_pool[CDL_POOL_LIMIT];
static int cdl_event_pool_used, cdl_event_pool_next;
static cdl_lock cdl_event_pool_lock = CDL_LOCK_INITIALIZER;

/* A runtime call that failed while the pool's lock was held, raised as CudaError once it is released:
 * making an exception may run Python code (a collection, a finalizer), which may convert again. */
typedef struct {
    const char *call;
    cudaError_t code;
} cdl_failed_call;

static int cdl_fail(cdl_failed_call *failed, const char *call, cudaError_t code)
{
    failed->call = call;
    failed->code = code;
    return -1;
}

/* 1 only where name says so in words (1, true, yes, on, in any case): for an option whose mistaken "on" costs
 * more than a mistaken "off". */
static int cdl_env_says_on(const char *name)
{
    const char *value = getenv(name);
    if (value == NULL)
        return 0;
    return strcmp(value, "1") == 0 || strcasecmp(value, "true") == 0 || strcasecmp(value, "yes") == 0 ||
           strcasecmp(value, "on") == 0;
}

static int cdl_env_flag(const char *name, int fallback)
{
    const char *value = getenv(name);
    if (value == NULL || value[0] == '\0')
        return fallback;
    return !(strcmp(value, "0") == 0 || strcasecmp(value, "false") == 0 || strcasecmp(value, "no") == 0 ||
             strcasecmp(value, "off") == 0);
}

void cdl_stream_options_init(void)
{
    cdl_option_sync = cdl_env_flag("CAI_DLPACK_SYNC", 1);
    cdl_option_export_stream = cdl_env_flag("CAI_DLPACK_EXPORT_STREAM", 1);
    /* A promise about the caller's streams: made only in so many words (a typo must not make it). */
    cdl_option_trust_streams = cdl_env_says_on("CAI_DLPACK_TRUST_STREAMS");
}

/* A consumer's stream object of the CUDA stream protocol (cuda.core, tvm-ffi, CuPy, ...):
 * __cuda_stream__() -> (version, handle). A NULL handle is the default stream, which a library built
 * without per-thread default streams (as CUDA's are by default) means as the legacy one. */
static int cdl_parse_stream_object(PyObject *value, const char *what, int64_t *out)
{
    PyObject *method;
    int found = cdl_lookup_attribute(value, cdl_name.cuda_stream, &method);
    if (found <= 0) {
        if (found == 0)
            PyErr_Format(PyExc_TypeError,
                         "%s must be None or an int, not %.200s (nor an object with __cuda_stream__)", what,
                         Py_TYPE(value)->tp_name);
        return -1;
    }
    PyObject *pair = PyObject_CallNoArgs(method);
    Py_DECREF(method);
    if (pair == NULL)
        return -1;
    int status = -1;
    unsigned long long handle = 0;
    if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2 || !PyLong_Check(PyTuple_GET_ITEM(pair, 0)) ||
        !PyLong_Check(PyTuple_GET_ITEM(pair, 1))) {
        PyErr_Format(PyExc_TypeError, "%s: %.200s.__cuda_stream__() returned %R, not a (version, handle) pair of ints",
                     what, Py_TYPE(value)->tp_name, pair);
    }
    else if ((handle = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(pair, 1))) == (unsigned long long)-1 &&
             PyErr_Occurred()) {
        PyErr_Format(PyExc_ValueError, "%s: %.200s.__cuda_stream__() returned %R, whose handle is not a pointer",
                     what, Py_TYPE(value)->tp_name, pair);
    }
    else {
        *out = handle == 0 ? CDL_STREAM_LEGACY : (int64_t)handle;
        status = 0;
    }
    Py_DECREF(pair);
    return status;
}

int cdl_parse_stream(PyObject *value, const char *what, int consumer, int64_t *out)
{
    if (value == NULL || value == Py_None) {
        /* The array API's None is the legacy default stream; a CAI's None is "no stream". */
        *out = consumer ? CDL_STREAM_LEGACY : 0;
        return 0;
    }
    if (!PyLong_Check(value) || PyBool_Check(value)) {
        if (consumer && !PyBool_Check(value))
            return cdl_parse_stream_object(value, what, out);
        PyErr_Format(PyExc_TypeError, "%s must be None or an int, not %.200s", what, Py_TYPE(value)->tp_name);
        return -1;
    }
    int overflow;
    long long stream = PyLong_AsLongLongAndOverflow(value, &overflow);
    if (stream == -1 && !overflow && PyErr_Occurred())
        return -1;
    if (overflow || stream == 0 || stream < (consumer ? CDL_STREAM_NO_SYNC : 1)) {
        PyErr_Format(PyExc_ValueError,
                     "%s %R is not a valid stream (%s1 for the legacy default, 2 for the per-thread "
                     "default, or a cudaStream_t handle; 0 is ambiguous and refused)",
                     what, value, consumer ? "None, -1 for no synchronization, " : "None, ");
        return -1;
    }
    *out = stream;
    return 0;
}

/* The pool key of the context current in scope: its id, or the device without the driver's calls. */
static int cdl_pool_key(const cdl_cudart *rt, const cdl_device_scope *scope, int device, unsigned long long *key)
{
    *key = (unsigned long long)device;
    if (scope->context == NULL || rt->cu_ctx_get_id == NULL)
        return 0;
    int code = rt->cu_ctx_get_id(scope->context, key);
    return code == 0 ? 0 : cdl_raise_driver_error("cuCtxGetId", code);
}

/* A number for the calling thread that no other thread of the process ever has (a thread's ident is reused
 * once it exits, and a graph captured there may still be replayed): given on the thread's first use. */
unsigned long long cdl_thread_serial(void)
{
    static _Atomic unsigned long long next = 1;
    static _Thread_local unsigned long long serial;
    if (serial == 0)
        serial = next++;
    return serial;
}

/* The thread an external wait's event belongs to: the caller for the per-thread default stream, else 0. */
static unsigned long long cdl_pool_thread(int64_t external_for)
{
    return external_for == CDL_STREAM_PER_THREAD ? cdl_thread_serial() : 0;
}

/* The pool's entry for key (and the producer stream of an external wait, or 0), or NULL. Lock held. */
static cdl_pool_entry *cdl_pool_find(unsigned long long key, int64_t external_for)
{
    const unsigned long long thread = cdl_pool_thread(external_for);
    for (int i = 0; i < cdl_event_pool_used; i++) {
        if (cdl_event_pool[i].key == key && cdl_event_pool[i].external_for == external_for &&
            cdl_event_pool[i].thread == thread)
            return &cdl_event_pool[i];
    }
    return NULL;
}

/* The pool's event for key and external_for, made when there is none. Lock held. */
static int cdl_pooled_event(const cdl_cudart *rt, unsigned long long key, int64_t external_for, cudaEvent_t *event,
                            cdl_failed_call *failed)
{
    cdl_pool_entry *entry = cdl_pool_find(key, external_for);
    if (entry != NULL) {
        *event = entry->event;
        return 0;
    }
    cudaError_t status = rt->event_create_with_flags(event, cudaEventDisableTiming);
    if (status != cudaSuccess)
        return cdl_fail(failed, "cudaEventCreateWithFlags", status);
    entry = &cdl_event_pool[cdl_event_pool_used < CDL_POOL_LIMIT ? cdl_event_pool_used++ : cdl_event_pool_next];
    cdl_event_pool_next = (cdl_event_pool_next + 1) % CDL_POOL_LIMIT;
    entry->key = key;
    entry->external_for = external_for;
    entry->thread = cdl_pool_thread(external_for);
    entry->event = *event;
    return 0;
}

/* Records event on the producer stream. A pooled event whose context was reset under the same id is a
 * dead handle: the record is tried once more with a new event, which replaces it in the pool only if
 * that record works (else the failure is the stream's, and the new event is destroyed: no leak). Lock held. */
static int cdl_record(const cdl_cudart *rt, unsigned long long key, int64_t external_for, int64_t producer,
                      cudaEvent_t *event, cdl_failed_call *failed)
{
    cudaError_t status = rt->event_record(*event, (cudaStream_t)(uintptr_t)producer);
    if (status == cudaErrorInvalidResourceHandle || status == cudaErrorContextIsDestroyed) {
        (void)rt->get_last_error();
        cudaEvent_t fresh;
        cudaError_t made = rt->event_create_with_flags(&fresh, cudaEventDisableTiming);
        if (made != cudaSuccess)
            return cdl_fail(failed, "cudaEventCreateWithFlags", made);
        cudaError_t again = rt->event_record(fresh, (cudaStream_t)(uintptr_t)producer);
        if (again == cudaSuccess) {
            cdl_pool_find(key, external_for)->event = *event = fresh;
            return 0;
        }
        (void)rt->get_last_error();
        (void)rt->event_destroy(fresh);
    }
    return status == cudaSuccess ? 0 : cdl_fail(failed, "cudaEventRecord", status);
}

/* Waits consumer on event (flags: cudaEventWaitExternal into a capture, else 0); 0 or -1. Lock held. */
static int cdl_wait(const cdl_cudart *rt, int64_t consumer, cudaEvent_t event, unsigned flags,
                    cdl_failed_call *failed)
{
    cudaError_t status = rt->stream_wait_event((cudaStream_t)(uintptr_t)consumer, event, flags);
    return status == cudaSuccess ? 0 : cdl_fail(failed, "cudaStreamWaitEvent", status);
}

/* ---- graph capture -------------------------------------------------------------------------------
 * What a stream is to a capture, asked of the runtime just before ordering (and never when nothing
 * is to be ordered). The legacy stream never captures, but while a blocking stream of its device
 * captures, any use of it would invalidate that capture: the runtime answers the query itself with
 * cudaErrorStreamCaptureImplicit, invalidating nothing. */
typedef enum {
    CDL_CAPTURE_NONE,
    CDL_CAPTURE_ACTIVE,
    CDL_CAPTURE_INVALIDATED,
    CDL_CAPTURE_LEGACY_UNUSABLE,
} cdl_capture_state;

typedef struct {
    cdl_capture_state state;
    unsigned long long id; /* the capture's id, while active or invalidated */
} cdl_capture;

static int cdl_capture_of(const cdl_cudart *rt, int64_t stream, cdl_capture *out)
{
    enum cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    cudaError_t code = cdl_stream_capture_info(rt, (cudaStream_t)(uintptr_t)stream, &status, &out->id);
    if (code == cudaErrorStreamCaptureImplicit) {
        (void)rt->get_last_error(); /* our query's, not a failure of anyone's work */
        out->state = CDL_CAPTURE_LEGACY_UNUSABLE;
        return 0;
    }
    if (code != cudaSuccess)
        return cdl_raise_cuda_error("cudaStreamGetCaptureInfo", code);
    out->state = status == cudaStreamCaptureStatusActive        ? CDL_CAPTURE_ACTIVE
                 : status == cudaStreamCaptureStatusInvalidated ? CDL_CAPTURE_INVALIDATED
                                                                : CDL_CAPTURE_NONE;
    return 0;
}

/* "stream 20480", or the name of a special handle, for messages. */
static const char *cdl_stream_words(int64_t stream, char *text, size_t size)
{
    if (stream == CDL_STREAM_LEGACY)
        return "the legacy default stream";
    if (stream == CDL_STREAM_PER_THREAD)
        return "the per-thread default stream";
    snprintf(text, size, "stream %lld", (long long)stream);
    return text;
}

/* How producer is ordered before consumer given their captures (the README's table): 0 with *external
 * set when the wait must be an external one (outside work joining a capture), or -1 with CudaError
 * naming the capture, where no ordering exists that keeps the capture whole and the replay correct. */
static int cdl_capture_plan(int64_t producer, const cdl_capture *made, int64_t consumer, const cdl_capture *used,
                            int *external)
{
    *external = 0;
    if (made->state == CDL_CAPTURE_NONE && used->state == CDL_CAPTURE_NONE)
        return 0;
    char producer_text[48], consumer_text[48];
    const char *p = cdl_stream_words(producer, producer_text, sizeof(producer_text));
    const char *c = cdl_stream_words(consumer, consumer_text, sizeof(consumer_text));
    if (made->state == CDL_CAPTURE_LEGACY_UNUSABLE || used->state == CDL_CAPTURE_LEGACY_UNUSABLE)
        return cdl_raise_capture_error(
            made->state == CDL_CAPTURE_LEGACY_UNUSABLE ? "cudaEventRecord" : "cudaStreamWaitEvent",
            cudaErrorStreamCaptureImplicit,
            "the %s stream is the legacy default stream, and a blocking stream of its device is capturing a CUDA "
            "graph: any use of the legacy stream would invalidate that capture. Order on a stream of the capture "
            "(or capture on a non-blocking stream), or make the data ready before the capture and pass stream=-1",
            made->state == CDL_CAPTURE_LEGACY_UNUSABLE ? "producer" : "consumer");
    if (made->state == CDL_CAPTURE_INVALIDATED || used->state == CDL_CAPTURE_INVALIDATED) {
        int producer_broken = made->state == CDL_CAPTURE_INVALIDATED;
        return cdl_raise_capture_error(producer_broken ? "cudaEventRecord" : "cudaStreamWaitEvent",
                                       cudaErrorStreamCaptureInvalidated,
                                       "the capture on %s (capture id %llu) was already invalidated by an earlier "
                                       "error; end it with cudaStreamEndCapture before converting",
                                       producer_broken ? p : c, producer_broken ? made->id : used->id);
    }
    if (made->state == CDL_CAPTURE_ACTIVE && used->state == CDL_CAPTURE_ACTIVE) {
        if (made->id == used->id)
            return 0; /* record and wait are both nodes of the one graph */
        return cdl_raise_capture_error(
            "cudaStreamWaitEvent", cudaErrorStreamCaptureMerge,
            "producer %s is capturing CUDA graph capture %llu and consumer %s capture %llu; work of one capture "
            "cannot be ordered before another's (their graphs launch independently). Convert within one capture",
            p, made->id, c, used->id);
    }
    if (made->state == CDL_CAPTURE_ACTIVE)
        return cdl_raise_capture_error(
            "cudaStreamWaitEvent", cudaErrorCapturedEvent,
            "producer %s is capturing a CUDA graph (capture id %llu), so its work runs only when that graph is "
            "launched, and consumer %s, outside the capture, cannot be ordered after it. Consume on a stream of "
            "the same capture, or convert after launching the graph",
            p, made->id, c);
    /* Work made outside the capture joins it through an external wait: a node of the graph that waits,
     * at each launch, on the event's latest record, so no replay runs ahead of the producer's writes
     * made before the conversion. */
    *external = 1;
    return 0;
}

/* The capture of stream asked in a scope of device's primary context (where the current context is another
 * device's): the legacy and per-thread handles there name that device's streams. 0, or -1 with an exception. */
static int cdl_capture_on_device(const cdl_cudart *rt, int device, int64_t stream, cdl_capture *out)
{
    cdl_device_scope scope;
    if (cdl_device_enter(rt, device, &scope) != 0)
        return cdl_raise_scope_error(&scope);
    int result = cdl_capture_of(rt, stream, out);
    if (cdl_device_leave(rt, &scope) != 0 && result == 0)
        return cdl_raise_scope_error(&scope);
    return result;
}

int cdl_order_streams_by_runtime(const cdl_array *arr, int64_t consumer)
{
    const DLDevice device = arr->device;
    const int64_t producer = arr->stream;
    /* A legacy or per-thread consumer handle names the stream of a device: for device memory the data's (the
     * array API's: a consumer's stream is on the array's device), for pinned and managed memory, which any
     * device may use, the caller's, so that wait is made in the caller's own context once the producer's is
     * left, and its capture is asked about there too. One handle is then two streams where the caller's device
     * is not the allocation's (the producer's stream), else one handle is one stream. */
    const int default_consumer = consumer == CDL_STREAM_LEGACY || consumer == CDL_STREAM_PER_THREAD;
    const int in_callers_context = device.device_type != kDLCUDA && default_consumer;
    /* No elements, nothing to race on. Producers give such arrays a NULL pointer, so the device is
     * only a guess (the current one) and may not be the producer stream's: recording there would fail. */
    for (int32_t i = 0; i < arr->ndim; i++) {
        if (arr->shape[i] == 0)
            return 0;
    }
    const cdl_cudart *rt = cdl_cudart_get();
    if (rt == NULL)
        return -1;
    if (producer == consumer) {
        int current;
        cudaError_t code = rt->get_device(&current);
        if (code != cudaSuccess)
            return cdl_raise_cuda_error("cudaGetDevice", code);
        if (current == arr->home_device)
            return 0;
    }
    cdl_capture made, used;
    if (in_callers_context && cdl_capture_of(rt, consumer, &used) < 0)
        return -1;
    /* The event is recorded in the producer stream's context (event and stream must share one): a
     * stream handle's own, and for the legacy and per-thread handles the primary context of the data's
     * device (the array API's streams belong to the array's device), or for pinned and managed memory,
     * which any device may use, of the allocation's. */
    cdl_device_scope scope;
    int entered, producer_handle = producer > CDL_STREAM_PER_THREAD && rt->cu_stream_get_ctx != NULL;
    if (producer_handle) {
        void *context;
        int code = rt->cu_stream_get_ctx((void *)(uintptr_t)producer, &context);
        if (code != 0)
            return cdl_raise_driver_error("cuStreamGetCtx", code);
        entered = cdl_context_enter(rt, context, &scope);
    }
    else {
        entered = cdl_device_enter(rt, arr->home_device, &scope);
    }
    if (entered != 0)
        return cdl_raise_scope_error(&scope);
    int result = -1, external = 0, locked = 0, left;
    int64_t external_for = 0;
    unsigned wait_flags = 0;
    unsigned long long key;
    cudaEvent_t event = NULL;
    cdl_failed_call failed = {NULL, cudaSuccess};
    /* A producer stream handle of another device than the data's: the consumer's legacy or per-thread stream of
     * device memory is the data's device's, asked about and waited on in its context, not the producer's. The
     * producer's context is the data's device's where the caller's current one was it (nothing switched). */
    int on_datas_device = 0, wait_apart = in_callers_context;
    if (producer_handle && default_consumer && device.device_type == kDLCUDA) {
        int producer_device = scope.previous_device;
        cudaError_t code = scope.switched ? rt->get_device(&producer_device) : cudaSuccess;
        if (code != cudaSuccess) {
            cdl_raise_cuda_error("cudaGetDevice", code);
            goto done;
        }
        on_datas_device = producer_device != arr->home_device;
        wait_apart = on_datas_device;
    }
    if ((on_datas_device && cdl_capture_on_device(rt, arr->home_device, consumer, &used) < 0) ||
        cdl_capture_of(rt, producer, &made) < 0 || (!wait_apart && cdl_capture_of(rt, consumer, &used) < 0) ||
        cdl_capture_plan(producer, &made, consumer, &used, &external) < 0 ||
        cdl_pool_key(rt, &scope, arr->home_device, &key) < 0)
        goto done;
    external_for = external ? producer : 0;
    wait_flags = external ? cudaEventWaitExternal : 0;
    cdl_lock_acquire(&cdl_event_pool_lock);
    locked = 1;
    if (cdl_pooled_event(rt, key, external_for, &event, &failed) == 0 &&
        cdl_record(rt, key, external_for, producer, &event, &failed) == 0)
        result = wait_apart ? 0 : cdl_wait(rt, consumer, event, wait_flags, &failed);
done:
    left = cdl_device_leave(rt, &scope) == 0;
    cdl_device_scope datas_device = {.switched = 0};
    if (result == 0 && left && on_datas_device && cdl_device_enter(rt, arr->home_device, &datas_device) != 0) {
        scope = datas_device;
        left = 0;
    }
    if (result == 0 && left && wait_apart) {
        result = cdl_wait(rt, consumer, event, wait_flags, &failed);
        if (cdl_device_leave(rt, &datas_device) != 0) {
            scope = datas_device;
            left = 0;
        }
    }
    if (locked)
        cdl_lock_release(&cdl_event_pool_lock);
    if (failed.call != NULL)
        return cdl_raise_cuda_error(failed.call, failed.code);
    return result == 0 && !left ? cdl_raise_scope_error(&scope) : result;
}

/* Refuses the legacy default stream of a device (device_type, device_id as DLPack gives them; the
 * caller's device for pinned and managed memory) while a blocking stream there captures a graph. */
int cdl_check_legacy_stream(DLDeviceType device_type, int32_t device_id, const char *what)
{
    const cdl_cudart *rt = cdl_cudart_get();
    if (rt == NULL)
        return -1;
    cdl_device_scope scope;
    if (device_type == kDLCUDA && cdl_device_enter(rt, device_id, &scope) != 0)
        return cdl_raise_scope_error(&scope);
    cdl_capture legacy;
    int result = cdl_capture_of(rt, CDL_STREAM_LEGACY, &legacy);
    if (result == 0 && legacy.state == CDL_CAPTURE_LEGACY_UNUSABLE)
        result = cdl_raise_capture_error("cudaStreamWaitEvent", cudaErrorStreamCaptureImplicit,
                                         "%s the legacy default stream, and a blocking stream of its device is "
                                         "capturing a CUDA graph: any use of the legacy stream would invalidate that "
                                         "capture. Pass a stream of the capture instead", what);
    if (device_type == kDLCUDA && cdl_device_leave(rt, &scope) != 0 && result == 0)
        result = cdl_raise_scope_error(&scope);
    return result;
}

int cdl_stream_to_export(int64_t stream, DLDevice device, int64_t *out)
{
    *out = stream;
    if (stream == 0 || !cdl_device_accessible(device.device_type))
        return 0;
    const cdl_cudart *rt = cdl_cudart_get();
    if (rt == NULL)
        return -1;
    cdl_device_scope scope;
    const int enter = device.device_type == kDLCUDA && stream <= CDL_STREAM_PER_THREAD;
    if (enter && cdl_device_enter(rt, device.device_id, &scope) != 0)
        return cdl_raise_scope_error(&scope);
    cdl_capture capture;
    int result = cdl_capture_of(rt, stream, &capture);
    /* A consumer may synchronize the stream it is given, which a capture forbids (on a capturing stream,
     * and on the legacy stream while a blocking one captures); and nothing it could wait for exists
     * before the graph is launched. A consumer inside the capture is ordered by the capture itself. */
    if (result == 0 && capture.state != CDL_CAPTURE_NONE)
        *out = 0;
    if (enter && cdl_device_leave(rt, &scope) != 0 && result == 0)
        result = cdl_raise_scope_error(&scope);
    return result;
}

int cdl_view_stream_set(cdl_view_stream *point, int64_t consumer, const cdl_array *arr)
{
    point->stream = 0;
    point->device = arr->device.device_id;
    point->thread = 0;
    point->event = NULL;
    if (consumer == 0 || consumer == CDL_STREAM_NO_SYNC || !cdl_device_accessible(arr->device.device_type))
        return 0;
    point->thread = consumer == CDL_STREAM_PER_THREAD ? cdl_thread_serial() : 0;
    const cdl_cudart *rt = NULL;
    /* The legacy and per-thread handles name a stream of a device: the data's, or for pinned and managed memory
     * (any device may use it) the caller's current one, as stream ordering took them. */
    if (consumer <= CDL_STREAM_PER_THREAD && arr->device.device_type != kDLCUDA) {
        if ((rt = cdl_cudart_get()) == NULL)
            return -1;
        int current;
        cudaError_t code = rt->get_device(&current);
        if (code != cudaSuccess)
            return cdl_raise_cuda_error("cudaGetDevice", code);
        point->device = current;
    }
    /* Decided now: options(sync=...) switched later changes nothing a view promised (or did not). */
    if (!cdl_option_sync)
        return 0;
    for (int32_t i = 0; i < arr->ndim; i++)
        if (arr->shape[i] == 0)
            return 0; /* nothing to read, and the device of a NULL pointer is only a guess */
    point->stream = consumer;
    if (consumer != CDL_STREAM_PER_THREAD)
        return 0;
    /* Only this thread can name its per-thread stream: an event marks the point the data is ready at, for a
     * host read or a re-export on another thread. None while that stream captures (the event would be a node
     * of the graph): other threads are then refused. */
    if (rt == NULL && (rt = cdl_cudart_get()) == NULL)
        return -1;
    cdl_device_scope scope;
    if (cdl_device_enter(rt, point->device, &scope) != 0)
        return cdl_raise_scope_error(&scope);
    cdl_capture capture;
    int result = cdl_capture_of(rt, consumer, &capture);
    const char *call = NULL;
    cudaError_t code = cudaSuccess;
    if (result == 0 && capture.state == CDL_CAPTURE_NONE) {
        cudaEvent_t event;
        code = rt->event_create_with_flags(&event, cudaEventDisableTiming);
        if (code != cudaSuccess)
            call = "cudaEventCreateWithFlags";
        else if ((code = rt->event_record(event, (cudaStream_t)(uintptr_t)consumer)) != cudaSuccess) {
            call = "cudaEventRecord";
            (void)rt->event_destroy(event);
        }
        else
            point->event = event;
    }
    const int left = cdl_device_leave(rt, &scope) == 0;
    if (call != NULL)
        return cdl_raise_cuda_error(call, code);
    if (result == 0 && !left) {
        cdl_view_stream_clear(point);
        return cdl_raise_scope_error(&scope);
    }
    return result;
}

void cdl_view_stream_clear(cdl_view_stream *point)
{
    if (point->event == NULL)
        return;
    /* Any thread, GIL held or not: destroying an event whose record has not completed is allowed (its
     * resources are released once it completes). */
    const cdl_cudart *rt = cdl_cudart_loaded();
    if (rt != NULL && rt->event_destroy((cudaEvent_t)point->event) != cudaSuccess)
        (void)rt->get_last_error();
    point->event = NULL;
}

/* BufferError: a per-thread stream of another thread, with no event to order after. Returns -1. */
static int cdl_refuse_other_threads_stream(const char *what)
{
    PyErr_Format(PyExc_BufferError,
                 "%s: this DLPackView was made with stream=2 on another thread while that thread's per-thread "
                 "default stream was capturing a CUDA graph, and no other thread can name that stream to wait for "
                 "it; use the view on the thread that made it, or make it with a stream handle",
                 what);
    return -1;
}

int cdl_view_stream_join(const cdl_view_stream *point, int64_t *producer)
{
    if (point->stream != CDL_STREAM_PER_THREAD || point->thread == cdl_thread_serial())
        return 0;
    if (point->event == NULL)
        return cdl_refuse_other_threads_stream("a re-export of this DLPackView on another thread");
    const cdl_cudart *rt = cdl_cudart_get();
    if (rt == NULL)
        return -1;
    /* This thread's own per-thread stream waits for the event, and stands for the view's stream from then on. */
    cdl_device_scope scope;
    if (cdl_device_enter(rt, point->device, &scope) != 0)
        return cdl_raise_scope_error(&scope);
    cdl_capture capture;
    int result = cdl_capture_of(rt, CDL_STREAM_PER_THREAD, &capture);
    cudaError_t code = cudaSuccess;
    if (result == 0)
        code = rt->stream_wait_event((cudaStream_t)(uintptr_t)CDL_STREAM_PER_THREAD, (cudaEvent_t)point->event,
                                     capture.state == CDL_CAPTURE_ACTIVE ? cudaEventWaitExternal : 0);
    const int left = cdl_device_leave(rt, &scope) == 0;
    if (result < 0)
        return -1;
    if (code != cudaSuccess)
        return cdl_raise_cuda_error("cudaStreamWaitEvent", code);
    if (!left)
        return cdl_raise_scope_error(&scope);
    *producer = CDL_STREAM_PER_THREAD;
    return 0;
}

int cdl_wait_for_host_read(const cdl_view_stream *point, DLDevice device)
{
    const int64_t stream = point->stream;
    if (stream == 0 || !cdl_device_accessible(device.device_type))
        return 0;
    if (stream == CDL_STREAM_PER_THREAD && point->event == NULL && point->thread != cdl_thread_serial())
        return cdl_refuse_other_threads_stream("a host read on another thread");
    const cdl_cudart *rt = cdl_cudart_get();
    if (rt == NULL)
        return -1;
    cudaError_t code;
    cdl_capture_mode_scope relaxed;
    if (point->event != NULL) {
        /* Recorded outside any capture: waiting for it breaks none (relaxed: nor another thread's global one). */
        Py_BEGIN_ALLOW_THREADS
        cdl_capture_mode_relax(rt, &relaxed);
        code = rt->event_synchronize((cudaEvent_t)point->event);
        cdl_capture_mode_leave(rt, &relaxed);
        Py_END_ALLOW_THREADS
        return code == cudaSuccess ? 0 : cdl_raise_cuda_error("cudaEventSynchronize", code);
    }
    /* The legacy and per-thread handles are the streams of the device the view was made for. */
    cdl_device_scope scope;
    const int enter = stream <= CDL_STREAM_PER_THREAD;
    if (enter && cdl_device_enter(rt, point->device, &scope) != 0)
        return cdl_raise_scope_error(&scope);
    cdl_capture capture;
    int result = cdl_capture_of(rt, stream, &capture);
    /* Waiting for a capturing stream (or the legacy one while a blocking stream captures) would invalidate the
     * capture, and the data is not made before the graph is launched: refused, nothing called. */
    if (result == 0 && capture.state != CDL_CAPTURE_NONE) {
        char words[64];
        result = cdl_raise_capture_error(
            "cudaStreamSynchronize",
            capture.state == CDL_CAPTURE_LEGACY_UNUSABLE ? (int)cudaErrorStreamCaptureImplicit
                                                         : (int)cudaErrorStreamCaptureUnsupported,
            "a host read of this DLPackView (__array_interface__, the buffer protocol) waits for %s, on which its "
            "producer made the data ready, and %s; read it after the capture, or make the view with stream=-1 "
            "and order the host read yourself",
            cdl_stream_words(stream, words, sizeof words),
            capture.state == CDL_CAPTURE_LEGACY_UNUSABLE ? "a blocking stream captures a CUDA graph"
                                                         : "that stream is capturing a CUDA graph");
    }
    if (result == 0) {
        /* Relaxed: another thread's capture in global mode must not be broken by this wait. */
        Py_BEGIN_ALLOW_THREADS
        cdl_capture_mode_relax(rt, &relaxed);
        code = rt->stream_synchronize((cudaStream_t)(uintptr_t)stream);
        cdl_capture_mode_leave(rt, &relaxed);
        Py_END_ALLOW_THREADS
        if (code != cudaSuccess)
            result = cdl_raise_cuda_error("cudaStreamSynchronize", code);
    }
    if (enter && cdl_device_leave(rt, &scope) != 0 && result == 0)
        result = cdl_raise_scope_error(&scope);
    return result;
}

int cdl_legacy_stream_unusable(void)
{
    const cdl_cudart *rt = cdl_cudart_loaded();
    if (rt == NULL)
        return 0; /* no runtime loaded: nobody in this process captures through it */
    cdl_capture legacy;
    if (cdl_capture_of(rt, CDL_STREAM_LEGACY, &legacy) < 0)
        return -1;
    return legacy.state == CDL_CAPTURE_LEGACY_UNUSABLE;
}

int cdl_current_work_stream(DLDeviceType device_type, int32_t device_id, void **out)
{
    *out = NULL; /* the legacy default stream */
    if (!cdl_device_accessible(device_type))
        return 0;
    return cdl_check_legacy_stream(device_type, device_id, "the exchange API's work stream is");
}

PyObject *cdl_options(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    (void)module;
    PyObject *names[] = {cdl_name.sync, cdl_name.export_stream, cdl_name.trust_streams};
    PyObject *values[] = {NULL, NULL, NULL};
    _Atomic int *options[] = {&cdl_option_sync, &cdl_option_export_stream, &cdl_option_trust_streams};
    enum { count = sizeof options / sizeof options[0] };
    if (cdl_parse_keywords("options", args, nargs, kwnames, 0, names, values, count) < 0)
        return NULL;
    for (int i = 0; i < count; i++) {
        if (values[i] != NULL && values[i] != Py_None && !PyBool_Check(values[i])) {
            /* The value as repr shows it; a repr that fails leaves it out, the refusal is the error to report. */
            PyObject *shown = PyObject_Repr(values[i]);
            if (shown == NULL && !PyErr_ExceptionMatches(PyExc_Exception))
                return NULL;
            PyErr_Clear();
            if (shown != NULL)
                PyErr_Format(PyExc_TypeError, "options(%U=%.200U) must be a bool, not %.200s", names[i], shown,
                             Py_TYPE(values[i])->tp_name);
            else
                PyErr_Format(PyExc_TypeError, "options(%U=...) must be a bool, not %.200s", names[i],
                             Py_TYPE(values[i])->tp_name);
            Py_XDECREF(shown);
            return NULL;
        }
    }
    /* Applied only once every argument is known to be valid (nothing half-done), and only those named: another
     * thread's setting of an option this call does not name is left as that thread made it. */
    for (int i = 0; i < count; i++)
        if (values[i] != NULL && values[i] != Py_None)
            *options[i] = values[i] == Py_True;
    return Py_BuildValue("{s:O, s:O, s:O}", "sync", cdl_option_sync ? Py_True : Py_False, "export_stream",
                         cdl_option_export_stream ? Py_True : Py_False, "trust_streams",
                         cdl_option_trust_streams ? Py_True : Py_False);
}
