/*
 * test_fault.c - fault loops. For each scenario and each backend operation
 * the scenario calls, fail its 1st, 2nd, 3rd ... call, once and then
 * persistently, until the scenario runs with no fault firing. Every step must
 * end in success or a clean error status (a known status with a message),
 * the invariants must hold after each step, and after freeing everything and
 * emptying both caches the simulated backend must hold no byte, allocation,
 * event or host block. After every step each device's backend memory must be
 * exactly what the allocator accounts for (segments plus mapped granules of
 * expandable segments): a failure in the middle of growing an expandable
 * segment maps nothing unaccounted.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "async.h"
#include "check.h"
#include "runtime.h"
#include "async.h"
#include "device.h"
#include "harness.h"
#include "plan_loop.h"

#define MiB ((size_t)1 << 20)
#define S1 ((cca_stream_t)(uintptr_t)0x1000)
#define S2 ((cca_stream_t)(uintptr_t)0x2000)

static cca_backend_t *sim;      /* the simulated backend (for the cca_sim_* calls) */
static cca_backend_t wrapper;   /* what cca runs on: sim's table, destroy hooked */
static cca_sim_usage_t final_usage; /* sim's usage when cca_shutdown destroyed it */

/* Read the backend's usage as cca_shutdown destroys it: nothing may be left. */
static void wrapper_destroy(void *ctx)
{
    cca_sim_usage(sim, &final_usage);
    sim->destroy(ctx);
}
static void *held[256];      /* device pointers the scenario holds */
static size_t nheld;
static void *held_host[64];  /* host pointers */
static size_t nheld_host;
static const char *cur_scenario;
static char cur_fault[128];
static uint64_t steps_run, runs_run, faults_fired;

/* Check one step's outcome and the invariants after it. */
static void step_check(cca_status_t st, const char *what)
{
    steps_run++;
    if (st != CCA_OK) {
        bool known = st == CCA_ERR_OUT_OF_MEMORY || st == CCA_ERR_BACKEND || st == CCA_ERR_NOT_READY;
        if (!known)
            HARNESS_FAIL("%s [%s]: %s returned unexpected %s: %s", cur_scenario, cur_fault, what,
                         cca_status_str(st), cca_last_error()->message);
        if (cca_last_error()->status != st || !cca_last_error()->message[0])
            HARNESS_FAIL("%s [%s]: %s returned %s without a message", cur_scenario, cur_fault, what,
                         cca_status_str(st));
    }
    char why[512];
    if (alloc_check_invariants(why, sizeof(why)) != CCA_OK)
        HARNESS_FAIL("%s [%s]: after %s: %s", cur_scenario, cur_fault, what, why);
    cca_sim_usage_t u;
    if (async_enabled() || cca_sim_usage(sim, &u) != CCA_OK)
        return; /* under cudaMallocAsync the driver's pool holds memory the allocator does not count */
    for (int d = 0; d < cca_state->device_count; d++) {
        cca_device_t *dev = &cca_state->devices[d];
        if (!dev->orphan_count && u.device_bytes[d] != dev->total_allocated_memory)
            HARNESS_FAIL("%s [%s]: after %s: device %d: the backend holds %zu bytes, the "
                         "allocator accounts for %zu", cur_scenario, cur_fault, what, d,
                         u.device_bytes[d], dev->total_allocated_memory);
    }
}

static void do_malloc(size_t size, int device, cca_stream_t stream)
{
    void *p = NULL;
    cca_status_t st = cca_malloc_device(&p, size, device, stream);
    if (st == CCA_OK && p && nheld < 256)
        held[nheld++] = p;
    step_check(st, "cca_malloc");
}

/* Free the i-th held pointer; it stays held if the call failed and it is still live. */
static void do_free(size_t i)
{
    if (i >= nheld)
        return;
    void *p = held[i];
    cca_status_t st = cca_free(p);
    bool live = async_enabled() ? async_get_base_allocation(p, NULL, NULL) == CCA_OK
                                : ptrmap_find(cca_state->ptrmap, (uintptr_t)p, false) != NULL;
    if (st == CCA_OK || !live)
        held[i] = held[--nheld];
    step_check(st, "cca_free");
}

static void do_record(size_t i, cca_stream_t stream)
{
    if (i < nheld)
        step_check(cca_record_stream(held[i], stream), "cca_record_stream");
}

static void do_host_malloc(size_t size)
{
    void *p = NULL;
    cca_status_t st = cca_host_malloc(&p, size);
    if (st == CCA_OK && p && nheld_host < 64)
        held_host[nheld_host++] = p;
    step_check(st, "cca_host_malloc");
}

static void do_host_free(size_t i)
{
    if (i >= nheld_host)
        return;
    cca_status_t st = cca_host_free(held_host[i]);
    if (st == CCA_OK)
        held_host[i] = held_host[--nheld_host];
    step_check(st, "cca_host_free");
}

/* ---- scenarios ---------------------------------------------------------------- */

