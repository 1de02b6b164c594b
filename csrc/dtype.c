/* Every fact about element types: one table maps the type strings of the CAI and of NumPy's array
 * interface, and the buffer protocol's formats, onto DLPack types and back; error messages list the
 * supported types from it. Messages name DLPack's type codes and device types from the two name tables
 * here. Uses no other csrc/ file but names.c (its error type). */
#include "cdl_internal.h"

#include <string.h>

typedef struct {
    char kind;          /* typestr kind character; 'V' rows are named types, found by name only */
    uint8_t itemsize;   /* typestr size in bytes */
    uint8_t code;       /* DLDataTypeCode */
    uint8_t bits;
    uint16_t lanes;
    const char *typestr;
    const char *format; /* buffer protocol (struct module) format, native order and size; NULL: none names it */
    const char *name;   /* NumPy's, ml_dtypes' and torch's name of the type */
} cdl_dtype_entry;

/* Types a typestr can name, then types it cannot (bfloat16, float8, packed float4): those are exported
 * as raw bytes of their size ('V' typestr) with a one-field descr that carries the name, and read back from
 * that name (or from the object's dtype, or a dtype= the caller gives). No buffer format names them: a buffer
 * consumer that asks for a format is refused, and reads the interface or __dlpack__ instead. */
static const cdl_dtype_entry cdl_dtype_table[] = {
    {'b', 1, kDLBool, 8, 1, "|b1", "?", "bool"},
    {'i', 1, kDLInt, 8, 1, "|i1", "b", "int8"},
    {'i', 2, kDLInt, 16, 1, "<i2", "h", "int16"},
    {'i', 4, kDLInt, 32, 1, "<i4", "i", "int32"},
    {'i', 8, kDLInt, 64, 1, "<i8", "q", "int64"},
    {'u', 1, kDLUInt, 8, 1, "|u1", "B", "uint8"},
    {'u', 2, kDLUInt, 16, 1, "<u2", "H", "uint16"},
    {'u', 4, kDLUInt, 32, 1, "<u4", "I", "uint32"},
    {'u', 8, kDLUInt, 64, 1, "<u8", "Q", "uint64"},
    {'f', 2, kDLFloat, 16, 1, "<f2", "e", "float16"},
    {'f', 4, kDLFloat, 32, 1, "<f4", "f", "float32"},
    {'f', 8, kDLFloat, 64, 1, "<f8", "d", "float64"},
    {'c', 8, kDLComplex, 64, 1, "<c8", "Zf", "complex64"},
    {'c', 16, kDLComplex, 128, 1, "<c16", "Zd", "complex128"},
    {'V', 2, kDLBfloat, 16, 1, "<V2", NULL, "bfloat16"},
    {'V', 1, kDLFloat8_e3m4, 8, 1, "|V1", NULL, "float8_e3m4"},
    {'V', 1, kDLFloat8_e4m3, 8, 1, "|V1", NULL, "float8_e4m3"},
    {'V', 1, kDLFloat8_e4m3b11fnuz, 8, 1, "|V1", NULL, "float8_e4m3b11fnuz"},
    {'V', 1, kDLFloat8_e4m3fn, 8, 1, "|V1", NULL, "float8_e4m3fn"},
    {'V', 1, kDLFloat8_e4m3fnuz, 8, 1, "|V1", NULL, "float8_e4m3fnuz"},
    {'V', 1, kDLFloat8_e5m2, 8, 1, "|V1", NULL, "float8_e5m2"},
    {'V', 1, kDLFloat8_e5m2fnuz, 8, 1, "|V1", NULL, "float8_e5m2fnuz"},
    {'V', 1, kDLFloat8_e8m0fnu, 8, 1, "|V1", NULL, "float8_e8m0fnu"},
    /* Two 4-bit values packed in each byte (torch's float4_e2m1fn_x2): an item is one whole byte. A lone
     * 4-bit or 6-bit element is not a whole byte, which an interface cannot describe: no row. */
    {'V', 1, kDLFloat4_e2m1fn, 4, 2, "|V1", NULL, "float4_e2m1fn_x2"},
};
#define CDL_DTYPE_COUNT (sizeof(cdl_dtype_table) / sizeof(cdl_dtype_table[0]))

