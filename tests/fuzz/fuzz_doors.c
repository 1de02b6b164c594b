/* libFuzzer target for the C doors a foreign caller has, built by run.sh: the exchange API's allocator with any
 * prototype (the made block is written end to end, so ASan sees one that is too small), view_from_managed_tensor
 * and managed_tensor_to_py_object_no_sync with any tensor (its deleter must run exactly once), the C API's
 * to_managed_tensor and fill_tensor with any stream and storage capacity (storage past the capacity must stay
 * untouched), and dlpack2cai of capsules of any name. Invariants: no crash, no sanitizer report, every refusal a
 * Python exception (or one SetError), every success what was asked. tests/cpu/test_fuzz_corpus.py replays
 * tests/fuzz/corpus_doors the same way through ctypes. */
#include "cdl_internal.h"
#include "fuzz_input.h"

#include <cai_dlpack/cai_dlpack.h>
#include <string.h>

PyMODINIT_FUNC PyInit__core(void);

static const cai_dlpack_api *api;
static const DLPackExchangeAPI *exchange;
static PyObject *holder_type; /* class Holder: its instances hold an __array_interface__ */
static char memory[1 << 12];


/* Extremes first: the values at which sizes and extents wrap. */
static const int64_t extremes[] = {0, 1, 2, 3, -1, -2, INT64_MIN, INT64_MAX, (int64_t)1 << 31, ((int64_t)1 << 32) + 1,
                                   ((int64_t)1 << 61) - 1, (int64_t)1 << 62, ((int64_t)1 << 60) + 1, (int64_t)1 << 33,
                                   ((int64_t)1 << 40) + 7, 288230376151711744 /* 2**58 */};

static int64_t take_int64(cdl_input *in)
{
    uint8_t choice = take_byte(in);
    if (choice < 128)
        return choice % 10;
    if (choice < 240)
        return extremes[choice % (sizeof(extremes) / sizeof(extremes[0]))];
    uint64_t value = 0;
    for (int i = 0; i < 8; i++)
        value = value << 8 | take_byte(in);
    return (int64_t)value;
}

static const int32_t device_types[] = {kDLCPU, kDLCUDA, kDLCUDAHost, kDLCUDAManaged, 0, 4, 7, 10, 99, INT32_MAX, -1};
static const int64_t streams[] = {-1, 1, 2, 0x5000, 0, -2, -5, INT64_MIN, INT64_MAX};

static int64_t take_stream(cdl_input *in) { return streams[take_byte(in) % (sizeof(streams) / sizeof(streams[0]))]; }

/* A dtype: code, bits and lanes from their interesting values. */
static DLDataType take_dtype(cdl_input *in)
{
    static const uint8_t bits[] = {8, 16, 32, 64, 1, 4, 6, 0, 128, 255};
    static const uint16_t lanes[] = {1, 1, 1, 2, 4, 0, 65535};
    DLDataType dtype;
    dtype.code = take_byte(in) % 22;
    dtype.bits = bits[take_byte(in) % sizeof(bits)];
    dtype.lanes = lanes[take_byte(in) % (sizeof(lanes) / sizeof(lanes[0]))];
    return dtype;
}

static int set_error_calls;
static char set_error_kind[32];

static void set_error(void *context, const char *kind, const char *message)
{
    if (context != (void *)&set_error_calls || kind == NULL || message == NULL ||
        strncmp(message, "cai_dlpack allocator: ", 22) != 0)
        __builtin_trap();
    set_error_calls++;
    strncpy(set_error_kind, kind, sizeof(set_error_kind) - 1);
}

/* An exception must be set exactly when a door failed; it is then cleared. */
static void expect_error(int failed)
{
    if (failed != (PyErr_Occurred() != NULL))
        __builtin_trap();
    PyErr_Clear();
}

