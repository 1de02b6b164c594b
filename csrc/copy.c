/* The copies a consumer asks __dlpack__ for (copy=True, or dl_device=(kDLCPU, 0) for CUDA memory): a new
 * C-contiguous allocation of the same type and shape, filled from the source, in a capsule that owns it. No
 * kernel of our own: host memory is copied by memcpy loops, CUDA memory by the runtime's memcpy family. */
#include "cdl_internal.h"
#include "cuda_runtime_table.h"

#include <stdlib.h>
#include <string.h>

/* The most runtime copy calls one device-to-device copy may take: more is refused (a gather kernel's job). */
#define CDL_COPY_MAX_CALLS 65536
/* Host copies at least this large run with the GIL released. */
#define CDL_COPY_RELEASE_GIL_BYTES (1 << 16)

/* A source layout reduced for copying, in C order: dimensions of extent 1 dropped, neighbours that step as
 * one dimension merged; strides in bytes. */
typedef struct {
    int32_t ndim;
    int64_t shape[CDL_MAX_NDIM];
    int64_t strides[CDL_MAX_NDIM];
} cdl_copy_layout;

static void cdl_reduce_layout(const cdl_array *arr, int64_t itemsize, cdl_copy_layout *out)
{
    /* The reader measures no extent for an empty array: its strides times the itemsize, and the products of
     * its other extents, need not fit. It reduces to one dimension of no elements, and nothing is multiplied. */
    for (int32_t i = 0; i < arr->ndim; i++) {
        if (arr->shape[i] == 0) {
            out->ndim = 1;
            out->shape[0] = 0;
            out->strides[0] = itemsize;
            return;
        }
    }
    out->ndim = 0;
    for (int32_t i = 0; i < arr->ndim; i++) {
        if (arr->shape[i] == 1)
            continue;
        /* (shape - 1) * stride * itemsize fits (the reader measured the extent), so stride * itemsize does; a
         * merged extent divides the element count, which fits. */
        int64_t stride = arr->strides[i] * itemsize, span;
        int32_t last = out->ndim - 1;
        if (last >= 0 && !__builtin_mul_overflow(stride, arr->shape[i], &span) && out->strides[last] == span) {
            out->shape[last] *= arr->shape[i];
            out->strides[last] = stride;
            continue;
        }
        out->shape[out->ndim] = arr->shape[i];
        out->strides[out->ndim] = stride;
        out->ndim++;
    }
}

/* How a layout is copied by the runtime: one call per index of the outer dimensions, each a 2D copy of height
 * rows of width bytes, pitch bytes apart in the source (height 1: a plain copy of width bytes). The innermost
 * contiguous run is the width; the next dimension is the rows when its stride is a pitch the runtime takes
 * (positive, at least the width, and at most cudaDevAttrMaxPitch, as the width must be too: it is the
 * destination's pitch). Negative and zero strides, and rows too far apart or too wide, are outer dimensions:
 * a plain copy has no pitch to bound. */
typedef struct {
    int32_t outer;        /* the first `outer` dimensions of the layout are looped over */
    int64_t width, height, pitch;
    int64_t calls;        /* saturates above CDL_COPY_MAX_CALLS */
} cdl_copy_plan;

static void cdl_plan_copy(const cdl_copy_layout *layout, int64_t itemsize, int64_t max_pitch, cdl_copy_plan *plan)
{
    int32_t n = layout->ndim;
    plan->width = itemsize;
    if (n > 0 && layout->strides[n - 1] == itemsize)
        plan->width = layout->shape[--n] * itemsize;
    plan->height = 1;
    plan->pitch = plan->width;
    if (n > 0 && layout->strides[n - 1] >= plan->width && layout->strides[n - 1] <= max_pitch &&
        plan->width <= max_pitch) {
        n--;
        plan->height = layout->shape[n];
        plan->pitch = layout->strides[n];
    }
    plan->outer = n;
    plan->calls = 1;
    for (int32_t i = 0; i < n; i++)
        if (__builtin_mul_overflow(plan->calls, layout->shape[i], &plan->calls) || plan->calls > CDL_COPY_MAX_CALLS)
            plan->calls = CDL_COPY_MAX_CALLS + 1;
}

/* Steps index (the first ndim dimensions of layout, C order) to the next element; moves *offset by the byte
 * strides. Returns 0 once every index has been visited. */
