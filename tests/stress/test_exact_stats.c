/*
 * test_exact_stats.c - exact_peak_stats (the default) under concurrency: each
 * stream pool logs its operations' statistics with their times, and a merge
 * applies every log's entries in time order. Threads on their own streams meet
 * at barriers holding a block each, so the exact peaks are known;
 * deterministic tests hold the stats lock while workers log (none waits until
 * its log is full), check that the merge follows the order of operations
 * across logs, and that a freed pool's log slot comes back; a last one lets
 * threads contend for a whole run, private pools included, and checks every
 * count after.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

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

/* The bytes (rounded to 512) and the requested bytes of the first n threads' blocks. */
static void round_sums(uintptr_t n, int64_t *bytes, int64_t *requested)
{
    *bytes = *requested = 0;
    for (uintptr_t i = 0; i < n; i++) {
        *bytes += (int64_t)((round_size(i) + 511) / 512 * 512);
        *requested += (int64_t)round_size(i);
    }
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

/*
 * cca up, with pools that log: the deterministic tests below hold the stats lock while
 * workers allocate, which returns only where their pools log. The clock check is a
 * measurement (a preempted read could refuse the clock, and every update would then wait
 * for the lock: those tests would hang), so it is taken as passed here; its rule has a test
 * of its own (clock_check_refuses_coarse_ticks).
 */
static void start_logged(void)
{
    stats_clock_set_usable(1);
    start("");
}

static void expect_invariants(void)
{
    char why[512] = "";
    expect_ok(alloc_check_invariants(why, sizeof(why)));
    if (why[0])
        printf("  %s\n", why);
}

/* Peaks equal the sum of the blocks all threads held at once. */
TEST(exact_peaks_across_threads)
{
    start("");
    pthread_barrier_init(&barrier, NULL, THREADS);
    pthread_t t[THREADS];
    for (uintptr_t i = 0; i < THREADS; i++)
        pthread_create(&t[i], NULL, barrier_worker, (void *)i);
    for (int i = 0; i < THREADS; i++)
        pthread_join(t[i], NULL);
    pthread_barrier_destroy(&barrier);
    int64_t bytes, requested;
    round_sums(THREADS, &bytes, &requested);
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

#define QUEUED 4

static void *queued_worker(void *arg)
{
    uintptr_t id = (uintptr_t)arg;
    void *p = NULL;
    expect_ok(cca_malloc_device(&p, round_size(id), 0, (cca_stream_t)(0x1000 + id * 0x100)));
    return p;
}

/* Entries logged and not yet merged, over the device's logs. */
static uint64_t unmerged(cca_device_t *dev)
{
    uint64_t n = 0;
    for (int i = 0; i < STATS_LOG_SLOTS; i++) {
        stats_log_t *l = atomic_load(&dev->ops->logs[i]);
        if (l)
            n += atomic_load(&l->tail) - atomic_load(&l->head);
    }
    return n;
}

/* Each of QUEUED streams' pools exists, with a segment (the allocations that follow are
 * cache hits, which take no stats lock), and the first pool's solo mode is over. */
static void warm_streams(cca_device_t *dev)
{
    for (uintptr_t i = 0; i < QUEUED; i++) {
        void *w = NULL;
        expect_ok(cca_malloc_device(&w, 100, 0, (cca_stream_t)(0x1000 + i * 0x100)));
        expect_ok(cca_free(w));
    }
    expect_true(atomic_load(&dev->stats_solo) == NULL);
}

/* One allocation made by another thread while this one holds the stats lock: it meets
 * the lock held, so its pool logs, and from then on every pool does. */
static void start_logging(cca_device_t *dev)
{
    stats_lock(dev);
    pthread_t t;
    void *p = NULL;
    pthread_create(&t, NULL, queued_worker, (void *)0);
    pthread_join(t, &p);
    stats_unlock(dev);
    expect_true(atomic_load(&dev->ops->log_count) >= 1);
    expect_ok(cca_free(p));
}

/*
 * While this thread holds the stats lock, each worker's allocation is logged
 * in its own pool's log and returns: no worker waits for the lock. Reading the
 * statistics merges the logs: the values and peaks are those of the four
 * blocks.
 */
TEST(updates_logged_while_the_stats_lock_is_held)
{
    start_logged();
    cca_device_t *dev = &cca_state->devices[0];
    warm_streams(dev);
    cca_device_stats_t s;
    expect_ok(cca_get_device_stats(0, &s)); /* everything so far merged */
    uint64_t before = dev->ops->merged;
    stats_lock(dev);
    pthread_t t[QUEUED];
    void *p[QUEUED];
    for (uintptr_t i = 0; i < QUEUED; i++)
        pthread_create(&t[i], NULL, queued_worker, (void *)i);
    for (int i = 0; i < QUEUED; i++)
        pthread_join(t[i], &p[i]); /* all returned with the lock still held */
    expect_eq_i64((int64_t)unmerged(dev), QUEUED);
    expect_eq_i64(dev->ops->cur[CCA_STAT_SMALL_POOL][OPS_ALLOCATION], 0);
    stats_unlock(dev);
    int64_t bytes, requested;
    round_sums(QUEUED, &bytes, &requested);
    expect_ok(cca_get_device_stats(0, &s));
    expect_eq_i64((int64_t)(dev->ops->merged - before), QUEUED);
    expect_eq_i64((int64_t)unmerged(dev), 0);
    expect_eq_i64(s.allocation[CCA_STAT_ALL].current, QUEUED);
    expect_eq_i64(s.allocation[CCA_STAT_ALL].peak, QUEUED);
    expect_eq_i64(s.allocated_bytes[CCA_STAT_SMALL_POOL].current, bytes);
    expect_eq_i64(s.requested_bytes[CCA_STAT_ALL].peak, requested);
    expect_invariants();
    for (int i = 0; i < QUEUED; i++)
        expect_ok(cca_free(p[i]));
    expect_ok(cca_get_device_stats(0, &s));
    expect_eq_i64(s.allocation[CCA_STAT_ALL].current, 0);
    expect_eq_i64(s.allocation[CCA_STAT_ALL].freed, 2 * QUEUED);
    cca_shutdown();
}

/*
 * The merge applies the logs' entries in the order they were made, not log by
 * log: a block on one stream live while a block on another is allocated and
 * freed counts both in the peak; two blocks never live at once do not.
 */
TEST(merge_follows_the_order_of_operations)
{
    start_logged();
    cca_device_t *dev = &cca_state->devices[0];
    warm_streams(dev);
    start_logging(dev);
    expect_ok(cca_reset_peak_stats(0));
    cca_stream_t sa = (cca_stream_t)0x1000, sb = (cca_stream_t)0x1100;
    void *a = NULL, *b = NULL;
    /* a, then b while a lives: peak a + b */
    expect_ok(cca_malloc_device(&a, 3 << 20, 0, sa));
    expect_ok(cca_malloc_device(&b, 5 << 20, 0, sb));
    expect_ok(cca_free(b));
    expect_ok(cca_free(a));
    expect_true(unmerged(dev) >= 4);
    cca_device_stats_t s;
    expect_ok(cca_get_device_stats(0, &s));
    expect_eq_i64(s.requested_bytes[CCA_STAT_ALL].peak, (3 << 20) + (5 << 20));
    expect_eq_i64(s.allocation[CCA_STAT_LARGE_POOL].peak, 2);
    /* one after the other, across the two logs: peak the larger */
    expect_ok(cca_reset_peak_stats(0));
    for (int r = 0; r < 3; r++) {
        expect_ok(cca_malloc_device(&b, 5 << 20, 0, sb));
        expect_ok(cca_free(b));
        expect_ok(cca_malloc_device(&a, 3 << 20, 0, sa));
        expect_ok(cca_free(a));
    }
    expect_ok(cca_get_device_stats(0, &s));
    expect_eq_i64(s.requested_bytes[CCA_STAT_ALL].peak, 5 << 20);
    expect_eq_i64(s.allocation[CCA_STAT_ALL].peak, 1);
    expect_eq_i64(s.allocation[CCA_STAT_ALL].current, 0);
    expect_invariants();
    cca_shutdown();
}

static atomic_int full_pairs; /* pairs the full-log worker has made */

static void *full_log_worker(void *arg)
{
    (void)arg;
    for (int i = 0; i < STATS_LOG_ENTRIES; i++) { /* 2 entries a pair: the log fills */
        void *p = NULL;
        expect_ok(cca_malloc_device(&p, 512, 0, (cca_stream_t)0x1100));
        expect_ok(cca_free(p));
        atomic_store(&full_pairs, i + 1);
    }
    return NULL;
}

/*
 * A full log waits for a merge: while this thread holds the stats lock the
 * worker fills its log and stops, its entries all there; letting go of the
 * lock lets it merge and go on, and every count comes out exact.
 */
TEST(full_log_waits_for_a_merge)
{
    start_logged();
    cca_device_t *dev = &cca_state->devices[0];
    warm_streams(dev);
    cca_device_stats_t s;
    expect_ok(cca_get_device_stats(0, &s));
    int64_t allocated = s.allocation[CCA_STAT_ALL].allocated;
    atomic_store(&full_pairs, 0);
    stats_lock(dev);
    pthread_t t;
    pthread_create(&t, NULL, full_log_worker, NULL);
    while (unmerged(dev) < STATS_LOG_ENTRIES || atomic_load(&full_pairs) < STATS_LOG_ENTRIES / 2) {
        /* the worker logs until its log is full, then waits for this lock */
    }
    expect_eq_i64((int64_t)unmerged(dev), STATS_LOG_ENTRIES);
    expect_eq_i64(atomic_load(&full_pairs), STATS_LOG_ENTRIES / 2);
    stats_unlock(dev);
    pthread_join(t, NULL);
    expect_ok(cca_get_device_stats(0, &s));
    expect_eq_i64(s.allocation[CCA_STAT_ALL].allocated - allocated, STATS_LOG_ENTRIES);
    expect_eq_i64(s.allocation[CCA_STAT_ALL].current, 0);
    expect_eq_i64(s.allocation[CCA_STAT_ALL].peak, 1);
    expect_invariants();
    cca_shutdown();
}

/* A private pool's stream pool gives its log's slot back when it is freed, its entries
 * merged first; the slot is taken again by the next pool that logs. */
TEST(log_slot_given_back)
{
    start_logged();
    cca_device_t *dev = &cca_state->devices[0];
    warm_streams(dev);
    start_logging(dev);
    uint32_t used = atomic_load(&dev->ops->log_count);
    cca_mempool_id_t id = {1, 2};
    expect_ok(cca_pool_create(0, id));
    expect_ok(cca_begin_allocate_stream_to_pool(0, id, (cca_stream_t)0x2000));
    void *b = NULL;
    expect_ok(cca_malloc_device(&b, 100, 0, (cca_stream_t)0x2000));
    expect_eq_i64(atomic_load(&dev->ops->log_count), used + 1);
    expect_true(atomic_load(&dev->ops->logs[used]) != NULL);
    expect_ok(cca_end_allocate_to_pool(0, id));
    expect_ok(cca_free(b));
    expect_ok(cca_release_pool(0, id)); /* the route's use */
    expect_ok(cca_release_pool(0, id)); /* its creation's */
    expect_ok(cca_empty_cache()); /* its segment goes: its stream pool, and the slot, free */
    expect_true(atomic_load(&dev->ops->logs[used]) == NULL);
    cca_device_stats_t s;
    expect_ok(cca_get_device_stats(0, &s));
    expect_eq_i64(s.allocation[CCA_STAT_ALL].current, 0);
    expect_eq_i64(s.allocation[CCA_STAT_ALL].allocated, QUEUED + 2);
    expect_eq_i64(s.allocation[CCA_STAT_ALL].freed, QUEUED + 2);
    /* a new private pool's stream pool takes the free slot */
    cca_mempool_id_t id2 = {1, 3};
    expect_ok(cca_pool_create(0, id2));
    expect_ok(cca_begin_allocate_stream_to_pool(0, id2, (cca_stream_t)0x3000));
    expect_ok(cca_malloc_device(&b, 100, 0, (cca_stream_t)0x3000));
    expect_true(atomic_load(&dev->ops->logs[used]) != NULL);
    expect_eq_i64(atomic_load(&dev->ops->log_count), used + 1);
    expect_ok(cca_end_allocate_to_pool(0, id2));
    expect_ok(cca_free(b));
    expect_ok(cca_release_pool(0, id2));
    expect_ok(cca_release_pool(0, id2));
    expect_invariants();
    cca_shutdown();
}

/* More logging pools than the table has slots: the ones past it apply their updates
 * under the stats lock, after a merge, and every value stays exact. */
TEST(pools_past_the_log_slots)
{
    start_logged();
    cca_device_t *dev = &cca_state->devices[0];
    warm_streams(dev);
    start_logging(dev);
    enum { STREAMS = STATS_LOG_SLOTS + 8 };
    const int64_t requested = STREAMS * 1000 + STREAMS * (STREAMS - 1) / 2; /* 1000 + i each */
    static void *p[STREAMS];
    for (uintptr_t i = 0; i < STREAMS; i++)
        expect_ok(cca_malloc_device(&p[i], 1000 + i, 0, (cca_stream_t)(0x100000 + i * 0x100)));
    expect_eq_i64(atomic_load(&dev->ops->log_count), STATS_LOG_SLOTS);
    cca_device_stats_t s;
    expect_ok(cca_get_device_stats(0, &s));
    expect_eq_i64(s.allocation[CCA_STAT_ALL].current, STREAMS);
    expect_eq_i64(s.requested_bytes[CCA_STAT_ALL].peak, requested);
    for (uintptr_t i = 0; i < STREAMS; i++)
        expect_ok(cca_free(p[i]));
    expect_ok(cca_get_device_stats(0, &s));
    expect_eq_i64(s.allocation[CCA_STAT_ALL].current, 0);
    expect_eq_i64(s.requested_bytes[CCA_STAT_ALL].current, 0);
    expect_eq_i64(s.requested_bytes[CCA_STAT_ALL].peak, requested);
    expect_invariants();
    expect_ok(cca_empty_cache()); /* the pools go with their segments, and their logs */
    expect_ok(cca_get_device_stats(0, &s));
    expect_eq_i64(s.allocation[CCA_STAT_ALL].freed, s.allocation[CCA_STAT_ALL].allocated);
    cca_shutdown();
}

static void *pair_worker(void *arg);

/* One allocation's update, added (+1) or taken back (-1), through sp's logged path. */
static void log_one(cca_stream_pool_t *sp, int sign)
{
    ops_delta_t d = {{0}};
    int8_t signs[OPS_COUNT] = {0};
    d.v[OPS_ALLOCATION] = sign;
    d.v[OPS_REQUESTED_BYTES] = sign * 100;
    pool_lock(sp);
    stats_log_append(sp, CCA_STAT_SMALL_POOL, d, signs);
    cca_spin_unlock(&sp->lock);
}

/*
 * With a clock too coarse or too slow to stamp entries, no pool logs: an update
 * that would be logged goes into the table under the stats lock (with a usable
 * clock the same call makes a log), and threads that contend for a whole run
 * keep every count exact.
 */
static void *pair_worker(void *arg);

TEST(no_logs_without_a_usable_clock)
{
    stats_clock_set_usable(2);
    start("");
    cca_device_t *dev = &cca_state->devices[0];
    warm_streams(dev);
    void *warm = NULL; /* the control's stream below: a segment, and no log asked for */
    expect_ok(cca_malloc_device(&warm, 100, 0, (cca_stream_t)0x5000));
    expect_ok(cca_free(warm));
    cca_stream_pool_t *sa = pool_stream_get(dev, (cca_stream_t)0x1000);
    cca_stream_pool_t *sb = pool_stream_get(dev, (cca_stream_t)0x1100);
    expect_true(sa && sb);
    log_one(sa, 1);
    expect_true(sa->log == NULL);
    expect_eq_i64(atomic_load(&dev->ops->log_count), 0);
    cca_device_stats_t s;
    expect_ok(cca_get_device_stats(0, &s));
    expect_eq_i64(s.allocation[CCA_STAT_ALL].current, 1);
    log_one(sa, -1);
    pthread_t w[4];
    for (uintptr_t i = 0; i < 4; i++)
        pthread_create(&w[i], NULL, pair_worker, (void *)i);
    for (int i = 0; i < 4; i++)
        pthread_join(w[i], NULL);
    expect_eq_i64(atomic_load(&dev->ops->log_count), 0);
    expect_ok(cca_get_device_stats(0, &s));
    expect_eq_i64(s.allocation[CCA_STAT_ALL].current, 0);
    expect_eq_i64(s.allocation[CCA_STAT_ALL].allocated, QUEUED + 2 + 4 * (PAIRS + 1));
    expect_eq_i64(s.allocation[CCA_STAT_ALL].freed, QUEUED + 2 + 4 * (PAIRS + 1));
    expect_eq_i64(s.requested_bytes[CCA_STAT_ALL].current, 0);
    /* the control: a usable clock, a pool that has not asked yet, and the stats lock held
     * (an update that finds it held is logged) */
    stats_clock_set_usable(1);
    stats_lock(dev);
    pthread_t t;
    void *p = NULL;
    pthread_create(&t, NULL, queued_worker, (void *)0x40); /* stream 0x5000 */
    pthread_join(t, &p);
    stats_unlock(dev);
    cca_stream_pool_t *sc = pool_stream_get(dev, (cca_stream_t)0x5000);
    expect_true(sc && sc->log != NULL);
    expect_true(sb->log == NULL); /* refused once, it does not ask again */
    expect_eq_i64(atomic_load(&dev->ops->log_count), 1);
    expect_ok(cca_free(p));
    expect_invariants();
    cca_shutdown();
    stats_clock_set_usable(0);
}

/*
 * The clock check on reads taken in a row: a clock whose tick is longer than a
 * read repeats a value and is refused, however fine clock_getres says it is
 * (a 1000 ns tick passed the check before, and two operations one after the
 * other then shared a time: a peak the merge reported that no order gave); a
 * clock that moves at every read, most reads under 500 ns apart, is taken.
 */
TEST(clock_check_refuses_coarse_ticks)
{
    enum { N = 256 };
    uint64_t fine[N], coarse[N], slow[N], arm[N];
    for (int i = 0; i < N; i++) {
        fine[i] = 1000000 + (uint64_t)i * 23;               /* a read every 23 ns, 1 ns ticks */
        coarse[i] = (1000000 + (uint64_t)i * 23) / 1000 * 1000; /* the same, 1000 ns ticks */
        arm[i] = (1000000 + (uint64_t)i * 23) / 41 * 41;       /* a 24 MHz counter */
        slow[i] = 1000000 + (uint64_t)i * 900;              /* a read every 900 ns */
    }
    expect_true(stats_clock_reads_fine(fine, N));
    expect_true(!stats_clock_reads_fine(coarse, N));
    expect_true(!stats_clock_reads_fine(arm, N));
    expect_true(!stats_clock_reads_fine(slow, N));
    expect_true(!stats_clock_reads_fine(fine, 1));
    uint64_t back[3] = {10, 30, 20}; /* a clock that goes back */
    expect_true(!stats_clock_reads_fine(back, 3));
    /* a read the thread was preempted across (4 ms) does not refuse a fine clock (before, the
     * span of all reads was the rule: one preemption refused it for the process's life, and
     * the deterministic tests here that need logs hung); most reads slow does */
    uint64_t preempted[N], mostly_slow[N];
    for (int i = 0; i < N; i++) {
        preempted[i] = fine[i] + (i >= N / 2 ? 4000000 : 0);
        mostly_slow[i] = 1000000 + (uint64_t)i * 23 + (uint64_t)(i - i / 3) * 900; /* 2 in 3 slow */
    }
    expect_true(stats_clock_reads_fine(preempted, N));
    expect_true(!stats_clock_reads_fine(mostly_slow, N));
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

/* Threads contend for the whole run; the totals stay exact. */
TEST(counts_exact_under_contention)
{
    start("");
    cca_mempool_id_t id = {1, 1};
    expect_ok(cca_pool_create(0, id));
    /* thread 0's stream goes to a private pool, whose blocks count in the device's
     * statistics too */
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
    printf("  %llu logged updates merged\n", (unsigned long long)cca_state->devices[0].ops->merged);
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
    /* one thread never meets another on the stats lock: no pool logs, each update goes
     * into the table under the lock */
    expect_eq_i64(atomic_load(&dev->ops->log_count), 0);
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

/* The same table, whatever the route: a log entry's update applied by the merge and the
 * same update applied by the locked mode as it happens. */
static bool tables_equal(const ops_table_t *a, const ops_table_t *b)
{
    return !memcmp(a->cur, b->cur, sizeof(a->cur)) && !memcmp(a->peak, b->peak, sizeof(a->peak)) &&
           !memcmp(a->n, b->n, sizeof(a->n));
}

/* A random amount of the sign given (0: either), counts small, bytes large. */
static int64_t random_amount(uint64_t *rng, int k, int sign)
{
    *rng = *rng * 6364136223846793005ull + 1442695040888963407ull;
    bool count = k == OPS_ALLOCATION || k == OPS_ACTIVE || k == OPS_INACTIVE_SPLIT || k == OPS_OVERSIZE;
    int64_t mag = count ? (int64_t)((*rng >> 40) % 3) : (int64_t)((*rng >> 24) % (1ull << 31));
    if (sign > 0)
        return mag;
    if (sign < 0)
        return -mag;
    return (*rng >> 63) ? mag : -mag;
}

/* The reference: the locked mode's update as it was first written, one statistic at a
 * time, skipping those with no amount and no sign, branching on the direction. */
static void reference_apply(ops_table_t *t, int type, const int64_t d[OPS_COUNT],
                            const int8_t sign[OPS_COUNT])
{
    for (int k = 0; k < OPS_COUNT; k++) {
        if (!sign[k] && !d[k])
            continue;
        bool up = sign[k] > 0 || (sign[k] == 0 && d[k] > 0);
        int own = k == OPS_OVERSIZE ? CCA_STAT_ALL : type;
        t->cur[own][k] += d[k];
        if (up) {
            if (t->cur[own][k] > t->peak[own][k])
                t->peak[own][k] = t->cur[own][k];
            t->n[own][k].allocated += d[k];
        } else {
            t->n[own][k].freed -= d[k];
        }
        if (up && k != OPS_OVERSIZE) {
            int64_t all = t->cur[CCA_STAT_SMALL_POOL][k] + t->cur[CCA_STAT_LARGE_POOL][k];
            if (all > t->peak[CCA_STAT_ALL][k])
                t->peak[CCA_STAT_ALL][k] = all;
        }
    }
}

/*
 * The locked mode's branch-free update (ops_apply_mode) and the merge's
 * application of a log entry (stats_entry_fill, stats_entry_apply) against the
 * reference: 200,000 random updates in both kinds with the callers' signs (an
 * allocation's, a free's, a return's, none) and amounts of those signs, some
 * 0, the peaks reset every 1,000 as cca_reset_peak_stats does; every value,
 * peak and count of the three tables equal after each update.
 */
TEST(log_entries_apply_as_the_locked_mode)
{
    static const int8_t signs[4][OPS_COUNT] = {
        {1, 1, 1, 1, 1, 0, 0, 0}, {-1, -1, 0, 0, 0, 0, 0, 0}, {0, 0, -1, -1, -1, 0, 0, 0}, {0}};
    ops_table_t *t[3];
    for (int j = 0; j < 3; j++) {
        t[j] = aligned_alloc(64, sizeof(ops_table_t));
        expect_true(t[j] != NULL);
        memset(t[j], 0, sizeof(ops_table_t));
    }
    uint64_t rng = 7;
    bool same = true;
    for (int i = 0; i < 200000 && same; i++) {
        rng = rng * 6364136223846793005ull + 1442695040888963407ull;
        int type = (rng >> 50) & 1 ? CCA_STAT_LARGE_POOL : CCA_STAT_SMALL_POOL;
        const int8_t *sign = signs[(rng >> 40) % 4];
        int64_t d[OPS_COUNT];
        for (int k = 0; k < OPS_COUNT; k++)
            d[k] = (rng >> (k + 8)) % 5 == 0 ? 0 : random_amount(&rng, k, sign[k]);
        reference_apply(t[0], type, d, sign);
        ops_apply_mode(t[1], NULL, OPS_LOCKED, type, d, sign);
        stats_entry_t e;
        stats_entry_fill(&e, type, d, sign);
        stats_entry_apply(t[2], &e);
        if (i % 1000 == 999) { /* the peaks reset: ALL's values summed, every peak its value */
            for (int j = 0; j < 3; j++) {
                for (int k = 0; k < OPS_OVERSIZE; k++)
                    t[j]->cur[CCA_STAT_ALL][k] =
                        t[j]->cur[CCA_STAT_SMALL_POOL][k] + t[j]->cur[CCA_STAT_LARGE_POOL][k];
                for (int k = 0; k < OPS_COUNT; k++)
                    for (int ty = 0; ty < (k == OPS_OVERSIZE ? 1 : CCA_STAT_TYPES); ty++)
                        t[j]->peak[ty][k] = t[j]->cur[ty][k];
            }
        }
        same = tables_equal(t[0], t[1]) && tables_equal(t[0], t[2]);
    }
    expect_true(same);
    for (int j = 0; j < 3; j++)
        free(t[j]);
}

int main(void)
{
    RUN(log_entries_apply_as_the_locked_mode);
    RUN(solo_ends_under_pairs);
    RUN(only_pool_then_two);
    RUN(exact_peaks_across_threads);
    RUN(updates_logged_while_the_stats_lock_is_held);
    RUN(merge_follows_the_order_of_operations);
    RUN(full_log_waits_for_a_merge);
    RUN(log_slot_given_back);
    RUN(pools_past_the_log_slots);
    RUN(no_logs_without_a_usable_clock);
    RUN(clock_check_refuses_coarse_ticks);
    RUN(counts_exact_under_contention);
    return harness_done();
}