/* Allocations across both pools, three streams and two devices; frees; reuse. */
static void scenario_burst(void)
{
    static const size_t sizes[] = {1000, 600 * 1024, 3 * MiB, 12 * MiB, 25 * MiB, 512};
    cca_stream_t streams[] = {NULL, S1, S2};
    for (int i = 0; i < 12; i++)
        do_malloc(sizes[i % 6], i % 4 == 3, streams[i % 3]);
    for (size_t i = 0; i < nheld; i += 2)
        do_free(i);
    for (int i = 0; i < 6; i++)
        do_malloc(sizes[(i + 2) % 6] / 2 + 1, 0, streams[i % 3]);
}

/* Frees with pending record_stream events, partly completed, then reuse. */
static void scenario_events(void)
{
    for (int i = 0; i < 6; i++)
        do_malloc(i % 2 ? 4 * MiB : 8192, 0, NULL);
    for (size_t i = 0; i < nheld; i++)
        do_record(i, i % 2 ? S1 : S2);
    do_record(0, S1);
    for (size_t i = nheld; i-- > 2;)
        do_free(i);
    step_check(cca_sim_complete_stream(sim, 0, S1, false), "complete S1");
    do_malloc(8192, 0, NULL);    /* processes events */
    do_malloc(4 * MiB, 0, NULL);
    step_check(cca_sim_complete_stream(sim, 0, NULL, true), "complete all");
    step_check(alloc_process_events(), "process_events");
    do_malloc(8192, 0, NULL);
}

/* The out-of-memory sequence: fraction cap, oversize release, release-all and retry. */
static void scenario_oom(void)
{
    step_check(cca_set_memory_fraction(0.5, 0), "cca_set_memory_fraction"); /* 64 MiB of 128 */
    do_malloc(30 * MiB, 0, NULL);
    do_malloc(20 * MiB, 0, S1);
    do_malloc(1000, 0, S1);
    do_record(0, S2);
    do_free(0);                      /* 30 MiB waits for S2 */
    do_free(0);
    do_malloc(40 * MiB, 0, NULL);    /* needs release of S1's cache + sync of the event */
    do_malloc(60 * MiB, 0, NULL);    /* beyond the fraction: OOM */
    step_check(cca_set_memory_fraction(1.0, 0), "cca_set_memory_fraction");
    do_malloc(60 * MiB, 0, S2);      /* device cap 96 MiB: release and retry */
}

/* empty_cache with cached blocks on several streams and pending events. */
static void scenario_empty_cache(void)
{
    do_malloc(1000, 0, NULL);
    do_malloc(3 * MiB, 0, S1);
    do_malloc(12 * MiB, 1, S2);
    do_malloc(2000, 0, S2);
    do_record(0, S1);
    do_record(1, S2);
    do_free(0);
    do_free(0);
    step_check(cca_empty_cache(), "cca_empty_cache");
    for (size_t i = nheld; i-- > 0;)
        do_free(i);
    step_check(cca_empty_cache(), "cca_empty_cache");
}

/* Forget a held pointer (it is no longer live). */
static void forget_held(void *p)
{
    for (size_t i = 0; i < nheld; i++)
        if (held[i] == p) {
            held[i] = held[--nheld];
            return;
        }
}

/* Checkpoint pool id, change it, restore it; the held list follows the delta. */
static void do_checkpoint_cycle(cca_mempool_id_t id)
{
    cca_pool_state_t *state = NULL;
    cca_status_t st = cca_pool_get_checkpoint(0, id, &state);
    step_check(st, "cca_pool_get_checkpoint");
    if (st != CCA_OK)
        return;
    step_check(cca_begin_allocate_stream_to_pool(0, id, S1), "cca_begin_allocate_stream_to_pool");
    do_malloc(2000, 0, S1);
    do_malloc(5 * MiB, 0, S1);
    step_check(cca_end_allocate_to_pool(0, id), "cca_end_allocate_to_pool");
    cca_checkpoint_delta_t d;
    st = cca_pool_set_checkpoint(0, state, &d);
    step_check(st, "cca_pool_set_checkpoint");
    if (st == CCA_OK) {
        for (size_t i = 0; i < d.freed_count; i++)
            forget_held(d.freed[i]);
        for (size_t i = 0; i < d.allocated_count; i++) {
            forget_held(d.allocated[i]);
            if (nheld < 256)
                held[nheld++] = d.allocated[i];
        }
        cca_checkpoint_delta_free(&d);
    }
    cca_pool_state_free(state);
    step_check(cca_release_pool(0, id), "cca_release_pool"); /* the second graph is gone */
}

/* Restore state; the held list follows the delta. */
static void do_restore(const cca_pool_state_t *state)
{
    if (!state)
        return;
    cca_checkpoint_delta_t d;
    cca_status_t st = cca_pool_set_checkpoint(0, state, &d);
    step_check(st, "cca_pool_set_checkpoint");
    if (st != CCA_OK)
        return;
    for (size_t i = 0; i < d.freed_count; i++)
        forget_held(d.freed[i]);
    for (size_t i = 0; i < d.allocated_count; i++)
        if (nheld < 256)
            held[nheld++] = d.allocated[i];
    cca_checkpoint_delta_free(&d);
}

/*
 * Checkpoints of a private pool holding an expandable segment (cudagraph trees
 * under expandable_segments:True): one taken small, one after the segment
 * grew; restoring the small one unmaps the growth, the big one maps it again.
 */
