/* Releases ordered after a consumer's stream: a tensor dropped on the host may still be read by work its
 * consumer queued, so what keeps its memory alive is released only once an event recorded on the consumer's
 * stream at the drop has completed (the legacy or per-thread stream, or a handle the caller trusts: see
 * cdl_release_point_for_drop; any other is released at once). Nothing here waits for the device, except past the bound on pending
 * releases and, briefly, at exit. No Python here but the pending call and the module's two test functions. */
#include "cdl_internal.h"
#include "cuda_runtime_table.h"

#include <stdlib.h>
#include <time.h>

/* One release waiting for its event. Made with malloc: deleters run on any thread, without the GIL. */
typedef struct cdl_pending {
    cdl_release_point point; /* the consumer's stream */
    int recorded;            /* 0 while point's stream captured at every try: no event yet */
    int reached;             /* its event completed (not a refused query): the stream ran past the drop */
    int64_t stream;          /* the stream the event was recorded on (the legacy one for another thread's 2) */
    cudaEvent_t event;
    unsigned long long key; /* the event's context: its id, or the device without the driver's calls */
    cdl_release_fn release;
    void *argument;
    struct cdl_pending *next;
} cdl_pending;

/* The pending releases, oldest first, under cdl_pending_lock (held only around C code and runtime calls,
 * never while a release runs: a release may take the GIL, run finalizers and convert again). */
static cdl_lock cdl_pending_lock = CDL_LOCK_INITIALIZER;
static cdl_pending *cdl_pending_head, *cdl_pending_tail;
static _Atomic Py_ssize_t cdl_pending_count;
/* Releases past the bound that waited for their event (cudaEventSynchronize), for tests and the README. */
static _Atomic Py_ssize_t cdl_pending_waits;
static _Atomic int cdl_pending_call_scheduled;
/* The test-only switch (_set_ordered_release): 0 releases at once, as before ordered release existed. */
static _Atomic int cdl_ordered_release_enabled = 1;
/* Set once the main interpreter's exit handler starts: from then on nothing waits for the bound (a stream still
 * holding a release after the handler's time may never get there, and a wait for it would hang the exit). A
 * subinterpreter's end sets nothing: the process goes on. */
static _Atomic int cdl_exiting;

/* Events whose release was made, kept for the next release in their context (a create per release would
 * cost a call and an event each), under cdl_pending_lock. */
#define CDL_SPARE_EVENTS 64
static struct {
    unsigned long long key;
    cudaEvent_t event;
} cdl_spare[CDL_SPARE_EVENTS];
static int cdl_spare_count;

/* A spare event of the context key, or a new one. Any thread. */
static cudaError_t cdl_take_event(const cdl_cudart *rt, unsigned long long key, cudaEvent_t *event)
{
    int found = 0;
    cdl_lock_acquire(&cdl_pending_lock);
    for (int i = cdl_spare_count - 1; i >= 0 && !found; i--) {
        if (cdl_spare[i].key == key) {
            *event = cdl_spare[i].event;
            cdl_spare[i] = cdl_spare[--cdl_spare_count];
            found = 1;
        }
    }
    cdl_lock_release(&cdl_pending_lock);
    return found ? cudaSuccess : rt->event_create_with_flags(event, cudaEventDisableTiming);
}

/* Keeps event for a later release, or destroys it when enough are kept. Any thread. */
static void cdl_give_event(const cdl_cudart *rt, unsigned long long key, cudaEvent_t event)
{
    int kept = 0;
    cdl_lock_acquire(&cdl_pending_lock);
    if (cdl_spare_count < CDL_SPARE_EVENTS) {
        cdl_spare[cdl_spare_count].key = key;
        cdl_spare[cdl_spare_count++].event = event;
        kept = 1;
    }
    cdl_lock_release(&cdl_pending_lock);
    if (!kept && rt->event_destroy(event) != cudaSuccess)
        (void)rt->get_last_error();
}

/* How long interpreter exit waits, at most, for pending releases' events. */
#define CDL_EXIT_WAIT_NS 2000000000LL

