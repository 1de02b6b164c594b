/* The CUDA runtime loader: libcudart is opened at run time (never linked), so the module imports
 * and its host paths work on machines with no CUDA at all. Also pointer -> DLDevice queries. */
#include "cdl_internal.h"
#include "cuda_runtime_table.h"

#include <dlfcn.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

/* Written once, under cdl_runtime_lock, before cdl_runtime_loaded is set; read-only from then on. */
static cdl_cudart cdl_runtime;
static int cdl_runtime_loaded;
static char cdl_runtime_path[1024];
static char cdl_runtime_file[1024]; /* the file the loader mapped for cdl_runtime_path */
static const char *cdl_runtime_source; /* how it was found: a string literal, for cuda_runtime_info */
static cdl_lock cdl_runtime_lock = CDL_LOCK_INITIALIZER;

/* Resolves every symbol of the table from handle. Returns the first missing name, or NULL. */
static const char *cdl_resolve_symbols(void *handle, cdl_cudart *table)
{
#define CDL_RESOLVE(field, symbol)                                                                  \
    do {                                                                                            \
        *(void **)(&table->field) = dlsym(handle, symbol);                                          \
        if (table->field == NULL)                                                                   \
            return symbol;                                                                          \
    } while (0)
    CDL_RESOLVE(get_error_name, "cudaGetErrorName");
    CDL_RESOLVE(get_error_string, "cudaGetErrorString");
    CDL_RESOLVE(get_last_error, "cudaGetLastError");
    CDL_RESOLVE(pointer_get_attributes, "cudaPointerGetAttributes");
    CDL_RESOLVE(get_device, "cudaGetDevice");
    CDL_RESOLVE(set_device, "cudaSetDevice");
    CDL_RESOLVE(get_device_count, "cudaGetDeviceCount");
    CDL_RESOLVE(runtime_get_version, "cudaRuntimeGetVersion");
    CDL_RESOLVE(driver_get_version, "cudaDriverGetVersion");
    CDL_RESOLVE(event_create_with_flags, "cudaEventCreateWithFlags");
    CDL_RESOLVE(event_destroy, "cudaEventDestroy");
    CDL_RESOLVE(event_record, "cudaEventRecord");
    CDL_RESOLVE(stream_wait_event, "cudaStreamWaitEvent");
    CDL_RESOLVE(malloc, "cudaMalloc");
    CDL_RESOLVE(free, "cudaFree");
    CDL_RESOLVE(malloc_host, "cudaMallocHost");
    CDL_RESOLVE(free_host, "cudaFreeHost");
    CDL_RESOLVE(malloc_managed, "cudaMallocManaged");
    CDL_RESOLVE(memcpy_async, "cudaMemcpyAsync");
    CDL_RESOLVE(memcpy_2d_async, "cudaMemcpy2DAsync");
    CDL_RESOLVE(stream_synchronize, "cudaStreamSynchronize");
    CDL_RESOLVE(device_get_attribute, "cudaDeviceGetAttribute");
#undef CDL_RESOLVE
    /* Optional: without it the allocator's calls are made in the thread's own capture mode. */
    *(void **)(&table->thread_exchange_stream_capture_mode) = dlsym(handle, "cudaThreadExchangeStreamCaptureMode");
    /* Optional: without them releases are not ordered after the consumer's stream (ordered_release.c). */
    *(void **)(&table->event_query) = dlsym(handle, "cudaEventQuery");
    *(void **)(&table->event_synchronize) = dlsym(handle, "cudaEventSynchronize");
    if (table->event_query == NULL || table->event_synchronize == NULL)
        table->event_query = NULL, table->event_synchronize = NULL;
    *(void **)(&table->launch_host_func) = dlsym(handle, "cudaLaunchHostFunc");
    *(void **)(&table->malloc_async) = dlsym(handle, "cudaMallocAsync");
    *(void **)(&table->free_async) = dlsym(handle, "cudaFreeAsync");
    if (table->malloc_async == NULL || table->free_async == NULL)
        table->malloc_async = NULL, table->free_async = NULL;
    return NULL;
}

