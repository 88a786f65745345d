/*
 * test_private_pools.c - private pools on the simulated backend: routing by
 * stream, thread and filter; pools kept apart from the default pools; use
 * counts, release and empty_cache; frees set aside during a capture; the
 * out-of-memory sequence during a route; use_on_oom and no_split; snapshots;
 * checkpoints and live allocations; misuse (a clear status, nothing changed);
 * a pool with its own allocator (MemPool(allocator=...)).
 * The invariant checker runs after every scenario.
 */
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "check.h"
#include "device.h"
#include "harness.h"
#include "pickle.h"

#define MiB ((size_t)1 << 20)

static cca_backend_t *sim;

static const char *setup_settings = "";

static void setup(size_t memory, bool manual_events)
{
    cca_sim_config_t cfg = {0};
    cfg.devices = 2;
    cfg.total_memory = memory ? memory : 8ull << 30;
    cfg.manual_events = manual_events;
    cca_shutdown();
    if (cca_sim_create(&cfg, &sim) != CCA_OK || cca_init_with_backend(sim, setup_settings) != CCA_OK) {
        printf("cannot init: %s\n", cca_last_error()->message);
        exit(1);
    }
}

static cca_device_stats_t stats(int device)
{
    cca_device_stats_t s;
    cca_get_device_stats(device, &s);
    return s;
}

static void *xmalloc(size_t size, cca_stream_t stream)
{
    void *p = NULL;
    cca_status_t st = cca_malloc(&p, size, stream);
    if (st != CCA_OK)
        printf("  cca_malloc(%zu) failed: %s\n", size, cca_last_error()->message);
    return p;
}

static void expect_valid(void)
{
    char why[512];
    cca_status_t st = device_check_invariants(why, sizeof(why));
    if (st != CCA_OK)
        printf("  invariant: %s\n", why);
    expect_ok(st);
}

/* The pool id a snapshot gives the segment holding p ((~0, ~0): not found). */
static cca_mempool_id_t segment_pool_of(void *p)
{
    cca_mempool_id_t id = {~0ull, ~0ull};
    cca_snapshot_t *snap = NULL;
    if (cca_snapshot(&snap) != CCA_OK)
        return id;
    for (size_t i = 0; i < snap->segment_count; i++) {
        const cca_segment_info_t *s = &snap->segments[i];
        if ((uintptr_t)p >= s->address && (uintptr_t)p < s->address + s->total_size) {
            id.first = s->owner_private_pool_id[0];
            id.second = s->owner_private_pool_id[1];
        }
    }
    cca_snapshot_free(snap);
    return id;
}

#define S1 ((cca_stream_t)(uintptr_t)0x1000)
#define S2 ((cca_stream_t)(uintptr_t)0x2000)

static const cca_mempool_id_t G1 = {1, 0};
static const cca_mempool_id_t G2 = {2, 0};
static const cca_mempool_id_t M1 = {0, 1};

TEST(ids)
{
    cca_mempool_id_t a = cca_mempool_id_new(false), b = cca_mempool_id_new(false);
    cca_mempool_id_t u = cca_mempool_id_new(true);
    expect_true(a.first > 0 && a.second == 0);
    expect_true(b.first > a.first);
    expect_true(u.first == 0 && u.second > 0);
}

/*
 * exact_peak_stats:False keeps a default pool's statistics in its stream pool, but a
 * private pool's in the device's table (its stream pools go when it is freed): the
 * device's statistics count both, and keep the private pool's counts after it is gone.
 */
TEST(relaxed_statistics_count_private_pools)
{
    setup_settings = "exact_peak_stats:False";
    setup(0, false);
    setup_settings = "";
    expect_ok(cca_pool_create(0, M1));
    expect_ok(cca_begin_allocate_stream_to_pool(0, M1, S2));
    void *a = xmalloc(3000, S1), *b = xmalloc(1000, S2);
    cca_device_stats_t s = stats(0);
    expect_eq_i64(s.allocation[CCA_STAT_ALL].current, 2);
    expect_eq_i64(s.allocation[CCA_STAT_SMALL_POOL].allocated, 2);
    expect_eq_i64(s.requested_bytes[CCA_STAT_ALL].current, 4000);
    expect_eq_i64(s.requested_bytes[CCA_STAT_ALL].peak, 4000);
    expect_eq_i64(s.allocated_bytes[CCA_STAT_ALL].current, 3072 + 1024);
    expect_valid();
    expect_ok(cca_free(b));
    expect_ok(cca_end_allocate_to_pool(0, M1));
    expect_ok(cca_release_pool(0, M1));
    expect_ok(cca_release_pool(0, M1));
    expect_ok(cca_empty_cache()); /* the private pool and its stream pool are gone */
    s = stats(0);
    expect_eq_i64(s.allocation[CCA_STAT_ALL].current, 1);
    expect_eq_i64(s.allocation[CCA_STAT_ALL].allocated, 2);
    expect_eq_i64(s.allocation[CCA_STAT_ALL].freed, 1);
    expect_eq_i64(s.requested_bytes[CCA_STAT_ALL].current, 3000);
    expect_valid();
    expect_ok(cca_free(a));
    s = stats(0);
    expect_eq_i64(s.allocation[CCA_STAT_ALL].current, 0);
    expect_eq_i64(s.allocation[CCA_STAT_ALL].freed, 2);
    expect_valid();
    cca_shutdown();
}

TEST(stream_route_keeps_pool_apart)
{
    setup(0, false);
    void *warm = xmalloc(4 * MiB, S1); /* a default segment on S1 with room left */
    expect_ok(cca_free(warm));
    expect_ok(cca_begin_allocate_stream_to_pool(0, G1, S1));
    int uc = 0;
    expect_ok(cca_pool_use_count(0, G1, &uc));
    expect_eq_i64(uc, 1);
    void *in_pool = xmalloc(4 * MiB, S1);
    void *other = xmalloc(4 * MiB, S2);
    expect_true(in_pool != warm); /* the default segment's free block is not the pool's */
    cca_mempool_id_t id = segment_pool_of(in_pool);
    expect_true(id.first == 1 && id.second == 0);
    id = segment_pool_of(other);
    expect_true(id.first == 0 && id.second == 0);
    expect_ok(cca_free(in_pool));
    expect_valid();
    expect_ok(cca_end_allocate_to_pool(0, G1));
    /* after the capture, S1 allocations use the default pools again; the pool keeps its memory */
    void *after = xmalloc(4 * MiB, S1);
    expect_true(after == warm);
    int64_t reserved = stats(0).reserved_bytes[CCA_STAT_ALL].current;
    expect_ok(cca_empty_cache()); /* the pool is in use: its segment stays */
    expect_true(segment_pool_of(in_pool).first == 1);
    expect_ok(cca_release_pool(0, G1));
    expect_ok(cca_pool_use_count(0, G1, &uc));
    expect_eq_i64(uc, 0);
    expect_ok(cca_empty_cache());
    /* the pool's segment went back and the pool is gone */
    expect_status(cca_pool_use_count(0, G1, &uc), CCA_ERR_INVALID_ARGUMENT);
    expect_true(stats(0).reserved_bytes[CCA_STAT_ALL].current < reserved);
    expect_ok(cca_free(after));
    expect_ok(cca_free(other));
    expect_valid();
    cca_shutdown();
}

TEST(live_block_keeps_freeable_pool)
{
    setup(0, false);
    expect_ok(cca_begin_allocate_stream_to_pool(0, G1, S1));
    void *kept = xmalloc(30 * MiB, S1);   /* a graph output the program keeps */
    void *tmp = xmalloc(30 * MiB, S1);
    expect_ok(cca_free(tmp));
    expect_ok(cca_end_allocate_to_pool(0, G1));
    expect_ok(cca_release_pool(0, G1));
    int64_t segs = stats(0).segment[CCA_STAT_ALL].current;
    expect_ok(cca_empty_cache()); /* tmp's segment goes, kept's stays */
    expect_eq_i64(stats(0).segment[CCA_STAT_ALL].current, segs - 1);
    int uc = -1;
    expect_ok(cca_pool_use_count(0, G1, &uc));
    expect_eq_i64(uc, 0);
    /* a freeable pool cannot be used again */
    expect_status(cca_begin_allocate_stream_to_pool(0, G1, S1), CCA_ERR_BUSY);
    expect_status(cca_pool_create(0, G1), CCA_ERR_BUSY);
    expect_ok(cca_free(kept));
    expect_eq_i64(stats(0).segment[CCA_STAT_ALL].current, segs - 1); /* cached until emptied */
    expect_ok(cca_empty_cache());
    expect_eq_i64(stats(0).segment[CCA_STAT_ALL].current, 0);
    expect_status(cca_pool_use_count(0, G1, &uc), CCA_ERR_INVALID_ARGUMENT);
    expect_valid();
    cca_shutdown();
}

TEST(two_graphs_share_a_pool)
{
    setup(0, false);
    expect_ok(cca_begin_allocate_stream_to_pool(0, G1, S1));
    void *a = xmalloc(8 * MiB, S1);
    expect_ok(cca_free(a));
    expect_ok(cca_end_allocate_to_pool(0, G1));
    /* a second capture shares the pool: its free block is reused, same address */
    expect_ok(cca_begin_allocate_stream_to_pool(0, G1, S1));
    int uc = 0;
    expect_ok(cca_pool_use_count(0, G1, &uc));
    expect_eq_i64(uc, 2);
    void *b = xmalloc(8 * MiB, S1);
    expect_eq_ptr(b, a);
    expect_ok(cca_end_allocate_to_pool(0, G1));
    expect_ok(cca_release_pool(0, G1));
    expect_ok(cca_empty_cache());
    expect_ok(cca_pool_use_count(0, G1, &uc));
    expect_eq_i64(uc, 1); /* the second graph still holds it */
    expect_ok(cca_free(b));
    expect_ok(cca_release_pool(0, G1));
    expect_ok(cca_empty_cache());
    expect_eq_i64(stats(0).reserved_bytes[CCA_STAT_ALL].current, 0);
    expect_valid();
    cca_shutdown();
}

typedef struct thread_arg {
    void *ptr;
    cca_stream_t stream;
} thread_arg_t;

