/* The C-speed doors: the public C API table (include/cai_dlpack/cai_dlpack.h, exported as the capsule
 * cai_dlpack._C_API) and the DLPack C exchange API (__dlpack_c_exchange_api__) on DLPackShim and
 * DLPackView. Both are thin: they call the same converters as the Python functions. */
#include "cdl_internal.h"
#include "cuda_runtime_table.h"

#include <cai_dlpack/cai_dlpack.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Reads obj into *arr: our shim (its wrapped object's interface) or view, or any interface object.
 * *owner receives the borrowed object that keeps the memory alive. */
static int cdl_array_of(PyObject *obj, cdl_array *arr, PyObject **owner, PyObject **keepalive)
{
    *keepalive = NULL;
    if (PyObject_TypeCheck(obj, &cdl_view_type)) {
        cdl_array_from_view(obj, arr);
        *owner = obj;
        return 0;
    }
    *owner = PyObject_TypeCheck(obj, &cdl_shim_type) ? ((cdl_shim *)obj)->obj : obj;
    return cdl_array_from_object(*owner, arr, keepalive);
}

/* The stream argument for obj.__dlpack__: None for host producers (the array API allows no other),
 * the consumer's stream otherwise. A new reference, or NULL with an exception set. */
static PyObject *cdl_stream_for_producer(PyObject *obj, int64_t consumer_stream)
{
    PyObject *device = PyObject_CallMethodNoArgs(obj, cdl_name.dlpack_device);
    if (device == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_AttributeError))
            return NULL;
        PyErr_Clear();
    }
    int host = device != NULL && PyTuple_Check(device) && PyTuple_GET_SIZE(device) == 2 &&
               PyLong_Check(PyTuple_GET_ITEM(device, 0)) && PyLong_AsLong(PyTuple_GET_ITEM(device, 0)) == kDLCPU;
    Py_XDECREF(device);
    return host ? Py_NewRef(Py_None) : PyLong_FromLongLong(consumer_stream);
}

/* The array API's stream rule for C callers: -1, 1, 2 or a handle; 0 and other negatives are refused. */
static int cdl_check_consumer_stream(int64_t consumer_stream)
{
    if (consumer_stream == 0 || consumer_stream < CDL_STREAM_NO_SYNC) {
        PyErr_Format(PyExc_ValueError, "consumer stream %lld is not a valid stream", (long long)consumer_stream);
        return -1;
    }
    return 0;
}

/* ---- public C API ------------------------------------------------------------------------------- */

static int cdl_api_to_managed_tensor(PyObject *obj, int64_t consumer_stream, DLManagedTensorVersioned **out)
{
    *out = NULL;
    if (cdl_check_consumer_stream(consumer_stream) < 0)
        return -1;
    PyObject *view = NULL;
    if (!PyObject_TypeCheck(obj, &cdl_shim_type) && !PyObject_TypeCheck(obj, &cdl_view_type) &&
        PyObject_HasAttr(obj, cdl_name.dlpack)) {
        /* A DLPack producer orders its own work before the stream it is given. */
        PyObject *stream = cdl_stream_for_producer(obj, consumer_stream);
        view = stream ? cdl_view_from_object(obj, stream) : NULL;
        Py_XDECREF(stream);
        if (view == NULL)
            return -1;
        obj = view;
    }
    cdl_array arr;
    PyObject *owner, *keepalive;
    int status = -1;
    if (cdl_array_of(obj, &arr, &owner, &keepalive) == 0 &&
        (view != NULL || cdl_order_streams(&arr, consumer_stream) == 0)) {
        *out = cdl_managed_from_array(&arr, owner, keepalive, 1);
        status = *out ? 0 : -1;
    }
    Py_XDECREF(keepalive);
    Py_XDECREF(view);
    return status;
}

