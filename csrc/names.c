/* What every file shares: interned names of interface keys, attributes and keywords, keyword-only
 * argument parsing for vectorcall functions, and the error for data one protocol cannot describe in the
 * other. Uses no other csrc/ file. */
#include "cdl_internal.h"

cdl_names cdl_name;
PyObject *cdl_UnsupportedError;

int cdl_names_init(void)
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
        {&cdl_name.obj, "obj"},
        {&cdl_name.sync, "sync"},
        {&cdl_name.export_stream, "export_stream"},
        {&cdl_name.trust_streams, "trust_streams"},
        {&cdl_name.dtype, "dtype"},
        {&cdl_name.name, "name"},
        {&cdl_name.cuda_stream, "__cuda_stream__"},
        {&cdl_name.exchange_api, "__dlpack_c_exchange_api__"},
        {&cdl_name.exchange_api_address, "__c_dlpack_exchange_api__"},
        {&cdl_name.requires_grad, "requires_grad"},
        {&cdl_name.is_conj, "is_conj"},
        {&cdl_name.is_neg, "is_neg"},
    };
    for (size_t i = 0; i < sizeof(table) / sizeof(table[0]); i++) {
        *table[i].slot = PyUnicode_InternFromString(table[i].text);
        if (*table[i].slot == NULL)
            return -1;
    }
    PyObject **const fresh = cdl_name.fresh_keys;
    fresh[CDL_FRESH_SHAPE] = cdl_name.shape;
    fresh[CDL_FRESH_TYPESTR] = cdl_name.typestr;
    fresh[CDL_FRESH_DESCR] = cdl_name.descr;
    fresh[CDL_FRESH_STREAM] = cdl_name.stream;
    fresh[CDL_FRESH_VERSION] = cdl_name.version;
    fresh[CDL_FRESH_STRIDES] = cdl_name.strides;
    fresh[CDL_FRESH_DATA] = cdl_name.data;
    fresh[CDL_FRESH_KEYS] = NULL;
    /* A BufferError, as the array API asks of __dlpack__ for data DLPack cannot describe (consumers fall
     * back on it), and a ValueError, as such data was refused before. */
    PyObject *bases = PyTuple_Pack(2, PyExc_BufferError, PyExc_ValueError);
    if (bases == NULL)
        return -1;
    cdl_UnsupportedError = PyErr_NewExceptionWithDoc(
        "cai_dlpack.UnsupportedArrayError",
        "Valid data that the other protocol cannot describe (a type, byte order, stride or mask). "
        "A BufferError and a ValueError.",
        bases, NULL);
    Py_DECREF(bases);
    return cdl_UnsupportedError ? 0 : -1;
}

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

int cdl_parse_dlpack_keywords_general(PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames, PyObject **values)
{
    values[0] = values[1] = values[2] = values[3] = NULL;
    PyObject *names[] = {cdl_name.stream, cdl_name.max_version, cdl_name.dl_device, cdl_name.copy};
    return cdl_parse_keywords("__dlpack__", args, nargs, kwnames, 0, names, values, 4);
}
