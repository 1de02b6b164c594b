/* Tensors the DLPack exchange API's managed_tensor_allocator makes for a consumer: host memory, or
 * device, pinned and managed memory from the CUDA runtime, in the right context and without breaking a
 * graph capture. No Python here (a deleter only lets go of the GIL around a free that may wait). */
#include "cdl_internal.h"
#include "cuda_runtime_table.h"

#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Tensors made for a consumer: one allocation holds the managed tensor, shape and strides; the data
 * is a separate allocation of the kind the device needs. Runs without the GIL: no Python here. */
typedef struct {
    DLManagedTensorVersioned managed;
    int64_t dims[];
} cdl_made_tensor;

static void cdl_free_made_tensor(DLManagedTensorVersioned *self)
{
    cdl_made_tensor *made = self->manager_ctx;
    DLDeviceType type = self->dl_tensor.device.device_type;
    const cdl_cudart *rt = cdl_cudart_loaded();
    if (type == kDLCPU) {
        free(self->dl_tensor.data);
    }
    else if (rt != NULL) {
        /* A deleter may run during a capture (a consumer dropping its output), on any thread. cudaFree and
         * cudaFreeHost may wait for the device: a thread holding the GIL lets go of it meanwhile, so a host
         * function that needs the GIL cannot deadlock against the wait. */
        PyThreadState *attached = cdl_attached_thread_state();
        if (attached != NULL)
            attached = PyEval_SaveThread();
        cdl_capture_mode_scope relaxed;
        cdl_capture_mode_relax(rt, &relaxed);
        if (type == kDLCUDAHost) {
            if (rt->free_host(self->dl_tensor.data) != cudaSuccess)
                (void)rt->get_last_error();
        }
        else {
            /* Device memory is freed in its device's context: on a thread with none, the runtime would
             * otherwise bind (and make) its own device's primary context just for the free. */
            cdl_device_scope scope;
            int device_memory = type == kDLCUDA;
            int entered = device_memory ? cdl_device_enter(rt, self->dl_tensor.device.device_id, &scope) : 0;
            if (rt->free(self->dl_tensor.data) != cudaSuccess)
                (void)rt->get_last_error();
            if (device_memory && entered == 0)
                (void)cdl_device_leave(rt, &scope);
        }
        cdl_capture_mode_leave(rt, &relaxed);
        if (attached != NULL)
            PyEval_RestoreThread(attached);
    }
    free(made);
}

