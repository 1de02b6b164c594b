/* cai_dlpack C API: accept any GPU (or host) array in a C or C++ extension without a Python round trip.
 *
 *   #include <cai_dlpack/cai_dlpack.h>       // include path: Python's and cai_dlpack.get_include(); the DLPack
 *                                            // types come with it (dlpack_abi.h; see there for mixing it
 *                                            // with an upstream dlpack/dlpack.h, in either order)
 *   const cai_dlpack_api *api = cai_dlpack_import();   // once, e.g. in your module init; NULL + exception
 *   DLTensor t; int64_t shape[CAI_DLPACK_MAX_NDIM], strides[CAI_DLPACK_MAX_NDIM];
 *   if (api->fill_tensor(obj, stream, &t, shape, strides, CAI_DLPACK_MAX_NDIM, NULL) < 0) return NULL;
 *   launch_kernel(t.data, ...);
 *
 * Every call returns 0 (or a pointer), or -1 (or NULL) with a Python exception set, and must be made
 * with the GIL held (on a free-threaded build: from a thread attached to the interpreter, as any C API
 * call). Stream values follow the array API: 1 is the legacy default stream, 2 the
 * per-thread default stream, any other positive value a cudaStream_t, -1 "no ordering, the caller takes
 * care of it". When the producer names a stream (the CAI 'stream' entry), cai_dlpack orders it before
 * the consumer stream on the device (an event, the host never waits).
 *
 * Free-threaded CPython (3.13t, 3.14t): every call of this table may be made from many threads at once,
 * and cai_dlpack's own module runs without the GIL. Your module must say so too, or importing it turns
 * the GIL back on for the whole process (with a RuntimeWarning). Single-phase init (PyModule_Create):
 *       PyObject *m = PyModule_Create(&def);
 *   #ifdef Py_GIL_DISABLED
 *       if (m != NULL && PyUnstable_Module_SetGIL(m, Py_MOD_GIL_NOT_USED) < 0) { Py_DECREF(m); return NULL; }
 *   #endif
 * Multi-phase init (PyModuleDef_Init): a {Py_mod_gil, Py_MOD_GIL_NOT_USED} slot, under
 * #if PY_VERSION_HEX >= 0x030D0000 (3.13 added it). Only declare it once your own code is safe without the
 * GIL; tests/c_api_example/example.c shows the single-phase form. */
#ifndef CAI_DLPACK_H
#define CAI_DLPACK_H

#include <Python.h>
#include "dlpack_abi.h"
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The API's version: a new major breaks callers, a new minor only appends members. */
#define CAI_DLPACK_API_MAJOR 1
#define CAI_DLPACK_API_MINOR 0
/* The most dimensions cai_dlpack accepts. */
#define CAI_DLPACK_MAX_NDIM 64

/* Copies: neither this table nor the DLPack C exchange API that DLPackShim and DLPackView publish makes one.
 * Both only share memory; the exchange API's managed_tensor_allocator makes an empty tensor and leaves the
 * filling to its caller. A consumer that wants a private copy asks __dlpack__(copy=True), or
 * __dlpack__(dl_device=(kDLCPU, 0)) for a host copy, from Python (the README's table). */
typedef struct cai_dlpack_api {
    /* CAI_DLPACK_API_MAJOR and _MINOR of the loaded module. */
    uint32_t major;
    uint32_t minor;

    /* obj (an object with __cuda_array_interface__ or __array_interface__, a __dlpack__ producer, a
     * DLPackShim or a DLPackView) -> a new owning tensor, its data ready on consumer_stream. The caller
     * owns *out and calls its deleter exactly once (from any thread, with or without the GIL). Ordered
     * release: the deleter does not wait, and what keeps the memory alive is released only once the work
     * queued on consumer_stream by the time of the deleter has run (an event recorded there; none for -1,
     * none on a capturing stream: memory a graph uses must outlive the graph, and none on a cudaStream_t
     * unless the module's option trust_streams was on at this call: the stream may be destroyed by the
     * deleter's time, and a call on a destroyed stream may crash). A bare interface dict is
     * refused (TypeError): it does not keep its memory alive; pass the object that does. On failure *out is
     * NULL. */
    int (*to_managed_tensor)(PyObject *obj, int64_t consumer_stream, DLManagedTensorVersioned **out);

    /* obj (CAI, array interface, DLPackShim or DLPackView) -> *out describes its data, shape and strides
     * written to the caller's arrays of capacity entries. No allocation, no Python object kept: *out is
     * borrowed and valid while obj lives and its interface is unchanged. *read_only (may be NULL) says
     * whether the producer marked the data read-only. */
    int (*fill_tensor)(PyObject *obj, int64_t consumer_stream, DLTensor *out, int64_t *shape, int64_t *strides,
                       int capacity, int *read_only);

    /* An owning tensor -> a new DLPackView exposing __cuda_array_interface__ / __array_interface__,
     * whose data is ready on stream (its exported CAI 'stream'; -1: none; 1, 2 or a cudaStream_t; 0 and
     * other negative values are refused with ValueError). Steals managed on every path: on failure (a bad
     * stream, a tensor the view cannot describe, no memory) its deleter has already run when this returns,
     * and the caller must not touch it again. A NULL managed raises ValueError. Ordered release: when the
     * view dies, managed's deleter is called once the work queued on stream by then has run (not for -1,
     * nor for a cudaStream_t unless trust_streams was on at this call). */
    PyObject *(*view_from_managed_tensor)(DLManagedTensorVersioned *managed, int64_t stream);
} cai_dlpack_api;

/* The name of the PyCapsule, module attribute cai_dlpack._C_API, that holds the table. */
#define CAI_DLPACK_API_CAPSULE "cai_dlpack._C_API"

/* Imports cai_dlpack and returns its API table (cached after the first call), or NULL with ImportError
 * set when the module is missing or its major version differs from this header's. */
static inline const cai_dlpack_api *cai_dlpack_import(void)
{
    static const cai_dlpack_api *api = NULL;
    if (api != NULL)
        return api;
    const cai_dlpack_api *found = (const cai_dlpack_api *)PyCapsule_Import(CAI_DLPACK_API_CAPSULE, 0);
    if (found == NULL)
        return NULL;
    if (found->major != CAI_DLPACK_API_MAJOR) {
        PyErr_Format(PyExc_ImportError, "cai_dlpack C API version %u.%u; this extension was built for %d.x",
                     (unsigned)found->major, (unsigned)found->minor, CAI_DLPACK_API_MAJOR);
        return NULL;
    }
    api = found;
    return api;
}

#ifdef __cplusplus
}
#endif

#endif
