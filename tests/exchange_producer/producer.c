/* A DLPack producer that publishes the DLPack C exchange API the way torch.Tensor does (a capsule on its
 * type), with knobs the tests turn: what current_work_stream reports, which table call fails and how, and
 * counts of every call. Its tensors share the memory of any buffer (NumPy arrays), described as the device
 * the test names. Built by the tests (tests/support/c_example.py), never shipped. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <cai_dlpack/dlpack_abi.h> /* the DLPack declarations cai_dlpack ships (any dlpack.h >= 1.2 would do) */
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    PyObject_HEAD
    Py_buffer buffer;
    DLDataType dtype;
    DLDevice device;
    int64_t shape[8], strides[8];
} Tensor;

/* The knobs (configure()) and the counts (counts()). */
static long long work_stream;          /* what current_work_stream reports, as a handle */
static int work_stream_fails;          /* current_work_stream: -1 with RuntimeError */
static int from_object_fails;          /* 0: no; 1: BufferError; 2: RuntimeError; 3: -1 with no exception */
static int dlpack_refuses;             /* __dlpack__: BufferError in its own words */
/* The table is called from many threads at once without the GIL (free-threaded builds): the counts and the
 * last device asked for are atomic; the knobs are set by configure() while no other thread calls. */
static atomic_long from_object_calls, dltensor_calls, work_stream_calls, dlpack_calls, deleter_calls;
static atomic_int work_stream_device_type, work_stream_device_id;

static int dtype_of(const char *format, Py_ssize_t itemsize, DLDataType *out)
{
    char kind = format == NULL ? 'B' : format[strspn(format, "@=<")];
    out->lanes = 1;
    out->bits = (uint8_t)(8 * itemsize);
    out->code = kind == 'f' || kind == 'd' || kind == 'e' ? kDLFloat
                : kind == 'Z'                               ? kDLComplex
                : strchr("bhilq", kind)                     ? kDLInt
                                                            : kDLUInt;
    return kind == 0 ? -1 : 0;
}

