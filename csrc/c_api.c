/* The C-speed doors: the public C API table (include/cai_dlpack/cai_dlpack.h, exported as the capsule
 * cai_dlpack._C_API) and the DLPack C exchange API (__dlpack_c_exchange_api__) on DLPackShim and
 * DLPackView. Both are thin: they call the same converters as the Python functions. */
#include "cdl_internal.h"

#include <cai_dlpack/cai_dlpack.h>
#include <string.h>

/* Reads obj into *arr: our shim (its wrapped object's interface) or view, or any interface object.
 * *owner receives the borrowed object that keeps the memory alive. */
static int cdl_array_of(PyObject *obj, cdl_array *arr, PyObject **owner, PyObject **keepalive)
{
    *keepalive = NULL;
    if (PyObject_TypeCheck(obj, &cdl_view_type)) {
        if (cdl_array_from_view(obj, arr) < 0)
            return -1;
        *owner = obj;
        return 0;
    }
    const int shim = PyObject_TypeCheck(obj, &cdl_shim_type);
    if (shim)
        cdl_shim_drop_reading((cdl_shim *)obj);
    *owner = shim ? cdl_shim_wrapped((cdl_shim *)obj) : obj;
    if (*owner == NULL)
        return -1;
    return cdl_array_from_object(*owner, shim ? cdl_shim_dtype((cdl_shim *)obj) : NULL, arr, keepalive);
}

/* Whether op dies when we drop our reference. Py_REFCNT is the whole count on every build: on free-threaded ones
 * it adds the owning thread's local part and the shared part, leaving out the shared field's flags. It can be
 * off only while another thread is changing the count, that is, while another thread holds op (then it is not
 * ours alone). 3.14's PyUnstable_Object_IsUniquelyReferenced answers a stricter question (may a new reference
 * appear?) and says no for any object a weakref points at, which here would lend a buffer about to be freed. */
static int cdl_dies_with_our_reference(PyObject *op)
{
    return Py_REFCNT(op) == 1;
}

/* The borrowed path keeps nothing: drops keepalive (the hold of a buffer an array interface named),
 * refusing the tensor when that buffer would die with it. obj's own buffer lives as long as obj; a
 * buffer object its interface made for this one access (NumPy's protocol allows a fresh one each time)
 * is freed on return, and a borrowed tensor would point into freed memory. Returns 0, or -1 with
 * BufferError. */
static int cdl_release_borrowed_buffer(PyObject *owner, PyObject *keepalive)
{
    if (keepalive == NULL)
        return 0;
    PyObject *exporter = Py_XNewRef(cdl_keepalive_exporter(keepalive));
    Py_DECREF(keepalive);
    /* After the view is gone, a unique reference is our own: nothing else holds the buffer. */
    int dying = exporter != NULL && exporter != owner && cdl_dies_with_our_reference(exporter);
    if (dying)
        PyErr_Format(PyExc_BufferError,
                     "the %.200s that %.200s's __array_interface__ 'data' names is held by nothing but this call, "
                     "so a borrowed tensor would outlive its memory; take an owning tensor (to_managed_tensor, "
                     "managed_tensor_from_py_object_no_sync) instead",
                     Py_TYPE(exporter)->tp_name, Py_TYPE(owner)->tp_name);
    Py_XDECREF(exporter);
    return dying ? -1 : 0;
}