static void *other_thread(void *arg)
{
    thread_arg_t *t = arg;
    t->ptr = xmalloc(2 * MiB + 512, t->stream);
    return NULL;
}

TEST(thread_route_takes_only_its_thread)
{
    setup(0, false);
    expect_ok(cca_pool_create(0, M1)); /* MemPool() */
    expect_ok(cca_begin_allocate_thread_to_pool(0, M1)); /* use_mem_pool */
    void *mine = xmalloc(2 * MiB + 512, S1);
    thread_arg_t t = {NULL, S1};
    pthread_t th;
    pthread_create(&th, NULL, other_thread, &t);
    pthread_join(th, NULL);
    expect_true(segment_pool_of(mine).second == 1);
    expect_true(segment_pool_of(t.ptr).second == 0 && segment_pool_of(t.ptr).first == 0);
    expect_ok(cca_end_allocate_to_pool(0, M1));
    expect_ok(cca_release_pool(0, M1));
    int uc = 0;
    expect_ok(cca_pool_use_count(0, M1, &uc));
    expect_eq_i64(uc, 1);
    expect_ok(cca_free(mine));
    expect_ok(cca_free(t.ptr));
    /* ~MemPool: release, then empty the pool's cache */
    expect_ok(cca_release_pool(0, M1));
    int64_t segs = stats(0).segment[CCA_STAT_ALL].current;
    expect_ok(cca_empty_cache_pool(M1));
    expect_eq_i64(stats(0).segment[CCA_STAT_ALL].current, segs - 1); /* only the pool's */
    expect_status(cca_pool_use_count(0, M1, &uc), CCA_ERR_INVALID_ARGUMENT);
    expect_valid();
    cca_shutdown();
}

static bool filter_s2(cca_stream_t stream, void *arg)
{
    (*(int *)arg)++;
    return stream == S2;
}

/*
 * With several routes active the newest matching one takes the allocation, as
 * PyTorch 2.11's get_pool walks captures_underway from its end (nested MemPools:
 * the innermost pool); an older route takes what the newer ones do not.
 */
TEST(filter_route_and_newest_wins)
{
    setup(0, false);
    int calls = 0;
    expect_ok(cca_begin_allocate_stream_to_pool(0, G1, S2));
    expect_ok(cca_begin_allocate_to_pool(0, G2, filter_s2, &calls));
    void *p = xmalloc(MiB, S2);
    expect_true(segment_pool_of(p).first == 2); /* the newest matching route */
    void *q = xmalloc(MiB, S1);
    expect_true(segment_pool_of(q).first == 0);
    expect_true(calls > 0); /* (asked for S1, which neither route takes) */
    expect_ok(cca_end_allocate_to_pool(0, G2));
    void *r = xmalloc(MiB, S2);
    expect_true(segment_pool_of(r).first == 1); /* the newer route is over */
    expect_ok(cca_end_allocate_to_pool(0, G1));
    expect_ok(cca_free(p));
    expect_ok(cca_free(q));
    expect_ok(cca_free(r));
    expect_ok(cca_release_pool(0, G1));
    expect_ok(cca_release_pool(0, G2));
    expect_ok(cca_empty_cache());
    expect_eq_i64(stats(0).reserved_bytes[CCA_STAT_ALL].current, 0);
    expect_valid();
    cca_shutdown();
}

/*
 * A graph captured inside use_mem_pool: the capture's route is the newer, so
 * (as in PyTorch 2.11) the capture stream's allocations go to the graph's pool,
 * from the capturing thread and from another; the capturing thread's
 * allocations on another stream still go to the MemPool.
 */
TEST(capture_inside_use_mem_pool)
{
    setup(0, false);
    expect_ok(cca_pool_create(0, M1));                   /* MemPool() */
    expect_ok(cca_begin_allocate_thread_to_pool(0, M1)); /* use_mem_pool */
    expect_ok(cca_begin_allocate_stream_to_pool(0, G1, S1)); /* the capture */
    void *mine = xmalloc(MiB, S1);
    void *mine_s2 = xmalloc(MiB, S2);
    thread_arg_t t = {NULL, S1};
    pthread_t th;
    pthread_create(&th, NULL, other_thread, &t);
    pthread_join(th, NULL);
    cca_mempool_id_t a = segment_pool_of(mine), b = segment_pool_of(t.ptr), c = segment_pool_of(mine_s2);
    expect_true(a.first == 1 && a.second == 0);
    expect_true(b.first == 1 && b.second == 0);
    expect_true(c.first == 0 && c.second == 1);
    expect_ok(cca_end_allocate_to_pool(0, G1));
    expect_ok(cca_end_allocate_to_pool(0, M1));
    expect_ok(cca_free(mine));
    expect_ok(cca_free(mine_s2));
    expect_ok(cca_free(t.ptr));
    expect_ok(cca_release_pool(0, G1)); /* the graph */
    expect_ok(cca_release_pool(0, M1)); /* the end of use_mem_pool */
    expect_ok(cca_release_pool(0, M1)); /* ~MemPool */
    expect_ok(cca_empty_cache());
    expect_eq_i64(stats(0).reserved_bytes[CCA_STAT_ALL].current, 0);
    expect_valid();
    cca_shutdown();
}

/* Segments a snapshot gives pool id (PyTorch's memory_snapshot(mempool_id)). */
static size_t pool_segment_count(cca_mempool_id_t id)
{
    size_t n = 0;
    cca_snapshot_t *snap = NULL;
    if (cca_snapshot(&snap) != CCA_OK)
        return SIZE_MAX;
    for (size_t i = 0; i < snap->segment_count; i++)
        n += snap->segments[i].owner_private_pool_id[0] == id.first &&
             snap->segments[i].owner_private_pool_id[1] == id.second;
    cca_snapshot_free(snap);
    return n;
}

/*
 * PyTorch's test_nested_mempool: three MemPools entered one inside the other with
 * use_mem_pool, a 20 MiB allocation before and after each inner one. Each
 * allocation goes to the innermost pool entered: 2, 2 and 1 segments (the
 * outer pool had all 5 when the oldest route won).
 */
TEST(nested_mempools_innermost_wins)
{
    setup(0, false);
    const cca_mempool_id_t pools[3] = {{0, 11}, {0, 12}, {0, 13}};
    for (int i = 0; i < 3; i++)
        expect_ok(cca_pool_create(0, pools[i]));
    void *data[5];
    int n = 0;
    expect_ok(cca_begin_allocate_thread_to_pool(0, pools[0]));
    data[n++] = xmalloc(20 * MiB, S1);
    expect_ok(cca_begin_allocate_thread_to_pool(0, pools[1]));
    data[n++] = xmalloc(20 * MiB, S1);
    expect_ok(cca_begin_allocate_thread_to_pool(0, pools[2]));
    data[n++] = xmalloc(20 * MiB, S1);
    expect_ok(cca_end_allocate_to_pool(0, pools[2]));
    expect_ok(cca_release_pool(0, pools[2]));
    data[n++] = xmalloc(20 * MiB, S1);
    expect_ok(cca_end_allocate_to_pool(0, pools[1]));
    expect_ok(cca_release_pool(0, pools[1]));
    data[n++] = xmalloc(20 * MiB, S1);
    expect_ok(cca_end_allocate_to_pool(0, pools[0]));
    expect_ok(cca_release_pool(0, pools[0]));
    expect_eq_u64(pool_segment_count(pools[0]), 2);
    expect_eq_u64(pool_segment_count(pools[1]), 2);
    expect_eq_u64(pool_segment_count(pools[2]), 1);
    for (int i = 0; i < n; i++)
        expect_ok(cca_free(data[i]));
    for (int i = 0; i < 3; i++)
        expect_ok(cca_release_pool(0, pools[i])); /* ~MemPool */
    expect_ok(cca_empty_cache());
    expect_eq_i64(stats(0).reserved_bytes[CCA_STAT_ALL].current, 0);
    expect_valid();
    cca_shutdown();
}

TEST(frees_set_aside_during_capture)
{
    setup(0, true);
    void *before = xmalloc(MiB, S1);
    expect_ok(cca_record_stream(before, S2)); /* used on S2 before the capture */
    expect_ok(cca_begin_allocate_stream_to_pool(0, G1, S1));
    void *inside = xmalloc(MiB, S1);
    expect_ok(cca_record_stream(inside, S2)); /* used on S2 inside the capture */
    uint64_t rec = cca_sim_call_count(sim, CCA_OP_EVENT_RECORD);
    uint64_t query = cca_sim_call_count(sim, CCA_OP_EVENT_QUERY);
    expect_ok(cca_free(before));
    expect_ok(cca_free(inside));
    void *more = xmalloc(MiB, S1);
    expect_ok(cca_empty_cache());
    /* no event recorded or queried while capturing */
    expect_eq_u64(cca_sim_call_count(sim, CCA_OP_EVENT_RECORD), rec);
    expect_eq_u64(cca_sim_call_count(sim, CCA_OP_EVENT_QUERY), query);
    expect_eq_u64(atomic_load(&cca_state->devices[0].deferred_count), 2);
    expect_valid();
    expect_ok(cca_end_allocate_to_pool(0, G1));
    /* the next allocation completes them: before gets an event on S2 (recorded
     * before the capture); inside's capture-time use is dropped: reusable at once */
    void *next = xmalloc(4 * MiB, S2);
    expect_eq_u64(cca_sim_call_count(sim, CCA_OP_EVENT_RECORD), rec + 1);
    expect_eq_u64(atomic_load(&cca_state->devices[0].deferred_count), 0);
    expect_eq_i64(stats(0).active[CCA_STAT_ALL].current, 3); /* before (pending), more, next */
    expect_ok(cca_sim_complete_stream(sim, 0, S2, false));
    expect_ok(alloc_process_events());
    expect_eq_i64(stats(0).active[CCA_STAT_ALL].current, 2);
    expect_ok(cca_free(more));
    expect_ok(cca_free(next));
    expect_ok(cca_release_pool(0, G1));
    expect_ok(cca_empty_cache());
    expect_eq_i64(stats(0).reserved_bytes[CCA_STAT_ALL].current, 0);
    expect_valid();
    cca_shutdown();
}

/*
 * A backend over the simulated one whose next event query or record, once
 * armed, waits (half a second at most) for the test to say that a capture
 * has begun, and notes whether it was still under way then.
 */