static int cdl_next_index(const cdl_copy_layout *layout, int32_t ndim, int64_t *index, int64_t *offset)
{
    for (int32_t d = ndim - 1; d >= 0; d--) {
        if (++index[d] < layout->shape[d]) {
            *offset += layout->strides[d];
            return 1;
        }
        *offset -= (layout->shape[d] - 1) * layout->strides[d];
        index[d] = 0;
    }
    return 0;
}

/* count items of itemsize bytes, stride bytes apart at source, packed at destination. Fixed sizes let the
 * compiler turn each memcpy into one load and store. */
static void cdl_copy_strided_run(char *destination, const char *source, int64_t count, int64_t stride,
                                 int64_t itemsize)
{
#define CDL_RUN(size)                                                                                           \
    for (int64_t i = 0; i < count; i++)                                                                        \
        memcpy(destination + i * (size), source + i * stride, (size));                                        \
    return
    switch (itemsize) {
    case 1: CDL_RUN(1);
    case 2: CDL_RUN(2);
    case 4: CDL_RUN(4);
    case 8: CDL_RUN(8);
    case 16: CDL_RUN(16);
    default: CDL_RUN((size_t)itemsize);
    }
#undef CDL_RUN
}

/* Host to host: every element of the layout at source, written in C order to destination: a memcpy per
 * innermost contiguous run, else a strided run per innermost dimension. No Python. */
static void cdl_gather_host(char *destination, const char *source, const cdl_copy_layout *layout, int64_t itemsize)
{
    int32_t n = layout->ndim;
    int64_t index[CDL_MAX_NDIM] = {0}, offset = 0;
    if (n > 0 && layout->strides[n - 1] != itemsize) {
        int64_t count = layout->shape[n - 1], stride = layout->strides[n - 1];
        do {
            cdl_copy_strided_run(destination, source + offset, count, stride, itemsize);
            destination += count * itemsize;
        } while (cdl_next_index(layout, n - 1, index, &offset));
        return;
    }
    int64_t width = n > 0 ? layout->shape[--n] * itemsize : itemsize;
    do {
        memcpy(destination, source + offset, (size_t)width);
        destination += width;
    } while (cdl_next_index(layout, n, index, &offset));
}

/* cudaDevAttrMaxPitch of device. Returns 0, or -1 with CudaError. */
static int cdl_max_pitch(const cdl_cudart *rt, int device, int64_t *out)
{
    int value = 0;
    cudaError_t code = rt->device_get_attribute(&value, cudaDevAttrMaxPitch, device);
    if (code != cudaSuccess)
        return cdl_raise_cuda_error("cudaDeviceGetAttribute", code);
    *out = value;
    return 0;
}

/* The plan's runtime calls on stream. Returns cudaSuccess, or the failed call's code with *failed its name. */
static cudaError_t cdl_issue_copies(const cdl_cudart *rt, char *destination, const char *source,
                                    const cdl_copy_layout *layout, const cdl_copy_plan *plan, cudaStream_t stream,
                                    const char **failed)
{
    int64_t index[CDL_MAX_NDIM] = {0}, offset = 0;
    cudaError_t code;
    do {
        if (plan->height == 1) {
            *failed = "cudaMemcpyAsync";
            code = rt->memcpy_async(destination, source + offset, (size_t)plan->width, cudaMemcpyDefault, stream);
        }
        else {
            *failed = "cudaMemcpy2DAsync";
            code = rt->memcpy_2d_async(destination, (size_t)plan->width, source + offset, (size_t)plan->pitch,
                                       (size_t)plan->width, (size_t)plan->height, cudaMemcpyDefault, stream);
        }
        destination += plan->width * plan->height;
    } while (code == cudaSuccess && cdl_next_index(layout, plan->outer, index, &offset));
    return code;
}

/* Whether stream can take stream-ordered work that is no node of a graph: not capturing (nor the legacy
 * stream while a blocking stream captures). In the current context. */
static int cdl_stream_outside_capture(const cdl_cudart *rt, cudaStream_t stream)
{
    enum cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    unsigned long long capture_id;
    cudaError_t code = cdl_stream_capture_info(rt, stream, &capture, &capture_id);
    if (code != cudaSuccess)
        (void)rt->get_last_error();
    return code == cudaSuccess && capture == cudaStreamCaptureStatusNone;
}