/* The driver's calls, through the runtime's entry-point query (cudaGetDriverEntryPointByVersion since
 * 12.5, cudaGetDriverEntryPoint before): NULL for a symbol the driver lacks, and all of the context
 * calls NULL unless every one of them is there. The query needs a driver; without one it fails and
 * sets the runtime's last error, which is then cleared (only then: a pending error of another
 * framework's is not ours to clear). */
static void cdl_resolve_driver(void *handle, cdl_cudart *table)
{
    typedef cudaError_t (*by_version_fn)(const char *, void **, unsigned int, unsigned long long, int *);
    typedef cudaError_t (*unversioned_fn)(const char *, void **, unsigned long long, int *);
    by_version_fn by_version;
    unversioned_fn unversioned;
    *(void **)&by_version = dlsym(handle, "cudaGetDriverEntryPointByVersion");
    *(void **)&unversioned = dlsym(handle, "cudaGetDriverEntryPoint");
    struct {
        void **slot;
        const char *symbol;
    } wanted[] = {
        {(void **)&table->cu_ctx_get_current, "cuCtxGetCurrent"},
        {(void **)&table->cu_ctx_push_current, "cuCtxPushCurrent"},
        {(void **)&table->cu_ctx_pop_current, "cuCtxPopCurrent"},
        {(void **)&table->cu_device_get, "cuDeviceGet"},
        {(void **)&table->cu_primary_ctx_retain, "cuDevicePrimaryCtxRetain"},
        {(void **)&table->cu_primary_ctx_release, "cuDevicePrimaryCtxRelease"},
        {(void **)&table->cu_primary_ctx_get_state, "cuDevicePrimaryCtxGetState"},
        {(void **)&table->cu_stream_get_ctx, "cuStreamGetCtx"},
        {(void **)&table->cu_ctx_get_id, "cuCtxGetId"},
        {(void **)&table->cu_get_error_name, "cuGetErrorName"},
        {(void **)&table->cu_get_error_string, "cuGetErrorString"},
    };
    const size_t context_calls = 9; /* the first nine: all or none */
    int failed = 0;
    for (size_t i = 0; i < sizeof(wanted) / sizeof(wanted[0]); i++) {
        void *function = NULL;
        int found = 0;
        cudaError_t status = by_version   ? by_version(wanted[i].symbol, &function, 12000, 0, &found)
                             : unversioned ? unversioned(wanted[i].symbol, &function, 0, &found)
                                           : cudaSuccess;
        failed |= status != cudaSuccess;
        int usable = status == cudaSuccess && found == 0 /* cudaDriverEntryPointSuccess */ && function != NULL;
        *wanted[i].slot = usable ? function : NULL;
    }
    for (size_t i = 0; i < context_calls; i++) {
        if (*wanted[i].slot == NULL) {
            for (size_t j = 0; j < context_calls; j++)
                *wanted[j].slot = NULL;
            break;
        }
    }
    if (failed)
        (void)table->get_last_error();
}

/* Tries one path; on success fills the table and returns 1. Appends what happened to tried, except
 * for a probe of what is already loaded (loaded_only) that finds nothing. source says how path was
 * found ("CAI_DLPACK_CUDART", "preloaded", "loader", "pip wheel"), for cuda_runtime_info. */
