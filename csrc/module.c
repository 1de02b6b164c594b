/* The module cai_dlpack._core and its DLPackShim type: the Python-facing functions, argument
 * parsing, interned names and the module's exceptions. The converters live in their own files. */
#include "cdl_internal.h"

cdl_names cdl_name;
PyObject *cdl_CudaError;
static PyObject *cdl_host_device; /* (kDLCPU, 0) */

int cdl_parse_keywords(const char *func, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames,
                       Py_ssize_t npositional, PyObject *const *names, PyObject **values, int count)
{
    if (nargs != npositional) {
        PyErr_Format(PyExc_TypeError, "%s() takes %zd positional argument%s but %zd were given", func, npositional,
                     npositional == 1 ? "" : "s", nargs);
        return -1;
    }
    Py_ssize_t given = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    for (Py_ssize_t k = 0; k < given; k++) {
        PyObject *key = PyTuple_GET_ITEM(kwnames, k);
        int i = 0;
        while (i < count && key != names[i])
            i++;
        if (i == count) {
            /* Keyword names are usually the interned strings themselves; compare text otherwise. */
            i = 0;
            while (i < count && PyUnicode_Compare(key, names[i]) != 0)
                i++;
        }
        if (i == count) {
            PyErr_Format(PyExc_TypeError, "%s() got an unexpected keyword argument %R", func, key);
            return -1;
        }
        values[i] = args[nargs + k];
    }
    return 0;
}

int cdl_parse_dlpack_keywords(PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames, PyObject **values)
{
    PyObject *names[] = {cdl_name.stream, cdl_name.max_version, cdl_name.dl_device, cdl_name.copy};
    values[0] = values[1] = values[2] = values[3] = NULL;
    return cdl_parse_keywords("__dlpack__", args, nargs, kwnames, 0, names, values, 4);
}

/* ---- DLPackShim ---------------------------------------------------------------------------------- */

static PyObject *cdl_shim_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    PyObject *obj;
    static char *keywords[] = {"obj", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O:DLPackShim", keywords, &obj))
        return NULL;
    if (PyDict_Check(obj)) {
        PyErr_SetString(PyExc_TypeError,
                        "DLPackShim wraps an object that owns its memory, not a bare interface dict; use "
                        "cai2dlpack(d, owner=...) for a dict");
        return NULL;
    }
    cdl_shim *self = (cdl_shim *)type->tp_alloc(type, 0);
    if (self != NULL)
        self->obj = Py_NewRef(obj);
    return (PyObject *)self;
}

static int cdl_shim_traverse(cdl_shim *self, visitproc visit, void *arg)
{
    Py_VISIT(self->obj);
    return 0;
}

static int cdl_shim_clear(cdl_shim *self)
{
    Py_CLEAR(self->obj);
    return 0;
}

