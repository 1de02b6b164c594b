/* A small extension that accepts any array through cai_dlpack's C API and the DLPack C exchange API,
 * as a kernel library would. Built by the tests (tests/support/c_example.py), never shipped. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <cai_dlpack/cai_dlpack.h>
#include <limits.h>
#include <string.h>

static const cai_dlpack_api *api;

static PyObject *tensor_fields(const DLTensor *t)
{
    PyObject *shape = PyTuple_New(t->ndim), *strides = t->strides ? PyTuple_New(t->ndim) : Py_NewRef(Py_None);
    for (int i = 0; shape && strides && i < t->ndim; i++) {
        PyTuple_SET_ITEM(shape, i, PyLong_FromLongLong(t->shape[i]));
        if (t->strides)
            PyTuple_SET_ITEM(strides, i, PyLong_FromLongLong(t->strides[i]));
    }
    if (shape == NULL || strides == NULL) {
        Py_XDECREF(shape);
        Py_XDECREF(strides);
        return NULL;
    }
    return Py_BuildValue("{s:K, s:(ii), s:i, s:(iii), s:N, s:N, s:K}", "data",
                         (unsigned long long)(uintptr_t)t->data, "device", (int)t->device.device_type,
                         (int)t->device.device_id, "ndim", (int)t->ndim, "dtype", (int)t->dtype.code,
                         (int)t->dtype.bits, (int)t->dtype.lanes, "shape", shape, "strides", strides,
                         "byte_offset", (unsigned long long)t->byte_offset);
}

/* fill(obj, stream) -> fields of the borrowed DLTensor, and read_only */
static PyObject *fill(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *obj;
    long long stream;
    if (!PyArg_ParseTuple(args, "OL", &obj, &stream))
        return NULL;
    DLTensor t;
    int64_t shape[CAI_DLPACK_MAX_NDIM], strides[CAI_DLPACK_MAX_NDIM];
    int read_only;
    if (api->fill_tensor(obj, stream, &t, shape, strides, CAI_DLPACK_MAX_NDIM, &read_only) < 0)
        return NULL;
    PyObject *fields = tensor_fields(&t);
    if (fields && PyDict_SetItemString(fields, "read_only", read_only ? Py_True : Py_False) < 0)
        Py_CLEAR(fields);
    return fields;
}

/* fill_small(obj): fill_tensor with room for only two dimensions */
static PyObject *fill_small(PyObject *self, PyObject *obj)
{
    (void)self;
    DLTensor t;
    int64_t shape[2], strides[2];
    if (api->fill_tensor(obj, 1, &t, shape, strides, 2, NULL) < 0)
        return NULL;
    return tensor_fields(&t);
}

/* The owning tensor of args (obj, stream) by to_managed_tensor; NULL with an exception set. */
static DLManagedTensorVersioned *managed_of(PyObject *args, long long *stream)
{
    PyObject *obj;
    DLManagedTensorVersioned *m;
    if (!PyArg_ParseTuple(args, "OL", &obj, stream) || api->to_managed_tensor(obj, *stream, &m) < 0)
        return NULL;
    return m;
}

/* managed(obj, stream) -> fields of an owning tensor, whose deleter then runs */
static PyObject *managed(PyObject *self, PyObject *args)
{
    (void)self;
    long long stream;
    DLManagedTensorVersioned *m = managed_of(args, &stream);
    if (m == NULL)
        return NULL;
    PyObject *fields = tensor_fields(&m->dl_tensor);
    if (fields) {
        PyObject *extra = Py_BuildValue("(II)K", m->version.major, m->version.minor, (unsigned long long)m->flags);
        if (extra == NULL || PyDict_SetItemString(fields, "version", PyTuple_GET_ITEM(extra, 0)) < 0 ||
            PyDict_SetItemString(fields, "flags", PyTuple_GET_ITEM(extra, 1)) < 0)
            Py_CLEAR(fields);
        Py_XDECREF(extra);
    }
    m->deleter(m);
    return fields;
}

/* view(obj, stream[, view_stream]) -> a DLPackView made from an owning tensor taken on stream, its data
 * said to be ready on view_stream (default: stream) */
static PyObject *view(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *obj;
    long long stream, view_stream = LLONG_MIN;
    DLManagedTensorVersioned *m;
    if (!PyArg_ParseTuple(args, "OL|L", &obj, &stream, &view_stream) || api->to_managed_tensor(obj, stream, &m) < 0)
        return NULL;
    return api->view_from_managed_tensor(m, view_stream == LLONG_MIN ? stream : view_stream);
}