static void fuzz_allocator(cdl_input *in)
{
    DLTensor prototype;
    int64_t shape[70];
    memset(&prototype, 0, sizeof(prototype));
    prototype.dtype = take_dtype(in);
    prototype.device.device_type = (DLDeviceType)device_types[take_byte(in) % (sizeof(device_types) / sizeof(int32_t))];
    prototype.device.device_id = take_byte(in) % 6 - 1;
    uint8_t ndim_choice = take_byte(in);
    prototype.ndim = ndim_choice < 250 ? ndim_choice % 6 : (ndim_choice == 250 ? -1 : ndim_choice == 251 ? 65 : 64);
    for (int i = 0; i < 70; i++)
        shape[i] = i < prototype.ndim ? take_int64(in) : 0;
    prototype.shape = (take_byte(in) % 16 == 0) ? NULL : shape;
    DLManagedTensorVersioned *out = NULL;
    set_error_calls = 0;
    int status = exchange->managed_tensor_allocator(&prototype, &out, &set_error_calls, set_error);
    if (PyErr_Occurred())
        __builtin_trap(); /* the allocator runs no Python and leaves none pending */
    /* What the prototype needs: its bytes (0 when it has no elements) and whether its strides fit in int64. */
    uint64_t bytes = ((uint64_t)prototype.dtype.bits * prototype.dtype.lanes + 7) / 8, count = 1;
    int valid = prototype.ndim >= 0 && prototype.ndim <= 64 && (prototype.ndim == 0 || prototype.shape != NULL) &&
                bytes > 0;
    int count_overflow = 0, strides_overflow = 0, empty = 0;
    int64_t stride = 1;
    for (int i = valid ? prototype.ndim - 1 : -1; i >= 0; i--) {
        valid &= shape[i] >= 0;
        empty |= shape[i] == 0;
        count_overflow |= __builtin_mul_overflow(count, (uint64_t)shape[i], &count);
        strides_overflow |= i > 0 && __builtin_mul_overflow(stride, shape[i] > 1 ? shape[i] : 1, &stride);
    }
    empty &= valid;
    count_overflow |= __builtin_mul_overflow(bytes, count, &bytes);
    if (status != 0) {
        if (set_error_calls != 1)
            __builtin_trap();
        /* A host tensor that could exist but whose bytes cannot be had is a MemoryError. */
        if (valid && !strides_overflow && !empty && !count_overflow && prototype.device.device_type == kDLCPU &&
            strcmp(set_error_kind, "MemoryError") != 0)
            __builtin_trap();
        /* An empty tensor whose strides fit has no bytes to allocate: always made (on the host here). */
        if (empty && !strides_overflow && prototype.device.device_type == kDLCPU)
            __builtin_trap();
        return;
    }
    if (!valid || strides_overflow || (count_overflow && !empty))
        __builtin_trap(); /* no tensor has this prototype */
    if (set_error_calls != 0 || out == NULL || out->dl_tensor.ndim != prototype.ndim || out->dl_tensor.data == NULL ||
        memcmp(&out->dl_tensor.dtype, &prototype.dtype, sizeof(DLDataType)) != 0)
        __builtin_trap();
    /* The block holds every byte the shape needs: written end to end (bounded, so a real tensor stays cheap). */
    for (int i = 0; i < prototype.ndim; i++) {
        if (out->dl_tensor.shape[i] != shape[i])
            __builtin_trap();
    }
    if (out->dl_tensor.device.device_type == kDLCPU) {
        if (bytes <= ((uint64_t)1 << 26))
            memset(out->dl_tensor.data, 0xa5, bytes);
        else if (bytes > 0)
            ((volatile char *)out->dl_tensor.data)[bytes - 1] = 1;
    }
    /* Handed back as an object: a view, or a refusal that ran the deleter. */
    void *view = NULL;
    status = exchange->managed_tensor_to_py_object_no_sync(out, &view);
    expect_error(status != 0);
    if (status == 0) {
        PyObject *shape_object = PyObject_GetAttrString(view, "shape");
        expect_error(shape_object == NULL);
        Py_XDECREF(shape_object);
        Py_DECREF((PyObject *)view);
    }
}

/* A foreign tensor, its deleter counting. */
typedef struct {
    DLManagedTensorVersioned managed;
    int64_t shape[70], strides[70];
    int deleted;
} fuzz_tensor;

static void count_deletion(DLManagedTensorVersioned *self) { ((fuzz_tensor *)self->manager_ctx)->deleted++; }

