/* DLPack managed tensors, legacy (DLManagedTensor) or versioned (DLManagedTensorVersioned): the one
 * place that knows both layouts. Capsule names, the tagged handle's deleter, our one-allocation export
 * (written out as either layout), capsules, and the reader that validates a foreign tensor into the
 * neutral record. */
#include "cdl_internal.h"

#include <string.h>

const char cdl_capsule_name_legacy[] = "dltensor";
const char cdl_capsule_name_versioned[] = "dltensor_versioned";
/* What a consumer renames a capsule to once it owns the tensor. */
static const char cdl_used_name_legacy[] = "used_dltensor";
static const char cdl_used_name_versioned[] = "used_dltensor_versioned";

typedef struct cdl_export_block cdl_export_block;
static void cdl_release_block(cdl_export_block *block);

/* Deletes the tensor: by its deleter, or where own is its block (our own export, its release covered already),
 * by releasing that block. */
static void cdl_managed_delete_as(cdl_managed *managed, cdl_export_block *own)
{
    if (managed->pointer == NULL)
        return;
    /* The deleter may run Python code, which must not see (or clear) an exception already set. */
    const int stash = PyErr_Occurred() != NULL;
    cdl_pending_error pending = {0}; /* (set when stash is; gcc 12 at -O3 cannot tell) */
    if (stash)
        cdl_error_stash(&pending);
    if (own != NULL) {
        cdl_release_block(own);
    }
    else if (managed->versioned) {
        DLManagedTensorVersioned *m = managed->pointer;
        if (m->deleter)
            m->deleter(m);
    }
    else {
        DLManagedTensor *m = managed->pointer;
        if (m->deleter)
            m->deleter(m);
    }
    managed->pointer = NULL;
    if (stash)
        cdl_error_unstash(&pending);
}

void cdl_managed_delete(cdl_managed *managed) { cdl_managed_delete_as(managed, NULL); }

/* ---- our export ---------------------------------------------------------------------------------- */

/* One allocation per export: the managed tensor, the references it holds, then shape and strides. */
struct cdl_export_block {
    union {
        DLManagedTensor legacy;
        DLManagedTensorVersioned versioned;
    } managed;
    PyObject *owner;
    PyObject *keepalive;
    /* The data itself when the export owns it (a copy): released with the block, NULL for shared memory. */
    cdl_data_release release_data;
    void *owned_data;
    DLDevice owned_device;
    /* Where the release is ordered (stream 0: at once); data_stream_ordered: the owned data is freed in the
     * consumer stream's order (cudaFreeAsync), so the block waits for no event. */
    cdl_release_point release_at;
    int data_stream_ordered;
    /* The interpreter whose objects (owner, keepalive) and allocator (the block) these are. */
    PyInterpreterState *interpreter;
    int keepable; /* made with room for CDL_KEPT_NDIM dimensions: may be kept for the next export */
    int64_t dims[];
};

/* A few freed blocks with room for the common dimension counts are kept for the next export, which then costs
 * no allocation. The list is touched exactly where PyMem_Malloc and PyMem_Free are called, which need the GIL (an
 * attached thread on a free-threaded build) themselves; the module is single-phase, so one interpreter's
 * allocator. With the GIL that guards it; free-threaded builds hold a lock for the pop or the push (freeing a
 * block on one thread that another allocated is as PyMem_Free allows). */
#define CDL_KEPT_NDIM 4
#define CDL_KEPT_BLOCKS 8
static cdl_export_block *cdl_kept_blocks[CDL_KEPT_BLOCKS];
static int cdl_kept_count;
#ifdef Py_GIL_DISABLED
static cdl_lock cdl_kept_lock = CDL_LOCK_INITIALIZER;
#endif

