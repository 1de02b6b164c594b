/* CAI -> DLPack: reads a __cuda_array_interface__ (or NumPy __array_interface__) dict, or a host
 * array's buffer, into the neutral record, and exports that record to a consumer: its requests
 * checked, streams ordered, the capsule written by managed_tensor.c. The records kept of unchanged
 * ready dicts are interface_cache.c's. */
#include "cdl_internal.h"

#include <stddef.h>
#include <string.h>

static const char *cdl_source_name(cdl_source source)
{
    return source == CDL_SOURCE_CAI ? "__cuda_array_interface__" : "__array_interface__";
}

/* Names the entry for a message: "__cuda_array_interface__ 'shape'[1]" (index < 0: no index). Only
 * ever built on the error path. */
static void cdl_entry_label(char *label, size_t size, cdl_source source, const char *key, Py_ssize_t index)
{
    if (index >= 0)
        PyOS_snprintf(label, size, "%s '%s'[%zd]", cdl_source_name(source), key, index);
    else
        PyOS_snprintf(label, size, "%s '%s'", cdl_source_name(source), key);
}

/* The value of an exact int that fits one digit (almost every shape and stride) without a call into
 * the runtime: 1 with *out set, else 0. */
static inline int cdl_compact_int(PyObject *value, int64_t *out)
{
    if (!PyLong_CheckExact(value))
        return 0;
#if PY_VERSION_HEX >= 0x030C0000
    if (!PyUnstable_Long_IsCompact((PyLongObject *)value))
        return 0;
    *out = PyUnstable_Long_CompactValue((PyLongObject *)value);
#else
    Py_ssize_t size = Py_SIZE(value);
    if (size < -1 || size > 1)
        return 0;
    *out = size * (int64_t)((PyLongObject *)value)->ob_digit[0]; /* ob_digit[0] exists even for 0 */
#endif
    return 1;
}

/* cdl_read_int for anything but a one-digit int in range: kept out of line, so the loops over shape
 * and strides inline only the fast path (7% of a 32-dimension conversion). */
static __attribute__((noinline)) int cdl_read_int_slow(PyObject *value, cdl_source source, const char *key,
                                                       Py_ssize_t index, int64_t low, int64_t high, int64_t *out)
{
    char label[96];
    if (!PyLong_Check(value) || PyBool_Check(value)) {
        cdl_entry_label(label, sizeof(label), source, key, index);
        PyErr_Format(PyExc_TypeError, "%s must be an int, not %.200s", label, Py_TYPE(value)->tp_name);
        return -1;
    }
    int overflow;
    long long number = PyLong_AsLongLongAndOverflow(value, &overflow);
    if (number == -1 && !overflow && PyErr_Occurred())
        return -1;
    if (overflow || number < low || number > high) {
        cdl_entry_label(label, sizeof(label), source, key, index);
        PyErr_Format(PyExc_ValueError, "%s is %R; it must lie in [%lld, %lld]", label, value, (long long)low,
                     (long long)high);
        return -1;
    }
    *out = number;
    return 0;
}

/* Reads a non-bool int in [low, high]; messages name the interface, key and index. Returns 0 or -1. */
static inline int cdl_read_int(PyObject *value, cdl_source source, const char *key, Py_ssize_t index,
                               int64_t low, int64_t high, int64_t *out)
{
    int64_t compact;
    if (cdl_compact_int(value, &compact) && compact >= low && compact <= high) {
        *out = compact;
        return 0;
    }
    return cdl_read_int_slow(value, source, key, index, low, high, out);
}

/* The value of an exact, non-negative int that fits 64 bits (a pointer): 1 with *out set, else 0 with no
 * exception. Before 3.12 an int of up to two digits (60 bits: every user-space address) is read from its digits,
 * which costs a tenth of the runtime's conversion. */
static inline int cdl_pointer_value(PyObject *value, unsigned long long *out)
{
#if PY_VERSION_HEX < 0x030C0000 && !defined(PyLong_SHIFT)
#error "Python.h gave no PyLong_SHIFT: the digit read below would be compiled out unseen"
#endif
#if PY_VERSION_HEX < 0x030C0000 && PyLong_SHIFT == 30
    const Py_ssize_t size = Py_SIZE(value);
    if (size >= 0 && size <= 2) {
        const digit *digits = ((PyLongObject *)value)->ob_digit;
        *out = size == 0 ? 0 : size == 1 ? digits[0] : digits[0] | (unsigned long long)digits[1] << PyLong_SHIFT;
        return 1;
    }
#endif
#if ULONG_MAX == ULLONG_MAX
    *out = PyLong_AsUnsignedLong(value);
#else
    *out = PyLong_AsUnsignedLongLong(value);
#endif
    if (*out == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        return 0;
    }
    return 1;
}

/* *quotient = value / itemsize when itemsize divides value; returns 0 when it does not. Item sizes are
 * the table's powers of two, so constant divisors turn each division into shifts. */
static inline int cdl_divide_exactly(int64_t value, int64_t itemsize, int64_t *quotient)
{
    switch (itemsize) {
    case 1:
        *quotient = value;
        return 1;
    case 2:
        *quotient = value / 2;
        return value % 2 == 0;
    case 4:
        *quotient = value / 4;
        return value % 4 == 0;
    case 8:
        *quotient = value / 8;
        return value % 8 == 0;
    case 16:
        *quotient = value / 16;
        return value % 16 == 0;
    default:
        *quotient = value / itemsize;
        return value % itemsize == 0;
    }
}

/* The entries the parser reads, in the order it checks them (so errors come in a fixed order). */
enum { CDL_VERSION, CDL_SHAPE, CDL_TYPESTR, CDL_DATA, CDL_STRIDES, CDL_STREAM, CDL_MASK, CDL_OFFSET, CDL_DESCR,
       CDL_ENTRIES };

/* Collects the entries of iface into entries[] (new references; NULL when absent) in one pass over the
 * dict rather than one lookup per key. Producers' keys are interned string literals, so identity
 * decides almost always; other strings are compared by value. Runs no Python code. */
static void cdl_collect_entries(PyObject *iface, PyObject **entries, uint64_t *ticket)
{
    PyObject *const names[CDL_ENTRIES] = {cdl_name.version, cdl_name.shape, cdl_name.typestr, cdl_name.data,
                                          cdl_name.strides, cdl_name.stream, cdl_name.mask, cdl_name.offset,
                                          cdl_name.descr};
    for (int i = 0; i < CDL_ENTRIES; i++)
        entries[i] = NULL;
    Py_ssize_t position = 0;
    PyObject *key, *value;
    /* Borrowed key and value, each taken by a new reference before another thread could change the dict. */
    CDL_BEGIN_CRITICAL_SECTION(iface);
    *ticket = cdl_cache_ticket(iface);
    while (PyDict_Next(iface, &position, &key, &value)) {
        int i = 0;
        while (i < CDL_ENTRIES && key != names[i])
            i++;
        if (i == CDL_ENTRIES && PyUnicode_CheckExact(key)) {
            i = 0;
            while (i < CDL_ENTRIES && PyUnicode_Compare(key, names[i]) != 0)
                i++;
        }
        if (i < CDL_ENTRIES)
            entries[i] = Py_NewRef(value);
    }
    CDL_END_CRITICAL_SECTION();
}

/* entries[index], or NULL with ValueError naming the missing key. */
static PyObject *cdl_required(PyObject *const *entries, int index, cdl_source source)
{
    static const char *const keys[] = {"version", "shape", "typestr", "data"};
    if (entries[index] == NULL)
        PyErr_Format(PyExc_ValueError, "%s lacks the required key '%s'", cdl_source_name(source), keys[index]);
    return entries[index];
}