/* The thread state attached to the calling thread, or NULL. From 3.12 the current thread state is the calling
 * thread's own (thread-local): one that is there is attached here, wherever it was made. Before, it is the
 * process's, the GIL holder's on whichever thread: it is this thread's only if it is the state the GIL-state
 * API keeps for this thread. Pointers are compared, never followed: another thread's state may be freed
 * meanwhile. (So before 3.12 a thread holding the GIL under a state the GIL-state API did not give it, a
 * legacy subinterpreter's or one made on another thread, counts as holding none: the README, "Lifetime".) */
static PyThreadState *cdl_current_thread_state(void)
{
#if PY_VERSION_HEX >= 0x030D0000
    return PyThreadState_GetUnchecked();
#elif PY_VERSION_HEX >= 0x030C0000
    return _PyThreadState_UncheckedGet();
#else
    PyThreadState *current = _PyThreadState_UncheckedGet();
    return current != NULL && current == PyGILState_GetThisThreadState() ? current : NULL;
#endif
}

/* The thread state attached to the calling thread, or NULL: a thread that holds the GIL detaches around a
 * wait for the device, so a host function that needs the GIL cannot deadlock against it. */
PyThreadState *cdl_attached_thread_state(void)
{
    /* While the interpreter finalizes, a thread that let go of the GIL may not get it back (it would be
     * stopped): it waits holding it. */
    if (!Py_IsInitialized() || cdl_interpreter_finalizing())
        return NULL;
    return cdl_current_thread_state();
}

#define CDL_LEFT_BEHIND_NOTE                                                                                   \
    "cai_dlpack: a DLPack tensor made in subinterpreter %lld was released on a thread not running it; its "   \
    "Python objects are left behind (never freed): release it in its own interpreter"

/* Says (as unraisable, under whichever interpreter this thread can write in) that objects of interpreter
 * owner were left behind: a release on a thread not running owner, which is not the main interpreter. */
static void cdl_note_left_behind(PyThreadState *current, PyInterpreterState *owner)
{
    long long id = (long long)PyInterpreterState_GetID(owner);
#if PY_VERSION_HEX < 0x030C0000
    /* No state of this thread's is known to be attached, yet it may hold the GIL (under a legacy
     * subinterpreter's state): taking it could wait forever, so the note goes to stderr as it is. */
    if (current == NULL) {
        fprintf(stderr, CDL_LEFT_BEHIND_NOTE "\n", id);
        return;
    }
#endif
    PyGILState_STATE state = PyGILState_UNLOCKED;
    if (current == NULL)
        state = PyGILState_Ensure();
    cdl_pending_error pending;
    cdl_error_stash(&pending);
    PyErr_Format(PyExc_RuntimeError, CDL_LEFT_BEHIND_NOTE, id);
    PyErr_WriteUnraisable(NULL);
    cdl_error_unstash(&pending);
    if (current == NULL)
        PyGILState_Release(state);
}

int cdl_interpreter_enter(PyInterpreterState *owner, cdl_interpreter_scope *scope)
{
    scope->detached = NULL;
    scope->made = NULL;
    scope->ensured = 0;
    if (!Py_IsInitialized() || cdl_interpreter_finalizing())
        return 0;
    PyThreadState *current = cdl_current_thread_state();
    if (current != NULL && PyThreadState_GetInterpreter(current) == owner)
        return 1; /* the common case: a capsule or view dying in its own interpreter */
    /* A subinterpreter's (this single-phase module loads only there and in the main one): whether it still
     * lives cannot be asked (no API says), so nothing of it is touched from a thread not running it. */
    if (owner != PyInterpreterState_Main()) {
        cdl_note_left_behind(current, owner);
        return 0;
    }
    /* Attached to another interpreter (its own GIL and allocator from 3.12): detached meanwhile. */
    if (current != NULL)
        scope->detached = PyEval_SaveThread();
    /* The GIL-state API's state for this thread belongs to the interpreter that first ran on it: the main
     * one's is taken (or made) by PyGILState_Ensure; a thread a subinterpreter started gets a state of
     * the main interpreter for the release, made and deleted here. */
    PyThreadState *own = PyGILState_GetThisThreadState();
    if (own == NULL || PyThreadState_GetInterpreter(own) == owner) {
        scope->gil = PyGILState_Ensure();
        scope->ensured = 1;
    }
    else {
        scope->made = PyThreadState_New(owner);
        PyEval_RestoreThread(scope->made);
    }
    return 1;
}