/* cdl_data_release of our copies: host copies are malloc'd; CUDA ones are freed in their device's context, by
 * cudaFreeAsync on stream where they were made by cudaMallocAsync (stream nonzero), else by cudaFree or
 * cudaFreeHost, which may wait for the device: the calling thread then detaches from the interpreter. */
static void cdl_release_copy(void *data, DLDevice device, int64_t stream)
{
    if (device.device_type == kDLCPU) {
        free(data);
        return;
    }
    const cdl_cudart *rt = cdl_cudart_loaded(); /* it made the copy, and a runtime is never unloaded */
    if (rt == NULL)
        return;
    cdl_capture_mode_scope relaxed; /* a free is made at once, never a node of a capture, and must not break one */
    cdl_capture_mode_relax(rt, &relaxed);
    cdl_device_scope scope;
    int entered = device.device_type == kDLCUDA && cdl_device_enter(rt, device.device_id, &scope) == 0;
    cudaError_t code;
    if (stream != 0 && rt->free_async != NULL && cdl_stream_outside_capture(rt, (cudaStream_t)(intptr_t)stream)) {
        code = rt->free_async(data, (cudaStream_t)(intptr_t)stream);
    }
    else {
        PyThreadState *attached = cdl_attached_thread_state();
        if (attached != NULL)
            attached = PyEval_SaveThread();
        code = device.device_type == kDLCUDAHost ? rt->free_host(data) : rt->free(data);
        if (attached != NULL)
            PyEval_RestoreThread(attached);
    }
    if (code != cudaSuccess)
        (void)rt->get_last_error(); /* at exit the runtime may already be unloading */
    if (entered)
        (void)cdl_device_leave(rt, &scope);
    cdl_capture_mode_leave(rt, &relaxed);
}

/* The stream a host copy is issued on and waited for: the producer's, which orders it after the producer's
 * work (the legacy stream where none was given or the sync option is off). */
static cudaStream_t cdl_producer_stream(const cdl_array *arr)
{
    return (cudaStream_t)(intptr_t)(arr->stream != 0 && cdl_option_sync ? arr->stream : CDL_STREAM_LEGACY);
}

/* A host copy is made once, now: a consumer whose stream is capturing a CUDA graph wants what the graph's
 * launches will compute, which no copy made at capture time holds. Refused (BufferError, naming the capture)
 * before any call. consumer: the stream the caller passed; the legacy stream never captures, -1 orders
 * nothing. The per-thread stream is the caller's own device's, asked about in the caller's context. */
static int cdl_refuse_capturing_consumer(const cdl_cudart *rt, int64_t consumer)
{
    if (consumer == CDL_STREAM_NO_SYNC || consumer == CDL_STREAM_LEGACY)
        return 0;
    enum cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    unsigned long long capture_id = 0;
    cudaError_t code = cdl_stream_capture_info(rt, (cudaStream_t)(intptr_t)consumer, &capture, &capture_id);
    if (code != cudaSuccess)
        return cdl_raise_cuda_error("cudaStreamGetCaptureInfo", code);
    if (capture == cudaStreamCaptureStatusNone)
        return 0;
    PyErr_Format(cdl_UnsupportedError,
                 "a host copy (dl_device=(1, 0)) was asked for with stream=%lld, which is capturing a CUDA graph "
                 "(capture %llu%s): the copy would be made once, now, never by the graph's launches. Make the host "
                 "copy outside the capture, or copy on the device (copy=True) within it",
                 (long long)consumer, capture_id,
                 capture == cudaStreamCaptureStatusInvalidated ? ", already invalidated" : "");
    return -1;
}

/* CUDA memory to a new host allocation, complete on return. With few enough runtime calls the elements are
 * copied straight into place; otherwise the bytes the layout reaches are staged in one copy and gathered on
 * the host, so a host copy is never refused for its layout. Returns 0, or -1 with an exception set
 * (destination untouched for the caller to free). */