/* A tuple or list of ints (shape or strides) into values; returns its length or -1. */
/* cdl_read_int_sequence of a tuple, or of a list inside its critical section. */
static Py_ssize_t cdl_read_int_items(PyObject *sequence, cdl_source source, const char *key, int64_t low,
                                     int64_t *values)
{
    Py_ssize_t length = PySequence_Fast_GET_SIZE(sequence);
    if (length > CDL_MAX_NDIM) {
        PyErr_Format(cdl_UnsupportedError, "%s '%s' has %zd entries; at most %d dimensions are supported",
                     cdl_source_name(source), key, length, CDL_MAX_NDIM);
        return -1;
    }
    for (Py_ssize_t i = 0; i < length; i++) {
        if (cdl_read_int(PySequence_Fast_GET_ITEM(sequence, i), source, key, i, low, INT64_MAX, &values[i]) < 0)
            return -1;
    }
    return length;
}

static Py_ssize_t cdl_read_int_sequence(PyObject *sequence, cdl_source source, const char *key, int64_t low,
                                        int64_t *values)
{
    if (!PyTuple_Check(sequence) && !PyList_Check(sequence)) {
        PyErr_Format(PyExc_TypeError, "%s '%s' must be a tuple of ints, not %.200s", cdl_source_name(source), key,
                     Py_TYPE(sequence)->tp_name);
        return -1;
    }
    if (PyTuple_Check(sequence))
        return cdl_read_int_items(sequence, source, key, low, values); /* immutable: no critical section */
    Py_ssize_t length;
    /* A list another thread changes is read as it was at one moment: the length read once, the items in
     * the critical section (with the GIL, nothing here runs Python code that could change it). */
    CDL_BEGIN_CRITICAL_SECTION(sequence);
    length = cdl_read_int_items(sequence, source, key, low, values);
    CDL_END_CRITICAL_SECTION();
    return length;
}

/* data: (pointer, read_only) for both interfaces; a buffer object or None (the object's own buffer)
 * for an array interface, kept alive through *keepalive. Sets out->data, out->read_only and, for a
 * buffer, *buffer_length. */
static int cdl_read_data(PyObject *data, cdl_source source, PyObject *obj, cdl_array *out, PyObject **keepalive,
                         Py_ssize_t *buffer_length)
{
    if (PyTuple_Check(data)) {
        if (PyTuple_GET_SIZE(data) != 2) {
            PyErr_Format(PyExc_ValueError, "%s 'data' must be a (pointer, read_only) pair, not %R",
                         cdl_source_name(source), data);
            return -1;
        }
        PyObject *pointer = PyTuple_GET_ITEM(data, 0), *read_only = PyTuple_GET_ITEM(data, 1);
        if (!PyLong_Check(pointer) || PyBool_Check(pointer)) {
            PyErr_Format(PyExc_TypeError, "%s 'data'[0] (the pointer) must be an int, not %.200s",
                         cdl_source_name(source), Py_TYPE(pointer)->tp_name);
            return -1;
        }
        /* Where long is 64 bits, its reader walks the digits; the long long one goes through a byte array on
         * 3.11, 5% of a conversion's time in a profile. Same range, same errors. */
#if ULONG_MAX == ULLONG_MAX
        unsigned long long address = PyLong_AsUnsignedLong(pointer);
#else
        unsigned long long address = PyLong_AsUnsignedLongLong(pointer);
#endif
        if (address == (unsigned long long)-1 && PyErr_Occurred()) {
            PyErr_Format(PyExc_ValueError, "%s 'data'[0] is %R, not a valid pointer", cdl_source_name(source),
                         pointer);
            return -1;
        }
        if (!PyBool_Check(read_only)) {
            PyErr_Format(PyExc_TypeError, "%s 'data'[1] (read-only) must be a bool, not %.200s",
                         cdl_source_name(source), Py_TYPE(read_only)->tp_name);
            return -1;
        }
        out->data = (void *)(uintptr_t)address;
        out->read_only = read_only == Py_True;
        return 0;
    }
    if (source == CDL_SOURCE_CAI || (data == Py_None && obj == NULL)) {
        PyErr_Format(PyExc_TypeError, "%s 'data' must be a (pointer, read_only) tuple, not %.200s",
                     cdl_source_name(source), Py_TYPE(data)->tp_name);
        return -1;
    }
    PyObject *view = PyMemoryView_FromObject(data == Py_None ? obj : data);
    if (view == NULL) {
        if (PyErr_ExceptionMatches(PyExc_TypeError)) {
            PyErr_Clear();
            PyErr_Format(PyExc_TypeError,
                         "__array_interface__ 'data' must be a (pointer, read_only) tuple, a buffer object, or None "
                         "for an object with a buffer; %.200s has no buffer",
                         Py_TYPE(data == Py_None ? obj : data)->tp_name);
        }
        return -1;
    }
    Py_buffer *buffer = PyMemoryView_GET_BUFFER(view);
    if (!PyBuffer_IsContiguous(buffer, 'C')) {
        Py_DECREF(view);
        PyErr_SetString(PyExc_ValueError, "__array_interface__ 'data' buffer is not contiguous");
        return -1;
    }
    out->data = buffer->buf;
    out->read_only = buffer->readonly;
    *buffer_length = buffer->len;
    *keepalive = view;
    return 0;
}

/* Checks the element count and the byte extent for overflow and for the pointer's range. For a
 * buffer (buffer_length >= 0) the extent must lie inside it, starting at offset. */
static int cdl_check_extent(const cdl_array *arr, cdl_source source, PyObject *shape, int64_t itemsize,
                            Py_ssize_t buffer_length, int64_t offset)
{
    int64_t low, high;
    switch (cdl_measure_extent(arr, itemsize, &low, &high)) {
    case CDL_EXTENT_EMPTY:
        return 0;
    case CDL_EXTENT_COUNT_OVERFLOW:
        PyErr_Format(PyExc_ValueError, "%s 'shape' %R has more elements than fit in 64 bits",
                     cdl_source_name(source), shape);
        return -1;
    case CDL_EXTENT_OVERFLOW:
        goto overflow;
    case CDL_EXTENT_OK:
        break;
    }
    if (buffer_length >= 0) {
        /* offset >= 0 and low <= 0, so offset + low cannot overflow (-low could, for INT64_MIN). */
        if (offset + low < 0 || high > (int64_t)buffer_length - offset) {
            PyErr_Format(PyExc_ValueError,
                         "__array_interface__ 'shape', 'strides' and 'offset' reach bytes [%lld, %lld) of a "
                         "buffer of %zd bytes",
                         (long long)(offset + low), (long long)(offset + high), buffer_length);
            return -1;
        }
        return 0;
    }
    if (arr->data == NULL) {
        int64_t count = 1;
        for (int32_t i = 0; i < arr->ndim; i++)
            count *= arr->shape[i]; /* the measure found no overflow */
        PyErr_Format(PyExc_ValueError, "%s 'data' pointer is 0 (NULL) but the array has %lld elements",
                     cdl_source_name(source), (long long)count);
        return -1;
    }
    if (cdl_extent_fits((uintptr_t)arr->data, low, high))
        return 0;
overflow:
    PyErr_Format(PyExc_ValueError, "%s 'shape' %R with these 'strides' reaches outside the address space",
                 cdl_source_name(source), shape);
    return -1;
}

/* The device fields of a record read from an interface: a CAI pointer's device is asked of the runtime. */
static int cdl_set_device(cdl_array *out, cdl_source source)
{
    if (source == CDL_SOURCE_CAI)
        return cdl_device_of_pointer(out->data, &out->device, &out->home_device);
    out->device.device_type = kDLCPU;
    out->device.device_id = out->home_device = 0;
    return 0;
}

/* Whether the fast readers may take out as measured: no elements, or a non-NULL pointer whose extent lies in the
 * address space. 0 leaves the array to a general reader, which raises what it finds. Sets no exception. */
static inline int cdl_extent_readable(const cdl_array *out, int64_t itemsize)
{
    int64_t low, high;
    switch (cdl_measure_extent(out, itemsize, &low, &high)) {
    case CDL_EXTENT_EMPTY:
        return 1;
    case CDL_EXTENT_OK:
        return out->data != NULL && cdl_extent_fits((uintptr_t)out->data, low, high);
    default:
        return 0;
    }
}

