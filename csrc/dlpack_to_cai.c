/* DLPack -> CAI: consumes a DLPack capsule (or calls __dlpack__) into a DLPackView, which owns the
 * managed tensor and exposes the record managed_tensor.c read from it as __cuda_array_interface__ /
 * __array_interface__ / the buffer protocol / __dlpack__. */
#include "cdl_internal.h"

#include <string.h>

typedef struct {
    PyObject_VAR_HEAD       /* ob_size: 2 * ndim, the length of dims */
    cdl_managed managed;    /* its deleter runs once, in dealloc */
    DLDevice device;
    int read_only;
    int64_t stream;         /* the stream the producer made the data ready on; 0: none (no sync asked) */
    cdl_view_stream made_for; /* that stream as it was when the view was made: what host reads wait for */
    int host_ready;         /* the host has waited for made_for once (pinned, managed memory): atomic */
    cdl_release_point release_at; /* the producer's tensor is deleted after the work queued there by then */
    PyObject *shape;        /* tuple */
    PyObject *strides;      /* tuple of byte strides, or None for C-contiguous (always for empty arrays) */
    PyObject *typestr;
    int named;              /* a type no typestr names: each interface dict gets a descr list of its own */
    PyObject *data;         /* (pointer, read_only) with byte_offset folded in; 0 when empty */
    PyObject *weakreflist;
    Py_ssize_t dims[];      /* shape, then byte strides: the buffer protocol's view of the record */
} cdl_view;

/* Kwnames and arguments for calling a producer's __dlpack__, made once. */
static PyObject *cdl_dlpack_kwnames_full;     /* ("stream", "max_version") */
static PyObject *cdl_dlpack_kwnames_stream;   /* ("stream",) */
static PyObject *cdl_our_max_version;         /* (DLPACK_MAJOR_VERSION, DLPACK_MINOR_VERSION) */
static PyObject *cdl_interface_version;       /* 3, the interface version views export */

/* Fills the view's Python values and buffer dims from the record, computing each byte stride once.
 * Returns 0 or -1. */
static int cdl_view_describe(cdl_view *view, const cdl_array *arr, int strides_given)
{
    int64_t itemsize = cdl_itemsize(arr->dtype);
    int empty = 0;
    view->typestr = cdl_typestr_from_dtype(arr->dtype);
    view->named = cdl_dtype_is_named(arr->dtype);
    view->shape = PyTuple_New(arr->ndim);
    if (view->typestr == NULL || view->shape == NULL)
        return -1;
    Py_ssize_t *byte_strides = view->dims + arr->ndim;
    for (int32_t i = 0; i < arr->ndim; i++) {
        view->dims[i] = (Py_ssize_t)arr->shape[i];
        /* The reader checked each given stride in bytes; implicit ones of an empty array may wrap. */
        (void)__builtin_mul_overflow(arr->strides[i], itemsize, &byte_strides[i]);
        empty |= arr->shape[i] == 0;
        PyObject *dim = PyLong_FromSsize_t(view->dims[i]);
        if (dim == NULL)
            return -1;
        PyTuple_SET_ITEM(view->shape, i, dim);
    }
    /* An empty array has no element to stride to: describe it as C-contiguous. Consumers that size the
     * memory from the strides (CuPy takes the largest shape * stride) would otherwise look up the null
     * pointer the interface asks for here and fail. */
    if (strides_given && !empty) {
        view->strides = PyTuple_New(arr->ndim);
        if (view->strides == NULL)
            return -1;
        for (int32_t i = 0; i < arr->ndim; i++) {
            PyObject *stride = PyLong_FromSsize_t(byte_strides[i]);
            if (stride == NULL)
                return -1;
            PyTuple_SET_ITEM(view->strides, i, stride);
        }
    }
    else {
        view->strides = Py_NewRef(Py_None);
    }
    void *address = empty ? NULL : arr->data;
    view->data = Py_BuildValue("(NO)", PyLong_FromVoidPtr(address), view->read_only ? Py_True : Py_False);
    return view->data ? 0 : -1;
}

/* A view owning managed, described by arr (what cdl_array_from_managed read from it). Takes ownership of
 * managed: on failure its deleter has run. */