static int cdl_copy_to_host(const cdl_array *arr, const cdl_copy_layout *layout, int64_t itemsize, int64_t consumer,
                            char *destination)
{
    const cdl_cudart *rt = cdl_cudart_get();
    if (rt == NULL)
        return -1;
    int64_t max_pitch = 0;
    if (cdl_refuse_capturing_consumer(rt, consumer) < 0 || cdl_max_pitch(rt, arr->home_device, &max_pitch) < 0)
        return -1;
    cdl_copy_plan plan;
    cdl_plan_copy(layout, itemsize, max_pitch, &plan);
    int64_t low = 0, high = 0;
    char *staging = NULL;
    if (plan.calls > CDL_COPY_MAX_CALLS) {
        (void)cdl_measure_extent(arr, itemsize, &low, &high);
        staging = malloc((size_t)(high - low));
        if (staging == NULL) {
            PyErr_NoMemory();
            return -1;
        }
    }
    cudaStream_t stream = cdl_producer_stream(arr);
    const char *failed = NULL;
    cudaError_t code = cudaSuccess;
    cdl_device_scope scope;
    if (cdl_device_enter(rt, arr->home_device, &scope) != 0) {
        free(staging);
        return cdl_raise_scope_error(&scope);
    }
    /* Waiting for a capturing stream would invalidate its capture (and the legacy stream cannot be used while
     * a blocking stream captures): refused before any call that would break it. */
    enum cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    unsigned long long capture_id = 0;
    cudaError_t query = cdl_stream_capture_info(rt, stream, &capture, &capture_id);
    if (query != cudaSuccess || capture != cudaStreamCaptureStatusNone) {
        free(staging);
        if (query != cudaSuccess)
            (void)rt->get_last_error();
        (void)cdl_device_leave(rt, &scope);
        if (query != cudaSuccess && query != cudaErrorStreamCaptureImplicit)
            return cdl_raise_cuda_error("cudaStreamGetCaptureInfo", query); /* the query itself failed */
        return cdl_raise_capture_error("cudaStreamSynchronize",
                                       query != cudaSuccess ? (int)query : (int)cudaErrorStreamCaptureUnsupported,
                                       "a host copy (dl_device=(1, 0)) waits for stream %lld, which %s; make the host "
                                       "copy outside the capture",
                                       (long long)(intptr_t)stream,
                                       query != cudaSuccess
                                           ? "is the legacy stream while a blocking stream captures a CUDA graph"
                                           : "is capturing a CUDA graph");
    }
    int scope_failed = 0;
    /* The one place a conversion waits for the device: the consumer asked for host memory. */
    Py_BEGIN_ALLOW_THREADS
    {
        /* A copy into pageable memory (synchronous to the host) and a synchronization are calls no capture can
         * record: in the thread's own mode (global, PyTorch's default) the runtime refuses them with
         * cudaErrorStreamCaptureUnsupported while this thread or any other captures in global mode, and
         * invalidates those captures. Neither touches a capturing stream (checked above), so no capture depends
         * on them: they run in relaxed mode, as allocations and frees do. */
        cdl_capture_mode_scope relaxed;
        cdl_capture_mode_relax(rt, &relaxed);
        if (staging == NULL) {
            code = cdl_issue_copies(rt, destination, arr->data, layout, &plan, stream, &failed);
        }
        else {
            failed = "cudaMemcpyAsync";
            code = rt->memcpy_async(staging, (const char *)arr->data + low, (size_t)(high - low), cudaMemcpyDefault,
                                    stream);
        }
        if (code == cudaSuccess) {
            failed = "cudaStreamSynchronize";
            code = rt->stream_synchronize(stream);
        }
        cdl_capture_mode_leave(rt, &relaxed);
        if (code == cudaSuccess && staging != NULL)
            cdl_gather_host(destination, staging - low, layout, itemsize);
        scope_failed = cdl_device_leave(rt, &scope) != 0 && code == cudaSuccess;
    }
    Py_END_ALLOW_THREADS
    free(staging);
    if (scope_failed)
        return cdl_raise_scope_error(&scope);
    return code == cudaSuccess ? 0 : cdl_raise_cuda_error(failed, code);
}

/* A new allocation like the source's memory (device, pinned or managed), made in relaxed capture mode. Device
 * memory is made by cudaMallocAsync on stream (not NULL) where the runtime has it and stream is outside any capture
 * (*stream_ordered set: it is freed by cudaFreeAsync, never waiting for the device). */