/* The typestrs as Python strings, made once so a view never builds one per access; for named types
 * the descr's one field (name, typestr) too (NULL for the others): a tuple, so sharing it is safe, put in
 * a new list for each dict handed out (a receiver may change its list, and nobody else's). */
static PyObject *cdl_typestr_objects[CDL_DTYPE_COUNT];
static PyObject *cdl_descr_fields[CDL_DTYPE_COUNT];
/* "b1, i1, ...; by name: bfloat16, ...": what an interface may use, for error messages. */
static char cdl_supported_text[32 * CDL_DTYPE_COUNT];

#if PY_BIG_ENDIAN
#define CDL_FOREIGN_BYTE_ORDER '<'
#define CDL_NATIVE_BYTE_ORDER '>'
#else
#define CDL_FOREIGN_BYTE_ORDER '>'
#define CDL_NATIVE_BYTE_ORDER '<'
#endif

/* The row of each (kind letter, item size 1 to 16 as its log2) with a typestr of its own: derived from the
 * table at init, so a typestr costs an index, not a scan. -1: none. */
static signed char cdl_row_of_kind[26][5];
/* The same for a typestr's two last characters, a kind letter and one digit (its item size): one index where a
 * three-character typestr is read, the common case. -1: none. */
static signed char cdl_row_of_kind_digit[128][10];
/* The first row whose buffer format is this one ASCII character, or -1: a buffer's format read without a walk of
 * the table (NumPy's arrays give one character). */
static signed char cdl_row_of_format[128];

/* log2 of an item size the index holds (1, 2, 4, 8, 16), else -1. */
static int cdl_size_slot(Py_ssize_t itemsize)
{
    switch (itemsize) {
    case 1: return 0;
    case 2: return 1;
    case 4: return 2;
    case 8: return 3;
    case 16: return 4;
    default: return -1;
    }
}

int cdl_dtype_init(void)
{
    memset(cdl_row_of_kind, -1, sizeof(cdl_row_of_kind));
    for (size_t i = 0; i < CDL_DTYPE_COUNT; i++) {
        int slot = cdl_size_slot(cdl_dtype_table[i].itemsize);
        char kind = cdl_dtype_table[i].kind;
        if (kind >= 'a' && kind <= 'z' && slot >= 0 && cdl_row_of_kind[kind - 'a'][slot] < 0)
            cdl_row_of_kind[kind - 'a'][slot] = (signed char)i;
    }
    memset(cdl_row_of_kind_digit, -1, sizeof(cdl_row_of_kind_digit));
    for (int kind = 'a'; kind <= 'z'; kind++) {
        for (int digit = 0; digit <= 9; digit++) {
            int slot = cdl_size_slot(digit);
            if (slot >= 0)
                cdl_row_of_kind_digit[kind][digit] = cdl_row_of_kind[kind - 'a'][slot];
        }
    }
    memset(cdl_row_of_format, -1, sizeof(cdl_row_of_format));
    for (size_t i = CDL_DTYPE_COUNT; i-- > 0;) {
        const char *format = cdl_dtype_table[i].format;
        if (format != NULL && (unsigned char)format[0] < 128 && format[0] != '\0' && format[1] == '\0')
            cdl_row_of_format[(unsigned char)format[0]] = (signed char)i;
    }
    for (size_t i = 0; i < CDL_DTYPE_COUNT; i++) {
        cdl_typestr_objects[i] = PyUnicode_InternFromString(cdl_dtype_table[i].typestr);
        if (cdl_typestr_objects[i] == NULL)
            return -1;
        const cdl_dtype_entry *entry = &cdl_dtype_table[i];
        size_t used = strlen(cdl_supported_text);
        if (entry->kind != 'V') {
            PyOS_snprintf(cdl_supported_text + used, sizeof(cdl_supported_text) - used, "%s%c%d", i ? ", " : "",
                          entry->kind, (int)entry->itemsize);
            continue;
        }
        PyOS_snprintf(cdl_supported_text + used, sizeof(cdl_supported_text) - used, "%s%s",
                      cdl_dtype_table[i - 1].kind != 'V' ? "; by name (a descr, a NumPy dtype or dtype=): " : ", ",
                      entry->name);
        cdl_descr_fields[i] = Py_BuildValue("(sO)", entry->name, cdl_typestr_objects[i]);
        if (cdl_descr_fields[i] == NULL)
            return -1;
    }
    return 0;
}