/* The fused reader, no dtype= asked: what the general reader below does for the common shapes of an interface
 * dict, in one pass, with borrowed references. Mostly a dict only this call holds (a producer's property builds
 * one on each access, as CuPy, Numba, PyTorch and RMM do): no critical section, since no other thread can reach
 * it. Of a dict held elsewhere (free-threaded builds only), the caller holds the dict's critical section, which
 * nothing here waits on anything to let go of. Nothing here runs Python code or makes an object the collector
 * tracks (which could start a collection, and its finalizers, or a signal handler), or waits: the typestr is named
 * without an exception (a refused one would be formatted by its repr, which first runs pending signal handlers
 * and, from 3.12, a pending collection). Only a pointer outside 0..2**64-1 is refused with one (the runtime's
 * OverflowError, set and cleared: no Python code runs), after which nothing borrowed is read again.
 * Whatever it does not read the common way (a key that is not one of our interned names, a list, a buffer, a
 * bool where an int goes, an int of several digits, a typestr no typestr alone names, a mask, strides that are
 * not whole items, any extent problem, a NULL pointer) it leaves to the general reader, which then reads the same
 * dict afresh and raises its errors: so this path never raises, and no dict reads differently through it.
 * Returns 1 with *out filled but for the device, else 0. */
static __attribute__((noinline)) int cdl_read_fresh_dict(PyObject *iface, cdl_source source, cdl_array *out)
{
    PyObject *found[CDL_FRESH_KEYS] = {NULL};
    PyObject *const *const names = cdl_name.fresh_keys; /* NULL after the last: a key is never NULL */
    Py_ssize_t position = 0, left = PyDict_GET_SIZE(iface);
    PyObject *key, *value;
    Py_ssize_t next = 0; /* the slot whose name is expected next: the one after the last found, as CuPy orders them */
    /* Stops at the last entry: the call that would only say so is not made. */
    while (left-- > 0 && PyDict_Next(iface, &position, &key, &value)) {
        Py_ssize_t slot = next;
        if (key != names[slot]) {
            slot = 0;
            while (slot < CDL_FRESH_KEYS && key != names[slot])
                slot++;
            if (slot == CDL_FRESH_KEYS) {
                if (key == cdl_name.mask ? value != Py_None : key != cdl_name.offset)
                    return 0; /* another key, or one of ours as a str of its own: the general reader compares text */
                continue;
            }
        }
        found[slot] = value;
        next = slot + 1;
    }
    PyObject *const version = found[CDL_FRESH_VERSION], *const shape = found[CDL_FRESH_SHAPE],
                   *const typestr = found[CDL_FRESH_TYPESTR], *const data = found[CDL_FRESH_DATA],
                   *const strides = found[CDL_FRESH_STRIDES], *const stream = found[CDL_FRESH_STREAM];
    int64_t number;
    if (version == NULL || !cdl_compact_int(version, &number) || number < 0 || number > 3)
        return 0;
    if (shape == NULL || !PyTuple_CheckExact(shape) || PyTuple_GET_SIZE(shape) > CDL_MAX_NDIM)
        return 0;
    const int32_t ndim = (int32_t)PyTuple_GET_SIZE(shape);
    for (int32_t i = 0; i < ndim; i++) {
        if (!cdl_compact_int(PyTuple_GET_ITEM(shape, i), &out->shape[i]) || out->shape[i] < 0)
            return 0;
    }
    out->ndim = ndim;
    /* A typestr alone names the type (the descr is then not read, as below); the parser's refusals are the
     * general reader's to raise. Only a compact ASCII str, which the parser reads in place: for any other it asks
     * the str for its UTF-8 form, which on a free-threaded build may wait for another thread's critical section
     * on that str, and a wait lets go of the dict's (every typestr the parser accepts is ASCII). */
    if (typestr == NULL || !PyUnicode_CheckExact(typestr) || !PyUnicode_IS_COMPACT_ASCII(typestr))
        return 0;
    if (cdl_name_ascii_typestr(typestr, &out->dtype) < 0)
        return 0;
    const int64_t itemsize = cdl_itemsize(out->dtype);
    if (data == NULL || !PyTuple_CheckExact(data) || PyTuple_GET_SIZE(data) != 2 ||
        !PyLong_CheckExact(PyTuple_GET_ITEM(data, 0)) || !PyBool_Check(PyTuple_GET_ITEM(data, 1)))
        return 0;
    unsigned long long address;
    if (!cdl_pointer_value(PyTuple_GET_ITEM(data, 0), &address))
        return 0;
    out->data = (void *)(uintptr_t)address;
    out->read_only = PyTuple_GET_ITEM(data, 1) == Py_True;
    out->stream = 0;
    if (source == CDL_SOURCE_CAI && stream != NULL && stream != Py_None) {
        /* A handle (a pointer: many digits) is read here too, not left to the general reader to read it all
         * again; exact ints only, in cdl_parse_stream's range. */
        if (!cdl_compact_int(stream, &out->stream)) {
            if (!PyLong_CheckExact(stream))
                return 0;
            int overflow;
            long long handle = PyLong_AsLongLongAndOverflow(stream, &overflow);
            if (overflow || (handle == -1 && PyErr_Occurred())) {
                PyErr_Clear();
                return 0;
            }
            out->stream = handle;
        }
        if (out->stream < 1)
            return 0;
    }
    if (strides == NULL || strides == Py_None) {
        /* C-contiguous: the strides, the element count and the extent [0, count * itemsize) in one loop; the
         * count is bounded by the stride product, so only that product can overflow (as the general reader
         * measures it: there, the same products). */
        int64_t stride = 1, count = 1, bytes;
        for (int32_t i = ndim - 1; i >= 0; i--) {
            out->strides[i] = stride;
            if (__builtin_mul_overflow(stride, out->shape[i] > 1 ? out->shape[i] : 1, &stride))
                return 0;
            count *= out->shape[i];
        }
        if (count == 0)
            return 1;
        return !__builtin_mul_overflow(count, itemsize, &bytes) && out->data != NULL &&
               cdl_extent_fits((uintptr_t)out->data, 0, bytes);
    }
    else {
        if (!PyTuple_CheckExact(strides) || PyTuple_GET_SIZE(strides) != ndim)
            return 0;
        for (int32_t i = 0; i < ndim; i++) {
            if (!cdl_compact_int(PyTuple_GET_ITEM(strides, i), &number) ||
                (!cdl_divide_exactly(number, itemsize, &out->strides[i]) && out->shape[i] > 1))
                return 0;
        }
    }
    return cdl_extent_readable(out, itemsize);
}

/* How many dicts the fused reader read (its own, not the general reader's): tests tell by it that the dicts real
 * producers build take the fast path, which is otherwise seen only in its cost. */
static unsigned long long cdl_fused_reads;

static inline void cdl_count_fused_read(void)
{
#ifdef Py_GIL_DISABLED
    __atomic_fetch_add(&cdl_fused_reads, 1, __ATOMIC_RELAXED);
#else
    cdl_fused_reads++;
#endif
}

/* _set_held_fused_reads(False), on free-threaded builds: a dict held elsewhere goes to the general reader (tests
 * compare the two readers by it; a fresh dict is always the fused reader's first). With the GIL, held dicts never
 * go to the fused reader. Set by tests while no other thread converts: a plain int. */
static int cdl_held_fused_off;

PyObject *cdl_set_held_fused_reads(PyObject *module, PyObject *enabled)
{
    (void)module;
    int on = PyObject_IsTrue(enabled);
    if (on < 0)
        return NULL;
    cdl_held_fused_off = !on;
    Py_RETURN_NONE;
}

PyObject *cdl_fused_reads_count(PyObject *module, PyObject *unused)
{
    (void)module, (void)unused;
    return PyLong_FromUnsignedLongLong(__atomic_load_n(&cdl_fused_reads, __ATOMIC_RELAXED));
}

/* Whether dropping value runs no Python code: absent, None, an exact int, bool or str, or an exact tuple of exact
 * ints and bools (no __del__, no weak reference; a tuple's release untracks it and runs nothing). */