static int cdl_api_fill_tensor(PyObject *obj, int64_t consumer_stream, DLTensor *out, int64_t *shape,
                               int64_t *strides, int capacity, int *read_only)
{
    if (cdl_check_consumer_stream(consumer_stream) < 0)
        return -1;
    cdl_array arr;
    PyObject *owner, *keepalive;
    if (cdl_array_of(obj, &arr, &owner, &keepalive) < 0)
        return -1;
    /* A buffer's memoryview is the only thing keepalive holds, and the buffer is owned by obj's
     * interface: the borrowed tensor lives as long as obj does. */
    Py_XDECREF(keepalive);
    if (arr.ndim > capacity) {
        PyErr_Format(PyExc_ValueError, "the array has %d dimensions but the caller's storage holds %d",
                     (int)arr.ndim, capacity);
        return -1;
    }
    if (cdl_order_streams(&arr, consumer_stream) < 0)
        return -1;
    memcpy(shape, arr.shape, (size_t)arr.ndim * sizeof(int64_t));
    memcpy(strides, arr.strides, (size_t)arr.ndim * sizeof(int64_t));
    out->data = arr.data;
    out->device = arr.device;
    out->ndim = arr.ndim;
    out->dtype = arr.dtype;
    out->shape = shape;
    out->strides = strides;
    out->byte_offset = 0;
    if (read_only != NULL)
        *read_only = arr.read_only;
    return 0;
}

static PyObject *cdl_api_view_from_managed_tensor(DLManagedTensorVersioned *managed, int64_t stream)
{
    return cdl_view_new(managed, 1, stream);
}

static const cai_dlpack_api cdl_public_api = {
    CAI_DLPACK_API_MAJOR,
    CAI_DLPACK_API_MINOR,
    cdl_api_to_managed_tensor,
    cdl_api_fill_tensor,
    cdl_api_view_from_managed_tensor,
};

/* ---- DLPack C exchange API ------------------------------------------------------------------------
 * The no-sync calls cannot tell the consumer about a CAI producer stream, so they order that stream
 * before the work stream they report (the legacy default stream) on the device, without blocking the
 * host. A consumer that launches on the reported stream never races the producer. */

static int cdl_exchange_from_object(void *py_object, DLManagedTensorVersioned **out)
{
    return cdl_api_to_managed_tensor((PyObject *)py_object, CDL_STREAM_LEGACY, out);
}

static int cdl_exchange_dltensor_from_object(void *py_object, DLTensor *out)
{
    PyObject *obj = py_object;
    if (PyObject_TypeCheck(obj, &cdl_view_type)) {
        /* The view's own tensor: borrowed shape and strides, nothing to copy. */
        cdl_array arr;
        cdl_array_from_view(obj, &arr);
        if (cdl_order_streams(&arr, CDL_STREAM_LEGACY) < 0)
            return -1;
        *out = *cdl_view_tensor(obj);
        return 0;
    }
    if (!PyObject_TypeCheck(obj, &cdl_shim_type)) {
        PyErr_Format(PyExc_TypeError, "%.200s is neither a DLPackShim nor a DLPackView", Py_TYPE(obj)->tp_name);
        return -1;
    }
    /* The shape and strides live in the shim until its next conversion: the exchange API promises them
     * only until control returns to the caller. */
    cdl_shim *shim = (cdl_shim *)obj;
    if (shim->dims == NULL) {
        shim->dims = PyMem_Malloc(2 * CDL_MAX_NDIM * sizeof(int64_t));
        if (shim->dims == NULL) {
            PyErr_NoMemory();
            return -1;
        }
    }
    return cdl_api_fill_tensor(obj, CDL_STREAM_LEGACY, out, shim->dims, shim->dims + CDL_MAX_NDIM, CDL_MAX_NDIM,
                               NULL);
}

static int cdl_exchange_to_object(DLManagedTensorVersioned *tensor, void **out_py_object)
{
    /* The consumer made the tensor on the work stream we reported. */
    PyObject *view = cdl_view_new(tensor, 1, CDL_STREAM_LEGACY);
    *out_py_object = view;
    return view ? 0 : -1;
}

