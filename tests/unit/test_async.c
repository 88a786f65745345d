/*
 * test_async.c - `backend:cudaMallocAsync` on the simulated backend's model
 * of a stream-ordered pool: PyTorch's set-up of the pool (release threshold,
 * reuse policies), statistics from the pool's attributes, record_stream
 * through the unifying stream, memory fraction as a hard limit, empty_cache,
 * cache_info, base allocations, faults and misuse. Graph capture as PyTorch's
 * CudaMallocAsync does it, on the simulated capture graph (where
 * malloc_async / free_async on a capturing stream are nodes and a free of an
 * allocation the capture did not make fails, as in CUDA): allocations during
 * it captured, frees of earlier allocations deferred to the first allocation
 * after it, free streams joined back into the capture stream at its end, one
 * capture at a time, the private-pool calls PyTorch refuses for this backend.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* pthread_setaffinity_np */
#endif
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <time.h>

#include "async.h"
#include "device.h"
#include "harness.h"

#define MiB ((size_t)1 << 20)
#define GiB ((size_t)1 << 30)
#define S1 ((cca_stream_t)(uintptr_t)0x1000)
#define S2 ((cca_stream_t)(uintptr_t)0x2000)

static cca_backend_t *sim;

static void setup(const char *settings)
{
    cca_sim_config_t cfg = {0};
    cfg.devices = 2;
    cfg.total_memory = GiB;
    cca_shutdown();
    if (cca_sim_create(&cfg, &sim) != CCA_OK || cca_init_with_backend(sim, settings) != CCA_OK) {
        printf("cannot set up: %s\n", cca_last_error()->message);
        exit(1);
    }
}

static cca_device_stats_t stats(int device)
{
    cca_device_stats_t s;
    expect_ok(cca_get_device_stats(device, &s));
    return s;
}

static uint64_t attr(int device, cca_mempool_attr_t a)
{
    uint64_t v = 0;
    expect_ok(sim->mempool_get_attr(sim->ctx, device, a, &v));
    return v;
}

TEST(pool_set_up_as_pytorch)
{
    setup("backend:cudaMallocAsync");
    /* nothing is set up before first use */
    expect_eq_u64(cca_sim_call_count(sim, CCA_OP_MEMPOOL_SET_ATTR), 0);
    cca_device_stats_t s = stats(0);
    expect_eq_i64(s.reserved_bytes[CCA_STAT_ALL].current, 0);
    expect_eq_u64(cca_sim_call_count(sim, CCA_OP_MEMPOOL_GET_ATTR), 0);
    void *p = NULL;
    expect_ok(cca_malloc(&p, 3 * MiB, S1));
    expect_true(p != NULL);
    expect_eq_u64(attr(0, CCA_MEMPOOL_RELEASE_THRESHOLD), UINT64_MAX);
    expect_eq_u64(attr(0, CCA_MEMPOOL_REUSE_FOLLOW_EVENT_DEPENDENCIES), 1);
    expect_eq_u64(attr(0, CCA_MEMPOOL_REUSE_ALLOW_OPPORTUNISTIC), 1);
    expect_eq_u64(attr(0, CCA_MEMPOOL_REUSE_ALLOW_INTERNAL_DEPENDENCIES), 1);
    expect_eq_u64(cca_sim_call_count(sim, CCA_OP_STREAM_CREATE), 1); /* the unifying stream */
    /* device 1 untouched */
    expect_eq_u64(attr(1, CCA_MEMPOOL_RELEASE_THRESHOLD), 0);
    expect_ok(cca_free(p));
}

TEST(statistics_are_the_pools)
{
    setup("backend:cudaMallocAsync");
    void *p = NULL, *q = NULL;
    expect_ok(cca_malloc(&p, 3 * MiB, S1));
    cca_device_stats_t s = stats(0);
    expect_eq_i64(s.allocated_bytes[CCA_STAT_ALL].current, 3 * MiB);
    expect_eq_i64(s.active_bytes[CCA_STAT_ALL].current, 3 * MiB);
    expect_eq_i64(s.reserved_bytes[CCA_STAT_ALL].current, attr(0, CCA_MEMPOOL_RESERVED_CURRENT));
    expect_true(s.reserved_bytes[CCA_STAT_ALL].current >= (int64_t)(3 * MiB));
    /* statistics of the native allocator stay 0 */
    expect_eq_i64(s.segment[CCA_STAT_ALL].current, 0);
    expect_eq_i64(s.allocation[CCA_STAT_ALL].current, 0);
    expect_eq_i64(s.allocated_bytes[CCA_STAT_LARGE_POOL].current, 0);
    expect_ok(cca_malloc(&q, 5 * MiB, S1));
    expect_ok(cca_free(p));
    s = stats(0);
    expect_eq_i64(s.allocated_bytes[CCA_STAT_ALL].current, 5 * MiB);
    expect_eq_i64(s.allocated_bytes[CCA_STAT_ALL].peak, 8 * MiB);
    int64_t reserved = s.reserved_bytes[CCA_STAT_ALL].current;
    expect_ok(cca_free(q));
    /* the release threshold keeps the pool's memory across synchronisations */
    expect_ok(sim->device_synchronize(sim->ctx, 0));
    s = stats(0);
    expect_eq_i64(s.allocated_bytes[CCA_STAT_ALL].current, 0);
    expect_eq_i64(s.reserved_bytes[CCA_STAT_ALL].current, reserved);
    /* memory_stats and the summary read the same figures */
    cca_stat_entry_t e[CCA_MEMORY_STATS_COUNT];
    expect_ok(cca_memory_stats(0, e, CCA_MEMORY_STATS_COUNT));
    int64_t peak = -1;
    for (size_t i = 0; i < CCA_MEMORY_STATS_COUNT; i++)
        if (!strcmp(e[i].key, "allocated_bytes.all.peak"))
            peak = e[i].value;
    expect_eq_i64(peak, 8 * MiB);
    char *text = NULL;
    expect_ok(cca_memory_summary(0, false, &text));
    expect_contains(text, "memory summary, device ID 0");
    free(text);
    /* peaks reset to the current values; accumulated statistics cannot be reset */
    expect_ok(cca_reset_peak_stats(0));
    s = stats(0);
    expect_eq_i64(s.allocated_bytes[CCA_STAT_ALL].peak, 0);
    expect_eq_i64(s.reserved_bytes[CCA_STAT_ALL].peak, reserved);
}