/* The table's type for a typestr kind character and an item size in bytes: 0, or -1 (no exception set)
 * when there is none. */
static int cdl_dtype_from_kind(char kind, Py_ssize_t itemsize, DLDataType *out)
{
    int slot = cdl_size_slot(itemsize);
    int row = kind >= 'a' && kind <= 'z' && slot >= 0 ? cdl_row_of_kind[kind - 'a'][slot] : -1;
    if (row < 0)
        return -1;
    out->code = cdl_dtype_table[row].code;
    out->bits = cdl_dtype_table[row].bits;
    out->lanes = 1;
    return 0;
}

/* The table row of dtype, or -1 when the table has none. */
static int cdl_row_of_dtype(DLDataType dtype)
{
    for (size_t i = 0; i < CDL_DTYPE_COUNT; i++) {
        const cdl_dtype_entry *entry = &cdl_dtype_table[i];
        if (entry->code == dtype.code && entry->bits == dtype.bits && entry->lanes == dtype.lanes)
            return (int)i;
    }
    return -1;
}

/* UnsupportedArrayError for a typestr no row describes, listing what is supported. Returns -1. */
static int cdl_raise_no_equivalent(PyObject *typestr, const char *where)
{
    PyErr_Format(cdl_UnsupportedError, "%s 'typestr' %R has no DLPack equivalent (supported: %s)", where, typestr,
                 cdl_supported_text);
    return -1;
}

/* A typestr's text split into its kind character and item size, without an exception: CDL_TEXT_SPLIT, or
 * CDL_TEXT_FOREIGN_ORDER, or CDL_TEXT_NO_TYPE (not a typestr of this form). */
enum { CDL_TEXT_SPLIT, CDL_TEXT_FOREIGN_ORDER, CDL_TEXT_NO_TYPE };

static int cdl_split_text(const char *text, Py_ssize_t length, char *kind, int *itemsize)
{
    if (length < 3 || length > 4)
        return CDL_TEXT_NO_TYPE;
    const char order = text[0];
    if (order == CDL_FOREIGN_BYTE_ORDER)
        return CDL_TEXT_FOREIGN_ORDER;
    if (order != '<' && order != '>' && order != '|' && order != '=')
        return CDL_TEXT_NO_TYPE;
    *itemsize = 0;
    for (Py_ssize_t i = 2; i < length; i++) {
        if (text[i] < '0' || text[i] > '9')
            return CDL_TEXT_NO_TYPE;
        *itemsize = *itemsize * 10 + (text[i] - '0');
    }
    *kind = text[1];
    return CDL_TEXT_SPLIT;
}

/* A typestr's kind character and item size. Returns 0, or -1 with TypeError (not a str) or
 * UnsupportedArrayError (another byte order, or no type this table could hold) naming it. */