/* A block with room for ndim dimensions (uninitialised), or NULL. */
static cdl_export_block *cdl_block_new(size_t ndim)
{
    const int keepable = ndim <= CDL_KEPT_NDIM;
#ifdef Py_GIL_DISABLED
    if (keepable) {
        cdl_lock_acquire(&cdl_kept_lock);
        cdl_export_block *kept = cdl_kept_count > 0 ? cdl_kept_blocks[--cdl_kept_count] : NULL;
        cdl_lock_release(&cdl_kept_lock);
        if (kept != NULL)
            return kept;
    }
#else
    if (keepable && cdl_kept_count > 0)
        return cdl_kept_blocks[--cdl_kept_count];
#endif
    cdl_export_block *block =
        PyMem_Malloc(sizeof(cdl_export_block) + 2 * (keepable ? CDL_KEPT_NDIM : ndim) * sizeof(int64_t));
    if (block != NULL)
        block->keepable = keepable;
    return block;
}

static void cdl_block_dispose(cdl_export_block *block)
{
#ifdef Py_GIL_DISABLED
    if (block->keepable) {
        cdl_lock_acquire(&cdl_kept_lock);
        const int kept = cdl_kept_count < CDL_KEPT_BLOCKS;
        if (kept)
            cdl_kept_blocks[cdl_kept_count++] = block;
        cdl_lock_release(&cdl_kept_lock);
        if (kept)
            return;
    }
#else
    if (block->keepable && cdl_kept_count < CDL_KEPT_BLOCKS) {
        cdl_kept_blocks[cdl_kept_count++] = block;
        return;
    }
#endif
    PyMem_Free(block);
}

/* The stream a block's owned data is freed on: the consumer's where that free is stream-ordered, else 0. */
static int64_t cdl_data_stream(const cdl_export_block *block)
{
    if (!block->data_stream_ordered)
        return 0;
    /* Another thread's per-thread stream cannot be named here; the legacy stream comes after its work. */
    if (block->release_at.stream == CDL_STREAM_PER_THREAD && block->release_at.thread != cdl_thread_serial())
        return CDL_STREAM_LEGACY;
    return block->release_at.stream;
}

/* The block's references and memory, under the GIL (Python's allocator made it: small, and fast). Inlined: an
 * unconsumed capsule's destructor, the common end of a block, then makes no call of its own. */
static inline __attribute__((always_inline)) void cdl_free_block(cdl_export_block *block)
{
    if (block->release_data != NULL)
        block->release_data(block->owned_data, block->owned_device, cdl_data_stream(block));
    PyObject *owner = block->owner, *keepalive = block->keepalive;
    cdl_block_dispose(block);
    /* Last: their deallocators may run Python code that exports again, and takes a kept block. */
    Py_XDECREF(owner);
    Py_XDECREF(keepalive);
}

/* Runs on any thread, with or without the GIL (or with another interpreter's), possibly during interpreter
 * shutdown. The block is freed in its own interpreter: another's allocator would abort on it. */
static void cdl_release_block(cdl_export_block *block)
{
    cdl_interpreter_scope scope;
    if (cdl_interpreter_enter(block->interpreter, &scope)) {
        cdl_free_block(block);
        cdl_interpreter_leave(&scope);
    }
    /* Otherwise the interpreter is gone, going, or cannot be entered from here: its objects and its allocator
     * must not be touched, so the block and its references are left behind with it. Owned data is freed all
     * the same: its release touches no Python state. */
    else if (block->release_data != NULL) {
        block->release_data(block->owned_data, block->owned_device, cdl_data_stream(block));
    }
}

static void cdl_release_block_later(void *block) { cdl_release_block(block); }

/* A consumer's deleter: what the tensor keeps alive is released once the work the consumer queued on its
 * stream so far has run (ordered_release.c); a copy's own memory goes back in that stream's order. */
static void cdl_release_ordered(cdl_export_block *block)
{
    if (block->release_at.stream == 0 || block->data_stream_ordered)
        cdl_release_block(block);
    else
        cdl_release_after(&block->release_at, cdl_release_block_later, block);
}

static void cdl_delete_legacy(DLManagedTensor *self) { cdl_release_ordered(self->manager_ctx); }

static void cdl_delete_versioned(DLManagedTensorVersioned *self) { cdl_release_ordered(self->manager_ctx); }