/* The asynchronous backend never reaches the express paths: after a native session's
 * pairs (the thread's pool cache filled, its pool holding a block back), a new state on
 * cudaMallocAsync sends every pair of the same size to the pool. */
TEST(pairs_after_native_ones_stay_async)
{
    setup("");
    for (int i = 0; i < 20; i++) {
        void *p = NULL;
        expect_ok(cca_malloc(&p, 512, S1));
        expect_ok(cca_free(p));
    }
    expect_eq_u64(cca_sim_call_count(sim, CCA_OP_MALLOC), 1);
    setup("backend:cudaMallocAsync");
    for (int i = 0; i < 50; i++) {
        void *p = NULL;
        expect_ok(cca_malloc(&p, 512, S1));
        expect_true(p != NULL);
        expect_ok(cca_free(p));
    }
    expect_eq_u64(cca_sim_call_count(sim, CCA_OP_MALLOC_ASYNC), 50);
    expect_eq_u64(cca_sim_call_count(sim, CCA_OP_FREE_ASYNC), 50);
    expect_eq_u64(cca_sim_call_count(sim, CCA_OP_MALLOC), 0);
    expect_eq_i64(stats(0).allocation[CCA_STAT_ALL].current, 0);
}

static char warned[4096];
static void capture(const char *text, void *arg)
{
    (void)arg;
    strncat(warned, text, sizeof(warned) - strlen(warned) - 1);
}

TEST(reset_accumulated_warns_once)
{
    setup("backend:cudaMallocAsync");
    warned[0] = 0;
    cca_register_output(capture, NULL);
    expect_ok(cca_reset_accumulated_stats(0));
    expect_ok(cca_reset_accumulated_stats(1));
    cca_register_output(NULL, NULL);
    const char *first = strstr(warned, "has no effect");
    expect_true(first != NULL);
    expect_true(first && !strstr(first + 1, "has no effect")); /* once */
}

TEST(empty_cache_trims_the_pool)
{
    setup("backend:cudaMallocAsync");
    void *p = NULL;
    expect_ok(cca_malloc(&p, 64 * MiB, S1));
    expect_ok(cca_free(p));
    expect_true(stats(0).reserved_bytes[CCA_STAT_ALL].current >= (int64_t)(64 * MiB));
    uint64_t syncs = cca_sim_call_count(sim, CCA_OP_DEVICE_SYNCHRONIZE);
    expect_ok(cca_empty_cache());
    expect_eq_i64(stats(0).reserved_bytes[CCA_STAT_ALL].current, 0);
    /* only the set-up device is synchronised and trimmed */
    expect_eq_u64(cca_sim_call_count(sim, CCA_OP_DEVICE_SYNCHRONIZE), syncs + 1);
    expect_eq_u64(cca_sim_call_count(sim, CCA_OP_MEMPOOL_TRIM), 1);
    /* memory in use is not trimmed */
    expect_ok(cca_malloc(&p, 10 * MiB, S1));
    expect_ok(cca_empty_cache());
    expect_true(stats(0).reserved_bytes[CCA_STAT_ALL].current >= (int64_t)(10 * MiB));
    expect_ok(cca_free(p));
}

TEST(record_stream_frees_through_the_unifying_stream)
{
    setup("backend:cudaMallocAsync");
    void *p = NULL, *q = NULL;
    expect_ok(cca_malloc(&p, MiB, S1));
    expect_ok(cca_malloc(&q, MiB, S1));
    uint64_t waits = cca_sim_call_count(sim, CCA_OP_STREAM_WAIT_EVENT);
    uint64_t events = cca_sim_call_count(sim, CCA_OP_EVENT_CREATE);
    expect_ok(cca_free(q)); /* one stream: a plain free on it */
    expect_eq_u64(cca_sim_call_count(sim, CCA_OP_STREAM_WAIT_EVENT), waits);
    expect_ok(cca_record_stream(p, S1)); /* the allocation stream: nothing */
    expect_ok(cca_record_stream(p, S2));
    expect_ok(cca_record_stream(p, S2)); /* once */
    expect_ok(cca_free(p));
    /* the unifying stream waits for the allocation stream and S2 */
    expect_eq_u64(cca_sim_call_count(sim, CCA_OP_STREAM_WAIT_EVENT), waits + 2);
    expect_eq_u64(cca_sim_call_count(sim, CCA_OP_EVENT_CREATE), events + 2);
    cca_sim_usage_t u;
    expect_ok(cca_sim_usage(sim, &u));
    expect_eq_u64(u.live_events, 0);
    expect_eq_u64(u.live_allocations, 0);
}

TEST(memory_fraction_is_a_hard_limit)
{
    setup("backend:cudaMallocAsync");
    void *p = NULL, *q = NULL;
    expect_ok(cca_set_memory_fraction(0.25, 0));
    expect_ok(cca_malloc(&p, 200 * MiB, S1));
    expect_status(cca_malloc(&q, 100 * MiB, S1), CCA_ERR_OUT_OF_MEMORY);
    const char *m = cca_last_error()->message;
    expect_contains(m, "Allocation on device 0 would exceed allowed memory. (out of memory)");
    expect_contains(m, "Currently allocated     : 200.00 MiB");
    expect_contains(m, "Requested               : 100.00 MiB");
    expect_contains(m, "PyTorch limit (set by user-supplied memory fraction)");
    expect_contains(m, "256.00 MiB");
    expect_eq_i64(stats(0).allocated_bytes[CCA_STAT_ALL].current, 200 * MiB);
    expect_ok(cca_free(p));
    expect_ok(cca_malloc(&q, 100 * MiB, S1)); /* recoverable */
    expect_ok(cca_free(q));
    /* the setting applies from initialisation */
    setup("backend:cudaMallocAsync,per_process_memory_fraction:0.5");
    expect_status(cca_malloc(&p, 600 * MiB, S1), CCA_ERR_OUT_OF_MEMORY);
    expect_ok(cca_malloc(&p, 500 * MiB, S1));
    expect_ok(cca_free(p));
    expect_status(cca_set_memory_fraction(1.5, 0), CCA_ERR_INVALID_ARGUMENT);
}

