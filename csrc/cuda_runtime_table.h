/* The CUDA runtime functions the core calls, as a table filled by dlsym in cuda_runtime.c.
 * Types come from the runtime's own header; the library itself is never linked. */
#ifndef CDL_CUDA_RUNTIME_TABLE_H
#define CDL_CUDA_RUNTIME_TABLE_H

#include <cuda_runtime_api.h>

typedef struct cdl_cudart {
    const char *(*get_error_name)(cudaError_t);
    const char *(*get_error_string)(cudaError_t);
    cudaError_t (*get_last_error)(void);
    cudaError_t (*pointer_get_attributes)(struct cudaPointerAttributes *, const void *);
    cudaError_t (*get_device)(int *);
    cudaError_t (*set_device)(int);
    cudaError_t (*get_device_count)(int *);
    cudaError_t (*runtime_get_version)(int *);
    cudaError_t (*driver_get_version)(int *);
    cudaError_t (*event_create_with_flags)(cudaEvent_t *, unsigned int);
    cudaError_t (*event_destroy)(cudaEvent_t);
    cudaError_t (*event_record)(cudaEvent_t, cudaStream_t);
    cudaError_t (*stream_wait_event)(cudaStream_t, cudaEvent_t, unsigned int);
    /* cudaStreamGetCaptureInfo changed shape: CUDA 12 exports six arguments as cudaStreamGetCaptureInfo_v2
     * (its plain name is CUDA 11.0's three), CUDA 13 seven under the plain name (edge data added). The
     * loader sets the one of the runtime's major version; cdl_stream_capture_info calls it. */
    cudaError_t (*stream_get_capture_info_12)(cudaStream_t, enum cudaStreamCaptureStatus *, unsigned long long *,
                                              cudaGraph_t *, const cudaGraphNode_t **, size_t *);
    cudaError_t (*stream_get_capture_info_13)(cudaStream_t, enum cudaStreamCaptureStatus *, unsigned long long *,
                                              cudaGraph_t *, const cudaGraphNode_t **, const void **, size_t *);
    /* For tensors the DLPack exchange API asks us to allocate. */
    cudaError_t (*malloc)(void **, size_t);
    cudaError_t (*free)(void *);
    cudaError_t (*malloc_host)(void **, size_t);
    cudaError_t (*free_host)(void *);
    cudaError_t (*malloc_managed)(void **, size_t, unsigned int);
    /* For the copies a consumer asks for (copy.c): the memcpy family, no kernel of our own. */
    cudaError_t (*memcpy_async)(void *, const void *, size_t, enum cudaMemcpyKind, cudaStream_t);
    cudaError_t (*memcpy_2d_async)(void *, size_t, const void *, size_t, size_t, size_t, enum cudaMemcpyKind,
                                   cudaStream_t);
    cudaError_t (*stream_synchronize)(cudaStream_t);
    /* cudaDevAttrMaxPitch: the widest pitch (and row) a 2D copy takes. */
    cudaError_t (*device_get_attribute)(int *, enum cudaDeviceAttr, int);
    /* Optional, for releases ordered after a consumer's stream (ordered_release.c): NULL where the runtime
     * lacks them (then a release is made at once, as without a stream). cudaMallocAsync/cudaFreeAsync
     * (CUDA 11.2) make and free our device copies in stream order. */
    cudaError_t (*event_query)(cudaEvent_t);
    cudaError_t (*event_synchronize)(cudaEvent_t);
    /* cudaLaunchHostFunc: a function of ours (no CUDA call in it) run when a stream reaches it; NULL where
     * missing (then a completed release waits for the next conversion or deleter). */
    cudaError_t (*launch_host_func)(cudaStream_t, cudaHostFn_t, void *);
    cudaError_t (*malloc_async)(void **, size_t, cudaStream_t);
    cudaError_t (*free_async)(void *, cudaStream_t);
    /* Swaps the calling thread's capture-interaction mode (CUDA 10.1); NULL where the runtime lacks it. */
    cudaError_t (*thread_exchange_stream_capture_mode)(enum cudaStreamCaptureMode *);
    /* The driver's, handed out by cudaGetDriverEntryPoint[ByVersion] (no libcuda of our own); NULL
     * where the driver cannot. A context is made current by pushing it and put back by popping it,
     * so the runtime's own device setting is never touched. */
    int (*cu_ctx_get_current)(void **);
    int (*cu_ctx_push_current)(void *);
    int (*cu_ctx_pop_current)(void **);
    int (*cu_device_get)(int *, int);
    int (*cu_primary_ctx_retain)(void **, int);
    int (*cu_primary_ctx_release)(int);
    int (*cu_primary_ctx_get_state)(int, unsigned *, int *);
    int (*cu_stream_get_ctx)(void *, void **);
    int (*cu_ctx_get_id)(void *, unsigned long long *); /* unique for the process's lifetime (CUDA 12.0) */
    int (*cu_get_error_name)(int, const char **);
    int (*cu_get_error_string)(int, const char **);
} cdl_cudart;

