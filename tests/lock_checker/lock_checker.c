/* The lock discipline of cai_dlpack's module, checked from outside it: loaded with LD_PRELOAD by
 * tests/cpu/test_locks.py, it stands in for pthread_mutex_lock and pthread_mutex_unlock. A call made from the
 * module (the cdl_lock of cdl_internal.h is a POSIX mutex before Python 3.13) that unlocks a mutex the calling
 * thread does not hold, or locks one it holds already (a deadlock), is reported on stderr and aborts; other
 * callers pass through unchecked. At exit it says how many calls it checked, so a test knows it saw the module's
 * locks at all. glibc only: the holder is read from the mutex (__data.__owner, the thread id glibc records). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

static int (*real_lock)(pthread_mutex_t *);
static int (*real_unlock)(pthread_mutex_t *);
static _Atomic unsigned long checked;

static void resolve(void)
{
    if (real_lock == NULL)
        *(void **)&real_lock = dlsym(RTLD_NEXT, "pthread_mutex_lock");
    if (real_unlock == NULL)
        *(void **)&real_unlock = dlsym(RTLD_NEXT, "pthread_mutex_unlock");
}

/* Whether the call returning to caller was made by cai_dlpack's module. */
static int from_module(const void *caller)
{
    Dl_info where;
    return dladdr(caller, &where) && where.dli_fname != NULL && strstr(where.dli_fname, "cai_dlpack/_core") != NULL;
}

static void refuse(const char *what, pthread_mutex_t *mutex)
{
    fprintf(stderr, "lock_checker: cai_dlpack's module %s (mutex %p, held by thread %d, called by thread %ld)\n", what,
            (void *)mutex, mutex->__data.__owner, (long)syscall(SYS_gettid));
    abort();
}

int pthread_mutex_lock(pthread_mutex_t *mutex)
{
    resolve();
    if (from_module(__builtin_return_address(0))) {
        checked++;
        if (mutex->__data.__owner == (int)syscall(SYS_gettid))
            refuse("locks a mutex its thread holds already", mutex);
    }
    return real_lock(mutex);
}

int pthread_mutex_unlock(pthread_mutex_t *mutex)
{
    resolve();
    if (from_module(__builtin_return_address(0))) {
        checked++;
        if (mutex->__data.__owner != (int)syscall(SYS_gettid))
            refuse("unlocks a mutex its thread does not hold", mutex);
    }
    return real_unlock(mutex);
}

__attribute__((destructor)) static void report(void)
{
    fprintf(stderr, "lock_checker: %lu calls of the module checked\n", (unsigned long)checked);
}