TEST(device_out_of_memory)
{
    setup("backend:cudaMallocAsync");
    void *p = NULL;
    expect_status(cca_malloc(&p, 2 * GiB, S1), CCA_ERR_OUT_OF_MEMORY);
    expect_contains(cca_last_error()->message, "Free (according to CUDA):");
    expect_eq_i64(stats(0).allocated_bytes[CCA_STAT_ALL].current, 0);
    expect_status(cca_malloc(&p, (size_t)1 << 61, S1), CCA_ERR_OUT_OF_MEMORY);
    expect_contains(cca_last_error()->message, "more than 1EB");
    expect_ok(cca_malloc(&p, 512 * MiB, S1));
    expect_ok(cca_free(p));
}

TEST(queries)
{
    setup("backend:cudaMallocAsync");
    char *p = NULL;
    expect_ok(cca_malloc((void **)&p, 10 * MiB, S1));
    void *base = NULL;
    size_t size = 0;
    expect_ok(cca_get_base_allocation(p, &base, &size));
    expect_eq_ptr(base, p);
    expect_eq_u64(size, 10 * MiB);
    expect_status(cca_get_base_allocation(p + 512, &base, &size), CCA_ERR_INVALID_POINTER);
    size_t cached = 0, largest = 0;
    expect_ok(cca_cache_info(0, &cached, &largest));
    expect_true(largest > 0 && largest <= GiB - 10 * MiB);
    expect_eq_u64(cached, attr(0, CCA_MEMPOOL_RESERVED_CURRENT) - attr(0, CCA_MEMPOOL_USED_CURRENT));
    expect_eq_u64(attr(0, CCA_MEMPOOL_USED_CURRENT), 10 * MiB); /* the trial was freed */
    cca_snapshot_t *snap = NULL;
    expect_status(cca_snapshot(&snap), CCA_ERR_NOT_SUPPORTED);
    expect_contains(cca_last_error()->message, "not meaningful");
    expect_ok(cca_free(p));
}

/* cca's extra statistics read the pool's figures: no trial allocation (cache_info's), which
 * left the pool holding the whole device and the peaks at the device's size. */
TEST(extra_statistics_change_nothing)
{
    setup("backend:cudaMallocAsync");
    void *p = NULL, *q = NULL;
    expect_ok(cca_malloc(&p, 10 * MiB, S1));
    expect_ok(cca_malloc(&q, 6 * MiB, S1));
    expect_ok(cca_free(q));
    cca_device_stats_t before = stats(0);
    uint64_t mallocs = cca_sim_call_count(sim, CCA_OP_MALLOC_ASYNC);
    cca_stat_entry_t e[CCA_MEMORY_STATS_EXTRA_COUNT];
    expect_ok(cca_memory_stats_extra(0, e, CCA_MEMORY_STATS_EXTRA_COUNT));
    expect_eq_u64(cca_sim_call_count(sim, CCA_OP_MALLOC_ASYNC), mallocs);
    cca_device_stats_t after = stats(0);
    int64_t reserved = before.reserved_bytes[CCA_STAT_ALL].current;
    expect_eq_i64(after.reserved_bytes[CCA_STAT_ALL].current, reserved);
    expect_eq_i64(after.reserved_bytes[CCA_STAT_ALL].peak, before.reserved_bytes[CCA_STAT_ALL].peak);
    expect_eq_i64(after.allocated_bytes[CCA_STAT_ALL].peak, 16 * MiB);
    for (size_t i = 0; i < CCA_MEMORY_STATS_EXTRA_COUNT; i++)
        if (!strcmp(e[i].key, "cca.cached_free_bytes") ||
            !strcmp(e[i].key, "cca.largest_free_bytes"))
            expect_eq_i64(e[i].value, reserved - 10 * (int64_t)MiB);
    /* a device not used yet: zeros, its pool not set up */
    expect_ok(cca_memory_stats_extra(1, e, CCA_MEMORY_STATS_EXTRA_COUNT));
    for (size_t i = 0; i < CCA_MEMORY_STATS_EXTRA_COUNT; i++)
        expect_eq_i64(e[i].value, 0);
    expect_eq_u64(attr(1, CCA_MEMPOOL_RELEASE_THRESHOLD), 0);
    expect_ok(cca_free(p));
}

TEST(misuse)
{
    setup("backend:cudaMallocAsync");
    void *p = NULL;
    int x;
    expect_status(cca_free(&x), CCA_ERR_INVALID_POINTER);
    expect_ok(cca_free(NULL));
    expect_ok(cca_malloc(&p, 0, S1));
    expect_true(p == NULL);
    expect_ok(cca_malloc(&p, 4096, S1));
    expect_ok(cca_free(p));
    expect_status(cca_free(p), CCA_ERR_INVALID_POINTER);
    expect_status(cca_record_stream(p, S2), CCA_ERR_INVALID_POINTER);
    expect_status(cca_set_settings("backend:native"), CCA_ERR_NOT_SUPPORTED);
    expect_status(cca_malloc_device(&p, 64, 2, S1), CCA_ERR_INVALID_ARGUMENT);
}

