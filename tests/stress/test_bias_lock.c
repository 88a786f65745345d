/*
 * test_bias_lock.c - biased spinlocks (core/spinlock.c) under contention: a
 * lock biased to one thread keeps mutual exclusion when other threads take
 * it while the owner is inside, the owner keeps working on the lock word
 * after the revocation, and a stream pool's lock, biased to the thread that
 * made the pool, stays exact when other threads allocate and free on its
 * stream. Counters are plain (not atomic) and guarded by the lock alone: a
 * lost update or a race (TSan) fails the test.
 */
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

#include "cca.h"
#include "check.h"
#include "device.h"
#include "runtime.h"
#include "cca_backend.h"
#include "harness.h"

#define OTHERS 3
#define ROUNDS 20000

static cca_spinlock_t lock;
static uint64_t counter; /* guarded by lock */
static atomic_int owner_started;

/* counter++ with a window between the read and the write: a second thread inside
 * the lock at the same time loses an update */
static void slow_increment(void)
{
    uint64_t v = counter;
    for (volatile int k = 0; k < 64; k++)
        ;
    counter = v + 1;
}

static void *other(void *arg)
{
    (void)arg;
    while (!atomic_load(&owner_started))
        ;
    for (int i = 0; i < ROUNDS; i++) {
        cca_spin_lock(&lock);
        slow_increment();
        cca_spin_unlock(&lock);
    }
    return NULL;
}

/* The others revoke the bias of lock while its owner (this thread) is inside; every
 * increment must count. */
static void revoke_while_inside(void)
{
    counter = 0;
    atomic_store(&owner_started, 0);
    cca_spin_bias(&lock);
    if (!cca_spin_bias_available()) {
        printf("  (membarrier unavailable: no lock is biased, the plain lock is tested)\n");
        expect_true(atomic_load(&lock.owner) == NULL);
    } else {
        expect_true(atomic_load(&lock.owner) == &cca_thread_token);
    }
    pthread_t t[OTHERS];
    for (int i = 0; i < OTHERS; i++)
        pthread_create(&t[i], NULL, other, NULL);
    /* the owner's increments: biased until a thread revokes, the lock word afterwards */
    for (int i = 0; i < ROUNDS; i++) {
        cca_spin_lock(&lock);
        slow_increment();
        if (i == 1000) {
            /* the others start while the owner is inside, biased: they revoke and must
             * wait until it leaves (a long stay, so that one that did not would overlap) */
            atomic_store(&owner_started, 1);
            uint64_t v = counter;
            struct timespec t0, t1;
            clock_gettime(CLOCK_MONOTONIC, &t0);
            do
                clock_gettime(CLOCK_MONOTONIC, &t1);
            while ((t1.tv_sec - t0.tv_sec) * 1000000000L + (t1.tv_nsec - t0.tv_nsec) < 20000000L);
            expect_eq_u64(*(volatile uint64_t *)&counter, v); /* nobody else got in */
        }
        cca_spin_unlock(&lock);
    }
    for (int i = 0; i < OTHERS; i++)
        pthread_join(t[i], NULL);
    cca_spin_lock(&lock);
    expect_eq_u64(counter, (uint64_t)ROUNDS * (OTHERS + 1));
    cca_spin_unlock(&lock);
    expect_eq_i64(atomic_load(&lock.locked), 0);
    expect_eq_i64(atomic_load(&lock.busy), 0);
}

TEST(biased_lock_keeps_mutual_exclusion_through_revocation)
{
    cca_spin_init(&lock);
    revoke_while_inside();
    if (cca_spin_bias_available())
        expect_eq_i64(atomic_load(&lock.revoked), 1);
}

static void watchdog_fired(int sig)
{
    (void)sig;
    static const char msg[] = "FAIL revocation_without_membarrier: the revocation never ended\n";
    if (write(1, msg, sizeof(msg) - 1) < 0)
        _exit(2);
    _exit(1);
}

/*
 * membarrier(2) refused after the lock was biased (a seccomp filter installed since
 * registration): the revocation still ends, through the barrier by migration, keeps
 * mutual exclusion, and no lock is biased from then on. Before, the revoker retried
 * membarrier for ever, holding the lock word (this test's watchdog fired). Run late: the
 * bias stays off for the process.
 */
TEST(revocation_without_membarrier)
{
    cca_spin_init(&lock);
    cca_spin_bias(&lock);
    if (!cca_spin_bias_available()) {
        printf("  (membarrier unavailable: no lock is biased, nothing to revoke)\n");
        return;
    }
    bool was_biased = atomic_load(&lock.owner) == &cca_thread_token;
    cca_spin_test_fail_membarrier(true);
    signal(SIGALRM, watchdog_fired);
    alarm(60);
    revoke_while_inside();
    alarm(0);
    cca_spin_test_fail_membarrier(false);
    expect_true(was_biased);
    expect_eq_i64(atomic_load(&lock.revoked), 1);
    expect_false(cca_spin_bias_available());
    cca_spin_init(&lock);
    cca_spin_bias(&lock);
    expect_true(atomic_load(&lock.owner) == NULL);
}