static void scenario_pools_expandable(void)
{
    cca_mempool_id_t g = {9, 0};
    cca_pool_state_t *small = NULL, *big = NULL;
    step_check(cca_begin_allocate_stream_to_pool(0, g, S1), "cca_begin_allocate_stream_to_pool");
    do_malloc(10 * MiB, 0, S1);
    do_malloc(2 * MiB, 0, S1);
    do_malloc(16 * MiB, 0, S1); /* 28 MiB in 40 mapped (20 MiB granules) */
    do_free(nheld - 2);
    step_check(cca_end_allocate_to_pool(0, g), "cca_end_allocate_to_pool");
    step_check(cca_pool_get_checkpoint(0, g, &small), "cca_pool_get_checkpoint");
    step_check(cca_begin_allocate_stream_to_pool(0, g, S1), "cca_begin_allocate_stream_to_pool");
    do_malloc(30 * MiB, 0, S1); /* grows to 60 MiB mapped */
    step_check(cca_end_allocate_to_pool(0, g), "cca_end_allocate_to_pool");
    step_check(cca_pool_get_checkpoint(0, g, &big), "cca_pool_get_checkpoint");
    do_restore(small);
    do_restore(big);
    do_restore(small);
    cca_pool_state_free(small);
    cca_pool_state_free(big);
    step_check(cca_release_pool(0, g), "cca_release_pool");
    step_check(cca_release_pool(0, g), "cca_release_pool");
}

/*
 * Private pools: a graph capture (empty_cache, a route on S1, allocations and
 * frees in the pool, frees set aside for blocks used on S2, the end of the
 * capture and the set-aside frees completed), a checkpoint cycle with a second
 * capture into the pool, the graphs' release and empty_cache; then a MemPool used by this thread, released and
 * emptied.
 */
static void scenario_pools(void)
{
    cca_mempool_id_t g = {1, 0}, m = {0, 1};
    do_malloc(3 * MiB, 0, S1);
    do_record(0, S2);
    step_check(cca_empty_cache(), "cca_empty_cache");
    step_check(cca_begin_allocate_stream_to_pool(0, g, S1), "cca_begin_allocate_stream_to_pool");
    do_malloc(1000, 0, S1);
    do_malloc(12 * MiB, 0, S1);
    do_malloc(3 * MiB, 0, S1);
    do_record(nheld - 1, S2); /* recorded during the capture */
    do_free(nheld - 1);       /* set aside */
    do_free(0);               /* used on S2 before the capture: set aside */
    do_malloc(600 * 1024, 0, S1);
    step_check(cca_end_allocate_to_pool(0, g), "cca_end_allocate_to_pool");
    do_malloc(8192, 0, NULL); /* completes the set-aside frees */
    step_check(cca_sim_complete_stream(sim, 0, S2, false), "complete S2");
    do_checkpoint_cycle(g);
    step_check(cca_release_pool(0, g), "cca_release_pool");
    step_check(cca_empty_cache(), "cca_empty_cache");
    step_check(cca_pool_create(0, m), "cca_pool_create");
    step_check(cca_begin_allocate_thread_to_pool(0, m), "cca_begin_allocate_thread_to_pool");
    do_malloc(25 * MiB, 0, NULL);
    do_malloc(1000, 0, S2);
    step_check(cca_end_allocate_to_pool(0, m), "cca_end_allocate_to_pool");
    step_check(cca_release_pool(0, m), "cca_release_pool");
    do_free(nheld - 1);
    step_check(cca_release_pool(0, m), "cca_release_pool"); /* ~MemPool */
    step_check(cca_empty_cache_pool(m), "cca_empty_cache_pool");
}

/*
 * graph_capture_record_stream_reuse: a block used on a second captured
 * stream, freed, and reused in the capture once that stream joined back
 * (the capture graph read through stream_capture_info and
 * graph_node_dependencies).
 */
static void scenario_pools_reuse(void)
{
    cca_mempool_id_t g = {5, 0};
    step_check(cca_sim_capture_begin(sim, S1), "cca_sim_capture_begin");
    step_check(cca_begin_allocate_stream_to_pool(0, g, S1), "cca_begin_allocate_stream_to_pool");
    do_malloc(4 * MiB, 0, S1);
    do_malloc(4 * MiB, 0, S1);
    step_check(cca_sim_capture_work(sim, S1), "cca_sim_capture_work");
    step_check(cca_sim_capture_join(sim, S2, S1), "cca_sim_capture_join");
    do_record(0, S2);
    step_check(cca_sim_capture_work(sim, S2), "cca_sim_capture_work");
    do_free(0);
    step_check(cca_sim_capture_join(sim, S1, S2), "cca_sim_capture_join");
    step_check(cca_sim_capture_work(sim, S1), "cca_sim_capture_work");
    do_malloc(4 * MiB, 0, S1); /* the freed block again */
    do_malloc(1000, 0, S1);
    step_check(cca_sim_capture_end(sim, S1), "cca_sim_capture_end");
    step_check(cca_end_allocate_to_pool(0, g), "cca_end_allocate_to_pool");
    step_check(cca_release_pool(0, g), "cca_release_pool");
}