static int cdl_split_typestr(PyObject *typestr, const char *where, char *kind, int *itemsize)
{
    if (!PyUnicode_Check(typestr)) {
        PyErr_Format(PyExc_TypeError, "%s 'typestr' must be a str, not %.200s", where, Py_TYPE(typestr)->tp_name);
        return -1;
    }
    Py_ssize_t length;
    /* Every valid typestr is ASCII, whose characters are its own bytes: no UTF-8 conversion to ask for. */
    const char *text = PyUnicode_IS_COMPACT_ASCII(typestr) ? (const char *)PyUnicode_DATA(typestr) : NULL;
    length = text ? PyUnicode_GET_LENGTH(typestr) : 0;
    if (text == NULL && (text = PyUnicode_AsUTF8AndSize(typestr, &length)) == NULL)
        return -1;
    switch (cdl_split_text(text, length, kind, itemsize)) {
    case CDL_TEXT_SPLIT:
        return 0;
    case CDL_TEXT_FOREIGN_ORDER:
        PyErr_Format(cdl_UnsupportedError,
                     "%s 'typestr' %R has non-native byte order, which DLPack cannot describe", where, typestr);
        return -1;
    default:
        return cdl_raise_no_equivalent(typestr, where);
    }
}

int cdl_parse_typestr(PyObject *typestr, const char *where, DLDataType *out)
{
    char kind;
    int itemsize;
    if (cdl_split_typestr(typestr, where, &kind, &itemsize) < 0)
        return -1;
    if (cdl_dtype_from_kind(kind, itemsize, out) == 0)
        return 0;
    return cdl_raise_no_equivalent(typestr, where);
}

/* What cdl_parse_typestr accepts of three characters ("<f4", "|b1") of a compact ASCII str, read in place by a
 * table: the byte order, the kind, one digit. 0 with *out filled, or -1 where the split below must decide. */
static inline int cdl_lookup_typestr(PyObject *typestr, DLDataType *out)
{
    if (PyUnicode_GET_LENGTH(typestr) != 3)
        return -1;
    const unsigned char *text = (const unsigned char *)PyUnicode_DATA(typestr);
    /* '<' and '>' less the foreign one: the native order's character. */
    const unsigned char order = text[0], kind = text[1], digit = (unsigned char)(text[2] - '0');
    if ((order != CDL_NATIVE_BYTE_ORDER && order != '|' && order != '=') || kind >= 128 || digit > 9)
        return -1;
    const int row = cdl_row_of_kind_digit[kind][digit];
    if (row < 0)
        return -1;
    out->code = cdl_dtype_table[row].code;
    out->bits = cdl_dtype_table[row].bits;
    out->lanes = 1;
    return 0;
}

int cdl_name_ascii_typestr(PyObject *typestr, DLDataType *out)
{
    if (cdl_lookup_typestr(typestr, out) == 0)
        return 0;
    char kind;
    int itemsize;
    if (cdl_split_text((const char *)PyUnicode_DATA(typestr), PyUnicode_GET_LENGTH(typestr), &kind, &itemsize) !=
        CDL_TEXT_SPLIT)
        return -1;
    return cdl_dtype_from_kind(kind, itemsize, out);
}

/* The row whose name is the str name, or -1. */
static int cdl_row_of_name(PyObject *name)
{
    const char *text = PyUnicode_Check(name) ? PyUnicode_AsUTF8(name) : NULL;
    if (text == NULL) {
        PyErr_Clear();
        return -1;
    }
    if (strncmp(text, "torch.", 6) == 0)
        text += 6; /* str(torch.bfloat16) */
    for (size_t i = 0; i < CDL_DTYPE_COUNT; i++) {
        if (strcmp(cdl_dtype_table[i].name, text) == 0)
            return (int)i;
    }
    return -1;
}

static void cdl_dtype_of_row(int row, DLDataType *out)
{
    out->code = cdl_dtype_table[row].code;
    out->bits = cdl_dtype_table[row].bits;
    out->lanes = cdl_dtype_table[row].lanes;
}