static cca_backend_t slow_events;
static cca_status_t (*real_query)(void *, int, cca_event_t);
static cca_status_t (*real_record)(void *, int, cca_event_t, cca_stream_t);
static atomic_int slow_armed, slow_inside, slow_begun, slow_overlap;

static void slow_wait(void)
{
    if (!atomic_exchange(&slow_armed, 0))
        return;
    atomic_store(&slow_inside, 1);
    for (int i = 0; i < 500 && !atomic_load(&slow_begun); i++)
        usleep(1000);
    if (atomic_load(&slow_begun))
        atomic_store(&slow_overlap, 1);
}

static cca_status_t slow_query(void *ctx, int device, cca_event_t event)
{
    slow_wait();
    return real_query(ctx, device, event);
}

static cca_status_t slow_record(void *ctx, int device, cca_event_t event, cca_stream_t stream)
{
    slow_wait();
    return real_record(ctx, device, event, stream);
}

static void *malloc_on_s1(void *arg)
{
    *(void **)arg = xmalloc(512, S1);
    return NULL;
}

static void *free_it(void *arg)
{
    expect_ok(cca_free(arg));
    return NULL;
}

/* Run fn(arg) on another thread until its event call waits, begin a route on S2 to id, and
 * say the capture has begun once that returns: the call must have been over by then. */
static void begin_route_beside(void *(*fn)(void *), void *arg, cca_mempool_id_t id)
{
    atomic_store(&slow_inside, 0);
    atomic_store(&slow_begun, 0);
    atomic_store(&slow_overlap, 0);
    atomic_store(&slow_armed, 1);
    pthread_t th;
    expect_eq_i64(pthread_create(&th, NULL, fn, arg), 0);
    for (int i = 0; i < 50000 && !atomic_load(&slow_inside); i++)
        usleep(100);
    expect_true(atomic_load(&slow_inside));
    expect_ok(cca_begin_allocate_stream_to_pool(0, id, S2));
    atomic_store(&slow_begun, 1); /* cudaStreamBeginCapture(S2) */
    pthread_join(th, NULL);
    atomic_store(&slow_armed, 0);
    expect_eq_i64(atomic_load(&slow_overlap), 0);
}

/*
 * No event is queried or recorded once a route has begun: an allocation
 * processing finished events (no lock held) and a free recording the events
 * of a block used on other streams, both on another thread, are over before
 * cca_begin_allocate_*_to_pool returns, so a capture begun then sees no event
 * call (PyTorch's mutex orders them). Before, each read the route count once
 * and went on querying or recording while the capture ran.
 */
TEST(route_begin_waits_for_event_calls_in_flight)
{
    cca_sim_config_t cfg = {0};
    cfg.devices = 2;
    cfg.total_memory = 8ull << 30;
    cfg.manual_events = true;
    cca_shutdown();
    expect_ok(cca_sim_create(&cfg, &sim));
    slow_events = *sim;
    real_query = sim->event_query;
    real_record = sim->event_record;
    slow_events.event_query = slow_query;
    slow_events.event_record = slow_record;
    sim = &slow_events; /* (the simulated backend's controls take the copy too) */
    expect_ok(cca_init_with_backend(&slow_events, ""));
    /* an allocation on another thread queries the pending event of a */
    void *a = xmalloc(512, S1);
    expect_ok(cca_record_stream(a, S2));
    expect_ok(cca_free(a));
    void *p = NULL;
    begin_route_beside(malloc_on_s1, &p, G1);
    expect_true(p != NULL);
    expect_ok(cca_end_allocate_to_pool(0, G1));
    /* a free on another thread records the event of b, used on S2 */
    void *b = xmalloc(512, S1);
    expect_ok(cca_record_stream(b, S2));
    begin_route_beside(free_it, b, G2);
    expect_ok(cca_end_allocate_to_pool(0, G2));
    expect_ok(cca_free(p));
    expect_ok(cca_release_pool(0, G1));
    expect_ok(cca_release_pool(0, G2));
    expect_ok(cca_sim_complete_stream(sim, 0, NULL, true));
    expect_ok(cca_empty_cache());
    expect_eq_i64(stats(0).reserved_bytes[CCA_STAT_ALL].current, 0);
    expect_valid();
    cca_shutdown();
}

/*
 * graph_capture_record_stream_reuse: a block used on a second stream of the
 * capture and freed is reused in the capture once the allocation stream's
 * captured work follows its last uses (the second stream joined back), and
 * not before; without the setting it waits for the end of the capture.
 */
static void reuse_scenario(bool reuse)
{
    setup_settings = reuse ? "graph_capture_record_stream_reuse:True" : "";
    setup(0, true);
    setup_settings = "";
    cca_stream_t S3 = (cca_stream_t)(uintptr_t)0x3000;
    expect_ok(cca_sim_capture_begin(sim, S1));
    expect_ok(cca_begin_allocate_stream_to_pool(0, G1, S1));
    expect_ok(cca_sim_capture_work(sim, S1));
    void *p = xmalloc(4 * MiB, S1);
    void *other = xmalloc(4 * MiB, S1); /* keeps p's block from merging away */
    expect_ok(cca_sim_capture_work(sim, S1)); /* a kernel using p */
    expect_ok(cca_sim_capture_join(sim, S2, S1)); /* S2 forks from S1 */
    expect_ok(cca_record_stream(p, S2));
    expect_ok(cca_sim_capture_work(sim, S2)); /* p used on S2 */
    uint64_t queries = cca_sim_call_count(sim, CCA_OP_EVENT_QUERY);
    expect_ok(cca_free(p));
    void *q = xmalloc(4 * MiB, S1); /* S2's use is not behind S1 yet */
    expect_true(q != p);
    expect_ok(cca_sim_capture_join(sim, S1, S2)); /* S1 waits for S2 */
    expect_ok(cca_sim_capture_work(sim, S1));
    void *r = xmalloc(4 * MiB, S1);
    if (reuse)
        expect_eq_ptr(r, p); /* reused inside the capture */
    else
        expect_true(r != p); /* set aside until the capture ends */
    /* a block used on a stream outside the capture waits for the end in any case */
    expect_ok(cca_record_stream(other, S3));
    expect_ok(cca_free(other));
    expect_ok(cca_sim_capture_work(sim, S1));
    void *t = xmalloc(4 * MiB, S1);
    expect_true(t != other);
    expect_eq_u64(cca_sim_call_count(sim, CCA_OP_EVENT_QUERY), queries); /* no event queried */
    expect_valid();
    expect_ok(cca_sim_capture_end(sim, S1));
    expect_ok(cca_end_allocate_to_pool(0, G1));
    expect_ok(cca_free(q));
    expect_ok(cca_free(r));
    expect_ok(cca_free(t));
    expect_ok(cca_release_pool(0, G1));
    expect_ok(cca_sim_complete_stream(sim, 0, NULL, true));
    expect_ok(cca_empty_cache());
    expect_eq_i64(stats(0).reserved_bytes[CCA_STAT_ALL].current, 0);
    expect_valid();
    cca_shutdown();
}

TEST(record_stream_reuse_in_capture)
{
    reuse_scenario(true);
    reuse_scenario(false);
}

TEST(sim_capture_model)
{
    setup(0, false);
    cca_backend_t *b = cca_current_backend();
    expect_status(cca_sim_capture_work(sim, S1), CCA_ERR_INVALID_ARGUMENT); /* not capturing */
    expect_ok(cca_sim_capture_begin(sim, S1));
    expect_status(cca_sim_capture_begin(sim, S1), CCA_ERR_INVALID_ARGUMENT);
    int status = 0;
    uint64_t id = 0;
    const cca_graph_node_t *terms = NULL;
    size_t n = 9;
    expect_ok(b->stream_capture_info(b->ctx, 0, S1, &status, &id, &terms, &n));
    expect_eq_i64(status, CCA_CAPTURE_ACTIVE);
    expect_true(id != 0);
    expect_eq_u64(n, 0);
    expect_ok(cca_sim_capture_work(sim, S1));
    expect_ok(b->stream_capture_info(b->ctx, 0, S1, &status, &id, &terms, &n));
    expect_eq_u64(n, 1);
    cca_graph_node_t first = terms[0];
    expect_ok(cca_sim_capture_join(sim, S2, S1));
    expect_ok(cca_sim_capture_work(sim, S2));
    expect_ok(cca_sim_capture_work(sim, S1));
    expect_ok(cca_sim_capture_join(sim, S1, S2));
    expect_ok(b->stream_capture_info(b->ctx, 0, S1, &status, &id, &terms, &n));
    expect_eq_u64(n, 2); /* S1's own work and S2's */
    cca_graph_node_t deps[4];
    size_t nd = 0;
    expect_ok(b->graph_node_dependencies(b->ctx, 0, terms[0], NULL, &nd));
    expect_eq_u64(nd, 1);
    nd = 4;
    expect_ok(b->graph_node_dependencies(b->ctx, 0, terms[0], deps, &nd));
    expect_eq_ptr(deps[0], first);
    expect_status(b->graph_node_dependencies(b->ctx, 0, (cca_graph_node_t)(uintptr_t)999, NULL, &nd),
                  CCA_ERR_BACKEND);
    expect_ok(cca_sim_capture_end(sim, S2)); /* ends the whole capture */
    expect_ok(b->stream_capture_status(b->ctx, 0, S1, &status));
    expect_eq_i64(status, CCA_CAPTURE_NONE);
    expect_status(cca_sim_capture_end(sim, S1), CCA_ERR_INVALID_ARGUMENT);
    cca_shutdown();
}

TEST(oom_during_capture_keeps_cache)
{
    setup(64 * MiB, false);
    void *a = xmalloc(40 * MiB, S2);
    expect_ok(cca_free(a)); /* a cached 40 MiB default segment */
    expect_ok(cca_begin_allocate_stream_to_pool(0, G1, S1));
    void *p = NULL;
    /* PyTorch does not release every cached block during a capture */
    expect_status(cca_malloc(&p, 40 * MiB, S1), CCA_ERR_OUT_OF_MEMORY);
    expect_eq_i64(stats(0).reserved_bytes[CCA_STAT_ALL].current, 40 * MiB);
    expect_eq_i64(stats(0).num_sync_all_streams, 0);
    expect_ok(cca_end_allocate_to_pool(0, G1));
    expect_ok(cca_malloc(&p, 40 * MiB, S1)); /* now it may */
    expect_ok(cca_free(p));
    expect_ok(cca_release_pool(0, G1));
    expect_ok(cca_empty_cache());
    expect_valid();
    cca_shutdown();
}

