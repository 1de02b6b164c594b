/* libFuzzer target for the CAI -> DLPack parser and the DLPack -> CAI view, built by run.sh.
 * Each input becomes a typestr and an __array_interface__ dict (shape, strides, data, version, mask,
 * offset, each of a type the input picks); a dict the parser accepts is written out as a capsule,
 * consumed into a view, and read back. Invariants: no crash, no sanitizer report, and every refusal
 * is a Python exception. */
#include "cdl_internal.h"
#include "fuzz_input.h"

#include <string.h>

PyMODINIT_FUNC PyInit__core(void);


static int64_t take_int64(cdl_input *in)
{
    uint64_t value = 0;
    for (int i = 0; i < 8; i++)
        value = value << 8 | take_byte(in);
    /* Mostly small numbers, sometimes any 64-bit pattern. */
    return (value >> 63) ? (int64_t)value : (int64_t)(value % 97) - 8;
}

/* A value of the type the input picks: int (small or huge), bool, None, float, str or tuple. */
static PyObject *take_value(cdl_input *in)
{
    switch (take_byte(in) % 8) {
    case 0:
        return PyBool_FromLong(take_byte(in) & 1);
    case 1:
        return Py_NewRef(Py_None);
    case 2:
        return PyFloat_FromDouble((double)take_int64(in));
    case 3:
        return PyUnicode_FromString("x");
    case 4: {
        PyObject *big = PyLong_FromUnsignedLongLong((unsigned long long)take_int64(in));
        PyObject *shift = PyLong_FromLong(take_byte(in) % 80);
        PyObject *value = big && shift ? PyNumber_Lshift(big, shift) : NULL;
        Py_XDECREF(big);
        Py_XDECREF(shift);
        return value;
    }
    default:
        return PyLong_FromLongLong(take_int64(in));
    }
}

static PyObject *take_tuple(cdl_input *in, Py_ssize_t length)
{
    PyObject *tuple = PyTuple_New(length);
    for (Py_ssize_t i = 0; tuple && i < length; i++) {
        PyObject *item = (take_byte(in) % 5) ? PyLong_FromLongLong(take_int64(in)) : take_value(in);
        if (item == NULL) {
            Py_CLEAR(tuple);
            break;
        }
        PyTuple_SET_ITEM(tuple, i, item);
    }
    return tuple;
}

static char buffer[1 << 12];

/* The view's buffer export under one of the standard requests: it either fails with an exception or
 * describes exactly len bytes; the memory itself is not read (the fuzzed pointers are arbitrary). */
static void exercise_buffer(PyObject *view, uint8_t choice)
{
    static const int requests[] = {PyBUF_SIMPLE, PyBUF_WRITABLE, PyBUF_FORMAT, PyBUF_ND, PyBUF_STRIDES,
                                   PyBUF_C_CONTIGUOUS, PyBUF_F_CONTIGUOUS, PyBUF_ANY_CONTIGUOUS, PyBUF_INDIRECT,
                                   PyBUF_CONTIG, PyBUF_CONTIG_RO, PyBUF_STRIDED, PyBUF_STRIDED_RO, PyBUF_RECORDS,
                                   PyBUF_RECORDS_RO, PyBUF_FULL, PyBUF_FULL_RO};
    int flags = requests[choice % (sizeof(requests) / sizeof(requests[0]))];
    Py_buffer buffer;
    if (PyObject_GetBuffer(view, &buffer, flags) < 0) {
        if (!PyErr_Occurred())
            __builtin_trap();
        PyErr_Clear();
        return;
    }
    Py_ssize_t length = buffer.itemsize;
    if (buffer.shape != NULL) {
        for (int i = 0; i < buffer.ndim; i++)
            length *= buffer.shape[i];
    }
    else {
        length = buffer.len;
    }
    if (length != buffer.len || buffer.obj != view || ((flags & PyBUF_WRITABLE) && buffer.readonly) ||
        ((flags & PyBUF_STRIDES) != PyBUF_STRIDES && !PyBuffer_IsContiguous(&buffer, 'C')))
        __builtin_trap();
    PyBuffer_Release(&buffer);
}