TEST(faults_leave_nothing_behind)
{
    setup("backend:cudaMallocAsync");
    void *p = NULL;
    /* pool set-up fails: nothing allocated, the next call sets up */
    expect_ok(cca_sim_inject_fault(sim, CCA_OP_MEMPOOL_SET_ATTR, 2, false, CCA_ERR_BACKEND));
    expect_status(cca_malloc(&p, MiB, S1), CCA_ERR_BACKEND);
    expect_ok(cca_sim_inject_fault(sim, CCA_OP_STREAM_CREATE, 1, false, CCA_ERR_BACKEND));
    expect_status(cca_malloc(&p, MiB, S1), CCA_ERR_BACKEND);
    expect_ok(cca_malloc(&p, MiB, S1));
    expect_ok(cca_free(p));
    /* the allocation fails */
    expect_ok(cca_sim_inject_fault(sim, CCA_OP_MALLOC_ASYNC, 1, false, CCA_ERR_BACKEND));
    expect_status(cca_malloc(&p, MiB, S1), CCA_ERR_BACKEND);
    expect_eq_i64(stats(0).allocated_bytes[CCA_STAT_ALL].current, 0);
    /* the free fails: still allocated, the retry frees */
    expect_ok(cca_malloc(&p, MiB, S1));
    expect_ok(cca_sim_inject_fault(sim, CCA_OP_FREE_ASYNC, 1, false, CCA_ERR_BACKEND));
    expect_status(cca_free(p), CCA_ERR_BACKEND);
    expect_eq_i64(stats(0).allocated_bytes[CCA_STAT_ALL].current, MiB);
    expect_ok(cca_free(p));
    /* a free through the unifying stream fails at each step */
    for (int op = 0; op < 3; op++) {
        static const cca_backend_op_t ops[3] = {CCA_OP_EVENT_CREATE, CCA_OP_EVENT_RECORD,
                                                CCA_OP_STREAM_WAIT_EVENT};
        expect_ok(cca_malloc(&p, MiB, S1));
        expect_ok(cca_record_stream(p, S2));
        expect_ok(cca_sim_inject_fault(sim, ops[op], 1, false, CCA_ERR_BACKEND));
        expect_status(cca_free(p), CCA_ERR_BACKEND);
        expect_ok(cca_free(p));
    }
    cca_sim_usage_t u;
    expect_ok(cca_sim_usage(sim, &u));
    expect_eq_u64(u.live_events, 0);
    expect_eq_u64(u.live_allocations, 0);
    expect_eq_i64(stats(0).allocated_bytes[CCA_STAT_ALL].current, 0);
}

#define S3 ((cca_stream_t)(uintptr_t)0x3000)

TEST(graph_capture_as_pytorch)
{
    setup("backend:cudaMallocAsync");
    warned[0] = 0;
    cca_register_output(capture, NULL);
    void *old = NULL, *c1 = NULL, *c2 = NULL, *c3 = NULL, *p = NULL;
    expect_ok(cca_malloc(&old, MiB, S1)); /* before the capture */
    expect_ok(cca_sim_capture_begin(sim, S1));
    cca_mempool_id_t id = cca_mempool_id_new(false);
    expect_ok(cca_begin_allocate_stream_to_pool(0, id, S1));
    /* one capture at a time in the process, whatever the device, pool or form */
    expect_status(cca_begin_allocate_stream_to_pool(1, cca_mempool_id_new(false), S2), CCA_ERR_BUSY);
    expect_contains(cca_last_error()->message, "Only one capture at a time is allowed in a process.");
    expect_status(cca_begin_allocate_thread_to_pool(0, id), CCA_ERR_BUSY);
    /* an allocation on the capturing stream is a node of the graph */
    size_t nodes = cca_sim_capture_nodes(sim);
    expect_ok(cca_malloc(&c1, 2 * MiB, S1));
    expect_eq_u64(cca_sim_capture_nodes(sim), nodes + 1);
    /* the driver would refuse to free the earlier allocation inside the capture ... */
    expect_status(sim->free_async(sim->ctx, 0, old, S1), CCA_ERR_BACKEND);
    /* ... so its free is deferred (warned once), and a second free is a double free */
    uint64_t frees = cca_sim_call_count(sim, CCA_OP_FREE_ASYNC);
    expect_ok(cca_free(old));
    expect_eq_u64(async_deferred_count(), 1);
    expect_eq_u64(cca_sim_call_count(sim, CCA_OP_FREE_ASYNC), frees);
    expect_eq_i64(stats(0).allocated_bytes[CCA_STAT_ALL].current, 3 * MiB);
    expect_status(cca_free(old), CCA_ERR_INVALID_POINTER);
    expect_contains(cca_last_error()->message, "capture");
    /* a forked stream allocates and frees inside the capture: two nodes, S2 a free stream */
    expect_ok(cca_sim_capture_join(sim, S2, S1));
    expect_ok(cca_malloc(&c2, MiB, S2));
    expect_ok(cca_free(c2));
    expect_eq_u64(cca_sim_capture_nodes(sim), nodes + 3);
    /* used on two streams: freed through the unifying stream, another free stream */
    expect_ok(cca_malloc(&c3, MiB, S1));
    expect_ok(cca_record_stream(c3, S2));
    expect_ok(cca_free(c3));
    /* a second free stream of the same stream is one */
    expect_ok(cca_malloc(&c2, MiB, S2));
    expect_ok(cca_free(c2));
    /* the end joins each free stream (S2, the unifying stream) into the capture stream */
    uint64_t records = cca_sim_call_count(sim, CCA_OP_EVENT_RECORD);
    uint64_t waits = cca_sim_call_count(sim, CCA_OP_STREAM_WAIT_EVENT);
    expect_ok(cca_end_allocate_to_pool(0, id));
    expect_eq_u64(cca_sim_call_count(sim, CCA_OP_EVENT_RECORD), records + 2);
    expect_eq_u64(cca_sim_call_count(sim, CCA_OP_STREAM_WAIT_EVENT), waits + 2);
    expect_status(cca_end_allocate_to_pool(0, id), CCA_ERR_BUSY);
    expect_contains(cca_last_error()->message, "capture_underway is false");
    expect_ok(cca_sim_capture_end(sim, S1));
    /* the deferred free waits for the next allocation, as PyTorch's */
    expect_eq_u64(async_deferred_count(), 1);
    expect_eq_i64(stats(0).allocated_bytes[CCA_STAT_ALL].current, 3 * MiB);
    expect_ok(cca_malloc(&p, MiB, S1));
    expect_eq_u64(async_deferred_count(), 0);
    expect_eq_i64(stats(0).allocated_bytes[CCA_STAT_ALL].current, 3 * MiB);
    expect_ok(cca_free(p));
    /* the graph's allocation freed outside a capture: allowed, with PyTorch's warning */
    expect_ok(cca_free(c1));
    expect_eq_i64(stats(0).allocated_bytes[CCA_STAT_ALL].current, 0);
    cca_register_output(NULL, NULL);
    const char *first = strstr(warned, "freeAsync() was called on an uncaptured allocation");
    expect_true(first != NULL);
    expect_true(first && !strstr(first + 1, "freeAsync() was called")); /* once */
    expect_contains(warned, "Attempting uncaptured free of a captured allocation");
    /* releasePool does nothing for this backend, however often */
    expect_ok(cca_release_pool(0, id));
    expect_ok(cca_release_pool(0, id));
    /* the other forms begin a capture too (use_mem_pool's thread route, a filter) */
    expect_ok(cca_begin_allocate_thread_to_pool(1, cca_mempool_id_new(true)));
    expect_ok(cca_malloc_device(&p, MiB, 1, S3));
    expect_ok(cca_end_allocate_to_pool(1, id)); /* the id is not looked at */
    warned[0] = 0;
    cca_register_output(capture, NULL);
    expect_ok(cca_free(p));
    cca_register_output(NULL, NULL);
    expect_contains(warned, "Attempting uncaptured free of a captured allocation");
    cca_sim_usage_t u;
    expect_ok(cca_sim_usage(sim, &u));
    expect_eq_u64(u.live_events, 0);
    expect_eq_u64(u.live_allocations, 0);
}