static int cdl_try_open(const char *path, const char *source, int loaded_only, char *tried, size_t tried_size)
{
    size_t used = strlen(tried);
    void *handle = dlopen(path, RTLD_NOW | RTLD_LOCAL | (loaded_only ? RTLD_NOLOAD : 0));
    if (handle == NULL && loaded_only)
        return 0;
    if (handle == NULL) {
        /* Only a path (not a bare soname) that exists says more than "not found". */
        const char *why = strchr(path, '/') ? dlerror() : NULL;
        snprintf(tried + used, tried_size - used, "%s%s%s%s%s", used ? ", " : "", path, why ? " (" : "",
                 why ? why : "", why ? ")" : "");
        return 0;
    }
    cdl_cudart table;
    const char *missing = cdl_resolve_symbols(handle, &table);
    if (missing != NULL) {
        snprintf(tried + used, tried_size - used, "%s%s (lacks %s)", used ? ", " : "", path, missing);
        dlclose(handle);
        return 0;
    }
    /* A runtime newer than the driver answers every call with cudaErrorInsufficientDriver: take an
     * older runtime instead. A driver version of 0 means no driver; that error comes at first use. */
    int runtime_version = 0, driver_version = 0;
    if (table.runtime_get_version(&runtime_version) == cudaSuccess &&
        table.driver_get_version(&driver_version) == cudaSuccess && driver_version > 0 &&
        driver_version / 1000 < runtime_version / 1000) {
        snprintf(tried + used, tried_size - used, "%s%s (runtime %d.%d needs a newer driver than this CUDA %d.%d one)",
                 used ? ", " : "", path, runtime_version / 1000, runtime_version % 1000 / 10, driver_version / 1000,
                 driver_version % 1000 / 10);
        dlclose(handle);
        return 0;
    }
    /* The capture query of this runtime's signature (see the table); a runtime of 12.0 or newer has it. */
    const int capture_query_13 = runtime_version >= 13000;
    const char *capture_query = capture_query_13 ? "cudaStreamGetCaptureInfo" : "cudaStreamGetCaptureInfo_v2";
    void *capture_function = dlsym(handle, capture_query);
    if (capture_function == NULL) {
        snprintf(tried + used, tried_size - used, "%s%s (lacks %s)", used ? ", " : "", path, capture_query);
        dlclose(handle);
        return 0;
    }
    *(void **)(capture_query_13 ? (void *)&table.stream_get_capture_info_13 : (void *)&table.stream_get_capture_info_12) =
        capture_function;
    if (capture_query_13)
        table.stream_get_capture_info_12 = NULL;
    else
        table.stream_get_capture_info_13 = NULL;
    cdl_resolve_driver(handle, &table);
    /* Published once, with release order: a thread without the GIL (a deleter, the exchange allocator)
     * that sees the flag sees the table. Another thread's search may have published first (the GIL
     * does not keep two searches apart on a free-threaded build, nor across the wheels' import): then
     * its runtime is the one in use, and this handle is closed. */
    cdl_lock_acquire(&cdl_runtime_lock);
    const int first = !cdl_runtime_loaded;
    if (first) {
        cdl_runtime = table;
        snprintf(cdl_runtime_path, sizeof(cdl_runtime_path), "%s", path);
        /* A bare soname says nothing of which copy the loader chose: the file holding a symbol does. */
        Dl_info where;
        void *symbol = dlsym(handle, "cudaRuntimeGetVersion");
        snprintf(cdl_runtime_file, sizeof(cdl_runtime_file), "%s",
                 symbol && dladdr(symbol, &where) && where.dli_fname ? where.dli_fname : path);
        cdl_runtime_source = source;
        __atomic_store_n(&cdl_runtime_loaded, 1, __ATOMIC_RELEASE);
    }
    cdl_lock_release(&cdl_runtime_lock);
    if (!first)
        dlclose(handle);
    return 1;
}

/* Appends the libcudart copies inside installed NVIDIA wheels (the 'nvidia' namespace package). */
static int cdl_try_wheels(char *tried, size_t tried_size)
{
    static const char *const wheel_libraries[] = {"cu13/lib/libcudart.so.13", "cuda_runtime/lib/libcudart.so.12"};
    PyObject *nvidia = PyImport_ImportModule("nvidia");
    if (nvidia == NULL) {
        PyErr_Clear();
        return 0;
    }
    PyObject *paths = PyObject_GetAttrString(nvidia, "__path__");
    Py_DECREF(nvidia);
    PyObject *list = paths ? PySequence_List(paths) : NULL;
    Py_XDECREF(paths);
    if (list == NULL) {
        PyErr_Clear();
        return 0;
    }
    int found = 0;
    for (Py_ssize_t i = 0; !found && i < PyList_GET_SIZE(list); i++) {
        const char *folder = PyUnicode_Check(PyList_GET_ITEM(list, i)) ? PyUnicode_AsUTF8(PyList_GET_ITEM(list, i)) : NULL;
        if (folder == NULL) {
            PyErr_Clear();
            continue;
        }
        for (size_t j = 0; !found && j < sizeof(wheel_libraries) / sizeof(wheel_libraries[0]); j++) {
            char path[1024];
            snprintf(path, sizeof(path), "%s/%s", folder, wheel_libraries[j]);
            found = cdl_try_open(path, "pip wheel", 0, tried, tried_size);
        }
    }
    Py_DECREF(list);
    return found;
}