/* sum_float64(obj) -> the sum of a host float64 array of any layout: the "kernel" of this library */
static PyObject *sum_float64(PyObject *self, PyObject *obj)
{
    (void)self;
    DLTensor t;
    int64_t shape[CAI_DLPACK_MAX_NDIM], strides[CAI_DLPACK_MAX_NDIM];
    if (api->fill_tensor(obj, -1, &t, shape, strides, CAI_DLPACK_MAX_NDIM, NULL) < 0)
        return NULL;
    if (t.dtype.code != kDLFloat || t.dtype.bits != 64 || t.dtype.lanes != 1 || t.device.device_type != kDLCPU) {
        PyErr_SetString(PyExc_TypeError, "sum_float64 takes a host float64 array");
        return NULL;
    }
    int64_t count = 1, index[CAI_DLPACK_MAX_NDIM] = {0};
    for (int i = 0; i < t.ndim; i++)
        count *= t.shape[i];
    double total = 0;
    for (int64_t n = 0; n < count; n++) {
        int64_t offset = 0;
        for (int i = 0; i < t.ndim; i++)
            offset += index[i] * t.strides[i];
        total += ((const double *)t.data)[offset];
        for (int i = t.ndim - 1; i >= 0 && ++index[i] == t.shape[i]; i--)
            index[i] = 0;
    }
    return PyFloat_FromDouble(total);
}

/* ---- the DLPack C exchange API, read from a type as any consumer would ---- */

static const DLPackExchangeAPI *exchange_api_of(PyObject *type)
{
    PyObject *capsule = PyObject_GetAttrString(type, "__dlpack_c_exchange_api__");
    if (capsule == NULL)
        return NULL;
    const DLPackExchangeAPI *exchange = PyCapsule_GetPointer(capsule, "dlpack_exchange_api");
    Py_DECREF(capsule);
    return exchange;
}

static void set_error(void *context, const char *kind, const char *message)
{
    PyObject *kinds = context;
    PyErr_Format(PyExc_RuntimeError, "%s: %s", kind, message);
    (void)kinds;
}

/* exchange_allocate(type, (code, bits), shape, (device_type, device_id)) -> the view the producer makes
 * of a tensor its allocator made, as a consumer returning an output would */
static PyObject *exchange_allocate(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *type, *shape_tuple;
    int code, bits, device_type, device_id;
    if (!PyArg_ParseTuple(args, "O(ii)O!(ii)", &type, &code, &bits, &PyTuple_Type, &shape_tuple, &device_type,
                          &device_id))
        return NULL;
    const DLPackExchangeAPI *exchange = exchange_api_of(type);
    if (exchange == NULL)
        return NULL;
    int64_t shape[CAI_DLPACK_MAX_NDIM];
    Py_ssize_t ndim = PyTuple_GET_SIZE(shape_tuple);
    for (Py_ssize_t i = 0; i < ndim && i < CAI_DLPACK_MAX_NDIM; i++)
        shape[i] = PyLong_AsLongLong(PyTuple_GET_ITEM(shape_tuple, i));
    DLTensor prototype = {NULL, {(DLDeviceType)device_type, device_id}, (int32_t)ndim,
                          {(uint8_t)code, (uint8_t)bits, 1}, shape, NULL, 0};
    DLManagedTensorVersioned *out = NULL;
    if (exchange->managed_tensor_allocator(&prototype, &out, NULL, set_error) != 0)
        return NULL;
    void *object;
    if (exchange->managed_tensor_to_py_object_no_sync(out, &object) != 0)
        return NULL;
    return object;
}

/* exchange_dltensor(obj) -> fields of the DLTensor the no-allocation exchange call fills */
static PyObject *exchange_dltensor(PyObject *self, PyObject *obj)
{
    (void)self;
    const DLPackExchangeAPI *exchange = exchange_api_of((PyObject *)Py_TYPE(obj));
    if (exchange == NULL)
        return NULL;
    DLTensor t = {0}; /* a call that says success without filling it gives zeros here, not stack garbage */
    if (exchange->dltensor_from_py_object_no_sync(obj, &t) != 0)
        return NULL;
    return tensor_fields(&t);
}