static bool any_stream(cca_stream_t stream, void *arg)
{
    (void)stream;
    (void)arg;
    return true;
}

TEST(private_pools_give_pytorchs_errors)
{
    setup("backend:cudaMallocAsync");
    cca_mempool_id_t id = cca_mempool_id_new(true);
    int count = 0;
    bool matches = false;
    cca_pool_state_t *state = NULL;
    expect_status(cca_pool_create(0, id), CCA_ERR_NOT_SUPPORTED);
    expect_contains(cca_last_error()->message,
                    "cudaMallocAsync does not yet support createOrIncrefPool. If you need it, "
                    "please file an issue describing your use case.");
    expect_status(cca_pool_use_count(0, id, &count), CCA_ERR_NOT_SUPPORTED);
    expect_contains(cca_last_error()->message, "does not yet support getPoolUseCount");
    expect_status(cca_pool_set_use_on_oom(0, id, true), CCA_ERR_NOT_SUPPORTED);
    expect_contains(cca_last_error()->message, "does not yet support setUseOnOOM");
    expect_status(cca_pool_set_no_split(0, id), CCA_ERR_NOT_SUPPORTED);
    expect_contains(cca_last_error()->message, "does not yet support setNoSplit");
    expect_status(cca_pool_set_allocator(0, id, NULL, NULL, NULL), CCA_ERR_NOT_SUPPORTED);
    expect_contains(cca_last_error()->message, "does not yet support createOrIncrefPool");
    expect_status(cca_pool_check_live_allocations(0, id, NULL, 0, &matches), CCA_ERR_NOT_SUPPORTED);
    expect_contains(cca_last_error()->message, "does not yet support checkPoolLiveAllocations");
    expect_status(cca_pool_get_checkpoint(0, id, &state), CCA_ERR_NOT_SUPPORTED);
    expect_contains(cca_last_error()->message, "does not yet support getCheckpointState");
    /* bad devices and arguments are still cca's errors */
    expect_status(cca_begin_allocate_stream_to_pool(2, id, S1), CCA_ERR_INVALID_ARGUMENT);
    expect_status(cca_begin_allocate_to_pool(0, id, NULL, NULL), CCA_ERR_INVALID_ARGUMENT);
    expect_status(cca_end_allocate_to_pool(-1, id), CCA_ERR_INVALID_ARGUMENT);
    expect_status(cca_release_pool(2, id), CCA_ERR_INVALID_ARGUMENT);
    expect_status(cca_end_allocate_to_pool(0, id), CCA_ERR_BUSY); /* no capture underway */
    /* a filter route is a capture as well; the rejoin goes to the default stream */
    expect_ok(cca_begin_allocate_to_pool(0, id, any_stream, NULL));
    void *p = NULL;
    expect_ok(cca_malloc(&p, MiB, S1));
    expect_ok(cca_free(p)); /* captured: freed at once, S1 a free stream */
    uint64_t waits = cca_sim_call_count(sim, CCA_OP_STREAM_WAIT_EVENT);
    expect_ok(cca_end_allocate_to_pool(0, id));
    expect_eq_u64(cca_sim_call_count(sim, CCA_OP_STREAM_WAIT_EVENT), waits + 1);
    /* emptyCache(mempool_id) of this backend ignores the id: the whole pool is trimmed */
    uint64_t trims = cca_sim_call_count(sim, CCA_OP_MEMPOOL_TRIM);
    expect_ok(cca_empty_cache_pool(id));
    expect_eq_u64(cca_sim_call_count(sim, CCA_OP_MEMPOOL_TRIM), trims + 1);
}

