/* A test double of the CUDA runtime (libcudart), loaded by cai_dlpack through CAI_DLPACK_CUDART:
 * it answers pointer-attribute queries from a table the tests fill, fakes devices, events and stream
 * capture (CUDA graphs), records every call in a log, and fails chosen calls on request. Driven from
 * Python by ctypes. */
#define _GNU_SOURCE /* RTLD_DEFAULT */
#include <dlfcn.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define API __attribute__((visibility("default")))

typedef int cudaError_t;
typedef void *cudaStream_t;
typedef void *cudaEvent_t;

/* Same layout as the runtime's struct cudaPointerAttributes of CUDA 13 (CUDA 11 and 12 lack the
 * reserved words): the double writes all of it, as the real runtime may, so a caller with too small a
 * struct is caught by the sanitized suite. */
struct cudaPointerAttributes {
    int type;
    int device;
    void *devicePointer;
    void *hostPointer;
    long reserved[8];
};

enum { SUCCESS = 0, INVALID_VALUE = 1, INVALID_DEVICE = 101, INVALID_RESOURCE_HANDLE = 400, NOT_SUPPORTED = 801 };

#define MAX_REGIONS 64
#define MAX_EVENTS 4096
#define MAX_FAILURES 16

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static struct { uintptr_t start; size_t size; int type; int device; } regions[MAX_REGIONS];
static int region_count;
/* The runtime's device setting (cudaSetDevice; what cudaGetDevice answers while no context is current). */
static int current_device;
/* The driver's context stack (device d's primary context is d); context_device is its top, -1 when
 * empty (a thread that never used CUDA). cudaSetDevice makes the device's primary context the top, as
 * CUDA 12 does, and the runtime holds it from then on; a call that needs a context binds the runtime
 * device's when none is current. A primary context exists while the runtime or a retain holds it. */
static int context_stack[16];
static int stack_depth = 1;
static int context_device;
static unsigned runtime_holds = 1;
static int primary_retains[32];
static struct { uintptr_t handle; int device; } streams[MAX_REGIONS];
static int stream_count;
static int device_count = 4;
static int last_error;
/* What cudaDeviceGetAttribute(cudaDevAttrMaxPitch) answers; 2D copies with a wider pitch or row are refused. */
#define DEFAULT_MAX_PITCH 2147483647
static size_t max_pitch = DEFAULT_MAX_PITCH;
/* Each log line ends with the device whose context is current (" @ctx1", " @ctx-1" for none) while set. */
static int log_context;
static char log_text[1 << 18];
static size_t log_length;
static struct { char name[64]; int code; int remaining; int after; } failures[MAX_FAILURES];
static int failure_count;
static int event_device[MAX_EVENTS]; /* device + 1 while alive, 0 when free */
static int events_created, events_destroyed;

/* Stream capture, as CUDA models it. A capture sequence runs on one stream (a handle, or the per-thread
 * default stream 2 of a device), with an id unique for the process, a mode and the thread that began
 * it. What would break a capture in CUDA is refused with CUDA's error, invalidates the capture and is
 * counted as a violation: the legacy stream used while a blocking stream of its device captures (906);
 * a capturing stream waiting on an event recorded outside its capture (905) unless the wait is
 * external, or in another capture (902); a stream outside waiting on a captured event (907); an unsafe
 * call (allocation, synchronization) that the calling thread's mode prohibits (900). An event recorded
 * in a capturing stream is a captured event (event_capture), not a point in time. */
enum { MODE_GLOBAL = 0, MODE_THREAD_LOCAL = 1, MODE_RELAXED = 2 };
#define MAX_CAPTURES 16
static struct {
    uintptr_t handle;
    int device;
    unsigned long long id;
    int mode;
    int blocking;       /* not created with cudaStreamNonBlocking: the legacy stream depends on it */
    int other_thread;   /* taken as begun by another thread than the one that began it here */
    pthread_t thread;   /* the thread that called double_begin_capture */
    int invalidated;
} captures[MAX_CAPTURES];
static int capture_count;
static unsigned long long next_capture_id = 1;
static unsigned long long event_capture[MAX_EVENTS]; /* the capture of the event's last record, or 0 */
static int violations;
/* The stream an event was last recorded on: the per-thread default stream 2 is a different stream on each
 * thread (and device), so its identity is (handle, device, thread). */
typedef struct {
    uintptr_t handle;
    int device;
    unsigned long long thread; /* the recording thread's serial: a thread id is reused once the thread exits */
} stream_identity;

/* A number for the calling thread that no other thread ever has. Lock held. */
static unsigned long long thread_serial(void)
{
    static unsigned long long next = 1;
    static __thread unsigned long long serial;
    if (serial == 0)
        serial = next++;
    return serial;
}
static stream_identity event_stream[MAX_EVENTS];
/* A graph's external wait: at each launch the graph waits on the event's latest record, so a later record
 * of that event on another stream than the one the capture waited for lets a replay run ahead of the work it
 * was ordered after. Such a record is counted as a violation. */
#define MAX_EXTERNAL_WAITS 64
static struct {
    int event;
    unsigned long long capture;
    stream_identity source;
} external_waits[MAX_EXTERNAL_WAITS];
static int external_wait_count;

/* An event destroyed (or its context reset) is waited on by no graph: its id may be made again. Lock held. */
static void forget_external_waits(int event)
{
    int kept = 0;
    for (int i = 0; i < external_wait_count; i++)
        if (external_waits[i].event != event)
            external_waits[kept++] = external_waits[i];
    external_wait_count = kept;
}

static int same_stream(stream_identity a, stream_identity b)
{
    return a.handle == b.handle && (a.handle > 2 || a.device == b.device) &&
           (a.handle != 2 || a.thread == b.thread);
}
static __thread int thread_capture_mode = MODE_GLOBAL;

/* The late-running device (double_set_late): each stream is a FIFO of queued work (copies, event records,
 * waits, host functions, stream-ordered frees) that runs only when something forces it: cudaStreamSynchronize,
 * cudaDeviceSynchronize, cudaEventSynchronize, cudaFree (which waits for the device), or a test's
 * double_run_stream / double_run_all. cudaEventQuery only looks: an event is complete once its stream has run
 * past its latest record. A stream waiting on an event cannot pass that point before the event's stream ran up
 * to it. Freed device memory is poisoned (0xDD) and handed out again by the next allocation of the same size,
 * as a caching allocator would. Outside this mode every call runs at once, as before. The per-thread default
 * stream is one queue for every thread. */
enum { OP_COPY, OP_RECORD, OP_WAIT, OP_HOST, OP_FREE };
typedef struct op {
    int kind;
    void *destination;
    const void *source;
    size_t destination_pitch, source_pitch, width, height;
    int event;
    unsigned generation;
    void (*function)(void *);
    void *argument;
    struct op *next;
} op;
#define MAX_QUEUES 256
static struct { uintptr_t handle; op *head, *tail; } queues[MAX_QUEUES];
static int queue_count;
static int late;
static unsigned event_recorded[MAX_EVENTS], event_reached[MAX_EVENTS]; /* records issued, records run */
static uintptr_t event_queue[MAX_EVENTS]; /* the stream of the event's latest record */
static int sync_calls; /* calls that wait for the device */
/* Whether the caller of the last cudaEventSynchronize held the GIL (PyGILState_Check of the process's Python: 1
 * or 0), -1 before any. A host wait must let the GIL go; meaningless once a subinterpreter exists (the check
 * then always answers 1), so read it in a fresh process. */
static int gil_at_event_sync = -1;
static unsigned long calls; /* every runtime and driver call (the log's entries and the unlogged queries) */
#define MAX_ALLOCATIONS 256
static struct { void *pointer; size_t size; int free; } allocations[MAX_ALLOCATIONS];
static int allocation_count;

