/*
 * test_exact_stats.c - exact_peak_stats (the default) under concurrency, in
 * both ways the device writes its statistics: under the stats lock, and
 * shared (fetch-add on each current value, compare-and-swap on each peak),
 * which a device turns to once its stats lock is found taken often. Threads
 * on their own streams meet at barriers holding a block each, so the exact
 * peaks are known; a second test lets contention turn the device shared in
 * the middle of a run, private pools included, and checks every count after.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>

#include "cca.h"
#include "check.h"
#include "device.h"
#include "runtime.h"
#include "cca_backend.h"
#include "harness.h"

#define THREADS 8
#define ROUNDS 100
#define PAIRS 20000

static pthread_barrier_t barrier;

/* Thread id's block size in the barrier rounds: every thread a different one. */
static size_t round_size(uintptr_t id)
{
    return (id + 1) * 1536 + 100;
}

static void *barrier_worker(void *arg)
{
    uintptr_t id = (uintptr_t)arg;
    cca_stream_t stream = (cca_stream_t)(0x1000 + id * 0x100);
    for (int r = 0; r < ROUNDS; r++) {
        void *p = NULL;
        cca_malloc_device(&p, round_size(id), 0, stream);
        pthread_barrier_wait(&barrier); /* every thread holds its block here */
        cca_free(p);
        pthread_barrier_wait(&barrier);
    }
    return NULL;
}

static void start(const char *settings)
{
    cca_sim_config_t cfg = {0};
    cfg.devices = 1;
    cca_backend_t *sim;
    expect_ok(cca_sim_create(&cfg, &sim));
    expect_ok(cca_init_with_backend(sim, settings));
}

static void expect_invariants(void)
{
    char why[512] = "";
    expect_ok(alloc_check_invariants(why, sizeof(why)));
    if (why[0])
        printf("  %s\n", why);
}

/* Peaks equal the sum of the blocks all threads held at once, locked and shared. */
TEST(exact_peaks_across_threads)
{
    for (int shared = 0; shared < 2; shared++) {
        start("");
        if (shared)
            atomic_store(&cca_state->devices[0].stats_shared, true);
        pthread_barrier_init(&barrier, NULL, THREADS);
        pthread_t t[THREADS];
        for (uintptr_t i = 0; i < THREADS; i++)
            pthread_create(&t[i], NULL, barrier_worker, (void *)i);
        for (int i = 0; i < THREADS; i++)
            pthread_join(t[i], NULL);
        pthread_barrier_destroy(&barrier);
        int64_t bytes = 0, requested = 0;
        for (uintptr_t i = 0; i < THREADS; i++) {
            bytes += (int64_t)((round_size(i) + 511) / 512 * 512);
            requested += (int64_t)round_size(i);
        }
        cca_device_stats_t s;
        expect_ok(cca_get_device_stats(0, &s));
        expect_eq_i64(s.allocation[CCA_STAT_ALL].peak, THREADS);
        expect_eq_i64(s.allocation[CCA_STAT_SMALL_POOL].peak, THREADS);
        expect_eq_i64(s.active[CCA_STAT_ALL].peak, THREADS);
        expect_eq_i64(s.allocated_bytes[CCA_STAT_ALL].peak, bytes);
        expect_eq_i64(s.active_bytes[CCA_STAT_SMALL_POOL].peak, bytes);
        expect_eq_i64(s.requested_bytes[CCA_STAT_ALL].peak, requested);
        expect_eq_i64(s.allocation[CCA_STAT_ALL].current, 0);
        expect_eq_i64(s.allocation[CCA_STAT_ALL].allocated, (int64_t)THREADS * ROUNDS);
        expect_eq_i64(s.allocation[CCA_STAT_ALL].freed, (int64_t)THREADS * ROUNDS);
        expect_eq_i64(s.allocated_bytes[CCA_STAT_ALL].freed, bytes * ROUNDS);
        expect_eq_i64(s.requested_bytes[CCA_STAT_SMALL_POOL].allocated, requested * ROUNDS);
        if (shared) /* (the locked run may turn shared too, when the threads meet on the lock) */
            expect_true(atomic_load(&cca_state->devices[0].stats_shared));
        expect_invariants();
        /* reset: peaks to the (zero) currents, counts to zero */
        expect_ok(cca_reset_peak_stats(0));
        expect_ok(cca_reset_accumulated_stats(0));
        expect_ok(cca_get_device_stats(0, &s));
        expect_eq_i64(s.allocated_bytes[CCA_STAT_ALL].peak, 0);
        expect_eq_i64(s.allocation[CCA_STAT_ALL].allocated, 0);
        expect_eq_i64(s.active_bytes[CCA_STAT_LARGE_POOL].freed, 0);
        cca_shutdown();
    }
}