static PyObject *cdl_view_from_record(cdl_managed managed, const cdl_array *arr, int64_t stream)
{
    cdl_view *view = PyObject_NewVar(cdl_view, &cdl_view_type, 2 * (Py_ssize_t)arr->ndim);
    if (view == NULL) {
        cdl_managed_delete(&managed);
        return NULL;
    }
    view->managed = managed;
    view->device = arr->device;
    view->read_only = arr->read_only;
    view->stream = stream == CDL_STREAM_NO_SYNC ? 0 : stream;
    view->host_ready = 0;
    view->made_for.event = NULL;
    cdl_release_point_for_drop(&view->release_at, stream, arr);
    view->shape = view->strides = view->typestr = view->data = NULL;
    view->weakreflist = NULL;
    if (cdl_view_stream_set(&view->made_for, view->stream, arr) < 0 ||
        cdl_view_describe(view, arr, cdl_managed_tensor(managed)->strides != NULL) < 0) {
        Py_DECREF(view); /* dealloc runs the deleter */
        return NULL;
    }
    return (PyObject *)view;
}

PyObject *cdl_view_new(cdl_managed managed, int64_t stream)
{
    cdl_array arr;
    if (cdl_array_from_managed(managed, &arr) < 0) {
        cdl_managed_delete(&managed);
        return NULL;
    }
    return cdl_view_from_record(managed, &arr, stream);
}

/* ---- producers' DLPack C exchange API ------------------------------------------------------------- */

const DLPackExchangeAPI *cdl_producer_exchange_api(PyObject *obj)
{
    if (PyObject_TypeCheck(obj, &cdl_view_type) || PyObject_TypeCheck(obj, &cdl_shim_type))
        return NULL; /* ours: their __dlpack__ orders the consumer's stream directly */
    PyTypeObject *type = Py_TYPE(obj);
    const DLPackExchangeAPIHeader *header = NULL;
    /* Held while read: the table it points at is the producer module's, the capsule only the type's. */
    PyObject *published = cdl_type_lookup(type, cdl_name.exchange_api);
    if (published != NULL) {
        if (PyCapsule_IsValid(published, "dlpack_exchange_api"))
            header = PyCapsule_GetPointer(published, "dlpack_exchange_api");
    }
    else if ((published = cdl_type_lookup(type, cdl_name.exchange_api_address)) != NULL && PyLong_CheckExact(published)) {
        header = PyLong_AsVoidPtr(published);
        if (header == NULL)
            PyErr_Clear(); /* not an address: the table is unusable, __dlpack__ is asked */
    }
    Py_XDECREF(published);
    /* A table of a newer major version may chain to an older one this build reads. */
    while (header != NULL && header->version.major != DLPACK_MAJOR_VERSION)
        header = header->prev_api;
    const DLPackExchangeAPI *api = (const DLPackExchangeAPI *)header;
    if (api == NULL || api->managed_tensor_from_py_object_no_sync == NULL || api->current_work_stream == NULL)
        return NULL;
    return api;
}

/* The truth of obj.<name> (a method is called), 0 when obj's type has no such attribute, or -1. */
static int cdl_flag_of(PyObject *obj, PyObject *name)
{
    PyObject *attribute = cdl_type_lookup(Py_TYPE(obj), name);
    if (attribute == NULL)
        return 0;
    const int callable = PyCallable_Check(attribute);
    Py_DECREF(attribute);
    PyObject *value = callable ? PyObject_CallMethodNoArgs(obj, name) : PyObject_GetAttr(obj, name);
    if (value == NULL)
        return -1;
    int truth = PyObject_IsTrue(value);
    Py_DECREF(value);
    return truth;
}

int cdl_exchange_usable(PyObject *obj, DLDataType dtype)
{
    int flag = cdl_flag_of(obj, cdl_name.is_neg);
    if (flag > 0)
        PyErr_Format(cdl_UnsupportedError,
                     "the %.200s has its negative bit set (a lazy negation): its memory holds the negation of its "
                     "values, which DLPack would hand on as they are; call .resolve_neg() first",
                     Py_TYPE(obj)->tp_name);
    if (flag != 0)
        return -1;
    /* Only a complex tensor can be a lazy conjugate: one call fewer for every other. */
    if ((flag = cdl_flag_of(obj, cdl_name.requires_grad)) == 0 && dtype.code == kDLComplex)
        flag = cdl_flag_of(obj, cdl_name.is_conj);
    return flag < 0 ? -1 : !flag;
}

