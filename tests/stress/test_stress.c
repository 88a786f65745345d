/*
 * test_stress.c - a deterministic multi-threaded stress test of the device
 * allocator on a backed simulated device: 16 worker threads on 16 streams
 * allocate blocks of both pools, fill them with a pattern and hand them
 * through a shared queue, so most frees happen on another thread than the
 * allocation; blocks are recorded on other streams before free, and a
 * completer thread completes the streams' events. Workers also empty the
 * cache and read the statistics. Each block's pattern is checked before it
 * is freed (a block handed out twice, or reused before its events, shows up
 * as a corrupted pattern). Two workers capture: every 150 operations they
 * route their stream to a private pool of their own (a graph) or end that
 * route and release the pool; a third routes its thread to a MemPool the
 * same way; so allocations, cross-thread frees and empty_cache meet routes,
 * set-aside frees and freeable pools. At the end the invariants hold and, once
 * everything is freed and the cache emptied, the backend holds nothing.
 * The run is made twice: with plain segments, and with expandable segments
 * (32 reservations growing and unmapping under the threads, real memory
 * behind every mapped granule).
 * Out of memory: while a route is active, PyTorch's malloc releases no cached
 * block on its way to an OOM (captures_underway), so with expandable segments
 * the 8 GiB device may fill with other streams' cached granules and a worker's
 * allocation fail. Such an OOM is an expected outcome: counted, checked
 * against num_ooms, and only once the device was full (peak reserved within
 * 64 MiB of its memory: at most a large granule short). An OOM while no
 * route was active at any point of the call fails the test, as does one of
 * the 64 GiB plain-segment run.
 * A last run gives each of 8 threads a loop of its own stream repeated every
 * step (tests/plan_loop.h) under compact_memory, plans made for them
 * (plan_test_force): planned placements, their maps and the lending between
 * the threads' segments meet under the locks, blocks patterned as above,
 * while another thread reads the statistics and empties the cache (which
 * forgets the plans).
 * Another takes checkpoints of a graph's private pool, and checks its live
 * blocks, while two threads allocate on other streams (the checkpoint's walk
 * over the device's segments must read nothing the other pools' locks guard).
 * Another records annotations with fields, compile contexts and user metadata from several
 * threads around their allocations while a tracker and a reader thread read them.
 * Fixed-seed PRNGs; no sleeps. STRESS_OPS overrides the operations per thread,
 * STRESS_MEMORY_MB the memory of the 8 GiB devices (a small one makes OOMs
 * under routes frequent).
 */
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "runtime.h"
#include "device.h"
#include "harness.h"
#include "plan.h"
#include "plan_loop.h"

#define THREADS 16
#define STREAMS 16
#define QUEUE_CAP 128
#define KiB ((size_t)1 << 10)
#define MiB ((size_t)1 << 20)

static cca_backend_t *sim;
static cca_stream_t streams[STREAMS];

typedef struct item {
    unsigned char *ptr;
    size_t size;
    uint64_t token;   /* the pattern's seed */
} item_t;

static struct {
    pthread_mutex_t lock;
    item_t items[QUEUE_CAP];
    size_t count;
} queue = {.lock = PTHREAD_MUTEX_INITIALIZER};

static atomic_bool stop_completer;
static atomic_uint_fast64_t ops_done, bad_patterns, errors, cross_frees;
/* route_begins: counted before each begin; route_ends: after each end returned */
static atomic_uint_fast64_t route_begins, route_ends, ooms_under_routes;

