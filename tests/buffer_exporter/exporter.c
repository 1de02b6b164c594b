/* A host array whose buffer export says the format the test names (any text, such as PEP 3118 formats no NumPy
 * or ctypes object gives), over the bytes of another object's buffer, and whose __array_interface__ is a C getset
 * (as NumPy's is) answering that object's interface. Built by the tests (tests/support/c_example.py), never
 * shipped. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

typedef struct {
    PyObject_HEAD
    PyObject *source;  /* the object whose bytes and interface are given */
    Py_buffer bytes;   /* source's buffer, held from creation to deallocation */
    PyObject *format;  /* bytes: the format every export says */
} Exporter;

static int exporter_init(Exporter *self, PyObject *args, PyObject *kwargs)
{
    static char *keywords[] = {"source", "format", NULL};
    PyObject *source;
    const char *format;
    if (self->source != NULL) {
        PyErr_SetString(PyExc_TypeError, "an Exporter is made once");
        return -1;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "Os:Exporter", keywords, &source, &format))
        return -1;
    self->format = PyBytes_FromString(format);
    if (self->format == NULL)
        return -1;
    if (PyObject_GetBuffer(source, &self->bytes, PyBUF_FULL_RO) < 0)
        return -1;
    self->source = Py_NewRef(source);
    return 0;
}

static void exporter_dealloc(Exporter *self)
{
    if (self->source != NULL) {
        PyBuffer_Release(&self->bytes);
        Py_DECREF(self->source);
    }
    Py_XDECREF(self->format);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* source's buffer as it is (the same memory, shape and strides), in the named format. */
static int exporter_getbuffer(Exporter *self, Py_buffer *view, int flags)
{
    if (self->source == NULL) {
        PyErr_SetString(PyExc_BufferError, "an Exporter not made yet has no buffer");
        return -1;
    }
    if ((flags & PyBUF_WRITABLE) == PyBUF_WRITABLE && self->bytes.readonly) {
        PyErr_SetString(PyExc_BufferError, "the source is read-only");
        return -1;
    }
    *view = self->bytes;
    view->obj = Py_NewRef((PyObject *)self);
    view->format = (flags & PyBUF_FORMAT) == PyBUF_FORMAT ? PyBytes_AS_STRING(self->format) : NULL;
    view->internal = NULL;
    return 0;
}

static PyObject *exporter_interface(Exporter *self, void *closure)
{
    (void)closure;
    if (self->source == NULL) {
        PyErr_SetString(PyExc_AttributeError, "an Exporter not made yet has no interface");
        return NULL;
    }
    return PyObject_GetAttrString(self->source, "__array_interface__");
}

static PyGetSetDef exporter_getset[] = {
    {"__array_interface__", (getter)exporter_interface, NULL, NULL, NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyBufferProcs exporter_buffer = {(getbufferproc)exporter_getbuffer, NULL};

static PyTypeObject exporter_type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "buffer_exporter.Exporter",
    .tp_basicsize = sizeof(Exporter),
    .tp_dealloc = (destructor)exporter_dealloc,
    .tp_as_buffer = &exporter_buffer,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Exporter(source, format): source's buffer, exported in format; source's __array_interface__.",
    .tp_getset = exporter_getset,
    .tp_init = (initproc)exporter_init,
    .tp_new = PyType_GenericNew,
};

static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "buffer_exporter", NULL, -1, NULL};

PyMODINIT_FUNC PyInit_buffer_exporter(void)
{
    if (PyType_Ready(&exporter_type) < 0)
        return NULL;
    PyObject *module = PyModule_Create(&module_def);
    if (module == NULL)
        return NULL;
    if (PyModule_AddObjectRef(module, "Exporter", (PyObject *)&exporter_type) < 0) {
        Py_DECREF(module);
        return NULL;
    }
#ifdef Py_GIL_DISABLED
    /* Safe without the GIL: an Exporter's fields are written once, by __init__, before any export reads them
     * (a second __init__ is refused), and the type keeps no other state. Without this line, importing the module
     * turns the GIL back on for the whole process. */
    if (PyUnstable_Module_SetGIL(module, Py_MOD_GIL_NOT_USED) < 0) {
        Py_DECREF(module);
        return NULL;
    }
#endif
    return module;
}
