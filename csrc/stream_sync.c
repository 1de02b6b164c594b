/* Stream ordering between a producer and a consumer: an event recorded on the producer's stream
 * and waited on by the consumer's, so the device orders the work and the host never blocks. */
#include "cdl_internal.h"
#include "cuda_runtime_table.h"

#include <stdlib.h>
#include <string.h>

int cdl_option_sync = 1;
int cdl_option_export_stream = 1;

/* Reusable events, one per context (keyed by the context's id, unique for the process's lifetime), or
 * per device where the driver's calls are missing. A stream that waits on an event captures the
 * event's state at cudaStreamWaitEvent time, so the event can be recorded again at once; the GIL,
 * held through record and wait, keeps two conversions from sharing one between those calls. A
 * device reset destroys a context and its events: the next conversion sees another id and makes a
 * new event. At most CDL_POOL_LIMIT are kept; past that the oldest entry is given up (not destroyed:
 * its context may be gone). */
typedef struct {
    unsigned long long key;
    cudaEvent_t event;
} cdl_pool_entry;
#define CDL_POOL_LIMIT 64
static cdl_pool_entry cdl_event_pool[CDL_POOL_LIMIT];
static int cdl_event_pool_used, cdl_event_pool_next;

static int cdl_env_flag(const char *name, int fallback)
{
    const char *value = getenv(name);
    if (value == NULL || value[0] == '\0')
        return fallback;
    return !(strcmp(value, "0") == 0 || strcmp(value, "false") == 0 || strcmp(value, "False") == 0 ||
             strcmp(value, "no") == 0 || strcmp(value, "off") == 0);
}

void cdl_stream_options_init(void)
{
    cdl_option_sync = cdl_env_flag("CAI_DLPACK_SYNC", 1);
    cdl_option_export_stream = cdl_env_flag("CAI_DLPACK_EXPORT_STREAM", 1);
}

