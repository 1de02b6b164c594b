/* The module cai_dlpack._core: its functions, constants and types, and the only file that builds it.
 * It sits on top: every other csrc/ file is below it, and none calls up into it. */
#include "cdl_internal.h"

/* ---- module functions ---------------------------------------------------------------------------- */

static PyObject *cdl_cai2dlpack(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    (void)module;
    if (nargs == 1 && kwnames == NULL && !PyDict_Check(args[0])) {
        /* cai2dlpack(obj), the common call: no keyword to parse or check. */
        return cdl_cai2dlpack_plain(args[0]);
    }
    PyObject *names[] = {cdl_name.stream, cdl_name.max_version, cdl_name.owner, cdl_name.dtype, cdl_name.dl_device,
                         cdl_name.copy};
    PyObject *values[] = {NULL, NULL, NULL, NULL, NULL, NULL};
    if (cdl_parse_keywords("cai2dlpack", args, nargs, kwnames, 1, names, values, 6) < 0)
        return NULL;
    DLDataType requested;
    if (values[3] != NULL && values[3] != Py_None && cdl_dtype_from_request(values[3], &requested) < 0)
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
    if (cdl_array_from_object(obj, values[3] != NULL && values[3] != Py_None ? &requested : NULL, &arr, &keepalive) < 0)
        return NULL;
    PyObject *capsule = cdl_export(&arr, owner ? owner : obj, keepalive, values[0], values[1], values[4], values[5]);
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
    return cdl_view_from_object(args[0], values[0], 1);
}