int cdl_dtype_from_request(PyObject *requested, DLDataType *out)
{
    /* A name; a type (ml_dtypes.bfloat16, numpy.float32); a NumPy dtype (its name); a torch.dtype (its str). */
    PyObject *name = NULL;
    if (PyUnicode_Check(requested))
        name = Py_NewRef(requested);
    else if (PyType_Check(requested))
        name = PyObject_GetAttrString(requested, "__name__");
    else if (cdl_lookup_attribute(requested, cdl_name.name, &name) == 0 || (name != NULL && !PyUnicode_Check(name)))
        Py_XSETREF(name, PyObject_Str(requested));
    if (name == NULL)
        return -1;
    int row = cdl_row_of_name(name);
    Py_DECREF(name);
    if (row < 0) {
        PyErr_Format(PyExc_ValueError, "dtype=%R names no type an array interface or DLPack both describe (%s)",
                     requested, cdl_supported_text);
        return -1;
    }
    cdl_dtype_of_row(row, out);
    return 0;
}

/* The name a NumPy-style interface gives its one-field descr [(name, typestr)], or NULL (no exception):
 * NumPy's default descr [("", typestr)] names nothing. A new reference: the list is the producer's, and
 * another thread may change it, so its one item is taken inside a critical section (the field is a tuple,
 * which nobody can change). */
static PyObject *cdl_name_in_descr(PyObject *descr, PyObject *typestr)
{
    if (descr == NULL || !PyList_Check(descr))
        return NULL;
    PyObject *field = NULL;
    CDL_BEGIN_CRITICAL_SECTION(descr);
    if (PyList_GET_SIZE(descr) == 1)
        field = Py_NewRef(PyList_GET_ITEM(descr, 0));
    CDL_END_CRITICAL_SECTION();
    PyObject *name = NULL;
    if (field != NULL && PyTuple_Check(field) && PyTuple_GET_SIZE(field) == 2 &&
        PyUnicode_Check(PyTuple_GET_ITEM(field, 0)) && PyUnicode_Check(PyTuple_GET_ITEM(field, 1)) &&
        PyUnicode_GET_LENGTH(PyTuple_GET_ITEM(field, 0)) != 0 &&
        PyUnicode_Compare(PyTuple_GET_ITEM(field, 1), typestr) == 0)
        name = Py_NewRef(PyTuple_GET_ITEM(field, 0));
    Py_XDECREF(field);
    return name;
}

/* The name of an object's element type, from its dtype: a NumPy (or ml_dtypes, CuPy, JAX) dtype's str
 * name, or a torch.dtype's str ("torch.bfloat16"), whose type carries no name attribute. Nothing else is
 * read as a name: an unknown dtype object names nothing. A new reference, or NULL (no exception). */
static PyObject *cdl_name_of_object_dtype(PyObject *obj)
{
    PyObject *dtype = NULL, *name = NULL;
    if (obj == NULL || cdl_lookup_attribute(obj, cdl_name.dtype, &dtype) <= 0)
        goto done;
    if (cdl_lookup_attribute(dtype, cdl_name.name, &name) > 0 && PyUnicode_Check(name))
        goto done;
    Py_CLEAR(name);
    PyErr_Clear();
    if (strcmp(Py_TYPE(dtype)->tp_name, "torch.dtype") == 0)
        name = PyObject_Str(dtype);
done:
    PyErr_Clear(); /* a failing dtype property only means "no name" here */
    Py_XDECREF(dtype);
    return name;
}