static uint64_t rng_next(uint64_t *s)
{
    uint64_t x = *s += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

/* The bytes checked: the whole block when small, else both ends. */
static void pattern(item_t *it, bool write, const char *where)
{
    size_t n = it->size < 16 * KiB ? it->size : 4 * KiB;
    uint64_t s = it->token;
    bool bad = false;
    for (int end = 0; end < 2 && !bad; end++) {
        unsigned char *p = end ? it->ptr + it->size - n : it->ptr;
        for (size_t i = 0; i < n; i++) {
            unsigned char v = (unsigned char)(s >> ((i & 7) * 8)) ^ (unsigned char)(i >> 3);
            if (write)
                p[i] = v;
            else if (p[i] != v) {
                bad = true;
                break;
            }
        }
        if (it->size < 16 * KiB)
            break;
    }
    if (bad) {
        atomic_fetch_add(&bad_patterns, 1);
        printf("  pattern of block %p (%zu bytes) corrupted %s\n", (void *)it->ptr, it->size, where);
    }
}

static void check_and_free(item_t *it, uint64_t *rng)
{
    pattern(it, false, "before free");
    if (rng_next(rng) % 4 == 0 &&
        cca_record_stream(it->ptr, streams[rng_next(rng) % STREAMS]) != CCA_OK)
        atomic_fetch_add(&errors, 1);
    if (cca_free(it->ptr) != CCA_OK) {
        atomic_fetch_add(&errors, 1);
        printf("  free failed: %s\n", cca_last_error()->message);
    }
}

static size_t pick_size(uint64_t *rng)
{
    uint64_t r = rng_next(rng) % 100;
    if (r < 60)
        return 1 + rng_next(rng) % (8 * KiB);           /* small pool, small blocks */
    if (r < 85)
        return 8 * KiB + rng_next(rng) % (1 * MiB);      /* small pool, up to 1 MiB */
    if (r < 97)
        return 1 * MiB + rng_next(rng) % (8 * MiB);      /* large pool, shared segments */
    return 10 * MiB + rng_next(rng) % (6 * MiB);         /* large pool, own segments */
}

static int ops_per_thread = 3000;
static atomic_uint_fast64_t routes_begun;
static bool moving_expected; /* compact_memory with its limit off: granules move */
static bool may_oom; /* the device is small enough for caching under routes to fill it */

/* Workers 1 and 2 capture their stream into pools of their own; worker 3 uses a MemPool. */
static void toggle_route(int id, cca_stream_t stream, int op, bool *routing)
{
    cca_mempool_id_t pool = {id == 3 ? 0 : 100 + (uint64_t)(op / 300) * 8 + (uint64_t)id,
                             id == 3 ? 100 : 0};
    cca_status_t st = CCA_OK;
    if (!*routing) {
        atomic_fetch_add(&route_begins, 1);
        st = id == 3 ? cca_begin_allocate_thread_to_pool(0, pool)
                     : cca_begin_allocate_stream_to_pool(0, pool, stream);
        atomic_fetch_add(&routes_begun, 1);
    } else {
        st = cca_end_allocate_to_pool(0, pool);
        if (st == CCA_OK)
            st = cca_release_pool(0, pool); /* the graph is gone; the end of use_mem_pool */
        atomic_fetch_add(&route_ends, 1);
    }
    if (st != CCA_OK) {
        atomic_fetch_add(&errors, 1);
        printf("  route of worker %d: %s\n", id, cca_last_error()->message);
    }
    *routing = !*routing;
}

static void *worker(void *arg)
{
    int id = (int)(intptr_t)arg;
    uint64_t rng = 0x5eed0000ull + (uint64_t)id;
    cca_stream_t mine = streams[id % STREAMS];
    bool routes = id >= 1 && id <= 3, routing = false;
    for (int op = 0; op < ops_per_thread; op++) {
        if (routes && op % 150 == 0)
            toggle_route(id, mine, op, &routing);
        uint64_t r = rng_next(&rng) % 100;
        if (r < 55) {
            item_t it = {NULL, pick_size(&rng), rng_next(&rng)};
            /* no route during the call: none begun and not ended before it, none begun after */
            uint64_t begins = atomic_load(&route_begins), ends = atomic_load(&route_ends);
            cca_status_t st = cca_malloc((void **)&it.ptr, it.size, mine);
            bool routed = begins != ends || atomic_load(&route_begins) != begins;
            if (st == CCA_ERR_OUT_OF_MEMORY && routed && may_oom) {
                if (it.ptr)
                    atomic_fetch_add(&errors, 1); /* a failed call hands out nothing */
                atomic_fetch_add(&ooms_under_routes, 1);
                atomic_fetch_add(&ops_done, 1);
                continue;
            }
            if (st != CCA_OK) {
                atomic_fetch_add(&errors, 1);
                printf("  malloc(%zu) failed: %s\n", it.size, cca_last_error()->message);
                continue;
            }
            pattern(&it, true, NULL);
            pthread_mutex_lock(&queue.lock);
            bool queued = queue.count < QUEUE_CAP;
            if (queued)
                queue.items[queue.count++] = it;
            pthread_mutex_unlock(&queue.lock);
            if (!queued)
                check_and_free(&it, &rng);
        } else if (r < 95) {
            item_t it = {0};
            pthread_mutex_lock(&queue.lock);
            if (queue.count) {
                size_t i = rng_next(&rng) % queue.count;
                it = queue.items[i];
                queue.items[i] = queue.items[--queue.count];
            }
            pthread_mutex_unlock(&queue.lock);
            if (it.ptr) {
                check_and_free(&it, &rng);
                atomic_fetch_add(&cross_frees, 1);
            }
        } else if (r < 97) {
            if (cca_empty_cache() != CCA_OK)
                atomic_fetch_add(&errors, 1);
        } else {
            cca_device_stats_t s;
            cca_stat_entry_t flat[CCA_MEMORY_STATS_COUNT];
            if (cca_get_device_stats(0, &s) != CCA_OK ||
                cca_memory_stats(0, flat, CCA_MEMORY_STATS_COUNT) != CCA_OK)
                atomic_fetch_add(&errors, 1);
            /* allocated never exceeds reserved (both read under one lock) */
            if (s.allocated_bytes[CCA_STAT_ALL].current > s.reserved_bytes[CCA_STAT_ALL].current)
                atomic_fetch_add(&errors, 1);
        }
        atomic_fetch_add(&ops_done, 1);
    }
    if (routing)
        toggle_route(id, mine, ops_per_thread - 1, &routing);
    return NULL;
}

/* Completes the events recorded on the streams, one stream at a time. */
static void *completer(void *arg)
{
    (void)arg;
    uint64_t rng = 0xc0ffee;
    while (!atomic_load(&stop_completer)) {
        cca_sim_complete_stream(sim, 0, streams[rng_next(&rng) % STREAMS], false);
        sched_yield();
    }
    return NULL;
}

static void run_stress(const char *settings, size_t total_memory)
{
    const char *env = getenv("STRESS_OPS");
    if (env && atoi(env) > 0)
        ops_per_thread = atoi(env);
    may_oom = total_memory < (64ull << 30);
    env = getenv("STRESS_MEMORY_MB");
    if (may_oom && env && atoi(env) > 0)
        total_memory = (size_t)atoi(env) * MiB;
    for (int i = 0; i < STREAMS; i++)
        streams[i] = i == 0 ? NULL : (cca_stream_t)(uintptr_t)(0x10000 * (size_t)i);
    cca_sim_config_t cfg = {0};
    cfg.devices = 1;
    cfg.total_memory = total_memory;
    cfg.backed = true;
    cfg.manual_events = true;
    atomic_store(&stop_completer, false);
    atomic_store(&ops_done, 0);
    atomic_store(&bad_patterns, 0);
    atomic_store(&errors, 0);
    atomic_store(&cross_frees, 0);
    atomic_store(&routes_begun, 0);
    atomic_store(&route_begins, 0);
    atomic_store(&route_ends, 0);
    atomic_store(&ooms_under_routes, 0);
    if (cca_sim_create(&cfg, &sim) != CCA_OK || cca_init_with_backend(sim, settings) != CCA_OK) {
        HARNESS_FAIL("setup: %s", cca_last_error()->message);
        return;
    }
    cca_mempool_id_t mempool = {0, 100};
    expect_ok(cca_pool_create(0, mempool)); /* MemPool() of worker 3 */
    pthread_t workers[THREADS], comp;
    pthread_create(&comp, NULL, completer, NULL);
    for (int i = 0; i < THREADS; i++)
        pthread_create(&workers[i], NULL, worker, (void *)(intptr_t)i);
    for (int i = 0; i < THREADS; i++)
        pthread_join(workers[i], NULL);
    atomic_store(&stop_completer, true);
    pthread_join(comp, NULL);

    char why[512];
    if (alloc_check_invariants(why, sizeof(why)) != CCA_OK)
        HARNESS_FAIL("after the threads: %s", why);
    expect_ok(cca_release_pool(0, mempool)); /* ~MemPool */
    uint64_t rng = 1;
    while (queue.count) {
        item_t it = queue.items[--queue.count];
        check_and_free(&it, &rng);
    }
    expect_ok(cca_sim_complete_stream(sim, 0, NULL, true));
    expect_ok(cca_empty_cache());
    if (alloc_check_invariants(why, sizeof(why)) != CCA_OK)
        HARNESS_FAIL("at the end: %s", why);
    cca_device_stats_t s;
    expect_ok(cca_get_device_stats(0, &s));
    expect_eq_i64(s.allocated_bytes[CCA_STAT_ALL].current, 0);
    expect_eq_i64(s.reserved_bytes[CCA_STAT_ALL].current, 0);
    expect_eq_i64(s.active[CCA_STAT_ALL].current, 0);
    expect_eq_i64(s.allocation[CCA_STAT_ALL].allocated, s.allocation[CCA_STAT_ALL].freed);
    cca_sim_usage_t u;
    expect_ok(cca_sim_usage(sim, &u));
    expect_eq_u64(u.device_bytes[0], 0);
    expect_eq_u64(u.live_allocations, 0);
    expect_eq_u64(u.live_events, 0);
    expect_eq_u64(atomic_load(&bad_patterns), 0);
    expect_eq_u64(atomic_load(&errors), 0);
    expect_eq_u64(atomic_load(&ops_done), (uint64_t)THREADS * (uint64_t)ops_per_thread);
    expect_eq_u64(u.live_handles, 0);
    expect_true(atomic_load(&routes_begun) > 0);
    /* every OOM counted by the test was the device's, and came once it was full */
    uint64_t ooms = atomic_load(&ooms_under_routes);
    expect_eq_i64(s.num_ooms, (int64_t)ooms);
    if (ooms && s.reserved_bytes[CCA_STAT_ALL].peak + (int64_t)(64 * MiB) < (int64_t)total_memory)
        HARNESS_FAIL("%llu OOMs under routes with reserved bytes peaking at %lld of %zu",
                     (unsigned long long)ooms, (long long)s.reserved_bytes[CCA_STAT_ALL].peak,
                     total_memory);
    printf("stress%s%s: %d threads, %llu operations, %llu cross-thread frees, %llu routes to "
           "private pools, %llu OOMs under routes, %lld allocations, %lld segments, %lld maps, %lld "
           "unmaps\n",
           *settings ? " " : "", settings, THREADS, (unsigned long long)atomic_load(&ops_done),
           (unsigned long long)atomic_load(&cross_frees),
           (unsigned long long)atomic_load(&routes_begun), (unsigned long long)ooms,
           (long long)s.allocation[CCA_STAT_ALL].allocated, (long long)s.segment[CCA_STAT_ALL].allocated,
           *settings ? (long long)s.num_device_alloc : 0ll,
           *settings ? (long long)s.num_device_free : 0ll);
    if (strstr(settings, "compact_memory")) {
        /* moves happened on events seen complete; no event call failed, so the growth
         * path never synchronised a stream */
        cca_stat_entry_t extra[CCA_MEMORY_STATS_EXTRA_COUNT];
        expect_ok(cca_memory_stats_extra(0, extra, CCA_MEMORY_STATS_EXTRA_COUNT));
        expect_eq_str(extra[4].key, "cca.compact_pending_growths");
        expect_eq_str(extra[8].key, "cca.compact_syncs");
        printf("stress %s: %lld growths moved %lld MiB of free granules, %lld took new memory "
               "past granules still pending\n", settings, (long long)extra[3].value,
               (long long)(extra[2].value >> 20), (long long)extra[4].value);
        if (moving_expected)
            expect_true(extra[3].value > 0);
        expect_eq_i64(extra[8].value, 0);
    }
    cca_shutdown();
}

TEST(threads_streams_events) { run_stress("", 64ull << 30); }
TEST(threads_streams_events_expandable) { run_stress("expandable_segments:True", 8ull << 30); }
/* the limit on: growths take new memory below it, move granules past it (none may) */
TEST(threads_streams_events_compact) { run_stress("compact_memory:True", 8ull << 30); }

/* the limit off: every growth moves the free granules known done, from other threads' streams */
TEST(threads_streams_events_compact_moving)
{
    compact_test_limit(true);
    moving_expected = true;
    run_stress("compact_memory:True", 8ull << 30);
    moving_expected = false;
    compact_test_limit(false);
}

/* ---- planned placement under threads ------------------------------------------------- */

#define PLAN_THREADS 8
#define PLAN_STEPS 40
static atomic_bool plan_workers_done;

/* One thread's loop (plan_loop's requests and frees, each block patterned). */
static void *plan_worker(void *arg)
{
    int id = (int)(intptr_t)arg;
    static const unsigned seeds[PLAN_THREADS] = {1, 3, 4, 7, 8, 9, 10, 12};
    plan_loop_t l;
    plan_loop_init(&l, seeds[id], 48, 16, streams[id + 1]);
    item_t live[2 * PLAN_LOOP_MAX] = {{0}};
    long dies[2 * PLAN_LOOP_MAX] = {0};
    uint64_t rng = 0x91a0000ull + (uint64_t)id;
    for (int step = 0; step < PLAN_STEPS; step++) {
        for (int j = 0; j < l.n; j++, l.t++) {
            for (int k = 0; k < 2 * l.n; k++)
                if (live[k].ptr && dies[k] <= l.t) {
                    check_and_free(&live[k], &rng);
                    live[k].ptr = NULL;
                }
            int slot = (int)(l.t % (2 * l.n));
            item_t it = {NULL, l.size[j], rng_next(&rng)};
            if (cca_malloc((void **)&it.ptr, it.size, l.stream) != CCA_OK) {
                atomic_fetch_add(&errors, 1);
                printf("  plan loop %d: malloc(%zu) failed: %s\n", id, it.size, cca_last_error()->message);
                continue;
            }
            pattern(&it, true, NULL);
            live[slot] = it;
            dies[slot] = l.t + l.life[j];
        }
    }
    for (int k = 0; k < 2 * l.n; k++)
        if (live[k].ptr)
            check_and_free(&live[k], &rng);
    return NULL;
}

/* Reads the statistics and, now and then, empties the cache while the loops run. */
static void *plan_reader(void *arg)
{
    (void)arg;
    uint64_t rng = 0x7ead;
    while (!atomic_load(&plan_workers_done)) {
        cca_stat_entry_t extra[CCA_MEMORY_STATS_EXTRA_COUNT];
        cca_device_stats_t s;
        if (cca_memory_stats_extra(0, extra, CCA_MEMORY_STATS_EXTRA_COUNT) != CCA_OK ||
            cca_get_device_stats(0, &s) != CCA_OK)
            atomic_fetch_add(&errors, 1);
        if (rng_next(&rng) % 64 == 0 && cca_empty_cache() != CCA_OK)
            atomic_fetch_add(&errors, 1);
        cca_sim_complete_stream(sim, 0, streams[1 + rng_next(&rng) % PLAN_THREADS], false);
        sched_yield();
    }
    return NULL;
}

TEST(threads_planned_loops)
{
    cca_sim_config_t cfg = {0};
    cfg.devices = 1;
    cfg.total_memory = 8ull << 30;
    cfg.backed = true;
    cfg.manual_events = true;
    for (int i = 0; i < STREAMS; i++)
        streams[i] = i == 0 ? NULL : (cca_stream_t)(uintptr_t)(0x10000 * (size_t)i);
    atomic_store(&bad_patterns, 0);
    atomic_store(&errors, 0);
    atomic_store(&plan_workers_done, false);
    if (cca_sim_create(&cfg, &sim) != CCA_OK || cca_init_with_backend(sim, "compact_memory:True") != CCA_OK) {
        HARNESS_FAIL("setup: %s", cca_last_error()->message);
        return;
    }
    plan_test_force(true);
    pthread_t workers[PLAN_THREADS], reader;
    pthread_create(&reader, NULL, plan_reader, NULL);
    for (int i = 0; i < PLAN_THREADS; i++)
        pthread_create(&workers[i], NULL, plan_worker, (void *)(intptr_t)i);
    for (int i = 0; i < PLAN_THREADS; i++)
        pthread_join(workers[i], NULL);
    atomic_store(&plan_workers_done, true);
    pthread_join(reader, NULL);
    plan_test_force(false);
    char why[512];
    if (alloc_check_invariants(why, sizeof(why)) != CCA_OK)
        HARNESS_FAIL("after the threads: %s", why);
    cca_stat_entry_t extra[CCA_MEMORY_STATS_EXTRA_COUNT];
    expect_ok(cca_memory_stats_extra(0, extra, CCA_MEMORY_STATS_EXTRA_COUNT));
    expect_eq_str(extra[6].key, "cca.compact_planned_allocations");
    expect_eq_str(extra[7].key, "cca.compact_plans");
    printf("stress planned loops: %d threads, %lld plans, %lld requests placed by them, %lld missed\n",
           PLAN_THREADS, (long long)extra[7].value, (long long)extra[6].value, (long long)extra[5].value);
    expect_true(extra[7].value >= PLAN_THREADS / 2);
    expect_true(extra[6].value > 0);
    expect_ok(cca_sim_complete_stream(sim, 0, NULL, true));
    expect_ok(cca_empty_cache());
    cca_device_stats_t s;
    expect_ok(cca_get_device_stats(0, &s));
    expect_eq_i64(s.allocated_bytes[CCA_STAT_ALL].current, 0);
    expect_eq_i64(s.reserved_bytes[CCA_STAT_ALL].current, 0);
    cca_sim_usage_t u;
    expect_ok(cca_sim_usage(sim, &u));
    expect_eq_u64(u.device_bytes[0], 0);
    expect_eq_u64(u.live_handles, 0);
    expect_eq_u64(atomic_load(&bad_patterns), 0);
    expect_eq_u64(atomic_load(&errors), 0);
    cca_shutdown();
}

/* ---- checkpoints of a private pool beside other streams' allocations ------------------ */

enum { CKPT_WORKERS = 2, CKPT_ROUNDS = 3000 };
static _Atomic bool ckpt_workers_done;

/* Allocations and frees on a stream of the default pools: the first block of each of its
 * segments splits and merges, so the segment's head block changes under the pool's lock. */
static void *ckpt_worker(void *arg)
{
    cca_stream_t stream = streams[2 + (int)(intptr_t)arg];
    uint64_t rng = 0xc4e7 + (uint64_t)(intptr_t)arg;
    void *held[8] = {0};
    for (int i = 0; i < CKPT_ROUNDS; i++) {
        int k = (int)(rng_next(&rng) % 8);
        if (held[k]) {
            if (cca_free(held[k]) != CCA_OK)
                atomic_fetch_add(&errors, 1);
            held[k] = NULL;
        } else if (cca_malloc(&held[k], (size_t)(1 + rng_next(&rng) % 64) * 64 * KiB, stream) != CCA_OK) {
            atomic_fetch_add(&errors, 1);
        }
    }
    for (int k = 0; k < 8; k++)
        if (held[k] && cca_free(held[k]) != CCA_OK)
            atomic_fetch_add(&errors, 1);
    return NULL;
}

/* The checkpoint tests' set-up: one simulated device, the streams, the counters. */
static bool ckpt_setup(void)
{
    cca_sim_config_t cfg = {0};
    cfg.devices = 1;
    cfg.total_memory = 8ull << 30;
    for (int i = 0; i < STREAMS; i++)
        streams[i] = i == 0 ? NULL : (cca_stream_t)(uintptr_t)(0x10000 * (size_t)i);
    atomic_store(&errors, 0);
    atomic_store(&ckpt_workers_done, false);
    if (cca_sim_create(&cfg, &sim) != CCA_OK || cca_init_with_backend(sim, "") != CCA_OK) {
        HARNESS_FAIL("setup: %s", cca_last_error()->message);
        return false;
    }
    return true;
}

/* Their end, every block freed: the pool released once per route, the cache emptied,
 * nothing reserved, no thread's error. */
static void ckpt_teardown(cca_mempool_id_t g, int releases)
{
    for (int i = 0; i < releases; i++)
        expect_ok(cca_release_pool(0, g));
    expect_ok(cca_empty_cache());
    cca_device_stats_t s;
    expect_ok(cca_get_device_stats(0, &s));
    expect_eq_i64(s.reserved_bytes[CCA_STAT_ALL].current, 0);
    expect_eq_u64(atomic_load(&errors), 0);
    cca_shutdown();
}

/*
 * A checkpoint of a graph's private pool taken, and its live blocks checked, again and
 * again while two threads allocate on other streams. The checkpoint walks the device's
 * segments (device lock held, the private pool's streams locked) and must tell the pool's
 * own from the others without reading what the other pools' locks guard: it read each
 * segment's head block, which the other threads' splits and merges rewrite (a data race
 * under TSan, and a read of a block struct that a merge may hand back meanwhile). Now the
 * segment says which private pool it is of, fixed for its life.
 */
TEST(threads_checkpoints_beside_other_streams)
{
    if (!ckpt_setup())
        return;
    const cca_mempool_id_t g = {1, 0};
    void *in_pool[2] = {NULL, NULL};
    expect_ok(cca_begin_allocate_stream_to_pool(0, g, streams[1]));
    expect_ok(cca_malloc(&in_pool[0], 2 * MiB, streams[1]));
    expect_ok(cca_malloc(&in_pool[1], 3 * MiB, streams[1]));
    expect_ok(cca_end_allocate_to_pool(0, g));
    cca_pool_state_t *first = NULL;
    expect_ok(cca_pool_get_checkpoint(0, g, &first));
    size_t pool_segments = first ? cca_pool_state_segments(first) : 0;
    cca_pool_state_free(first);
    expect_true(pool_segments >= 1);
    pthread_t workers[CKPT_WORKERS];
    for (int i = 0; i < CKPT_WORKERS; i++)
        pthread_create(&workers[i], NULL, ckpt_worker, (void *)(intptr_t)i);
    int checkpoints = 0, mismatches = 0;
    for (int r = 0; r < 200; r++) {
        cca_pool_state_t *state = NULL;
        if (cca_pool_get_checkpoint(0, g, &state) != CCA_OK) {
            atomic_fetch_add(&errors, 1);
            break;
        }
        checkpoints += cca_pool_state_segments(state) == pool_segments;
        cca_pool_state_free(state);
        bool ok = false;
        if (cca_pool_check_live_allocations(0, g, in_pool, 2, &ok) != CCA_OK || !ok)
            mismatches++;
    }
    for (int i = 0; i < CKPT_WORKERS; i++)
        pthread_join(workers[i], NULL);
    printf("stress checkpoints: 200 taken beside %d threads, %d with the pool's %zu segment(s), %d "
           "mismatches of its live blocks\n", CKPT_WORKERS, checkpoints, pool_segments, mismatches);
    expect_eq_i64(checkpoints, 200);
    expect_eq_i64(mismatches, 0);
    char why[512];
    if (alloc_check_invariants(why, sizeof(why)) != CCA_OK)
        HARNESS_FAIL("after the threads: %s", why);
    expect_ok(cca_free(in_pool[0]));
    expect_ok(cca_free(in_pool[1]));
    ckpt_teardown(g, 1);
}

enum { POOL_FREES = 256 };
static void *pool_blocks[POOL_FREES];

/* Frees the private pool's blocks one by one, in an order that splits and merges them. */
static void *pool_freer(void *arg)
{
    (void)arg;
    for (int i = 0; i < POOL_FREES; i++) {
        int k = (i * 7) % POOL_FREES; /* 7 and 256 are coprime: each once */
        if (cca_free(pool_blocks[k]) != CCA_OK)
            atomic_fetch_add(&errors, 1);
        if (i % 8 == 0)
            sched_yield();
    }
    atomic_store(&ckpt_workers_done, true);
    return NULL;
}

/*
 * Checkpoints of a private pool taken while another thread frees that pool's own blocks
 * (the program's, allocated in the pool before its route ended, on another of its streams):
 * each checkpoint walks the pool's segments, and each free merges blocks of them under its
 * stream pool's lock. The checkpoint's checks of the pool's blocks (events pending, blocks
 * in use) walked them with the device lock only (a data race under TSan); every walk now
 * holds the pool's stream pools' locks, so each free comes before a walk or after it.
 */
TEST(threads_checkpoints_beside_frees_of_the_pool)
{
    if (!ckpt_setup())
        return;
    const cca_mempool_id_t g = {1, 0};
    void *kept = NULL;
    expect_ok(cca_begin_allocate_stream_to_pool(0, g, streams[1]));
    expect_ok(cca_malloc(&kept, 2 * MiB, streams[1]));
    expect_ok(cca_end_allocate_to_pool(0, g));
    expect_ok(cca_begin_allocate_stream_to_pool(0, g, streams[2]));
    for (int i = 0; i < POOL_FREES; i++)
        expect_ok(cca_malloc(&pool_blocks[i], (size_t)(1 + i % 16) * 16 * KiB, streams[2]));
    expect_ok(cca_end_allocate_to_pool(0, g));
    pthread_t freer;
    pthread_create(&freer, NULL, pool_freer, NULL);
    int checkpoints = 0, refused = 0;
    while (!atomic_load(&ckpt_workers_done)) {
        cca_pool_state_t *state = NULL;
        if (cca_pool_get_checkpoint(0, g, &state) == CCA_OK)
            checkpoints++;
        else
            refused++;
        cca_pool_state_free(state);
        bool same = true; /* kept alone is live once the freer is done, not before */
        if (cca_pool_check_live_allocations(0, g, &kept, 1, &same) != CCA_OK)
            refused++;
    }
    pthread_join(freer, NULL);
    printf("stress checkpoints: %d taken while another thread freed %d blocks of the pool, %d "
           "refused\n", checkpoints, POOL_FREES, refused);
    expect_true(checkpoints >= 1);
    expect_eq_i64(refused, 0);
    bool ok = false;
    expect_ok(cca_pool_check_live_allocations(0, g, &kept, 1, &ok));
    expect_true(ok); /* every other block of the pool is freed */
    char why[512];
    if (alloc_check_invariants(why, sizeof(why)) != CCA_OK)
        HARNESS_FAIL("after the threads: %s", why);
    expect_ok(cca_free(kept));
    ckpt_teardown(g, 2); /* one release for each of the two routes */
}

/*
 * Annotations with fields recorded by several threads while they allocate and free on their
 * streams, the history on: a tracker and a reader thread read every annotation's fields as
 * they come (the tracker inside the history's lock, the reader from cca_history_get's
 * copies), and every START has its END.
 */
enum { ANN_THREADS = 4, ANN_ROUNDS = 300 };
static atomic_int ann_starts, ann_ends, ann_bad;
static atomic_bool ann_done;

static void ann_tracker(const cca_trace_entry_t *e, void *arg)
{
    (void)arg;
    if ((e->compile_context && e->compile_context[0] != 't') || (e->user_metadata && e->user_metadata[0] != 't'))
        atomic_fetch_add(&ann_bad, 1); /* (each thread's name: t0 .. t3) */
    if (e->action != CCA_TRACE_USER_DEFINED)
        return;
    const char *stage = cca_trace_entry_field(e, "stage"), *name = cca_trace_entry_field(e, "name");
    if (!stage || !name || name[0] != 't' || strcmp(e->context, name))
        atomic_fetch_add(&ann_bad, 1);
    else if (!strcmp(stage, "START"))
        atomic_fetch_add(&ann_starts, 1);
    else if (!strcmp(stage, "END"))
        atomic_fetch_add(&ann_ends, 1);
    else
        atomic_fetch_add(&ann_bad, 1);
}

static void *ann_worker(void *arg)
{
    int t = (int)(intptr_t)arg;
    char name[16];
    snprintf(name, sizeof(name), "t%d", t);
    const char *keys[2] = {"name", "stage"};
    const char *start[2] = {name, "START"}, *end[2] = {name, "END"};
    for (int r = 0; r < ANN_ROUNDS; r++) {
        void *p = NULL;
        if (r % 50 == 0 && cca_set_user_metadata(name) != CCA_OK)
            atomic_fetch_add(&errors, 1);
        if (cca_record_annotation_fields(keys, start, 2) != CCA_OK || cca_push_compile_context(name) != CCA_OK ||
            cca_malloc(&p, (size_t)(1 + (r + t) % 64) * 16 * KiB, streams[1 + t]) != CCA_OK ||
            cca_free(p) != CCA_OK || cca_pop_compile_context() != CCA_OK ||
            cca_record_annotation_fields(keys, end, 2) != CCA_OK)
            atomic_fetch_add(&errors, 1);
    }
    return NULL;
}

static void *ann_reader(void *arg)
{
    (void)arg;
    while (!atomic_load(&ann_done)) {
        cca_trace_entry_t *e = NULL;
        size_t n = 0;
        if (cca_history_get(&e, &n) != CCA_OK) {
            atomic_fetch_add(&errors, 1);
            continue;
        }
        for (size_t i = 0; i < n; i++)
            if (e[i].action == CCA_TRACE_USER_DEFINED) {
                const char *k = NULL, *v = NULL;
                if (!cca_trace_entry_field_at(&e[i], 1, &k, &v) || strcmp(k, "stage") ||
                    (strcmp(v, "START") && strcmp(v, "END")))
                    atomic_fetch_add(&ann_bad, 1);
            }
        cca_history_free(e);
    }
    return NULL;
}

TEST(threads_annotations_beside_allocations)
{
    if (!ckpt_setup())
        return;
    atomic_store(&ann_starts, 0);
    atomic_store(&ann_ends, 0);
    atomic_store(&ann_bad, 0);
    atomic_store(&ann_done, false);
    expect_ok(cca_attach_trace_tracker(ann_tracker, NULL));
    expect_ok(cca_record_history(true, NULL, NULL, 512, CCA_RECORD_CONTEXT_NEVER));
    pthread_t workers[ANN_THREADS], reader;
    pthread_create(&reader, NULL, ann_reader, NULL);
    for (int t = 0; t < ANN_THREADS; t++)
        pthread_create(&workers[t], NULL, ann_worker, (void *)(intptr_t)t);
    for (int t = 0; t < ANN_THREADS; t++)
        pthread_join(workers[t], NULL);
    atomic_store(&ann_done, true);
    pthread_join(reader, NULL);
    expect_eq_i64(atomic_load(&ann_starts), ANN_THREADS * ANN_ROUNDS);
    expect_eq_i64(atomic_load(&ann_ends), ANN_THREADS * ANN_ROUNDS);
    expect_eq_i64(atomic_load(&ann_bad), 0);
    /* every push popped: the next entry has no compile context */
    void *last = NULL;
    expect_ok(cca_malloc(&last, 4096, streams[0]));
    cca_trace_entry_t *h = NULL;
    size_t n = 0;
    expect_ok(cca_history_get(&h, &n));
    expect_true(n > 0 && h[n - 1].action == CCA_TRACE_ALLOC && h[n - 1].compile_context == NULL &&
                h[n - 1].user_metadata && h[n - 1].user_metadata[0] == 't');
    cca_history_free(h);
    expect_ok(cca_free(last));
    expect_ok(cca_detach_trace_tracker(ann_tracker, NULL));
    expect_ok(cca_record_history(false, NULL, NULL, 0, CCA_RECORD_CONTEXT_NEVER));
    char why[512];
    if (alloc_check_invariants(why, sizeof(why)) != CCA_OK)
        HARNESS_FAIL("after the threads: %s", why);
    expect_ok(cca_empty_cache());
    cca_device_stats_t s;
    expect_ok(cca_get_device_stats(0, &s));
    expect_eq_i64(s.reserved_bytes[CCA_STAT_ALL].current, 0);
    expect_eq_u64(atomic_load(&errors), 0);
    cca_shutdown();
}

int main(void)
{
    RUN(threads_streams_events);
    RUN(threads_streams_events_expandable);
    RUN(threads_streams_events_compact);
    RUN(threads_streams_events_compact_moving);
    RUN(threads_planned_loops);
    RUN(threads_checkpoints_beside_other_streams);
    RUN(threads_checkpoints_beside_frees_of_the_pool);
    RUN(threads_annotations_beside_allocations);
    return harness_done();
}