void cdl_interpreter_leave(cdl_interpreter_scope *scope)
{
    if (scope->ensured)
        PyGILState_Release(scope->gil);
    if (scope->made != NULL) {
        PyThreadState_Clear(scope->made);
        PyThreadState_DeleteCurrent();
    }
    if (scope->detached != NULL)
        PyEval_RestoreThread(scope->detached);
}

void cdl_release_point_set(cdl_release_point *point, int64_t consumer, const cdl_array *arr)
{
    const DLDevice device = arr->device;
    point->stream = 0;
    point->device = arr->home_device;
    point->thread = 0;
    if (consumer == 0 || consumer == CDL_STREAM_NO_SYNC || !cdl_device_accessible(device.device_type) ||
        !cdl_ordered_release_enabled)
        return;
    /* No elements: nothing a kernel could read (and the device of its NULL pointer is only a guess). */
    for (int32_t i = 0; i < arr->ndim; i++)
        if (arr->shape[i] == 0)
            return;
    /* A device tensor may come before anything loaded the runtime (a view of another library's export asks the
     * runtime nothing): it is loaded now, or its release could not be ordered. Callers hold the GIL; an error
     * already set is theirs, and a runtime that cannot be loaded leaves the release unordered, as it must. */
    const cdl_cudart *rt = cdl_cudart_loaded();
    if (rt == NULL) {
        cdl_pending_error pending = {0}; /* stashed only when an error is set */
        const int stash = PyErr_Occurred() != NULL;
        if (stash)
            cdl_error_stash(&pending);
        rt = cdl_cudart_get();
        PyErr_Clear();
        if (stash)
            cdl_error_unstash(&pending);
    }
    if (rt == NULL || rt->event_query == NULL)
        return;
    /* The legacy and per-thread handles name a stream of a device: the data's, or for pinned and managed
     * memory (any device may use it) the caller's, as stream ordering takes them. */
    if (consumer <= CDL_STREAM_PER_THREAD && device.device_type != kDLCUDA) {
        int current;
        if (rt->get_device(&current) != cudaSuccess) {
            (void)rt->get_last_error();
            return;
        }
        point->device = current;
    }
    point->stream = consumer;
    point->thread = consumer == CDL_STREAM_PER_THREAD ? cdl_thread_serial() : 0;
}

void cdl_release_point_for_drop(cdl_release_point *point, int64_t consumer, const cdl_array *arr)
{
    /* A handle is the consumer's stream, and the consumer may destroy it once the call returns: CuPy's and Numba's
     * stream objects destroy theirs when collected, often before the tensor goes. The runtime does not check a
     * handle: any call on a destroyed one (a record, a query, even its id) reads freed memory and may crash the
     * process. So what is dropped later is ordered after a handle only where the caller said its streams outlive
     * what is made for them; the legacy and per-thread streams never go. */
    if (cdl_handle_untrusted(consumer))
        consumer = 0;
    cdl_release_point_set(point, consumer, arr);
}

/* What cdl_record_release did. */
enum { CDL_RELEASE_NOW, CDL_RECORDED, CDL_NOT_YET };

static void cdl_schedule_collection(void);

/* Run by the runtime on its own thread when a stream reaches a recorded release's event: schedules the pending
 * call. No CUDA call here, no GIL taken; Py_AddPendingCall needs only a live interpreter (cdl_schedule_collection
 * asks, under its lock, so exit cannot come between the question and the call). */
static void CUDART_CB cdl_stream_reached_release(void *unused)
{
    (void)unused;
    cdl_schedule_collection();
}

