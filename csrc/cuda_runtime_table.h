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
    /* For tensors the DLPack exchange API asks us to allocate. */
    cudaError_t (*malloc)(void **, size_t);
    cudaError_t (*free)(void *);
    cudaError_t (*malloc_host)(void **, size_t);
    cudaError_t (*free_host)(void *);
    cudaError_t (*malloc_managed)(void **, size_t, unsigned int);
} cdl_cudart;

#endif