static int cdl_allocate_like(const cdl_cudart *rt, DLDevice device, size_t size, cudaStream_t stream, void **out,
                             int *stream_ordered)
{
    *stream_ordered = 0;
    if (device.device_type == kDLCUDA && stream != NULL && rt->malloc_async != NULL &&
        cdl_stream_outside_capture(rt, stream)) {
        cudaError_t made = rt->malloc_async(out, size, stream);
        if (made == cudaSuccess) {
            *stream_ordered = 1;
            return 0;
        }
        (void)rt->get_last_error(); /* a device without memory pools: cudaMalloc below */
    }
    cdl_capture_mode_scope relaxed;
    cdl_capture_mode_relax(rt, &relaxed);
    const char *call = device.device_type == kDLCUDAHost ? "cudaMallocHost"
                       : device.device_type == kDLCUDAManaged ? "cudaMallocManaged" : "cudaMalloc";
    cudaError_t code = device.device_type == kDLCUDAHost      ? rt->malloc_host(out, size)
                       : device.device_type == kDLCUDAManaged ? rt->malloc_managed(out, size, cudaMemAttachGlobal)
                                                              : rt->malloc(out, size);
    cdl_capture_mode_leave(rt, &relaxed);
    return code == cudaSuccess ? 0 : cdl_raise_cuda_error(call, code);
}

/* After the copies queued on stream (at: its release point; copies_device: the device whose context they were
 * issued in, whose default stream a legacy or per-thread handle names): the producer's stream waits for them (an
 * event, as stream ordering makes one; nothing when the producer gave no stream, or copied on its own), and
 * owner and keepalive are released once they have run. 0, or -1 with an exception (the copies are queued all
 * the same). */
static int cdl_keep_source_until_copied(const cdl_array *arr, int64_t stream, int copies_device,
                                        const cdl_release_point *at, PyObject *owner, PyObject *keepalive)
{
    cdl_release_objects_after(at, owner, keepalive);
    if (arr->stream == 0 || arr->stream == stream || !cdl_option_sync)
        return 0;
    cdl_array copied = *arr;
    copied.stream = stream;
    copied.home_device = copies_device;
    return cdl_order_streams(&copied, arr->stream);
}

/* The legacy stream cannot take stream-ordered work (a copy, a cudaMallocAsync) while a blocking stream of the
 * current context's device captures a CUDA graph: the runtime would answer cudaErrorStreamCaptureImplicit and
 * invalidate that capture. Asked of the runtime (which answers the query itself, invalidating nothing) and
 * refused with CudaError before any call, as a host copy and stream ordering refuse it. */
static int cdl_refuse_unusable_legacy_stream(const cdl_cudart *rt)
{
    enum cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    unsigned long long capture_id = 0;
    cudaError_t code = cdl_stream_capture_info(rt, (cudaStream_t)(intptr_t)CDL_STREAM_LEGACY, &capture, &capture_id);
    if (code == cudaSuccess)
        return 0;
    (void)rt->get_last_error(); /* our query's, not a failure of anyone's work */
    if (code != cudaErrorStreamCaptureImplicit)
        return cdl_raise_cuda_error("cudaStreamGetCaptureInfo", code);
    return cdl_raise_capture_error(
        "cudaMemcpyAsync", cudaErrorStreamCaptureImplicit,
        "copy=True would copy on the legacy default stream (stream=None or 1, or stream=-1 where the producer gave "
        "no stream), and a blocking stream of its device is capturing a CUDA graph: any use of the legacy stream "
        "would invalidate that capture. Pass a stream of the capture to copy within it, or copy outside the capture");
}

/* CUDA memory to a new allocation of the same kind: ordered after the producer's stream, issued on the
 * consumer's (the producer's for consumer -1, which asks for no ordering), and not waited for. The source is
 * kept alive (owner, keepalive) until the copy has run, and the producer's stream is ordered after the copy,
 * so the producer's allocator cannot hand the source to other work before the copy read it (outside graph
 * captures: a captured copy runs at each launch of the graph, whose sources must outlive it, as the README
 * says). *release_at: where the copy's own memory is released; *stream_ordered as cdl_allocate_like's. An
 * empty array is copied by no call at all, so its layout is never planned (nor refused). */