/* Records a new event on point's stream, in the stream's context, and after it a host function that schedules
 * the pending call. CDL_RECORDED with entry->event recorded and not yet complete; CDL_NOT_YET while the stream
 * captures a graph (an event recorded there would be a node of the graph, not a point in time) or, for the
 * legacy stream, while a blocking stream captures (cudaErrorStreamCaptureImplicit): the work queued before the
 * capture still runs, so the caller keeps the release and records later; CDL_RELEASE_NOW when the stream has run
 * all its work already, or the runtime refused. Any thread, no GIL needed. */
static int cdl_record_release(const cdl_cudart *rt, const cdl_release_point *point, cdl_pending *entry)
{
    int64_t stream = point->stream;
    /* Another thread's per-thread default stream cannot be named from here. The legacy stream's work comes
     * after all earlier work of every blocking stream, per-thread default streams included. */
    if (stream == CDL_STREAM_PER_THREAD && point->thread != cdl_thread_serial())
        stream = CDL_STREAM_LEGACY;
    cdl_device_scope scope;
    int entered;
    if (stream > CDL_STREAM_PER_THREAD && rt->cu_stream_get_ctx != NULL) {
        void *context;
        if (rt->cu_stream_get_ctx((void *)(uintptr_t)stream, &context) != 0)
            return 0;
        entered = cdl_context_enter(rt, context, &scope);
    }
    else {
        entered = cdl_device_enter(rt, point->device, &scope);
    }
    if (entered != 0)
        return 0;
    int recorded = CDL_RELEASE_NOW;
    entry->stream = stream;
    entry->key = (unsigned long long)point->device;
    if (scope.context != NULL && rt->cu_ctx_get_id != NULL && rt->cu_ctx_get_id(scope.context, &entry->key) != 0)
        entry->key = (unsigned long long)point->device;
    enum cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    unsigned long long capture_id;
    cudaError_t code = cdl_stream_capture_info(rt, (cudaStream_t)(uintptr_t)stream, &capture, &capture_id);
    if (code == cudaErrorStreamCaptureImplicit || (code == cudaSuccess && capture != cudaStreamCaptureStatusNone))
        recorded = CDL_NOT_YET;
    if (code == cudaSuccess && capture == cudaStreamCaptureStatusNone) {
        code = cdl_take_event(rt, entry->key, &entry->event);
        if (code == cudaSuccess) {
            code = rt->event_record(entry->event, (cudaStream_t)(uintptr_t)stream);
            if (code == cudaErrorInvalidResourceHandle || code == cudaErrorContextIsDestroyed) {
                /* A spare event of a context that was reset under the same key: a new one, once. */
                (void)rt->get_last_error();
                (void)rt->event_destroy(entry->event);
                code = rt->event_create_with_flags(&entry->event, cudaEventDisableTiming);
                if (code == cudaSuccess)
                    code = rt->event_record(entry->event, (cudaStream_t)(uintptr_t)stream);
            }
            /* A stream with nothing left to run: its event has completed already, and nothing waits. The query
             * is made in relaxed mode, as cdl_release_completed's are. */
            cudaError_t done = cudaErrorNotReady;
            if (code == cudaSuccess) {
                cdl_capture_mode_scope relaxed;
                cdl_capture_mode_relax(rt, &relaxed);
                done = rt->event_query(entry->event);
                cdl_capture_mode_leave(rt, &relaxed);
                if (done != cudaSuccess && done != cudaErrorNotReady)
                    (void)rt->get_last_error();
            }
            if (code != cudaSuccess)
                (void)rt->event_destroy(entry->event);
            else if (done == cudaSuccess)
                cdl_give_event(rt, entry->key, entry->event);
            if (code == cudaSuccess && done != cudaSuccess) {
                recorded = CDL_RECORDED;
                /* Without it the release waits for the next conversion, deleter or pending call. */
                if (rt->launch_host_func != NULL &&
                    rt->launch_host_func((cudaStream_t)(uintptr_t)stream, cdl_stream_reached_release, NULL) !=
                        cudaSuccess)
                    (void)rt->get_last_error();
            }
        }
    }
    if (code != cudaSuccess)
        (void)rt->get_last_error(); /* ours (the legacy stream's query while a capture runs, a dead stream) */
    (void)cdl_device_leave(rt, &scope);
    return recorded;
}