static const struct { int code; const char *name; const char *text; } error_table[] = {
    {0, "cudaSuccess", "no error"},
    {1, "cudaErrorInvalidValue", "invalid argument"},
    {2, "cudaErrorMemoryAllocation", "out of memory"},
    {12, "cudaErrorInvalidPitchValue", "invalid pitch argument"},
    {100, "cudaErrorNoDevice", "no CUDA-capable device is detected"},
    {101, "cudaErrorInvalidDevice", "invalid device ordinal"},
    {400, "cudaErrorInvalidResourceHandle", "invalid resource handle"},
    {700, "cudaErrorIllegalAddress", "an illegal memory access was encountered"},
    {801, "cudaErrorNotSupported", "operation not supported"},
    {900, "cudaErrorStreamCaptureUnsupported", "operation not permitted when stream is capturing"},
    {901, "cudaErrorStreamCaptureInvalidated", "operation failed due to a previous error during capture"},
    {902, "cudaErrorStreamCaptureMerge", "operation would result in a merge of separate capture sequences"},
    {905, "cudaErrorStreamCaptureIsolation", "dependency created on uncaptured work in another stream"},
    {906, "cudaErrorStreamCaptureImplicit", "operation would make the legacy stream depend on a capturing blocking stream"},
    {907, "cudaErrorCapturedEvent", "operation not permitted on an event last recorded in a capturing stream"},
    {999, "cudaErrorUnknown", "unknown error"},
};

static void vnote(const char *format, va_list args)
{
    calls++;
    if (log_length < sizeof(log_text) - 256) {
        log_length += (size_t)vsnprintf(log_text + log_length, sizeof(log_text) - log_length, format, args);
        if (log_context)
            log_length += (size_t)snprintf(log_text + log_length, sizeof(log_text) - log_length, " @ctx%d",
                                           context_device);
        log_text[log_length++] = '\n';
        log_text[log_length] = '\0';
    }
}

static void note(const char *format, ...)
{
    va_list args;
    va_start(args, format);
    vnote(format, args);
    va_end(args);
}

/* A call that only logs itself and succeeds. */
static cudaError_t logged(const char *format, ...)
{
    va_list args;
    va_start(args, format);
    pthread_mutex_lock(&lock);
    vnote(format, args);
    pthread_mutex_unlock(&lock);
    va_end(args);
    return 0;
}

/* The error code a call is told to return, or 0. */
static int injected(const char *name)
{
    for (int i = 0; i < failure_count; i++) {
        if (failures[i].remaining != 0 && strcmp(failures[i].name, name) == 0) {
            if (failures[i].after > 0) { /* calls let through before the failures */
                failures[i].after--;
                continue;
            }
            if (failures[i].remaining > 0)
                failures[i].remaining--;
            if (strncmp(name, "cuda", 4) == 0) /* driver calls leave the runtime's last error alone */
                last_error = failures[i].code;
            return failures[i].code;
        }
    }
    return 0;
}

static int event_id(cudaEvent_t event) { return (int)((uintptr_t)event - 0xE000); }

/* A runtime call that needs a context binds the current device's primary context when none is
 * current (lock held). */
static void set_top_context(int device)
{
    if (stack_depth == 0)
        stack_depth = 1;
    context_stack[stack_depth - 1] = context_device = device;
}

static void bind_context(void)
{
    if (context_device < 0) {
        set_top_context(current_device);
        runtime_holds |= 1u << current_device;
    }
}

static unsigned primary_active(void)
{
    unsigned active = runtime_holds;
    for (int d = 0; d < 32; d++)
        active |= primary_retains[d] > 0 ? 1u << d : 0;
    return active;
}

/* The capture running on stream (the per-thread default stream: the calling thread's, of the current device),
 * or NULL. The legacy stream never captures. Lock held. */
static int capture_index(cudaStream_t stream)
{
    uintptr_t handle = (uintptr_t)stream;
    for (int i = 0; handle != 1 && i < capture_count; i++)
        if (captures[i].handle == handle &&
            (handle != 2 || (captures[i].device == context_device && pthread_equal(captures[i].thread, pthread_self()))))
            return i;
    return -1;
}

/* A blocking stream of device is capturing: the legacy stream of that device is unusable. */
static int legacy_unusable(int device)
{
    for (int i = 0; i < capture_count; i++)
        if (captures[i].blocking && captures[i].device == device)
            return 1;
    return 0;
}

static void invalidate(int i, const char *why)
{
    if (!captures[i].invalidated)
        note("VIOLATION: capture %llu invalidated (%s)", captures[i].id, why);
    captures[i].invalidated = 1;
    violations++;
}

/* The legacy stream used while a blocking stream of the current device captures: 906, and those
 * captures are invalidated. Lock held. */
static int use_legacy(cudaStream_t stream, const char *call)
{
    if ((uintptr_t)stream != 1 || !legacy_unusable(context_device))
        return 0;
    for (int i = 0; i < capture_count; i++)
        if (captures[i].blocking && captures[i].device == context_device)
            invalidate(i, call);
    return last_error = 906;
}

/* An unsafe call (one the capture cannot observe) made by this thread: refused with 900 where a capture
 * in progress prohibits it under the calling thread's mode, and those captures invalidated. Lock held. */
static int unsafe_call(const char *call)
{
    int code = 0;
    for (int i = 0; i < capture_count; i++) {
        int elsewhere = captures[i].other_thread || !pthread_equal(captures[i].thread, pthread_self());
        int own = !elsewhere && captures[i].mode != MODE_RELAXED;
        int prohibited = thread_capture_mode == MODE_GLOBAL ? own || (elsewhere && captures[i].mode == MODE_GLOBAL)
                         : thread_capture_mode == MODE_THREAD_LOCAL ? own
                                                                    : 0;
        if (prohibited) {
            invalidate(i, call);
            code = last_error = 900;
        }
    }
    return code;
}

/* ---- the late-running device's queues (lock held throughout, except while a host function runs) ---- */

static int queue_of(uintptr_t handle)
{
    for (int i = 0; i < queue_count; i++)
        if (queues[i].handle == handle)
            return i;
    /* Past MAX_QUEUES streams an empty queue is taken over: it holds nothing of its stream's (a test may use
     * more streams than that, over a run or at once). Only MAX_QUEUES streams with queued work are too many. */
    for (int i = 0; queue_count == MAX_QUEUES && i < queue_count; i++) {
        if (queues[i].head == NULL) {
            queues[i].handle = handle;
            return i;
        }
    }
    if (queue_count == MAX_QUEUES)
        abort();
    queues[queue_count].handle = handle;
    queues[queue_count].head = queues[queue_count].tail = NULL;
    return queue_count++;
}

/* Queues a copy of o on stream; cudaErrorMemoryAllocation when the host has no room. */
static int enqueue(cudaStream_t stream, op o)
{
    op *queued = malloc(sizeof(op));
    if (queued == NULL)
        return last_error = 2;
    *queued = o;
    queued->next = NULL;
    int q = queue_of((uintptr_t)stream);
    if (queues[q].tail != NULL)
        queues[q].tail->next = queued;
    else
        queues[q].head = queued;
    queues[q].tail = queued;
    return 0;
}

static int allocation_index(const void *pointer)
{
    for (int i = 0; i < allocation_count; i++)
        if (allocations[i].pointer == pointer)
            return i;
    return -1;
}

/* Device memory given back: poisoned and kept for the next allocation of its size in late mode, else freed. */
static void release_memory(void *pointer)
{
    for (int i = 0; i < region_count; i++) {
        if (regions[i].start == (uintptr_t)pointer && regions[i].type == 2) {
            regions[i] = regions[--region_count];
            break;
        }
    }
    int i = allocation_index(pointer);
    if (i >= 0 && late) {
        memset(pointer, 0xDD, allocations[i].size);
        allocations[i].free = 1;
        return;
    }
    if (i >= 0)
        allocations[i] = allocations[--allocation_count];
    free(pointer);
}