TEST(trylock_of_a_biased_lock)
{
    cca_spin_init(&lock);
    cca_spin_bias(&lock);
    expect_true(cca_spin_trylock(&lock));
    cca_spin_unlock(&lock);
    expect_eq_i64(atomic_load(&lock.busy), 0);
    expect_eq_i64(atomic_load(&lock.locked), 0);
}

/* ---- a stream pool's lock: made by one thread, used by others ---- */

#define POOL_THREADS 4
#define POOL_ROUNDS 20000
#define STREAM ((cca_stream_t)(uintptr_t)0x5000)

static void *pool_worker(void *arg)
{
    uintptr_t id = (uintptr_t)arg;
    for (int i = 0; i < POOL_ROUNDS; i++) {
        void *p = NULL;
        size_t size = (i + id) % 3 ? 512 : 4096 * (1 + id);
        if (cca_malloc_device(&p, size, 0, STREAM) != CCA_OK)
            return (void *)1;
        if (cca_free(p) != CCA_OK)
            return (void *)1;
    }
    return NULL;
}

/* cca up on a fresh simulated device, then n cached pairs of 512 B on STREAM made by this
 * thread (its pool's lock biased to it where the system allows). */
static void setup_with_pairs(int n)
{
    cca_sim_config_t cfg = {0};
    cfg.devices = 1;
    cfg.total_memory = (size_t)1 << 34;
    cca_backend_t *sim;
    cca_shutdown();
    expect_ok(cca_sim_create(&cfg, &sim));
    expect_ok(cca_init_with_backend(sim, ""));
    void *p;
    for (int i = 0; i < n; i++) {
        expect_ok(cca_malloc_device(&p, 512, 0, STREAM));
        expect_ok(cca_free(p));
    }
}

TEST(stream_pool_lock_biased_to_its_maker_stays_exact_across_threads)
{
    /* this thread makes the pool and runs cached pairs on it (the express path) */
    setup_with_pairs(1000);
    cca_stream_pool_t *sp = pool_stream_get(&cca_state->devices[0], STREAM);
    expect_true(sp != NULL);
    if (cca_spin_bias_available())
        expect_true(atomic_load(&sp->lock.owner) == &cca_thread_token);
    pthread_t t[POOL_THREADS];
    for (uintptr_t i = 0; i < POOL_THREADS; i++)
        pthread_create(&t[i], NULL, pool_worker, (void *)i);
    void *res = (void *)pool_worker((void *)(uintptr_t)POOL_THREADS);
    expect_true(res == NULL);
    for (int i = 0; i < POOL_THREADS; i++) {
        pthread_join(t[i], &res);
        expect_true(res == NULL);
    }
    cca_device_stats_t s;
    expect_ok(cca_get_device_stats(0, &s));
    uint64_t total = 1000 + (uint64_t)(POOL_THREADS + 1) * POOL_ROUNDS;
    expect_eq_i64(s.allocation[CCA_STAT_ALL].allocated, (int64_t)total);
    expect_eq_i64(s.allocation[CCA_STAT_ALL].freed, (int64_t)total);
    expect_eq_i64(s.allocation[CCA_STAT_ALL].current, 0);
    expect_eq_i64(s.allocated_bytes[CCA_STAT_ALL].current, 0);
    expect_eq_i64(s.active_bytes[CCA_STAT_ALL].current, 0);
    expect_eq_i64(s.requested_bytes[CCA_STAT_ALL].current, 0);
    if (cca_spin_bias_available())
        expect_eq_i64(atomic_load(&sp->lock.revoked), 1);
    char why[512] = "";
    expect_ok(alloc_check_invariants(why, sizeof(why)));
    if (why[0])
        printf("  %s\n", why);
    cca_shutdown();
}

/* Where membarrier(2) is missing (or the bias is switched off), no lock is biased and
 * the pools work on the lock word alone (run last: the switch is for the process). */
TEST(without_bias_the_pool_lock_is_plain)
{
    cca_spin_bias_disable();
    expect_false(cca_spin_bias_available());
    cca_spin_init(&lock);
    cca_spin_bias(&lock);
    expect_true(atomic_load(&lock.owner) == NULL);
    setup_with_pairs(100);
    cca_stream_pool_t *sp = pool_stream_get(&cca_state->devices[0], STREAM);
    expect_true(sp && atomic_load(&sp->lock.owner) == NULL);
    cca_device_stats_t s;
    expect_ok(cca_get_device_stats(0, &s));
    expect_eq_i64(s.allocation[CCA_STAT_ALL].allocated, 100);
    expect_eq_i64(s.allocation[CCA_STAT_ALL].current, 0);
    cca_shutdown();
}

int main(void)
{
    RUN(biased_lock_keeps_mutual_exclusion_through_revocation);
    RUN(trylock_of_a_biased_lock);
    RUN(stream_pool_lock_biased_to_its_maker_stays_exact_across_threads);
    RUN(revocation_without_membarrier);
    RUN(without_bias_the_pool_lock_is_plain);
    return harness_done();
}