static int cdl_copy_on_device(const cdl_array *arr, const cdl_copy_layout *layout, int64_t itemsize, int64_t count,
                              int64_t consumer, PyObject *owner, PyObject *keepalive, void **out,
                              cdl_release_point *release_at, int *stream_ordered)
{
    const cdl_cudart *rt = cdl_cudart_get();
    if (rt == NULL)
        return -1;
    int64_t max_pitch = 0;
    cdl_copy_plan plan = {0};
    if (count > 0 && cdl_max_pitch(rt, arr->home_device, &max_pitch) < 0)
        return -1;
    if (count > 0)
        cdl_plan_copy(layout, itemsize, max_pitch, &plan);
    if (plan.calls > CDL_COPY_MAX_CALLS) {
        char strides[400] = "";
        size_t used = 0;
        for (int32_t i = 0; i < arr->ndim && used < sizeof(strides) - 24; i++)
            used += (size_t)snprintf(strides + used, sizeof(strides) - used, "%s%lld", i ? ", " : "",
                                     (long long)arr->strides[i]);
        PyErr_Format(PyExc_BufferError,
                     "copy=True of CUDA memory with element strides (%s) would take more than %d runtime copy "
                     "calls; cai_dlpack copies with the runtime's memcpy calls only (no kernel of its own): ask "
                     "for a host copy (dl_device=(1, 0)) or copy with the producer's library",
                     strides, CDL_COPY_MAX_CALLS);
        return -1;
    }
    *stream_ordered = 0;
    cudaStream_t stream = consumer == CDL_STREAM_NO_SYNC ? cdl_producer_stream(arr) : (cudaStream_t)(intptr_t)consumer;
    /* A legacy or per-thread consumer names that stream of the caller's current device. For pinned and managed
     * memory, which every device reaches, that need not be the allocation's device: the copies go onto the
     * consumer's stream in the caller's own context, right after the wait on the producer that
     * cdl_order_streams put there, so they run after the producer's work and before the consumer's. For device
     * memory those handles are the data's device's streams (the array API's), reached in its context; so is the
     * producer's stream that stream=-1 copies on. */
    int in_callers_context = arr->device.device_type != kDLCUDA &&
                             (consumer == CDL_STREAM_LEGACY || consumer == CDL_STREAM_PER_THREAD);
    int copies_device = arr->home_device;
    cudaError_t asked = in_callers_context && count > 0 ? rt->get_device(&copies_device) : cudaSuccess;
    if (asked != cudaSuccess)
        return cdl_raise_cuda_error("cudaGetDevice", asked);
    int on_legacy_stream = count > 0 && (int64_t)(intptr_t)stream == CDL_STREAM_LEGACY;
    if (on_legacy_stream && in_callers_context && cdl_refuse_unusable_legacy_stream(rt) < 0)
        return -1;
    cdl_device_scope scope;
    if (cdl_device_enter(rt, arr->home_device, &scope) != 0)
        return cdl_raise_scope_error(&scope);
    if (on_legacy_stream && !in_callers_context && cdl_refuse_unusable_legacy_stream(rt) < 0) {
        (void)cdl_device_leave(rt, &scope); /* the refusal is the error to report: nothing was made */
        return -1;
    }
    /* An empty copy is a byte nobody reads: made and freed at once (no stream, no release point). */
    int status = cdl_allocate_like(rt, arr->device, (size_t)(count > 0 ? count * itemsize : 1),
                                   count > 0 ? stream : NULL, out, stream_ordered);
    if (cdl_device_leave(rt, &scope) != 0 && status == 0) {
        cdl_release_copy(*out, arr->device, *stream_ordered ? (int64_t)(intptr_t)stream : 0);
        return cdl_raise_scope_error(&scope);
    }
    if (status < 0)
        return -1;
    if (count == 0) {
        cdl_release_point_set(release_at, 0, arr);
        return 0;
    }
    if (cdl_order_streams(arr, consumer) < 0)
        goto fail;
    if (!in_callers_context && cdl_device_enter(rt, arr->home_device, &scope) != 0) {
        cdl_raise_scope_error(&scope);
        goto fail;
    }
    /* Asked, and the release point set, in the context the copies are issued in: the stream is that context's. A
     * stream that cannot be asked gets no copies: whether the source must be kept until they ran is not known. */
    enum cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    unsigned long long capture_id;
    cudaError_t query = cdl_stream_capture_info(rt, stream, &capture, &capture_id);
    if (query != cudaSuccess && query != cudaErrorStreamCaptureImplicit) {
        if (!in_callers_context)
            (void)cdl_device_leave(rt, &scope);
        cdl_raise_cuda_error("cudaStreamGetCaptureInfo", query);
        goto fail;
    }
    if (query != cudaSuccess)
        (void)rt->get_last_error(); /* the legacy stream while a blocking stream captures: ours to clear */
    int outside_capture = query == cudaSuccess && capture == cudaStreamCaptureStatusNone;
    cdl_release_point_set(release_at, (int64_t)(intptr_t)stream, arr);
    const char *failed = NULL;
    cudaError_t code = cdl_issue_copies(rt, *out, arr->data, layout, &plan, stream, &failed);
    if (!in_callers_context && cdl_device_leave(rt, &scope) != 0 && code == cudaSuccess) {
        cdl_raise_scope_error(&scope);
        goto fail;
    }
    if (code != cudaSuccess) {
        cdl_raise_cuda_error(failed, code);
        goto fail;
    }
    if (outside_capture &&
        cdl_keep_source_until_copied(arr, (int64_t)(intptr_t)stream, copies_device, release_at, owner, keepalive) < 0)
        goto fail; /* freed in the stream's order: after the copies queued */
    return 0;
fail:
    cdl_release_copy(*out, arr->device, *stream_ordered ? (int64_t)(intptr_t)stream : 0);
    return -1;
}

