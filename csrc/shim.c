/* DLPackShim: gives an object with __cuda_array_interface__ (or __array_interface__) the DLPack
 * protocol, reading the wrapped object's interface once per conversion. */
#include "cdl_internal.h"

/* What __dlpack_device__ read, for the next __dlpack__ of the same shim on the same thread. */
struct cdl_shim_reading {
    cdl_array arr;
    PyObject *keepalive;
    unsigned long long thread; /* the serial of the thread that read it (an ident is reused after exit) */
};

/* The shim's pending slot holds a reading, or a mark: a thread's serial, shifted, with the low bit set (no reading
 * is at an odd address), left by a __dlpack_device__ that found no CUDA interface but an array interface, so
 * that the __dlpack__ after it does not ask for the CUDA interface again (a failed attribute lookup, a sixth
 * of such a conversion's own cost). NULL where a serial does not fit (a 32-bit build's four billionth thread). */
static cdl_shim_reading *cdl_host_mark(unsigned long long serial)
{
    if (serial > UINTPTR_MAX >> 1)
        return NULL;
    return (cdl_shim_reading *)(((uintptr_t)serial << 1) | 1);
}

static int cdl_is_host_mark(const cdl_shim_reading *reading) { return ((uintptr_t)reading & 1) != 0; }

static void cdl_reading_free(cdl_shim_reading *reading)
{
    if (reading != NULL && !cdl_is_host_mark(reading)) {
        Py_XDECREF(reading->keepalive);
        PyMem_Free(reading);
    }
}

/* Takes the shim's pending reading (NULL: none), which is then nobody else's. */
static cdl_shim_reading *cdl_shim_take_reading(cdl_shim *shim)
{
    return __atomic_exchange_n(&shim->pending, NULL, __ATOMIC_ACQ_REL);
}

void cdl_shim_drop_reading(cdl_shim *shim) { cdl_reading_free(cdl_shim_take_reading(shim)); }

/* Leaves a reading (or a host mark) for the shim's next __dlpack__, in place of whatever was left before. */
static void cdl_shim_leave_reading(cdl_shim *shim, cdl_shim_reading *reading)
{
    cdl_reading_free(__atomic_exchange_n(&shim->pending, reading, __ATOMIC_ACQ_REL));
}

static PyObject *cdl_host_device; /* (kDLCPU, 0) */

PyObject *cdl_shim_wrapped(cdl_shim *shim)
{
    if (shim->obj == NULL)
        PyErr_SetString(PyExc_BufferError, "this DLPackShim wraps nothing any more: the garbage collector cleared it "
                                           "while breaking a reference cycle, so it has no memory to export");
    return shim->obj;
}

/* A few freed shims (of DLPackShim itself, not a subclass) are kept for the next DLPackShim(obj), which every
 * shim conversion makes and drops: a kept one is handed out again as new (untracked, its fields cleared, its
 * reference made afresh by PyObject_Init) at a third of what its allocation and free cost. Only where the GIL
 * guards the list, and the module is single-phase: every interpreter that has it shares one allocator and one
 * GIL. */
#ifndef Py_GIL_DISABLED
#define CDL_KEPT_SHIMS 4
static cdl_shim *cdl_kept_shims[CDL_KEPT_SHIMS];
static int cdl_kept_shim_count;
#endif

static cdl_shim *cdl_shim_alloc(PyTypeObject *type)
{
#ifndef Py_GIL_DISABLED
    if (type == &cdl_shim_type && cdl_kept_shim_count > 0) {
        cdl_shim *self = cdl_kept_shims[--cdl_kept_shim_count];
        memset((char *)self + sizeof(PyObject), 0, sizeof(cdl_shim) - sizeof(PyObject));
        (void)PyObject_Init((PyObject *)self, type);
        PyObject_GC_Track(self);
        return self;
    }
#endif
    return (cdl_shim *)type->tp_alloc(type, 0);
}