/* A table call that returned failure: its exception, or one saying the producer set none. Returns -1. */
static int cdl_exchange_call_failed(PyObject *obj, const char *call)
{
    if (!PyErr_Occurred())
        PyErr_Format(PyExc_RuntimeError, "%.200s's DLPack exchange API %s failed without setting an exception",
                     Py_TYPE(obj)->tp_name, call);
    return -1;
}

int cdl_order_exchange_producer(const DLPackExchangeAPI *api, PyObject *obj, cdl_array *arr, int64_t consumer)
{
    if (consumer == CDL_STREAM_NO_SYNC || !cdl_device_accessible(arr->device.device_type))
        return 0;
    void *stream = NULL;
    if (api->current_work_stream(arr->device.device_type, arr->device.device_id, &stream) != 0)
        return cdl_exchange_call_failed(obj, "current_work_stream");
    /* NULL is the default stream, which a DLPack producer means as the legacy one (the array API's 1). */
    arr->stream = stream == NULL ? CDL_STREAM_LEGACY : (int64_t)(uintptr_t)stream;
    return cdl_order_streams(arr, consumer);
}

int cdl_view_from_exchange_api(PyObject *obj, int64_t consumer, PyObject **view)
{
    *view = NULL;
    const DLPackExchangeAPI *api = cdl_producer_exchange_api(obj);
    if (api == NULL)
        return 0;
    DLManagedTensorVersioned *tensor = NULL;
    if (api->managed_tensor_from_py_object_no_sync(obj, &tensor) != 0 || tensor == NULL) {
        /* torch raises RuntimeError with a C++ backtrace where its __dlpack__ raises a clean BufferError. */
        PyErr_Clear();
        return 0;
    }
    cdl_managed managed = cdl_managed_versioned(tensor);
    int usable = cdl_exchange_usable(obj, tensor->dl_tensor.dtype);
    if (usable <= 0) {
        cdl_managed_delete(&managed);
        return usable;
    }
    cdl_array arr;
    if (cdl_array_from_managed(managed, &arr) < 0 || cdl_order_exchange_producer(api, obj, &arr, consumer) < 0) {
        cdl_managed_delete(&managed);
        return -1;
    }
    *view = cdl_view_from_record(managed, &arr, consumer);
    return *view ? 1 : -1;
}

/* Calls obj.__dlpack__(stream=..., max_version=ours), then without max_version if that raises
 * TypeError (a producer older than DLPack 1.0). Returns a new capsule reference or NULL. */
static PyObject *cdl_call_dlpack(PyObject *obj, PyObject *stream)
{
    PyObject *method;
    int found = cdl_lookup_attribute(obj, cdl_name.dlpack, &method);
    if (found < 0)
        return NULL;
    if (found == 0) {
        PyErr_Format(PyExc_TypeError, "expected a DLPack capsule or an object with __dlpack__, not %.200s",
                     Py_TYPE(obj)->tp_name);
        return NULL;
    }
    PyObject *args[2] = {stream ? stream : Py_None, cdl_our_max_version};
    PyObject *capsule = PyObject_Vectorcall(method, args, 0, cdl_dlpack_kwnames_full);
    if (capsule == NULL && PyErr_ExceptionMatches(PyExc_TypeError)) {
        PyErr_Clear();
        capsule = PyObject_Vectorcall(method, args, 0, cdl_dlpack_kwnames_stream);
    }
    Py_DECREF(method);
    if (capsule != NULL && !PyCapsule_CheckExact(capsule)) {
        PyErr_Format(PyExc_TypeError, "%.200s.__dlpack__ returned %.200s, not a PyCapsule", Py_TYPE(obj)->tp_name,
                     Py_TYPE(capsule)->tp_name);
        Py_CLEAR(capsule);
    }
    return capsule;
}

/* Asking a producer for the legacy stream while a blocking stream of its device captures a graph makes it
 * order its work against that stream, which invalidates the capture: refused before it is asked. The
 * producer's device is asked first: host data costs no CUDA call (a capture query on a thread without a
 * context would make the current device's primary context), and no call at all is made before a runtime
 * is loaded (nobody in this process captures through one). 0, or -1 with CudaError (or the device call's). */