/* A free-memory callback that sets aside a free of a block of S1's default pool (used on S2)
 * during a short route, as another thread's route ending meanwhile would leave it. */
static void *set_aside_block;

static bool set_aside_during_route(void *arg)
{
    (void)arg;
    if (!set_aside_block)
        return false;
    expect_ok(cca_begin_allocate_stream_to_pool(0, G1, S2));
    expect_ok(cca_free(set_aside_block));
    expect_eq_u64(atomic_load(&cca_state->devices[0].deferred_count), 1);
    expect_ok(cca_end_allocate_to_pool(0, G1));
    expect_ok(cca_release_pool(0, G1));
    set_aside_block = NULL;
    return false;
}

static void *make_s1_pool(void *arg)
{
    (void)arg;
    expect_ok(cca_free(xmalloc(512, S1)));
    return NULL;
}

/*
 * The out-of-memory retry of an allocation on S1 completes the frees set aside
 * while it ran, one of them a block of S1's own stream pool, whose lock the
 * allocation holds: the block goes back and its segment with the others.
 */
TEST(oom_retry_completes_a_set_aside_free_of_its_pool)
{
    setup(64 * MiB, false);
    /* S1's pool made by another thread: its lock is not biased to this one, which takes
     * the lock word (a lock word taken twice spins for ever) */
    pthread_t maker;
    expect_eq_i64(pthread_create(&maker, NULL, make_s1_pool, NULL), 0);
    pthread_join(maker, NULL);
    alarm(60);
    set_aside_block = xmalloc(8 * MiB, S1); /* a 20 MiB segment */
    expect_ok(cca_record_stream(set_aside_block, S2));
    expect_ok(cca_register_free_memory_callback(set_aside_during_route, NULL));
    void *p = xmalloc(60 * MiB, S1); /* only once the 20 MiB segment is released */
    alarm(0);
    expect_true(p != NULL);
    expect_true(set_aside_block == NULL);
    expect_eq_u64(atomic_load(&cca_state->devices[0].deferred_count), 0);
    expect_eq_i64(stats(0).segment[CCA_STAT_ALL].current, 1);
    expect_valid();
    expect_ok(cca_free(p));
    expect_ok(cca_empty_cache());
    expect_eq_i64(stats(0).reserved_bytes[CCA_STAT_ALL].current, 0);
    expect_valid();
    cca_shutdown();
}

TEST(use_on_oom_and_no_split)
{
    setup(40 * MiB, false);
    expect_ok(cca_pool_create(0, M1));
    expect_ok(cca_pool_set_no_split(0, M1));
    expect_ok(cca_begin_allocate_thread_to_pool(0, M1));
    void *p = xmalloc(4 * MiB, NULL);
    void *q = xmalloc(20 * MiB, NULL); /* no_split: a whole 20 MiB segment of its own */
    expect_ok(cca_end_allocate_to_pool(0, M1));
    expect_ok(cca_release_pool(0, M1));
    cca_snapshot_t *snap = NULL;
    expect_ok(cca_snapshot(&snap));
    size_t blocks = 0;
    for (size_t i = 0; i < snap->segment_count; i++)
        blocks += snap->segments[i].block_count;
    expect_eq_u64(blocks, snap->segment_count); /* nothing split */
    cca_snapshot_free(snap);
    expect_ok(cca_free(q));
    /* the device is full: without use_on_oom a 16 MiB request fails... */
    void *r = NULL;
    expect_status(cca_malloc(&r, 16 * MiB, NULL), CCA_ERR_OUT_OF_MEMORY);
    /* ...with it, the pool's free 20 MiB block serves it */
    expect_ok(cca_pool_set_use_on_oom(0, M1, true));
    expect_ok(cca_malloc(&r, 16 * MiB, NULL));
    expect_true(segment_pool_of(r).second == 1);
    expect_ok(cca_free(r));
    expect_ok(cca_free(p));
    expect_ok(cca_release_pool(0, M1));
    expect_ok(cca_empty_cache());
    expect_eq_i64(stats(0).reserved_bytes[CCA_STAT_ALL].current, 0);
    expect_valid();
    cca_shutdown();
}

/*
 * A pool marked use_on_oom is PyTorch's last resort (try_mempool_fallback
 * after the out-of-memory sequence): a default-pool allocation that finds no
 * memory first releases the cached blocks and retries, and takes a free block
 * of the pool only if that fails too. Before, the pool's block was taken at
 * the first failure, where releasing the default pools' cache served the
 * request in PyTorch (the statistics and the block's pool differed).
 */
TEST(use_on_oom_is_the_last_resort)
{
    setup(40 * MiB, false);
    expect_ok(cca_pool_create(0, M1));
    expect_ok(cca_pool_set_use_on_oom(0, M1, true));
    expect_ok(cca_begin_allocate_thread_to_pool(0, M1));
    void *m = xmalloc(20 * MiB, NULL); /* a 20 MiB segment of the pool */
    expect_ok(cca_end_allocate_to_pool(0, M1));
    expect_ok(cca_release_pool(0, M1)); /* the end of use_mem_pool */
    expect_ok(cca_free(m));             /* cached in the pool */
    expect_ok(cca_free(xmalloc(12 * MiB, NULL))); /* a cached 12 MiB default segment */
    /* 8 MiB free: 16 MiB fit once the default pools' 12 MiB segment is released */
    void *r = xmalloc(16 * MiB, NULL);
    cca_mempool_id_t owner = segment_pool_of(r);
    expect_true(r != NULL && owner.first == 0 && owner.second == 0);
    cca_device_stats_t s = stats(0);
    expect_eq_i64(s.num_alloc_retries, 1);
    expect_eq_i64(s.num_ooms, 0);
    expect_eq_i64(s.reserved_bytes[CCA_STAT_ALL].current, (int64_t)(36 * MiB));
    expect_valid();
    /* 4 MiB free and nothing cached in the default pools: the pool's block serves */
    void *t = xmalloc(16 * MiB, NULL);
    expect_true(t != NULL && segment_pool_of(t).second == 1);
    s = stats(0);
    expect_eq_i64(s.num_alloc_retries, 2);
    expect_eq_i64(s.num_ooms, 0);
    expect_valid();
    expect_ok(cca_free(t));
    expect_ok(cca_free(r));
    expect_ok(cca_release_pool(0, M1)); /* ~MemPool */
    expect_ok(cca_empty_cache());
    expect_eq_i64(stats(0).reserved_bytes[CCA_STAT_ALL].current, 0);
    expect_valid();
    cca_shutdown();
}

TEST(checkpoint_restore)
{
    setup(0, false);
    expect_ok(cca_begin_allocate_stream_to_pool(0, G1, S1));
    void *a = xmalloc(2 * MiB, S1);
    void *b = xmalloc(2 * MiB, S1);
    void *c = xmalloc(2 * MiB, S1);
    expect_ok(cca_free(b));
    expect_ok(cca_end_allocate_to_pool(0, G1));
    void *live[2] = {a, c};
    bool ok = false;
    expect_ok(cca_pool_check_live_allocations(0, G1, live, 2, &ok));
    expect_true(ok);
    expect_ok(cca_pool_check_live_allocations(0, G1, live, 1, &ok));
    expect_false(ok);
    cca_pool_state_t *state = NULL;
    expect_ok(cca_pool_get_checkpoint(0, G1, &state));
    expect_eq_u64(cca_pool_state_segments(state), 1);
    expect_true(cca_pool_state_id(state).first == 1);
    /* the program moves on: a and c die, d is made in the pool */
    expect_ok(cca_begin_allocate_stream_to_pool(0, G1, S1));
    expect_ok(cca_free(a));
    void *d = xmalloc(MiB, S1);
    expect_ok(cca_end_allocate_to_pool(0, G1));
    expect_ok(cca_free(c));
    cca_checkpoint_delta_t delta;
    expect_ok(cca_pool_set_checkpoint(0, state, &delta));
    expect_eq_u64(delta.freed_count, 1);
    expect_eq_ptr(delta.freed[0], d);
    expect_eq_u64(delta.allocated_count, 2);
    expect_eq_ptr(delta.allocated[0], a);
    expect_eq_ptr(delta.allocated[1], c);
    expect_ok(cca_pool_check_live_allocations(0, G1, live, 2, &ok));
    expect_true(ok);
    expect_valid();
    cca_checkpoint_delta_free(&delta);
    /* a and c are the caller's again */
    expect_ok(cca_free(a));
    expect_ok(cca_free(c));
    /* misuse: a freeable pool has no checkpoint, a checkpoint of another device */
    expect_status(cca_pool_set_checkpoint(1, state, &delta), CCA_ERR_INVALID_ARGUMENT);
    expect_ok(cca_release_pool(0, G1)); /* both captures' graphs are gone */
    expect_ok(cca_release_pool(0, G1));
    expect_status(cca_pool_get_checkpoint(0, G1, &state), CCA_ERR_BUSY);
    expect_status(cca_pool_set_checkpoint(0, state, &delta), CCA_ERR_BUSY);
    cca_pool_state_free(state);
    expect_ok(cca_empty_cache());
    expect_eq_i64(stats(0).reserved_bytes[CCA_STAT_ALL].current, 0);
    expect_valid();
    cca_shutdown();
}

/*
 * A restore allocates each checkpoint segment's blocks whole, then frees those
 * free in the checkpoint: the order of the segments decides the peak of
 * allocated bytes. As PyTorch: a segment whose first block is free comes
 * after those whose first block is allocated, small pool before large, by
 * (stream, first block's size, address). Here a small segment (a free block,
 * then a live one) older than a large one, wholly free: the small one is
 * restored first, so the large one's transient allocation comes on top of the
 * live block.
 */
