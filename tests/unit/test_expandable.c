/*
 * test_expandable.c - expandable segments (expandable_segments:True) on the
 * simulated backend: growth at the end in granules, PyTorch's statistics in
 * this mode, segment_map / segment_unmap history, unmapping of whole free
 * granules on empty_cache and on the out-of-memory path, the release of an
 * empty reservation, run-time switching, peers, snapshots, real (backed)
 * memory across granule boundaries, and misuse.
 */
#include <inttypes.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "check.h"
#include "device.h"
#include "harness.h"
#include "pickle.h"

#define MiB ((size_t)1 << 20)
#define KiB ((size_t)1 << 10)
#define S1 ((cca_stream_t)(uintptr_t)0x1000)

static cca_backend_t *sim;

static void setup_with(const char *settings, size_t memory, bool backed, int devices)
{
    cca_sim_config_t cfg = {0};
    cfg.devices = devices;
    cfg.total_memory = memory ? memory : 8ull << 30;
    cfg.backed = backed;
    cca_shutdown();
    if (cca_sim_create(&cfg, &sim) != CCA_OK) {
        printf("cannot create sim backend: %s\n", cca_last_error()->message);
        exit(1);
    }
    if (cca_init_with_backend(sim, settings) != CCA_OK) {
        printf("cannot init: %s\n", cca_last_error()->message);
        exit(1);
    }
}

static void setup(const char *settings)
{
    setup_with(settings, 0, false, 1);
}

