/* The DLPack ABI that cai_dlpack speaks (DLPack 1.4: versioned managed tensors and the C exchange API),
 * declared here so that neither cai_dlpack's build nor an extension including cai_dlpack.h needs another
 * package for dlpack/dlpack.h. Written from the DLPack specification's layouts and values; a test
 * (tests/cpu/test_dlpack_abi.py) compares every size, field offset, enum value and version macro with an
 * upstream dlpack.h wherever one is installed, and 1.4's additions and layout with DLPack 1.4's values, which
 * it records (no installable package ships a 1.4 dlpack.h yet).
 *
 * Together with an upstream dlpack/dlpack.h, in either order:
 *   - upstream first: its declarations are used (it must be DLPack 1.2 or newer, which this header checks),
 *     and nothing is declared twice;
 *   - this header first: it defines upstream's include guard DLPACK_DLPACK_H_, so a later
 *     #include <dlpack/dlpack.h> adds nothing, and every name means the same layout as upstream's.
 *     To see a newer upstream header's additions, include it first, or define CAI_DLPACK_UPSTREAM_DLPACK
 *     (then this header includes <dlpack/dlpack.h> from your include path instead of declaring anything). */
#ifndef CAI_DLPACK_DLPACK_ABI_H
#define CAI_DLPACK_DLPACK_ABI_H

#if !defined(DLPACK_DLPACK_H_) && defined(CAI_DLPACK_UPSTREAM_DLPACK)
#include <dlpack/dlpack.h>
#endif

#ifdef DLPACK_DLPACK_H_
/* An upstream dlpack.h is in use: it must declare what cai_dlpack's API uses. */
#if !defined(DLPACK_MAJOR_VERSION) || DLPACK_MAJOR_VERSION != 1 || DLPACK_MINOR_VERSION < 2
#error "cai_dlpack needs dlpack/dlpack.h of DLPack 1.2 or newer (1.x): DLManagedTensorVersioned and DLPackExchangeAPI"
#endif
#else
#define DLPACK_DLPACK_H_ /* upstream's include guard: a later #include <dlpack/dlpack.h> adds nothing */
#define CAI_DLPACK_OWN_DLPACK_DECLARATIONS 1

#include <stddef.h>
#include <stdint.h>

#define DLPACK_MAJOR_VERSION 1
#define DLPACK_MINOR_VERSION 4

/* Kept for code written against upstream's header, which marks its declarations with them. */
#ifndef DLPACK_EXTERN_C
#ifdef __cplusplus
#define DLPACK_EXTERN_C extern "C"
#else
#define DLPACK_EXTERN_C
#endif
#endif
#ifndef DLPACK_DLL
#define DLPACK_DLL
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* A version of the ABI: a new major breaks readers, a new minor only adds. */
typedef struct {
    uint32_t major;
    uint32_t minor;
} DLPackVersion;