TEST(graph_capture_faults)
{
    setup("backend:cudaMallocAsync");
    void *old = NULL, *c = NULL, *p = NULL;
    cca_mempool_id_t id = cca_mempool_id_new(false);
    cca_register_output(capture, NULL);
    expect_ok(cca_malloc(&old, MiB, S1));
    expect_ok(cca_begin_allocate_stream_to_pool(0, id, S1));
    expect_ok(cca_free(old)); /* deferred */
    expect_ok(cca_malloc(&c, MiB, S2));
    expect_ok(cca_free(c)); /* S2 to join back */
    /* the join fails at each step: the capture stays underway, a second end completes it */
    static const cca_backend_op_t ops[3] = {CCA_OP_EVENT_CREATE, CCA_OP_EVENT_RECORD,
                                            CCA_OP_STREAM_WAIT_EVENT};
    for (int i = 0; i < 3; i++) {
        expect_ok(cca_sim_inject_fault(sim, ops[i], 1, false, CCA_ERR_BACKEND));
        expect_status(cca_end_allocate_to_pool(0, id), CCA_ERR_BACKEND);
        expect_status(cca_begin_allocate_stream_to_pool(0, id, S1), CCA_ERR_BUSY); /* still on */
    }
    expect_ok(cca_end_allocate_to_pool(0, id));
    /* the deferred free fails at the next allocation: the allocation goes on, the free waits */
    expect_ok(cca_sim_inject_fault(sim, CCA_OP_FREE_ASYNC, 1, false, CCA_ERR_BACKEND));
    expect_ok(cca_malloc(&p, MiB, S1));
    expect_eq_u64(async_deferred_count(), 1);
    expect_status(cca_free(old), CCA_ERR_INVALID_POINTER); /* still a double free */
    expect_ok(cca_free(p));
    expect_ok(cca_malloc(&p, MiB, S1));
    expect_eq_u64(async_deferred_count(), 0);
    expect_ok(cca_free(p));
    /* a deferred free still waiting at shutdown is freed by it */
    expect_ok(cca_malloc(&old, MiB, S1));
    expect_ok(cca_begin_allocate_stream_to_pool(0, id, S1));
    expect_ok(cca_free(old));
    expect_ok(cca_end_allocate_to_pool(0, id));
    cca_register_output(NULL, NULL);
    expect_eq_u64(async_deferred_count(), 1);
    uint64_t frees = cca_sim_call_count(sim, CCA_OP_FREE_ASYNC);
    async_shutdown(sim); /* what cca_shutdown does first, before the backend goes */
    expect_eq_u64(cca_sim_call_count(sim, CCA_OP_FREE_ASYNC), frees + 1);
    cca_sim_usage_t u;
    expect_ok(cca_sim_usage(sim, &u));
    expect_eq_u64(u.live_allocations, 0);
    expect_eq_u64(u.live_events, 0);
    cca_shutdown();
}

TEST(host_allocator_unchanged)
{
    setup("backend:cudaMallocAsync");
    void *h = NULL;
    expect_ok(cca_host_malloc(&h, 4096));
    expect_ok(cca_host_free(h));
}

/* ---- PyTorch's behaviour where cca differed ---- */

/* The fraction set with cca_set_memory_fraction reads back (PyTorch's getMemoryFraction of this
 * backend: the limit over the device's memory); it read 1 before. */
TEST(memory_fraction_reads_back)
{
    setup("backend:cudaMallocAsync");
    double f = -1;
    expect_ok(cca_get_memory_fraction(0, &f));
    expect_true(f == 1.0);
    expect_ok(cca_set_memory_fraction(0.25, 0));
    expect_ok(cca_get_memory_fraction(0, &f));
    expect_true(f == 0.25);
    void *p = NULL;
    expect_status(cca_malloc(&p, 300 * MiB, S1), CCA_ERR_OUT_OF_MEMORY); /* 0.25 of 1 GiB */
}

/* per_process_memory_fraction set at run time is the limit enforced (it was only reported). */
TEST(run_time_fraction_is_enforced)
{
    setup("backend:cudaMallocAsync");
    expect_ok(cca_set_settings("per_process_memory_fraction:0.25"));
    double f = -1;
    expect_ok(cca_get_memory_fraction(0, &f));
    expect_true(f == 0.25);
    void *p = NULL;
    expect_status(cca_malloc(&p, 600 * MiB, S1), CCA_ERR_OUT_OF_MEMORY);
    expect_ok(cca_malloc(&p, 200 * MiB, S1));
    expect_ok(cca_free(p));
}

/* per_process_memory_fraction set back to 0 at run time lifts the limit (0: none). */
TEST(run_time_fraction_zero_lifts_the_limit)
{
    setup("backend:cudaMallocAsync");
    expect_ok(cca_set_settings("per_process_memory_fraction:0.25"));
    void *p = NULL;
    expect_status(cca_malloc(&p, 600 * MiB, S1), CCA_ERR_OUT_OF_MEMORY);
    expect_ok(cca_set_settings("per_process_memory_fraction:0"));
    double f = -1;
    expect_ok(cca_get_memory_fraction(0, &f));
    expect_true(f == 1.0);
    expect_ok(cca_malloc(&p, 600 * MiB, S1));
    expect_ok(cca_free(p));
}

/*
 * An allocation the driver is about to refuse does not make another thread's
 * fitting allocation fail: PyTorch checks the limit under its mutex and counts
 * the bytes once the driver has them, so B's 200 MiB fits in either order.
 * A's driver call (400 MiB on a device capped at 300) is held until B has
 * found its bytes counted and waits for it, or until B is done (as it was
 * before: refused at once).
 */
static pthread_mutex_t race_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t race_cv = PTHREAD_COND_INITIALIZER;
static int race_phase; /* 1: A in the driver; 2: B done */
static cca_status_t race_b_status;
static cca_status_t (*real_malloc_async)(void *, int, size_t, cca_stream_t, void **);

/* A's driver call has begun (phase 1, B told); returns the charge's waits so far. */
static size_t race_a_in_driver(void)
{
    size_t waits = async_test_charge_waits();
    pthread_mutex_lock(&race_mu);
    race_phase = 1;
    pthread_cond_broadcast(&race_cv);
    pthread_mutex_unlock(&race_mu);
    return waits;
}