PyObject *cdl_export_copy(const cdl_array *arr, DLDevice target, int64_t consumer, PyObject *owner,
                          PyObject *keepalive, int versioned)
{
    int64_t itemsize = cdl_itemsize(arr->dtype), count = 1, bytes;
    for (int32_t i = 0; i < arr->ndim; i++)
        count *= arr->shape[i]; /* the reader checked that the count fits */
    if (__builtin_mul_overflow(count, itemsize, &bytes)) {
        PyErr_Format(PyExc_BufferError, "a copy of %lld elements of %lld bytes does not fit in memory",
                     (long long)count, (long long)itemsize);
        return NULL;
    }
    cdl_copy_layout layout;
    cdl_reduce_layout(arr, itemsize, &layout);
    cdl_array copy = *arr;
    copy.device = target;
    copy.home_device = target.device_type == kDLCPU ? 0 : arr->home_device;
    copy.read_only = 0;
    copy.stream = 0;
    (void)cdl_contiguous_strides(copy.ndim, copy.shape, copy.strides);
    if (target.device_type == kDLCPU) {
        copy.data = malloc((size_t)(bytes > 0 ? bytes : 1));
        if (copy.data == NULL)
            return PyErr_NoMemory();
        int status = 0;
        if (count > 0 && arr->device.device_type != kDLCPU) {
            status = cdl_copy_to_host(arr, &layout, itemsize, consumer, copy.data);
        }
        else if (count > 0 && bytes >= CDL_COPY_RELEASE_GIL_BYTES) {
            Py_BEGIN_ALLOW_THREADS
            cdl_gather_host(copy.data, arr->data, &layout, itemsize);
            Py_END_ALLOW_THREADS
        }
        else if (count > 0) {
            cdl_gather_host(copy.data, arr->data, &layout, itemsize);
        }
        if (status < 0) {
            free(copy.data);
            return NULL;
        }
    }
    else {
        cdl_release_point release_at = {0}; /* set by the copy; zeroed for gcc, which cannot see that under LTO */
        int stream_ordered = 0;
        if (cdl_copy_on_device(arr, &layout, itemsize, count, consumer, owner, keepalive, &copy.data, &release_at,
                               &stream_ordered) < 0)
            return NULL;
        PyObject *capsule = cdl_capsule_owning_data(&copy, cdl_release_copy, versioned);
        /* The copy's memory goes back at the drop: in the order of a stream that is sure to be there then (see
         * cdl_release_point_for_drop), else by cudaFree, which waits for the device. The promise covers the
         * streams consumers name, not the producer's, which a copy for stream -1 is made on. */
        if (cdl_handle_untrusted(release_at.stream) ||
            (release_at.stream > CDL_STREAM_PER_THREAD && release_at.stream != consumer))
            release_at.stream = 0;
        if (capsule != NULL)
            cdl_capsule_order_release(capsule, &release_at, stream_ordered);
        return capsule;
    }
    return cdl_capsule_owning_data(&copy, cdl_release_copy, versioned);
}