int cdl_parse_interface_dtype(PyObject *typestr, PyObject *descr, PyObject *obj, const DLDataType *requested,
                              const char *where, DLDataType *out)
{
    char kind;
    int itemsize;
    if (cdl_split_typestr(typestr, where, &kind, &itemsize) < 0)
        return -1;
    if (requested != NULL) {
        if (cdl_itemsize(*requested) != itemsize) {
            int row = cdl_row_of_dtype(*requested);
            PyErr_Format(PyExc_ValueError, "dtype=%s has %d-byte items but %s 'typestr' %R has %d-byte items",
                         cdl_dtype_table[row].name, (int)cdl_itemsize(*requested), where, typestr, itemsize);
            return -1;
        }
        *out = *requested;
        return 1;
    }
    if (cdl_dtype_from_kind(kind, itemsize, out) == 0)
        return 0;
    /* A type no typestr names: the descr's name (our views', NumPy's for a named field), else the name of
     * the object's dtype (ml_dtypes arrays lose it in their descr, [("", "<V2")]; torch's interface has no
     * descr at all). The item size must agree with the name's: never a guess from the size alone. */
    PyObject *name = cdl_name_in_descr(descr, typestr);
    if (name == NULL)
        name = cdl_name_of_object_dtype(obj);
    int row = name ? cdl_row_of_name(name) : -1;
    Py_XDECREF(name);
    if (row < 0 || itemsize != cdl_dtype_table[row].itemsize)
        return cdl_raise_no_equivalent(typestr, where);
    cdl_dtype_of_row(row, out);
    return 1;
}

int cdl_dtype_is_named(DLDataType dtype)
{
    int row = cdl_row_of_dtype(dtype);
    return row >= 0 && cdl_descr_fields[row] != NULL;
}

PyObject *cdl_descr_new(DLDataType dtype)
{
    int row = cdl_row_of_dtype(dtype);
    if (row < 0 || cdl_descr_fields[row] == NULL) {
        PyErr_SetString(PyExc_SystemError, "cai_dlpack: a descr asked of a type a typestr names");
        return NULL;
    }
    PyObject *descr = PyList_New(1);
    if (descr != NULL)
        PyList_SET_ITEM(descr, 0, Py_NewRef(cdl_descr_fields[row]));
    return descr;
}

int cdl_dtype_from_format(const char *format, Py_ssize_t itemsize, DLDataType *out)
{
    if (format == NULL)
        return cdl_dtype_from_kind('u', itemsize, out); /* plain bytes */
    /* One item in native order and size: an optional native byte-order mark, then one character (or
     * 'Z' and one, for complex). Anything else (another order, a repeat count, a structure) has no row. */
#if PY_BIG_ENDIAN
    if (*format == '@' || *format == '=' || *format == '>' || *format == '!')
#else
    if (*format == '@' || *format == '=' || *format == '<')
#endif
        format++;
    if ((unsigned char)format[0] < 128 && format[0] != '\0' && format[1] == '\0') {
        const int row = cdl_row_of_format[(unsigned char)format[0]];
        if (row >= 0 && cdl_dtype_table[row].itemsize == itemsize)
            return cdl_dtype_from_kind(cdl_dtype_table[row].kind, itemsize, out);
    }
    size_t length = strlen(format);
    for (size_t i = 0; i < CDL_DTYPE_COUNT; i++) {
        const char *known = cdl_dtype_table[i].format;
        if (known != NULL && known[0] == format[0] && strcmp(known, format) == 0 &&
            cdl_dtype_table[i].itemsize == itemsize)
            return cdl_dtype_from_kind(cdl_dtype_table[i].kind, itemsize, out);
    }
    /* Formats of C's integer types whose size the table's fixed-size formats also cover: the size
     * decides (a 'l' is 'q' on LP64). */
    if (length == 1) {
        static const char signed_formats[] = "bhilqn", unsigned_formats[] = "BHILQN";
        if (strchr(signed_formats, format[0]))
            return cdl_dtype_from_kind('i', itemsize, out);
        if (strchr(unsigned_formats, format[0]))
            return cdl_dtype_from_kind('u', itemsize, out);
    }
    return -1;
}

const char *cdl_name_of_dtype(DLDataType dtype)
{
    int row = cdl_row_of_dtype(dtype);
    return row < 0 ? "an unknown type" : cdl_dtype_table[row].name;
}

const char *cdl_format_from_dtype(DLDataType dtype)
{
    int row = cdl_row_of_dtype(dtype);
    return row < 0 ? NULL : cdl_dtype_table[row].format;
}