/* Waits for entry's event, the calling thread detached from the interpreter while it waits, in relaxed capture
 * mode (cudaEventSynchronize is prohibited, as cudaEventQuery is, while a global-mode capture runs, and would
 * invalidate it). 1 once the event completed; 0 when the runtime refused the wait (the release stays pending). */
static int cdl_wait_for(const cdl_cudart *rt, cdl_pending *entry)
{
    PyThreadState *attached = cdl_attached_thread_state();
    if (attached != NULL)
        attached = PyEval_SaveThread();
    cdl_capture_mode_scope relaxed;
    cdl_capture_mode_relax(rt, &relaxed);
    cudaError_t code = rt->event_synchronize(entry->event);
    if (code != cudaSuccess)
        (void)rt->get_last_error();
    cdl_capture_mode_leave(rt, &relaxed);
    if (attached != NULL)
        PyEval_RestoreThread(attached);
    return code == cudaSuccess;
}

/* Puts entry back at the head of the pending list (it is older than all there). Lock held. */
static void cdl_push_oldest(cdl_pending *entry)
{
    entry->next = cdl_pending_head;
    cdl_pending_head = entry;
    if (cdl_pending_tail == NULL)
        cdl_pending_tail = entry;
}

/* How many releases the calling thread is making. A release may drop what holds other ordered releases (a
 * finalizer converts and drops; an object held views): they queue, and the bound is held once the outermost
 * release returned (cdl_hold_to_bound), never by a wait inside a release, which would finish an older release
 * that may queue one more, and so on down the list (a host wait and a level of recursion each). */
static _Thread_local int cdl_releasing;

/* The argument of the release this thread is making because its event completed, or NULL: set for each release
 * made, whatever its nesting (a release a release makes answers for itself, never for the one around it). */
static _Thread_local const void *cdl_reached_argument;

int cdl_release_reached(const void *argument)
{
    return argument != NULL && argument == cdl_reached_argument;
}

static void cdl_call_release(cdl_release_fn release, void *argument, int reached)
{
    const void *outer = cdl_reached_argument;
    cdl_reached_argument = reached ? argument : NULL;
    release(argument);
    cdl_reached_argument = outer;
}

/* Makes a release taken from the pending list (reached: because its event completed), and frees its entry. */
static void cdl_release_entry(cdl_pending *entry, int reached)
{
    cdl_releasing++;
    cdl_call_release(entry->release, entry->argument, reached);
    cdl_releasing--;
    free(entry);
}

/* entry's event has completed, or erred (entry->reached says which): its event goes back, its release is made. */
static void cdl_finish(const cdl_cudart *rt, cdl_pending *entry)
{
    cdl_give_event(rt, entry->key, entry->event);
    cdl_release_entry(entry, entry->reached);
}

/* Run by the interpreter soon after a release was queued and when a stream reaches a release's event
 * (Py_AddPendingCall), in the main thread. */
static int cdl_pending_call(void *unused)
{
    (void)unused;
    cdl_pending_call_scheduled = 0;
    cdl_release_completed();
    return 0;
}

/* Whether the pending call may still be scheduled: cleared at exit, under cdl_schedule_lock, after which no host
 * function of ours touches the interpreter. */
static cdl_lock cdl_schedule_lock = CDL_LOCK_INITIALIZER;
static int cdl_schedule_allowed = 1;

/* Schedules the pending call unless it is scheduled already. Any thread, GIL or not (the runtime's own thread). */
static void cdl_schedule_collection(void)
{
    if (cdl_pending_call_scheduled)
        return;
    cdl_lock_acquire(&cdl_schedule_lock);
    /* Py_AddPendingCall needs neither the GIL nor a thread state; only a live interpreter. */
    if (cdl_schedule_allowed && !cdl_pending_call_scheduled && Py_IsInitialized() && !cdl_interpreter_finalizing()) {
        cdl_pending_call_scheduled = 1;
        if (Py_AddPendingCall(cdl_pending_call, NULL) < 0)
            cdl_pending_call_scheduled = 0;
    }
    cdl_lock_release(&cdl_schedule_lock);
}