static PyObject *tensor_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    PyObject *base;
    int device_type = kDLCPU, device_id = 0;
    static char *keywords[] = {"base", "device_type", "device_id", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O|ii", keywords, &base, &device_type, &device_id))
        return NULL;
    Tensor *self = (Tensor *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    if (PyObject_GetBuffer(base, &self->buffer, PyBUF_RECORDS_RO) < 0) {
        self->buffer.obj = NULL;
        Py_DECREF(self);
        return NULL;
    }
    if (self->buffer.ndim > 8 || dtype_of(self->buffer.format, self->buffer.itemsize, &self->dtype) < 0) {
        PyErr_SetString(PyExc_ValueError, "the test producer takes up to 8 dimensions of a plain type");
        Py_DECREF(self);
        return NULL;
    }
    for (int i = 0; i < self->buffer.ndim; i++) {
        self->shape[i] = self->buffer.shape[i];
        self->strides[i] = self->buffer.strides[i] / self->buffer.itemsize;
    }
    self->device.device_type = (DLDeviceType)device_type;
    self->device.device_id = device_id;
    return (PyObject *)self;
}

static void tensor_dealloc(Tensor *self)
{
    if (self->buffer.obj != NULL)
        PyBuffer_Release(&self->buffer);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static void fill(Tensor *self, DLTensor *t)
{
    t->data = self->buffer.buf;
    t->device = self->device;
    t->ndim = self->buffer.ndim;
    t->dtype = self->dtype;
    t->shape = self->shape;
    t->strides = self->strides;
    t->byte_offset = 0;
}

static void managed_deleter(DLManagedTensorVersioned *managed)
{
    PyGILState_STATE state = PyGILState_Ensure();
    deleter_calls++;
    Py_DECREF((PyObject *)managed->manager_ctx);
    PyGILState_Release(state);
    free(managed);
}

static DLManagedTensorVersioned *managed_of(Tensor *self)
{
    DLManagedTensorVersioned *managed = calloc(1, sizeof *managed);
    if (managed == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    managed->version.major = DLPACK_MAJOR_VERSION;
    managed->version.minor = DLPACK_MINOR_VERSION;
    managed->manager_ctx = Py_NewRef(self);
    managed->deleter = managed_deleter;
    fill(self, &managed->dl_tensor);
    return managed;
}

/* ---- the table ---------------------------------------------------------------------------------- */

static int fail_as_asked(void)
{
    if (from_object_fails == 1)
        PyErr_SetString(PyExc_BufferError, "the table cannot describe this tensor");
    else if (from_object_fails == 2)
        PyErr_SetString(PyExc_RuntimeError, "the table failed\nException raised from a C++ frame");
    return from_object_fails ? -1 : 0;
}

static int table_from_object(void *obj, DLManagedTensorVersioned **out)
{
    from_object_calls++;
    if (fail_as_asked() < 0)
        return -1;
    *out = managed_of((Tensor *)obj);
    return *out ? 0 : -1;
}

static int table_dltensor(void *obj, DLTensor *out)
{
    dltensor_calls++;
    if (fail_as_asked() < 0)
        return -1;
    fill((Tensor *)obj, out);
    return 0;
}

static int table_to_object(DLManagedTensorVersioned *tensor, void **out)
{
    (void)tensor;
    (void)out;
    PyErr_SetString(PyExc_NotImplementedError, "the test producer makes no tensors from DLPack");
    return -1;
}

static int table_allocate(DLTensor *prototype, DLManagedTensorVersioned **out, void *ctx,
                          void (*set_error)(void *, const char *, const char *))
{
    (void)prototype;
    *out = NULL;
    set_error(ctx, "NotImplementedError", "the test producer allocates nothing");
    return -1;
}

static int table_work_stream(DLDeviceType device_type, int32_t device_id, void **out)
{
    work_stream_calls++;
    work_stream_device_type = (int)device_type;
    work_stream_device_id = device_id;
    if (work_stream_fails) {
        PyErr_SetString(PyExc_RuntimeError, "the producer has no work stream");
        return -1;
    }
    *out = (void *)(uintptr_t)work_stream;
    return 0;
}

static DLPackExchangeAPI table = {
    {{1, 3}, NULL}, table_allocate, table_from_object, table_to_object, table_dltensor, table_work_stream,
};
/* A later major version a 1.x reader cannot read, chaining to the 1.3 table or to nothing. */
static DLPackExchangeAPI future_chained = {
    {{2, 0}, &table.header}, table_allocate, table_from_object, table_to_object, table_dltensor, table_work_stream,
};
static DLPackExchangeAPI future_alone = {
    {{2, 0}, NULL}, table_allocate, table_from_object, table_to_object, table_dltensor, table_work_stream,
};
/* A table without the optional borrowed-tensor call. */
static DLPackExchangeAPI no_dltensor = {
    {{1, 3}, NULL}, table_allocate, table_from_object, table_to_object, NULL, table_work_stream,
};

/* ---- __dlpack__, the reference path ------------------------------------------------------------------ */

static void capsule_destructor(PyObject *capsule)
{
    if (PyCapsule_IsValid(capsule, "dltensor_versioned")) {
        DLManagedTensorVersioned *managed = PyCapsule_GetPointer(capsule, "dltensor_versioned");
        managed->deleter(managed);
    }
}

static PyObject *tensor_dlpack(Tensor *self, PyObject *args, PyObject *kwargs)
{
    (void)args;
    (void)kwargs;
    dlpack_calls++;
    if (dlpack_refuses) {
        PyErr_SetString(PyExc_BufferError, "Tensor.__dlpack__ refuses in its own words");
        return NULL;
    }
    DLManagedTensorVersioned *managed = managed_of(self);
    if (managed == NULL)
        return NULL;
    PyObject *capsule = PyCapsule_New(managed, "dltensor_versioned", capsule_destructor);
    if (capsule == NULL)
        managed->deleter(managed);
    return capsule;
}

static PyObject *tensor_dlpack_device(Tensor *self, PyObject *unused)
{
    (void)unused;
    return Py_BuildValue("(ii)", (int)self->device.device_type, (int)self->device.device_id);
}

static PyMethodDef tensor_methods[] = {
    {"__dlpack__", (PyCFunction)(void (*)(void))tensor_dlpack, METH_VARARGS | METH_KEYWORDS, NULL},
    {"__dlpack_device__", (PyCFunction)tensor_dlpack_device, METH_NOARGS, NULL},
    {NULL, NULL, 0, NULL},
};

#define TENSOR_TYPE(cname, pyname)                                                                          \
    static PyTypeObject cname = {                                                                           \
        PyVarObject_HEAD_INIT(NULL, 0).tp_name = "exchange_producer." pyname,                               \
        .tp_basicsize = sizeof(Tensor),                                                                     \
        .tp_dealloc = (destructor)tensor_dealloc,                                                           \
        .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,                                               \
        .tp_methods = tensor_methods,                                                                       \
        .tp_new = tensor_new,                                                                               \
    }
TENSOR_TYPE(tensor_type, "Tensor");                 /* DLPack 1.3: a capsule */
TENSOR_TYPE(address_type, "AddressTensor");        /* DLPack 1.2: the table's address as an int */
TENSOR_TYPE(chained_type, "ChainedTensor");        /* a 2.0 table chaining to 1.3 */
TENSOR_TYPE(future_type, "FutureTensor");          /* a 2.0 table alone */
TENSOR_TYPE(no_dltensor_type, "NoDLTensorTensor"); /* no dltensor_from_py_object_no_sync */
TENSOR_TYPE(plain_type, "PlainTensor");            /* __dlpack__ only */

/* ---- the module ---------------------------------------------------------------------------------- */

static PyObject *configure(PyObject *self, PyObject *args, PyObject *kwargs)
{
    (void)self;
    static char *keywords[] = {"work_stream", "work_stream_fails", "from_object_fails", "dlpack_refuses", NULL};
    work_stream = 0;
    work_stream_fails = from_object_fails = dlpack_refuses = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "|$Lpip", keywords, &work_stream, &work_stream_fails,
                                     &from_object_fails, &dlpack_refuses))
        return NULL;
    from_object_calls = dltensor_calls = work_stream_calls = dlpack_calls = deleter_calls = 0;
    Py_RETURN_NONE;
}

static PyObject *counts(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    return Py_BuildValue("{s:l, s:l, s:l, s:l, s:l, s:(ii)}", "from_object", (long)from_object_calls, "dltensor",
                         (long)dltensor_calls, "work_stream", (long)work_stream_calls, "dlpack", (long)dlpack_calls,
                         "deleter", (long)deleter_calls, "work_stream_device", (int)work_stream_device_type,
                         (int)work_stream_device_id);
}

static PyMethodDef methods[] = {
    {"configure", (PyCFunction)(void (*)(void))configure, METH_VARARGS | METH_KEYWORDS, NULL},
    {"counts", counts, METH_NOARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "exchange_producer", NULL, -1, methods};

static int publish(PyObject *module, PyTypeObject *type, DLPackExchangeAPI *api, int as_address)
{
    if (PyType_Ready(type) < 0)
        return -1;
    if (api != NULL) {
        PyObject *value = as_address ? PyLong_FromVoidPtr(api) : PyCapsule_New(api, "dlpack_exchange_api", NULL);
        int status = value ? PyDict_SetItemString(type->tp_dict, as_address ? "__c_dlpack_exchange_api__"
                                                                           : "__dlpack_c_exchange_api__", value)
                           : -1;
        Py_XDECREF(value);
        if (status < 0)
            return -1;
        PyType_Modified(type);
    }
    return PyModule_AddObjectRef(module, strrchr(type->tp_name, '.') + 1, (PyObject *)type);
}

PyMODINIT_FUNC PyInit_exchange_producer(void)
{
    PyObject *module = PyModule_Create(&module_def);
    if (module == NULL || publish(module, &tensor_type, &table, 0) < 0 ||
        publish(module, &address_type, &table, 1) < 0 || publish(module, &chained_type, &future_chained, 0) < 0 ||
        publish(module, &future_type, &future_alone, 0) < 0 || publish(module, &no_dltensor_type, &no_dltensor, 0) < 0 ||
        publish(module, &plain_type, NULL, 0) < 0) {
        Py_XDECREF(module);
        return NULL;
    }
#ifdef Py_GIL_DISABLED
    if (PyUnstable_Module_SetGIL(module, Py_MOD_GIL_NOT_USED) < 0) {
        Py_DECREF(module);
        return NULL;
    }
#endif
    return module;
}