int cdl_exchange_allocate(DLTensor *prototype, DLManagedTensorVersioned **out, void *error_ctx,
                                 void (*set_error)(void *error_ctx, const char *kind, const char *message))
{
    char message[256];
    int32_t ndim = prototype->ndim;
    uint64_t bytes = (uint64_t)cdl_itemsize(prototype->dtype);
    if (prototype->dtype.bits == 0 || prototype->dtype.lanes == 0) {
        snprintf(message, sizeof(message), "cai_dlpack allocator: prototype dtype (code=%d, bits=%d, lanes=%d) has "
                 "no size", (int)prototype->dtype.code, (int)prototype->dtype.bits, (int)prototype->dtype.lanes);
        set_error(error_ctx, "ValueError", message);
        return -1;
    }
    if (ndim < 0 || ndim > CDL_MAX_NDIM || (ndim > 0 && prototype->shape == NULL)) {
        set_error(error_ctx, "ValueError", "cai_dlpack allocator: bad prototype ndim or shape");
        return -1;
    }
    /* A tensor with no elements needs no bytes, whatever its other extents multiply to; its contiguous strides
     * must still fit in 64 bits (an extent of 0 or 1 counts as one there). */
    int empty = 0;
    for (int32_t i = 0; i < ndim; i++) {
        if (prototype->shape[i] < 0) {
            set_error(error_ctx, "ValueError", "cai_dlpack allocator: a prototype extent is negative");
            return -1;
        }
        empty |= prototype->shape[i] == 0;
    }
    int64_t stride = 1;
    for (int32_t i = ndim - 1; i > 0; i--) {
        if (__builtin_mul_overflow(stride, prototype->shape[i] > 1 ? prototype->shape[i] : 1, &stride)) {
            set_error(error_ctx, "ValueError", "cai_dlpack allocator: the prototype's strides overflow 64 bits");
            return -1;
        }
    }
    for (int32_t i = 0; i < ndim && !empty; i++) {
        if (__builtin_mul_overflow(bytes, (uint64_t)prototype->shape[i], &bytes)) {
            set_error(error_ctx, "ValueError", "cai_dlpack allocator: bad or overflowing prototype shape");
            return -1;
        }
    }
    if (empty)
        bytes = 0;
    /* The host block is rounded up to whole 64-byte lines, and no allocator hands out more than PTRDIFF_MAX
     * bytes: a count past that is refused here, before any rounding could wrap it to a few bytes. */
    if (bytes > (uint64_t)PTRDIFF_MAX - 63) {
        snprintf(message, sizeof(message),
                 "cai_dlpack allocator: the prototype needs %llu bytes, more than any allocation can hold",
                 (unsigned long long)bytes);
        set_error(error_ctx, "MemoryError", message);
        return -1;
    }
    cdl_made_tensor *made = calloc(1, sizeof(cdl_made_tensor) + 2 * (size_t)ndim * sizeof(int64_t));
    if (made == NULL) {
        set_error(error_ctx, "MemoryError", "cai_dlpack allocator: out of host memory");
        return -1;
    }
    size_t size = bytes ? (size_t)bytes : 1;
    const char *kind = "RuntimeError"; /* of a failure below: a device's, or no device this allocator knows */
    void *data = NULL;
    DLDeviceType type = prototype->device.device_type;
    if (type == kDLCPU) {
        data = aligned_alloc(64, (size + 63) / 64 * 64);
        if (data == NULL) {
            snprintf(message, sizeof(message), "cai_dlpack allocator: cannot allocate %zu host bytes", size);
            kind = "MemoryError";
        }
    }
    else if (type == kDLCUDA || type == kDLCUDAHost || type == kDLCUDAManaged) {
        const cdl_cudart *rt = cdl_cudart_get_any_thread(); /* a consumer's first call may be this one */
        /* Device memory is made in its device's context; pinned and managed memory, which any device
         * may use, in the caller's (entering device 0's would make a context there). */
        cdl_device_scope scope = {0};
        cdl_capture_mode_scope relaxed = {0};
        if (rt != NULL)
            cdl_capture_mode_relax(rt, &relaxed);
        int status = rt == NULL ? -1 : type == kDLCUDA ? cdl_device_enter(rt, prototype->device.device_id, &scope) : 0;
        const char *failed = scope.failed_call;
        int in_driver = scope.failed_in_driver;
        if (status == 0) {
            status = type == kDLCUDA       ? rt->malloc(&data, size)
                     : type == kDLCUDAHost ? rt->malloc_host(&data, size)
                                           : rt->malloc_managed(&data, size, cudaMemAttachGlobal);
            failed = type == kDLCUDA ? "cudaMalloc" : type == kDLCUDAHost ? "cudaMallocHost" : "cudaMallocManaged";
            if (status == 0 && cdl_device_leave(rt, &scope) != 0) {
                /* The memory is made, but the caller's device could not be put back: refuse it. */
                if ((type == kDLCUDAHost ? rt->free_host(data) : rt->free(data)) != cudaSuccess)
                    (void)rt->get_last_error();
                status = scope.failed_code, failed = scope.failed_call, in_driver = scope.failed_in_driver;
            }
            else if (status != 0) {
                (void)cdl_device_leave(rt, &scope);
            }
        }
        if (status != 0) {
            snprintf(message, sizeof(message), "cai_dlpack allocator: %zu bytes on device (%d, %d): %s%s%s", size,
                     (int)type, (int)prototype->device.device_id, rt ? failed : "",
                     rt ? " failed: " : "", rt ? cdl_error_name(rt, status, in_driver) : "no CUDA runtime found");
            if (rt && !in_driver)
                (void)rt->get_last_error();
            /* Out of memory is a MemoryError, as for the host (the runtime's cudaErrorMemoryAllocation and the
             * driver's CUDA_ERROR_OUT_OF_MEMORY are both 2); any other refusal stays a RuntimeError. */
            if (rt && status == cudaErrorMemoryAllocation)
                kind = "MemoryError";
            data = NULL;
        }
        if (rt != NULL)
            cdl_capture_mode_leave(rt, &relaxed);
    }
    else {
        snprintf(message, sizeof(message), "cai_dlpack allocator: device type %d is not supported (%s)", (int)type,
                 cdl_device_type_name((int)type));
    }
    if (data == NULL) {
        free(made);
        set_error(error_ctx, kind, message);
        return -1;
    }
    DLManagedTensorVersioned *m = &made->managed;
    m->version.major = DLPACK_MAJOR_VERSION;
    m->version.minor = DLPACK_MINOR_VERSION;
    m->manager_ctx = made;
    m->deleter = cdl_free_made_tensor;
    m->dl_tensor.data = data;
    m->dl_tensor.device = prototype->device;
    m->dl_tensor.ndim = ndim;
    m->dl_tensor.dtype = prototype->dtype;
    m->dl_tensor.shape = made->dims;
    m->dl_tensor.strides = made->dims + ndim;
    if (ndim > 0)
        memcpy(made->dims, prototype->shape, (size_t)ndim * sizeof(int64_t));
    (void)cdl_contiguous_strides(ndim, made->dims, made->dims + ndim); /* checked above: the strides fit */
    *out = m;
    return 0;
}