static int cdl_refuse_legacy_stream_for(PyObject *obj)
{
    if (cdl_cudart_loaded() == NULL)
        return 0;
    PyObject *device = PyObject_CallMethodNoArgs(obj, cdl_name.dlpack_device);
    if (device == NULL) {
        if (PyErr_ExceptionMatches(PyExc_AttributeError)) {
            PyErr_Clear(); /* no device to ask about: __dlpack__ decides */
            return 0;
        }
        if (!PyErr_ExceptionMatches(PyExc_Exception) || PyErr_ExceptionMatches(PyExc_MemoryError))
            return -1;
        /* A device the producer cannot name (torch's meta tensors): __dlpack__ decides, in the producer's own
         * words, unless the caller's legacy stream is unusable now: then the producer's error is raised, and
         * nothing is asked of it that could break the capture. */
        cdl_pending_error unnamed;
        cdl_error_stash(&unnamed);
        int unusable = cdl_legacy_stream_unusable();
        if (unusable > 0) {
            cdl_error_unstash(&unnamed);
            return -1;
        }
        cdl_error_discard(&unnamed);
        return unusable;
    }
    int type = -1, id = 0;
    if (!PyTuple_Check(device) || !PyArg_ParseTuple(device, "ii", &type, &id))
        PyErr_Clear(); /* __dlpack__'s reader names a malformed device */
    Py_DECREF(device);
    if (type < 0 || !cdl_device_accessible((DLDeviceType)type))
        return 0;
    return cdl_check_legacy_stream((DLDeviceType)type, id, "dlpack2cai's stream (None) is");
}

PyObject *cdl_view_from_object(PyObject *obj, PyObject *stream, int exchange)
{
    int64_t consumer;
    if (cdl_parse_stream(stream, "stream", 1, &consumer) < 0)
        return NULL;
    cdl_release_completed();
    PyObject *view;
    if (exchange && !PyCapsule_CheckExact(obj) && cdl_view_from_exchange_api(obj, consumer, &view) != 0)
        return view;
    if (consumer == CDL_STREAM_LEGACY && !PyCapsule_CheckExact(obj) && cdl_refuse_legacy_stream_for(obj) < 0)
        return NULL;
    /* A producer is asked with the array API's int, also for a stream object the caller gave. */
    PyObject *as_int = stream == NULL || stream == Py_None || PyLong_Check(stream) ? Py_XNewRef(stream)
                                                                                  : PyLong_FromLongLong(consumer);
    if (as_int == NULL && stream != NULL && stream != Py_None)
        return NULL;
    PyObject *capsule = PyCapsule_CheckExact(obj) ? Py_NewRef(obj) : cdl_call_dlpack(obj, as_int);
    Py_XDECREF(as_int);
    if (capsule == NULL)
        return NULL;
    cdl_managed managed;
    int status = cdl_managed_from_capsule(capsule, &managed);
    Py_DECREF(capsule);
    return status < 0 ? NULL : cdl_view_new(managed, consumer);
}

/* ---- the view type ------------------------------------------------------------------------------- */

static void cdl_view_dealloc(cdl_view *self)
{
    if (self->weakreflist != NULL)
        PyObject_ClearWeakRefs((PyObject *)self);
    Py_XDECREF(self->shape);
    Py_XDECREF(self->strides);
    Py_XDECREF(self->typestr);
    Py_XDECREF(self->data);
    cdl_view_stream_clear(&self->made_for);
    cdl_managed_delete_after(&self->managed, &self->release_at);
    PyObject_Free(self);
}

/* A new interface dict each access (consumers may keep or change it); the values are the view's cached
 * objects and the keys interned strings, so building it allocates only the dict. */