static int cdl_inert(PyObject *value)
{
    if (value == NULL || value == Py_None || PyLong_CheckExact(value) || PyBool_Check(value) ||
        PyUnicode_CheckExact(value))
        return 1;
    if (!PyTuple_CheckExact(value))
        return 0;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(value); i++) {
        PyObject *item = PyTuple_GET_ITEM(value, i);
        if (!PyLong_CheckExact(item) && !PyBool_Check(item))
            return 0;
    }
    return 1;
}

/* Whether every entry a record may come from is inert (the store's rule below). The descr (NumPy's is a list) is
 * not: a record is kept only when the typestr alone names the type, so what the descr holds is not in it. */
/* Out of line: inlined, it moved the fresh-dict path's code (+4 instructions on 3.11). */
static __attribute__((noinline)) int cdl_entries_inert(PyObject *const *entries)
{
    for (int i = 0; i < CDL_DESCR; i++) {
        if (!cdl_inert(entries[i]))
            return 0;
    }
    return 1;
}

static __attribute__((noinline)) int cdl_read_entries(PyObject *iface, cdl_source source, PyObject *obj,
                                                      const DLDataType *requested, cdl_array *out,
                                                      PyObject **keepalive);

/* cdl_array_from_interface: the fused reader of a fresh dict and the kept records here, the general reader out of
 * line. Inlined into the conversion of an object too: with cdl_array_from_any_object and the export inlined into
 * cdl_cai2dlpack_plain, the calls they replaced had cost a fresh dict 49 instructions and a ready one 67 (callgrind,
 * 3.11). */
static inline __attribute__((always_inline)) int cdl_read_interface(PyObject *iface, cdl_source source, PyObject *obj,
                                                                    const DLDataType *requested, cdl_array *out,
                                                                    PyObject **keepalive)
{
    *keepalive = NULL;
    if (!PyDict_Check(iface)) {
        PyErr_Format(PyExc_TypeError, "%s must be a dict, not %.200s", cdl_source_name(source),
                     Py_TYPE(iface)->tp_name);
        return -1;
    }
#ifdef Py_GIL_DISABLED
    /* A dict only this call holds: no other thread can reach it. One held elsewhere: its kept record, else the
     * fused reader too, inside the dict's critical section, whose answer is kept (cdl_cache_ticket takes the dict's
     * version tag there, before the read). */
    const int held = Py_REFCNT(iface) > 1;
    if (requested == NULL && PyDict_CheckExact(iface) && (!held || !cdl_held_fused_off)) {
        if (held && cdl_cache_find(iface, source, out))
            return cdl_set_device(out, source);
        PyCriticalSection section;
        uint64_t ticket = 0;
        if (held) {
            PyCriticalSection_Begin(&section, iface);
            ticket = cdl_cache_ticket(iface);
        }
        const int fused = cdl_read_fresh_dict(iface, source, out);
        if (held)
            PyCriticalSection_End(&section);
        if (fused) {
            cdl_count_fused_read();
            if (held) {
                CDL_CACHE_READ_WAIT();
                cdl_cache_store(iface, source, ticket, out);
            }
            return cdl_set_device(out, source);
        }
    }
#else
    /* A dict only this call holds is never kept, so the kept records are not asked about it. One held elsewhere is
     * its kept record's, else the general reader's: read by the fused reader it would cost the fresh dict's path
     * a test more (+9 to +13 instructions there, and as much on the shim's), for what its record mostly serves. */
    if (requested == NULL && Py_REFCNT(iface) == 1 && PyDict_CheckExact(iface) &&
        cdl_read_fresh_dict(iface, source, out)) {
        cdl_count_fused_read();
        return cdl_set_device(out, source);
    }
#endif
    if (requested == NULL && cdl_cache_find(iface, source, out))
        return cdl_set_device(out, source);
    return cdl_read_entries(iface, source, obj, requested, out, keepalive);
}

int cdl_array_from_interface(PyObject *iface, cdl_source source, PyObject *obj, const DLDataType *requested,
                             cdl_array *out, PyObject **keepalive)
{
    return cdl_read_interface(iface, source, obj, requested, out, keepalive);
}

/* The general reader: every entry read as the specifications say, each refusal raised, the record kept where the
 * rules below allow. *keepalive is NULL on entry. */
static int cdl_read_entries(PyObject *iface, cdl_source source, PyObject *obj, const DLDataType *requested,
                            cdl_array *out, PyObject **keepalive)
{
    /* Strong references: reading a buffer object may run Python code that changes the dict. */
    PyObject *entries[CDL_ENTRIES];
    uint64_t ticket;
    cdl_collect_entries(iface, entries, &ticket);
    CDL_CACHE_READ_WAIT();
    int status = -1;

    PyObject *value = cdl_required(entries, CDL_VERSION, source);
    int64_t version;
    if (value == NULL || cdl_read_int(value, source, "version", -1, 0, 3, &version) < 0)
        goto done;

    PyObject *shape = cdl_required(entries, CDL_SHAPE, source);
    Py_ssize_t ndim = shape ? cdl_read_int_sequence(shape, source, "shape", 0, out->shape) : -1;
    if (ndim < 0)
        goto done;
    out->ndim = (int32_t)ndim;

    /* Naming the type may run Python (the object's dtype), which may change a strides list read after it: the
     * list is taken as it is now, with the shape (its errors still come in the order of the keys). */
    const int strides_listed = entries[CDL_STRIDES] != NULL && PyList_Check(entries[CDL_STRIDES]);
    if (strides_listed) {
        PyObject *taken = PyList_AsTuple(entries[CDL_STRIDES]);
        if (taken == NULL)
            goto done;
        Py_SETREF(entries[CDL_STRIDES], taken);
    }

    value = cdl_required(entries, CDL_TYPESTR, source);
    int named = value ? cdl_parse_interface_dtype(value, entries[CDL_DESCR], obj, requested, cdl_source_name(source),
                                                  &out->dtype)
                      : -1;
    if (named < 0)
        goto done;
    int64_t itemsize = cdl_itemsize(out->dtype);

    /* NumPy reads an array interface without 'data' as 'data': None, the object's own buffer. */
    PyObject *data = source == CDL_SOURCE_ARRAY_INTERFACE && obj != NULL && entries[CDL_DATA] == NULL
                         ? Py_None
                         : cdl_required(entries, CDL_DATA, source);
    if (data == NULL)
        goto done;

    value = entries[CDL_STRIDES];
    if (value != NULL && value != Py_None) {
        int64_t byte_strides[CDL_MAX_NDIM];
        Py_ssize_t count = cdl_read_int_sequence(value, source, "strides", INT64_MIN, byte_strides);
        if (count < 0)
            goto done;
        if (count != ndim) {
            PyErr_Format(PyExc_ValueError, "%s 'strides' has %zd entries but 'shape' has %zd",
                         cdl_source_name(source), count, ndim);
            goto done;
        }
        for (Py_ssize_t i = 0; i < ndim; i++) {
            /* A dimension of extent 0 or 1 never steps: its stride may be any number of bytes (NumPy exports
             * such views), and any element stride says the same there. */
            if (!cdl_divide_exactly(byte_strides[i], itemsize, &out->strides[i]) && out->shape[i] > 1) {
                PyErr_Format(cdl_UnsupportedError,
                             "%s 'strides'[%zd] is %lld bytes, not a multiple of the itemsize %lld; DLPack "
                             "strides count elements",
                             cdl_source_name(source), i, (long long)byte_strides[i], (long long)itemsize);
                goto done;
            }
        }
    }
    else if (cdl_contiguous_strides(out->ndim, out->shape, out->strides) < 0) {
        PyErr_Format(PyExc_ValueError, "%s 'shape' %R has more elements than fit in 64 bits",
                     cdl_source_name(source), shape);
        goto done;
    }

    out->stream = 0;
    if (source == CDL_SOURCE_CAI &&
        cdl_parse_stream(entries[CDL_STREAM], "__cuda_array_interface__ 'stream'", 0, &out->stream) < 0)
        goto done;

    value = entries[CDL_MASK];
    if (value != NULL && value != Py_None) {
        PyErr_Format(cdl_UnsupportedError, "%s 'mask' is set (%.200s); DLPack has no masked arrays",
                     cdl_source_name(source), Py_TYPE(value)->tp_name);
        goto done;
    }

    Py_ssize_t buffer_length = -1;
    if (cdl_read_data(data, source, obj, out, keepalive, &buffer_length) < 0)
        goto done;
    int64_t offset = 0;
    if (buffer_length >= 0) {
        value = entries[CDL_OFFSET];
        if (value != NULL && value != Py_None &&
            cdl_read_int(value, source, "offset", -1, 0, buffer_length, &offset) < 0)
            goto done;
        out->data = (char *)out->data + offset;
    }
    if (cdl_check_extent(out, source, shape, itemsize, buffer_length, offset) < 0)
        goto done;

    /* Every value the record came from is immutable, so the dict's version tag covers them (named: the type came
     * from dtype=, the descr or obj). Each is also inert: dropping it runs no Python code. On 3.11 and 3.12 an
     * attribute store into an object's own combined __dict__ (the specialized STORE_ATTR_WITH_HINT) drops the old
     * value before it writes the new tag, so a __del__ there could be served this record of the old content. */
    value = entries[CDL_STRIDES];
    if (!named && Py_REFCNT(iface) > 1 && buffer_length < 0 && PyTuple_Check(shape) && !strides_listed &&
        (value == NULL || value == Py_None || PyTuple_Check(value)) && cdl_entries_inert(entries))
        cdl_cache_store(iface, source, ticket, out);
    status = cdl_set_device(out, source);
done:
    if (status < 0)
        Py_CLEAR(*keepalive);
    for (int i = 0; i < CDL_ENTRIES; i++)
        Py_XDECREF(entries[i]);
    return status;
}