static int run_one(int q);

/* Runs queues until event has reached the record it had when the wait was queued. */
static void run_until(int event, unsigned generation)
{
    while (event_reached[event] < generation && run_one(queue_of(event_queue[event])))
        ;
}

/* Runs the head of queue q; 0 when it was empty. */
static int run_one(int q)
{
    op *o = queues[q].head;
    if (o == NULL)
        return 0;
    queues[q].head = o->next;
    if (queues[q].head == NULL)
        queues[q].tail = NULL;
    switch (o->kind) {
    case OP_COPY:
        for (size_t row = 0; row < o->height; row++)
            memmove((char *)o->destination + row * o->destination_pitch,
                    (const char *)o->source + row * o->source_pitch, o->width);
        break;
    case OP_RECORD:
        if (event_reached[o->event] < o->generation)
            event_reached[o->event] = o->generation;
        break;
    case OP_WAIT:
        run_until(o->event, o->generation);
        break;
    case OP_HOST:
        pthread_mutex_unlock(&lock);
        o->function(o->argument);
        pthread_mutex_lock(&lock);
        break;
    case OP_FREE:
        release_memory(o->destination);
        break;
    }
    free(o);
    return 1;
}

/* Runs stream handle's queue to its end; returns how many operations ran. A host function runs unlocked, and
 * meanwhile the emptied queue may be taken over by another stream: the run stops there. */
static int run_queue(uintptr_t handle)
{
    int ran = 0, q = queue_of(handle);
    while (queues[q].handle == handle && run_one(q))
        ran++;
    return ran;
}

static void run_all(void)
{
    for (int more = 1; more;) {
        more = 0;
        for (int q = 0; q < queue_count; q++)
            more |= run_one(q);
    }
}

/* ---- runtime API ------------------------------------------------------------------------------- */

API const char *cudaGetErrorName(cudaError_t code)
{
    for (size_t i = 0; i < sizeof(error_table) / sizeof(error_table[0]); i++)
        if (error_table[i].code == code)
            return error_table[i].name;
    return "cudaErrorUnrecognized";
}

API const char *cudaGetErrorString(cudaError_t code)
{
    for (size_t i = 0; i < sizeof(error_table) / sizeof(error_table[0]); i++)
        if (error_table[i].code == code)
            return error_table[i].text;
    return "unrecognized error code";
}

API cudaError_t cudaGetLastError(void)
{
    pthread_mutex_lock(&lock);
    int code = last_error;
    last_error = 0;
    note("cudaGetLastError() -> %d", code);
    pthread_mutex_unlock(&lock);
    return code;
}

API cudaError_t cudaPointerGetAttributes(struct cudaPointerAttributes *attributes, const void *pointer)
{
    pthread_mutex_lock(&lock);
    note("cudaPointerGetAttributes(%#lx)", (unsigned long)(uintptr_t)pointer);
    int code = injected("cudaPointerGetAttributes");
    if (code == 0) {
        memset(attributes, 0, sizeof(*attributes));
        attributes->type = 0;
        attributes->device = -2;
        attributes->devicePointer = attributes->hostPointer = NULL;
        for (int i = 0; i < region_count; i++) {
            uintptr_t p = (uintptr_t)pointer;
            if (p >= regions[i].start && p < regions[i].start + regions[i].size) {
                attributes->type = regions[i].type;
                attributes->device = regions[i].device;
                attributes->devicePointer = (void *)pointer;
                attributes->hostPointer = regions[i].type == 2 ? NULL : (void *)pointer;
            }
        }
    }
    pthread_mutex_unlock(&lock);
    return code;
}

API cudaError_t cudaGetDevice(int *device)
{
    pthread_mutex_lock(&lock);
    int code = injected("cudaGetDevice");
    int device_now = context_device >= 0 ? context_device : current_device;
    if (code == 0)
        *device = device_now;
    note("cudaGetDevice() -> %d", code == 0 ? device_now : -1);
    pthread_mutex_unlock(&lock);
    return code;
}

API cudaError_t cudaSetDevice(int device)
{
    pthread_mutex_lock(&lock);
    note("cudaSetDevice(%d)", device);
    int code = injected("cudaSetDevice");
    if (code == 0 && (device < 0 || device >= device_count))
        code = last_error = INVALID_DEVICE;
    if (code == 0) {
        current_device = device;
        set_top_context(device);
        runtime_holds |= 1u << device;
    }
    pthread_mutex_unlock(&lock);
    return code;
}

API cudaError_t cudaGetDeviceCount(int *count)
{
    pthread_mutex_lock(&lock);
    note("cudaGetDeviceCount()");
    int code = injected("cudaGetDeviceCount");
    if (code == 0)
        *count = device_count;
    pthread_mutex_unlock(&lock);
    return code;
}

API cudaError_t cudaRuntimeGetVersion(int *version)
{
#ifdef DOUBLE_CUDA_12_0
    *version = 12000;
#else
    *version = 13000;
#endif
    return 0;
}

/* The driver's CUDA version: 13000, or what CUDART_DOUBLE_DRIVER_VERSION says (0: no driver). */
API cudaError_t cudaDriverGetVersion(int *version)
{
    const char *text = getenv("CUDART_DOUBLE_DRIVER_VERSION");
    *version = text != NULL ? atoi(text) : 13000;
    return 0;
}

API cudaError_t cudaEventCreateWithFlags(cudaEvent_t *event, unsigned int flags)
{
    pthread_mutex_lock(&lock);
    int code = injected("cudaEventCreateWithFlags");
    if (code == 0)
        bind_context();
    int id = 1;
    while (code == 0 && id < MAX_EVENTS && event_device[id] != 0)
        id++;
    if (code == 0 && id == MAX_EVENTS)
        code = last_error = 2;
    if (code == 0) {
        event_device[id] = context_device + 1;
        events_created++;
        *event = (cudaEvent_t)(uintptr_t)(0xE000 + id);
        note("cudaEventCreateWithFlags(%#x) -> ev%d", flags, id);
    }
    else {
        note("cudaEventCreateWithFlags(%#x) -> error %d", flags, code);
    }
    pthread_mutex_unlock(&lock);
    return code;
}

API cudaError_t cudaEventDestroy(cudaEvent_t event)
{
    pthread_mutex_lock(&lock);
    int id = event_id(event), code = 0;
    note("cudaEventDestroy(ev%d)", id);
    if (id <= 0 || id >= MAX_EVENTS || event_device[id] == 0)
        code = last_error = INVALID_RESOURCE_HANDLE;
    else {
        event_device[id] = 0;
        events_destroyed++;
        forget_external_waits(id);
    }
    pthread_mutex_unlock(&lock);
    return code;
}

API cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream)
{
    pthread_mutex_lock(&lock);
    int id = event_id(event);
    note("cudaEventRecord(ev%d, %lu)", id, (unsigned long)(uintptr_t)stream);
    int code = injected("cudaEventRecord");
    if (code == 0)
        bind_context();
    /* The runtime refuses an event of another context, or a stream of another one. */
    if (code == 0 && (id <= 0 || id >= MAX_EVENTS || event_device[id] != context_device + 1))
        code = last_error = INVALID_RESOURCE_HANDLE;
    for (int i = 0; code == 0 && i < stream_count; i++)
        if (streams[i].handle == (uintptr_t)stream && streams[i].device != context_device)
            code = last_error = INVALID_RESOURCE_HANDLE;
    if (code == 0)
        code = use_legacy(stream, "cudaEventRecord on the legacy stream");
    int capture = code == 0 ? capture_index(stream) : -1;
    if (capture >= 0 && captures[capture].invalidated)
        code = last_error = 901;
    if (code == 0 && capture < 0) {
        event_recorded[id]++;
        event_queue[id] = (uintptr_t)stream;
        op record = {.kind = OP_RECORD, .event = id, .generation = event_recorded[id]};
        if (!late)
            event_reached[id] = event_recorded[id];
        else
            code = enqueue(stream, record);
    }
    if (code == 0) {
        event_capture[id] = capture >= 0 ? captures[capture].id : 0;
        stream_identity here = {(uintptr_t)stream, context_device, thread_serial()};
        event_stream[id] = here;
        for (int i = 0; i < external_wait_count; i++) {
            if (external_waits[i].event == id && !same_stream(external_waits[i].source, here)) {
                note("VIOLATION: ev%d, which capture %llu waits on externally, recorded on another stream", id,
                     external_waits[i].capture);
                violations++;
            }
        }
    }
    pthread_mutex_unlock(&lock);
    return code;
}

API cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned int flags)
{
    pthread_mutex_lock(&lock);
    int id = event_id(event);
    note("cudaStreamWaitEvent(%lu, ev%d, %u)", (unsigned long)(uintptr_t)stream, id, flags);
    int code = injected("cudaStreamWaitEvent");
    if (code == 0)
        bind_context();
    if (code == 0 && (id <= 0 || id >= MAX_EVENTS || event_device[id] == 0))
        code = last_error = INVALID_RESOURCE_HANDLE;
    if (code == 0)
        code = use_legacy(stream, "cudaStreamWaitEvent on the legacy stream");
    int capture = code == 0 ? capture_index(stream) : -1;
    unsigned long long recorded_in = code == 0 ? event_capture[id] : 0;
    if (capture >= 0 && captures[capture].invalidated) {
        code = last_error = 901;
    }
    else if (capture >= 0 && recorded_in == 0 && (flags & 1)) {
        if (external_wait_count < MAX_EXTERNAL_WAITS) {
            external_waits[external_wait_count].event = id;
            external_waits[external_wait_count].capture = captures[capture].id;
            external_waits[external_wait_count].source = event_stream[id];
            external_wait_count++;
        }
    }
    else if (capture >= 0 && recorded_in != captures[capture].id) {
        /* Outside work joins a capture only through an external wait (cudaEventWaitExternal). */
        code = last_error = recorded_in == 0 ? 905 : (flags & 1) ? 907 : 902;
        invalidate(capture, recorded_in == 0 ? "wait on an event recorded outside the capture"
                            : "wait on an event of another capture");
    }
    else if (capture < 0 && recorded_in != 0) {
        code = last_error = 907;
        for (int i = 0; i < capture_count; i++)
            if (captures[i].id == recorded_in)
                invalidate(i, "wait outside the capture on a captured event");
    }
    else if (code == 0 && capture < 0 && late && event_reached[id] < event_recorded[id]) {
        op wait = {.kind = OP_WAIT, .event = id, .generation = event_recorded[id]};
        code = enqueue(stream, wait);
    }
    pthread_mutex_unlock(&lock);
    return code;
}

/* The capture state of stream: 0 none, 1 active, 2 invalidated; 906 for the legacy stream while a
 * blocking stream of its device captures (nothing invalidated, as CUDA says). */
static int capture_info(const char *call, cudaStream_t stream, int *status, unsigned long long *id)
{
    pthread_mutex_lock(&lock);
    int code = injected("cudaStreamGetCaptureInfo");
    if (code == 0)
        bind_context();
    if (code == 0 && (uintptr_t)stream == 1 && legacy_unusable(context_device))
        code = last_error = 906;
    int capture = code == 0 ? capture_index(stream) : -1;
    if (code == 0) {
        *status = capture < 0 ? 0 : captures[capture].invalidated ? 2 : 1;
        if (id != NULL)
            *id = capture < 0 ? 0 : captures[capture].id;
    }
    if (code != 0)
        note("%s(%lu) -> error %d", call, (unsigned long)(uintptr_t)stream, code);
    else if (capture < 0)
        note("%s(%lu) -> none", call, (unsigned long)(uintptr_t)stream);
    else
        note("%s(%lu) -> %s %llu", call, (unsigned long)(uintptr_t)stream, *status == 1 ? "active" : "invalidated",
             captures[capture].id);
    pthread_mutex_unlock(&lock);
    return code;
}

#ifndef DOUBLE_CUDA_12_0
/* CUDA 13's signature: edge data between the dependencies and their count. */
API cudaError_t cudaStreamGetCaptureInfo(cudaStream_t stream, int *status, unsigned long long *id, void **graph,
                                         const void **dependencies, const void **edges, size_t *count)
{
    if (graph != NULL || dependencies != NULL || edges != NULL || count != NULL)
        return INVALID_VALUE; /* the double answers status and id only */
    return capture_info("cudaStreamGetCaptureInfo", stream, status, id);
}
#else
/* CUDA 12 exports the first signature (CUDA 11.0's) under the plain name and the six-argument one as _v2. */
API cudaError_t cudaStreamGetCaptureInfo(cudaStream_t stream, int *status, unsigned long long *id)
{
    return capture_info("cudaStreamGetCaptureInfo", stream, status, id);
}

API cudaError_t cudaStreamGetCaptureInfo_v2(cudaStream_t stream, int *status, unsigned long long *id, void **graph,
                                            const void **dependencies, size_t *count)
{
    if (graph != NULL || dependencies != NULL || count != NULL)
        return INVALID_VALUE;
    return capture_info("cudaStreamGetCaptureInfo_v2", stream, status, id);
}
#endif

#ifndef DOUBLE_NO_CAPTURE_MODE
/* The calling thread's mode is swapped with *mode; a value that is no mode is refused and changes nothing. */
API cudaError_t cudaThreadExchangeStreamCaptureMode(int *mode)
{
    pthread_mutex_lock(&lock);
    int asked = *mode, previous = thread_capture_mode;
    int code = injected("cudaThreadExchangeStreamCaptureMode");
    if (code == 0 && (asked < MODE_GLOBAL || asked > MODE_RELAXED))
        code = last_error = INVALID_VALUE;
    if (code == 0) {
        thread_capture_mode = asked;
        *mode = previous;
    }
    note("cudaThreadExchangeStreamCaptureMode(%d) -> %d, was %d", asked, code, previous);
    pthread_mutex_unlock(&lock);
    return code;
}
#endif

/* The calling thread's capture-interaction mode (no log entry). */
API int double_thread_capture_mode(void) { return thread_capture_mode; }

/* Synchronizing a capturing stream, or any unsafe call the thread's mode prohibits, breaks captures. */
static cudaError_t synchronize(const char *what, cudaStream_t stream, int whole_device)
{
    pthread_mutex_lock(&lock);
    note("%s(%lu)", what, (unsigned long)(uintptr_t)stream);
    int code = injected(what);
    if (code == 0)
        code = unsafe_call(what);
    int capture = whole_device ? -1 : capture_index(stream);
    if (capture >= 0) {
        invalidate(capture, what);
        code = last_error = 900;
    }
    if (code == 0) {
        sync_calls++;
        if (whole_device)
            run_all();
        else
            run_queue((uintptr_t)stream);
    }
    pthread_mutex_unlock(&lock);
    return code;
}

API cudaError_t cudaStreamSynchronize(cudaStream_t stream) { return synchronize("cudaStreamSynchronize", stream, 0); }

API cudaError_t cudaDeviceSynchronize(void) { return synchronize("cudaDeviceSynchronize", NULL, 1); }

/* Copies: device memory is host memory here, so the bytes really move (at once: the double has no queue). The
 * log names the stream each copy was issued on, so tests see where it lands relative to the event waits. A
 * copy on the legacy stream while a blocking stream captures is refused as every legacy-stream call is. */
static int copy_allowed(const char *call, cudaStream_t stream)
{
    int code = injected(call);
    if (code == 0)
        bind_context();
    if (code == 0)
        code = use_legacy(stream, call);
    int capture = code == 0 ? capture_index(stream) : -1;
    if (capture >= 0 && captures[capture].invalidated)
        code = last_error = 901;
    return code;
}