static PyMethodDef cdl_module_methods[] = {
    {"cai2dlpack", (PyCFunction)(void (*)(void))cdl_cai2dlpack, METH_FASTCALL | METH_KEYWORDS,
     "cai2dlpack($module, obj, /, *, stream=None, max_version=None, owner=None, dtype=None, dl_device=None, "
     "copy=None)\n--\n\n"
     "A DLPack capsule sharing the memory of obj: an object with __cuda_array_interface__ or "
     "__array_interface__, or a CAI dict with owner= the object that keeps its memory alive. dtype= names "
     "the element type a typestr cannot (\"bfloat16\", a NumPy/ml_dtypes dtype, a torch.dtype). copy= and "
     "dl_device= copy as __dlpack__'s do."},
    {"dlpack2cai", (PyCFunction)(void (*)(void))cdl_dlpack2cai, METH_FASTCALL | METH_KEYWORDS,
     "dlpack2cai($module, x, /, *, stream=None)\n--\n\n"
     "Consumes a DLPack capsule (or calls x.__dlpack__(stream=stream)) into a view that owns the tensor "
     "and exposes __cuda_array_interface__ / __array_interface__."},
    {"options", (PyCFunction)(void (*)(void))cdl_options, METH_FASTCALL | METH_KEYWORDS,
     "options($module, /, *, sync=None, export_stream=None, trust_streams=None)\n--\n\n"
     "The CAI spec's stream opt-outs. sync=False: ignore producer streams (no ordering); "
     "export_stream=False: views export 'stream': None. trust_streams=True: the streams consumers name by handle "
     "outlive the tensors and views made for them, so their release waits for those streams too. Returns the "
     "settings now in force."},
    {"cuda_runtime_info", cdl_cuda_runtime_info, METH_NOARGS,
     "cuda_runtime_info($module, /)\n--\n\n"
     "A dict: path (as opened), file (the file the loader mapped), source (how it was found: "
     "'CAI_DLPACK_CUDART', 'preloaded', 'loader' or 'pip wheel'), version and device count of the CUDA runtime "
     "in use (loads it; RuntimeError saying what was searched if there is none)."},
    {"_interface_cache_info", cdl_interface_cache_info, METH_NOARGS,
     "_interface_cache_info($module, /)\n--\n\n"
     "Whether validated interface dicts are kept, and how often one was reused or kept (for tests)."},
    {"_set_interface_cache", cdl_set_interface_cache, METH_O,
     "_set_interface_cache($module, enabled, /)\n--\n\n"
     "Keeps validated interface dicts (True, the default) or reads every dict afresh (False), for benchmarks "
     "and tests; returns _interface_cache_info()."},
    {"_set_record_store_delay", cdl_set_record_store_delay, METH_O,
     "_set_record_store_delay($module, microseconds, /)\n--\n\n"
     "On a free-threaded build, each record of a dict read elsewhere waits this long before its slot's lock and "
     "again holding it (0, the default: no wait), so that tests can land another thread's change between a read "
     "and its store."},
    {"_fused_reads", cdl_fused_reads_count, METH_NOARGS,
     "_fused_reads($module, /)\n--\n\n"
     "How many interface dicts (a property's fresh dict, or on a free-threaded build one held elsewhere) were "
     "read by the fused reader rather than the general one, since import (for tests)."},
    {"_set_held_fused_reads", cdl_set_held_fused_reads, METH_O,
     "_set_held_fused_reads($module, enabled, /)\n--\n\n"
     "On a free-threaded build, reads an interface dict held elsewhere (not a property's fresh one) through the "
     "fused reader where it can (True, the default) or through the general reader (False), for tests that "
     "compare the two readers; with the GIL, held dicts are always their kept record's or the general reader's."},
    {"_pending_releases", cdl_pending_releases, METH_NOARGS,
     "_pending_releases($module, /)\n--\n\n"
     "Makes the releases whose consumer stream has run, then returns how many still wait (pending), the bound "
     "(limit), how many waited past it (waited) and whether ordered release is on (for tests)."},
    {"_set_ordered_release", cdl_set_ordered_release, METH_O,
     "_set_ordered_release($module, enabled, /)\n--\n\n"
     "Orders releases after the consumer's stream (True, the default) or releases at once (False), for tests "
     "that show what goes wrong without it; returns _pending_releases()."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef cdl_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "cai_dlpack._core",
    .m_doc = "C core of cai_dlpack: CUDA Array Interface <-> DLPack, zero-copy.",
    .m_size = -1,
    .m_methods = cdl_module_methods,
};

/* Adds value (a new reference, or NULL after an error) to the module, consuming it. */
static int cdl_add_new_object(PyObject *module, const char *name, PyObject *value)
{
    int status = value ? PyModule_AddObjectRef(module, name, value) : -1;
    Py_XDECREF(value);
    return status;
}

PyMODINIT_FUNC PyInit__core(void)
{
    if (cdl_names_init() < 0 || cdl_dtype_init() < 0 || cdl_cuda_errors_init() < 0 || cdl_view_type_init() < 0 ||
        cdl_shim_type_init() < 0 || cdl_interface_cache_init() < 0)
        return NULL;
    cdl_stream_options_init();
    PyObject *module = PyModule_Create(&cdl_module);
    if (module == NULL)
        return NULL;
#ifdef Py_GIL_DISABLED
    /* Without this, importing the module turns the GIL back on for the whole process. Its shared state
     * is safe without the GIL: README.md, "Free-threading", says how. */
    if (PyUnstable_Module_SetGIL(module, Py_MOD_GIL_NOT_USED) < 0) {
        Py_DECREF(module);
        return NULL;
    }
#endif
    if (PyModule_AddObjectRef(module, "CudaError", cdl_CudaError) < 0 ||
        PyModule_AddObjectRef(module, "UnsupportedArrayError", cdl_UnsupportedError) < 0 ||
        PyModule_AddObjectRef(module, "DLPackShim", (PyObject *)&cdl_shim_type) < 0 ||
        PyModule_AddObjectRef(module, "DLPackView", (PyObject *)&cdl_view_type) < 0 ||
        cdl_add_new_object(module, "DLPACK_VERSION", Py_BuildValue("(ii)", DLPACK_MAJOR_VERSION, DLPACK_MINOR_VERSION)) < 0 ||
        PyModule_AddIntConstant(module, "CUDART_HEADER_MAJOR", CDL_CUDART_HEADER_MAJOR) < 0 ||
        cdl_c_api_init(module) < 0 || cdl_ordered_release_init(module) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