static void *pair_worker(void *arg)
{
    uintptr_t id = (uintptr_t)arg;
    cca_stream_t stream = (cca_stream_t)(0x1000 + id * 0x100);
    void *keep = NULL;
    cca_malloc_device(&keep, (id + 2) << 20, 0, stream); /* a large block for the whole run */
    for (int i = 0; i < PAIRS; i++) {
        void *p = NULL;
        cca_malloc_device(&p, 512 + (size_t)(i % 7) * 1000, 0, stream);
        cca_free(p);
    }
    cca_free(keep);
    return NULL;
}

static void *stats_reader(void *arg)
{
    atomic_int *running = arg;
    cca_device_stats_t s;
    while (atomic_load(running))
        cca_get_device_stats(0, &s);
    return NULL;
}

/* Contention may turn the device shared mid-run; the totals stay exact either way. */
TEST(counts_exact_through_the_switch)
{
    start("");
    cca_mempool_id_t id = {1, 1};
    expect_ok(cca_pool_create(0, id));
    /* thread 0's stream goes to a private pool, whose blocks count in the device's
     * statistics too (their counts by atomics once shared) */
    expect_ok(cca_begin_allocate_stream_to_pool(0, id, (cca_stream_t)0x1000));
    pthread_t t[THREADS], rd;
    atomic_int running = 1;
    pthread_create(&rd, NULL, stats_reader, &running);
    for (uintptr_t i = 0; i < THREADS; i++)
        pthread_create(&t[i], NULL, pair_worker, (void *)i);
    for (int i = 0; i < THREADS; i++)
        pthread_join(t[i], NULL);
    atomic_store(&running, 0);
    pthread_join(rd, NULL);
    expect_ok(cca_end_allocate_to_pool(0, id));
    expect_ok(cca_release_pool(0, id));
    cca_device_stats_t s;
    expect_ok(cca_get_device_stats(0, &s));
    int64_t ops = (int64_t)THREADS * (PAIRS + 1);
    expect_eq_i64(s.allocation[CCA_STAT_ALL].current, 0);
    expect_eq_i64(s.allocation[CCA_STAT_ALL].allocated, ops);
    expect_eq_i64(s.allocation[CCA_STAT_ALL].freed, ops);
    expect_eq_i64(s.active[CCA_STAT_SMALL_POOL].allocated, (int64_t)THREADS * PAIRS);
    expect_eq_i64(s.active[CCA_STAT_LARGE_POOL].allocated, THREADS);
    expect_eq_i64(s.allocated_bytes[CCA_STAT_ALL].current, 0);
    expect_eq_i64(s.requested_bytes[CCA_STAT_ALL].current, 0);
    expect_eq_i64(s.allocated_bytes[CCA_STAT_ALL].allocated, s.allocated_bytes[CCA_STAT_ALL].freed);
    expect_true(s.allocation[CCA_STAT_ALL].peak >= 2);
    expect_true(s.allocation[CCA_STAT_ALL].peak <= 2 * THREADS);
    printf("  statistics %s at the end\n",
           atomic_load(&cca_state->devices[0].stats_shared) ? "shared" : "still locked");
    expect_invariants();
    cca_shutdown();
}

/* The first stream's pool writes the statistics under its own lock alone until a second
 * stream pool appears; the values run on unchanged through the hand-over. */
