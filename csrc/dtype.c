/* Every fact about element types: one table maps the type strings of the CAI and of NumPy's array
 * interface, and the buffer protocol's formats, onto DLPack types and back; error messages list the
 * supported types from it. Uses no other csrc/ file but names.c (its error type). */
#include "cdl_internal.h"

#include <string.h>

typedef struct {
    char kind;          /* typestr kind character */
    uint8_t itemsize;   /* typestr size in bytes */
    uint8_t code;       /* DLDataTypeCode */
    uint8_t bits;
    const char *typestr;
    const char *format; /* buffer protocol (struct module) format, native order and size */
} cdl_dtype_entry;

static const cdl_dtype_entry cdl_dtype_table[] = {
    {'b', 1, kDLBool, 8, "|b1", "?"},
    {'i', 1, kDLInt, 8, "|i1", "b"},
    {'i', 2, kDLInt, 16, "<i2", "h"},
    {'i', 4, kDLInt, 32, "<i4", "i"},
    {'i', 8, kDLInt, 64, "<i8", "q"},
    {'u', 1, kDLUInt, 8, "|u1", "B"},
    {'u', 2, kDLUInt, 16, "<u2", "H"},
    {'u', 4, kDLUInt, 32, "<u4", "I"},
    {'u', 8, kDLUInt, 64, "<u8", "Q"},
    {'f', 2, kDLFloat, 16, "<f2", "e"},
    {'f', 4, kDLFloat, 32, "<f4", "f"},
    {'f', 8, kDLFloat, 64, "<f8", "d"},
    {'c', 8, kDLComplex, 64, "<c8", "Zf"},
    {'c', 16, kDLComplex, 128, "<c16", "Zd"},
};
#define CDL_DTYPE_COUNT (sizeof(cdl_dtype_table) / sizeof(cdl_dtype_table[0]))

/* The typestrs as Python strings, made once so a view never builds one per access. */
static PyObject *cdl_typestr_objects[CDL_DTYPE_COUNT];
/* "b1, i1, i2, ...": the typestrs an interface may use, for error messages. */
static char cdl_supported_text[8 * CDL_DTYPE_COUNT];

#if PY_BIG_ENDIAN
#define CDL_FOREIGN_BYTE_ORDER '<'
#else
#define CDL_FOREIGN_BYTE_ORDER '>'
#endif

int cdl_dtype_init(void)
{
    for (size_t i = 0; i < CDL_DTYPE_COUNT; i++) {
        cdl_typestr_objects[i] = PyUnicode_InternFromString(cdl_dtype_table[i].typestr);
        if (cdl_typestr_objects[i] == NULL)
            return -1;
        size_t used = strlen(cdl_supported_text);
        PyOS_snprintf(cdl_supported_text + used, sizeof(cdl_supported_text) - used, "%s%c%d", i ? ", " : "",
                      cdl_dtype_table[i].kind, (int)cdl_dtype_table[i].itemsize);
    }
    return 0;
}

/* The table's type for a typestr kind character and an item size in bytes: 0, or -1 (no exception set)
 * when there is none. */
static int cdl_dtype_from_kind(char kind, Py_ssize_t itemsize, DLDataType *out)
{
    for (size_t i = 0; i < CDL_DTYPE_COUNT; i++) {
        const cdl_dtype_entry *entry = &cdl_dtype_table[i];
        if (entry->kind == kind && entry->itemsize == itemsize) {
            out->code = entry->code;
            out->bits = entry->bits;
            out->lanes = 1;
            return 0;
        }
    }
    return -1;
}

int cdl_parse_typestr(PyObject *typestr, const char *where, DLDataType *out)
{
    if (!PyUnicode_Check(typestr)) {
        PyErr_Format(PyExc_TypeError, "%s 'typestr' must be a str, not %.200s", where, Py_TYPE(typestr)->tp_name);
        return -1;
    }
    Py_ssize_t length;
    const char *text = PyUnicode_AsUTF8AndSize(typestr, &length);
    if (text == NULL)
        return -1;
    if (length < 3 || length > 4)
        goto unsupported;
    char order = text[0];
    if (order == CDL_FOREIGN_BYTE_ORDER) {
        PyErr_Format(cdl_UnsupportedError,
                     "%s 'typestr' %R has non-native byte order, which DLPack cannot describe", where, typestr);
        return -1;
    }
    if (order != '<' && order != '>' && order != '|' && order != '=')
        goto unsupported;
    int itemsize = 0;
    for (Py_ssize_t i = 2; i < length; i++) {
        if (text[i] < '0' || text[i] > '9')
            goto unsupported;
        itemsize = itemsize * 10 + (text[i] - '0');
    }
    if (cdl_dtype_from_kind(text[1], itemsize, out) == 0)
        return 0;
unsupported:
    PyErr_Format(cdl_UnsupportedError,
                 "%s 'typestr' %R has no DLPack equivalent (supported: %s)", where, typestr, cdl_supported_text);
    return -1;
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
    size_t length = strlen(format);
    for (size_t i = 0; i < CDL_DTYPE_COUNT; i++) {
        const char *known = cdl_dtype_table[i].format;
        if (strcmp(known, format) == 0 && cdl_dtype_table[i].itemsize == itemsize)
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

/* The table row of dtype, or -1 when the table has none. */
static int cdl_row_of_dtype(DLDataType dtype)
{
    if (dtype.lanes == 1) {
        for (size_t i = 0; i < CDL_DTYPE_COUNT; i++) {
            if (cdl_dtype_table[i].code == dtype.code && cdl_dtype_table[i].bits == dtype.bits)
                return (int)i;
        }
    }
    return -1;
}

const char *cdl_format_from_dtype(DLDataType dtype)
{
    int row = cdl_row_of_dtype(dtype);
    return row < 0 ? NULL : cdl_dtype_table[row].format;
}

int cdl_check_dtype(DLDataType dtype)
{
    if (cdl_row_of_dtype(dtype) >= 0)
        return 0;
    PyErr_Format(cdl_UnsupportedError,
                 "DLPack dtype (code=%d, bits=%d, lanes=%d) has no array-interface typestr (supported: %s)",
                 (int)dtype.code, (int)dtype.bits, (int)dtype.lanes, cdl_supported_text);
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