/*
 * A pool's own allocator (MemPool(allocator=...)): the user's functions take
 * the backend's memory themselves, so the backend's faults reach them (a
 * refused allocation is an out-of-memory error, a refused free keeps the
 * segment cached) and the accounting checks see their segments.
 */
static long ua_live;

static void *fault_ua_alloc(size_t size, int device, cca_stream_t stream, void *ctx)
{
    (void)stream;
    (void)ctx;
    void *p = NULL;
    if (sim->malloc(sim->ctx, device, size, &p) != CCA_OK)
        return NULL;
    ua_live++;
    return p;
}

static cca_status_t fault_ua_free(void *ptr, size_t size, int device, cca_stream_t stream, void *ctx)
{
    (void)size;
    (void)stream;
    (void)ctx;
    cca_status_t st = sim->free(sim->ctx, device, ptr);
    if (st == CCA_OK)
        ua_live--;
    return st;
}

static void scenario_pools_allocator(void)
{
    cca_mempool_id_t m = {0, 9}, g = {9, 0};
    step_check(cca_pool_create(0, m), "cca_pool_create");
    step_check(cca_pool_set_allocator(0, m, fault_ua_alloc, fault_ua_free, NULL), "cca_pool_set_allocator");
    step_check(cca_begin_allocate_thread_to_pool(0, m), "cca_begin_allocate_thread_to_pool");
    do_malloc(1000, 0, S1);
    do_malloc(12 * MiB, 0, S1);
    do_malloc(3 * MiB, 0, S2);
    do_free(nheld - 2);
    do_malloc(100 * MiB, 0, S1); /* more than the device has left: out of memory, nothing kept */
    do_malloc(12 * MiB, 0, S1);  /* the cached block */
    step_check(cca_end_allocate_to_pool(0, m), "cca_end_allocate_to_pool");
    step_check(cca_release_pool(0, m), "cca_release_pool"); /* the end of use_mem_pool */
    do_malloc(50 * MiB, 0, S1);   /* the default pools, from the backend */
    do_free(0);
    step_check(cca_release_pool(0, m), "cca_release_pool"); /* ~MemPool */
    step_check(cca_empty_cache_pool(m), "cca_empty_cache_pool");
    step_check(cca_begin_allocate_stream_to_pool(0, g, S2), "cca_begin_allocate_stream_to_pool");
    step_check(cca_pool_set_allocator(0, g, fault_ua_alloc, fault_ua_free, NULL), "cca_pool_set_allocator");
    do_malloc(5 * MiB, 0, S2);
    do_malloc(700 * 1024, 0, S2);
    do_free(nheld - 1);
    step_check(cca_end_allocate_to_pool(0, g), "cca_end_allocate_to_pool");
    step_check(cca_release_pool(0, g), "cca_release_pool");
    step_check(cca_empty_cache(), "cca_empty_cache");
}

/* Run-time settings changes between allocations. */
static void scenario_settings(void)
{
    do_malloc(30 * MiB, 0, NULL);
    do_malloc(3 * MiB, 0, NULL);
    do_free(0);
    step_check(cca_set_settings("max_split_size_mb:20,roundup_power2_divisions:4"), "cca_set_settings");
    do_malloc(25 * MiB, 0, NULL);
    do_malloc(5 * MiB + 3, 0, NULL);
    step_check(cca_set_settings("garbage_collection_threshold:0.5,per_process_memory_fraction:0.6"),
               "cca_set_settings");
    do_free(0);
    do_malloc(40 * MiB, 0, S1);
    do_malloc(40 * MiB, 0, S2);
    step_check(cca_set_settings("pinned_max_cached_size_mb:1,pinned_max_round_threshold_mb:1"),
               "cca_set_settings");
    do_host_malloc(3 * MiB);
    do_host_free(0);
}

/* The pinned host allocator: allocate, record events, free, reuse, empty. */
static void scenario_host(void)
{
    do_host_malloc(1000);
    do_host_malloc(5000);
    do_host_malloc(2 * MiB);
    if (nheld_host > 0)
        step_check(cca_host_record_event(held_host[0], S1), "cca_host_record_event");
    if (nheld_host > 1)
        step_check(cca_host_record_event(held_host[1], S2), "cca_host_record_event");
    do_host_free(0);
    do_host_free(0);
    do_host_malloc(1000);
    step_check(cca_sim_complete_stream(sim, 0, NULL, true), "complete all");
    do_host_malloc(900);
    step_check(cca_host_empty_cache(), "cca_host_empty_cache");
    for (size_t i = nheld_host; i-- > 0;)
        do_host_free(i);
}

/* Peer access between the two devices and copies; allocations on both. */
static void scenario_peer(void)
{
    do_malloc(4 * MiB, 0, NULL);
    do_malloc(4 * MiB, 1, S1);
    step_check(cca_enable_peer_access(1, 0), "cca_enable_peer_access");
    step_check(cca_enable_peer_access(0, 1), "cca_enable_peer_access");
    if (nheld == 2)
        step_check(cca_memcpy_peer_async(held[1], 1, held[0], 0, MiB, S1), "cca_memcpy_peer_async");
    do_free(0);
    do_malloc(1000, 1, NULL);
}