static int cdl_is_loaded(void) { return __atomic_load_n(&cdl_runtime_loaded, __ATOMIC_ACQUIRE); }

const cdl_cudart *cdl_cudart_loaded(void) { return cdl_is_loaded() ? &cdl_runtime : NULL; }

const cdl_cudart *cdl_cudart_get_any_thread(void)
{
    if (cdl_is_loaded())
        return &cdl_runtime;
    if (!Py_IsInitialized() || cdl_interpreter_finalizing())
        return NULL;
    PyGILState_STATE state = PyGILState_Ensure();
    cdl_pending_error pending;
    cdl_error_stash(&pending);
    const cdl_cudart *rt = cdl_cudart_get();
    PyErr_Clear(); /* the caller reports a missing runtime in its own way */
    cdl_error_unstash(&pending);
    PyGILState_Release(state);
    return rt;
}

/* cdl_cudart_get's search: out of line, so that callers which inline cdl_cudart_get take only its first test. */
static __attribute__((noinline)) const cdl_cudart *cdl_cudart_search(void);

const cdl_cudart *cdl_cudart_get(void)
{
    return cdl_is_loaded() ? &cdl_runtime : cdl_cudart_search();
}

static const cdl_cudart *cdl_cudart_search(void)
{
    char tried[4096] = "";
    const char *named = getenv("CAI_DLPACK_CUDART");
    if (named != NULL && named[0] != '\0') {
        /* A runtime the user names is the only one tried: a silent fallback would hide the mistake. */
        if (cdl_try_open(named, "CAI_DLPACK_CUDART", 0, tried, sizeof(tried)))
            return &cdl_runtime;
        PyErr_Format(PyExc_RuntimeError, "CAI_DLPACK_CUDART names a CUDA runtime that could not be loaded: %s",
                     tried);
        return NULL;
    }
    /* First a runtime the process has loaded already (PyTorch's, CuPy's): one runtime instance, one
     * last-error state, one view of the current device. Then the loader's search, newest first. */
    static const int majors[] = {CDL_CUDART_HEADER_MAJOR, 13, 12};
    int refused_loaded[sizeof(majors) / sizeof(majors[0])] = {0};
    for (int loaded_only = 1; loaded_only >= 0; loaded_only--) {
        for (size_t i = 0; i < sizeof(majors) / sizeof(majors[0]); i++) {
            if ((i > 0 && majors[i] == CDL_CUDART_HEADER_MAJOR) || (!loaded_only && refused_loaded[i]))
                continue; /* a soname the first pass found loaded and refused is the same library now */
            char soname[64];
            snprintf(soname, sizeof(soname), "libcudart.so.%d", majors[i]);
            size_t used = strlen(tried);
            if (cdl_try_open(soname, loaded_only ? "preloaded" : "loader", loaded_only, tried, sizeof(tried)))
                return &cdl_runtime;
            refused_loaded[i] = loaded_only && strlen(tried) > used;
        }
    }
    if (cdl_try_wheels(tried, sizeof(tried)) || cdl_is_loaded()) /* or another thread's search found one */
        return &cdl_runtime;
    PyErr_Format(PyExc_RuntimeError,
                 "no CUDA runtime found (tried %s); install a CUDA driver and runtime, e.g. "
                 "'pip install nvidia-cuda-runtime', or set CAI_DLPACK_CUDART to the path of libcudart.so",
                 tried);
    return NULL;
}

PyObject *cdl_CudaError;

int cdl_cuda_errors_init(void)
{
    cdl_CudaError = PyErr_NewExceptionWithDoc(
        "cai_dlpack.CudaError",
        "A CUDA runtime call failed. Attributes: call (the function), code, name (the runtime's error name).",
        PyExc_RuntimeError, NULL);
    return cdl_CudaError ? 0 : -1;
}

cudaError_t cdl_stream_capture_info(const cdl_cudart *rt, cudaStream_t stream, enum cudaStreamCaptureStatus *status,
                                    unsigned long long *id)
{
    *id = 0;
    /* Only status and id are asked for: every other output stays NULL, as both signatures allow. */
    if (rt->stream_get_capture_info_13 != NULL)
        return rt->stream_get_capture_info_13(stream, status, id, NULL, NULL, NULL, NULL);
    return rt->stream_get_capture_info_12(stream, status, id, NULL, NULL, NULL);
}