/* A buffer export held for a tensor: the Py_buffer in a capsule of ours (no name: it is never handed out), which
 * releases the export when the tensor lets go. One small object where a memoryview is two tracked ones. */
static void cdl_buffer_hold_destructor(PyObject *capsule)
{
    Py_buffer *buffer = PyCapsule_GetPointer(capsule, NULL);
    PyBuffer_Release(buffer);
    PyMem_Free(buffer);
}

PyObject *cdl_keepalive_exporter(PyObject *keepalive)
{
    if (PyCapsule_CheckExact(keepalive) && PyCapsule_GetDestructor(keepalive) == cdl_buffer_hold_destructor)
        return ((Py_buffer *)PyCapsule_GetPointer(keepalive, NULL))->obj;
    return PyMemoryView_GET_BUFFER(keepalive)->obj;
}

/* Host arrays whose type implements __array_interface__ in C and exports a buffer (NumPy's ndarray):
 * the buffer describes the same array as the interface, and reading it costs a tenth of the dict
 * NumPy builds on every __array_interface__ access. The export, held in *keepalive (a buffer hold, above),
 * lives as long as the tensor. Returns 1 with *out filled, 0 when the buffer cannot describe the array
 * (the caller then reads __array_interface__, whose errors name the offending key), -1 with an exception
 * set. */