/* Blocks shared through IPC handles: deferred frees, released references, collection. */
static void scenario_ipc(void)
{
    cca_ipc_mem_handle_t h[3];
    bool made[3] = {false, false, false};
    do_malloc(1000, 0, NULL);
    do_malloc(3 * MiB, 0, S1);
    do_malloc(30 * MiB, 1, NULL);
    size_t n = nheld;
    void *p[3] = {NULL, NULL, NULL};
    for (size_t i = 0; i < n && i < 3; i++) {
        p[i] = held[i];
        size_t len = 0;
        /* the third through the serialized form (its length is the fixed one here) */
        cca_status_t st = i == 2 ? cca_ipc_get_handle_bytes(p[i], NULL, h[i].bytes,
                                                            sizeof(h[i].bytes), &len)
                                 : cca_ipc_get_handle(p[i], NULL, &h[i]);
        made[i] = st == CCA_OK;
        step_check(st, i == 2 ? "cca_ipc_get_handle_bytes" : "cca_ipc_get_handle");
    }
    for (size_t i = nheld; i-- > 0;)
        do_free(i); /* shared ones are deferred */
    for (size_t i = 0; i < 3; i++)
        if (made[i] && i != 1)
            step_check(i == 2 ? cca_ipc_release_handle_bytes(h[i].bytes, sizeof(h[i].bytes))
                              : cca_ipc_release_handle(&h[i]),
                       "cca_ipc_release_handle");
    /* fits only once the small segment goes: the miss collects, the OOM path releases */
    do_malloc(52 * MiB, 0, S2);
    size_t pending = 0;
    if (made[1])
        step_check(cca_ipc_release_handle(&h[1]), "cca_ipc_release_handle");
    step_check(cca_ipc_collect(&pending), "cca_ipc_collect");
}

/* The pool id of scenario_async's graph capture. */
#define ASYNC_CAPTURE_POOL ((cca_mempool_id_t){7, 0})

/* backend:cudaMallocAsync: streams, devices, record_stream, fraction, empty_cache, stats,
 * a graph capture. */
static void scenario_async(void)
{
    do_malloc(1000, 0, NULL);
    do_malloc(3 * MiB, 0, S1);
    do_malloc(12 * MiB, 1, S2);
    do_record(0, S1);
    do_record(1, S2);
    do_free(0);
    step_check(cca_set_memory_fraction(0.25, 0), "cca_set_memory_fraction");
    do_malloc(40 * MiB, 0, S1); /* beyond the fraction */
    do_malloc(20 * MiB, 0, S1);
    cca_device_stats_t ds;
    step_check(cca_get_device_stats(0, &ds), "cca_get_device_stats");
    step_check(cca_reset_peak_stats(0), "cca_reset_peak_stats");
    size_t cached, largest;
    step_check(cca_cache_info(0, &cached, &largest), "cca_cache_info");
    do_free(0);
    step_check(cca_empty_cache(), "cca_empty_cache");
    step_check(cca_enable_peer_access(1, 0), "cca_enable_peer_access");
    do_malloc(100 * MiB, 0, NULL); /* device cap */
    /* a graph capture, as PyTorch's CudaMallocAsync: the free of an earlier allocation is
     * deferred, frees inside it are joined back into the capture stream at its end, the next
     * allocation completes the deferred free */
    do_malloc(2 * MiB, 0, S1);
    cca_status_t st = cca_begin_allocate_stream_to_pool(0, ASYNC_CAPTURE_POOL, S1);
    step_check(st, "cca_begin_allocate_stream_to_pool");
    if (st == CCA_OK) {
        do_free(nheld - 1); /* deferred */
        do_malloc(MiB, 0, S2);
        do_record(nheld - 1, S1);
        do_free(nheld - 1); /* through the unifying stream */
        do_malloc(MiB, 1, S2);
        do_free(nheld - 1);
        step_check(cca_end_allocate_to_pool(0, ASYNC_CAPTURE_POOL), "cca_end_allocate_to_pool");
    }
    do_malloc(MiB, 0, S1);
}

/* Expandable segments: growth over several granules and streams, holes
 * mapped again, events, unmapping on empty_cache and on the OOM path. */
static void scenario_expandable(void)
{
    do_malloc(1000, 0, NULL);        /* small pool: a 2 MiB granule */
    do_malloc(3 * MiB, 0, NULL);     /* large pool: a 20 MiB granule */
    do_malloc(30 * MiB, 0, NULL);    /* grows at the end: one more granule */
    do_malloc(45 * MiB, 0, S1);      /* another stream's segment: three granules at once */
    do_malloc(900 * 1024, 0, NULL);
    do_malloc(5 * MiB, 1, S2);       /* device 1 */
    do_record(2, S2);
    do_free(2);                      /* 30 MiB waits for S2 */
    do_free(1);
    step_check(cca_empty_cache(), "cca_empty_cache"); /* syncs the event, unmaps free granules */
    do_malloc(25 * MiB, 0, NULL);    /* maps the hole again */
    do_malloc(50 * MiB, 0, NULL);    /* beyond the cap: unmaps S1's cache and retries, or OOM */
    for (size_t i = nheld; i-- > 0;)
        do_free(i);
    step_check(cca_empty_cache(), "cca_empty_cache"); /* every reservation goes */
    do_malloc(7 * MiB, 0, NULL);
}