static int cdl_exchange_current_work_stream(DLDeviceType device_type, int32_t device_id, void **out)
{
    (void)device_type;
    (void)device_id;
    *out = NULL; /* the default (legacy) stream */
    return 0;
}

/* Tensors made for a consumer: one allocation holds the managed tensor, shape and strides; the data
 * is a separate allocation of the kind the device needs. Runs without the GIL: no Python here. */
typedef struct {
    DLManagedTensorVersioned managed;
    int64_t dims[];
} cdl_made_tensor;

static void cdl_free_made_tensor(DLManagedTensorVersioned *self)
{
    cdl_made_tensor *made = self->manager_ctx;
    const cdl_cudart *rt = cdl_cudart_loaded();
    switch (self->dl_tensor.device.device_type) {
    case kDLCPU:
        free(self->dl_tensor.data);
        break;
    case kDLCUDAHost:
        if (rt && rt->free_host(self->dl_tensor.data) != cudaSuccess)
            (void)rt->get_last_error();
        break;
    default:
        if (rt) {
            /* Device memory is freed in its device's context: on a thread with none, the runtime would
             * otherwise bind (and make) its own device's primary context just for the free. */
            cdl_device_scope scope;
            int device_memory = self->dl_tensor.device.device_type == kDLCUDA;
            int entered = device_memory ? cdl_device_enter(rt, self->dl_tensor.device.device_id, &scope) : 0;
            if (rt->free(self->dl_tensor.data) != cudaSuccess)
                (void)rt->get_last_error();
            if (device_memory && entered == 0)
                (void)cdl_device_leave(rt, &scope);
        }
        break;
    }
    free(made);
}

static int cdl_exchange_allocate(DLTensor *prototype, DLManagedTensorVersioned **out, void *error_ctx,
                                 void (*set_error)(void *error_ctx, const char *kind, const char *message))
{
    char message[256];
    int32_t ndim = prototype->ndim;
    uint64_t bytes = (uint64_t)cdl_itemsize(prototype->dtype);
    if (ndim < 0 || ndim > CDL_MAX_NDIM || (ndim > 0 && prototype->shape == NULL)) {
        set_error(error_ctx, "ValueError", "cai_dlpack allocator: bad prototype ndim or shape");
        return -1;
    }
    for (int32_t i = 0; i < ndim; i++) {
        if (prototype->shape[i] < 0 || __builtin_mul_overflow(bytes, (uint64_t)prototype->shape[i], &bytes)) {
            set_error(error_ctx, "ValueError", "cai_dlpack allocator: bad or overflowing prototype shape");
            return -1;
        }
    }
    cdl_made_tensor *made = calloc(1, sizeof(cdl_made_tensor) + 2 * (size_t)ndim * sizeof(int64_t));
    if (made == NULL) {
        set_error(error_ctx, "MemoryError", "cai_dlpack allocator: out of host memory");
        return -1;
    }
    size_t size = bytes ? (size_t)bytes : 1;
    void *data = NULL;
    DLDeviceType type = prototype->device.device_type;
    if (type == kDLCPU) {
        data = aligned_alloc(64, (size + 63) / 64 * 64);
        if (data == NULL)
            snprintf(message, sizeof(message), "cai_dlpack allocator: cannot allocate %zu host bytes", size);
    }
    else if (type == kDLCUDA || type == kDLCUDAHost || type == kDLCUDAManaged) {
        const cdl_cudart *rt = cdl_cudart_get_any_thread(); /* a consumer's first call may be this one */
        /* Device memory is made in its device's context; pinned and managed memory, which any device
         * may use, in the caller's (entering device 0's would make a context there). */
        cdl_device_scope scope = {0};
        int status = rt == NULL ? -1 : type == kDLCUDA ? cdl_device_enter(rt, prototype->device.device_id, &scope) : 0;
        const char *failed = scope.failed_call;
        int in_driver = scope.failed_in_driver;
        if (status == 0) {
            status = type == kDLCUDA       ? rt->malloc(&data, size)
                     : type == kDLCUDAHost ? rt->malloc_host(&data, size)
                                           : rt->malloc_managed(&data, size, cudaMemAttachGlobal);
            failed = type == kDLCUDA ? "cudaMalloc" : type == kDLCUDAHost ? "cudaMallocHost" : "cudaMallocManaged";
            if (status == 0 && cdl_device_leave(rt, &scope) != 0) {
                /* The memory is made, but the caller's device could not be put back: refuse it. */
                if ((type == kDLCUDAHost ? rt->free_host(data) : rt->free(data)) != cudaSuccess)
                    (void)rt->get_last_error();
                status = scope.failed_code, failed = scope.failed_call, in_driver = scope.failed_in_driver;
            }
            else if (status != 0) {
                (void)cdl_device_leave(rt, &scope);
            }
        }
        if (status != 0) {
            snprintf(message, sizeof(message), "cai_dlpack allocator: %zu bytes on device (%d, %d): %s%s%s", size,
                     (int)type, (int)prototype->device.device_id, rt ? failed : "",
                     rt ? " failed: " : "", rt ? cdl_error_name(rt, status, in_driver) : "no CUDA runtime found");
            if (rt && !in_driver)
                (void)rt->get_last_error();
            data = NULL;
        }
    }
    else {
        snprintf(message, sizeof(message), "cai_dlpack allocator: device type %d is not supported", (int)type);
    }
    if (data == NULL) {
        free(made);
        set_error(error_ctx, "RuntimeError", message);
        return -1;
    }
    DLManagedTensorVersioned *m = &made->managed;
    m->version.major = DLPACK_MAJOR_VERSION;
    m->version.minor = DLPACK_MINOR_VERSION;
    m->manager_ctx = made;
    m->deleter = cdl_free_made_tensor;
    m->dl_tensor.data = data;
    m->dl_tensor.device = prototype->device;
    m->dl_tensor.ndim = ndim;
    m->dl_tensor.dtype = prototype->dtype;
    m->dl_tensor.shape = made->dims;
    m->dl_tensor.strides = made->dims + ndim;
    if (ndim > 0)
        memcpy(made->dims, prototype->shape, (size_t)ndim * sizeof(int64_t));
    (void)cdl_contiguous_strides(ndim, made->dims, made->dims + ndim); /* the size check above bounds them */
    *out = m;
    return 0;
}