API cudaError_t cudaMemcpyAsync(void *destination, const void *source, size_t count, int kind, cudaStream_t stream)
{
    pthread_mutex_lock(&lock);
    note("cudaMemcpyAsync(%zu bytes, kind %d, %lu)", count, kind, (unsigned long)(uintptr_t)stream);
    int code = copy_allowed("cudaMemcpyAsync", stream);
    op copy = {.kind = OP_COPY, .destination = destination, .source = source, .destination_pitch = count,
               .source_pitch = count, .width = count, .height = 1};
    if (code == 0 && count > 0 && late && capture_index(stream) < 0)
        code = enqueue(stream, copy);
    else if (code == 0 && count > 0)
        memmove(destination, source, count);
    pthread_mutex_unlock(&lock);
    return code;
}

/* height rows of width bytes; CUDA refuses a pitch smaller than the width. */
API cudaError_t cudaMemcpy2DAsync(void *destination, size_t destination_pitch, const void *source,
                                  size_t source_pitch, size_t width, size_t height, int kind, cudaStream_t stream)
{
    pthread_mutex_lock(&lock);
    note("cudaMemcpy2DAsync(%zu x %zu bytes, pitches %zu %zu, kind %d, %lu)", height, width, destination_pitch,
         source_pitch, kind, (unsigned long)(uintptr_t)stream);
    int code = copy_allowed("cudaMemcpy2DAsync", stream);
    if (code == 0 && (destination_pitch < width || source_pitch < width))
        code = last_error = INVALID_VALUE;
    if (code == 0 && (destination_pitch > max_pitch || source_pitch > max_pitch))
        code = last_error = 12; /* cudaErrorInvalidPitchValue: above cudaDevAttrMaxPitch */
    op copy = {.kind = OP_COPY, .destination = destination, .source = source, .destination_pitch = destination_pitch,
               .source_pitch = source_pitch, .width = width, .height = height};
    if (code == 0 && late && capture_index(stream) < 0) {
        code = enqueue(stream, copy);
        height = 0;
    }
    for (size_t row = 0; code == 0 && row < height; row++)
        memmove((char *)destination + row * destination_pitch, (const char *)source + row * source_pitch, width);
    pthread_mutex_unlock(&lock);
    return code;
}


/* Only cudaDevAttrMaxPitch (11) is known here; device is checked as the runtime does. */
API cudaError_t cudaDeviceGetAttribute(int *value, int attribute, int device)
{
    pthread_mutex_lock(&lock);
    note("cudaDeviceGetAttribute(%d, %d)", attribute, device);
    int code = injected("cudaDeviceGetAttribute");
    if (code == 0 && (device < 0 || device >= device_count))
        code = last_error = INVALID_DEVICE;
    if (code == 0 && attribute != 11)
        code = last_error = INVALID_VALUE;
    if (code == 0)
        *value = (int)max_pitch;
    pthread_mutex_unlock(&lock);
    return code;
}

/* Streams made here are 0x7000 + n on the current device. */
API cudaError_t cudaStreamCreate(cudaStream_t *stream)
{
    pthread_mutex_lock(&lock);
    int code = injected("cudaStreamCreate");
    if (code == 0 && stream_count == MAX_REGIONS)
        code = last_error = 2;
    if (code == 0) {
        bind_context();
        uintptr_t handle = 0x7000 + (uintptr_t)stream_count;
        streams[stream_count].handle = handle, streams[stream_count].device = context_device, stream_count++;
        *stream = (cudaStream_t)handle;
    }
    note("cudaStreamCreate() -> %d", code);
    pthread_mutex_unlock(&lock);
    return code;
}

API cudaError_t cudaStreamDestroy(cudaStream_t stream)
{
    return logged("cudaStreamDestroy(%lu)", (unsigned long)(uintptr_t)stream);
}

static void reset_device(int device);

API cudaError_t cudaDeviceReset(void)
{
    pthread_mutex_lock(&lock);
    note("cudaDeviceReset()");
    reset_device(current_device);
    pthread_mutex_unlock(&lock);
    return 0;
}

/* ---- driver API, reached only through the runtime's entry-point query ------------------------ */

typedef void *CUcontext;
#define CONTEXT_OF(device) ((CUcontext)(uintptr_t)(0xC000 + (device)))

static int cuCtxGetCurrent(CUcontext *context)
{
    pthread_mutex_lock(&lock);
    int code = injected("cuCtxGetCurrent");
    if (code == 0)
        *context = context_device < 0 ? NULL : CONTEXT_OF(context_device);
    if (context_device < 0)
        note("cuCtxGetCurrent() -> NULL");
    else
        note("cuCtxGetCurrent() -> ctx%d", context_device);
    pthread_mutex_unlock(&lock);
    return code;
}

static int context_argument(CUcontext context)
{
    int device = context == NULL ? -1 : (int)((uintptr_t)context - 0xC000);
    return device >= 0 && device < device_count && (primary_active() >> device & 1) ? device : -1;
}

static int cuCtxPushCurrent(CUcontext context)
{
    pthread_mutex_lock(&lock);
    int device = context_argument(context);
    note("cuCtxPushCurrent(ctx%d)", device);
    int code = injected("cuCtxPushCurrent");
    if (code == 0 && (device < 0 || stack_depth == 16))
        code = 201; /* CUDA_ERROR_INVALID_CONTEXT */
    if (code == 0)
        context_stack[stack_depth++] = context_device = device;
    pthread_mutex_unlock(&lock);
    return code;
}

static int cuCtxPopCurrent(CUcontext *context)
{
    pthread_mutex_lock(&lock);
    int code = injected("cuCtxPopCurrent");
    if (code == 0 && stack_depth == 0)
        code = 201;
    if (code == 0) {
        int device = context_stack[--stack_depth];
        if (context != NULL)
            *context = CONTEXT_OF(device);
        context_device = stack_depth > 0 ? context_stack[stack_depth - 1] : -1;
        note(context_device < 0 ? "cuCtxPopCurrent() -> NULL current" : "cuCtxPopCurrent() -> ctx%d current",
             context_device);
    }
    else {
        note("cuCtxPopCurrent() -> error %d", code);
    }
    pthread_mutex_unlock(&lock);
    return code;
}

static int cuDeviceGet(int *device, int ordinal)
{
    if (ordinal < 0 || ordinal >= device_count)
        return 101; /* CUDA_ERROR_INVALID_DEVICE */
    *device = ordinal;
    return 0;
}

static int cuDevicePrimaryCtxRetain(CUcontext *context, int device)
{
    pthread_mutex_lock(&lock);
    note("cuDevicePrimaryCtxRetain(%d)", device);
    int code = injected("cuDevicePrimaryCtxRetain");
    if (code == 0) {
        primary_retains[device]++;
        *context = CONTEXT_OF(device);
    }
    pthread_mutex_unlock(&lock);
    return code;
}

static int cuDevicePrimaryCtxRelease(int device)
{
    pthread_mutex_lock(&lock);
    note("cuDevicePrimaryCtxRelease(%d)", device);
    int code = injected("cuDevicePrimaryCtxRelease");
    if (code == 0 && primary_retains[device] == 0)
        code = 201;
    if (code == 0 && --primary_retains[device] == 0 && !(runtime_holds >> device & 1))
        reset_device(device); /* the last holder let go: the context and its events are destroyed */
    pthread_mutex_unlock(&lock);
    return code;
}

static int cuDevicePrimaryCtxGetState(int device, unsigned *flags, int *active)
{
    pthread_mutex_lock(&lock);
    *flags = 0;
    *active = (int)(primary_active() >> device & 1);
    note("cuDevicePrimaryCtxGetState(%d) -> %d", device, *active);
    pthread_mutex_unlock(&lock);
    return 0;
}