TEST(checkpoint_restore_order_decides_peak)
{
    setup(0, false);
    expect_ok(cca_begin_allocate_stream_to_pool(0, G1, S1));
    void *s1 = xmalloc(64 << 10, S1);
    void *s2 = xmalloc(64 << 10, S1);
    void *big = xmalloc(20 * MiB, S1);
    expect_ok(cca_free(s1));
    expect_ok(cca_free(big));
    expect_ok(cca_end_allocate_to_pool(0, G1));
    cca_pool_state_t *state = NULL;
    expect_ok(cca_pool_get_checkpoint(0, G1, &state));
    expect_eq_u64(cca_pool_state_segments(state), 2);
    expect_ok(cca_free(s2)); /* the program moves on */
    expect_ok(cca_reset_peak_stats(0));
    cca_checkpoint_delta_t delta;
    expect_ok(cca_pool_set_checkpoint(0, state, &delta));
    expect_eq_u64(delta.allocated_count, 1);
    expect_eq_ptr(delta.allocated[0], s2);
    cca_device_stats_t st = stats(0);
    expect_eq_i64(st.allocated_bytes[CCA_STAT_ALL].current, 64 << 10);
    expect_eq_i64(st.allocated_bytes[CCA_STAT_ALL].peak, (int64_t)(20 * MiB + (64 << 10)));
    cca_checkpoint_delta_free(&delta);
    expect_ok(cca_free(s2));
    cca_pool_state_free(state);
    expect_ok(cca_release_pool(0, G1));
    expect_ok(cca_empty_cache());
    expect_eq_i64(stats(0).reserved_bytes[CCA_STAT_ALL].current, 0);
    expect_valid();
    cca_shutdown();
}

TEST(checkpoint_refuses_changed_segments)
{
    setup(0, false);
    expect_ok(cca_begin_allocate_stream_to_pool(0, G1, S1));
    void *a = xmalloc(30 * MiB, S1);
    expect_ok(cca_end_allocate_to_pool(0, G1));
    cca_pool_state_t *state = NULL;
    expect_ok(cca_pool_get_checkpoint(0, G1, &state));
    expect_ok(cca_free(a));
    expect_ok(cca_release_pool(0, G1));
    expect_ok(cca_pool_create(0, G2));
    cca_device_stats_t before = stats(0);
    cca_checkpoint_delta_t delta;
    /* the pool G1 is freeable now: refused, nothing changed */
    expect_status(cca_pool_set_checkpoint(0, state, &delta), CCA_ERR_BUSY);
    expect_eq_i64(stats(0).allocated_bytes[CCA_STAT_ALL].current,
                  before.allocated_bytes[CCA_STAT_ALL].current);
    cca_pool_state_free(state);
    expect_ok(cca_release_pool(0, G2));
    expect_ok(cca_empty_cache());
    expect_valid();
    cca_shutdown();
}

TEST(checkpoint_refuses_blocks_shared_by_ipc)
{
    setup(0, false);
    expect_ok(cca_begin_allocate_stream_to_pool(0, G1, S1));
    void *a = xmalloc(4 * MiB, S1);
    expect_ok(cca_end_allocate_to_pool(0, G1));
    cca_pool_state_t *state = NULL;
    expect_ok(cca_pool_get_checkpoint(0, G1, &state));
    cca_ipc_mem_handle_t h;
    expect_ok(cca_ipc_get_handle(a, S1, &h)); /* another process may map a now */
    cca_device_stats_t before = stats(0);
    cca_checkpoint_delta_t delta;
    expect_status(cca_pool_set_checkpoint(0, state, &delta), CCA_ERR_BUSY);
    expect_contains(cca_last_error()->message, "another process");
    cca_device_stats_t after = stats(0);
    expect_true(memcmp(&before.allocation, &after.allocation, sizeof(before.allocation)) == 0);
    expect_ok(cca_ipc_release_handle(&h));
    expect_ok(cca_pool_set_checkpoint(0, state, &delta)); /* a freed and allocated again */
    expect_eq_u64(delta.freed_count, 1);
    expect_eq_u64(delta.allocated_count, 1);
    expect_eq_ptr(delta.allocated[0], a);
    cca_checkpoint_delta_free(&delta);
    cca_pool_state_free(state);
    expect_ok(cca_free(a));
    expect_ok(cca_release_pool(0, G1));
    expect_ok(cca_empty_cache());
    expect_valid();
    cca_shutdown();
}

/*
 * A block allocated now and used on another stream (record_stream): its free
 * would wait for that stream's event, and the restore handed it out again as
 * the caller's while it waited, so the event's completion freed the caller's
 * live block and the pool gave its address out twice. The restore is refused,
 * nothing changed; once the block is freed and its stream done it goes ahead.
 */
TEST(checkpoint_refuses_blocks_used_on_other_streams)
{
    setup(0, true); /* manual events: S2's event stays pending until completed */
    expect_ok(cca_begin_allocate_stream_to_pool(0, G1, S1));
    void *a = xmalloc(2 * MiB, S1);
    expect_ok(cca_end_allocate_to_pool(0, G1));
    cca_pool_state_t *state = NULL;
    expect_ok(cca_pool_get_checkpoint(0, G1, &state)); /* a allocated */
    expect_ok(cca_record_stream(a, S2));
    cca_device_stats_t before = stats(0);
    cca_checkpoint_delta_t delta;
    memset(&delta, 0, sizeof(delta));
    expect_status(cca_pool_set_checkpoint(0, state, &delta), CCA_ERR_BUSY);
    expect_contains(cca_last_error()->message, "record_stream");
    cca_device_stats_t after = stats(0);
    expect_true(memcmp(&before.allocation, &after.allocation, sizeof(before.allocation)) == 0);
    expect_true(memcmp(&before.active, &after.active, sizeof(before.active)) == 0);
    expect_valid();
    /* S2's work ends: the pool must not hand out a's address while a is the caller's */
    expect_ok(cca_sim_complete_stream(sim, 0, S2, true));
    void *b = xmalloc(512, S1); /* (the default pools: completed events are processed) */
    expect_ok(cca_begin_allocate_stream_to_pool(0, G1, S1));
    void *c = xmalloc(2 * MiB, S1);
    expect_ok(cca_end_allocate_to_pool(0, G1));
    expect_true(c != NULL && c != a);
    expect_valid();
    expect_ok(cca_free(c));
    expect_ok(cca_free(a)); /* waits for S2's new event */
    expect_ok(cca_sim_complete_stream(sim, 0, S2, true));
    expect_ok(cca_free(b));
    b = xmalloc(512, S1); /* processes a's event: a back in the pool */
    expect_ok(cca_pool_set_checkpoint(0, state, &delta)); /* a allocated again */
    expect_eq_u64(delta.allocated_count, 1);
    if (delta.allocated_count == 1)
        expect_eq_ptr(delta.allocated[0], a);
    cca_checkpoint_delta_free(&delta);
    cca_pool_state_free(state);
    expect_ok(cca_free(a));
    expect_ok(cca_free(b));
    expect_ok(cca_release_pool(0, G1)); /* the two routes' uses */
    expect_ok(cca_release_pool(0, G1));
    expect_ok(cca_empty_cache());
    expect_eq_i64(stats(0).reserved_bytes[CCA_STAT_ALL].current, 0);
    expect_valid();
    cca_shutdown();
}

/*
 * A restore that runs out of host memory changes nothing: everything it
 * could fail for (its lists, block structs, the pointer map's buckets) is
 * made before it frees a block. Each run fails the k-th host allocation of
 * those kinds; until one passes, the program's blocks must still be its own
 * (the pool's live allocations, the statistics, the invariants). Before,
 * such a failure freed the program's blocks and left others allocated that
 * nobody held.
 */
/* A free-memory callback that holds the allocation that called it until the test opens the
 * gate: an allocation routed to a pool, under way on another thread with no lock held. */
typedef struct gate {
    atomic_int inside, open;
} gate_t;

static bool gate_callback(void *arg)
{
    gate_t *g = arg;
    atomic_store(&g->inside, 1);
    while (!atomic_load(&g->open))
        sched_yield();
    return false;
}

static void *routed_malloc(void *arg)
{
    (void)arg;
    return xmalloc(30 * MiB, S1); /* no fitting block: the slow path, callbacks first */
}

/* A checkpoint is neither taken nor restored while an allocation routed to the pool before
 * its route ended has not returned (on another thread): it would change the pool under the
 * walks; refused with CCA_ERR_BUSY, nothing changed, and both go through once it returns. */
TEST(checkpoint_waits_for_routed_allocations_in_flight)
{
    setup(0, false);
    expect_ok(cca_begin_allocate_stream_to_pool(0, G1, S1));
    void *a = xmalloc(2 * MiB, S1);
    expect_ok(cca_end_allocate_to_pool(0, G1));
    cca_pool_state_t *state = NULL;
    expect_ok(cca_pool_get_checkpoint(0, G1, &state));
    static gate_t g;
    atomic_store(&g.inside, 0);
    atomic_store(&g.open, 0);
    expect_ok(cca_register_free_memory_callback(gate_callback, &g));
    expect_ok(cca_begin_allocate_stream_to_pool(0, G1, S1));
    pthread_t t;
    expect_true(pthread_create(&t, NULL, routed_malloc, NULL) == 0);
    while (!atomic_load(&g.inside))
        sched_yield();
    expect_ok(cca_end_allocate_to_pool(0, G1)); /* the allocation is routed already */
    cca_pool_state_t *other = NULL;
    expect_status(cca_pool_get_checkpoint(0, G1, &other), CCA_ERR_BUSY);
    expect_true(strstr(cca_last_error()->message, "has not returned") != NULL);
    expect_true(other == NULL);
    cca_checkpoint_delta_t delta;
    memset(&delta, 0, sizeof(delta));
    expect_status(cca_pool_set_checkpoint(0, state, &delta), CCA_ERR_BUSY);
    expect_eq_u64(delta.freed_count, 0);
    atomic_store(&g.open, 1);
    void *b = NULL;
    expect_true(pthread_join(t, &b) == 0);
    expect_true(b != NULL);
    expect_true(segment_pool_of(b).first == G1.first); /* it went to the pool */
    expect_valid();
    /* returned: both go through; the restore frees b, keeps a */
    expect_ok(cca_pool_get_checkpoint(0, G1, &other));
    cca_pool_state_free(other);
    expect_ok(cca_pool_set_checkpoint(0, state, &delta));
    expect_eq_u64(delta.freed_count, 2);
    expect_eq_u64(delta.allocated_count, 1);
    expect_eq_ptr(delta.allocated[0], a);
    cca_checkpoint_delta_free(&delta);
    cca_pool_state_free(state);
    expect_valid();
    expect_ok(cca_free(a));
    cca_shutdown();
}