void cdl_managed_order_release(cdl_managed managed, const cdl_release_point *at, int data_stream_ordered)
{
    cdl_export_block *block = managed.versioned ? ((DLManagedTensorVersioned *)managed.pointer)->manager_ctx
                                                : ((DLManagedTensor *)managed.pointer)->manager_ctx;
    block->release_at = *at;
    block->data_stream_ordered = data_stream_ordered && at->stream != 0;
}

void cdl_capsule_order_release(PyObject *capsule, const cdl_release_point *at, int data_stream_ordered)
{
    const char *name = PyCapsule_GetName(capsule);
    cdl_managed managed = {PyCapsule_GetPointer(capsule, name), name == cdl_capsule_name_versioned};
    cdl_managed_order_release(managed, at, data_stream_ordered);
}

/* A tensor a view held, deleted once its consumer's work has run, in the view's interpreter. */
typedef struct {
    cdl_managed managed; /* the copy of the handle is ours */
    cdl_release_point at;
    PyInterpreterState *interpreter;
} cdl_managed_later;

/* The block of one of our own exports whose release is ordered at the point at, with nothing else to wait for;
 * else NULL. */
static cdl_export_block *cdl_own_block_ordered_at(const cdl_managed *managed, const cdl_release_point *at)
{
    cdl_export_block *block;
    if (managed->versioned) {
        const DLManagedTensorVersioned *m = managed->pointer;
        block = m->deleter == cdl_delete_versioned ? m->manager_ctx : NULL;
    }
    else {
        const DLManagedTensor *m = managed->pointer;
        block = m->deleter == cdl_delete_legacy ? m->manager_ctx : NULL;
    }
    if (block == NULL || block->data_stream_ordered || block->release_at.stream != at->stream ||
        block->release_at.device != at->device || block->release_at.thread != at->thread)
        return NULL;
    return block;
}

static void cdl_managed_delete_now(void *argument)
{
    cdl_managed_later *later = argument;
    cdl_interpreter_scope scope;
    if (cdl_interpreter_enter(later->interpreter, &scope)) {
        /* The view held our own export for its own stream, and this release is made because the event recorded on
         * that stream when the view (the tensor's one holder) was dropped completed: it covers the tensor's
         * release too, no second one. Made for any other reason (a refused record or query), the tensor's own
         * deleter orders it. */
        cdl_managed_delete_as(&later->managed, cdl_release_reached(later)
                                                   ? cdl_own_block_ordered_at(&later->managed, &later->at)
                                                   : NULL);
        cdl_interpreter_leave(&scope);
    }
    /* Else the producer's deleter is not called: it may need the interpreter that is going. */
    free(later);
}

void cdl_managed_delete_after(cdl_managed *managed, const cdl_release_point *at)
{
    cdl_managed_later *later = at->stream != 0 ? malloc(sizeof(cdl_managed_later)) : NULL;
    if (later == NULL) {
        cdl_managed_delete(managed);
        return;
    }
    later->managed = *managed;
    later->at = *at;
    later->interpreter = PyInterpreterState_Get();
    managed->pointer = NULL;
    cdl_release_after(at, cdl_managed_delete_now, later);
}