int cdl_parse_stream(PyObject *value, const char *what, int consumer, int64_t *out)
{
    if (value == NULL || value == Py_None) {
        /* The array API's None is the legacy default stream; a CAI's None is "no stream". */
        *out = consumer ? CDL_STREAM_LEGACY : 0;
        return 0;
    }
    if (!PyLong_Check(value) || PyBool_Check(value)) {
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

/* The pool's entry for key, or NULL. */
static cdl_pool_entry *cdl_pool_find(unsigned long long key)
{
    for (int i = 0; i < cdl_event_pool_used; i++) {
        if (cdl_event_pool[i].key == key)
            return &cdl_event_pool[i];
    }
    return NULL;
}

/* The pool's event for key, made when there is none. */
static int cdl_pooled_event(const cdl_cudart *rt, unsigned long long key, cudaEvent_t *event)
{
    cdl_pool_entry *entry = cdl_pool_find(key);
    if (entry != NULL) {
        *event = entry->event;
        return 0;
    }
    cudaError_t status = rt->event_create_with_flags(event, cudaEventDisableTiming);
    if (status != cudaSuccess)
        return cdl_raise_cuda_error("cudaEventCreateWithFlags", status);
    entry = &cdl_event_pool[cdl_event_pool_used < CDL_POOL_LIMIT ? cdl_event_pool_used++ : cdl_event_pool_next];
    cdl_event_pool_next = (cdl_event_pool_next + 1) % CDL_POOL_LIMIT;
    entry->key = key;
    entry->event = *event;
    return 0;
}

/* Records event on the producer stream. A pooled event whose context was reset under the same id is a
 * dead handle: the record is tried once more with a new event, which replaces it in the pool only if
 * that record works (else the failure is the stream's, and the new event is destroyed: no leak). */
static int cdl_record(const cdl_cudart *rt, unsigned long long key, int64_t producer, cudaEvent_t *event)
{
    cudaError_t status = rt->event_record(*event, (cudaStream_t)(uintptr_t)producer);
    if (status == cudaErrorInvalidResourceHandle || status == cudaErrorContextIsDestroyed) {
        (void)rt->get_last_error();
        cudaEvent_t fresh;
        cudaError_t made = rt->event_create_with_flags(&fresh, cudaEventDisableTiming);
        if (made != cudaSuccess)
            return cdl_raise_cuda_error("cudaEventCreateWithFlags", made);
        cudaError_t again = rt->event_record(fresh, (cudaStream_t)(uintptr_t)producer);
        if (again == cudaSuccess) {
            cdl_pool_find(key)->event = *event = fresh;
            return 0;
        }
        (void)rt->get_last_error();
        (void)rt->event_destroy(fresh);
    }
    return status == cudaSuccess ? 0 : cdl_raise_cuda_error("cudaEventRecord", status);
}

/* Waits consumer on event; 0 or -1 with CudaError. */
static int cdl_wait(const cdl_cudart *rt, int64_t consumer, cudaEvent_t event)
{
    cudaError_t status = rt->stream_wait_event((cudaStream_t)(uintptr_t)consumer, event, 0);
    return status == cudaSuccess ? 0 : cdl_raise_cuda_error("cudaStreamWaitEvent", status);
}

int cdl_order_streams(const cdl_array *arr, int64_t consumer)
{
    const DLDevice device = arr->device;
    const int64_t producer = arr->stream;
    if (!cdl_option_sync || producer == 0 || consumer == CDL_STREAM_NO_SYNC || producer == consumer)
        return 0;
    if (device.device_type == kDLCPU)
        return 0;
    /* No elements, nothing to race on. Producers give such arrays a NULL pointer, so the device is
     * only a guess (the current one) and may not be the producer stream's: recording there would fail. */
    for (int32_t i = 0; i < arr->ndim; i++) {
        if (arr->shape[i] == 0)
            return 0;
    }
    const cdl_cudart *rt = cdl_cudart_get();
    if (rt == NULL)
        return -1;
    /* The event is recorded in the producer stream's context (event and stream must share one): a
     * stream handle's own, and for the legacy and per-thread handles the primary context of the data's
     * device (the array API's streams belong to the array's device), or for pinned and managed memory,
     * which any device may use, of the allocation's. */
    cdl_device_scope scope;
    int entered;
    if (producer > CDL_STREAM_PER_THREAD && rt->cu_stream_get_ctx != NULL) {
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
    /* A legacy or per-thread consumer handle names the stream of the caller's device: for pinned and
     * managed memory that is the caller's own context, so that wait comes after the scope is left. */
    const int wait_outside = device.device_type != kDLCUDA && consumer <= CDL_STREAM_PER_THREAD;
    int result = -1;
    unsigned long long key;
    cudaEvent_t event = NULL;
    if (cdl_pool_key(rt, &scope, arr->home_device, &key) < 0 || cdl_pooled_event(rt, key, &event) < 0 ||
        cdl_record(rt, key, producer, &event) < 0)
        goto done;
    result = wait_outside ? 0 : cdl_wait(rt, consumer, event);
done:
    if (cdl_device_leave(rt, &scope) != 0 && result == 0)
        result = cdl_raise_scope_error(&scope);
    if (result == 0 && wait_outside)
        result = cdl_wait(rt, consumer, event);
    return result;
}

PyObject *cdl_options(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    (void)module;
    PyObject *names[] = {cdl_name.sync, cdl_name.export_stream};
    PyObject *values[] = {NULL, NULL};
    int *options[] = {&cdl_option_sync, &cdl_option_export_stream};
    if (cdl_parse_keywords("options", args, nargs, kwnames, 0, names, values, 2) < 0)
        return NULL;
    int chosen[2];
    for (int i = 0; i < 2; i++) {
        chosen[i] = *options[i];
        if (values[i] != NULL && values[i] != Py_None) {
            if (!PyBool_Check(values[i])) {
                PyErr_Format(PyExc_TypeError, "options(%U=...) must be a bool, not %.200s", names[i],
                             Py_TYPE(values[i])->tp_name);
                return NULL;
            }
            chosen[i] = values[i] == Py_True;
        }
    }
    /* Applied only once every argument is known to be valid: nothing half-done. */
    for (int i = 0; i < 2; i++)
        *options[i] = chosen[i];
    return Py_BuildValue("{s:O, s:O}", "sync", cdl_option_sync ? Py_True : Py_False, "export_stream",
                         cdl_option_export_stream ? Py_True : Py_False);
}