TEST(checkpoint_restore_out_of_host_memory_changes_nothing)
{
    bool restored = false;
    long refused = 0;
    for (long k = 1; k < 64 && !restored; k++) {
        setup(0, false);
        /* the checkpoint: a and c allocated, b free, in one segment */
        expect_ok(cca_begin_allocate_stream_to_pool(0, G1, S1));
        void *a = xmalloc(2 * MiB, S1), *b = xmalloc(2 * MiB, S1), *c = xmalloc(2 * MiB, S1);
        expect_ok(cca_free(b));
        expect_ok(cca_end_allocate_to_pool(0, G1));
        cca_pool_state_t *state = NULL;
        expect_ok(cca_pool_get_checkpoint(0, G1, &state));
        /* since: a freed, d made in a segment of its own; the program holds c and d */
        expect_ok(cca_begin_allocate_stream_to_pool(0, G1, S1));
        expect_ok(cca_free(a));
        void *d = xmalloc(12 * MiB, S1);
        expect_ok(cca_end_allocate_to_pool(0, G1));
        cca_device_stats_t before = stats(0);
        cca_checkpoint_delta_t delta;
        memset(&delta, 0, sizeof(delta));
        pool_test_fail_host_alloc(k);
        cca_status_t st = cca_pool_set_checkpoint(0, state, &delta);
        pool_test_fail_host_alloc(0);
        if (st == CCA_OK) { /* no k-th allocation was left to fail */
            restored = true;
            expect_eq_u64(delta.freed_count, 2);
            expect_eq_u64(delta.allocated_count, 2);
            for (size_t i = 0; i < delta.allocated_count; i++)
                expect_ok(cca_free(delta.allocated[i]));
            cca_checkpoint_delta_free(&delta);
        } else {
            refused++;
            expect_status(st, CCA_ERR_OUT_OF_MEMORY);
            void *held[2] = {c, d};
            bool same = false;
            expect_ok(cca_pool_check_live_allocations(0, G1, held, 2, &same));
            expect_true(same);
            cca_device_stats_t after = stats(0);
            expect_true(memcmp(&before.allocation, &after.allocation, sizeof(before.allocation)) == 0);
            expect_true(memcmp(&before.allocated_bytes, &after.allocated_bytes,
                               sizeof(before.allocated_bytes)) == 0);
            expect_valid();
            expect_ok(cca_free(c));
            expect_ok(cca_free(d));
        }
        cca_pool_state_free(state);
        expect_ok(cca_release_pool(0, G1)); /* the two routes' uses */
        expect_ok(cca_release_pool(0, G1));
        expect_ok(cca_empty_cache());
        expect_eq_i64(stats(0).reserved_bytes[CCA_STAT_ALL].current, 0);
        expect_valid();
        cca_shutdown();
    }
    expect_true(restored);
    printf("  %ld restores refused for want of host memory before one went through\n", refused);
    expect_true(refused >= 2); /* the lists' room at least */
}

TEST(misuse_changes_nothing)
{
    setup(0, false);
    cca_mempool_id_t none = {0, 0};
    int uc;
    bool ok;
    cca_pool_state_t *state;
    cca_device_stats_t before = stats(0);
    uint64_t mallocs = cca_sim_call_count(sim, CCA_OP_MALLOC);
    expect_status(cca_end_allocate_to_pool(0, G1), CCA_ERR_BUSY);       /* capture not begun */
    expect_status(cca_release_pool(0, G1), CCA_ERR_INVALID_ARGUMENT);   /* unknown id */
    expect_status(cca_pool_use_count(0, G1, &uc), CCA_ERR_INVALID_ARGUMENT);
    expect_status(cca_pool_set_no_split(0, G1), CCA_ERR_INVALID_ARGUMENT);
    expect_status(cca_pool_get_checkpoint(0, G1, &state), CCA_ERR_INVALID_ARGUMENT);
    expect_status(cca_pool_check_live_allocations(0, G1, NULL, 0, &ok), CCA_ERR_INVALID_ARGUMENT);
    expect_status(cca_pool_create(0, none), CCA_ERR_INVALID_ARGUMENT);  /* the default pools */
    expect_status(cca_begin_allocate_stream_to_pool(0, none, S1), CCA_ERR_INVALID_ARGUMENT);
    expect_status(cca_pool_create(7, G1), CCA_ERR_INVALID_ARGUMENT);    /* bad device */
    expect_status(cca_begin_allocate_to_pool(0, G1, NULL, NULL), CCA_ERR_INVALID_ARGUMENT);
    expect_status(cca_pool_use_count(0, G1, NULL), CCA_ERR_INVALID_ARGUMENT);
    expect_status(cca_pool_set_checkpoint(0, NULL, NULL), CCA_ERR_INVALID_ARGUMENT);
    expect_status(cca_pool_use_count(0, G1, &uc), CCA_ERR_INVALID_ARGUMENT); /* none created */
    /* begin twice, release while routed, release twice */
    expect_ok(cca_begin_allocate_stream_to_pool(0, G1, S1));
    expect_status(cca_begin_allocate_stream_to_pool(0, G1, S2), CCA_ERR_BUSY);
    expect_ok(cca_pool_use_count(0, G1, &uc));
    expect_eq_i64(uc, 1);
    expect_status(cca_release_pool(0, G1), CCA_ERR_BUSY);
    expect_ok(cca_pool_use_count(0, G1, &uc));
    expect_eq_i64(uc, 1);
    expect_status(cca_pool_get_checkpoint(0, G1, &state), CCA_ERR_BUSY); /* route active */
    expect_ok(cca_end_allocate_to_pool(0, G1));
    expect_status(cca_end_allocate_to_pool(0, G1), CCA_ERR_BUSY);
    expect_ok(cca_release_pool(0, G1));
    expect_status(cca_release_pool(0, G1), CCA_ERR_BUSY);
    expect_contains(cca_last_error()->message, "already released");
    expect_ok(cca_empty_cache());
    expect_status(cca_release_pool(0, G1), CCA_ERR_INVALID_ARGUMENT); /* gone */
    cca_device_stats_t after = stats(0);
    expect_true(memcmp(&before.allocation, &after.allocation, sizeof(before.allocation)) == 0);
    expect_eq_i64(after.reserved_bytes[CCA_STAT_ALL].current, 0);
    expect_eq_u64(cca_sim_call_count(sim, CCA_OP_MALLOC), mallocs);
    expect_valid();
    cca_shutdown();
}

/* ---- a pool's own allocator (MemPool(allocator=...)) ------------------------------ */

/* A user allocator handing out addresses of its own range, recording every segment. */
#define UA_BASE ((uintptr_t)0x7e0000000000ull)
#define UA_MAX 64
typedef struct ua_seg {
    uintptr_t ptr;
    size_t size;
    int device;
    cca_stream_t stream;
    bool live;
} ua_seg_t;
typedef struct user_alloc {
    uintptr_t next;
    ua_seg_t segs[UA_MAX];
    int count;          /* segments handed out */
    int frees;          /* frees that matched a live segment */
    int bad_frees;      /* frees of an unknown pointer or with a wrong size/device/stream */
    int refusals;       /* allocations refused (fail set) */
    bool fail;          /* refuse every allocation */
    bool fail_free;     /* refuse every free */
} user_alloc_t;

static void *ua_alloc(size_t size, int device, cca_stream_t stream, void *ctx)
{
    user_alloc_t *u = ctx;
    if (u->fail || u->count == UA_MAX) {
        u->refusals++;
        return NULL;
    }
    if (!u->next)
        u->next = UA_BASE;
    ua_seg_t *sg = &u->segs[u->count++];
    *sg = (ua_seg_t){u->next, size, device, stream, true};
    u->next += (size + 64 * MiB) & ~(2 * MiB - 1);
    return (void *)sg->ptr;
}

static cca_status_t ua_free(void *ptr, size_t size, int device, cca_stream_t stream, void *ctx)
{
    user_alloc_t *u = ctx;
    if (u->fail_free)
        return CCA_ERR_BACKEND;
    for (int i = 0; i < u->count; i++) {
        ua_seg_t *sg = &u->segs[i];
        if (sg->live && sg->ptr == (uintptr_t)ptr) {
            if (sg->size != size || sg->device != device || sg->stream != stream)
                u->bad_frees++;
            sg->live = false;
            u->frees++;
            return CCA_OK;
        }
    }
    u->bad_frees++;
    return CCA_OK;
}

static int ua_live(const user_alloc_t *u)
{
    int n = 0;
    for (int i = 0; i < u->count; i++)
        n += u->segs[i].live;
    return n;
}

static bool ua_owns(const user_alloc_t *u, const void *p)
{
    for (int i = 0; i < u->count; i++)
        if (u->segs[i].live && (uintptr_t)p >= u->segs[i].ptr &&
            (uintptr_t)p < u->segs[i].ptr + u->segs[i].size)
            return true;
    return false;
}

/* A new MemPool whose memory comes from u's functions (u cleared first). */
static cca_mempool_id_t ua_pool(user_alloc_t *u)
{
    memset(u, 0, sizeof(*u));
    cca_mempool_id_t m = cca_mempool_id_new(true);
    expect_ok(cca_pool_create(0, m));
    expect_ok(cca_pool_set_allocator(0, m, ua_alloc, ua_free, u));
    return m;
}

static uint64_t sim_bytes(int device)
{
    cca_sim_usage_t u;
    if (cca_sim_usage(sim, &u) != CCA_OK)
        return UINT64_MAX;
    return u.device_bytes[device];
}