static cca_device_stats_t stats(void)
{
    cca_device_stats_t s;
    cca_get_device_stats(0, &s);
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

static cca_sim_usage_t usage(void)
{
    cca_sim_usage_t u;
    memset(&u, 0, sizeof(u));
    cca_sim_usage(sim, &u);
    return u;
}

/* Count history entries of one action. */
static size_t history_count(cca_trace_action_t action, size_t *bytes)
{
    cca_trace_entry_t *e = NULL;
    size_t n = 0, found = 0;
    if (bytes)
        *bytes = 0;
    if (cca_history_get(&e, &n) != CCA_OK)
        return 0;
    for (size_t i = 0; i < n; i++)
        if (e[i].action == action) {
            found++;
            if (bytes)
                *bytes += e[i].size;
        }
    cca_history_free(e);
    return found;
}

TEST(small_pool_maps_2mib_granules)
{
    setup("expandable_segments:True");
    void *a = xmalloc(1000, NULL);
    cca_device_stats_t s = stats();
    expect_eq_i64(s.reserved_bytes[CCA_STAT_SMALL_POOL].current, 2 * MiB);
    expect_eq_i64(s.num_device_alloc, 1);
    expect_eq_i64(s.segment[CCA_STAT_ALL].current, 0); /* PyTorch keeps segment.* at 0 */
    expect_eq_u64(usage().live_reservations, 1);
    expect_eq_u64(usage().live_handles, 1);
    /* fill the granule: the next small block comes from the next granule, contiguous */
    void *b = xmalloc(MiB, NULL);
    void *c = xmalloc(MiB, NULL);
    expect_eq_u64((uintptr_t)b, (uintptr_t)a + 1024);
    expect_eq_u64((uintptr_t)c, (uintptr_t)b + MiB);
    s = stats();
    expect_eq_i64(s.reserved_bytes[CCA_STAT_ALL].current, 4 * MiB);
    expect_eq_i64(s.num_device_alloc, 2);
    expect_eq_i64(s.inactive_split[CCA_STAT_ALL].current, 0);
    expect_eq_i64(s.inactive_split_bytes[CCA_STAT_ALL].current, 0);
    expect_true(device_is_valid());
    cca_free(a);
    cca_free(b);
    cca_free(c);
    expect_true(device_is_valid());
    cca_shutdown();
}

TEST(large_pool_grows_at_the_end)
{
    setup("expandable_segments:True");
    cca_record_history(true, NULL, NULL, 1000, CCA_RECORD_CONTEXT_NEVER);
    void *a = xmalloc(3 * MiB, NULL);
    expect_eq_i64(stats().reserved_bytes[CCA_STAT_LARGE_POOL].current, 20 * MiB);
    /* 17 MiB are free after a; 30 MiB more map one granule and continue there */
    void *b = xmalloc(30 * MiB, NULL);
    expect_eq_u64((uintptr_t)b, (uintptr_t)a + 3 * MiB);
    cca_device_stats_t s = stats();
    expect_eq_i64(s.reserved_bytes[CCA_STAT_LARGE_POOL].current, 40 * MiB);
    expect_eq_i64(s.num_device_alloc, 2);
    expect_eq_i64(s.segment[CCA_STAT_LARGE_POOL].current, 0);
    expect_eq_i64(s.oversize_segments.current, 0);
    /* a request of several granules is one map entry of whole granules */
    void *c = xmalloc(100 * MiB, NULL);
    expect_eq_u64((uintptr_t)c, (uintptr_t)b + 30 * MiB);
    size_t mapped = 0;
    expect_eq_u64(history_count(CCA_TRACE_SEGMENT_MAP, &mapped), 3);
    expect_eq_u64(mapped, 140 * MiB);
    expect_eq_u64(history_count(CCA_TRACE_SEGMENT_ALLOC, NULL), 0);
    expect_eq_i64(stats().reserved_bytes[CCA_STAT_ALL].current, 140 * MiB);
    expect_true(device_is_valid());
    cca_free(a);
    cca_free(b);
    cca_free(c);
    cca_record_history(false, NULL, NULL, 0, CCA_RECORD_CONTEXT_NEVER);
    cca_shutdown();
}

TEST(empty_cache_unmaps_and_frees_the_reservation)
{
    setup("expandable_segments:True");
    cca_record_history(true, NULL, NULL, 1000, CCA_RECORD_CONTEXT_NEVER);
    void *a = xmalloc(50 * MiB, NULL);
    void *b = xmalloc(4000, NULL);
    cca_free(a);
    cca_free(b);
    expect_true(usage().device_bytes[0] == 62 * MiB);
    expect_ok(cca_empty_cache());
    cca_device_stats_t s = stats();
    expect_eq_i64(s.reserved_bytes[CCA_STAT_ALL].current, 0);
    expect_eq_i64(s.num_device_free, 2); /* one unmap per pool */
    size_t unmapped = 0;
    expect_eq_u64(history_count(CCA_TRACE_SEGMENT_UNMAP, &unmapped), 2);
    expect_eq_u64(unmapped, 62 * MiB);
    cca_sim_usage_t u = usage();
    expect_eq_u64(u.device_bytes[0], 0);
    expect_eq_u64(u.live_handles, 0);
    expect_eq_u64(u.live_reservations, 0);
    expect_true(device_is_valid());
    /* the next allocation reserves again */
    void *c = xmalloc(50 * MiB, NULL);
    expect_true(c != NULL);
    expect_eq_u64(usage().live_reservations, 1);
    cca_free(c);
    cca_record_history(false, NULL, NULL, 0, CCA_RECORD_CONTEXT_NEVER);
    cca_shutdown();
}

TEST(empty_cache_unmaps_only_whole_free_granules)
{
    setup("expandable_segments:True");
    void *a = xmalloc(30 * MiB, NULL);  /* [0, 30) */
    void *b = xmalloc(30 * MiB, NULL);  /* [30, 60) */
    void *c = xmalloc(15 * MiB, NULL);  /* [60, 75) */
    expect_eq_i64(stats().reserved_bytes[CCA_STAT_ALL].current, 80 * MiB);
    cca_free(b); /* free [30, 60): only granule [40, 60) is whole */
    expect_ok(cca_empty_cache());
    cca_device_stats_t s = stats();
    expect_eq_i64(s.reserved_bytes[CCA_STAT_ALL].current, 60 * MiB);
    expect_eq_i64(s.num_device_free, 1);
    expect_eq_u64(usage().device_bytes[0], 60 * MiB);
    expect_true(device_is_valid());
    /* the snapshot shows two mapped ranges, both expandable */
    cca_snapshot_t *snap = NULL;
    expect_ok(cca_snapshot(&snap));
    expect_eq_u64(snap->segment_count, 2);
    if (snap->segment_count == 2) {
        expect_true(snap->segments[0].is_expandable && snap->segments[1].is_expandable);
        expect_eq_u64(snap->segments[0].address, (uintptr_t)a);
        expect_eq_u64(snap->segments[0].total_size, 40 * MiB);
        expect_eq_u64(snap->segments[0].block_count, 2); /* a, and b's free 10 MiB */
        expect_eq_u64(snap->segments[1].address, (uintptr_t)a + 60 * MiB);
        expect_eq_u64(snap->segments[1].total_size, 20 * MiB);
    }
    cca_snapshot_free(snap);
    /* 20 MiB fit in the hole: mapped again there, not at the end */
    void *d = xmalloc(25 * MiB, NULL);
    expect_eq_u64((uintptr_t)d, (uintptr_t)a + 30 * MiB);
    expect_eq_i64(stats().reserved_bytes[CCA_STAT_ALL].current, 80 * MiB);
    expect_true(device_is_valid());
    cca_free(a);
    cca_free(c);
    cca_free(d);
    expect_ok(cca_empty_cache());
    expect_eq_u64(usage().live_reservations, 0);
    cca_shutdown();
}

TEST(oom_unmaps_cached_granules_and_retries)
{
    /* a 1 GiB device: 600 MiB cached in one stream's segment, then 600 MiB on another */
    setup_with("expandable_segments:True", 1ull << 30, false, 1);
    void *a = xmalloc(600 * MiB, NULL);
    cca_free(a);
    expect_eq_i64(stats().reserved_bytes[CCA_STAT_ALL].current, 600 * MiB);
    void *b = xmalloc(600 * MiB, S1);
    expect_true(b != NULL);
    cca_device_stats_t s = stats();
    expect_eq_i64(s.num_alloc_retries, 1);
    expect_eq_i64(s.num_device_free, 1);
    expect_eq_i64(s.reserved_bytes[CCA_STAT_ALL].current, 600 * MiB);
    expect_eq_i64(s.num_ooms, 0);
    expect_true(device_is_valid());
    /* a real OOM: PyTorch's message, allocator still usable */
    void *c = NULL;
    expect_status(cca_malloc(&c, 600 * MiB, NULL), CCA_ERR_OUT_OF_MEMORY);
    expect_contains(cca_last_error()->message, "CUDA out of memory");
    expect_eq_i64(stats().num_ooms, 1);
    expect_true(device_is_valid());
    cca_free(b);
    expect_ok(cca_empty_cache());
    expect_eq_u64(usage().device_bytes[0], 0);
    expect_eq_u64(usage().live_handles, 0);
    cca_shutdown();
}

TEST(oom_in_the_middle_of_growth_maps_nothing_unaccounted)
{
    setup_with("expandable_segments:True", 1ull << 30, false, 1);
    void *a = xmalloc(3 * MiB, NULL); /* 20 MiB mapped */
    /* room for 5 more granules only: a 200 MiB growth fails in its 6th create */
    cca_sim_set_cap(sim, 0, 120 * MiB);
    void *b = NULL;
    expect_status(cca_malloc(&b, 200 * MiB, NULL), CCA_ERR_OUT_OF_MEMORY);
    cca_device_stats_t s = stats();
    expect_eq_i64(s.reserved_bytes[CCA_STAT_ALL].current, 20 * MiB);
    expect_eq_u64(usage().device_bytes[0], 20 * MiB);
    expect_eq_u64(usage().live_handles, 1);
    expect_true(device_is_valid());
    /* with the memory fraction: the check comes before any growth */
    cca_sim_set_cap(sim, 0, 0);
    expect_ok(cca_set_memory_fraction(0.05, 0)); /* ~51 MiB */
    expect_status(cca_malloc(&b, 60 * MiB, NULL), CCA_ERR_OUT_OF_MEMORY);
    expect_contains(cca_last_error()->message, "allowed");
    expect_eq_i64(stats().reserved_bytes[CCA_STAT_ALL].current, 20 * MiB);
    b = xmalloc(10 * MiB, NULL);
    expect_true(b != NULL);
    expect_true(device_is_valid());
    cca_free(a);
    cca_free(b);
    expect_ok(cca_empty_cache());
    expect_eq_u64(usage().device_bytes[0], 0);
    cca_shutdown();
}

TEST(one_segment_per_stream_and_kind)
{
    setup("expandable_segments:True");
    void *a = xmalloc(5 * MiB, NULL);
    void *b = xmalloc(5 * MiB, S1);
    void *c = xmalloc(100, NULL);
    void *d = xmalloc(100, S1);
    expect_eq_u64(usage().live_reservations, 4);
    cca_snapshot_t *snap = NULL;
    expect_ok(cca_snapshot(&snap));
    expect_eq_u64(snap->segment_count, 4);
    size_t large = 0;
    for (size_t i = 0; i < snap->segment_count; i++) {
        expect_true(snap->segments[i].is_expandable);
        large += snap->segments[i].is_large;
    }
    expect_eq_u64(large, 2);
    cca_snapshot_free(snap);
    cca_free(a);
    cca_free(b);
    cca_free(c);
    cca_free(d);
    expect_ok(cca_empty_cache());
    expect_eq_u64(usage().live_reservations, 0);
    cca_shutdown();
}

TEST(switching_at_run_time_affects_new_segments_only)
{
    setup("");
    void *a = xmalloc(5 * MiB, NULL); /* a plain 20 MiB segment */
    cca_free(a);
    expect_ok(cca_set_settings("expandable_segments:True"));
    /* the cached plain block still serves a fitting request */
    void *b = xmalloc(5 * MiB, NULL);
    expect_eq_ptr(b, a);
    /* a new segment is expandable */
    void *c = xmalloc(50 * MiB, NULL);
    expect_eq_i64(stats().segment[CCA_STAT_ALL].current, 1);
    expect_eq_u64(usage().live_reservations, 1);
    cca_free(c);
    expect_ok(cca_set_settings("expandable_segments:False"));
    /* expandable blocks are skipped now: a new plain segment */
    void *d = xmalloc(30 * MiB, NULL);
    expect_true((uintptr_t)d != (uintptr_t)c);
    expect_eq_i64(stats().segment[CCA_STAT_ALL].current, 2);
    expect_true(device_is_valid());
    cca_free(b);
    cca_free(d);
    expect_ok(cca_empty_cache());
    cca_sim_usage_t u = usage();
    expect_eq_u64(u.live_reservations, 0);
    expect_eq_u64(u.live_allocations, 0);
    expect_eq_u64(u.device_bytes[0], 0);
    cca_shutdown();
}

TEST(backed_memory_across_granules)
{
    setup_with("expandable_segments:True", 1ull << 30, true, 1);
    unsigned char *a = xmalloc(15 * MiB, NULL);
    unsigned char *b = xmalloc(40 * MiB, NULL); /* spans granules 0..2 */
    expect_eq_u64((uintptr_t)b, (uintptr_t)a + 15 * MiB);
    if (b) {
        memset(b, 0x5a, 40 * MiB);
        size_t bad = 0;
        for (size_t i = 0; i < 40 * MiB; i += 4096)
            bad += b[i] != 0x5a;
        expect_eq_u64(bad, 0);
        expect_eq_u64(b[40 * MiB - 1], 0x5a);
    }
    cca_free(a);
    cca_free(b);
    expect_ok(cca_empty_cache());
    expect_eq_u64(usage().live_handles, 0);
    cca_shutdown();
}

TEST(peers_get_access_to_mapped_ranges)
{
    setup_with("expandable_segments:True", 1ull << 30, false, 2);
    void *a = xmalloc(30 * MiB, NULL);
    bool has = true;
    expect_ok(cca_sim_vmm_has_access(sim, (char *)a + 29 * MiB, 1, &has));
    expect_false(has);
    expect_status(cca_sim_vmm_has_access(sim, a, 1, NULL), CCA_ERR_INVALID_ARGUMENT);
    expect_status(cca_sim_vmm_has_access(NULL, a, 1, &has), CCA_ERR_INVALID_ARGUMENT);
    uint64_t before = cca_sim_call_count(sim, CCA_OP_VMM_SET_ACCESS);
    /* device 1 may access device 0's memory: the range mapped so far gets its access */
    expect_ok(cca_enable_peer_access(1, 0));
    expect_eq_u64(cca_sim_call_count(sim, CCA_OP_VMM_SET_ACCESS), before + 1);
    expect_ok(cca_sim_vmm_has_access(sim, (char *)a + 29 * MiB, 1, &has));
    expect_true(has);
    expect_ok(cca_enable_peer_access(1, 0)); /* already enabled: nothing more */
    expect_eq_u64(cca_sim_call_count(sim, CCA_OP_VMM_SET_ACCESS), before + 1);
    /* a later growth sets access for the device and the peer */
    void *b = xmalloc(30 * MiB, NULL);
    expect_eq_u64(cca_sim_call_count(sim, CCA_OP_VMM_SET_ACCESS), before + 3);
    for (int d = 0; d < 2; d++) {
        has = false;
        expect_ok(cca_sim_vmm_has_access(sim, (char *)b + 29 * MiB, d, &has));
        expect_true(has);
    }
    cca_free(a);
    cca_free(b);
    cca_shutdown();
}

/*
 * The pool's segments as a snapshot gives them (mapped ranges, blocks and their
 * states) and the device's current figures, as text: equal texts, equal pools.
 */
static void pool_picture(cca_mempool_id_t id, char *out, size_t len)
{
    size_t used = 0;
    cca_snapshot_t *snap = NULL;
    out[0] = 0;
    if (cca_snapshot(&snap) != CCA_OK)
        return;
    for (size_t i = 0; i < snap->segment_count; i++) {
        const cca_segment_info_t *seg = &snap->segments[i];
        if (seg->owner_private_pool_id[0] != id.first || seg->owner_private_pool_id[1] != id.second)
            continue;
        used += (size_t)snprintf(out + used, len - used, "[%" PRIx64 " %zu%s:", seg->address,
                                 seg->total_size, seg->is_expandable ? " exp" : "");
        for (size_t j = 0; j < seg->block_count && used < len; j++)
            used += (size_t)snprintf(out + used, len - used, " %" PRIx64 "+%zu/%d", seg->blocks[j].address,
                                     seg->blocks[j].size, (int)seg->blocks[j].state);
        if (used < len)
            used += (size_t)snprintf(out + used, len - used, "]");
        if (used >= len)
            break;
    }
    cca_snapshot_free(snap);
    cca_device_stats_t st = stats();
    if (used < len)
        snprintf(out + used, len - used, " reserved %" PRId64 " allocated %" PRId64 " active %" PRId64
                 " requested %" PRId64 " allocations %" PRId64, st.reserved_bytes[CCA_STAT_ALL].current,
                 st.allocated_bytes[CCA_STAT_ALL].current, st.active_bytes[CCA_STAT_ALL].current,
                 st.requested_bytes[CCA_STAT_ALL].current, st.allocation[CCA_STAT_ALL].current);
}

/*
 * Checkpoints of a private pool that holds an expandable segment (cudagraph
 * trees under expandable_segments:True): a checkpoint taken small, one taken
 * after the segment grew; restoring the first unmaps the growth, restoring the
 * second maps it again: blocks, mappings and figures as at each checkpoint.
 * Before, both refused (CCA_ERR_NOT_SUPPORTED).
 */
TEST(checkpoint_restore_expandable)
{
    setup("expandable_segments:True");
    const cca_mempool_id_t g = {7, 0};
    char small_then[2048], big_then[2048], now[2048];
    expect_ok(cca_begin_allocate_stream_to_pool(0, g, S1));
    void *a = xmalloc(30 * MiB, S1);
    void *b = xmalloc(4 * MiB, S1);
    void *c = xmalloc(40 * MiB, S1);
    expect_ok(cca_free(b));
    expect_ok(cca_end_allocate_to_pool(0, g));
    cca_pool_state_t *small = NULL, *big = NULL;
    expect_ok(cca_pool_get_checkpoint(0, g, &small));
    pool_picture(g, small_then, sizeof(small_then));
    int64_t reserved_small = stats().reserved_bytes[CCA_STAT_ALL].current;
    expect_ok(cca_begin_allocate_stream_to_pool(0, g, S1));
    void *d = xmalloc(50 * MiB, S1); /* the segment grows */
    expect_ok(cca_end_allocate_to_pool(0, g));
    expect_true(stats().reserved_bytes[CCA_STAT_ALL].current > reserved_small);
    expect_ok(cca_pool_get_checkpoint(0, g, &big));
    pool_picture(g, big_then, sizeof(big_then));

    cca_checkpoint_delta_t delta;
    /* every block allocated now is freed (PyTorch's freeBlocksAllocatedToPool), those of
     * the checkpoint allocated again: d dies, its growth is unmapped */
    expect_ok(cca_pool_set_checkpoint(0, small, &delta));
    expect_eq_u64(delta.freed_count, 3);
    expect_eq_ptr(delta.freed[2], d);
    expect_eq_u64(delta.allocated_count, 2);
    expect_eq_ptr(delta.allocated[0], a);
    expect_eq_ptr(delta.allocated[1], c);
    cca_checkpoint_delta_free(&delta);
    pool_picture(g, now, sizeof(now));
    expect_eq_str(now, small_then);
    expect_true(device_is_valid());

    expect_ok(cca_pool_set_checkpoint(0, big, &delta)); /* mapped again; a, c, d live */
    expect_eq_u64(delta.freed_count, 2);
    expect_eq_u64(delta.allocated_count, 3);
    expect_eq_ptr(delta.allocated[2], d);
    cca_checkpoint_delta_free(&delta);
    pool_picture(g, now, sizeof(now));
    expect_eq_str(now, big_then);
    expect_true(device_is_valid());

    /* a restore the backend cannot map for changes no block: the map fails first */
    expect_ok(cca_pool_set_checkpoint(0, small, &delta));
    cca_checkpoint_delta_free(&delta);
    expect_ok(cca_sim_inject_fault(sim, CCA_OP_VMM_MAP, 1, false, CCA_ERR_BACKEND));
    expect_status(cca_pool_set_checkpoint(0, big, &delta), CCA_ERR_BACKEND);
    bool ok = false;
    void *live[2] = {a, c};
    expect_ok(cca_pool_check_live_allocations(0, g, live, 2, &ok));
    expect_true(ok);
    expect_true(device_is_valid());
    /* an unmap the backend refuses leaves the range mapped and free: the restore goes on */
    expect_ok(cca_pool_set_checkpoint(0, big, &delta));
    cca_checkpoint_delta_free(&delta);
    expect_ok(cca_sim_inject_fault(sim, CCA_OP_VMM_UNMAP, 1, false, CCA_ERR_BACKEND));
    expect_ok(cca_pool_set_checkpoint(0, small, &delta));
    cca_checkpoint_delta_free(&delta);
    expect_ok(cca_pool_check_live_allocations(0, g, live, 2, &ok));
    expect_true(ok);
    expect_true(stats().reserved_bytes[CCA_STAT_ALL].current > reserved_small);
    expect_true(device_is_valid());

    cca_pool_state_free(small);
    cca_pool_state_free(big);
    expect_ok(cca_free(a));
    expect_ok(cca_free(c));
    expect_ok(cca_release_pool(0, g)); /* both captures' graphs are gone */
    expect_ok(cca_release_pool(0, g));
    expect_ok(cca_empty_cache());
    expect_eq_i64(stats().reserved_bytes[CCA_STAT_ALL].current, 0);
    expect_true(device_is_valid());
    cca_shutdown();
}

/* A MemPool in this mode: its own reservation, freed with the pool. */
TEST(private_pool)
{
    setup("expandable_segments:True");
    cca_mempool_id_t id = cca_mempool_id_new(true);
    expect_ok(cca_pool_create(0, id));
    expect_ok(cca_begin_allocate_thread_to_pool(0, id));
    void *a = xmalloc(30 * MiB, NULL);
    expect_ok(cca_end_allocate_to_pool(0, id));
    expect_ok(cca_release_pool(0, id)); /* as use_mem_pool's exit */
    void *b = xmalloc(30 * MiB, NULL); /* the default pool: another reservation */
    expect_eq_u64(usage().live_reservations, 2);
    cca_snapshot_t *snap = NULL;
    expect_ok(cca_snapshot(&snap));
    size_t in_pool = 0;
    for (size_t i = 0; snap && i < snap->segment_count; i++) {
        expect_true(snap->segments[i].is_expandable);
        in_pool += snap->segments[i].owner_private_pool_id[1] == id.second &&
                   snap->segments[i].address == (uintptr_t)a;
    }
    expect_eq_u64(in_pool, 1);
    cca_snapshot_free(snap);
    cca_pool_state_t *state = NULL;
    expect_ok(cca_pool_get_checkpoint(0, id, &state)); /* (checkpoint_restore_expandable) */
    cca_pool_state_free(state);
    expect_true(device_is_valid());
    cca_free(a);
    expect_ok(cca_release_pool(0, id)); /* the MemPool is deleted */
    expect_ok(cca_empty_cache()); /* the freeable pool's granules go, then its reservation */
    expect_eq_u64(usage().live_reservations, 1);
    int count = 0;
    expect_status(cca_pool_use_count(0, id, &count), CCA_ERR_INVALID_ARGUMENT); /* pool gone */
    expect_true(device_is_valid());
    cca_free(b);
    expect_ok(cca_empty_cache());
    expect_eq_u64(usage().live_reservations, 0);
    cca_shutdown();
}

/* The pickle PyTorch's viewer reads: expandable segments and map/unmap entries. */
TEST(snapshot_file)
{
    setup("expandable_segments:True");
    cca_record_history(true, NULL, NULL, 1000, CCA_RECORD_CONTEXT_NEVER);
    void *a = xmalloc(30 * MiB, NULL);
    void *b = xmalloc(30 * MiB, NULL);
    void *c = xmalloc(15 * MiB, NULL);
    cca_free(b);
    expect_ok(cca_empty_cache());
    char path[] = "/tmp/cca-expandable-XXXXXX";
    int fd = mkstemp(path);
    expect_true(fd >= 0);
    if (fd >= 0)
        close(fd);
    expect_ok(cca_dump_snapshot(path));
    pv_doc_t *doc = NULL;
    expect_ok(pickle_load_file(path, &doc));
    unlink(path);
    const pv_node_t *root = doc ? pv_doc_root(doc) : NULL;
    const pv_node_t *segs = root ? pv_dict_get(root, "segments") : NULL;
    expect_true(segs && pv_len(segs) == 2);
    for (size_t i = 0; segs && i < pv_len(segs); i++) {
        bool expandable = false;
        expect_true(pv_get_bool(pv_dict_get(pv_at(segs, i), "is_expandable"), &expandable));
        expect_true(expandable);
    }
    const pv_node_t *traces = root ? pv_dict_get(root, "device_traces") : NULL;
    const pv_node_t *ev = traces ? pv_at(traces, 0) : NULL;
    size_t maps = 0, unmaps = 0, seg_allocs = 0;
    for (size_t i = 0; ev && i < pv_len(ev); i++) {
        const pv_node_t *action = pv_dict_get(pv_at(ev, i), "action");
        maps += pv_str_eq(action, "segment_map");
        unmaps += pv_str_eq(action, "segment_unmap");
        seg_allocs += pv_str_eq(action, "segment_alloc");
    }
    expect_eq_u64(maps, 3);
    expect_eq_u64(unmaps, 1);
    expect_eq_u64(seg_allocs, 0);
    pv_doc_free(doc);
    cca_free(a);
    cca_free(c);
    cca_record_history(false, NULL, NULL, 0, CCA_RECORD_CONTEXT_NEVER);
    cca_shutdown();
}

TEST(misuse)
{
    setup("expandable_segments:True");
    void *a = xmalloc(5 * MiB, NULL);
    void *base = NULL;
    size_t size = 0;
    /* PyTorch refuses to share expandable memory between processes */
    expect_status(cca_get_base_allocation(a, &base, &size), CCA_ERR_NOT_SUPPORTED);
    expect_contains(cca_last_error()->message, "expandable_segments");
    expect_status(cca_free((char *)a + 512), CCA_ERR_INVALID_POINTER);
    expect_ok(cca_free(a));
    expect_status(cca_free(a), CCA_ERR_INVALID_POINTER);
    expect_true(device_is_valid());
    cca_shutdown();

    /* a granule the backend cannot map is refused with a clear error */
    cca_sim_config_t cfg = {0};
    cfg.total_memory = 1ull << 30;
    cfg.granularity = 4 * MiB;
    expect_ok(cca_sim_create(&cfg, &sim));
    expect_ok(cca_init_with_backend(sim, "expandable_segments:True"));
    void *b = NULL;
    expect_status(cca_malloc(&b, 100, NULL), CCA_ERR_NOT_SUPPORTED);
    expect_contains(cca_last_error()->message, "granularity");
    expect_ok(cca_malloc(&b, 5 * MiB, NULL)); /* 20 MiB granules are fine */
    expect_ok(cca_free(b));
    expect_true(device_is_valid());
    expect_ok(cca_empty_cache());
    expect_eq_u64(usage().live_reservations, 0);
    cca_shutdown();
}

/*
 * The OOM path's release of oversize cached blocks passes over an expandable
 * block and goes on releasing the plain oversize blocks below it, as
 * PyTorch's release_available_cached_blocks does: the growth then maps in
 * place, with no full release and no retry counted. Before, the search
 * stopped at the expandable block, and the full release unmapped it and
 * mapped the request at a new address.
 */
TEST(release_available_passes_over_expandable_blocks)
{
    setup_with("max_split_size_mb:40", 1ull << 30, false, 1);
    void *p1 = xmalloc(60 * MiB, NULL); /* two plain oversize segments of 60 MiB */
    void *p2 = xmalloc(60 * MiB, NULL);
    cca_free(p1);
    cca_free(p2);
    expect_ok(cca_set_settings("expandable_segments:True,max_split_size_mb:40"));
    void *e = xmalloc(80 * MiB, NULL); /* expandable: 4 granules mapped */
    cca_free(e);                       /* the largest free block, expandable */
    expect_eq_u64(usage().device_bytes[0], 200 * MiB);
    cca_sim_set_cap(sim, 0, 200 * MiB); /* no growth without a release */
    cca_device_stats_t s0 = stats();
    void *x = xmalloc(100 * MiB, NULL); /* both plain blocks released, one granule after e */
    cca_device_stats_t s = stats();
    expect_eq_ptr(x, e);
    expect_eq_i64(s.num_alloc_retries - s0.num_alloc_retries, 0);
    expect_eq_i64(s.num_device_free - s0.num_device_free, 2);
    expect_eq_i64(s.num_device_alloc - s0.num_device_alloc, 1);
    expect_true(device_is_valid());
    cca_free(x);
    cca_sim_set_cap(sim, 0, 0);
    cca_shutdown();
}

/* An emptied reservation whose free failed is freed by the next empty_cache (it stayed until
 * shutdown, 9/8 of the device's memory in address space). */
TEST(failed_reservation_free_retried)
{
    setup("expandable_segments:True");
    void *a = xmalloc(50 * MiB, NULL);
    cca_free(a);
    expect_ok(cca_sim_inject_fault(sim, CCA_OP_VMM_FREE, 1, false, CCA_ERR_BACKEND));
    expect_status(cca_empty_cache(), CCA_ERR_BACKEND);
    cca_sim_clear_faults(sim);
    expect_eq_i64(stats().reserved_bytes[CCA_STAT_ALL].current, 0);
    expect_eq_u64(usage().live_reservations, 1);
    expect_true(device_is_valid());
    expect_ok(cca_empty_cache());
    expect_eq_u64(usage().live_reservations, 0);
    expect_true(device_is_valid());
    cca_shutdown();
}

/* cca_enable_peer_access whose access to one mapped range fails is not enabled: a retry gives
 * access to every range (it found the peer enabled and did nothing). */
TEST(failed_peer_access_is_retried_whole)
{
    setup_with("expandable_segments:True", 1ull << 30, false, 2);
    void *a = xmalloc(30 * MiB, NULL); /* a large pool segment */
    void *c = xmalloc(1000, NULL);     /* a small pool segment */
    expect_ok(cca_sim_inject_fault(sim, CCA_OP_VMM_SET_ACCESS, 1, false, CCA_ERR_BACKEND));
    expect_true(cca_enable_peer_access(1, 0) != CCA_OK);
    cca_sim_clear_faults(sim);
    int peers[2];
    size_t n = 9;
    expect_ok(cca_peer_access_list(0, peers, 2, &n));
    expect_eq_u64(n, 0); /* not enabled */
    uint64_t before = cca_sim_call_count(sim, CCA_OP_VMM_SET_ACCESS);
    expect_ok(cca_enable_peer_access(1, 0));
    expect_eq_u64(cca_sim_call_count(sim, CCA_OP_VMM_SET_ACCESS) - before, 2); /* both ranges */
    expect_ok(cca_peer_access_list(0, peers, 2, &n));
    expect_eq_u64(n, 1);
    cca_free(a);
    cca_free(c);
    cca_shutdown();
}

/* A growth whose set_access fails and whose undo's unmap fails too keeps that granule's
 * handle as an orphan still mapped in a range the allocator holds unmapped: the next growth
 * maps the same range, so the stale mapping must go first (the map overlapped it). */
TEST(failed_undo_unmap_does_not_block_the_next_growth)
{
    setup("expandable_segments:True");
    void *a = xmalloc(4 * MiB, NULL), *b = NULL;
    expect_ok(cca_sim_inject_fault(sim, CCA_OP_VMM_SET_ACCESS, 1, false, CCA_ERR_BACKEND));
    expect_ok(cca_sim_inject_fault(sim, CCA_OP_VMM_UNMAP, 1, false, CCA_ERR_BACKEND));
    expect_status(cca_malloc(&b, 30 * MiB, NULL), CCA_ERR_BACKEND); /* its granule stays mapped */
    cca_sim_clear_faults(sim);
    expect_true(device_is_valid());
    b = xmalloc(30 * MiB, NULL); /* the same range */
    expect_true(b != NULL);
    expect_eq_i64(stats().reserved_bytes[CCA_STAT_ALL].current, 40 * (int64_t)MiB);
    expect_true(device_is_valid());
    cca_free(a);
    cca_free(b);
    expect_ok(cca_empty_cache());
    expect_eq_u64(usage().device_bytes[0], 0);
    expect_eq_u64(usage().live_handles, 0);
    cca_shutdown();
}

int main(void)
{
    RUN(small_pool_maps_2mib_granules);
    RUN(large_pool_grows_at_the_end);
    RUN(empty_cache_unmaps_and_frees_the_reservation);
    RUN(empty_cache_unmaps_only_whole_free_granules);
    RUN(oom_unmaps_cached_granules_and_retries);
    RUN(oom_in_the_middle_of_growth_maps_nothing_unaccounted);
    RUN(one_segment_per_stream_and_kind);
    RUN(switching_at_run_time_affects_new_segments_only);
    RUN(backed_memory_across_granules);
    RUN(peers_get_access_to_mapped_ranges);
    RUN(private_pool);
    RUN(checkpoint_restore_expandable);
    RUN(snapshot_file);
    RUN(misuse);
    cca_shutdown();
    RUN(release_available_passes_over_expandable_blocks);
    RUN(failed_reservation_free_retried);
    RUN(failed_peer_access_is_retried_whole);
    RUN(failed_undo_unmap_does_not_block_the_next_growth);
    return harness_done();
}
