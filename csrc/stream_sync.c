/* Stream ordering between a producer and a consumer: an event recorded on the producer's stream
 * and waited on by the consumer's, so the device orders the work and the host never blocks. */
#include "cdl_internal.h"
#include "cuda_runtime_table.h"

#include <stdlib.h>
#include <string.h>

int cdl_option_sync = 1;
int cdl_option_export_stream = 1;

/* One reusable event per device, and the id of the context it was made in. A stream that waits on an
 * event captures the event's state at cudaStreamWaitEvent time, so the event can be recorded again at
 * once; the GIL, held through record and wait, keeps two conversions from sharing one between those
 * calls. A device reset (cudaDeviceReset, cuDevicePrimaryCtxReset) destroys the context and its events:
 * the next conversion finds another context id and makes a new event rather than record a dead handle
 * (which fails, or worse, names an event someone made since). */
typedef struct {
    cudaEvent_t event;
    unsigned long long context_id;
} cdl_pool_entry;
static cdl_pool_entry *cdl_event_pool;
static int cdl_event_pool_size;

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

/* The pool's event of a device, made on first use or when the current context is not the one it was
 * made in. The device must be current, entered through scope. */
static int cdl_pooled_event(const cdl_cudart *rt, int device, const cdl_device_scope *scope, cudaEvent_t *event)
{
    if (device >= cdl_event_pool_size) {
        int size = device + 1 > 8 ? device + 1 : 8;
        cdl_pool_entry *grown = PyMem_RawRealloc(cdl_event_pool, (size_t)size * sizeof(cdl_pool_entry));
        if (grown == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        memset(grown + cdl_event_pool_size, 0, (size_t)(size - cdl_event_pool_size) * sizeof(cdl_pool_entry));
        cdl_event_pool = grown;
        cdl_event_pool_size = size;
    }
    cdl_pool_entry *entry = &cdl_event_pool[device];
    unsigned long long context_id = 0;
    if (rt->cu_ctx_get_id != NULL) {
        void *context = scope->previous_context; /* current, unless the scope switched */
        int code = scope->switched ? rt->cu_ctx_get_current(&context) : 0;
        if (code != 0)
            return cdl_raise_driver_error("cuCtxGetCurrent", code);
        if ((code = rt->cu_ctx_get_id(context, &context_id)) != 0)
            return cdl_raise_driver_error("cuCtxGetId", code);
        if (entry->event != NULL && entry->context_id != context_id)
            entry->event = NULL; /* its context is gone (or not current): the event is not ours to use */
    }
    if (entry->event == NULL) {
        cudaError_t status = rt->event_create_with_flags(&entry->event, cudaEventDisableTiming);
        if (status != cudaSuccess) {
            entry->event = NULL;
            return cdl_raise_cuda_error("cudaEventCreateWithFlags", status);
        }
        entry->context_id = context_id;
    }
    *event = entry->event;
    return 0;
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
    /* The event goes on the producer stream's device. For device memory that is the data's device;
     * pinned and managed memory may be used from any device, so a stream handle is asked for its own
     * (where the runtime can say) and the legacy and per-thread handles keep the allocation's. */
    int event_device = arr->home_device;
    if (device.device_type != kDLCUDA && producer > CDL_STREAM_PER_THREAD && rt->stream_get_device != NULL) {
        cudaError_t status = rt->stream_get_device((cudaStream_t)(uintptr_t)producer, &event_device);
        if (status != cudaSuccess)
            return cdl_raise_cuda_error("cudaStreamGetDevice", status);
    }
    cdl_device_scope scope;
    if (cdl_device_enter(rt, event_device, &scope) != 0)
        return cdl_raise_scope_error(&scope);
    int result = -1;
    cudaEvent_t event = NULL;
    if (cdl_pooled_event(rt, event_device, &scope, &event) < 0)
        goto done;
    cudaError_t status = rt->event_record(event, (cudaStream_t)(uintptr_t)producer);
    if (status != cudaSuccess) {
        cdl_raise_cuda_error("cudaEventRecord", status);
        goto done;
    }
    status = rt->stream_wait_event((cudaStream_t)(uintptr_t)consumer, event, 0);
    if (status != cudaSuccess) {
        cdl_raise_cuda_error("cudaStreamWaitEvent", status);
        goto done;
    }
    result = 0;
done:
    if (cdl_device_leave(rt, &scope) != 0 && result == 0)
        result = cdl_raise_scope_error(&scope);
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