/* The end of a dead shim's memory: kept (above), or freed. */
static void cdl_shim_free(cdl_shim *self)
{
#ifndef Py_GIL_DISABLED
    if (Py_IS_TYPE(self, &cdl_shim_type) && cdl_kept_shim_count < CDL_KEPT_SHIMS) {
        cdl_kept_shims[cdl_kept_shim_count++] = self;
        return;
    }
#endif
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *cdl_shim_make(PyTypeObject *type, PyObject *obj, PyObject *dtype)
{
    if (PyDict_Check(obj)) {
        PyErr_SetString(PyExc_TypeError,
                        "DLPackShim wraps an object that owns its memory, not a bare interface dict; use "
                        "cai2dlpack(d, owner=...) for a dict");
        return NULL;
    }
    DLDataType requested = {0, 0, 0};
    if (dtype != NULL && dtype != Py_None && cdl_dtype_from_request(dtype, &requested) < 0)
        return NULL;
    cdl_shim *self = cdl_shim_alloc(type);
    if (self != NULL) {
        self->obj = Py_NewRef(obj);
        self->dtype = requested;
    }
    return (PyObject *)self;
}

/* Subclasses are made here (tp_vectorcall is not inherited). */
static PyObject *cdl_shim_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    PyObject *obj, *dtype = Py_None;
    static char *keywords[] = {"obj", "dtype", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O|$O:DLPackShim", keywords, &obj, &dtype))
        return NULL;
    return cdl_shim_make(type, obj, dtype);
}

/* DLPackShim(obj) itself, which every shim conversion pays for: no argument tuple, no format string. */
static PyObject *cdl_shim_vectorcall(PyObject *type, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (nargs == 1 && kwnames == NULL)
        return cdl_shim_make((PyTypeObject *)type, args[0], NULL);
    if (nargs > 1) {
        PyErr_Format(PyExc_TypeError, "DLPackShim() takes at most 1 positional argument (%zd given)", nargs);
        return NULL;
    }
    PyObject *names[] = {cdl_name.obj, cdl_name.dtype};
    PyObject *values[2] = {NULL, NULL};
    if (cdl_parse_keywords("DLPackShim", args, nargs, kwnames, nargs, names, values, 2) < 0)
        return NULL;
    if (nargs == 1) {
        if (values[0] != NULL) {
            PyErr_SetString(PyExc_TypeError, "argument for DLPackShim() given by name ('obj') and position (1)");
            return NULL;
        }
        values[0] = args[0];
    }
    if (values[0] == NULL) {
        PyErr_SetString(PyExc_TypeError, "DLPackShim() missing required argument 'obj' (pos 1)");
        return NULL;
    }
    return cdl_shim_make((PyTypeObject *)type, values[0], values[1]);
}

static int cdl_shim_traverse(cdl_shim *self, visitproc visit, void *arg)
{
    Py_VISIT(self->obj);
    return 0;
}

static int cdl_shim_clear(cdl_shim *self)
{
    Py_CLEAR(self->obj);
    return 0;
}

static void cdl_shim_dealloc(cdl_shim *self)
{
    PyObject_GC_UnTrack(self);
    if (self->weakreflist != NULL)
        PyObject_ClearWeakRefs((PyObject *)self);
    cdl_shim_clear(self);
    cdl_shim_drop_reading(self);
    if (self->dims != NULL)
        PyMem_RawFree(self->dims);
    cdl_shim_free(self);
}

static PyObject *cdl_shim_dlpack(cdl_shim *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    PyObject *values[4];
    PyObject *obj = cdl_shim_wrapped(self); /* borrowed: the shim holds it */
    if (obj == NULL)
        return NULL;
    cdl_shim_reading *reading = cdl_shim_take_reading(self);
    int cai_absent = 0;
    if (cdl_is_host_mark(reading)) {
        cai_absent = reading == cdl_host_mark(cdl_thread_serial());
        reading = NULL;
    }
    else if (reading != NULL && reading->thread != cdl_thread_serial()) {
        cdl_reading_free(reading); /* another thread's half conversion: read afresh */
        reading = NULL;
    }
    if (cdl_parse_dlpack_keywords(args, nargs, kwnames, values) < 0) {
        cdl_reading_free(reading);
        return NULL;
    }
    cdl_array fresh;
    const cdl_array *arr = reading ? &reading->arr : &fresh;
    PyObject *keepalive = NULL;
    if (reading != NULL) {
        keepalive = reading->keepalive;
        reading->keepalive = NULL;
    }
    else if ((cai_absent ? cdl_array_from_host_object : cdl_array_from_object)(obj, cdl_shim_dtype(self), &fresh,
                                                                                 &keepalive) < 0) {
        return NULL;
    }
    PyObject *capsule = cdl_export(arr, obj, keepalive, values[0], values[1], values[2], values[3]);
    Py_XDECREF(keepalive);
    cdl_reading_free(reading);
    return capsule;
}

static PyObject *cdl_shim_dlpack_device(cdl_shim *self, PyObject *unused)
{
    (void)unused;
    PyObject *obj = cdl_shim_wrapped(self); /* borrowed: the shim holds it */
    if (obj == NULL)
        return NULL;
    /* A conversion starts: what an earlier __dlpack_device__ left is not what this one says. */
    cdl_shim_drop_reading(self);
    PyObject *iface;
    int found = cdl_lookup_attribute(obj, cdl_name.cuda_array_interface, &iface);
    if (found < 0)
        return NULL;
    if (found == 0) {
        /* Array-interface memory is host memory: nothing needs reading to say so (NumPy would build its
         * dict on each access). The type's attribute is asked first (presence only: the borrowed result is
         * never read), an instance's only when it has none. */
        int host = _PyType_Lookup(Py_TYPE(obj), cdl_name.array_interface) != NULL;
        if (!host) {
            if ((host = cdl_lookup_attribute(obj, cdl_name.array_interface, &iface)) < 0)
                return NULL;
            Py_XDECREF(iface);
        }
        if (host) {
            /* The __dlpack__ after this one on this thread reads the array interface without asking for the
             * CUDA one again: the device said is the memory exported. */
            cdl_shim_leave_reading(self, cdl_host_mark(cdl_thread_serial()));
            return Py_NewRef(cdl_host_device);
        }
        /* Neither (or one just made): the reader decides, and says why in its own words. */
        cdl_array arr;
        PyObject *keepalive;
        if (cdl_array_from_object(obj, cdl_shim_dtype(self), &arr, &keepalive) < 0)
            return NULL;
        Py_XDECREF(keepalive);
        return cdl_device_tuple(arr.device);
    }
    /* A CAI read costs a dict and a runtime query of the pointer: kept for the __dlpack__ that follows. */
    cdl_shim_reading *reading = PyMem_Malloc(sizeof(cdl_shim_reading));
    if (reading == NULL) {
        Py_DECREF(iface);
        return PyErr_NoMemory();
    }
    reading->keepalive = NULL;
    int status = cdl_array_from_interface(iface, CDL_SOURCE_CAI, obj, cdl_shim_dtype(self), &reading->arr,
                                          &reading->keepalive);
    Py_DECREF(iface);
    PyObject *device = status < 0 ? NULL : cdl_device_tuple(reading->arr.device);
    if (device == NULL) {
        cdl_reading_free(reading);
        return NULL;
    }
    reading->thread = cdl_thread_serial();
    cdl_shim_leave_reading(self, reading);
    return device;
}

static PyObject *cdl_shim_repr(cdl_shim *self)
{
    if (self->obj == NULL)
        return PyUnicode_FromString("cai_dlpack.DLPackShim(<cleared>)");
    return PyUnicode_FromFormat("cai_dlpack.DLPackShim(%R)", self->obj);
}

static PyMethodDef cdl_shim_methods[] = {
    {"__dlpack__", (PyCFunction)(void (*)(void))cdl_shim_dlpack, METH_FASTCALL | METH_KEYWORDS,
     "__dlpack__($self, /, *, stream=None, max_version=None, dl_device=None, copy=None)\n--\n\n"
     "A DLPack capsule sharing the wrapped object's memory, described as the __dlpack_device__ call just before\n"
     "it on this thread read it (the first half of a conversion), else as its interface reads now. copy=True,\n"
     "or dl_device=(1, 0) for CUDA memory, gives a C-contiguous copy instead (the README's table)."},
    {"__dlpack_device__", (PyCFunction)cdl_shim_dlpack_device, METH_NOARGS,
     "__dlpack_device__($self, /)\n--\n\n(DLDeviceType, device_id) of the wrapped object's data, without building a capsule."},
    {NULL, NULL, 0, NULL},
};

static PyObject *cdl_shim_get_obj(cdl_shim *self, void *closure)
{
    (void)closure;
    return Py_NewRef(self->obj != NULL ? self->obj : Py_None);
}

static PyGetSetDef cdl_shim_getset[] = {
    {"obj", (getter)cdl_shim_get_obj, NULL,
     "the wrapped object (None once the garbage collector has cleared the shim in a reference cycle)", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

PyTypeObject cdl_shim_type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "cai_dlpack.DLPackShim",
    .tp_basicsize = sizeof(cdl_shim),
    .tp_dealloc = (destructor)cdl_shim_dealloc,
    .tp_repr = (reprfunc)cdl_shim_repr,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_BASETYPE,
    .tp_doc = "DLPackShim(obj, *, dtype=None)\n--\n\nGives any object with __cuda_array_interface__ (or __array_interface__) the "
              "DLPack protocol, so torch.from_dlpack(DLPackShim(obj)) shares its memory.",
    .tp_traverse = (traverseproc)cdl_shim_traverse,
    .tp_clear = (inquiry)cdl_shim_clear,
    .tp_weaklistoffset = offsetof(cdl_shim, weakreflist),
    .tp_methods = cdl_shim_methods,
    .tp_getset = cdl_shim_getset,
    .tp_new = cdl_shim_new,
    .tp_vectorcall = cdl_shim_vectorcall,
};

int cdl_shim_type_init(void)
{
    cdl_host_device = Py_BuildValue("(ii)", (int)kDLCPU, 0);
    if (cdl_host_device == NULL)
        return -1;
    return PyType_Ready(&cdl_shim_type);
}