/* Past the bound, the oldest releases with an event are waited for and made, one at a time, until at most
 * CDL_PENDING_LIMIT wait: memory held back stays bounded (but for releases whose stream captures: they have
 * nothing to wait for yet). A release made here may queue more (counted by the next turn); a wait the runtime
 * refuses (a capture prohibits it, or any error) keeps that release pending, never made before its stream ran,
 * and ends the turns. Only outside any release of this thread's, and never once exit began (cdl_exiting). */
static void cdl_hold_to_bound(const cdl_cudart *rt)
{
    while (cdl_pending_count > CDL_PENDING_LIMIT && !cdl_exiting) {
        cdl_pending *oldest = NULL, *before = NULL;
        cdl_lock_acquire(&cdl_pending_lock);
        if (cdl_pending_count > CDL_PENDING_LIMIT) {
            for (oldest = cdl_pending_head; oldest != NULL && !oldest->recorded; oldest = oldest->next)
                before = oldest;
            if (oldest != NULL) {
                if (before != NULL)
                    before->next = oldest->next;
                else
                    cdl_pending_head = oldest->next;
                if (cdl_pending_tail == oldest)
                    cdl_pending_tail = before;
                oldest->next = NULL;
                cdl_pending_count--;
            }
        }
        cdl_lock_release(&cdl_pending_lock);
        if (oldest == NULL)
            return;
        cdl_pending_waits++;
        if (!cdl_wait_for(rt, oldest)) {
            cdl_lock_acquire(&cdl_pending_lock);
            cdl_push_oldest(oldest);
            cdl_pending_count++;
            cdl_lock_release(&cdl_pending_lock);
            return;
        }
        oldest->reached = 1;
        cdl_finish(rt, oldest);
    }
}

void cdl_release_after(const cdl_release_point *point, cdl_release_fn release, void *argument)
{
    cdl_release_completed();
    const cdl_cudart *rt = cdl_cudart_loaded();
    cdl_pending *entry = NULL;
    int recorded = CDL_RELEASE_NOW;
    if (point->stream != 0 && cdl_ordered_release_enabled && rt != NULL && rt->event_query != NULL &&
        (entry = malloc(sizeof(cdl_pending))) != NULL)
        recorded = cdl_record_release(rt, point, entry);
    if (recorded == CDL_RELEASE_NOW) {
        free(entry);
        cdl_call_release(release, argument, 0);
        return;
    }
    entry->point = *point;
    entry->recorded = recorded == CDL_RECORDED;
    entry->reached = 0;
    entry->release = release;
    entry->argument = argument;
    entry->next = NULL;
    cdl_lock_acquire(&cdl_pending_lock);
    if (cdl_pending_tail != NULL)
        cdl_pending_tail->next = entry;
    else
        cdl_pending_head = entry;
    cdl_pending_tail = entry;
    cdl_pending_count++;
    cdl_lock_release(&cdl_pending_lock);
    if (cdl_releasing == 0)
        cdl_hold_to_bound(rt);
    cdl_schedule_collection();
}

/* Whether entry's event is on a stream already found not to have run past an older release's event in this
 * collection: events of one stream complete in order, so it is not asked. */
#define CDL_BUSY_STREAMS 16
typedef struct {
    int count;
    struct {
        int64_t stream;
        unsigned long long key, thread;
    } stream[CDL_BUSY_STREAMS];
} cdl_busy_streams;

static int cdl_stream_busy(const cdl_busy_streams *busy, const cdl_pending *entry)
{
    for (int i = 0; i < busy->count; i++)
        if (busy->stream[i].stream == entry->stream && busy->stream[i].key == entry->key &&
            busy->stream[i].thread == entry->point.thread)
            return 1;
    return 0;
}