static PyObject *cdl_view_interface(cdl_view *self, int with_stream)
{
    PyObject *stream = NULL;
    if (with_stream) {
        /* A capturing stream exports None: CAI consumers synchronize the stream they are given, which a
         * capture forbids. */
        int64_t exported = 0;
        if (self->stream != 0 && cdl_option_export_stream &&
            cdl_stream_to_export(self->stream, self->device, &exported) < 0)
            return NULL;
        stream = exported ? PyLong_FromLongLong(exported) : Py_NewRef(Py_None);
        if (stream == NULL)
            return NULL;
    }
    PyObject *descr = self->named ? cdl_descr_new(cdl_managed_tensor(self->managed)->dtype) : NULL;
    PyObject *iface = self->named && descr == NULL ? NULL : PyDict_New();
    if (iface == NULL || PyDict_SetItem(iface, cdl_name.shape, self->shape) < 0 ||
        PyDict_SetItem(iface, cdl_name.typestr, self->typestr) < 0 ||
        PyDict_SetItem(iface, cdl_name.data, self->data) < 0 ||
        PyDict_SetItem(iface, cdl_name.strides, self->strides) < 0 ||
        PyDict_SetItem(iface, cdl_name.version, cdl_interface_version) < 0 ||
        (descr != NULL && PyDict_SetItem(iface, cdl_name.descr, descr) < 0) ||
        (stream != NULL && PyDict_SetItem(iface, cdl_name.stream, stream) < 0))
        Py_CLEAR(iface);
    Py_XDECREF(descr);
    Py_XDECREF(stream);
    return iface;
}

static PyObject *cdl_view_get_cai(cdl_view *self, void *closure)
{
    (void)closure;
    if (!cdl_device_accessible(self->device.device_type)) {
        PyErr_SetString(PyExc_AttributeError,
                        "__cuda_array_interface__: this tensor is in host memory (kDLCPU); use "
                        "__array_interface__ or __dlpack__");
        return NULL;
    }
    return cdl_view_interface(self, 1);
}

/* Host readers know no stream: before the first host pointer of pinned or managed memory is handed out, the
 * host waits for the stream the producer made the data ready on (once per view; the data is ready for good). */
static int cdl_view_ready_for_host(cdl_view *self)
{
    if (__atomic_load_n(&self->host_ready, __ATOMIC_ACQUIRE))
        return 0;
    if (cdl_wait_for_host_read(&self->made_for, self->device) < 0)
        return -1;
    __atomic_store_n(&self->host_ready, 1, __ATOMIC_RELEASE);
    return 0;
}

static PyObject *cdl_view_get_array_interface(cdl_view *self, void *closure)
{
    (void)closure;
    if (!cdl_host_accessible(self->device.device_type)) {
        PyErr_SetString(PyExc_AttributeError,
                        "__array_interface__: this tensor is in device memory (kDLCUDA); use "
                        "__cuda_array_interface__ or __dlpack__");
        return NULL;
    }
    if (cdl_view_ready_for_host(self) < 0)
        return NULL;
    return cdl_view_interface(self, 0);
}

/* The buffer protocol for host-accessible tensors (where __array_interface__ is offered too): NumPy,
 * memoryview and every buffer consumer read the tensor without a dict. The export holds the view,
 * and with it the tensor, until it is released. */