static int cdl_array_from_buffer(PyObject *obj, cdl_array *out, PyObject **keepalive)
{
    Py_buffer *buffer = PyMem_Malloc(sizeof(Py_buffer));
    if (buffer == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    /* What a memoryview of obj asks for. */
    if (PyObject_GetBuffer(obj, buffer, PyBUF_FULL_RO) < 0) {
        PyMem_Free(buffer);
        if (!PyErr_ExceptionMatches(PyExc_Exception) || PyErr_ExceptionMatches(PyExc_MemoryError))
            return -1;
        PyErr_Clear();
        return 0;
    }
    if (buffer->ndim > CDL_MAX_NDIM || buffer->suboffsets != NULL ||
        cdl_dtype_from_format(buffer->format, buffer->itemsize, &out->dtype) < 0)
        goto fallback;
    int64_t itemsize = buffer->itemsize;
    out->ndim = buffer->ndim;
    for (int i = 0; i < buffer->ndim; i++) {
        out->shape[i] = buffer->shape[i];
        if (out->shape[i] < 0)
            goto fallback;
    }
    /* A C-contiguous buffer is given its contiguous strides, as the array's interface gives them ('strides' None):
     * NumPy's buffer of an empty array may step by 0 bytes where its interface says nothing. */
    if (buffer->strides != NULL && !PyBuffer_IsContiguous(buffer, 'C')) {
        for (int i = 0; i < buffer->ndim; i++) {
            if (!cdl_divide_exactly(buffer->strides[i], itemsize, &out->strides[i]) && out->shape[i] > 1)
                goto fallback; /* a stride of extent 0 or 1 never steps; any other counts whole items */
        }
    }
    else if (cdl_contiguous_strides(out->ndim, out->shape, out->strides) < 0) {
        goto fallback;
    }
    out->data = buffer->buf;
    out->read_only = buffer->readonly;
    out->device.device_type = kDLCPU;
    out->device.device_id = out->home_device = 0;
    out->stream = 0;
    if (cdl_check_extent(out, CDL_SOURCE_ARRAY_INTERFACE, Py_None, itemsize, -1, 0) < 0) {
        PyErr_Clear();
        goto fallback;
    }
    *keepalive = PyCapsule_New(buffer, NULL, cdl_buffer_hold_destructor);
    if (*keepalive == NULL) {
        PyBuffer_Release(buffer);
        PyMem_Free(buffer);
        return -1;
    }
    return 1;
fallback:
    PyBuffer_Release(buffer);
    PyMem_Free(buffer);
    return 0;
}

/* ---- NumPy arrays, read from their fields ---------------------------------------------------------- */

/* The leading fields of NumPy's array object and of its dtype object, as numpy/ndarraytypes.h lays them out.
 * They are NumPy's ABI: extensions built against any NumPy since 1.7 read them in place through its macros
 * (PyArray_DATA, PyArray_NDIM, PyArray_DESCR, ...), and NumPy 2 changed only the dtype's fields after type_num.
 * PyObject_HEAD is this interpreter's own header, as it is NumPy's when built for it (free-threaded included). */
typedef struct {
    PyObject_HEAD
    char *data;
    int nd;
    Py_intptr_t *dimensions;
    Py_intptr_t *strides; /* bytes */
    PyObject *base;
    PyObject *descr;
    int flags;
} cdl_numpy_array;

typedef struct {
    PyObject_HEAD
    PyTypeObject *typeobj;
    char kind, type, byteorder, former_flags;
    int type_num;
} cdl_numpy_descr;

/* NumPy's public array flags (ndarraytypes.h). NumPy keeps flags of its own above these (one marks arrays that
 * warn on their first write, which its buffer reports read-only): an array with any of them set is left to the
 * buffer, where NumPy says what they mean. */
enum {
    CDL_NUMPY_C_CONTIGUOUS = 0x0001,
    CDL_NUMPY_F_CONTIGUOUS = 0x0002,
    CDL_NUMPY_WRITEABLE = 0x0400,
    CDL_NUMPY_PUBLIC_FLAGS = 0xFFFF
};

/* numpy.ndarray once an array of it was met (NULL before): arrays of exactly that type are read from their
 * fields. Set once, to the one static type of that name; read without a lock on free-threaded builds. */
static PyTypeObject *cdl_ndarray_type;

/* Whether type is numpy.ndarray: a static type of that name that exports buffers and whose objects hold the
 * fields above (a Python class never qualifies, whatever its name). Noted the first time it is seen, after
 * which one pointer comparison answers. */
static inline int cdl_is_ndarray_type(PyTypeObject *type)
{
    PyTypeObject *known = __atomic_load_n(&cdl_ndarray_type, __ATOMIC_RELAXED);
    if (known != NULL || (type->tp_flags & Py_TPFLAGS_HEAPTYPE))
        return type == known;
    if (type->tp_basicsize < (Py_ssize_t)sizeof(cdl_numpy_array) || type->tp_as_buffer == NULL ||
        type->tp_as_buffer->bf_getbuffer == NULL || strcmp(type->tp_name, "numpy.ndarray") != 0)
        return 0;
    __atomic_store_n(&cdl_ndarray_type, type, __ATOMIC_RELAXED);
    return 1;
}

/* DLPack's type of a NumPy type number (NPY_BOOL ... NPY_CDOUBLE, then NPY_HALF), in native byte order; bits 0
 * for the types DLPack has no row for here (long double, objects, strings, dates, ...): those go to the buffer. */
static const DLDataType cdl_numpy_types[24] = {
    [0] = {kDLBool, 8, 1},
    [1] = {kDLInt, 8, 1},
    [2] = {kDLUInt, 8, 1},
    [3] = {kDLInt, 8 * sizeof(short), 1},
    [4] = {kDLUInt, 8 * sizeof(short), 1},
    [5] = {kDLInt, 8 * sizeof(int), 1},
    [6] = {kDLUInt, 8 * sizeof(int), 1},
    [7] = {kDLInt, 8 * sizeof(long), 1},
    [8] = {kDLUInt, 8 * sizeof(long), 1},
    [9] = {kDLInt, 8 * sizeof(long long), 1},
    [10] = {kDLUInt, 8 * sizeof(long long), 1},
    [11] = {kDLFloat, 32, 1},
    [12] = {kDLFloat, 64, 1},
    [14] = {kDLComplex, 64, 1},
    [15] = {kDLComplex, 128, 1},
    [23] = {kDLFloat, 16, 1},
};

/* An exact numpy.ndarray read from its fields: what its buffer says (type, shape, strides, read-only), without
 * NumPy building the buffer's format and shape arrays (and us holding the export) on every conversion. The array
 * itself keeps its memory: the tensor holds it as the owner, as it holds any producer. Returns 1 with *out
 * filled, 0 for an array the buffer reader is left to (a byte order, type or flag this does not read). Sets
 * no exception. */
static int cdl_array_from_ndarray(PyObject *obj, cdl_array *out)
{
    const cdl_numpy_array *array = (const cdl_numpy_array *)obj;
    const cdl_numpy_descr *descr = (const cdl_numpy_descr *)array->descr;
    const int flags = array->flags;
#if PY_BIG_ENDIAN
    const char foreign = '<';
#else
    const char foreign = '>';
#endif
    if ((flags & ~CDL_NUMPY_PUBLIC_FLAGS) != 0 || array->nd < 0 || array->nd > CDL_MAX_NDIM ||
        descr->byteorder == foreign || descr->type_num < 0 ||
        descr->type_num >= (int)(sizeof(cdl_numpy_types) / sizeof(cdl_numpy_types[0])) ||
        cdl_numpy_types[descr->type_num].bits == 0)
        return 0;
    out->dtype = cdl_numpy_types[descr->type_num];
    const int64_t itemsize = cdl_itemsize(out->dtype);
    out->ndim = array->nd;
    for (int i = 0; i < array->nd; i++)
        out->shape[i] = array->dimensions[i];
    /* A contiguous array is given the strides of its order, as its buffer gives them (its own may differ where an
     * extent is 0 or 1, which never steps): C order first, as NumPy's buffer asks. */
    if (flags & CDL_NUMPY_C_CONTIGUOUS) {
        if (cdl_contiguous_strides(out->ndim, out->shape, out->strides) < 0)
            return 0;
    }
    else if (flags & CDL_NUMPY_F_CONTIGUOUS) {
        int64_t stride = 1;
        for (int i = 0; i < array->nd; i++) {
            out->strides[i] = stride;
            if (__builtin_mul_overflow(stride, out->shape[i] > 1 ? out->shape[i] : 1, &stride))
                return 0;
        }
    }
    else {
        for (int i = 0; i < array->nd; i++) {
            if (!cdl_divide_exactly(array->strides[i], itemsize, &out->strides[i]) && out->shape[i] > 1)
                return 0;
        }
    }
    out->data = array->data;
    out->read_only = !(flags & CDL_NUMPY_WRITEABLE);
    out->device.device_type = kDLCPU;
    out->device.device_id = out->home_device = 0;
    out->stream = 0;
    return cdl_extent_readable(out, itemsize);
}

/* Whether obj's type implements __array_interface__ in C (a getset descriptor, not a Python-level
 * property that might describe other memory) and exports a buffer. generic: obj's attribute access is the
 * generic one and array is its type's __array_interface__ (or NULL), already looked up. */
static int cdl_has_native_array_buffer(PyObject *obj, int generic, PyObject *array)
{
    PyBufferProcs *procs = Py_TYPE(obj)->tp_as_buffer;
    if (procs == NULL || procs->bf_getbuffer == NULL)
        return 0;
    if (generic)
        return array != NULL && Py_IS_TYPE(array, &PyGetSetDescr_Type);
    PyObject *descriptor = cdl_type_lookup(Py_TYPE(obj), cdl_name.array_interface);
    int native = descriptor != NULL && Py_IS_TYPE(descriptor, &PyGetSetDescr_Type);
    Py_XDECREF(descriptor);
    return native;
}

/* dict[key] as a new reference, or NULL (absent, or an error set). */
static PyObject *cdl_dict_value(PyObject *dict, PyObject *key)
{
#if PY_VERSION_HEX >= 0x030D0000
    PyObject *value;
    (void)PyDict_GetItemRef(dict, key, &value);
    return value;
#else
    return Py_XNewRef(PyDict_GetItemWithError(dict, key));
#endif
}

/* The few entries of a small instance dict are walked in less time than two lookups take. Every key of the
 * walk must be an interned str (setattr interns attribute names): one of those equals one of our interned
 * names only by being it. Returns 1 with *iface and *source set, 0 when neither name is a key, or -2 when
 * the dict is too large or holds another key, for the lookups to decide. */
static int cdl_walk_instance_dict(PyObject *dict, PyObject **iface, cdl_source *source)
{
    if (PyDict_GET_SIZE(dict) > 4)
        return -2;
    PyObject *cai = NULL, *array = NULL;
    int found = 0;
    CDL_BEGIN_CRITICAL_SECTION(dict);
    Py_ssize_t position = 0;
    PyObject *key, *value;
    while (PyDict_Next(dict, &position, &key, &value)) {
        if (key == cdl_name.cuda_array_interface)
            cai = value;
        else if (key == cdl_name.array_interface)
            array = value;
        else if (!PyUnicode_CheckExact(key) || !PyUnicode_CHECK_INTERNED(key))
            found = -2;
    }
    if (found == 0 && (cai != NULL || array != NULL)) {
        *source = cai != NULL ? CDL_SOURCE_CAI : CDL_SOURCE_ARRAY_INTERFACE;
        *iface = Py_NewRef(cai != NULL ? cai : array);
        found = 1;
    }
    CDL_END_CRITICAL_SECTION();
    return found;
}

/* Both interfaces of an object whose type defines neither and has no attribute hooks (a plain class holding
 * a ready dict) can only be instance attributes: its instance dict is asked for both, which is what the two
 * generic attribute lookups would do, at a third of their cost (the first of them fails for every host
 * object). Returns 1 with *iface and *source set, 0 when neither is there, -1 with an exception set, or -2
 * when obj is not such an object. */
static int cdl_instance_interface(PyObject *obj, PyObject **iface, cdl_source *source)
{
    PyObject *dict = PyObject_GenericGetDict(obj, NULL);
    if (dict == NULL)
        return -1;
    int found = cdl_walk_instance_dict(dict, iface, source);
    if (found == -2) {
        *source = CDL_SOURCE_CAI;
        *iface = cdl_dict_value(dict, cdl_name.cuda_array_interface);
        if (*iface == NULL && !PyErr_Occurred()) {
            *source = CDL_SOURCE_ARRAY_INTERFACE;
            *iface = cdl_dict_value(dict, cdl_name.array_interface);
        }
        found = *iface != NULL ? 1 : PyErr_Occurred() ? -1 : 0;
    }
    Py_DECREF(dict);
    return found;
}

/* Whether instances of type have no attribute dict (a NumPy array). */
static int cdl_has_no_instance_dict(PyTypeObject *type)
{
#ifdef Py_TPFLAGS_MANAGED_DICT
    if (type->tp_flags & Py_TPFLAGS_MANAGED_DICT)
        return 0;
#endif
    return type->tp_dictoffset == 0;
}

/* getattr(obj, name) as cdl_lookup_attribute answers it. generic: obj's attribute access is the generic one, and
 * descriptor is what obj's type holds under name (or NULL): a data descriptor there (a property, a getset) is what the
 * generic lookup would call before anything else, so it is called here at once. Inlined: as a call it cost a
 * conversion 20 instructions (callgrind), a seventh of what its producer's property leaves us. */
static inline __attribute__((always_inline)) int
cdl_interface_attribute(PyObject *obj, PyObject *name, int generic, PyObject *descriptor, PyObject **value)
{
    *value = NULL;
    if (generic && descriptor == NULL && cdl_has_no_instance_dict(Py_TYPE(obj)))
        return 0; /* in neither place the generic lookup would look (a NumPy array's CUDA interface) */
    if (descriptor != NULL && Py_TYPE(descriptor)->tp_descr_get != NULL &&
        Py_TYPE(descriptor)->tp_descr_set != NULL) {
        *value = Py_TYPE(descriptor)->tp_descr_get(descriptor, obj, (PyObject *)Py_TYPE(obj));
        if (*value != NULL)
            return 1;
        if (!PyErr_ExceptionMatches(PyExc_AttributeError))
            return -1;
        PyErr_Clear();
        return 0;
    }
    return cdl_lookup_attribute(obj, name, value);
}

/* The CUDA interface of an object whose array interface went since its CUDA one was found missing (a shim's host
 * mark): asked for after all, each attribute once as in any conversion. Out of line: the common path's frame stays
 * as it was (inlined, it cost a conversion 40 to 57 instructions, callgrind). */
static __attribute__((noinline)) int cdl_cuda_interface_after_all(PyObject *obj, int generic, PyObject **iface)
{
    PyObject *descriptor = generic ? cdl_type_lookup(Py_TYPE(obj), cdl_name.cuda_array_interface) : NULL;
    int found = cdl_interface_attribute(obj, cdl_name.cuda_array_interface, generic, descriptor, iface);
    Py_XDECREF(descriptor);
    return found;
}

/* cdl_array_from_object of an object, not a dict; cai: its type's attribute of that name when its attribute
 * access is the generic one (a strong reference, or NULL), else NULL. *array_of_type: the same of
 * __array_interface__ (a strong reference the caller releases), looked up only once the CUDA interface is found
 * missing where the type has one: a CUDA producer's property answers first, and the type is looked up after any
 * Python code its descriptor ran, as getattr would. cai_absent: the caller found the CUDA interface missing just
 * before: it is asked for only if the array interface is missing now. */
static inline __attribute__((always_inline)) int
cdl_array_from_attributes(PyObject *obj, const DLDataType *requested, cdl_array *out, PyObject **keepalive, int generic,
                          PyObject *cai, PyObject **array_of_type, int cai_absent)
{
    PyObject *iface;
    cdl_source source = CDL_SOURCE_CAI;
    int found = -2;
    if (generic && cai == NULL)
        *array_of_type = cdl_type_lookup(Py_TYPE(obj), cdl_name.array_interface);
    PyObject *array = *array_of_type;
    if (!cai_absent && generic && Py_TYPE(obj)->tp_dictoffset != 0 && cai == NULL && array == NULL)
        found = cdl_instance_interface(obj, &iface, &source);
    if (found == -2) {
        found = cai_absent ? 0 : cdl_interface_attribute(obj, cdl_name.cuda_array_interface, generic, cai, &iface);
        if (found == 0 && generic && cai != NULL)
            array = *array_of_type = cdl_type_lookup(Py_TYPE(obj), cdl_name.array_interface);
        if (found == 0) {
            if (requested == NULL && cdl_has_native_array_buffer(obj, generic, array)) {
                *keepalive = NULL;
                int read = cdl_array_from_buffer(obj, out, keepalive);
                if (read != 0)
                    return read < 0 ? -1 : 0;
            }
            source = CDL_SOURCE_ARRAY_INTERFACE;
            found = cdl_interface_attribute(obj, cdl_name.array_interface, generic, array, &iface);
        }
    }
    if (found == 0 && cai_absent) {
        source = CDL_SOURCE_CAI;
        found = cdl_cuda_interface_after_all(obj, generic, &iface);
    }
    if (found < 0)
        return -1;
    if (found == 0) {
        PyErr_Format(PyExc_TypeError,
                     "object of type %.200s has neither __cuda_array_interface__ nor __array_interface__",
                     Py_TYPE(obj)->tp_name);
        return -1;
    }
    int status = cdl_read_interface(iface, source, obj, requested, out, keepalive);
    Py_DECREF(iface);
    return status;
}

/* Inlined into its three callers, cdl_cai2dlpack_plain's with requested NULL (what the calls had cost: above
 * cdl_read_interface). */
static inline __attribute__((always_inline)) int cdl_array_from_any_object(PyObject *obj, const DLDataType *requested,
                                                                           cdl_array *out, PyObject **keepalive,
                                                                           int cai_absent)
{
    if (PyDict_Check(obj))
        return cdl_array_from_interface(obj, CDL_SOURCE_CAI, NULL, requested, out, keepalive);
    PyTypeObject *type = Py_TYPE(obj);
    /* numpy.ndarray has no CUDA interface and no instance dict: its buffer would be read (below), and its fields
     * say the same. */
    if (requested == NULL && cdl_is_ndarray_type(type) && cdl_array_from_ndarray(obj, out)) {
        *keepalive = NULL;
        return 0;
    }
    const int generic = type->tp_getattro == PyObject_GenericGetAttr;
    PyObject *cai = generic && !cai_absent ? cdl_type_lookup(type, cdl_name.cuda_array_interface) : NULL;
    PyObject *array = NULL;
    int status = cdl_array_from_attributes(obj, requested, out, keepalive, generic, cai, &array, cai_absent);
    Py_XDECREF(cai);
    Py_XDECREF(array);
    return status;
}

int cdl_array_from_object(PyObject *obj, const DLDataType *requested, cdl_array *out, PyObject **keepalive)
{
    return cdl_array_from_any_object(obj, requested, out, keepalive, 0);
}

int cdl_array_from_host_object(PyObject *obj, const DLDataType *requested, cdl_array *out, PyObject **keepalive)
{
    return cdl_array_from_any_object(obj, requested, out, keepalive, 1);
}

/* ---- export -------------------------------------------------------------------------------------- */

/* max_version: None (legacy capsule) or a (major, minor) tuple; sets *versioned. The general read, out of line. */
static __attribute__((noinline)) int cdl_parse_max_version_general(PyObject *max_version, int *versioned)
{
    *versioned = 0;
    if (max_version == NULL || max_version == Py_None)
        return 0;
    if (!PyTuple_Check(max_version) || PyTuple_GET_SIZE(max_version) != 2 ||
        !PyLong_Check(PyTuple_GET_ITEM(max_version, 0)) || !PyLong_Check(PyTuple_GET_ITEM(max_version, 1))) {
        PyErr_Format(PyExc_TypeError, "max_version must be None or a (major, minor) tuple of ints, not %R",
                     max_version);
        return -1;
    }
    int64_t major;
    if (!cdl_compact_int(PyTuple_GET_ITEM(max_version, 0), &major)) { /* not one digit: the general read */
        major = PyLong_AsLong(PyTuple_GET_ITEM(max_version, 0));
        if (major == -1 && PyErr_Occurred())
            return -1;
    }
    *versioned = major >= 1;
    return 0;
}

/* The same, with torch's (1, 0) read inline: an exact pair whose major is a one-digit int and whose minor is an
 * exact int; anything else (None, a bool, a big int, a list, a subclass) by the general read. */
static inline __attribute__((always_inline)) int cdl_parse_max_version(PyObject *max_version, int *versioned)
{
    int64_t major;
    if (max_version != NULL && PyTuple_CheckExact(max_version) && PyTuple_GET_SIZE(max_version) == 2 &&
        PyLong_CheckExact(PyTuple_GET_ITEM(max_version, 1)) &&
        cdl_compact_int(PyTuple_GET_ITEM(max_version, 0), &major)) {
        *versioned = major >= 1;
        return 0;
    }
    return cdl_parse_max_version_general(max_version, versioned);
}

/* dl_device: None (the data's own device) or a (device_type, device_id) pair, into *target. */
static int cdl_parse_dl_device(PyObject *dl_device, DLDevice device, DLDevice *target)
{
    *target = device;
    if (dl_device == NULL || dl_device == Py_None)
        return 0;
    int type, id;
    if (!PyTuple_Check(dl_device) || !PyArg_ParseTuple(dl_device, "ii", &type, &id)) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "dl_device must be None or a (device_type, device_id) tuple, not %R",
                     dl_device);
        return -1;
    }
    target->device_type = (DLDeviceType)type;
    target->device_id = id;
    return 0;
}