/* error.NAME = text, for the attributes a CudaError carries. Returns 0 or -1. */
static int cdl_set_text_attribute(PyObject *error, const char *name, const char *text)
{
    PyObject *value = PyUnicode_FromString(text);
    int result = value ? PyObject_SetAttrString(error, name, value) : -1;
    Py_XDECREF(value);
    return result;
}

const char *cdl_error_name(const cdl_cudart *rt, int code, int in_driver)
{
    const char *name = NULL;
    if (in_driver) {
        if (rt->cu_get_error_name == NULL || rt->cu_get_error_name(code, &name) != 0)
            name = NULL;
    }
    else if (rt->get_error_name) {
        name = rt->get_error_name((cudaError_t)code);
    }
    return name ? name : "unknown error";
}

/* CudaError(message) with attributes code, call and name; message is stolen. Returns -1. */
static int cdl_raise_message(const char *call, int code, const char *name, PyObject *message)
{
    if (message == NULL)
        return -1;
    PyObject *error = PyObject_CallOneArg(cdl_CudaError, message);
    Py_DECREF(message);
    if (error == NULL)
        return -1;
    PyObject *code_value = PyLong_FromLong(code);
    if (code_value != NULL && PyObject_SetAttrString(error, "code", code_value) == 0 &&
        cdl_set_text_attribute(error, "call", call) == 0 && cdl_set_text_attribute(error, "name", name) == 0)
        PyErr_SetObject(cdl_CudaError, error);
    Py_XDECREF(code_value);
    Py_DECREF(error);
    return -1;
}

static int cdl_raise(const char *call, int code, const char *name, const char *text)
{
    return cdl_raise_message(call, code, name, PyUnicode_FromFormat("%s failed: %s (%s)", call, name, text));
}

int cdl_raise_capture_error(const char *call, int code, const char *format, ...)
{
    va_list arguments;
    va_start(arguments, format);
    PyObject *why = PyUnicode_FromFormatV(format, arguments);
    va_end(arguments);
    if (why == NULL)
        return -1;
    const char *name = cdl_error_name(&cdl_runtime, code, 0);
    PyObject *message = PyUnicode_FromFormat("%s not called: it would fail with %s and break a CUDA graph capture: %U",
                                             call, name, why);
    Py_DECREF(why);
    return cdl_raise_message(call, code, name, message);
}

int cdl_raise_cuda_error(const char *call, int code)
{
    const char *name = cdl_error_name(&cdl_runtime, code, 0);
    const char *text = cdl_runtime.get_error_string ? cdl_runtime.get_error_string((cudaError_t)code) : NULL;
    /* A failed call leaves the runtime's last error set; clear it so the next framework to check
     * it does not blame its own kernel. */
    if (cdl_runtime.get_last_error)
        (void)cdl_runtime.get_last_error();
    return cdl_raise(call, code, name, text ? text : "no description");
}

int cdl_raise_driver_error(const char *call, int code)
{
    const char *text = NULL;
    if (cdl_runtime.cu_get_error_string == NULL || cdl_runtime.cu_get_error_string(code, &text) != 0)
        text = NULL;
    return cdl_raise(call, code, cdl_error_name(&cdl_runtime, code, 1), text ? text : "no description");
}

int cdl_raise_scope_error(const cdl_device_scope *scope)
{
    return scope->failed_in_driver ? cdl_raise_driver_error(scope->failed_call, scope->failed_code)
                                   : cdl_raise_cuda_error(scope->failed_call, scope->failed_code);
}

/* ---- the current device, switched and put back ------------------------------------------------- */

/* Notes a scope's failed call. A runtime call's failure is taken off the runtime's last error here, not only where
 * it is raised (cdl_raise_scope_error): a release or a free that cannot enter its scope goes on without raising,
 * and must not leave its error for the next framework to find. Driver calls set no runtime error. */
static int cdl_scope_failed(cdl_device_scope *scope, const char *call, int code, int in_driver)
{
    if (!in_driver && cdl_runtime.get_last_error != NULL)
        (void)cdl_runtime.get_last_error();
    scope->failed_call = call;
    scope->failed_code = code;
    scope->failed_in_driver = in_driver;
    return code;
}

