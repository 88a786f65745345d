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

static long membarrier_call(int cmd)
{
#if defined(__linux__) && defined(SYS_membarrier)
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