/* A registered stream's context is its device's; any other handle (the legacy and per-thread ones,
 * and the handles tests make up) is taken as a stream of the current context. */
static int cuStreamGetCtx(void *stream, CUcontext *context)
{
    pthread_mutex_lock(&lock);
    uintptr_t handle = (uintptr_t)stream;
    int code = injected("cuStreamGetCtx"), found = -1;
    for (int i = 0; code == 0 && i < stream_count; i++)
        if (streams[i].handle == handle)
            found = streams[i].device;
    if (code == 0 && found < 0) {
        bind_context();
        found = context_device;
    }
    if (code == 0)
        *context = CONTEXT_OF(found);
    note("cuStreamGetCtx(%lu) -> %d", (unsigned long)handle, code == 0 ? found : -code);
    pthread_mutex_unlock(&lock);
    return code;
}

/* Context ids are unique for the process's lifetime: device d's primary context is d + 1 until a
 * reset makes it a new one. */
static unsigned long long context_generation[32];

static int cuCtxGetId(CUcontext context, unsigned long long *id)
{
    pthread_mutex_lock(&lock);
    int device = context == NULL ? -1 : (int)((uintptr_t)context - 0xC000);
    int code = injected("cuCtxGetId");
    if (code == 0 && (device < 0 || device >= device_count))
        code = 201; /* CUDA_ERROR_INVALID_CONTEXT */
    if (code == 0)
        *id = (unsigned long long)device + 1 + 1000 * context_generation[device];
    note("cuCtxGetId(ctx%d) -> %d", device, code);
    pthread_mutex_unlock(&lock);
    return code;
}

static int cuGetErrorName(int code, const char **name)
{
    *name = code == 201   ? "CUDA_ERROR_INVALID_CONTEXT"
            : code == 2   ? "CUDA_ERROR_OUT_OF_MEMORY"
            : code == 400 ? "CUDA_ERROR_INVALID_HANDLE"
                          : NULL;
    return *name ? 0 : 1;
}

static int cuGetErrorString(int code, const char **text)
{
    *text = code == 201 ? "invalid device context" : code == 2 ? "out of memory" : code == 400 ? "invalid resource handle" : NULL;
    return *text ? 0 : 1;
}

/* The driver functions by name, with cudaDriverEntryPointSuccess (0) or SymbolNotFound (1); with
 * CUDART_DOUBLE_ENTRY_POINTS=0 the query fails as it does without a driver, and with =-NAME the driver lacks
 * that one function (an older driver's table). */
static cudaError_t entry_point(const char *symbol, void **function, int *status)
{
    const char *allowed = getenv("CUDART_DOUBLE_ENTRY_POINTS");
    *function = NULL;
    if (allowed != NULL && strcmp(allowed, "0") == 0)
        return last_error = NOT_SUPPORTED;
    if (allowed != NULL && allowed[0] == '-' && strcmp(allowed + 1, symbol) == 0) {
        if (status != NULL)
            *status = 1;
        return SUCCESS;
    }
    if (strcmp(symbol, "cuCtxGetCurrent") == 0)
        *function = (void *)cuCtxGetCurrent;
    else if (strcmp(symbol, "cuCtxPushCurrent") == 0)
        *function = (void *)cuCtxPushCurrent;
    else if (strcmp(symbol, "cuCtxPopCurrent") == 0)
        *function = (void *)cuCtxPopCurrent;
    else if (strcmp(symbol, "cuDeviceGet") == 0)
        *function = (void *)cuDeviceGet;
    else if (strcmp(symbol, "cuDevicePrimaryCtxRetain") == 0)
        *function = (void *)cuDevicePrimaryCtxRetain;
    else if (strcmp(symbol, "cuDevicePrimaryCtxRelease") == 0)
        *function = (void *)cuDevicePrimaryCtxRelease;
    else if (strcmp(symbol, "cuDevicePrimaryCtxGetState") == 0)
        *function = (void *)cuDevicePrimaryCtxGetState;
    else if (strcmp(symbol, "cuStreamGetCtx") == 0)
        *function = (void *)cuStreamGetCtx;
    else if (strcmp(symbol, "cuCtxGetId") == 0)
        *function = (void *)cuCtxGetId;
    else if (strcmp(symbol, "cuGetErrorName") == 0)
        *function = (void *)cuGetErrorName;
    else if (strcmp(symbol, "cuGetErrorString") == 0)
        *function = (void *)cuGetErrorString;
    if (status != NULL)
        *status = *function ? 0 : 1;
    return SUCCESS;
}

#ifndef DOUBLE_CUDA_12_0
API cudaError_t cudaGetDriverEntryPointByVersion(const char *symbol, void **function, unsigned int version,
                                                 unsigned long long flags, int *status)
{
    (void)flags;
    pthread_mutex_lock(&lock);
    note("cudaGetDriverEntryPointByVersion(%s, %u)", symbol, version);
    cudaError_t code = entry_point(symbol, function, status);
    pthread_mutex_unlock(&lock);
    return code;
}
#endif

API cudaError_t cudaGetDriverEntryPoint(const char *symbol, void **function, unsigned long long flags, int *status)
{
    (void)flags;
    pthread_mutex_lock(&lock);
    note("cudaGetDriverEntryPoint(%s)", symbol);
    cudaError_t code = entry_point(symbol, function, status);
    pthread_mutex_unlock(&lock);
    return code;
}

/* Device allocations are host memory here, so tests can read what a consumer wrote. In late mode a freed block
 * of the same size is handed out again (poisoned, 0xDD, as it was freed). */
static void *remember(const char *call, void **pointer, size_t size)
{
    size = size ? size : 1;
    *pointer = NULL;
    for (int i = 0; late && i < allocation_count && *pointer == NULL; i++) {
        if (allocations[i].free && allocations[i].size == size) {
            allocations[i].free = 0;
            *pointer = allocations[i].pointer;
        }
    }
    if (*pointer == NULL && (*pointer = malloc(size)) != NULL && allocation_count < MAX_ALLOCATIONS) {
        allocations[allocation_count].pointer = *pointer, allocations[allocation_count].size = size;
        allocations[allocation_count++].free = 0;
    }
    note("%s(%zu) -> %s", call, size, *pointer ? "ok" : "out of memory");
    return *pointer;
}

API cudaError_t cudaMalloc(void **pointer, size_t size)
{
    pthread_mutex_lock(&lock);
    int code = injected("cudaMalloc");
    if (code == 0)
        code = unsafe_call("cudaMalloc");
    if (code == 0)
        bind_context();
    if (code == 0 && remember("cudaMalloc", pointer, size) == NULL)
        code = last_error = 2;
    if (code == 0 && region_count < MAX_REGIONS) /* device memory of the current device, for pointer queries */
        regions[region_count].start = (uintptr_t)*pointer, regions[region_count].size = size ? size : 1,
        regions[region_count].type = 2, regions[region_count].device = context_device, region_count++;
    pthread_mutex_unlock(&lock);
    return code;
}

API cudaError_t cudaMallocHost(void **pointer, size_t size)
{
    pthread_mutex_lock(&lock);
    int code = injected("cudaMallocHost");
    if (code == 0)
        code = unsafe_call("cudaMallocHost");
    if (code == 0)
        bind_context();
    if (code == 0 && remember("cudaMallocHost", pointer, size) == NULL)
        code = last_error = 2;
    pthread_mutex_unlock(&lock);
    return code;
}

API cudaError_t cudaMallocManaged(void **pointer, size_t size, unsigned int flags)
{
    (void)flags;
    pthread_mutex_lock(&lock);
    int code = injected("cudaMallocManaged");
    if (code == 0)
        code = unsafe_call("cudaMallocManaged");
    if (code == 0)
        bind_context();
    if (code == 0 && remember("cudaMallocManaged", pointer, size) == NULL)
        code = last_error = 2;
    pthread_mutex_unlock(&lock);
    return code;
}