static void cdl_note_busy(cdl_busy_streams *busy, const cdl_pending *entry)
{
    if (busy->count < CDL_BUSY_STREAMS) {
        busy->stream[busy->count].stream = entry->stream;
        busy->stream[busy->count].key = entry->key;
        busy->stream[busy->count++].thread = entry->point.thread;
    }
}

/* cdl_release_completed past its first test: kept out of line, so an export that inlines its callees (the flattened
 * cai2dlpack(obj)) takes only that test. */
static __attribute__((noinline)) void cdl_release_pending(void);

void cdl_release_completed(void)
{
    if (cdl_pending_count != 0)
        cdl_release_pending();
}

static void cdl_release_pending(void)
{
    const cdl_cudart *rt = cdl_cudart_loaded();
    if (rt == NULL)
        return;
    /* The list is taken out whole and its calls made without the lock (a record takes it for a spare event);
     * what stays pending goes back in front of what was added meanwhile. */
    cdl_lock_acquire(&cdl_pending_lock);
    cdl_pending *list = cdl_pending_head;
    cdl_pending_head = cdl_pending_tail = NULL;
    cdl_lock_release(&cdl_pending_lock);
    if (list == NULL)
        return;
    /* Querying an event is prohibited while another thread captures in global mode (PyTorch's default):
     * asked in relaxed mode, it breaks no capture. */
    cdl_capture_mode_scope relaxed;
    cdl_capture_mode_relax(rt, &relaxed);
    cdl_pending *done = NULL, **done_tail = &done, *kept = NULL, **kept_tail = &kept, *kept_last = NULL;
    cdl_busy_streams busy = {0};
    Py_ssize_t made = 0;
    /* Every release is looked at, whatever its stream (one not yet complete holds back none of another stream);
     * a stream's later releases are not asked once one of its releases is found incomplete. */
    while (list != NULL) {
        cdl_pending *entry = list;
        list = entry->next;
        entry->next = NULL;
        int complete;
        if (!entry->recorded) {
            /* Its stream captured when it was dropped: recorded once the stream is outside the capture. */
            int recorded = cdl_record_release(rt, &entry->point, entry);
            entry->recorded = recorded == CDL_RECORDED;
            complete = recorded == CDL_RELEASE_NOW;
        }
        else if (cdl_stream_busy(&busy, entry)) {
            complete = 0;
        }
        else {
            cudaError_t code = rt->event_query(entry->event);
            if (code != cudaSuccess && code != cudaErrorNotReady)
                (void)rt->get_last_error(); /* the event's context is gone, and nothing of its work still runs */
            complete = code != cudaErrorNotReady;
            entry->reached = code == cudaSuccess;
            if (!complete)
                cdl_note_busy(&busy, entry);
        }
        if (complete) {
            *done_tail = entry;
            done_tail = &entry->next;
            made++;
        }
        else {
            *kept_tail = entry;
            kept_tail = &entry->next;
            kept_last = entry;
        }
    }
    cdl_capture_mode_leave(rt, &relaxed);
    cdl_lock_acquire(&cdl_pending_lock);
    if (kept != NULL) {
        *kept_tail = cdl_pending_head;
        if (cdl_pending_head == NULL)
            cdl_pending_tail = kept_last;
        cdl_pending_head = kept;
    }
    cdl_pending_count -= made;
    cdl_lock_release(&cdl_pending_lock);
    while (done != NULL) {
        cdl_pending *next = done->next;
        if (done->recorded)
            cdl_finish(rt, done);
        else
            cdl_release_entry(done, 0);
        done = next;
    }
    if (made > 0 && cdl_releasing == 0)
        cdl_hold_to_bound(rt); /* what the releases made queued */
}

/* Two references released together, in their interpreter (any thread); left to a finalizing interpreter. */
typedef struct {
    PyObject *a, *b;
    PyInterpreterState *interpreter;
} cdl_object_pair;