static const DLPackExchangeAPI cdl_exchange_api = {
    {{DLPACK_MAJOR_VERSION, DLPACK_MINOR_VERSION}, NULL},
    cdl_exchange_allocate,
    cdl_exchange_from_object,
    cdl_exchange_to_object,
    cdl_exchange_dltensor_from_object,
    cdl_exchange_current_work_stream,
};

int cdl_c_api_init(PyObject *module)
{
    PyObject *api = PyCapsule_New((void *)&cdl_public_api, CAI_DLPACK_API_CAPSULE, NULL);
    if (api == NULL || PyModule_AddObjectRef(module, "_C_API", api) < 0) {
        Py_XDECREF(api);
        return -1;
    }
    Py_DECREF(api);
    /* DLPack 1.3 reads a capsule type attribute; DLPack 1.2 consumers read the address as an int. */
    PyObject *exchange = PyCapsule_New((void *)&cdl_exchange_api, "dlpack_exchange_api", NULL);
    PyObject *address = PyLong_FromVoidPtr((void *)&cdl_exchange_api);
    PyTypeObject *types[] = {&cdl_shim_type, &cdl_view_type};
    int status = exchange && address ? 0 : -1;
    for (size_t i = 0; status == 0 && i < 2; i++) {
        if (PyDict_SetItemString(types[i]->tp_dict, "__dlpack_c_exchange_api__", exchange) < 0 ||
            PyDict_SetItemString(types[i]->tp_dict, "__c_dlpack_exchange_api__", address) < 0)
            status = -1;
        PyType_Modified(types[i]);
    }
    Py_XDECREF(exchange);
    Py_XDECREF(address);
    return status;
}