/* Switching expandable segments on and off between allocations. */
static void scenario_expandable_switch(void)
{
    do_malloc(5 * MiB, 0, NULL);     /* a plain segment */
    step_check(cca_set_settings("expandable_segments:True"), "cca_set_settings");
    do_malloc(5 * MiB, 0, NULL);     /* from the plain segment's cache */
    do_malloc(40 * MiB, 0, NULL);    /* an expandable segment */
    do_free(2);
    step_check(cca_set_settings("expandable_segments:False"), "cca_set_settings");
    do_malloc(30 * MiB, 0, NULL);    /* skips the expandable block: a plain segment */
    step_check(cca_empty_cache(), "cca_empty_cache");
    step_check(cca_set_settings("expandable_segments:True,max_split_size_mb:40"), "cca_set_settings");
    do_malloc(2 * MiB, 0, S1);
    do_malloc(60 * MiB, 0, NULL);
}

/* compact_memory: holes in one stream's segments lent to the growth of
 * another stream's and of the other kind's (their streams' events recorded
 * and queried, never waited for; a failed event call synchronises the
 * stream instead), the OOM path with lending. */
static void scenario_compact(void)
{
    do_malloc(10 * MiB, 0, NULL);
    do_malloc(10 * MiB, 0, NULL);
    do_malloc(10 * MiB, 0, NULL);
    do_malloc(1000, 0, NULL);
    do_free(1);                      /* a 10 MiB hole: five granules */
    do_malloc(1000, 0, S1);          /* S1's small segment: a granule of the hole */
    do_malloc(6 * MiB, 0, S1);       /* S1's large segment: three more */
    do_record(4, S2);
    do_free(4);                      /* its event on S2 */
    do_malloc(40 * MiB, 0, NULL);    /* the rest of the hole, then new memory */
    do_malloc(5 * MiB, 1, S2);       /* device 1 */
    do_free(0);
    do_malloc(60 * MiB, 0, S2);      /* beyond the cap: lends, releases, or OOM */
    step_check(cca_empty_cache(), "cca_empty_cache");
    for (size_t i = nheld; i-- > 0;)
        do_free(i);
    step_check(cca_empty_cache(), "cca_empty_cache");
    do_malloc(3 * MiB, 0, NULL);
}

/* compact_memory: a hole of S1's segment whose work is pending mapped again
 * by S1's own growths (aliased: the old mappings stay until S1's event
 * completes), the old mappings unmapped by a later growth once it has, by
 * empty_cache (a wait) while one is still pending, and by the OOM path. */
static void scenario_compact_alias(void)
{
    do_malloc(4 * MiB, 0, S1);
    do_malloc(4 * MiB, 0, S1);
    do_malloc(4 * MiB, 0, S1);
    do_free(1);                      /* two granules, S1's work on them pending */
    do_malloc(6 * MiB, 0, S1);       /* aliases them, one granule new */
    do_malloc(1000, 0, S1);          /* the small pool: a new granule */
    do_free(0);
    do_malloc(6 * MiB, 0, S1);       /* aliases the first hole too */
    step_check(cca_sim_complete_stream(sim, 0, S1, false), "complete S1");
    do_free(0);
    do_malloc(10 * MiB, 0, S1);      /* unmaps the old mappings, then moves or aliases */
    do_free(1);
    do_malloc(8 * MiB, 0, S1);
    step_check(cca_empty_cache(), "cca_empty_cache"); /* waits for S1, unmaps the rest */
    do_free(0);
    do_malloc(100 * MiB, 0, S1);     /* beyond the cap: aliases, releases, or OOM */
}

/* compact_memory's planned placement (plans forced: on this device the six-granule cap never
 * leaves a loop moving at it): a loop of 32 large requests (tests/plan_loop.h, seed 4, sizes
 * a 32nd) repeated 8 times on one stream, planned after its second period, its range mapped at
 * the start and then a place at a time, the old layout's granules lent; each request checked
 * (a failed one leaves its block missing), the stream's events completed at each step's end. */
static void scenario_compact_plan(void)
{
    plan_test_force(true);
    plan_loop_t l;
    plan_loop_init(&l, 4, 32, 32, NULL);
    for (int step = 0; step < 8; step++) {
        for (int j = 0; j < l.n; j++, l.t++) {
            for (int k = 0; k < 2 * l.n; k++)
                if (l.live[k] && l.dies[k] <= l.t) {
                    step_check(cca_free(l.live[k]), "cca_free");
                    l.live[k] = NULL;
                }
            int slot = (int)(l.t % (2 * l.n));
            cca_status_t st = cca_malloc(&l.live[slot], l.size[j], NULL);
            if (st != CCA_OK)
                l.live[slot] = NULL;
            step_check(st, "cca_malloc");
            l.dies[slot] = l.t + l.life[j];
        }
        step_check(cca_sim_complete_stream(sim, 0, NULL, false), "complete the stream");
    }
    plan_loop_end(&l);
    plan_test_force(false);
}

typedef struct scenario {
    const char *name;
    void (*run)(void);
    const char *settings;
    size_t cap; /* device memory cap, 0: none */
} scenario_t;