/* A capsule of arr, its data ordered after the producer's stream, whose tensor keeps owner alive until the work
 * its consumer queued on its stream by the time it lets go has run (ordered_release.c): the release point goes
 * into the block as it is made, no capsule is asked for its pointer again. Releases that became ready are made
 * now. (A wait queued before an allocation that then fails only orders the consumer's stream once more.) Inlined
 * into both exports, the no-keyword one a call shorter. */
static inline __attribute__((always_inline)) PyObject *
cdl_export_shared(const cdl_array *arr, PyObject *owner, PyObject *keepalive, int versioned, int64_t consumer)
{
    if (cdl_order_streams(arr, consumer) < 0)
        return NULL;
    /* Host memory is released at once: the release point cdl_release_point_for_drop would give it says so, and is
     * not made (one comparison; any other type is asked, and the point says what it is). */
    cdl_release_point point;
    const cdl_release_point *release_at = NULL;
    if (arr->device.device_type != kDLCPU) {
        cdl_release_point_for_drop(&point, consumer, arr);
        release_at = &point;
    }
    PyObject *capsule = cdl_capsule_from_array(arr, owner, keepalive, versioned, release_at);
    if (capsule != NULL)
        cdl_release_completed();
    return capsule;
}

/* BufferError for read-only data asked for as a legacy capsule. Returns NULL. */
static PyObject *cdl_refuse_read_only_legacy(void)
{
    PyErr_SetString(PyExc_BufferError,
                    "the array is read-only, which a legacy 'dltensor' capsule cannot say; ask for "
                    "max_version=(1, 0) or newer to get a versioned capsule with the read-only flag");
    return NULL;
}