static void fuzz_tensor_to_view(cdl_input *in)
{
    static fuzz_tensor tensor;
    memset(&tensor, 0, sizeof(tensor));
    DLManagedTensorVersioned *m = &tensor.managed;
    m->version.major = take_byte(in) % 3;
    m->version.minor = take_byte(in) % 4;
    m->manager_ctx = &tensor;
    m->deleter = count_deletion;
    m->flags = take_byte(in) % 4;
    DLTensor *t = &m->dl_tensor;
    t->data = memory + take_byte(in);
    t->device.device_type = (DLDeviceType)device_types[take_byte(in) % (sizeof(device_types) / sizeof(int32_t))];
    t->device.device_id = take_byte(in) % 3;
    uint8_t ndim_choice = take_byte(in);
    t->ndim = ndim_choice < 250 ? ndim_choice % 6 : (ndim_choice == 250 ? -1 : ndim_choice == 251 ? 65 : 64);
    t->dtype = take_dtype(in);
    for (int i = 0; i < 70; i++) {
        tensor.shape[i] = i < t->ndim ? take_int64(in) : 0;
        tensor.strides[i] = i < t->ndim ? take_int64(in) : 0;
    }
    uint8_t layout = take_byte(in);
    t->shape = layout % 16 == 0 ? NULL : tensor.shape;
    t->strides = layout & 16 ? NULL : tensor.strides;
    t->byte_offset = take_byte(in);
    PyObject *view;
    if (take_byte(in) & 1) {
        view = api->view_from_managed_tensor(m, take_stream(in));
    }
    else {
        void *object = NULL;
        view = exchange->managed_tensor_to_py_object_no_sync(m, &object) == 0 ? object : NULL;
        if ((view == NULL) != (object == NULL))
            __builtin_trap();
    }
    expect_error(view == NULL);
    if (view == NULL) {
        if (tensor.deleted != 1)
            __builtin_trap(); /* a door that steals a tensor and fails has let it go */
        return;
    }
    if (tensor.deleted != 0)
        __builtin_trap();
    PyObject *iface = PyObject_GetAttrString(view, "__array_interface__");
    if (iface == NULL) {
        PyErr_Clear();
        iface = PyObject_GetAttrString(view, "__cuda_array_interface__");
    }
    Py_XDECREF(iface);
    PyErr_Clear();
    Py_DECREF(view);
    if (tensor.deleted != 1)
        __builtin_trap();
}

/* A Holder of an array interface over memory: shape and strides from the input, as tuples or lists. */
static PyObject *take_holder(cdl_input *in)
{
    static const char *const typestrs[] = {"<f4", "|u1", "<i8", "<c16", "<V2", "|b1", ">f4", "<f16"};
    uint8_t flags = take_byte(in);
    int ndim = flags & 64 ? take_byte(in) % 70 : take_byte(in) % 5;
    PyObject *shape = flags & 1 ? PyList_New(ndim) : PyTuple_New(ndim);
    PyObject *strides = flags & 2 ? (flags & 1 ? PyList_New(ndim) : PyTuple_New(ndim)) : Py_NewRef(Py_None);
    for (int i = 0; shape && strides && i < ndim; i++) {
        PyObject *extent = PyLong_FromLongLong(take_int64(in));
        PyObject *stride = strides != Py_None ? PyLong_FromLongLong((int64_t)((uint64_t)take_int64(in) * 4)) : NULL;
        if (flags & 1) {
            PyList_SET_ITEM(shape, i, extent);
            if (stride)
                PyList_SET_ITEM(strides, i, stride);
        }
        else {
            PyTuple_SET_ITEM(shape, i, extent);
            if (stride)
                PyTuple_SET_ITEM(strides, i, stride);
        }
    }
    const char *typestr = typestrs[take_byte(in) % 8]; /* read in this order (the replay's) */
    char *data = memory + take_byte(in);
    PyObject *iface = Py_BuildValue("{s:N, s:N, s:s, s:(Nb), s:i}", "shape", shape, "strides", strides, "typestr",
                                    typestr, "data", PyLong_FromVoidPtr(data), (flags & 4) != 0, "version", 3);
    PyObject *holder = iface ? PyObject_CallOneArg(holder_type, iface) : NULL;
    Py_XDECREF(iface);
    if (holder == NULL)
        __builtin_trap();
    return holder;
}