/* Whether obj's type speaks either array interface (presence only: the borrowed results are never read). */
static int cdl_has_interface(PyObject *obj)
{
    return _PyType_Lookup(Py_TYPE(obj), cdl_name.cuda_array_interface) != NULL ||
           _PyType_Lookup(Py_TYPE(obj), cdl_name.array_interface) != NULL;
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
        return PyLong_FromLongLong(consumer_stream);
    }
    int overflow = 0;
    long type = -1;
    if (PyTuple_Check(device) && PyTuple_GET_SIZE(device) == 2 && PyLong_Check(PyTuple_GET_ITEM(device, 0)) &&
        PyLong_Check(PyTuple_GET_ITEM(device, 1)))
        type = PyLong_AsLongAndOverflow(PyTuple_GET_ITEM(device, 0), &overflow);
    if (type < kDLCPU || overflow || type > INT32_MAX) { /* DLPack's device types count from kDLCPU, 1 */
        if (!PyErr_Occurred())
            PyErr_Format(PyExc_ValueError,
                         "%.200s.__dlpack_device__() returned %R, not a (device_type, device_id) pair of DLPack "
                         "device numbers",
                         Py_TYPE(obj)->tp_name, device);
        Py_DECREF(device);
        return NULL;
    }
    Py_DECREF(device);
    return type == kDLCPU ? Py_NewRef(Py_None) : PyLong_FromLongLong(consumer_stream);
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
    /* The tensor would hold the dict, which does not keep the memory it describes alive (cai2dlpack asks
     * for owner= there; this door has none). */
    if (PyDict_Check(obj)) {
        PyErr_SetString(PyExc_TypeError,
                        "to_managed_tensor() of a bare interface dict: nothing would keep its memory alive; pass "
                        "the object that owns the memory, or a view of one: dlpack2cai(cai2dlpack(d, owner=...))");
        return -1;
    }
    PyObject *view = NULL;
    int taken = cdl_view_from_exchange_api(obj, consumer_stream, &view);
    if (taken < 0)
        return -1;
    if (taken == 0 && !PyObject_TypeCheck(obj, &cdl_shim_type) && !PyObject_TypeCheck(obj, &cdl_view_type) &&
        PyObject_HasAttr(obj, cdl_name.dlpack)) {
        /* A DLPack producer orders its own work before the stream it is given. */
        PyObject *stream = cdl_stream_for_producer(obj, consumer_stream);
        view = stream ? cdl_view_from_object(obj, stream, 0) : NULL;
        Py_XDECREF(stream);
        if (view == NULL) {
            /* A producer whose DLPack export cannot describe its data (NumPy's, for an ml_dtypes array) may
             * still describe it through its array interface, which is read instead. */
            if (!PyErr_ExceptionMatches(PyExc_BufferError))
                return -1;
            /* (the attribute lookups of cdl_has_interface must not run with the producer's error set) */
            PyObject *type, *value, *traceback;
            PyErr_Fetch(&type, &value, &traceback);
            int has_interface = cdl_has_interface(obj);
            if (!has_interface) {
                PyErr_Restore(type, value, traceback);
                return -1;
            }
            Py_XDECREF(type);
            Py_XDECREF(value);
            Py_XDECREF(traceback);
        }
    }
    if (view != NULL)
        obj = view;
    cdl_array arr;
    PyObject *owner, *keepalive;
    int status = -1;
    if (cdl_array_of(obj, &arr, &owner, &keepalive) == 0 &&
        (view != NULL || cdl_order_streams(&arr, consumer_stream) == 0)) {
        cdl_managed managed = cdl_managed_from_array(&arr, owner, keepalive, 1);
        if (managed.pointer != NULL) {
            /* Its deleter keeps owner alive until the consumer's stream has run what it queued by then. */
            cdl_release_point point;
            cdl_release_point_for_drop(&point, consumer_stream, &arr);
            cdl_managed_order_release(managed, &point, 0);
        }
        *out = managed.pointer;
        status = *out ? 0 : -1;
    }
    Py_XDECREF(keepalive);
    Py_XDECREF(view);
    return status;
}

/* fill_tensor through a producer's exchange table: its borrowed DLTensor, validated (its work is not
 * ordered yet: *api is for that). Returns 1 with *arr and *api set, 0 when the table does not lend tensors,
 * cdl_exchange_usable turns it down or the call raises (the caller reads obj's interface instead), or -1. */
static int cdl_array_from_exchange_api(PyObject *obj, cdl_array *arr, const DLPackExchangeAPI **api)
{
    *api = cdl_producer_exchange_api(obj);
    if (*api == NULL || (*api)->dltensor_from_py_object_no_sync == NULL)
        return 0;
    DLTensor tensor;
    if ((*api)->dltensor_from_py_object_no_sync(obj, &tensor) != 0) {
        PyErr_Clear(); /* the interface is read instead, and says why in its own words */
        return 0;
    }
    /* The borrowed tensor is the producer's only until control goes back to it, and the checks below run
     * Python code (a subclass may override them): it is read into the record first, by C code alone. */
    DLDataType dtype = tensor.dtype;
    int valid = cdl_array_from_tensor(&tensor, 0, arr);
    cdl_pending_error invalid = {0}; /* stashed only when the tensor is refused */
    if (valid < 0)
        cdl_error_stash(&invalid);
    int usable = cdl_exchange_usable(obj, dtype);
    if (valid < 0) {
        /* A tensor the checks turn down is read through the interface, which says why in its own words. */
        if (usable > 0) {
            cdl_error_unstash(&invalid);
            return -1;
        }
        cdl_error_discard(&invalid);
    }
    return usable <= 0 ? usable : 1;
}

static int cdl_refuse_read_only_dltensor(PyObject *obj);

/* fill_tensor; with refuse_read_only (the exchange API's DLTensor, which cannot say read-only), read-only
 * memory is refused before any stream is ordered for a tensor that will not be lent. */