/* Where the data lives. The values are fixed by the specification. */
#ifdef __cplusplus
typedef enum : int32_t {
#else
typedef enum {
#endif
    kDLCPU = 1,
    kDLCUDA = 2,           /* device memory of a CUDA GPU */
    kDLCUDAHost = 3,       /* page-locked host memory from cudaMallocHost */
    kDLOpenCL = 4,
    kDLVulkan = 7,
    kDLMetal = 8,
    kDLVPI = 9,
    kDLROCM = 10,
    kDLROCMHost = 11,
    kDLExtDev = 12,
    kDLCUDAManaged = 13,   /* unified memory from cudaMallocManaged */
    kDLOneAPI = 14,
    kDLWebGPU = 15,
    kDLHexagon = 16,
    kDLMAIA = 17,
    kDLTrn = 18,
    kDLTPU = 19,           /* DLPack 1.4: Google TPU memory */
    kDLTPUHost = 20,       /* DLPack 1.4: host memory pinned for a TPU */
    kDLAscend = 21,        /* DLPack 1.4: Huawei Ascend NPU memory */
} DLDeviceType;

/* A device: its kind and its ordinal among devices of that kind. */
typedef struct {
    DLDeviceType device_type;
    int32_t device_id;
} DLDevice;

/* The kind of number an element holds; DLDataType.code carries it in one byte. */
typedef enum {
    kDLInt = 0U,
    kDLUInt = 1U,
    kDLFloat = 2U,
    kDLOpaqueHandle = 3U,
    kDLBfloat = 4U,
    kDLComplex = 5U,
    kDLBool = 6U,
    kDLFloat8_e3m4 = 7U,
    kDLFloat8_e4m3 = 8U,
    kDLFloat8_e4m3b11fnuz = 9U,
    kDLFloat8_e4m3fn = 10U,
    kDLFloat8_e4m3fnuz = 11U,
    kDLFloat8_e5m2 = 12U,
    kDLFloat8_e5m2fnuz = 13U,
    kDLFloat8_e8m0fnu = 14U,
    kDLFloat6_e2m3fn = 15U,
    kDLFloat6_e3m2fn = 16U,
    kDLFloat4_e2m1fn = 17U,
    kDLBcomplex = 18U,     /* DLPack 1.4: complex of two bfloat16 (bits 32) */
} DLDataTypeCode;

/* An element type: a DLDataTypeCode, the bits of one lane, and the lanes of a vector element (1 for scalars). */
typedef struct {
    uint8_t code;
    uint8_t bits;
    uint16_t lanes;
} DLDataType;

/* A strided view of memory. shape and strides (in elements, NULL meaning C-contiguous) have ndim entries;
 * the first element is at (char *)data + byte_offset. */
typedef struct {
    void *data;
    DLDevice device;
    int32_t ndim;
    DLDataType dtype;
    int64_t *shape;
    int64_t *strides;
    uint64_t byte_offset;
} DLTensor;

/* The unversioned owning tensor (DLPack before 1.0, still the 'dltensor' capsule): whoever consumes it
 * calls deleter(self) once, which may be NULL. */
typedef struct DLManagedTensor {
    DLTensor dl_tensor;
    void *manager_ctx;
    void (*deleter)(struct DLManagedTensor *self);
} DLManagedTensor;

/* DLManagedTensorVersioned.flags bits. */
#define DLPACK_FLAG_BITMASK_READ_ONLY (1UL << 0UL)               /* the consumer must not write the data */
#define DLPACK_FLAG_BITMASK_IS_COPIED (1UL << 1UL)               /* the data is a copy made for the consumer */
#define DLPACK_FLAG_BITMASK_IS_SUBBYTE_TYPE_PADDED (1UL << 2UL)  /* each sub-byte element padded to a byte */

/* The versioned owning tensor ('dltensor_versioned' capsule): version first, so a reader can check it
 * before touching the rest; deleter(self) is called once by the consumer and may be NULL. */
typedef struct DLManagedTensorVersioned {
    DLPackVersion version;
    void *manager_ctx;
    void (*deleter)(struct DLManagedTensorVersioned *self);
    uint64_t flags;
    DLTensor dl_tensor;
} DLManagedTensorVersioned;

/* The C exchange API (DLPack 1.2): a table of functions a framework publishes so another can exchange
 * tensors without Python calls. Each returns 0, or -1 with a Python exception set (the allocator reports
 * through SetError instead). */
typedef int (*DLPackManagedTensorAllocator)(DLTensor *prototype, DLManagedTensorVersioned **out, void *error_ctx,
                                            void (*SetError)(void *error_ctx, const char *kind, const char *message));
typedef int (*DLPackManagedTensorFromPyObjectNoSync)(void *py_object, DLManagedTensorVersioned **out);
typedef int (*DLPackDLTensorFromPyObjectNoSync)(void *py_object, DLTensor *out);
typedef int (*DLPackCurrentWorkStream)(DLDeviceType device_type, int32_t device_id, void **out_current_stream);
typedef int (*DLPackManagedTensorToPyObjectNoSync)(DLManagedTensorVersioned *tensor, void **out_py_object);

/* The first member of every version of the table: its version, and a table of an older version (or NULL). */
typedef struct DLPackExchangeAPIHeader {
    DLPackVersion version;
    struct DLPackExchangeAPIHeader *prev_api;
} DLPackExchangeAPIHeader;

typedef struct DLPackExchangeAPI {
    DLPackExchangeAPIHeader header;
    DLPackManagedTensorAllocator managed_tensor_allocator;
    DLPackManagedTensorFromPyObjectNoSync managed_tensor_from_py_object_no_sync;
    DLPackManagedTensorToPyObjectNoSync managed_tensor_to_py_object_no_sync;
    DLPackDLTensorFromPyObjectNoSync dltensor_from_py_object_no_sync;
    DLPackCurrentWorkStream current_work_stream;
} DLPackExchangeAPI;

#ifdef __cplusplus
}
#endif

#endif /* DLPACK_DLPACK_H_ */
#endif /* CAI_DLPACK_DLPACK_ABI_H */