static const scenario_t scenarios[] = {
    {"burst", scenario_burst, "", 0},
    {"events", scenario_events, "", 0},
    {"oom", scenario_oom, "max_split_size_mb:20", 96 * MiB},
    {"empty_cache", scenario_empty_cache, "", 0},
    {"settings", scenario_settings, "", 0},
    {"host", scenario_host, "", 0},
    {"peer", scenario_peer, "", 0},
    {"ipc", scenario_ipc, "", 72 * MiB},
    {"async", scenario_async, "backend:cudaMallocAsync", 96 * MiB},
    {"expandable", scenario_expandable, "expandable_segments:True", 120 * MiB},
    {"expandable_switch", scenario_expandable_switch, "", 0},
    {"pools", scenario_pools, "", 0},
    {"pools_reuse", scenario_pools_reuse, "graph_capture_record_stream_reuse:True", 0},
    {"compact", scenario_compact, "compact_memory:True", 120 * MiB},
    {"pools_allocator", scenario_pools_allocator, "", 0},
    {"compact_alias", scenario_compact_alias, "compact_memory:True", 120 * MiB},
    {"compact_plan", scenario_compact_plan, "compact_memory:True", 120 * MiB},
    {"pools_expandable", scenario_pools_expandable, "expandable_segments:True", 0},
};

static void setup(const scenario_t *sc)
{
    cca_sim_config_t cfg = {0};
    cfg.devices = 2;
    cfg.total_memory = 128 * MiB;
    cfg.memory_cap = sc->cap;
    cfg.manual_events = true;
    nheld = nheld_host = 0;
    if (cca_sim_create(&cfg, &sim) != CCA_OK) {
        printf("cannot create the simulated backend: %s\n", cca_last_error()->message);
        exit(1);
    }
    wrapper = *sim;
    wrapper.destroy = wrapper_destroy;
    if (cca_init_with_backend(&wrapper, sc->settings) != CCA_OK) {
        printf("cannot set up %s: %s\n", sc->name, cca_last_error()->message);
        exit(1);
    }
}

/* Free everything, empty the caches, check nothing is left, shut down. */
static void teardown(void)
{
    cca_sim_clear_faults(sim);
    /* a capture whose end failed ends now (BUSY: none underway) */
    if (async_enabled())
        (void)cca_end_allocate_to_pool(0, ASYNC_CAPTURE_POOL);
    for (size_t i = nheld; i-- > 0;)
        do_free(i);
    if (async_enabled() && async_deferred_count()) { /* the next allocation completes them */
        void *p = NULL;
        expect_ok(cca_malloc(&p, 512, NULL));
        expect_ok(cca_free(p));
    }
    for (size_t i = nheld_host; i-- > 0;)
        do_host_free(i);
    if (nheld || nheld_host)
        HARNESS_FAIL("%s [%s]: %zu device and %zu host pointers could not be freed without faults",
                     cur_scenario, cur_fault, nheld, nheld_host);
    expect_ok(cca_sim_complete_stream(sim, 0, NULL, true));
    expect_ok(cca_sim_complete_stream(sim, 1, NULL, true));
    cca_status_t st = cca_empty_cache();
    if (st != CCA_OK)
        HARNESS_FAIL("%s [%s]: empty_cache: %s", cur_scenario, cur_fault, cca_last_error()->message);
    st = cca_host_empty_cache();
    if (st != CCA_OK)
        HARNESS_FAIL("%s [%s]: host_empty_cache: %s", cur_scenario, cur_fault, cca_last_error()->message);
    char why[512];
    if (alloc_check_invariants(why, sizeof(why)) != CCA_OK)
        HARNESS_FAIL("%s [%s]: at the end: %s", cur_scenario, cur_fault, why);
    /* Emptied caches: no device byte, allocation, host block or event. */
    cca_sim_usage_t u;
    expect_ok(cca_sim_usage(sim, &u));
    size_t device_events = cca_state->devices[0].events_created + cca_state->devices[1].events_created;
    if (u.device_bytes[0] || u.device_bytes[1] || u.live_allocations || u.live_host || device_events ||
        u.live_events)
        HARNESS_FAIL("%s [%s]: left behind: %zu + %zu bytes, %llu allocations, %zu device events, "
                     "%llu backend events, %llu host", cur_scenario, cur_fault, u.device_bytes[0],
                     u.device_bytes[1], (unsigned long long)u.live_allocations, device_events,
                     (unsigned long long)u.live_events, (unsigned long long)u.live_host);
    memset(&final_usage, 0xff, sizeof(final_usage));
    cca_shutdown();
    if (ua_live)
        HARNESS_FAIL("%s [%s]: a pool's own allocator still holds %ld segments", cur_scenario,
                     cur_fault, ua_live);
    ua_live = 0;
    /* After shutdown not even an event may be left. */
    cca_sim_usage_t zero;
    memset(&zero, 0, sizeof(zero));
    memset(final_usage.device_peak_bytes, 0, sizeof(final_usage.device_peak_bytes)); /* not live */
    if (memcmp(&final_usage, &zero, sizeof(zero)))
        HARNESS_FAIL("%s [%s]: at shutdown the backend still held %llu allocations, %llu events, "
                     "%llu host", cur_scenario, cur_fault, (unsigned long long)final_usage.live_allocations,
                     (unsigned long long)final_usage.live_events,
                     (unsigned long long)final_usage.live_host);
}