static int cdl_fill_tensor(PyObject *obj, int64_t consumer_stream, DLTensor *out, int64_t *shape,
                           int64_t *strides, int capacity, int *read_only, int refuse_read_only)
{
    if (cdl_check_consumer_stream(consumer_stream) < 0)
        return -1;
    cdl_array arr;
    const DLPackExchangeAPI *api;
    int taken = cdl_array_from_exchange_api(obj, &arr, &api);
    if (taken < 0)
        return -1;
    if (taken == 0) {
        PyObject *owner, *keepalive;
        if (cdl_array_of(obj, &arr, &owner, &keepalive) < 0 || cdl_release_borrowed_buffer(owner, keepalive) < 0)
            return -1;
    }
    if (arr.ndim > capacity) {
        PyErr_Format(PyExc_ValueError, "the array has %d dimensions but the caller's storage holds %d",
                     (int)arr.ndim, capacity);
        return -1;
    }
    if (refuse_read_only && arr.read_only)
        return cdl_refuse_read_only_dltensor(obj);
    if ((taken ? cdl_order_exchange_producer(api, obj, &arr, consumer_stream) : cdl_order_streams(&arr, consumer_stream)) < 0)
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

static int cdl_api_fill_tensor(PyObject *obj, int64_t consumer_stream, DLTensor *out, int64_t *shape,
                               int64_t *strides, int capacity, int *read_only)
{
    return cdl_fill_tensor(obj, consumer_stream, out, shape, strides, capacity, read_only, 0);
}

static PyObject *cdl_api_view_from_managed_tensor(DLManagedTensorVersioned *managed, int64_t stream)
{
    cdl_managed handle = cdl_managed_versioned(managed);
    if (managed == NULL) {
        PyErr_SetString(PyExc_ValueError, "view_from_managed_tensor() was given a NULL tensor");
        return NULL;
    }
    /* The tensor is stolen on every path: refused, its deleter runs here. */
    if (cdl_check_consumer_stream(stream) < 0) {
        cdl_managed_delete(&handle);
        return NULL;
    }
    return cdl_view_new(handle, stream);
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

/* A DLTensor has no flags: lent read-only memory would look writable to the consumer, so it is refused
 * (BufferError, the exchange API's word for data DLPack cannot describe); the managed tensor carries
 * DLPACK_FLAG_BITMASK_READ_ONLY. Returns -1. */
static int cdl_refuse_read_only_dltensor(PyObject *obj)
{
    PyErr_Format(PyExc_BufferError,
                 "this %.200s's memory is read-only, which a DLTensor cannot say (it has no flags), so "
                 "dltensor_from_py_object_no_sync does not lend it; managed_tensor_from_py_object_no_sync gives a "
                 "tensor flagged DLPACK_FLAG_BITMASK_READ_ONLY",
                 Py_TYPE(obj)->tp_name);
    return -1;
}

static int cdl_exchange_dltensor_from_object(void *py_object, DLTensor *out)
{
    PyObject *obj = py_object;
    if (PyObject_TypeCheck(obj, &cdl_view_type)) {
        /* The view's own tensor: borrowed shape and strides, nothing to copy. */
        cdl_array arr;
        if (cdl_array_from_view(obj, &arr) < 0)
            return -1;
        if (arr.read_only)
            return cdl_refuse_read_only_dltensor(obj);
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
    int64_t *dims = __atomic_load_n(&shim->dims, __ATOMIC_ACQUIRE);
    if (dims == NULL) {
        int64_t *made = PyMem_RawMalloc(2 * CDL_MAX_NDIM * sizeof(int64_t));
        if (made == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        /* Two threads may both make one: the first stored is kept, and is what both lend. */
        int64_t *expected = NULL;
        if (__atomic_compare_exchange_n(&shim->dims, &expected, made, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
            dims = made;
        }
        else {
            PyMem_RawFree(made);
            dims = expected;
        }
    }
    return cdl_fill_tensor(obj, CDL_STREAM_LEGACY, out, dims, dims + CDL_MAX_NDIM, CDL_MAX_NDIM, NULL, 1);
}

static int cdl_exchange_to_object(DLManagedTensorVersioned *tensor, void **out_py_object)
{
    /* The consumer made the tensor on the work stream we reported. */
    *out_py_object = NULL;
    if (tensor == NULL) {
        PyErr_SetString(PyExc_ValueError, "managed_tensor_to_py_object_no_sync() was given a NULL tensor");
        return -1;
    }
    PyObject *view = cdl_view_new(cdl_managed_versioned(tensor), CDL_STREAM_LEGACY);
    *out_py_object = view;
    return view ? 0 : -1;
}

static int cdl_exchange_current_work_stream(DLDeviceType device_type, int32_t device_id, void **out)
{
    return cdl_current_work_stream(device_type, device_id, out);
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