static cca_status_t held_malloc_async(void *ctx, int device, size_t size, cca_stream_t stream,
                                      void **ptr)
{
    if (size == 400 * MiB) {
        size_t waits = race_a_in_driver();
        for (;;) { /* until B waits for this call, or has finished without waiting */
            pthread_mutex_lock(&race_mu);
            bool done = race_phase == 2;
            pthread_mutex_unlock(&race_mu);
            if (done || async_test_charge_waits() != waits)
                break;
            sched_yield();
        }
    }
    return real_malloc_async(ctx, device, size, stream, ptr);
}

static void *thread_b(void *arg)
{
    (void)arg;
    pthread_mutex_lock(&race_mu);
    while (race_phase != 1)
        pthread_cond_wait(&race_cv, &race_mu);
    pthread_mutex_unlock(&race_mu);
    void *q = NULL;
    race_b_status = cca_malloc(&q, 200 * MiB, S2);
    pthread_mutex_lock(&race_mu);
    race_phase = 2;
    pthread_mutex_unlock(&race_mu);
    if (race_b_status == CCA_OK)
        (void)cca_free(q);
    return NULL;
}

/* One race: A's 400 MiB through the driver hook (which the device refuses), B's 200 MiB
 * beside it on another thread; B must get its memory. */
static void race_once(cca_status_t (*hook)(void *, int, size_t, cca_stream_t, void **))
{
    setup("backend:cudaMallocAsync");
    race_phase = 0;
    expect_ok(cca_set_memory_fraction(0.5, 0));   /* 512 MiB */
    expect_ok(cca_sim_set_cap(sim, 0, 300 * MiB)); /* the device has 300 */
    real_malloc_async = sim->malloc_async;
    sim->malloc_async = hook;
    pthread_t b;
    pthread_create(&b, NULL, thread_b, NULL);
    void *p = NULL;
    expect_status(cca_malloc(&p, 400 * MiB, S1), CCA_ERR_OUT_OF_MEMORY); /* the device refuses */
    pthread_join(b, NULL);
    sim->malloc_async = real_malloc_async;
    expect_ok(race_b_status);
    expect_eq_i64(stats(0).allocated_bytes[CCA_STAT_ALL].current, 0);
}

TEST(refused_allocation_in_flight_blocks_no_other)
{
    race_once(held_malloc_async);
}

/*
 * The same race, many times: B's count may see A's bytes, and A's driver call
 * then fail and take them back before B has looked for calls under way. B
 * finds none then, but the bytes it saw are gone: it counts again (it was
 * refused, now and then, when A finished in that window).
 */
TEST(refused_allocation_finishing_meanwhile_blocks_no_other)
{
    setup("backend:cudaMallocAsync");
    expect_ok(cca_set_memory_fraction(0.5, 0));   /* 512 MiB */
    expect_ok(cca_sim_set_cap(sim, 0, 300 * MiB)); /* the device has 300 */
    real_malloc_async = sim->malloc_async;
    sim->malloc_async = held_malloc_async;
    /* A and B on two CPUs where there are two: the window is a few instructions of each */
    cpu_set_t was, one, other;
    bool pinned = pthread_getaffinity_np(pthread_self(), sizeof(was), &was) == 0 &&
                  CPU_COUNT(&was) >= 2;
    int first = -1, second = -1;
    for (int c = 0; pinned && c < CPU_SETSIZE && second < 0; c++)
        if (CPU_ISSET(c, &was)) {
            if (first < 0)
                first = c;
            else
                second = c;
        }
    CPU_ZERO(&one);
    CPU_ZERO(&other);
    if (pinned) {
        CPU_SET(first, &one);
        CPU_SET(second, &other);
        pthread_setaffinity_np(pthread_self(), sizeof(one), &one);
    }
    int refused = 0;
    for (int i = 0; i < 200; i++) {
        race_phase = 0;
        pthread_t b;
        pthread_create(&b, NULL, thread_b, NULL);
        if (pinned)
            pthread_setaffinity_np(b, sizeof(other), &other);
        void *p = NULL;
        expect_status(cca_malloc(&p, 400 * MiB, S1), CCA_ERR_OUT_OF_MEMORY);
        pthread_join(b, NULL);
        refused += race_b_status != CCA_OK;
    }
    if (pinned)
        pthread_setaffinity_np(pthread_self(), sizeof(was), &was);
    sim->malloc_async = real_malloc_async;
    expect_eq_i64(refused, 0);
    expect_eq_i64(stats(0).allocated_bytes[CCA_STAT_ALL].current, 0);
}

/*
 * A driver call that takes long (a pool growing on a real device, a thread
 * preempted) is waited for however long it takes, as under PyTorch's mutex:
 * B, whose 200 MiB fit once A's refused 400 MiB are given back, was refused
 * after a bounded number of tries while A's call was still under way.
 */
static cca_status_t slow_malloc_async(void *ctx, int device, size_t size, cca_stream_t stream,
                                      void **ptr)
{
    if (size == 400 * MiB) {
        size_t waits = race_a_in_driver();
        while (async_test_charge_waits() == waits) /* B waits for this call ... */
            sched_yield();
        for (int i = 0; i < 50000; i++) /* ... which takes long */
            sched_yield();
    }
    return real_malloc_async(ctx, device, size, stream, ptr);
}

TEST(slow_driver_call_is_waited_for)
{
    race_once(slow_malloc_async);
}

/*
 * A request that the bytes allocated already leave no room for is refused at
 * once, as under PyTorch's mutex, without waiting for another thread's
 * driver call under way: B's 200 MiB never fit beside the 400 MiB allocated
 * under a 512 MiB limit, whatever A's 50 MiB call in flight does.
 */
static bool b_finished_first;

