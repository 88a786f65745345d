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