/* cdl_managed_from_array, inlined into the capsule export: a call there costs as much as the copies it makes. */
static inline __attribute__((always_inline)) cdl_managed cdl_fill_block(const cdl_array *arr, PyObject *owner,
                                                                        PyObject *keepalive, int versioned)
{
    cdl_managed managed = {NULL, versioned};
    size_t ndim = (size_t)arr->ndim;
    cdl_export_block *block = cdl_block_new(ndim);
    if (block == NULL) {
        PyErr_NoMemory();
        return managed;
    }
    DLTensor *tensor;
    if (versioned) {
        DLManagedTensorVersioned *m = &block->managed.versioned;
        m->version.major = DLPACK_MAJOR_VERSION;
        m->version.minor = DLPACK_MINOR_VERSION;
        m->manager_ctx = block;
        m->deleter = cdl_delete_versioned;
        m->flags = arr->read_only ? DLPACK_FLAG_BITMASK_READ_ONLY : 0;
        tensor = &m->dl_tensor;
        managed.pointer = m;
    }
    else {
        DLManagedTensor *m = &block->managed.legacy;
        m->manager_ctx = block;
        m->deleter = cdl_delete_legacy;
        tensor = &m->dl_tensor;
        managed.pointer = m;
    }
    tensor->data = arr->data;
    tensor->device = arr->device;
    tensor->ndim = arr->ndim;
    tensor->dtype = arr->dtype;
    tensor->shape = block->dims;
    tensor->strides = block->dims + ndim;
    tensor->byte_offset = 0;
    /* A loop, not two memcpy calls: a few dimensions are copied in less than the calls cost. */
    for (size_t i = 0; i < ndim; i++) {
        block->dims[i] = arr->shape[i];
        block->dims[ndim + i] = arr->strides[i];
    }
    block->owner = Py_XNewRef(owner);
    block->keepalive = Py_XNewRef(keepalive);
    block->release_data = NULL;
    block->release_at.stream = 0;
    block->data_stream_ordered = 0;
    block->interpreter = PyInterpreterState_Get();
    return managed;
}

cdl_managed cdl_managed_from_array(const cdl_array *arr, PyObject *owner, PyObject *keepalive, int versioned)
{
    return cdl_fill_block(arr, owner, keepalive, versioned);
}

/* ---- capsules ------------------------------------------------------------------------------------ */

/* Frees the tensor of a capsule nobody consumed; a consumer renames the capsule 'used_*'. Capsules
 * die while exceptions are in flight (a consumer that refused the tensor, say): the pending
 * exception must come through untouched. */
static void cdl_capsule_destructor(PyObject *capsule)
{
    /* A consumer renames the capsule with a string of its own, so our own pointers mean "unconsumed". */
    const char *name = PyCapsule_GetName(capsule);
    if (name != cdl_capsule_name_legacy && name != cdl_capsule_name_versioned)
        return;
    cdl_managed managed = {PyCapsule_GetPointer(capsule, name), name == cdl_capsule_name_versioned};
    if (managed.pointer == NULL) {
        PyErr_WriteUnraisable(capsule);
        return;
    }
    /* Our own export, dying under the GIL in a live interpreter: its references go without the checks
     * a deleter on an unknown thread needs (a finalizer that runs keeps a pending exception itself). */
    void *deleter = managed.versioned ? (void *)((DLManagedTensorVersioned *)managed.pointer)->deleter
                                      : (void *)((DLManagedTensor *)managed.pointer)->deleter;
    if (deleter == (void *)cdl_delete_legacy || deleter == (void *)cdl_delete_versioned) {
        cdl_export_block *block = managed.versioned ? ((DLManagedTensorVersioned *)managed.pointer)->manager_ctx
                                                    : ((DLManagedTensor *)managed.pointer)->manager_ctx;
        cdl_free_block(block);
        return;
    }
    cdl_managed_delete(&managed);
}

PyObject *cdl_capsule_from_array(const cdl_array *arr, PyObject *owner, PyObject *keepalive, int versioned,
                                 const cdl_release_point *release_at)
{
    cdl_managed managed = cdl_fill_block(arr, owner, keepalive, versioned);
    if (managed.pointer == NULL)
        return NULL;
    if (release_at != NULL && release_at->stream != 0)
        cdl_managed_order_release(managed, release_at, 0);
    PyObject *capsule = PyCapsule_New(managed.pointer, versioned ? cdl_capsule_name_versioned : cdl_capsule_name_legacy,
                                      cdl_capsule_destructor);
    if (capsule == NULL)
        cdl_managed_delete(&managed);
    return capsule;
}