static cca_status_t busy_malloc_async(void *ctx, int device, size_t size, cca_stream_t stream,
                                      void **ptr)
{
    if (size == 50 * MiB) {
        pthread_mutex_lock(&race_mu);
        race_phase = 1;
        pthread_cond_broadcast(&race_cv);
        pthread_mutex_unlock(&race_mu);
        struct timespec start, now;
        clock_gettime(CLOCK_MONOTONIC, &start);
        do { /* until B is done, or for 5 s */
            pthread_mutex_lock(&race_mu);
            b_finished_first = race_phase == 2;
            pthread_mutex_unlock(&race_mu);
            sched_yield();
            clock_gettime(CLOCK_MONOTONIC, &now);
        } while (!b_finished_first && now.tv_sec - start.tv_sec < 5);
    }
    return real_malloc_async(ctx, device, size, stream, ptr);
}

TEST(allocation_without_room_refused_at_once)
{
    setup("backend:cudaMallocAsync");
    race_phase = 0;
    b_finished_first = false;
    expect_ok(cca_set_memory_fraction(0.5, 0)); /* 512 MiB */
    void *big = NULL, *p = NULL;
    expect_ok(cca_malloc(&big, 400 * MiB, S1));
    real_malloc_async = sim->malloc_async;
    sim->malloc_async = busy_malloc_async;
    pthread_t b;
    pthread_create(&b, NULL, thread_b, NULL);
    expect_ok(cca_malloc(&p, 50 * MiB, S1));
    pthread_join(b, NULL);
    sim->malloc_async = real_malloc_async;
    expect_status(race_b_status, CCA_ERR_OUT_OF_MEMORY);
    expect_true(b_finished_first);
    expect_ok(cca_free(p));
    expect_ok(cca_free(big));
}

/* Out-of-memory observers and history are refused with PyTorch's errors for this backend (they
 * were accepted, and then nothing was observed or recorded); turning history off is no error. */
static void never_observer(int device, size_t alloc_size, size_t device_total, size_t device_free,
                           void *arg)
{
    (void)device, (void)alloc_size, (void)device_total, (void)device_free, (void)arg;
}

TEST(observers_and_history_refused)
{
    setup("backend:cudaMallocAsync");
    expect_status(cca_attach_oom_observer(never_observer, NULL), CCA_ERR_NOT_SUPPORTED);
    expect_contains(cca_last_error()->message, "does not yet support attachOutOfMemoryObserver");
    expect_status(cca_record_history(true, NULL, NULL, 100, CCA_RECORD_CONTEXT_NEVER),
                  CCA_ERR_NOT_SUPPORTED);
    expect_contains(cca_last_error()->message, "does not yet support recordHistory");
    expect_ok(cca_record_history(false, NULL, NULL, 0, CCA_RECORD_CONTEXT_NEVER));
}

/* A stream event of a device never allocated on, whose destroy failed, is released by the next
 * empty_cache (it waited for shutdown). */
TEST(orphan_event_of_an_unused_device)
{
    setup("backend:cudaMallocAsync");
    void *p = NULL;
    expect_ok(cca_malloc(&p, MiB, S1));  /* device 0 */
    expect_ok(sim->set_device(sim->ctx, 1));
    expect_ok(cca_record_stream(p, S2)); /* S2 of device 1 */
    expect_ok(sim->set_device(sim->ctx, 0));
    expect_ok(cca_sim_inject_fault(sim, CCA_OP_EVENT_DESTROY, 2, false, CCA_ERR_BACKEND));
    expect_ok(cca_free(p));
    cca_sim_usage_t u;
    expect_ok(cca_sim_usage(sim, &u));
    expect_eq_u64(u.live_events, 1); /* kept to be released later */
    expect_ok(cca_empty_cache());
    expect_ok(cca_sim_usage(sim, &u));
    expect_eq_u64(u.live_events, 0);
}

/* PyTorch's warning, once, for record_stream on the allocation's own stream (run first: once a
 * process). */
TEST(record_stream_on_the_allocation_stream_warns)
{
    setup("backend:cudaMallocAsync");
    void *p = NULL;
    expect_ok(cca_malloc(&p, MiB, S1));
    warned[0] = 0;
    cca_register_output(capture, NULL);
    expect_ok(cca_record_stream(p, S1));
    expect_ok(cca_record_stream(p, S1));
    cca_register_output(NULL, NULL);
    const char *w = "Called record_stream on tensor whose original creation stream matches the "
                    "recorded stream. This is unnecessary and has no effect.";
    expect_contains(warned, w);
    const char *first = strstr(warned, w);
    expect_true(first && !strstr(first + 1, w)); /* once */
    expect_ok(cca_free(p));
}

int main(void)
{
    RUN(record_stream_on_the_allocation_stream_warns);
    RUN(pool_set_up_as_pytorch);
    RUN(statistics_are_the_pools);
    RUN(pairs_after_native_ones_stay_async);
    RUN(reset_accumulated_warns_once);
    RUN(empty_cache_trims_the_pool);
    RUN(record_stream_frees_through_the_unifying_stream);
    RUN(memory_fraction_is_a_hard_limit);
    RUN(device_out_of_memory);
    RUN(queries);
    RUN(extra_statistics_change_nothing);
    RUN(misuse);
    RUN(faults_leave_nothing_behind);
    RUN(graph_capture_as_pytorch);
    RUN(private_pools_give_pytorchs_errors);
    RUN(graph_capture_faults);
    RUN(host_allocator_unchanged);
    cca_shutdown();
    RUN(memory_fraction_reads_back);
    RUN(run_time_fraction_is_enforced);
    RUN(run_time_fraction_zero_lifts_the_limit);
    RUN(refused_allocation_in_flight_blocks_no_other);
    RUN(refused_allocation_finishing_meanwhile_blocks_no_other);
    RUN(slow_driver_call_is_waited_for);
    RUN(allocation_without_room_refused_at_once);
    RUN(observers_and_history_refused);
    RUN(orphan_event_of_an_unused_device);
    return harness_done();
}
