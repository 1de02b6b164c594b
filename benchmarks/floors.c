/* Floors for the converter benchmark, built by benchmarks/cpu.py: the least any dict -> capsule
 * converter must do. f0: one allocation and a capsule. f1: f0 plus reading shape, typestr, data and
 * strides from the same dict, with interned keys (f1) or with PyDict_GetItemString (f1_getitemstring). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdlib.h>

static PyObject *key_shape, *key_typestr, *key_data, *key_strides;

static void free_pointer(PyObject *capsule) { free(PyCapsule_GetPointer(capsule, "floor")); }

static PyObject *make_capsule(void)
{
    void *block = malloc(128);
    if (block == NULL)
        return PyErr_NoMemory();
    PyObject *capsule = PyCapsule_New(block, "floor", free_pointer);
    if (capsule == NULL)
        free(block);
    return capsule;
}

static PyObject *f0(PyObject *module, PyObject *unused)
{
    (void)module;
    (void)unused;
    return make_capsule();
}

static PyObject *f1(PyObject *module, PyObject *dict)
{
    (void)module;
    if (PyDict_GetItemWithError(dict, key_shape) == NULL || PyDict_GetItemWithError(dict, key_typestr) == NULL ||
        PyDict_GetItemWithError(dict, key_data) == NULL || PyDict_GetItemWithError(dict, key_strides) == NULL) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_KeyError, "missing key");
        return NULL;
    }
    return make_capsule();
}

static PyObject *f1_getitemstring(PyObject *module, PyObject *dict)
{
    (void)module;
    if (PyDict_GetItemString(dict, "shape") == NULL || PyDict_GetItemString(dict, "typestr") == NULL ||
        PyDict_GetItemString(dict, "data") == NULL || PyDict_GetItemString(dict, "strides") == NULL) {
        PyErr_SetString(PyExc_KeyError, "missing key");
        return NULL;
    }
    return make_capsule();
}

static PyMethodDef methods[] = {
    {"f0", f0, METH_NOARGS, "malloc + PyCapsule_New"},
    {"f1", f1, METH_O, "f0 + four interned-key dict reads"},
    {"f1_getitemstring", f1_getitemstring, METH_O, "f0 + four PyDict_GetItemString reads"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_floors", NULL, -1, methods};

PyMODINIT_FUNC PyInit__floors(void)
{
    key_shape = PyUnicode_InternFromString("shape");
    key_typestr = PyUnicode_InternFromString("typestr");
    key_data = PyUnicode_InternFromString("data");
    key_strides = PyUnicode_InternFromString("strides");
    if (!key_shape || !key_typestr || !key_data || !key_strides)
        return NULL;
    return PyModule_Create(&module);
}