static void cdl_release_pair(void *argument)
{
    cdl_object_pair *pair = argument;
    cdl_interpreter_scope scope;
    if (cdl_interpreter_enter(pair->interpreter, &scope)) {
        Py_XDECREF(pair->a);
        Py_XDECREF(pair->b);
        cdl_interpreter_leave(&scope);
    }
    free(pair);
}

void cdl_release_objects_after(const cdl_release_point *point, PyObject *a, PyObject *b)
{
    if (point->stream == 0 || (a == NULL && b == NULL))
        return;
    cdl_object_pair *pair = malloc(sizeof(cdl_object_pair));
    if (pair == NULL)
        return; /* nothing held: the source lives as long as its producer keeps it, as before */
    pair->a = Py_XNewRef(a);
    pair->b = Py_XNewRef(b);
    pair->interpreter = PyInterpreterState_Get();
    cdl_release_after(point, cdl_release_pair, pair);
}

/* ---- the module's side: exit, and the tests' two functions ------------------------------------- */

static long long cdl_now_ns(void)
{
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (long long)now.tv_sec * 1000000000LL + now.tv_nsec;
}

/* At interpreter exit (atexit, while objects still live): pending releases are waited for, at most
 * CDL_EXIT_WAIT_NS in all, polling without the GIL; what is still pending then is never released (its memory
 * may still be read; the process is ending and the context goes with it). */
static PyObject *cdl_release_pending_at_exit(PyObject *module, PyObject *unused)
{
    (void)module, (void)unused;
    const long long deadline = cdl_now_ns() + CDL_EXIT_WAIT_NS;
    /* The module is initialized once per process (single-phase init), so its handler is registered with the atexit
     * of the first interpreter that imports it, which may be a subinterpreter that ends long before the process. */
    const int process_ends = PyInterpreterState_Get() == PyInterpreterState_Main();
    if (process_ends)
        cdl_exiting = 1;
    cdl_release_completed();
    while (cdl_pending_count > 0 && cdl_now_ns() < deadline) {
        Py_BEGIN_ALLOW_THREADS
        struct timespec pause = {0, 1000000};
        nanosleep(&pause, NULL);
        Py_END_ALLOW_THREADS
        cdl_release_completed();
    }
    /* From here a stream reaching a release schedules nothing: the interpreter is going. */
    if (process_ends) {
        cdl_lock_acquire(&cdl_schedule_lock);
        cdl_schedule_allowed = 0;
        cdl_lock_release(&cdl_schedule_lock);
    }
    Py_RETURN_NONE;
}

static PyMethodDef cdl_exit_method = {"_release_pending_at_exit", cdl_release_pending_at_exit, METH_NOARGS, NULL};

int cdl_ordered_release_init(PyObject *module)
{
    PyObject *function = PyCFunction_NewEx(&cdl_exit_method, NULL, PyModule_GetNameObject(module));
    PyObject *atexit = function ? PyImport_ImportModule("atexit") : NULL;
    PyObject *done = atexit ? PyObject_CallMethod(atexit, "register", "O", function) : NULL;
    Py_XDECREF(done);
    Py_XDECREF(atexit);
    Py_XDECREF(function);
    return done ? 0 : -1;
}

PyObject *cdl_pending_releases(PyObject *module, PyObject *unused)
{
    (void)module, (void)unused;
    cdl_release_completed();
    return Py_BuildValue("{s:n, s:i, s:n, s:O}", "pending", (Py_ssize_t)cdl_pending_count, "limit",
                         CDL_PENDING_LIMIT, "waited", (Py_ssize_t)cdl_pending_waits, "enabled",
                         cdl_ordered_release_enabled ? Py_True : Py_False);
}

PyObject *cdl_set_ordered_release(PyObject *module, PyObject *enabled)
{
    if (!PyBool_Check(enabled)) {
        PyErr_Format(PyExc_TypeError, "_set_ordered_release(enabled) takes a bool, not %.200s",
                     Py_TYPE(enabled)->tp_name);
        return NULL;
    }
    cdl_ordered_release_enabled = enabled == Py_True;
    return cdl_pending_releases(module, NULL);
}