PyObject *cdl_capsule_owning_data(const cdl_array *arr, cdl_data_release release_data, int versioned)
{
    cdl_managed managed = cdl_managed_from_array(arr, NULL, NULL, versioned);
    if (managed.pointer == NULL) {
        release_data(arr->data, arr->device, 0);
        return NULL;
    }
    cdl_export_block *block = managed.versioned ? ((DLManagedTensorVersioned *)managed.pointer)->manager_ctx
                                                : ((DLManagedTensor *)managed.pointer)->manager_ctx;
    /* Data this block owns was made for the consumer: the array API has a copy say so. Legacy capsules have no
     * flags field and cannot. */
    if (managed.versioned)
        ((DLManagedTensorVersioned *)managed.pointer)->flags |= DLPACK_FLAG_BITMASK_IS_COPIED;
    block->release_data = release_data;
    block->owned_data = arr->data;
    block->owned_device = arr->device;
    PyObject *capsule = PyCapsule_New(managed.pointer, versioned ? cdl_capsule_name_versioned : cdl_capsule_name_legacy,
                                      cdl_capsule_destructor);
    if (capsule == NULL)
        cdl_managed_delete(&managed);
    return capsule;
}

/* cdl_managed_from_capsule inside its critical section. */
static int cdl_take_from_capsule(PyObject *capsule, cdl_managed *out)
{
    const char *name = PyCapsule_GetName(capsule);
    if (name == NULL) {
        /* A nameless capsule is valid and has no error to report: it is simply no DLPack tensor. */
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_TypeError, "a PyCapsule without a name is not a DLPack tensor (expected one "
                            "named 'dltensor' or 'dltensor_versioned')");
        return -1;
    }
    out->versioned = strcmp(name, cdl_capsule_name_versioned) == 0;
    if (!out->versioned && strcmp(name, cdl_capsule_name_legacy) != 0) {
        if (strcmp(name, cdl_used_name_legacy) == 0 || strcmp(name, cdl_used_name_versioned) == 0)
            PyErr_SetString(PyExc_BufferError, "this DLPack capsule was already consumed");
        else
            PyErr_Format(PyExc_TypeError, "a PyCapsule named %s is not a DLPack tensor", name);
        return -1;
    }
    void *pointer = PyCapsule_GetPointer(capsule, name);
    if (pointer == NULL ||
        PyCapsule_SetName(capsule, out->versioned ? cdl_used_name_versioned : cdl_used_name_legacy) < 0)
        return -1;
    out->pointer = pointer;
    return 0;
}

int cdl_managed_from_capsule(PyObject *capsule, cdl_managed *out)
{
    out->pointer = NULL;
    int status;
    /* Checking the name and renaming it is one step: two threads cannot both take the tensor. */
    CDL_BEGIN_CRITICAL_SECTION(capsule);
    status = cdl_take_from_capsule(capsule, out);
    CDL_END_CRITICAL_SECTION();
    return status;
}

/* ---- reading a foreign tensor -------------------------------------------------------------------- */

int cdl_array_from_managed(cdl_managed managed, cdl_array *out)
{
    if (managed.versioned) {
        const DLManagedTensorVersioned *m = managed.pointer;
        if (m->version.major > DLPACK_MAJOR_VERSION) {
            PyErr_Format(PyExc_BufferError,
                         "DLPack capsule has version %u.%u, a newer major version than this build's DLPack %d.%d "
                         "reads (newer minor versions of %d.x are read)",
                         m->version.major, m->version.minor, DLPACK_MAJOR_VERSION, DLPACK_MINOR_VERSION,
                         DLPACK_MAJOR_VERSION);
            return -1;
        }
    }
    return cdl_array_from_tensor(cdl_managed_tensor(managed), cdl_managed_flags(managed), out);
}