/* Run sc once with no fault; return the backend call counts it made. */
static void baseline(const scenario_t *sc, uint64_t calls[CCA_OP_COUNT])
{
    cur_scenario = sc->name;
    snprintf(cur_fault, sizeof(cur_fault), "no fault");
    setup(sc);
    uint64_t before[CCA_OP_COUNT];
    for (int op = 0; op < CCA_OP_COUNT; op++)
        before[op] = cca_sim_call_count(sim, (cca_backend_op_t)op);
    sc->run();
    for (int op = 0; op < CCA_OP_COUNT; op++)
        calls[op] = cca_sim_call_count(sim, (cca_backend_op_t)op) - before[op];
    cca_device_stats_t ds;
    cca_get_device_stats(0, &ds);
    printf("  %s: %lld ooms, %lld retries, %lld segment frees; calls:", sc->name,
           (long long)ds.num_ooms, (long long)ds.num_alloc_retries, (long long)ds.num_device_free);
    for (int op = 0; op < CCA_OP_COUNT; op++)
        if (calls[op])
            printf(" %s %llu", cca_backend_op_name((cca_backend_op_t)op), (unsigned long long)calls[op]);
    printf("\n");
    teardown();
    runs_run++;
}

/* The loops over (operation, persistence, nth) of one scenario. */
static void fault_loops(const scenario_t *sc)
{
    uint64_t calls[CCA_OP_COUNT];
    baseline(sc, calls);
    for (int op = 0; op < CCA_OP_COUNT; op++) {
        if (!calls[op])
            continue;
        cca_status_t statuses[2] = {CCA_ERR_BACKEND, CCA_ERR_OUT_OF_MEMORY};
        int nstatus = (op == CCA_OP_MALLOC || op == CCA_OP_HOST_ALLOC || op == CCA_OP_MALLOC_ASYNC ||
                       op == CCA_OP_VMM_CREATE) ? 2 : 1;
        for (int si = 0; si < nstatus; si++)
            for (int persistent = 0; persistent < 2; persistent++)
                for (uint64_t nth = 1;; nth++) {
                    snprintf(cur_fault, sizeof(cur_fault), "%s call %llu %s -> %s",
                             cca_backend_op_name((cca_backend_op_t)op), (unsigned long long)nth,
                             persistent ? "and later" : "once", cca_status_str(statuses[si]));
                    setup(sc);
                    uint64_t before = cca_sim_call_count(sim, (cca_backend_op_t)op);
                    cca_sim_inject_fault(sim, (cca_backend_op_t)op, nth, persistent, statuses[si]);
                    sc->run();
                    uint64_t made = cca_sim_call_count(sim, (cca_backend_op_t)op) - before;
                    teardown();
                    runs_run++;
                    if (made < nth)
                        break; /* the scenario completed without the fault firing */
                    faults_fired += persistent ? made - nth + 1 : 1;
                }
    }
}

TEST(fault_burst) { fault_loops(&scenarios[0]); }
TEST(fault_events) { fault_loops(&scenarios[1]); }
TEST(fault_oom) { fault_loops(&scenarios[2]); }
TEST(fault_empty_cache) { fault_loops(&scenarios[3]); }
TEST(fault_settings) { fault_loops(&scenarios[4]); }
TEST(fault_host) { fault_loops(&scenarios[5]); }
TEST(fault_peer) { fault_loops(&scenarios[6]); }
TEST(fault_ipc) { fault_loops(&scenarios[7]); }
TEST(fault_async) { fault_loops(&scenarios[8]); }
TEST(fault_expandable) { fault_loops(&scenarios[9]); }
TEST(fault_expandable_switch) { fault_loops(&scenarios[10]); }
TEST(fault_pools) { fault_loops(&scenarios[11]); }
TEST(fault_pools_reuse) { fault_loops(&scenarios[12]); }
TEST(fault_compact) { fault_loops(&scenarios[13]); }
TEST(fault_pools_allocator) { fault_loops(&scenarios[14]); }
TEST(fault_compact_alias) { fault_loops(&scenarios[15]); }
TEST(fault_compact_plan) { fault_loops(&scenarios[16]); }
TEST(fault_pools_expandable) { fault_loops(&scenarios[17]); }

int main(void)
{
    cca_register_output(NULL, NULL);
    RUN(fault_burst);
    RUN(fault_events);
    RUN(fault_oom);
    RUN(fault_empty_cache);
    RUN(fault_settings);
    RUN(fault_host);
    RUN(fault_peer);
    RUN(fault_ipc);
    RUN(fault_async);
    RUN(fault_expandable);
    RUN(fault_expandable_switch);
    RUN(fault_pools);
    RUN(fault_pools_reuse);
    RUN(fault_compact);
    RUN(fault_pools_allocator);
    RUN(fault_compact_alias);
    RUN(fault_compact_plan);
    RUN(fault_pools_expandable);
    printf("fault loops: %llu runs, %llu faults injected, %llu steps checked\n",
           (unsigned long long)runs_run, (unsigned long long)faults_fired,
           (unsigned long long)steps_run);
    return harness_done();
}