/* cudaFree and cudaFreeHost wait for the device (all queued work runs first): counted as synchronizing. */
static cudaError_t free_now(const char *call, void *pointer)
{
    pthread_mutex_lock(&lock);
    note("%s()", call);
    int code = injected(call);
    if (code != 0) {
        pthread_mutex_unlock(&lock);
        return code;
    }
    if (unsafe_call(call) != 0) {
        pthread_mutex_unlock(&lock);
        return 900;
    }
    sync_calls++;
    run_all();
    release_memory(pointer);
    pthread_mutex_unlock(&lock);
    return 0;
}

API cudaError_t cudaFree(void *pointer) { return free_now("cudaFree", pointer); }

API cudaError_t cudaFreeHost(void *pointer) { return free_now("cudaFreeHost", pointer); }

/* Stream-ordered allocation (CUDA 11.2): made at once here, from the same pool as cudaMalloc's. */
API cudaError_t cudaMallocAsync(void **pointer, size_t size, cudaStream_t stream)
{
    pthread_mutex_lock(&lock);
    int code = injected("cudaMallocAsync");
    if (code == 0)
        bind_context();
    if (code == 0 && capture_index(stream) >= 0)
        code = last_error = 900; /* a graph allocation node: the double has none */
    if (code == 0 && remember("cudaMallocAsync", pointer, size) == NULL)
        code = last_error = 2;
    if (code == 0 && region_count < MAX_REGIONS)
        regions[region_count].start = (uintptr_t)*pointer, regions[region_count].size = size ? size : 1,
        regions[region_count].type = 2, regions[region_count].device = context_device, region_count++;
    if (code != 0)
        note("cudaMallocAsync(%zu, %lu) -> error %d", size, (unsigned long)(uintptr_t)stream, code);
    pthread_mutex_unlock(&lock);
    return code;
}

/* The block is given back when stream reaches the free: queued in late mode, at once otherwise. */
API cudaError_t cudaFreeAsync(void *pointer, cudaStream_t stream)
{
    pthread_mutex_lock(&lock);
    note("cudaFreeAsync(%lu)", (unsigned long)(uintptr_t)stream);
    int code = injected("cudaFreeAsync");
    if (code == 0)
        code = use_legacy(stream, "cudaFreeAsync on the legacy stream");
    op release = {.kind = OP_FREE, .destination = pointer};
    if (code == 0 && late && capture_index(stream) < 0)
        code = enqueue(stream, release);
    else if (code == 0)
        release_memory(pointer);
    pthread_mutex_unlock(&lock);
    return code;
}

/* 0 when the stream has run past the event's latest record (or it was never recorded), else
 * cudaErrorNotReady (600). Only looks: nothing runs. Not logged (counted in double_calls). */
API cudaError_t cudaEventQuery(cudaEvent_t event)
{
    pthread_mutex_lock(&lock);
    calls++;
    int id = event_id(event), code = injected("cudaEventQuery");
    if (code == 0)
        code = unsafe_call("cudaEventQuery"); /* prohibited during a capture the thread's mode forbids */
    if (code == 0 && (id <= 0 || id >= MAX_EVENTS || event_device[id] == 0))
        code = INVALID_RESOURCE_HANDLE;
    else if (code == 0 && event_reached[id] < event_recorded[id])
        code = 600;
    pthread_mutex_unlock(&lock);
    return code;
}

/* Waits for the event: its stream (and what it waits on) runs up to the record. */
API cudaError_t cudaEventSynchronize(cudaEvent_t event)
{
    int (*gil_check)(void) = (int (*)(void))dlsym(RTLD_DEFAULT, "PyGILState_Check");
    int gil = gil_check != NULL ? gil_check() : -1;
    pthread_mutex_lock(&lock);
    gil_at_event_sync = gil;
    int id = event_id(event);
    note("cudaEventSynchronize(ev%d)", id);
    int code = injected("cudaEventSynchronize");
    if (code == 0)
        code = unsafe_call("cudaEventSynchronize"); /* the blocking form of cudaEventQuery, prohibited alike */
    if (code == 0 && (id <= 0 || id >= MAX_EVENTS || event_device[id] == 0))
        code = last_error = INVALID_RESOURCE_HANDLE;
    if (code == 0) {
        sync_calls++;
        run_until(id, event_recorded[id]);
    }
    pthread_mutex_unlock(&lock);
    return code;
}

/* A host function queued on stream: the tests' "kernel" (it reads device memory, which is host memory here). */
API cudaError_t cudaLaunchHostFunc(cudaStream_t stream, void (*function)(void *), void *argument)
{
    pthread_mutex_lock(&lock);
    note("cudaLaunchHostFunc(%lu)", (unsigned long)(uintptr_t)stream);
    int code = copy_allowed("cudaLaunchHostFunc", stream);
    op host = {.kind = OP_HOST, .function = function, .argument = argument};
    int run_now = code == 0 && !(late && capture_index(stream) < 0);
    if (code == 0 && !run_now)
        code = enqueue(stream, host);
    pthread_mutex_unlock(&lock);
    if (run_now)
        function(argument);
    return code;
}

/* ---- controls for the tests -------------------------------------------------------------------- */

API void double_reset(void)
{
    pthread_mutex_lock(&lock);
    region_count = failure_count = stream_count = 0;
    current_device = context_device = last_error = 0;
    context_stack[0] = 0;
    stack_depth = 1;
    runtime_holds = 1;
    memset(primary_retains, 0, sizeof(primary_retains));
    device_count = 4;
    capture_count = violations = external_wait_count = 0;
    memset(event_capture, 0, sizeof(event_capture));
    thread_capture_mode = MODE_GLOBAL;
    max_pitch = DEFAULT_MAX_PITCH;
    log_context = 0;
    for (int q = 0; q < queue_count; q++) {
        while (queues[q].head != NULL) {
            op *o = queues[q].head;
            queues[q].head = o->next;
            free(o);
        }
        queues[q].tail = NULL;
    }
    queue_count = 0;
    for (int id = 0; id < MAX_EVENTS; id++)
        event_reached[id] = event_recorded[id]; /* what was queued never runs: its events are done */
    late = sync_calls = 0;
    log_length = 0;
    log_text[0] = '\0';
    pthread_mutex_unlock(&lock);
}

/* Late mode on (1) or off (0); turning it off runs what is queued. */
API void double_set_late(int on)
{
    pthread_mutex_lock(&lock);
    if (!on)
        run_all();
    late = on;
    pthread_mutex_unlock(&lock);
}

/* Runs stream's queue to its end (a test's "the device got to it now"); returns how many operations ran. */
API int double_run_stream(uintptr_t handle)
{
    pthread_mutex_lock(&lock);
    int ran = run_queue(handle);
    pthread_mutex_unlock(&lock);
    return ran;
}

API void double_run_all(void)
{
    pthread_mutex_lock(&lock);
    run_all();
    pthread_mutex_unlock(&lock);
}

/* Operations queued on stream and not run yet. */
API int double_queued(uintptr_t handle)
{
    pthread_mutex_lock(&lock);
    int count = 0;
    for (op *o = queues[queue_of(handle)].head; o != NULL; o = o->next)
        count++;
    pthread_mutex_unlock(&lock);
    return count;
}

API int double_sync_calls(void) { return sync_calls; }
API int double_gil_at_event_sync(void) { return gil_at_event_sync; }
API unsigned long double_calls(void) { return calls; }

API void double_clear_log(void)
{
    pthread_mutex_lock(&lock);
    log_length = 0;
    log_text[0] = '\0';
    pthread_mutex_unlock(&lock);
}

API const char *double_log(void) { return log_text; }