int cdl_array_from_tensor(const DLTensor *t, uint64_t flags, cdl_array *out)
{
    DLDeviceType type = t->device.device_type;
    if (!cdl_host_accessible(type) && !cdl_device_accessible(type)) {
        PyErr_Format(PyExc_BufferError,
                     "DLPack device type %d (%s) is neither CUDA nor host memory; only kDLCPU, kDLCUDA, "
                     "kDLCUDAHost and kDLCUDAManaged tensors can be described by an array interface",
                     (int)type, cdl_device_type_name((int)type));
        return -1;
    }
    if (t->ndim < 0 || t->ndim > CDL_MAX_NDIM || (t->ndim > 0 && t->shape == NULL)) {
        PyErr_Format(PyExc_BufferError, "DLPack tensor has ndim %d%s; 0 to %d dimensions with a shape are supported",
                     (int)t->ndim, t->ndim > 0 && t->shape == NULL ? " and no shape" : "", CDL_MAX_NDIM);
        return -1;
    }
    if (cdl_check_dtype(t->dtype) < 0)
        return -1;
    int64_t itemsize = cdl_itemsize(t->dtype);
    out->dtype = t->dtype;
    out->ndim = t->ndim;
    int empty = 0;
    for (int32_t i = 0; i < t->ndim; i++) {
        out->shape[i] = t->shape[i];
        if (out->shape[i] < 0) {
            PyErr_Format(PyExc_BufferError, "DLPack tensor shape[%d] is %lld", (int)i, (long long)t->shape[i]);
            return -1;
        }
        empty |= out->shape[i] == 0;
    }
    if (t->strides != NULL) {
        /* Strides of an empty tensor step to no element (views describe it as C-contiguous), so only
         * a tensor with elements needs them to fit in bytes. */
        for (int32_t i = 0; i < t->ndim && !empty; i++) {
            int64_t byte_stride;
            if (__builtin_mul_overflow(t->strides[i], itemsize, &byte_stride)) {
                PyErr_Format(PyExc_BufferError, "DLPack tensor strides[%d] = %lld overflows in bytes", (int)i,
                             (long long)t->strides[i]);
                return -1;
            }
        }
        memcpy(out->strides, t->strides, (size_t)t->ndim * sizeof(int64_t));
    }
    else {
        (void)cdl_contiguous_strides(t->ndim, out->shape, out->strides); /* wraps only past the count check */
    }
    /* The pointer handed on is data + byte_offset: a sum past the end of the address space names no memory. */
    if ((uint64_t)t->byte_offset > UINTPTR_MAX - (uintptr_t)t->data) {
        PyErr_Format(PyExc_BufferError,
                     "DLPack tensor data %p + byte_offset %llu wraps past the end of the address space", t->data,
                     (unsigned long long)t->byte_offset);
        return -1;
    }
    uintptr_t address = (uintptr_t)t->data + (uintptr_t)t->byte_offset;
    int64_t low, high;
    switch (cdl_measure_extent(out, itemsize, &low, &high)) {
    case CDL_EXTENT_COUNT_OVERFLOW:
        PyErr_SetString(PyExc_BufferError, "DLPack tensor shape has more elements than fit in 64 bits");
        return -1;
    case CDL_EXTENT_OVERFLOW:
        PyErr_SetString(PyExc_BufferError, "DLPack tensor shape and strides reach outside the address space");
        return -1;
    case CDL_EXTENT_OK:
        if (t->data == NULL) {
            /* A tensor with elements needs memory; only an empty one may name none (producers give those NULL). */
            int64_t count = 1;
            for (int32_t i = 0; i < t->ndim; i++)
                count *= out->shape[i]; /* the measure found no overflow */
            PyErr_Format(PyExc_BufferError,
                         "DLPack tensor data is NULL (byte_offset %llu) but the tensor has %lld elements",
                         (unsigned long long)t->byte_offset, (long long)count);
            return -1;
        }
        if (!cdl_extent_fits(address, low, high)) {
            PyErr_Format(PyExc_BufferError,
                         "DLPack tensor data %p + byte_offset %llu with its shape and strides reaches outside the "
                         "address space",
                         t->data, (unsigned long long)t->byte_offset);
            return -1;
        }
        break;
    case CDL_EXTENT_EMPTY:
        break;
    }
    out->data = (void *)address;
    out->device = t->device;
    out->home_device = t->device.device_id; /* a producer's pinned or managed tensor says 0: no better guess */
    out->read_only = (flags & DLPACK_FLAG_BITMASK_READ_ONLY) != 0;
    out->stream = 0;
    return 0;
}