/* The context current now: NULL when there is none, including before the driver is initialized
 * (CUDA_ERROR_NOT_INITIALIZED, 3). Returns 0 or the driver's error. */
static int cdl_current_context(const cdl_cudart *rt, void **context)
{
    *context = NULL;
    int code = rt->cu_ctx_get_current(context);
    if (code == 3)
        *context = NULL;
    return code == 3 ? 0 : code;
}

/* Starts a scope with nothing switched, and reads the caller's device and, with the driver's calls,
 * its context. The runtime first: it initializes the driver on first use; without a current context
 * cudaGetDevice answers the runtime's device setting and creates nothing. 0 or the failure. */
static int cdl_scope_start(const cdl_cudart *rt, cdl_device_scope *scope, void **current)
{
    scope->switched = 0;
    scope->retained = -1;
    scope->previous_device = -1;
    scope->context = NULL;
    *current = NULL;
    int code = rt->get_device(&scope->previous_device);
    if (code != cudaSuccess)
        return cdl_scope_failed(scope, "cudaGetDevice", code, 0);
    if (rt->cu_ctx_push_current != NULL && (code = cdl_current_context(rt, current)) != 0)
        return cdl_scope_failed(scope, "cuCtxGetCurrent", code, 1);
    return 0;
}

int cdl_device_enter(const cdl_cudart *rt, int device, cdl_device_scope *scope)
{
    void *current;
    int code = cdl_scope_start(rt, scope, &current);
    if (code != 0)
        return code;
    if (rt->cu_ctx_push_current == NULL) {
        if (scope->previous_device == device)
            return 0;
        if ((code = rt->set_device(device)) != cudaSuccess)
            return cdl_scope_failed(scope, "cudaSetDevice", code, 0);
        scope->switched = 1;
        return 0;
    }
    if (current != NULL && scope->previous_device == device) {
        scope->context = current;
        return 0;
    }
    int handle, active = 0;
    unsigned flags;
    if ((code = rt->cu_device_get(&handle, device)) != 0)
        return cdl_scope_failed(scope, "cuDeviceGet", code, 1);
    if ((code = rt->cu_primary_ctx_get_state(handle, &flags, &active)) != 0)
        return cdl_scope_failed(scope, "cuDevicePrimaryCtxGetState", code, 1);
    void *primary;
    if ((code = rt->cu_primary_ctx_retain(&primary, handle)) != 0)
        return cdl_scope_failed(scope, "cuDevicePrimaryCtxRetain", code, 1);
    if ((code = rt->cu_ctx_push_current(primary)) != 0) {
        (void)rt->cu_primary_ctx_release(handle); /* nothing was made in it */
        return cdl_scope_failed(scope, "cuCtxPushCurrent", code, 1);
    }
    /* A primary context nobody held (we just made it) stays retained, as the runtime keeps the ones
     * it makes: releasing it would destroy it, with any memory or event made in it. */
    scope->retained = active ? handle : -1;
    scope->switched = 1;
    scope->context = primary;
    return 0;
}

int cdl_context_enter(const cdl_cudart *rt, void *context, cdl_device_scope *scope)
{
    void *current;
    int code = cdl_scope_start(rt, scope, &current);
    if (code != 0)
        return code;
    scope->context = context;
    if (current == context)
        return 0;
    if ((code = rt->cu_ctx_push_current(context)) != 0)
        return cdl_scope_failed(scope, "cuCtxPushCurrent", code, 1);
    scope->switched = 1;
    return 0;
}

int cdl_device_leave(const cdl_cudart *rt, cdl_device_scope *scope)
{
    if (!scope->switched)
        return 0;
    scope->switched = 0;
    int code;
    if (rt->cu_ctx_push_current == NULL) {
        if ((code = rt->set_device(scope->previous_device)) != cudaSuccess)
            return cdl_scope_failed(scope, "cudaSetDevice", code, 0);
        return 0;
    }
    void *popped;
    code = rt->cu_ctx_pop_current(&popped);
    int released = scope->retained >= 0 ? rt->cu_primary_ctx_release(scope->retained) : 0;
    scope->retained = -1;
    if (code != 0)
        return cdl_scope_failed(scope, "cuCtxPopCurrent", code, 1);
    if (released != 0)
        return cdl_scope_failed(scope, "cuDevicePrimaryCtxRelease", released, 1);
    return 0;
}