/* DLPack 1.4's names of its type codes and device types, indexed by value. The values past those of an
 * upstream dlpack.h older than 1.4 (which a build may use instead of ours) are written as numbers. */
static const char *const cdl_type_code_names[] = {
    [kDLInt] = "kDLInt", [kDLUInt] = "kDLUInt", [kDLFloat] = "kDLFloat", [kDLOpaqueHandle] = "kDLOpaqueHandle",
    [kDLBfloat] = "kDLBfloat", [kDLComplex] = "kDLComplex", [kDLBool] = "kDLBool",
    [kDLFloat8_e3m4] = "kDLFloat8_e3m4", [kDLFloat8_e4m3] = "kDLFloat8_e4m3",
    [kDLFloat8_e4m3b11fnuz] = "kDLFloat8_e4m3b11fnuz", [kDLFloat8_e4m3fn] = "kDLFloat8_e4m3fn",
    [kDLFloat8_e4m3fnuz] = "kDLFloat8_e4m3fnuz", [kDLFloat8_e5m2] = "kDLFloat8_e5m2",
    [kDLFloat8_e5m2fnuz] = "kDLFloat8_e5m2fnuz", [kDLFloat8_e8m0fnu] = "kDLFloat8_e8m0fnu",
    [kDLFloat6_e2m3fn] = "kDLFloat6_e2m3fn", [kDLFloat6_e3m2fn] = "kDLFloat6_e3m2fn",
    [kDLFloat4_e2m1fn] = "kDLFloat4_e2m1fn", [18] = "kDLBcomplex",
};
static const char *const cdl_device_type_names[] = {
    [kDLCPU] = "kDLCPU", [kDLCUDA] = "kDLCUDA", [kDLCUDAHost] = "kDLCUDAHost", [kDLOpenCL] = "kDLOpenCL",
    [kDLVulkan] = "kDLVulkan", [kDLMetal] = "kDLMetal", [kDLVPI] = "kDLVPI", [kDLROCM] = "kDLROCM",
    [kDLROCMHost] = "kDLROCMHost", [kDLExtDev] = "kDLExtDev", [kDLCUDAManaged] = "kDLCUDAManaged",
    [kDLOneAPI] = "kDLOneAPI", [kDLWebGPU] = "kDLWebGPU", [kDLHexagon] = "kDLHexagon", [kDLMAIA] = "kDLMAIA",
    [kDLTrn] = "kDLTrn", [19] = "kDLTPU", [20] = "kDLTPUHost", [21] = "kDLAscend",
};

const char *cdl_type_code_name(int code)
{
    const int count = (int)(sizeof(cdl_type_code_names) / sizeof(cdl_type_code_names[0]));
    return code >= 0 && code < count && cdl_type_code_names[code] ? cdl_type_code_names[code] : "an unknown code";
}

const char *cdl_device_type_name(int device_type)
{
    const int count = (int)(sizeof(cdl_device_type_names) / sizeof(cdl_device_type_names[0]));
    return device_type >= 0 && device_type < count && cdl_device_type_names[device_type]
               ? cdl_device_type_names[device_type]
               : "an unknown device type";
}

int cdl_check_dtype(DLDataType dtype)
{
    if (cdl_row_of_dtype(dtype) >= 0)
        return 0;
    PyErr_Format(cdl_UnsupportedError,
                 "DLPack dtype %s (code=%d, bits=%d, lanes=%d) has no array-interface typestr (supported: %s)",
                 cdl_type_code_name(dtype.code), (int)dtype.code, (int)dtype.bits, (int)dtype.lanes,
                 cdl_supported_text);
    return -1;
}

PyObject *cdl_typestr_from_dtype(DLDataType dtype)
{
    int row = cdl_row_of_dtype(dtype);
    if (row >= 0)
        return Py_NewRef(cdl_typestr_objects[row]);
    (void)cdl_check_dtype(dtype);
    return NULL;
}