static void fuzz_c_api(cdl_input *in)
{
    PyObject *holder = take_holder(in);
    int64_t stream = take_stream(in);
    if (take_byte(in) & 1) {
        DLManagedTensorVersioned *out = NULL;
        int status = api->to_managed_tensor(holder, stream, &out);
        expect_error(status != 0);
        if ((status == 0) != (out != NULL))
            __builtin_trap();
        if (out != NULL)
            out->deleter(out);
    }
    else {
        int capacity = take_byte(in) % 70 - 2;
        int64_t shape[72], strides[72];
        memset(shape, 0x5a, sizeof(shape));
        memset(strides, 0x5a, sizeof(strides));
        DLTensor tensor;
        int read_only = -1;
        int status = api->fill_tensor(holder, stream, &tensor, shape, strides, capacity, &read_only);
        expect_error(status != 0);
        if (status == 0 && (tensor.ndim > capacity || (read_only != 0 && read_only != 1) ||
                            tensor.shape != shape || tensor.strides != strides))
            __builtin_trap();
        for (int i = capacity < 0 ? 0 : capacity; i < 72; i++) {
            if (shape[i] != 0x5a5a5a5a5a5a5a5a || strides[i] != 0x5a5a5a5a5a5a5a5a)
                __builtin_trap(); /* written past the caller's capacity */
        }
    }
    Py_DECREF(holder);
}

static void fuzz_capsule(cdl_input *in)
{
    static const char *const names[] = {"dltensor", "dltensor_versioned", "used_dltensor", "used_dltensor_versioned",
                                        NULL, "", "dltensor_", "DLTENSOR"};
    static fuzz_tensor tensor;
    memset(&tensor, 0, sizeof(tensor));
    DLManagedTensorVersioned *m = &tensor.managed;
    m->version.major = 1;
    m->manager_ctx = &tensor;
    m->deleter = count_deletion;
    m->dl_tensor.data = memory;
    m->dl_tensor.device.device_type = kDLCPU;
    m->dl_tensor.ndim = 1;
    m->dl_tensor.dtype.code = kDLFloat;
    m->dl_tensor.dtype.bits = 32;
    m->dl_tensor.dtype.lanes = 1;
    tensor.shape[0] = 4;
    m->dl_tensor.shape = tensor.shape;
    const char *name = names[take_byte(in) % 8];
    if (name != NULL && strcmp(name, "dltensor") == 0)
        name = "dltensor_versioned"; /* the tensor here is versioned; a legacy one is the same path */
    PyObject *capsule = PyCapsule_New(m, name, NULL);
    for (int round = 0; capsule && round < 2; round++) {
        PyObject *view = cdl_view_from_object(capsule, NULL, 0);
        expect_error(view == NULL);
        if (view != NULL && (name == NULL || strcmp(name, "dltensor_versioned") != 0 || round != 0))
            __builtin_trap(); /* only an unused tensor capsule is taken, once */
        Py_XDECREF(view);
    }
    Py_XDECREF(capsule);
    if (tensor.deleted != (name != NULL && strcmp(name, "dltensor_versioned") == 0))
        __builtin_trap();
}

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    Py_InitializeEx(0);
    PyObject *module = PyInit__core();
    PyObject *capsule = module ? PyObject_GetAttrString(module, "_C_API") : NULL;
    api = capsule ? PyCapsule_GetPointer(capsule, CAI_DLPACK_API_CAPSULE) : NULL;
    PyObject *shim = module ? PyObject_GetAttrString(module, "DLPackShim") : NULL;
    PyObject *table = shim ? PyObject_GetAttrString(shim, "__dlpack_c_exchange_api__") : NULL;
    exchange = table ? PyCapsule_GetPointer(table, "dlpack_exchange_api") : NULL;
    PyObject *globals = PyDict_New();
    PyObject *ran = globals ? PyRun_String("class Holder:\n    def __init__(self, iface):\n"
                                           "        self.__array_interface__ = iface\n",
                                           Py_file_input, globals, globals)
                            : NULL;
    holder_type = ran ? Py_XNewRef(PyDict_GetItemString(globals, "Holder")) : NULL;
    Py_XDECREF(ran);
    Py_XDECREF(globals);
    Py_XDECREF(capsule);
    Py_XDECREF(table);
    Py_XDECREF(shim);
    if (api == NULL || exchange == NULL || holder_type == NULL) {
        PyErr_Print();
        __builtin_trap();
    }
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    cdl_input in = {data, size};
    switch (take_byte(&in) % 4) {
    case 0:
        fuzz_allocator(&in);
        break;
    case 1:
        fuzz_tensor_to_view(&in);
        break;
    case 2:
        fuzz_c_api(&in);
        break;
    default:
        fuzz_capsule(&in);
        break;
    }
    if (PyErr_Occurred())
        __builtin_trap();
    return 0;
}