static void exercise(cdl_input *in)
{
    uint8_t flags = take_byte(in);
    char typestr[8] = {0};
    size_t typestr_length = take_byte(in) % 6;
    for (size_t i = 0; i < typestr_length; i++)
        typestr[i] = (char)(take_byte(in) & 0x7f);
    Py_ssize_t ndim = take_byte(in) % 70;
    PyObject *iface = PyDict_New();
    PyObject *typestr_object = PyUnicode_FromString(typestr);
    if (typestr_object != NULL)
        PyDict_SetItemString(iface, "typestr", (flags & 0x80) ? typestr_object : Py_None);
    Py_XDECREF(typestr_object);
    PyObject *shape = (flags & 1) ? take_tuple(in, ndim) : take_value(in);
    if (shape) {
        PyDict_SetItemString(iface, "shape", shape);
        Py_DECREF(shape);
    }
    if (flags & 2) {
        PyObject *strides = (flags & 4) ? take_tuple(in, ndim) : take_value(in);
        if (strides) {
            PyDict_SetItemString(iface, "strides", strides);
            Py_DECREF(strides);
        }
    }
    PyObject *data;
    if (flags & 8) {
        data = PyMemoryView_FromMemory(buffer, take_byte(in) * 16, PyBUF_WRITE);
        PyObject *offset = take_value(in);
        if (offset) {
            PyDict_SetItemString(iface, "offset", offset);
            Py_DECREF(offset);
        }
    }
    else {
        data = Py_BuildValue("(NN)", PyLong_FromVoidPtr(buffer + take_byte(in)),
                             (flags & 16) ? PyBool_FromLong(1) : take_value(in));
    }
    if (data) {
        PyDict_SetItemString(iface, "data", data);
        Py_DECREF(data);
    }
    PyObject *version = (flags & 32) ? take_value(in) : PyLong_FromLong(3);
    if (version) {
        PyDict_SetItemString(iface, "version", version);
        Py_DECREF(version);
    }
    if (flags & 64)
        PyDict_SetItemString(iface, "mask", Py_True);

    cdl_array arr;
    PyObject *keepalive = NULL;
    if (cdl_array_from_interface(iface, CDL_SOURCE_ARRAY_INTERFACE, NULL, NULL, &arr, &keepalive) == 0) {
        PyObject *capsule = cdl_capsule_from_array(&arr, iface, keepalive, take_byte(in) & 1, NULL);
        PyObject *view = capsule ? cdl_view_from_object(capsule, NULL, 1) : NULL;
        PyObject *round_trip = view ? PyObject_GetAttrString(view, "__array_interface__") : NULL;
        if (capsule && view && !round_trip)
            __builtin_trap(); /* a tensor we made must always read back */
        if (view)
            exercise_buffer(view, take_byte(in));
        Py_XDECREF(round_trip);
        Py_XDECREF(view);
        Py_XDECREF(capsule);
        Py_XDECREF(keepalive);
    }
    else if (!PyErr_Occurred()) {
        __builtin_trap(); /* a refusal must carry an exception */
    }
    PyErr_Clear();
    Py_DECREF(iface);
}

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    Py_InitializeEx(0);
    PyObject *module = PyInit__core();
    if (module == NULL) {
        PyErr_Print();
        __builtin_trap();
    }
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    /* The typestr parser alone, on the raw bytes. */
    PyObject *text = PyUnicode_DecodeLatin1((const char *)data, size < 8 ? (Py_ssize_t)size : 8, NULL);
    DLDataType dtype;
    if (text != NULL && cdl_parse_typestr(text, "fuzz", &dtype) < 0 && !PyErr_Occurred())
        __builtin_trap();
    Py_XDECREF(text);
    PyErr_Clear();
    cdl_input in = {data, size};
    exercise(&in);
    return 0;
}
