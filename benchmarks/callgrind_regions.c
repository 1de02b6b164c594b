/* The measuring end of benchmarks/instructions.py, built by it: counts callgrind's instructions of one Python
 * callable at a time. Run under `valgrind --tool=callgrind --instr-atstart=no --collect-atstart=no`, start()
 * turns instrumentation on once, and count(label, loop) collects only while loop() runs, then dumps the
 * counts under label (one file per region) and zeroes them. Outside callgrind the requests do nothing. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <valgrind/callgrind.h>

static PyObject *start(PyObject *module, PyObject *unused)
{
    (void)module, (void)unused;
    CALLGRIND_START_INSTRUMENTATION;
    Py_RETURN_NONE;
}

static PyObject *count(PyObject *module, PyObject *args)
{
    (void)module;
    const char *label;
    PyObject *loop;
    if (!PyArg_ParseTuple(args, "sO:count", &label, &loop))
        return NULL;
    CALLGRIND_TOGGLE_COLLECT;
    PyObject *result = PyObject_CallNoArgs(loop);
    CALLGRIND_TOGGLE_COLLECT;
    CALLGRIND_DUMP_STATS_AT(label);
    return result;
}

static PyObject *running(PyObject *module, PyObject *unused)
{
    (void)module, (void)unused;
    return PyBool_FromLong(RUNNING_ON_VALGRIND);
}

static PyMethodDef methods[] = {
    {"start", start, METH_NOARGS, "turn callgrind's instrumentation on"},
    {"count", count, METH_VARARGS, "count(label, loop): loop() with collection on, then a dump named label"},
    {"running", running, METH_NOARGS, "whether this process runs under valgrind"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_callgrind_regions", NULL, -1, methods};

PyMODINIT_FUNC PyInit__callgrind_regions(void)
{
    PyObject *made = PyModule_Create(&module);
#ifdef Py_GIL_DISABLED
    if (made != NULL && PyUnstable_Module_SetGIL(made, Py_MOD_GIL_NOT_USED) < 0)
        Py_CLEAR(made);
#endif
    return made;
}
