/* A test helper: calls a Python callable under a thread state made for the call, on the calling OS thread (an
 * embedder's PyThreadState_New and swap). The caller's own state is detached meanwhile and attached again after.
 * The OS thread's GIL-state record still names the caller's state: nothing the callable runs may call
 * PyGILState_Ensure (it would wait for that detached state), so the callable converts without copies or waits. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

static PyObject *call_in_new_thread_state(PyObject *module, PyObject *callable)
{
    (void)module;
    PyInterpreterState *interpreter = PyThreadState_GetInterpreter(PyThreadState_Get());
    PyThreadState *caller = PyEval_SaveThread();
    PyThreadState *made = PyThreadState_New(interpreter);
    PyEval_RestoreThread(made);
    PyObject *result = PyObject_CallNoArgs(callable);
    /* The error goes back with the caller's state. */
#if PY_VERSION_HEX >= 0x030C0000
    PyObject *raised = PyErr_GetRaisedException();
#else
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
#endif
    PyThreadState_Clear(made);
    PyThreadState_DeleteCurrent();
    PyEval_RestoreThread(caller);
#if PY_VERSION_HEX >= 0x030C0000
    PyErr_SetRaisedException(raised);
#else
    PyErr_Restore(type, value, traceback);
#endif
    return result;
}

static PyMethodDef methods[] = {
    {"call_in_new_thread_state", call_in_new_thread_state, METH_O, "callable() under a thread state made for it"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef definition = {PyModuleDef_HEAD_INIT, "thread_state_swap", NULL, -1, methods};

PyMODINIT_FUNC PyInit_thread_state_swap(void)
{
    PyObject *module = PyModule_Create(&definition);
#ifdef Py_GIL_DISABLED
    /* Nothing here needs the GIL: a free-threaded run keeps it off. */
    if (module != NULL && PyUnstable_Module_SetGIL(module, Py_MOD_GIL_NOT_USED) < 0) {
        Py_DECREF(module);
        return NULL;
    }
#endif
    return module;
}