/* cdl_export of a consumer that asked for something; kept out of line so that the common call, which asks for
 * nothing, does not pay for saving the registers this one needs. */
static __attribute__((noinline)) PyObject *cdl_export_as_asked(const cdl_array *arr, PyObject *owner,
                                                                PyObject *keepalive, PyObject *stream,
                                                                PyObject *max_version, PyObject *dl_device,
                                                                PyObject *copy)
{
    int64_t consumer;
    int versioned;
    DLDevice target;
    if (cdl_parse_stream(stream, "stream", 1, &consumer) < 0 || cdl_parse_max_version(max_version, &versioned) < 0 ||
        cdl_parse_dl_device(dl_device, arr->device, &target) < 0)
        return NULL;
    /* copy: None, or a truth value. A bool, or a number that has one (a NumPy bool_ or 0-d array, as NumPy's own
     * __dlpack__ takes; an array of several values raises its own ValueError); a str or any other object is a
     * TypeError, never read as True. */
    int copy_asked = -1;
    if (copy != NULL && copy != Py_None) {
        if (!PyBool_Check(copy) && !PyNumber_Check(copy)) {
            PyErr_Format(PyExc_TypeError, "copy must be None or a bool, not %.200s", Py_TYPE(copy)->tp_name);
            return NULL;
        }
        if ((copy_asked = PyObject_IsTrue(copy)) < 0)
            return NULL;
    }
    /* The array API's rules (the README's table): copy=True copies, a dl_device other than the data's asks for
     * a copy there unless copy=False, which never copies. Copies are made to the host or on the data's own
     * device, nowhere else. */
    int other_device = target.device_type != arr->device.device_type || target.device_id != arr->device.device_id;
    /* Refusals are UnsupportedArrayError: the BufferError the array API asks __dlpack__ for, and the ValueError
     * it asks from_dlpack for (NumPy's from_dlpack passes ours on as it is). */
    if (other_device && copy_asked == 0) {
        PyErr_Format(cdl_UnsupportedError,
                     "dl_device (%d, %d) differs from the data's device (%d, %d) and copy=False forbids a copy",
                     (int)target.device_type, (int)target.device_id, (int)arr->device.device_type,
                     (int)arr->device.device_id);
        return NULL;
    }
    if (other_device && !(target.device_type == kDLCPU && target.device_id == 0)) {
        PyErr_Format(cdl_UnsupportedError,
                     "dl_device (%d, %d) differs from the data's device (%d, %d); cai_dlpack copies only to the "
                     "host, dl_device=(1, 0), or on the data's own device (copy=True), not to %s from %s",
                     (int)target.device_type, (int)target.device_id, (int)arr->device.device_type,
                     (int)arr->device.device_id, cdl_device_type_name((int)target.device_type),
                     cdl_device_type_name((int)arr->device.device_type));
        return NULL;
    }
    if (other_device || copy_asked == 1)
        return cdl_export_copy(arr, target, consumer, owner, keepalive, versioned);
    if (arr->read_only && !versioned)
        return cdl_refuse_read_only_legacy();
    return cdl_export_shared(arr, owner, keepalive, versioned, consumer);
}

/* The export of a consumer that asks for no stream, device or copy: the legacy stream, the data where it is. */
static inline __attribute__((always_inline)) PyObject *cdl_export_unasked(const cdl_array *arr, PyObject *owner,
                                                                          PyObject *keepalive, int versioned)
{
    if (arr->read_only && !versioned)
        return cdl_refuse_read_only_legacy();
    return cdl_export_shared(arr, owner, keepalive, versioned, CDL_STREAM_LEGACY);
}

PyObject *cdl_export(const cdl_array *arr, PyObject *owner, PyObject *keepalive, PyObject *stream,
                     PyObject *max_version, PyObject *dl_device, PyObject *copy)
{
    if (stream == NULL && dl_device == NULL && copy == NULL) {
        /* No keyword but max_version (torch's call for host memory). */
        int versioned = 0;
        if (max_version != NULL && cdl_parse_max_version(max_version, &versioned) < 0)
            return NULL;
        return cdl_export_unasked(arr, owner, keepalive, versioned);
    }
    return cdl_export_as_asked(arr, owner, keepalive, stream, max_version, dl_device, copy);
}

/* Flattened: every call in it is inlined, through every file under link-time optimization (the capsule, the release
 * point, the pointer query), callees' calls too. What a common conversion never reaches is kept out of line where
 * it is declared (noinline): the general reader, the runtime's search, ordering by the runtime, the pending
 * releases, the CUDA error; the fresh-dict walk too, which inlined here cost 9 instructions more (registers). So
 * this function is 9 to 11 KB (gcc inlines it into module.c's caller, whose stack frame grows by about 200 bytes,
 * for the calls with keywords too). Callgrind, 3.11, against the two calls it replaced: a fresh dict 1,407 ->
 * 1,322 instructions, a ready one 1,012 -> 932, a NumPy array 770 -> 697. */
__attribute__((flatten)) PyObject *cdl_cai2dlpack_plain(PyObject *obj)
{
    cdl_array arr;
    PyObject *keepalive;
    if (cdl_array_from_any_object(obj, NULL, &arr, &keepalive, 0) < 0)
        return NULL;
    PyObject *capsule = cdl_export_unasked(&arr, obj, keepalive, 0);
    Py_XDECREF(keepalive);
    return capsule;
}