TEST(pool_allocator_segments)
{
    setup(0, false);
    static user_alloc_t u;
    cca_mempool_id_t m = ua_pool(&u);
    uint64_t backend_mallocs = cca_sim_call_count(sim, CCA_OP_MALLOC);
    cca_device_stats_t before = stats(0);
    expect_ok(cca_begin_allocate_thread_to_pool(0, m));
    void *a = xmalloc(1000, S1);        /* small: a 2 MiB segment */
    void *b = xmalloc(3 * MiB, S1);     /* large: a 20 MiB segment */
    void *c = xmalloc(30 * MiB, S2);    /* its own 30 MiB segment, on S2 */
    void *d = xmalloc(2000, S1);        /* fits a's segment: no new one */
    expect_ok(cca_end_allocate_to_pool(0, m));
    expect_ok(cca_release_pool(0, m)); /* the end of use_mem_pool */
    void *outside = xmalloc(1000, S1);  /* default pools: the backend */
    expect_eq_i64(u.count, 3);
    expect_eq_u64(u.segs[0].size, 2 * MiB);
    expect_eq_u64(u.segs[1].size, 20 * MiB);
    expect_eq_u64(u.segs[2].size, 30 * MiB);
    expect_true(u.segs[0].stream == S1 && u.segs[2].stream == S2 && u.segs[1].device == 0);
    expect_true(ua_owns(&u, a) && ua_owns(&u, b) && ua_owns(&u, c) && ua_owns(&u, d));
    expect_false(ua_owns(&u, outside));
    expect_eq_u64(cca_sim_call_count(sim, CCA_OP_MALLOC), backend_mallocs + 1); /* only outside's */
    expect_eq_u64(sim_bytes(0), 2 * MiB);
    expect_true(segment_pool_of(c).second == m.second);
    /* statistics count them as PyTorch does: segments, reserved bytes, device allocations */
    cca_device_stats_t after = stats(0);
    expect_eq_i64(after.segment[CCA_STAT_ALL].current - before.segment[CCA_STAT_ALL].current, 4);
    expect_eq_i64(after.reserved_bytes[CCA_STAT_LARGE_POOL].current, 50 * MiB);
    expect_eq_i64(after.reserved_bytes[CCA_STAT_SMALL_POOL].current, 4 * MiB);
    expect_eq_i64(after.num_device_alloc - before.num_device_alloc, 4);
    expect_valid();
    /* frees keep the memory cached; empty_cache keeps a pool in use */
    expect_ok(cca_free(a));
    expect_ok(cca_free(b));
    expect_ok(cca_free(d));
    expect_ok(cca_free(outside));
    expect_ok(cca_empty_cache());
    expect_eq_i64(u.frees, 0);
    expect_eq_u64(sim_bytes(0), 0);
    /* released with c still live: empty_cache returns a's and b's segments, c's stays */
    expect_ok(cca_release_pool(0, m));
    expect_ok(cca_empty_cache());
    expect_eq_i64(u.frees, 2);
    expect_eq_i64(ua_live(&u), 1);
    expect_true(ua_owns(&u, c));
    expect_ok(cca_free(c));
    expect_ok(cca_empty_cache_pool(m)); /* ~MemPool */
    expect_eq_i64(u.frees, 3);
    expect_eq_i64(u.bad_frees, 0);
    expect_eq_i64(ua_live(&u), 0);
    int uc;
    expect_status(cca_pool_use_count(0, m, &uc), CCA_ERR_INVALID_ARGUMENT); /* gone */
    after = stats(0);
    expect_eq_i64(after.segment[CCA_STAT_ALL].current, 0);
    expect_eq_i64(after.reserved_bytes[CCA_STAT_ALL].current, 0);
    expect_eq_i64(after.num_device_free - before.num_device_free, 4);
    expect_valid();
    cca_shutdown();
}

TEST(pool_allocator_oom_and_shutdown)
{
    setup(0, false);
    static user_alloc_t u;
    cca_mempool_id_t m = ua_pool(&u);
    expect_ok(cca_begin_allocate_thread_to_pool(0, m));
    /* the user's allocator has no memory: a clean out-of-memory error, nothing left behind */
    u.fail = true;
    cca_device_stats_t before = stats(0);
    void *p = NULL;
    expect_status(cca_malloc(&p, 3 * MiB, S1), CCA_ERR_OUT_OF_MEMORY);
    expect_contains(cca_last_error()->message, "out of memory");
    expect_true(p == NULL);
    expect_true(u.refusals >= 1);
    expect_eq_i64(u.count, 0);
    cca_device_stats_t after = stats(0);
    expect_eq_i64(after.num_ooms - before.num_ooms, 1);
    expect_eq_i64(after.segment[CCA_STAT_ALL].current, 0);
    expect_eq_i64(after.allocation[CCA_STAT_ALL].current, 0);
    expect_eq_u64(sim_bytes(0), 0); /* no fallback to the backend */
    expect_valid();
    /* it has memory again: the same request succeeds */
    u.fail = false;
    void *q = xmalloc(3 * MiB, S1);
    void *r = xmalloc(40 * MiB, S1);
    expect_true(ua_owns(&u, q) && ua_owns(&u, r));
    expect_ok(cca_free(r));
    /* a free the user's allocator refuses keeps the segment cached, and reports it */
    expect_ok(cca_end_allocate_to_pool(0, m));
    expect_ok(cca_release_pool(0, m)); /* the end of use_mem_pool */
    expect_ok(cca_release_pool(0, m)); /* ~MemPool */
    u.fail_free = true;
    expect_status(cca_empty_cache(), CCA_ERR_BACKEND);
    expect_contains(cca_last_error()->message, "allocator could not free");
    expect_eq_i64(ua_live(&u), 2);
    expect_eq_i64(stats(0).segment[CCA_STAT_ALL].current, 2);
    expect_valid();
    u.fail_free = false;
    expect_ok(cca_empty_cache());
    expect_eq_i64(ua_live(&u), 1); /* q's: still allocated */
    /* shutdown gives q's segment back to the user's allocator */
    cca_shutdown();
    expect_eq_i64(ua_live(&u), 0);
    expect_eq_i64(u.bad_frees, 0);
}

TEST(pool_allocator_no_expandable_segments)
{
    setup_settings = "expandable_segments:True";
    setup(0, false);
    setup_settings = "";
    static user_alloc_t u;
    cca_mempool_id_t m = ua_pool(&u);
    expect_ok(cca_begin_allocate_thread_to_pool(0, m));
    void *a = xmalloc(3 * MiB, S1);
    void *b = xmalloc(3 * MiB, S1); /* the same 20 MiB segment */
    void *c = xmalloc(30 * MiB, S1);
    expect_ok(cca_end_allocate_to_pool(0, m));
    expect_eq_i64(u.count, 2);
    expect_eq_u64(u.segs[0].size, 20 * MiB);
    expect_eq_u64(u.segs[1].size, 30 * MiB);
    expect_true(ua_owns(&u, a) && ua_owns(&u, b) && ua_owns(&u, c));
    expect_eq_u64(sim_bytes(0), 0); /* nothing reserved or mapped from the backend */
    expect_eq_u64(cca_sim_call_count(sim, CCA_OP_VMM_RESERVE), 0);
    /* a plain pool's memory has checkpoints; this one's too (no expandable segment) */
    cca_pool_state_t *state = NULL;
    expect_ok(cca_pool_get_checkpoint(0, m, &state));
    expect_eq_u64(cca_pool_state_segments(state), 2);
    cca_pool_state_free(state);
    expect_ok(cca_free(a));
    expect_ok(cca_free(b));
    expect_ok(cca_free(c));
    expect_ok(cca_release_pool(0, m));
    expect_ok(cca_release_pool(0, m));
    expect_ok(cca_empty_cache());
    expect_eq_i64(ua_live(&u), 0);
    expect_eq_i64(u.bad_frees, 0);
    expect_valid();
    cca_shutdown();
}

/*
 * PyTorch's test_mempool_empty_cache_inactive under test_cuda_expandable_segments.py:
 * expandable segments switched on at run time, a MemPool with its own allocator made and
 * dropped while a tensor of it lives on; the tensor's free and empty_cache then give the
 * memory back through the pool's free function, and nothing came from the backend.
 */
TEST(pool_allocator_outlived_by_its_block_with_expandable_set_later)
{
    setup(0, false);
    expect_ok(cca_set_settings("expandable_segments:True"));
    static user_alloc_t u;
    cca_mempool_id_t m = ua_pool(&u);
    expect_ok(cca_begin_allocate_thread_to_pool(0, m));
    void *x = xmalloc(16 * MiB, S1);
    expect_ok(cca_end_allocate_to_pool(0, m));
    expect_ok(cca_release_pool(0, m)); /* use_mem_pool's exit */
    expect_ok(cca_release_pool(0, m)); /* the MemPool goes; x lives on */
    expect_eq_i64(u.count, 1);
    expect_true(ua_owns(&u, x));
    expect_eq_u64(cca_sim_call_count(sim, CCA_OP_VMM_RESERVE), 0);
    expect_ok(cca_empty_cache());
    expect_eq_i64(ua_live(&u), 1); /* x is live: nothing to give back */
    expect_ok(cca_free(x));
    expect_ok(cca_empty_cache());
    expect_eq_i64(ua_live(&u), 0);
    expect_eq_i64(u.bad_frees, 0);
    expect_eq_i64(stats(0).reserved_bytes[CCA_STAT_ALL].current, 0);
    expect_valid();
    cca_shutdown();
}