static void cdl_shim_dealloc(cdl_shim *self)
{
    PyObject_GC_UnTrack(self);
    if (self->weakreflist != NULL)
        PyObject_ClearWeakRefs((PyObject *)self);
    cdl_shim_clear(self);
    PyMem_Free(self->dims);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *cdl_shim_dlpack(cdl_shim *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    PyObject *values[4];
    if (cdl_parse_dlpack_keywords(args, nargs, kwnames, values) < 0)
        return NULL;
    cdl_array arr;
    PyObject *keepalive;
    if (cdl_array_from_object(self->obj, &arr, &keepalive) < 0)
        return NULL;
    PyObject *capsule = cdl_export(&arr, self->obj, keepalive, values[0], values[1], values[2], values[3]);
    Py_XDECREF(keepalive);
    return capsule;
}

static PyObject *cdl_shim_dlpack_device(cdl_shim *self, PyObject *unused)
{
    (void)unused;
    PyObject *iface;
    int found = cdl_lookup_attribute(self->obj, cdl_name.cuda_array_interface, &iface);
    if (found < 0)
        return NULL;
    if (found == 0 && _PyType_Lookup(Py_TYPE(self->obj), cdl_name.array_interface) != NULL) {
        /* Array-interface memory is host memory: no need to build the interface (NumPy makes a new
         * dict on each access) just to say so. */
        return Py_NewRef(cdl_host_device);
    }
    cdl_array arr;
    PyObject *keepalive;
    int status = found ? cdl_array_from_interface(iface, CDL_SOURCE_CAI, self->obj, &arr, &keepalive)
                       : cdl_array_from_object(self->obj, &arr, &keepalive);
    Py_XDECREF(iface);
    if (status < 0)
        return NULL;
    Py_XDECREF(keepalive);
    return cdl_device_tuple(arr.device);
}

static PyObject *cdl_shim_repr(cdl_shim *self)
{
    return PyUnicode_FromFormat("cai_dlpack.DLPackShim(%R)", self->obj);
}

static PyMethodDef cdl_shim_methods[] = {
    {"__dlpack__", (PyCFunction)(void (*)(void))cdl_shim_dlpack, METH_FASTCALL | METH_KEYWORDS,
     "__dlpack__(*, stream=None, max_version=None, dl_device=None, copy=None)\n\n"
     "Reads the wrapped object's interface now and returns a DLPack capsule sharing its memory."},
    {"__dlpack_device__", (PyCFunction)cdl_shim_dlpack_device, METH_NOARGS,
     "(DLDeviceType, device_id) of the wrapped object's data, without building a capsule."},
    {NULL, NULL, 0, NULL},
};

static PyObject *cdl_shim_get_obj(cdl_shim *self, void *closure)
{
    (void)closure;
    return Py_NewRef(self->obj);
}

static PyGetSetDef cdl_shim_getset[] = {
    {"obj", (getter)cdl_shim_get_obj, NULL, "the wrapped object", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

PyTypeObject cdl_shim_type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "cai_dlpack.DLPackShim",
    .tp_basicsize = sizeof(cdl_shim),
    .tp_dealloc = (destructor)cdl_shim_dealloc,
    .tp_repr = (reprfunc)cdl_shim_repr,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_BASETYPE,
    .tp_doc = "DLPackShim(obj)\n\nGives any object with __cuda_array_interface__ (or __array_interface__) the "
              "DLPack protocol, so torch.from_dlpack(DLPackShim(obj)) shares its memory.",
    .tp_traverse = (traverseproc)cdl_shim_traverse,
    .tp_clear = (inquiry)cdl_shim_clear,
    .tp_weaklistoffset = offsetof(cdl_shim, weakreflist),
    .tp_methods = cdl_shim_methods,
    .tp_getset = cdl_shim_getset,
    .tp_new = cdl_shim_new,
};

/* ---- module functions ---------------------------------------------------------------------------- */

static PyObject *cdl_cai2dlpack(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    (void)module;
    PyObject *names[] = {cdl_name.stream, cdl_name.max_version, cdl_name.owner};
    PyObject *values[] = {NULL, NULL, NULL};
    if (cdl_parse_keywords("cai2dlpack", args, nargs, kwnames, 1, names, values, 3) < 0)
        return NULL;
    PyObject *obj = args[0], *owner = values[2] == Py_None ? NULL : values[2];
    if (PyDict_Check(obj) && owner == NULL) {
        PyErr_SetString(PyExc_TypeError,
                        "cai2dlpack() of a CAI dict needs owner=, the object that keeps its memory alive");
        return NULL;
    }
    if (!PyDict_Check(obj) && owner != NULL) {
        PyErr_SetString(PyExc_TypeError, "cai2dlpack(): owner= is only for a CAI dict; an object is its own owner");
        return NULL;
    }
    cdl_array arr;
    PyObject *keepalive;
    if (cdl_array_from_object(obj, &arr, &keepalive) < 0)
        return NULL;
    PyObject *capsule = cdl_export(&arr, owner ? owner : obj, keepalive, values[0], values[1], NULL, NULL);
    Py_XDECREF(keepalive);
    return capsule;
}

static PyObject *cdl_dlpack2cai(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    (void)module;
    PyObject *names[] = {cdl_name.stream};
    PyObject *values[] = {NULL};
    if (cdl_parse_keywords("dlpack2cai", args, nargs, kwnames, 1, names, values, 1) < 0)
        return NULL;
    return cdl_view_from_object(args[0], values[0]);
}

static PyMethodDef cdl_module_methods[] = {
    {"cai2dlpack", (PyCFunction)(void (*)(void))cdl_cai2dlpack, METH_FASTCALL | METH_KEYWORDS,
     "cai2dlpack(obj, *, stream=None, max_version=None, owner=None) -> PyCapsule\n\n"
     "A DLPack capsule sharing the memory of obj: an object with __cuda_array_interface__ or "
     "__array_interface__, or a CAI dict with owner= the object that keeps its memory alive."},
    {"dlpack2cai", (PyCFunction)(void (*)(void))cdl_dlpack2cai, METH_FASTCALL | METH_KEYWORDS,
     "dlpack2cai(x, *, stream=None) -> DLPackView\n\n"
     "Consumes a DLPack capsule (or calls x.__dlpack__(stream=stream)) into a view that owns the tensor "
     "and exposes __cuda_array_interface__ / __array_interface__."},
    {"options", (PyCFunction)(void (*)(void))cdl_options, METH_FASTCALL | METH_KEYWORDS,
     "options(*, sync=None, export_stream=None) -> dict\n\n"
     "The CAI spec's stream opt-outs. sync=False: ignore producer streams (no ordering); "
     "export_stream=False: views export 'stream': None. Returns the settings now in force."},
    {"cuda_runtime_info", cdl_cuda_runtime_info, METH_NOARGS,
     "cuda_runtime_info() -> dict: path, version and device count of the CUDA runtime in use "
     "(loads it; RuntimeError saying what was searched if there is none)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef cdl_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "cai_dlpack._core",
    .m_doc = "C core of cai_dlpack: CUDA Array Interface <-> DLPack, zero-copy.",
    .m_size = -1,
    .m_methods = cdl_module_methods,
};

static int cdl_intern_names(void)
{
    struct {
        PyObject **slot;
        const char *text;
    } table[] = {
        {&cdl_name.shape, "shape"},
        {&cdl_name.typestr, "typestr"},
        {&cdl_name.data, "data"},
        {&cdl_name.strides, "strides"},
        {&cdl_name.version, "version"},
        {&cdl_name.mask, "mask"},
        {&cdl_name.stream, "stream"},
        {&cdl_name.offset, "offset"},
        {&cdl_name.descr, "descr"},
        {&cdl_name.cuda_array_interface, "__cuda_array_interface__"},
        {&cdl_name.array_interface, "__array_interface__"},
        {&cdl_name.dlpack, "__dlpack__"},
        {&cdl_name.dlpack_device, "__dlpack_device__"},
        {&cdl_name.max_version, "max_version"},
        {&cdl_name.dl_device, "dl_device"},
        {&cdl_name.copy, "copy"},
        {&cdl_name.owner, "owner"},
        {&cdl_name.sync, "sync"},
        {&cdl_name.export_stream, "export_stream"},
    };
    for (size_t i = 0; i < sizeof(table) / sizeof(table[0]); i++) {
        *table[i].slot = PyUnicode_InternFromString(table[i].text);
        if (*table[i].slot == NULL)
            return -1;
    }
    return 0;
}

/* Adds value (a new reference, or NULL after an error) to the module, consuming it. */
static int cdl_add_new_object(PyObject *module, const char *name, PyObject *value)
{
    int status = value ? PyModule_AddObjectRef(module, name, value) : -1;
    Py_XDECREF(value);
    return status;
}

PyMODINIT_FUNC PyInit__core(void)
{
    if (cdl_intern_names() < 0 || cdl_dtype_init() < 0 || cdl_view_type_init() < 0 ||
        PyType_Ready(&cdl_shim_type) < 0)
        return NULL;
    cdl_stream_options_init();
    cdl_host_device = Py_BuildValue("(ii)", (int)kDLCPU, 0);
    if (cdl_host_device == NULL)
        return NULL;
    PyObject *module = PyModule_Create(&cdl_module);
    if (module == NULL)
        return NULL;
    cdl_CudaError = PyErr_NewExceptionWithDoc(
        "cai_dlpack.CudaError",
        "A CUDA runtime call failed. Attributes: call (the function), code, name (the runtime's error name).",
        PyExc_RuntimeError, NULL);
    if (cdl_CudaError == NULL || PyModule_AddObjectRef(module, "CudaError", cdl_CudaError) < 0 ||
        PyModule_AddObjectRef(module, "DLPackShim", (PyObject *)&cdl_shim_type) < 0 ||
        PyModule_AddObjectRef(module, "DLPackView", (PyObject *)&cdl_view_type) < 0 ||
        cdl_add_new_object(module, "DLPACK_VERSION", Py_BuildValue("(ii)", DLPACK_MAJOR_VERSION, DLPACK_MINOR_VERSION)) < 0 ||
        PyModule_AddIntConstant(module, "CUDART_HEADER_MAJOR", CDL_CUDART_HEADER_MAJOR) < 0 ||
        cdl_c_api_init(module) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