TEST(only_pool_then_two)
{
    start("");
    cca_device_t *dev = &cca_state->devices[0];
    void *a = NULL, *b = NULL, *c = NULL;
    expect_ok(cca_malloc_device(&a, 3000, 0, (cca_stream_t)0x1000));
    expect_true(atomic_load(&dev->stats_solo) != NULL);
    expect_true(ptrmap_solo(cca_state->ptrmap) == &atomic_load(&dev->stats_solo)->lock);
    expect_ok(cca_malloc_device(&b, 5 << 20, 0, (cca_stream_t)0x1000));
    expect_ok(cca_free(a));
    expect_ok(cca_malloc_device(&c, 700, 0, (cca_stream_t)0x2000)); /* a second pool */
    expect_true(atomic_load(&dev->stats_solo) == NULL);
    expect_true(ptrmap_solo(cca_state->ptrmap) == NULL); /* the map's shards take over */
    expect_ok(cca_malloc_device(&a, 3000, 0, (cca_stream_t)0x1000));
    cca_device_stats_t s;
    expect_ok(cca_get_device_stats(0, &s));
    expect_eq_i64(s.allocation[CCA_STAT_ALL].current, 3);
    expect_eq_i64(s.allocation[CCA_STAT_ALL].peak, 3);
    expect_eq_i64(s.allocation[CCA_STAT_ALL].allocated, 4);
    expect_eq_i64(s.allocation[CCA_STAT_SMALL_POOL].current, 2);
    expect_eq_i64(s.allocated_bytes[CCA_STAT_ALL].current, 3072 + (5 << 20) + 1024);
    expect_eq_i64(s.requested_bytes[CCA_STAT_ALL].peak, 3000 + (5 << 20) + 700);
    expect_invariants();
    expect_ok(cca_free(a));
    expect_ok(cca_free(b));
    expect_ok(cca_free(c));
    expect_ok(cca_get_device_stats(0, &s));
    expect_eq_i64(s.allocation[CCA_STAT_ALL].current, 0);
    expect_eq_i64(s.allocation[CCA_STAT_ALL].freed, 4);
    expect_eq_i64(s.requested_bytes[CCA_STAT_ALL].peak, 3000 + (5 << 20) + 700);
    expect_invariants();
    cca_shutdown();
}

static atomic_int solo_pairs; /* pairs the first stream's thread has made */

static void *solo_worker(void *arg)
{
    void **handed = arg; /* blocks left for the main thread to free */
    cca_stream_t stream = (cca_stream_t)0x1000;
    for (int i = 0; i < PAIRS; i++) {
        void *p = NULL;
        expect_ok(cca_malloc_device(&p, 512 + (size_t)(i % 5) * 512, 0, stream));
        if (i % 1000 == 0 && i / 1000 < 8)
            handed[i / 1000] = p; /* freed later by another thread, on another pool's terms */
        else
            expect_ok(cca_free(p));
        atomic_store(&solo_pairs, i + 1);
    }
    return NULL;
}

/*
 * The only stream pool guards the statistics and the pointer map alone (no
 * stats lock, no map shard lock) while a thread makes pairs on it; a second
 * stream pool made by another thread in the middle of that ends both, the
 * pairs running on; blocks allocated then are freed by the other thread.
 */
TEST(solo_ends_under_pairs)
{
    start("");
    void *handed[8] = {0};
    atomic_store(&solo_pairs, 0);
    pthread_t t;
    pthread_create(&t, NULL, solo_worker, handed);
    while (atomic_load(&solo_pairs) < PAIRS / 4) {
        /* the worker's pool is the only one until this thread makes a second */
    }
    void *other = NULL;
    expect_ok(cca_malloc_device(&other, 4096, 0, (cca_stream_t)0x2000));
    expect_true(ptrmap_solo(cca_state->ptrmap) == NULL);
    pthread_join(t, NULL);
    for (int i = 0; i < 8; i++)
        expect_ok(cca_free(handed[i]));
    expect_ok(cca_free(other));
    expect_status(cca_free(other), CCA_ERR_INVALID_POINTER);
    cca_device_stats_t s;
    expect_ok(cca_get_device_stats(0, &s));
    expect_eq_i64(s.allocation[CCA_STAT_ALL].current, 0);
    expect_eq_i64(s.allocation[CCA_STAT_ALL].allocated, PAIRS + 1);
    expect_eq_i64(s.allocation[CCA_STAT_ALL].freed, PAIRS + 1);
    expect_eq_i64(s.allocated_bytes[CCA_STAT_ALL].current, 0);
    expect_eq_i64(s.requested_bytes[CCA_STAT_ALL].current, 0);
    expect_eq_i64(s.allocated_bytes[CCA_STAT_ALL].allocated, s.allocated_bytes[CCA_STAT_ALL].freed);
    expect_true(s.allocation[CCA_STAT_ALL].peak >= 9);
    expect_invariants();
    cca_shutdown();
}

int main(void)
{
    RUN(solo_ends_under_pairs);
    RUN(only_pool_then_two);
    RUN(exact_peaks_across_threads);
    RUN(counts_exact_through_the_switch);
    return harness_done();
}