int cdl_device_of_pointer(const void *ptr, DLDevice *device, int32_t *home)
{
    const cdl_cudart *rt = cdl_cudart_get();
    if (rt == NULL)
        return -1;
    if (ptr == NULL) {
        /* A zero-size array has no memory to ask about: it lives on the current device. */
        int current;
        cudaError_t status = rt->get_device(&current);
        if (status != cudaSuccess)
            return cdl_raise_cuda_error("cudaGetDevice", status);
        device->device_type = kDLCUDA;
        device->device_id = *home = current;
        return 0;
    }
    /* The struct grew in CUDA 13 (reserved words) and the runtime loaded may be newer than the headers
     * built against: give it room to spare. The struct we read is zeroed, as its reserved words must be; the
     * room past it is only ever written (by a newer runtime) and never read, so it is left as it is. */
    union {
        struct cudaPointerAttributes attributes;
        unsigned char room[256];
    } answer;
    _Static_assert(sizeof(struct cudaPointerAttributes) <= sizeof(answer.room), "cudaPointerAttributes grew");
    memset(&answer.attributes, 0, sizeof(answer.attributes));
    struct cudaPointerAttributes *const attributes_of = &answer.attributes;
    cudaError_t status = rt->pointer_get_attributes(attributes_of, ptr);
    if (status != cudaSuccess)
        return cdl_raise_cuda_error("cudaPointerGetAttributes", status);
    const struct cudaPointerAttributes attributes = *attributes_of;
    switch (attributes.type) {
    case cudaMemoryTypeDevice:
        device->device_type = kDLCUDA;
        break;
    case cudaMemoryTypeManaged:
        device->device_type = kDLCUDAManaged;
        break;
    case cudaMemoryTypeHost:
        device->device_type = kDLCUDAHost;
        break;
    default:
        PyErr_Format(PyExc_BufferError,
                     "__cuda_array_interface__ 'data' pointer %p is not memory the CUDA runtime knows "
                     "(cudaMemoryTypeUnregistered)", ptr);
        return -1;
    }
    *home = attributes.device < 0 ? 0 : attributes.device;
    device->device_id = device->device_type == kDLCUDA ? *home : 0;
    return 0;
}

PyObject *cdl_cuda_runtime_info(PyObject *module, PyObject *unused)
{
    (void)module;
    (void)unused;
    const cdl_cudart *rt = cdl_cudart_get();
    if (rt == NULL)
        return NULL;
    int version = 0, count = 0;
    cudaError_t status = rt->runtime_get_version(&version);
    if (status != cudaSuccess)
        return cdl_raise_cuda_error("cudaRuntimeGetVersion", status), NULL;
    status = rt->get_device_count(&count);
    if (status != cudaSuccess) {
        /* No driver or no GPU is an answer here, not an error. */
        (void)rt->get_last_error();
        count = 0;
    }
    return Py_BuildValue("{s:s, s:s, s:s, s:i, s:i}", "path", cdl_runtime_path, "file", cdl_runtime_file, "source",
                         cdl_runtime_source, "version", version, "device_count", count);
}

/* ---- relaxed capture mode around allocations and frees (exchange_alloc.c, copy.c) ---- */

void cdl_capture_mode_relax(const cdl_cudart *rt, cdl_capture_mode_scope *scope)
{
    scope->switched = 0;
    scope->previous = cudaStreamCaptureModeRelaxed;
    if (rt->thread_exchange_stream_capture_mode == NULL)
        return;
    if (rt->thread_exchange_stream_capture_mode(&scope->previous) == cudaSuccess)
        scope->switched = 1;
    else
        (void)rt->get_last_error(); /* the call goes ahead in the thread's own mode */
}

void cdl_capture_mode_leave(const cdl_cudart *rt, cdl_capture_mode_scope *scope)
{
    if (scope->switched && rt->thread_exchange_stream_capture_mode(&scope->previous) != cudaSuccess)
        (void)rt->get_last_error();
    scope->switched = 0;
}