TEST(pool_allocator_misuse)
{
    setup(0, false);
    static user_alloc_t u, v;
    memset(&u, 0, sizeof(u));
    memset(&v, 0, sizeof(v));
    cca_mempool_id_t m = cca_mempool_id_new(true), none = {0, 0};
    expect_status(cca_pool_set_allocator(0, m, ua_alloc, ua_free, &u), CCA_ERR_INVALID_ARGUMENT);
    expect_contains(cca_last_error()->message, "no private pool");
    expect_status(cca_pool_set_allocator(0, none, ua_alloc, ua_free, &u), CCA_ERR_INVALID_ARGUMENT);
    expect_status(cca_pool_set_allocator(5, m, ua_alloc, ua_free, &u), CCA_ERR_INVALID_ARGUMENT);
    expect_ok(cca_pool_create(0, m));
    expect_status(cca_pool_set_allocator(0, m, ua_alloc, NULL, &u), CCA_ERR_INVALID_ARGUMENT);
    expect_status(cca_pool_set_allocator(0, m, NULL, ua_free, &u), CCA_ERR_INVALID_ARGUMENT);
    expect_status(cca_pool_set_allocator(1, m, ua_alloc, ua_free, &u), CCA_ERR_INVALID_ARGUMENT);
    /* set, then cleared (both NULL): the backend again */
    expect_ok(cca_pool_set_allocator(0, m, ua_alloc, ua_free, &u));
    expect_ok(cca_pool_set_allocator(0, m, NULL, NULL, NULL));
    expect_ok(cca_pool_set_allocator(0, m, ua_alloc, ua_free, &u));
    expect_ok(cca_begin_allocate_thread_to_pool(0, m));
    void *p = xmalloc(3 * MiB, S1);
    expect_eq_i64(u.count, 1);
    /* the pool holds memory: no other allocator, and the first one stays in use */
    expect_status(cca_pool_set_allocator(0, m, ua_alloc, ua_free, &v), CCA_ERR_BUSY);
    expect_contains(cca_last_error()->message, "already holds");
    expect_status(cca_pool_set_allocator(0, m, NULL, NULL, NULL), CCA_ERR_BUSY);
    void *q = xmalloc(30 * MiB, S1);
    expect_eq_i64(u.count, 2);
    expect_eq_i64(v.count, 0);
    expect_ok(cca_end_allocate_to_pool(0, m));
    expect_ok(cca_release_pool(0, m));
    expect_ok(cca_release_pool(0, m));
    expect_ok(cca_free(q));
    expect_ok(cca_empty_cache());
    /* freeable (released, p still live) */
    expect_status(cca_pool_set_allocator(0, m, ua_alloc, ua_free, &v), CCA_ERR_BUSY);
    expect_contains(cca_last_error()->message, "released");
    expect_ok(cca_free(p));
    expect_ok(cca_empty_cache());
    expect_eq_i64(ua_live(&u), 0);
    expect_eq_i64(v.count + v.frees, 0);
    /* a pool of a graph may have one too, and a plain pool takes the backend's memory */
    expect_ok(cca_begin_allocate_stream_to_pool(0, G2, S2));
    expect_ok(cca_pool_set_allocator(0, G2, ua_alloc, ua_free, &v));
    void *g = xmalloc(1000, S2);
    expect_true(ua_owns(&v, g));
    expect_ok(cca_end_allocate_to_pool(0, G2));
    expect_ok(cca_release_pool(0, G2));
    expect_ok(cca_free(g));
    expect_ok(cca_empty_cache());
    expect_eq_i64(ua_live(&v), 0);
    expect_eq_i64(u.bad_frees + v.bad_frees, 0);
    expect_valid();
    cca_shutdown();
}

/* (address, pool id, size) of every segment of a snapshot pickle, sorted; count returned. */
typedef struct seg_key {
    uint64_t address, pool_first, pool_second, size;
} seg_key_t;

static int seg_order(const void *a, const void *b)
{
    const seg_key_t *x = a, *y = b;
    return x->address < y->address ? -1 : x->address > y->address;
}

static size_t snapshot_segments(const char *path, seg_key_t *out, size_t cap)
{
    pv_doc_t *doc = NULL;
    if (pickle_load_file(path, &doc) != CCA_OK)
        return 0;
    const pv_node_t *segs = pv_dict_get(pv_doc_root(doc), "segments");
    size_t n = 0;
    for (size_t i = 0; segs && i < pv_len(segs) && n < cap; i++) {
        const pv_node_t *seg = pv_at(segs, i), *pool = pv_dict_get(seg, "segment_pool_id");
        seg_key_t k = {0, 0, 0, 0};
        if (!pool || !pv_get_u64(pv_dict_get(seg, "address"), &k.address) ||
            !pv_get_u64(pv_at(pool, 0), &k.pool_first) || !pv_get_u64(pv_at(pool, 1), &k.pool_second) ||
            !pv_get_u64(pv_dict_get(seg, "total_size"), &k.size))
            continue;
        out[n++] = k;
    }
    pv_doc_free(doc);
    qsort(out, n, sizeof(*out), seg_order);
    return n;
}

TEST(replay_of_graph_and_mempool_traces)
{
    const char *names[] = {"tests/data/traces/graph_mlp_default.pickle.gz",
                           "tests/data/traces/mempool_default.pickle.gz"};
    for (int i = 0; i < 2; i++) {
        cca_replay_options_t opt = {0};
        opt.trace_addresses = true;
        cca_replay_result_t r;
        char snap[512];
        snprintf(snap, sizeof(snap), "%s/private_pools_replay_%d.pickle.gz", CCA_BINARY_DIR, i);
        opt.snapshot_path = snap;
        expect_ok(cca_replay_file(names[i], &opt, &r));
        expect_eq_u64(r.address_mismatches, 0);
        expect_true(r.pool_ops > 0);
        expect_eq_u64(r.stats_mismatches, 0);
        cca_replay_result_free(&r);
        /* the end state's segments, with their pools, are PyTorch's own */
        static seg_key_t want[64], have[64];
        size_t nw = snapshot_segments(names[i], want, 64), nh = snapshot_segments(snap, have, 64);
        expect_true(nw > 0);
        expect_eq_u64(nh, nw);
        size_t private_segments = 0;
        for (size_t k = 0; k < nw && k < nh; k++) {
            expect_true(memcmp(&want[k], &have[k], sizeof(want[k])) == 0);
            private_segments += want[k].pool_first || want[k].pool_second;
        }
        expect_true(private_segments > 0);
        remove(snap);
    }
}

/* Trackers and history see each entry's private pool: PyTorch's TraceEntry carries it (NCCL's
 * registration hook registers the segments of the pools registered with a process group). */
typedef struct pool_seen {
    int n;
    cca_trace_action_t action[16];
    cca_mempool_id_t pool[16];
} pool_seen_t;

static void note_pool(const cca_trace_entry_t *e, void *arg)
{
    pool_seen_t *seen = arg;
    if (seen->n < 16) {
        seen->action[seen->n] = e->action;
        seen->pool[seen->n++] = e->pool;
    }
}

static bool is_pool(cca_mempool_id_t a, cca_mempool_id_t b)
{
    return a.first == b.first && a.second == b.second;
}

TEST(trace_entries_carry_the_private_pool)
{
    setup(0, false);
    pool_seen_t seen = {0};
    cca_mempool_id_t none = {0, 0};
    expect_ok(cca_attach_trace_tracker(note_pool, &seen));
    expect_ok(cca_record_history(true, NULL, NULL, 64, CCA_RECORD_CONTEXT_NEVER));
    expect_ok(cca_pool_create(0, M1));
    expect_ok(cca_begin_allocate_stream_to_pool(0, M1, S2));
    void *p = xmalloc(3000, S2); /* segment_alloc, alloc: in M1 */
    void *q = xmalloc(3000, S1); /* segment_alloc, alloc: default pool */
    expect_ok(cca_free(p));      /* free_requested, free_completed: M1 */
    expect_ok(cca_end_allocate_to_pool(0, M1));
    expect_ok(cca_release_pool(0, M1));
    expect_ok(cca_release_pool(0, M1));
    expect_ok(cca_empty_cache()); /* segment_free: M1 */
    expect_eq_i64(seen.n, 7);
    static const cca_trace_action_t want[7] = {CCA_TRACE_SEGMENT_ALLOC, CCA_TRACE_ALLOC,
                                               CCA_TRACE_SEGMENT_ALLOC, CCA_TRACE_ALLOC,
                                               CCA_TRACE_FREE_REQUESTED, CCA_TRACE_FREE_COMPLETED,
                                               CCA_TRACE_SEGMENT_FREE};
    const bool in_m1[7] = {true, true, false, false, true, true, true};
    for (int i = 0; i < seen.n && i < 7; i++) {
        expect_eq_i64(seen.action[i], want[i]);
        expect_true(is_pool(seen.pool[i], in_m1[i] ? M1 : none));
    }
    cca_trace_entry_t *list = NULL;
    size_t count = 0;
    expect_ok(cca_history_get(&list, &count));
    expect_eq_u64(count, 7);
    for (size_t i = 0; i < count && i < 7; i++)
        expect_true(is_pool(list[i].pool, in_m1[i] ? M1 : none));
    cca_history_free(list);
    expect_ok(cca_detach_trace_tracker(note_pool, &seen));
    expect_ok(cca_record_history(false, NULL, NULL, 0, CCA_RECORD_CONTEXT_NEVER));
    expect_ok(cca_free(q));
    expect_valid();
}

int main(void)
{
    RUN(ids);
    RUN(relaxed_statistics_count_private_pools);
    RUN(stream_route_keeps_pool_apart);
    RUN(live_block_keeps_freeable_pool);
    RUN(two_graphs_share_a_pool);
    RUN(thread_route_takes_only_its_thread);
    RUN(filter_route_and_newest_wins);
    RUN(nested_mempools_innermost_wins);
    RUN(capture_inside_use_mem_pool);
    RUN(frees_set_aside_during_capture);
    RUN(route_begin_waits_for_event_calls_in_flight);
    RUN(sim_capture_model);
    RUN(record_stream_reuse_in_capture);
    RUN(oom_during_capture_keeps_cache);
    RUN(oom_retry_completes_a_set_aside_free_of_its_pool);
    RUN(use_on_oom_and_no_split);
    RUN(use_on_oom_is_the_last_resort);
    RUN(checkpoint_restore);
    RUN(checkpoint_restore_order_decides_peak);
    RUN(pool_allocator_outlived_by_its_block_with_expandable_set_later);
    RUN(checkpoint_waits_for_routed_allocations_in_flight);
    RUN(checkpoint_refuses_changed_segments);
    RUN(checkpoint_refuses_blocks_shared_by_ipc);
    RUN(checkpoint_refuses_blocks_used_on_other_streams);
    RUN(checkpoint_restore_out_of_host_memory_changes_nothing);
    RUN(misuse_changes_nothing);
    RUN(replay_of_graph_and_mempool_traces);
    RUN(pool_allocator_segments);
    RUN(pool_allocator_oom_and_shutdown);
    RUN(pool_allocator_no_expandable_segments);
    RUN(pool_allocator_misuse);
    RUN(trace_entries_carry_the_private_pool);
    return harness_done();
}