/* exchange_work_stream(type, device_type, device_id) -> the stream the producer says to launch on */
static PyObject *exchange_work_stream(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *type;
    int device_type, device_id;
    if (!PyArg_ParseTuple(args, "Oii", &type, &device_type, &device_id))
        return NULL;
    const DLPackExchangeAPI *exchange = exchange_api_of(type);
    void *stream = (void *)1;
    if (exchange == NULL || exchange->current_work_stream((DLDeviceType)device_type, device_id, &stream) != 0)
        return NULL;
    return PyLong_FromVoidPtr(stream);
}

/* status_of(door, obj, stream) -> (what the call returned, the exception it set or None, whether it handed out a
 * tensor): the exception is taken, not raised, so that a test can hold each door to the convention (0 and no
 * exception, or -1 and one). door: "to_managed_tensor", "fill_tensor", or an exchange call of obj's type,
 * "managed_tensor_from_py_object_no_sync" or "dltensor_from_py_object_no_sync", or
 * "managed_tensor_to_py_object_no_sync of NULL" (a NULL tensor handed back to obj's type). */
static PyObject *status_of(PyObject *self, PyObject *args)
{
    (void)self;
    const char *door;
    PyObject *obj;
    long long stream;
    if (!PyArg_ParseTuple(args, "sOL", &door, &obj, &stream))
        return NULL;
    const DLPackExchangeAPI *exchange = NULL;
    if (strstr(door, "_no_sync") != NULL && (exchange = exchange_api_of((PyObject *)Py_TYPE(obj))) == NULL)
        return NULL;
    DLManagedTensorVersioned *m = NULL;
    DLTensor t;
    int64_t shape[CAI_DLPACK_MAX_NDIM], strides[CAI_DLPACK_MAX_NDIM];
    int status;
    if (strcmp(door, "to_managed_tensor") == 0)
        status = api->to_managed_tensor(obj, stream, &m);
    else if (strcmp(door, "fill_tensor") == 0)
        status = api->fill_tensor(obj, stream, &t, shape, strides, CAI_DLPACK_MAX_NDIM, NULL);
    else if (strcmp(door, "managed_tensor_from_py_object_no_sync") == 0)
        status = exchange->managed_tensor_from_py_object_no_sync(obj, &m);
    else if (strcmp(door, "dltensor_from_py_object_no_sync") == 0)
        status = exchange->dltensor_from_py_object_no_sync(obj, &t);
    else if (strcmp(door, "managed_tensor_to_py_object_no_sync of NULL") == 0) {
        void *made = NULL;
        status = exchange->managed_tensor_to_py_object_no_sync(NULL, &made);
        Py_XDECREF((PyObject *)made);
    }
    else
        return PyErr_Format(PyExc_ValueError, "no door %s", door);
#if PY_VERSION_HEX >= 0x030C0000
    PyObject *value = PyErr_GetRaisedException();
#else
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    PyErr_NormalizeException(&type, &value, &traceback);
    Py_XDECREF(type);
    Py_XDECREF(traceback);
#endif
    int handed_out = m != NULL;
    if (m != NULL)
        m->deleter(m);
    return Py_BuildValue("(iNO)", status, value ? value : Py_NewRef(Py_None), handed_out ? Py_True : Py_False);
}

static PyMethodDef methods[] = {
    {"status_of", status_of, METH_VARARGS, NULL},
    {"fill", fill, METH_VARARGS, NULL},
    {"fill_small", fill_small, METH_O, NULL},
    {"managed", managed, METH_VARARGS, NULL},
    {"view", view, METH_VARARGS, NULL},
    {"sum_float64", sum_float64, METH_O, NULL},
    {"exchange_allocate", exchange_allocate, METH_VARARGS, NULL},
    {"exchange_dltensor", exchange_dltensor, METH_O, NULL},
    {"exchange_work_stream", exchange_work_stream, METH_VARARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "cai_dlpack_example", NULL, -1, methods};

PyMODINIT_FUNC PyInit_cai_dlpack_example(void)
{
    api = cai_dlpack_import();
    if (api == NULL)
        return NULL;
    PyObject *created = PyModule_Create(&module);
#ifdef Py_GIL_DISABLED
    /* Safe without the GIL: api is written once, here, and the functions keep no state of their own.
     * Without this line, importing the module turns the GIL back on for the whole process. */
    if (created != NULL && PyUnstable_Module_SetGIL(created, Py_MOD_GIL_NOT_USED) < 0) {
        Py_DECREF(created);
        return NULL;
    }
#endif
    return created;
}