static int cdl_view_getbuffer(cdl_view *self, Py_buffer *buffer, int flags)
{
    const DLTensor *t = cdl_managed_tensor(self->managed);
    buffer->obj = NULL;
    if (!cdl_host_accessible(self->device.device_type)) {
        PyErr_Format(PyExc_BufferError,
                     "DLPackView of device memory (DLPack device type %d) has no host buffer; use "
                     "__cuda_array_interface__ or __dlpack__",
                     (int)self->device.device_type);
        return -1;
    }
    if ((flags & PyBUF_FORMAT) == PyBUF_FORMAT && self->named) {
        /* No struct format names bfloat16 or float8 (a pad-byte one maps to no datatype in a consumer such as
         * mpi4py, and to a nameless type in NumPy). Refused, a consumer reads what names the type: NumPy the
         * array interface's descr, mpi4py __dlpack__ (raw bytes, as it sends the producer's own tensor). */
        PyErr_Format(PyExc_BufferError,
                     "DLPackView of %s: no buffer format names this type; read __array_interface__ (its descr names "
                     "it) or __dlpack__, or ask for the buffer without a format (raw bytes)",
                     cdl_name_of_dtype(t->dtype));
        return -1;
    }
    if ((flags & PyBUF_WRITABLE) == PyBUF_WRITABLE && self->read_only) {
        PyErr_SetString(PyExc_BufferError, "DLPackView is read-only (the producer flagged the tensor read-only)");
        return -1;
    }
    int64_t itemsize = cdl_itemsize(t->dtype);
    int ndim = (int)(Py_SIZE(self) / 2);
    int64_t length = itemsize;
    for (int i = 0; i < ndim; i++) {
        if (__builtin_mul_overflow(length, (int64_t)self->dims[i], &length) || length > PY_SSIZE_T_MAX) {
            PyErr_Format(PyExc_BufferError, "DLPackView shape %R has more bytes than a buffer can hold",
                         self->shape);
            return -1;
        }
    }
    if (cdl_view_ready_for_host(self) < 0)
        return -1;
    buffer->buf = (char *)t->data + t->byte_offset;
    buffer->len = (Py_ssize_t)length;
    buffer->readonly = self->read_only;
    buffer->itemsize = (Py_ssize_t)itemsize;
    buffer->format = (flags & PyBUF_FORMAT) == PyBUF_FORMAT ? (char *)cdl_format_from_dtype(t->dtype) : NULL;
    buffer->ndim = ndim;
    buffer->shape = self->dims;
    buffer->strides = ndim > 0 ? self->dims + ndim : NULL;
    buffer->suboffsets = NULL;
    buffer->internal = NULL;
    /* A consumer that takes no strides (or no shape) needs C-contiguous memory; the contiguity
     * requests ask for the layout they name. Checked on the whole description, then trimmed to
     * what was asked. */
    char order = 0;
    if ((flags & PyBUF_C_CONTIGUOUS) == PyBUF_C_CONTIGUOUS || (flags & PyBUF_STRIDES) != PyBUF_STRIDES)
        order = 'C';
    else if ((flags & PyBUF_F_CONTIGUOUS) == PyBUF_F_CONTIGUOUS)
        order = 'F';
    else if ((flags & PyBUF_ANY_CONTIGUOUS) == PyBUF_ANY_CONTIGUOUS)
        order = 'A';
    if (order != 0 && ndim > 0 && !PyBuffer_IsContiguous(buffer, order)) {
        PyErr_Format(PyExc_BufferError, "DLPackView is not %s-contiguous, which the buffer consumer asked for",
                     order == 'C' ? "C" : order == 'F' ? "Fortran" : "C- or Fortran");
        return -1;
    }
    if ((flags & PyBUF_STRIDES) != PyBUF_STRIDES)
        buffer->strides = NULL;
    if ((flags & PyBUF_ND) != PyBUF_ND) {
        buffer->shape = NULL;
        buffer->ndim = 1; /* a plain run of bytes */
    }
    buffer->obj = Py_NewRef(self);
    return 0;
}

static PyBufferProcs cdl_view_as_buffer = {.bf_getbuffer = (getbufferproc)cdl_view_getbuffer};

static PyObject *cdl_view_get_shape(cdl_view *self, void *closure)
{
    (void)closure;
    return Py_NewRef(self->shape);
}

static PyObject *cdl_view_get_strides(cdl_view *self, void *closure)
{
    (void)closure;
    return Py_NewRef(self->strides);
}

static PyObject *cdl_view_get_typestr(cdl_view *self, void *closure)
{
    (void)closure;
    return Py_NewRef(self->typestr);
}

static PyObject *cdl_view_get_device(cdl_view *self, void *closure)
{
    (void)closure;
    return cdl_device_tuple(self->device);
}

static PyObject *cdl_view_get_read_only(cdl_view *self, void *closure)
{
    (void)closure;
    return PyBool_FromLong(self->read_only);
}

const DLTensor *cdl_view_tensor(PyObject *view) { return cdl_managed_tensor(((cdl_view *)view)->managed); }

int cdl_array_from_view(PyObject *view, cdl_array *arr)
{
    const cdl_view *self = (const cdl_view *)view;
    /* Read when the view was made, and the producer's tensor does not change while we own it: the
     * reader cannot fail here. */
    (void)cdl_array_from_managed(self->managed, arr);
    arr->stream = self->stream;
    /* A legacy or per-thread stream of pinned or managed memory was the making caller's device's: ordered
     * there, whatever device is current now (the allocation's, which DLPack's device_id 0 does not give). */
    if (self->stream > 0 && self->stream <= CDL_STREAM_PER_THREAD && self->device.device_type != kDLCUDA)
        arr->home_device = self->made_for.device;
    return cdl_view_stream_join(&self->made_for, &arr->stream);
}