/* The capture status of stream and, while it captures, the capture's id (unique for the process). The
 * runtime's answer: cudaErrorStreamCaptureImplicit for the legacy stream while a blocking stream of its
 * device captures (nothing is invalidated by asking). */
cudaError_t cdl_stream_capture_info(const cdl_cudart *rt, cudaStream_t stream, enum cudaStreamCaptureStatus *status,
                                    unsigned long long *id);

/* Makes a context current for a few runtime calls, then puts the caller's back as it was. With the
 * driver's calls: a device's primary context (or a stream's own context) is retained and pushed, then
 * popped and released, so a thread that had no context is left with none and the runtime's device
 * setting is never changed (cudaSetDevice(previous) would make a primary context, hundreds of MiB, on
 * a device the thread never used). Without them: cudaGetDevice/cudaSetDevice. No Python: any thread. */
typedef struct {
    int switched;         /* the scope pushed a context (or, without the driver, set a device) */
    int retained;         /* the device whose primary context the scope retained, or -1 */
    int previous_device;  /* the device cudaSetDevice puts back, without the driver */
    void *context;        /* the context current inside the scope; NULL without the driver */
    /* The failed call, when enter or leave returns nonzero: its name, code and API. */
    const char *failed_call;
    int failed_code;
    int failed_in_driver;
} cdl_device_scope;

/* cudaMalloc, cudaFree and their pinned and managed kinds are "potentially unsafe" during a graph capture: a
 * thread in global mode (every thread's default) may not make them while it captures in global or thread-local
 * mode, nor while any thread captures in global mode (PyTorch's default); the runtime refuses the call and
 * invalidates that capture. A thread in relaxed mode is not prohibited from them, and none of them is a node of
 * a capture: the memory is made or freed at once, which is what the allocator's caller asks for. So each runs
 * with the calling thread switched to relaxed and its own mode put back after (the push-pop use of
 * cudaThreadExchangeStreamCaptureMode); without that call, in the thread's own mode as before. */
typedef struct {
    int switched;                           /* the thread is in relaxed mode until cdl_capture_mode_leave */
    enum cudaStreamCaptureMode previous;    /* the mode it is put back in */
} cdl_capture_mode_scope;
/* Switches the calling thread to relaxed capture mode (a no-op without cudaThreadExchangeStreamCaptureMode). */
void cdl_capture_mode_relax(const cdl_cudart *rt, cdl_capture_mode_scope *scope);
/* Puts the thread's own mode back. */
void cdl_capture_mode_leave(const cdl_cudart *rt, cdl_capture_mode_scope *scope);

/* Makes device's primary context current. 0, or nonzero with scope->failed_* set (nothing switched). */
int cdl_device_enter(const cdl_cudart *rt, int device, cdl_device_scope *scope);
/* Makes context current (driver calls required). Same contract. */
int cdl_context_enter(const cdl_cudart *rt, void *context, cdl_device_scope *scope);
/* Puts the caller's context back; 0, or nonzero with scope->failed_* set. */
int cdl_device_leave(const cdl_cudart *rt, cdl_device_scope *scope);
/* Raises CudaError for the scope's failed call. Returns -1. */
int cdl_raise_scope_error(const cdl_device_scope *scope);
/* Raises CudaError for a call not made because CUDA would refuse it during a graph capture, with the code
 * it would give and why (a printf-style format for PyUnicode_FromFormat). Returns -1. */
int cdl_raise_capture_error(const char *call, int code, const char *format, ...);
/* Raises CudaError for a failed driver call (a CUresult). Returns -1. */
int cdl_raise_driver_error(const char *call, int code);
/* The name of an error code of the call's API ("cudaError..." or "CUDA_ERROR_..."). */
const char *cdl_error_name(const cdl_cudart *rt, int code, int in_driver);

#endif