/* type: 0 unregistered, 1 pinned host, 2 device, 3 managed. */
API int double_add_region(uintptr_t start, size_t size, int type, int device)
{
    pthread_mutex_lock(&lock);
    int ok = region_count < MAX_REGIONS;
    if (ok)
        regions[region_count].start = start, regions[region_count].size = size, regions[region_count].type = type,
        regions[region_count].device = device, region_count++;
    pthread_mutex_unlock(&lock);
    return ok ? 0 : -1;
}

/* The next count calls of name return code (count < 0: every call until reset), once after calls of it have
 * gone through. */
API int double_fail_after(const char *name, int code, int count, int after)
{
    pthread_mutex_lock(&lock);
    int slot = 0;
    while (slot < failure_count && failures[slot].remaining != 0)
        slot++; /* reuse a spent entry */
    int ok = slot < MAX_FAILURES;
    if (ok) {
        snprintf(failures[slot].name, sizeof(failures[0].name), "%s", name);
        failures[slot].code = code;
        failures[slot].remaining = count;
        failures[slot].after = after;
        if (slot == failure_count)
            failure_count++;
    }
    pthread_mutex_unlock(&lock);
    return ok ? 0 : -1;
}

API int double_fail(const char *name, int code, int count) { return double_fail_after(name, code, count, 0); }

API int double_current_device(void) { return current_device; }
API void double_set_max_pitch(size_t pitch) { max_pitch = pitch; }
API void double_log_context(int on) { log_context = on; }
/* Device made current with its primary context, as cudaSetDevice would (no log entry). */
API void double_set_current_device(int device)
{
    current_device = device;
    set_top_context(device);
    runtime_holds |= 1u << device;
}
/* A thread, and a process, that never used CUDA: no context current, no primary context made;
 * cudaGetDevice answers device. */
API void double_drop_context(int device)
{
    current_device = device;
    context_device = -1;
    stack_depth = 0;
    runtime_holds = 0;
}
API int double_context_device(void) { return context_device; }
/* A reset of device: its primary context and every event made in it are destroyed (lock held). */
static void reset_device(int device)
{
    context_generation[device]++;
    for (int id = 1; id < MAX_EVENTS; id++) {
        if (event_device[id] == device + 1) {
            event_device[id] = 0;
            events_destroyed++;
            forget_external_waits(id);
        }
    }
}

API void double_reset_device(int device)
{
    pthread_mutex_lock(&lock);
    reset_device(device);
    pthread_mutex_unlock(&lock);
}
API unsigned double_primary_contexts(void) { return primary_active(); }
API int double_context_depth(void) { return stack_depth; }
API int double_add_stream(uintptr_t handle, int device)
{
    pthread_mutex_lock(&lock);
    int ok = stream_count < MAX_REGIONS;
    if (ok) /* a stream made in the device's primary context, which the runtime then holds */
        streams[stream_count].handle = handle, streams[stream_count].device = device, stream_count++,
        runtime_holds |= 1u << device;
    pthread_mutex_unlock(&lock);
    return ok ? 0 : -1;
}
API void double_set_device_count(int count) { device_count = count; }
API int double_last_error(void) { return last_error; }
API int double_events_created(void) { return events_created; }
API int double_events_alive(void) { return events_created - events_destroyed; }

/* Begins a capture on stream (of device) in mode; blocking: a stream the legacy stream depends on;
 * other_thread: begun by another thread. Returns the capture's id, or 0 when the stream already captures. */
API unsigned long long double_begin_capture(uintptr_t handle, int device, int mode, int blocking, int other_thread)
{
    pthread_mutex_lock(&lock);
    unsigned long long id = 0;
    int busy = 0;
    for (int i = 0; i < capture_count; i++)
        busy |= captures[i].handle == handle && captures[i].device == device;
    if (!busy && capture_count < MAX_CAPTURES && handle != 1) {
        id = next_capture_id++;
        captures[capture_count].handle = handle, captures[capture_count].device = device;
        captures[capture_count].id = id, captures[capture_count].mode = mode;
        captures[capture_count].blocking = blocking, captures[capture_count].other_thread = other_thread;
        captures[capture_count].thread = pthread_self();
        captures[capture_count].invalidated = 0;
        capture_count++;
    }
    pthread_mutex_unlock(&lock);
    return id;
}

/* Adds stream (of device; blocking as for double_begin_capture) to the capture with id, as waiting on an
 * event recorded in it would (a fork). Returns 0, or -1 when there is no such capture. */
API int double_join_capture(uintptr_t handle, int device, unsigned long long id, int blocking)
{
    pthread_mutex_lock(&lock);
    int found = -1;
    for (int i = 0; i < capture_count; i++)
        if (captures[i].id == id)
            found = i;
    if (found >= 0 && capture_count < MAX_CAPTURES) {
        captures[capture_count] = captures[found];
        captures[capture_count].handle = handle, captures[capture_count].device = device;
        captures[capture_count].blocking = blocking;
        capture_count++;
    }
    pthread_mutex_unlock(&lock);
    return found >= 0 ? 0 : -1;
}

/* Ends the capture with id: 1 when it made a graph, 0 when it was invalidated, -1 when there is none. */
API int double_end_capture(unsigned long long id)
{
    pthread_mutex_lock(&lock);
    int result = -1;
    for (int i = capture_count - 1; i >= 0; i--) {
        if (captures[i].id == id) {
            result = !captures[i].invalidated;
            captures[i] = captures[--capture_count];
        }
    }
    pthread_mutex_unlock(&lock);
    return result;
}

/* Invalidates the capture with id, as an earlier error of someone else's would. */
API void double_invalidate_capture(unsigned long long id)
{
    pthread_mutex_lock(&lock);
    for (int i = 0; i < capture_count; i++)
        if (captures[i].id == id)
            captures[i].invalidated = 1;
    pthread_mutex_unlock(&lock);
}

API int double_violations(void) { return violations; }

/* Calls fn(arg) on a new thread that has never held the GIL, and waits for it. */
static void *trampoline(void *pair)
{
    void (**call)(void *) = pair;
    call[0](((void **)pair)[1]);
    return NULL;
}

API int double_call_in_thread(void (*fn)(void *), void *arg)
{
    void *pair[2] = {(void *)fn, arg};
    pthread_t thread;
    if (pthread_create(&thread, NULL, trampoline, pair) != 0)
        return -1;
    return pthread_join(thread, NULL);
}

/* Calls fn(arg) on a detached thread after delay_us microseconds: a deleter that runs while the
 * interpreter shuts down. */
struct delayed_call {
    void (*fn)(void *);
    void *arg;
    unsigned delay_us;
};

static void *delayed_trampoline(void *raw)
{
    struct delayed_call call = *(struct delayed_call *)raw;
    free(raw);
    usleep(call.delay_us);
    call.fn(call.arg);
    return NULL;
}

API int double_call_later(void (*fn)(void *), void *arg, unsigned delay_us)
{
    struct delayed_call *call = malloc(sizeof(*call));
    if (call == NULL)
        return -1;
    call->fn = fn;
    call->arg = arg;
    call->delay_us = delay_us;
    pthread_t thread;
    if (pthread_create(&thread, NULL, delayed_trampoline, call) != 0) {
        free(call);
        return -1;
    }
    return pthread_detach(thread);
}

/* At process exit (after the interpreter is gone), the log is written to CUDART_DOUBLE_LOG_AT_EXIT if set:
 * tests see the calls deleters made while the interpreter finalized. */
__attribute__((destructor)) static void write_log_at_exit(void)
{
    const char *path = getenv("CUDART_DOUBLE_LOG_AT_EXIT");
    FILE *file = path != NULL ? fopen(path, "w") : NULL;
    if (file == NULL)
        return;
    pthread_mutex_lock(&lock);
    fputs(log_text, file);
    pthread_mutex_unlock(&lock);
    fclose(file);
}