static PyObject *cdl_view_dlpack(cdl_view *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    PyObject *values[4];
    if (cdl_parse_dlpack_keywords(args, nargs, kwnames, values) < 0)
        return NULL;
    /* No stream for pinned or managed memory, handed on where it is: a host consumer (numpy.from_dlpack,
     * torch.from_dlpack of kDLCUDAHost), which reads at once and is owed the host readers' wait. */
    if ((values[0] == NULL || values[0] == Py_None) && (values[2] == NULL || values[2] == Py_None) &&
        (values[3] == NULL || values[3] == Py_None || values[3] == Py_False) &&
        cdl_host_accessible(self->device.device_type) && cdl_view_ready_for_host(self) < 0)
        return NULL;
    cdl_array arr;
    if (cdl_array_from_view((PyObject *)self, &arr) < 0)
        return NULL;
    return cdl_export(&arr, (PyObject *)self, NULL, values[0], values[1], values[2], values[3]);
}

static PyObject *cdl_view_dlpack_device(cdl_view *self, PyObject *unused)
{
    (void)unused;
    return cdl_device_tuple(self->device);
}

static PyObject *cdl_view_repr(cdl_view *self)
{
    return PyUnicode_FromFormat("<cai_dlpack.DLPackView shape=%R typestr=%R device=(%d, %d)%s>", self->shape,
                                self->typestr, (int)self->device.device_type, (int)self->device.device_id, self->read_only ? " read-only" : "");
}

static PyGetSetDef cdl_view_getset[] = {
    {"__cuda_array_interface__", (getter)cdl_view_get_cai, NULL, "CUDA Array Interface v3 dict (device-accessible memory)", NULL},
    {"__array_interface__", (getter)cdl_view_get_array_interface, NULL, "NumPy array interface v3 dict (host-accessible memory)", NULL},
    {"shape", (getter)cdl_view_get_shape, NULL, "shape tuple", NULL},
    {"strides", (getter)cdl_view_get_strides, NULL, "byte strides, or None for C-contiguous", NULL},
    {"typestr", (getter)cdl_view_get_typestr, NULL, "array-interface type string", NULL},
    {"device", (getter)cdl_view_get_device, NULL, "(DLDeviceType, device_id)", NULL},
    {"read_only", (getter)cdl_view_get_read_only, NULL, "whether the producer marked the data read-only", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMethodDef cdl_view_methods[] = {
    {"__dlpack__", (PyCFunction)(void (*)(void))cdl_view_dlpack, METH_FASTCALL | METH_KEYWORDS,
     "__dlpack__($self, /, *, stream=None, max_version=None, dl_device=None, copy=None)\n--\n\n"
     "Hands the tensor on (zero-copy; copy=True or dl_device=(1, 0) copies, as DLPackShim's)."},
    {"__dlpack_device__", (PyCFunction)cdl_view_dlpack_device, METH_NOARGS,
     "__dlpack_device__($self, /)\n--\n\n(DLDeviceType, device_id)"},
    {NULL, NULL, 0, NULL},
};

PyTypeObject cdl_view_type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "cai_dlpack.DLPackView",
    .tp_basicsize = sizeof(cdl_view),
    .tp_itemsize = sizeof(Py_ssize_t),
    .tp_dealloc = (destructor)cdl_view_dealloc,
    .tp_repr = (reprfunc)cdl_view_repr,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A DLPack tensor owned by Python, exposed through the CUDA Array Interface (device memory) "
              "and NumPy's array interface (host memory). Made by dlpack2cai().",
    .tp_weaklistoffset = offsetof(cdl_view, weakreflist),
    .tp_methods = cdl_view_methods,
    .tp_getset = cdl_view_getset,
    .tp_as_buffer = &cdl_view_as_buffer,
};

int cdl_view_type_init(void)
{
    cdl_dlpack_kwnames_full = Py_BuildValue("(ss)", "stream", "max_version");
    cdl_dlpack_kwnames_stream = Py_BuildValue("(s)", "stream");
    cdl_our_max_version = Py_BuildValue("(ii)", DLPACK_MAJOR_VERSION, DLPACK_MINOR_VERSION);
    cdl_interface_version = PyLong_FromLong(3);
    if (cdl_dlpack_kwnames_full == NULL || cdl_dlpack_kwnames_stream == NULL || cdl_our_max_version == NULL ||
        cdl_interface_version == NULL)
        return -1;
    return PyType_Ready(&cdl_view_type);
}
