/*
 * spinlock.c - the contended path of cca_spinlock_t: spin briefly reading
 * the lock word (no cache-line ping-pong), then yield the CPU, so a holder
 * that was preempted or is inside a slow backend call gets to run.
 */
#include <sched.h>

#include "internal.h"

static inline void cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

void cca_spin_backoff(unsigned spins)
{
    if (spins < 128)
        cpu_relax();
    else
        sched_yield();
}

void cca_spin_lock_slow(cca_spinlock_t *l)
{
    for (unsigned spins = 0;; spins++) {
        if (!atomic_load_explicit(&l->locked, memory_order_relaxed) &&
            !atomic_exchange_explicit(&l->locked, 1, memory_order_acquire))
            return;
        cca_spin_backoff(spins);
    }
}

/* ---- biased locks ---------------------------------------------------------------- */

#if defined(__linux__)
#include <linux/membarrier.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif
#include <errno.h>

CCA_THREAD_HOT char cca_thread_token;

/* 0: not yet asked; 1: registered; -1: unavailable or disabled */
static atomic_int bias_state;

static atomic_bool membarrier_fails; /* tests (cca_spin_test_fail_membarrier) */

void cca_spin_test_fail_membarrier(bool on)
{
    atomic_store_explicit(&membarrier_fails, on, memory_order_relaxed);
}

static long membarrier_call(int cmd)
{
#if defined(__linux__) && defined(SYS_membarrier)
    if (atomic_load_explicit(&membarrier_fails, memory_order_relaxed)) {
        errno = EPERM; /* what a seccomp filter installed since registration returns */
        return -1;
    }
    return syscall(SYS_membarrier, cmd, 0, 0);
#else
    (void)cmd;
    errno = ENOSYS;
    return -1;
#endif
}

bool cca_spin_bias_available(void)
{
    int st = atomic_load_explicit(&bias_state, memory_order_acquire);
    if (st)
        return st > 0;
    int want = -1;
#if defined(__linux__) && defined(SYS_membarrier)
    long cmds = membarrier_call(MEMBARRIER_CMD_QUERY);
    if (cmds >= 0 && (cmds & MEMBARRIER_CMD_PRIVATE_EXPEDITED) &&
        membarrier_call(MEMBARRIER_CMD_REGISTER_PRIVATE_EXPEDITED) == 0)
        want = 1;
#endif
    int expected = 0;
    if (!atomic_compare_exchange_strong_explicit(&bias_state, &expected, want, memory_order_acq_rel,
                                                 memory_order_acquire))
        want = expected; /* another thread decided (or the tests disabled it) first */
    return want > 0;
}

void cca_spin_bias_disable(void)
{
    atomic_store_explicit(&bias_state, -1, memory_order_release);
}

void cca_spin_bias(cca_spinlock_t *l)
{
    if (cca_spin_bias_available())
        atomic_store_explicit(&l->owner, &cca_thread_token, memory_order_relaxed);
}

#if defined(__linux__) && defined(SYS_membarrier)
/*
 * The barrier without membarrier(2): this thread runs on every CPU in turn. A CPU that
 * switches to it has switched out whatever thread ran there, and the scheduler puts a full
 * barrier between a thread's accesses and its switch (what membarrier itself relies on).
 * So once this thread has run on every CPU, an owner inside since before the revocation
 * has its busy flag visible here, and one that enters later sees revoked. A CPU this
 * thread may not run on (absent, offline, outside the cpuset the process's threads share)
 * is passed over: no thread of the process runs there. The thread's own CPUs are restored.
 * False: a CPU could not be reached for another reason (the caller tries again).
 */
static bool barrier_by_migration(void)
{
    cpu_set_t saved, one;
    if (sched_getaffinity(0, sizeof(saved), &saved) != 0)
        return false;
    bool ok = true;
    for (int cpu = 0; cpu < CPU_SETSIZE && ok; cpu++) {
        CPU_ZERO(&one);
        CPU_SET(cpu, &one);
        if (sched_setaffinity(0, sizeof(one), &one) != 0) {
            ok = errno == EINVAL;
        } else {
            int at = sched_getcpu(); /* moved before the call returned (-1: cannot tell) */
            ok = at == cpu || at < 0;
        }
    }
    (void)sched_setaffinity(0, sizeof(saved), &saved); /* fails only if all went offline */
    return ok;
}
#endif

/* Every running thread of the process passes a full barrier before this returns. */
static void process_barrier(void)
{
#if defined(__linux__) && defined(SYS_membarrier)
    for (;;) {
        if (membarrier_call(MEMBARRIER_CMD_PRIVATE_EXPEDITED) == 0)
            return;
        if (errno == EINTR || errno == EAGAIN)
            continue;
        /* not registered (a child of fork(), if its kernel did not carry the registration
         * over): register again, else the global barrier, which needs no registration */
        if (membarrier_call(MEMBARRIER_CMD_REGISTER_PRIVATE_EXPEDITED) == 0 &&
            membarrier_call(MEMBARRIER_CMD_PRIVATE_EXPEDITED) == 0)
            return;
        if (membarrier_call(MEMBARRIER_CMD_GLOBAL) == 0)
            return;
        /* membarrier refused (a seccomp filter installed since registration, the kernel out
         * of memory): no new lock is biased, and this revocation goes through the scheduler.
         * Only if that fails too is it tried again: entering without the barrier could let
         * two threads in at once. */
        cca_spin_bias_disable();
        if (barrier_by_migration())
            return;
        sched_yield();
    }
#endif
}

void cca_spin_bias_take(cca_spinlock_t *l)
{
    atomic_store_explicit(&l->revoked, 1, memory_order_seq_cst);
    process_barrier();
    /* the owner, inside since before the revocation, leaves */
    for (unsigned spins = 0; atomic_load_explicit(&l->busy, memory_order_acquire); spins++)
        cca_spin_backoff(spins);
}
