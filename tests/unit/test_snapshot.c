/*
 * test_snapshot.c - snapshots, the allocation history and its user context,
 * trace trackers, annotations, and the snapshot writers (pickle read back by
 * cca's reader and by Python's pickle module, JSON, SVG), on the simulated
 * backend.
 */
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "device.h"
#include "harness.h"
#include "pickle.h"
#include "trace_ring.h"

#define MiB ((size_t)1 << 20)
#define S1 ((cca_stream_t)(uintptr_t)0x1000)
#define S2 ((cca_stream_t)(uintptr_t)0x2000)

static cca_backend_t *sim;

static void setup(size_t memory)
{
    cca_sim_config_t cfg = {0};
    cfg.devices = 2;
    cfg.total_memory = memory ? memory : 8ull << 30;
    cfg.manual_events = true;
    cca_shutdown();
    cca_record_history(false, NULL, NULL, 0, CCA_RECORD_CONTEXT_NEVER);
    if (cca_sim_create(&cfg, &sim) != CCA_OK || cca_init_with_backend(sim, "") != CCA_OK) {
        printf("cannot set up the simulated backend: %s\n", cca_last_error()->message);
        exit(1);
    }
}

static void *xmalloc_dev(size_t size, int device, cca_stream_t stream)
{
    void *p = NULL;
    if (cca_malloc_device(&p, size, device, stream) != CCA_OK)
        printf("  cca_malloc_device(%zu) failed: %s\n", size, cca_last_error()->message);
    return p;
}

static cca_snapshot_t *take(void)
{
    cca_snapshot_t *s = NULL;
    if (cca_snapshot(&s) != CCA_OK)
        printf("  cca_snapshot failed: %s\n", cca_last_error()->message);
    return s;
}

/* ---- snapshots -------------------------------------------------------------------- */

TEST(snapshot_split_blocks)
{
    setup(0);
    void *a = xmalloc_dev(1000, 0, S1);
    void *b = xmalloc_dev(3000, 0, S1);
    cca_snapshot_t *s = take();
    expect_eq_u64(s->segment_count, 1);
    cca_segment_info_t *seg = &s->segments[0];
    expect_eq_i64(seg->device, 0);
    expect_eq_u64(seg->address, (uintptr_t)a);
    expect_eq_u64(seg->total_size, CCA_SMALL_BUFFER);
    expect_eq_u64(seg->allocated_size, 1024 + 3072);
    expect_eq_u64(seg->active_size, 1024 + 3072);
    expect_eq_u64(seg->requested_size, 1000 + 3000);
    expect_true(seg->stream == S1);
    expect_false(seg->is_large);
    expect_false(seg->is_expandable);
    expect_eq_u64(seg->owner_private_pool_id[0], 0);
    expect_eq_u64(seg->owner_private_pool_id[1], 0);
    expect_eq_u64(seg->block_count, 3);
    expect_eq_u64(seg->blocks[0].address, (uintptr_t)a);
    expect_eq_u64(seg->blocks[0].size, 1024);
    expect_eq_u64(seg->blocks[0].requested_size, 1000);
    expect_eq_i64(seg->blocks[0].state, CCA_BLOCK_ACTIVE_ALLOCATED);
    expect_eq_u64(seg->blocks[1].address, (uintptr_t)b);
    expect_eq_u64(seg->blocks[1].size, 3072);
    expect_eq_u64(seg->blocks[2].size, CCA_SMALL_BUFFER - 4096);
    expect_eq_i64(seg->blocks[2].state, CCA_BLOCK_INACTIVE);
    expect_true(seg->blocks[0].context == NULL);
    cca_snapshot_free(s);
    cca_free(a);
    s = take();
    expect_eq_u64(s->segments[0].block_count, 3);
    expect_eq_i64(s->segments[0].blocks[0].state, CCA_BLOCK_INACTIVE);
    expect_eq_u64(s->segments[0].allocated_size, 3072);
    expect_eq_u64(s->segments[0].requested_size, 3000);
    cca_snapshot_free(s);
    cca_free(b);
    s = take();
    expect_eq_u64(s->segments[0].block_count, 1); /* merged back into one block */
    expect_eq_u64(s->segments[0].active_size, 0);
    cca_snapshot_free(s);
    expect_eq_str(cca_block_state_name(CCA_BLOCK_ACTIVE_PENDING_FREE), "active_pending_free");
    expect_eq_str(cca_block_state_name(CCA_BLOCK_INACTIVE), "inactive");
    expect_eq_str(cca_block_state_name((cca_block_state_t)9), "unknown");
}

TEST(snapshot_pending_free)
{
    setup(0);
    void *a = xmalloc_dev(5 * MiB, 0, S1);
    expect_eq_i64(cca_record_stream(a, S2), CCA_OK);
    expect_eq_i64(cca_free(a), CCA_OK);
    cca_snapshot_t *s = take();
    expect_eq_u64(s->segment_count, 1);
    cca_segment_info_t *seg = &s->segments[0];
    expect_true(seg->is_large);
    expect_eq_u64(seg->total_size, 20 * MiB);
    expect_eq_i64(seg->blocks[0].state, CCA_BLOCK_ACTIVE_PENDING_FREE);
    expect_eq_u64(seg->allocated_size, 0);
    expect_eq_u64(seg->active_size, 5 * MiB);
    expect_eq_u64(seg->requested_size, 5 * MiB);
    cca_snapshot_free(s);
    cca_sim_complete_stream(sim, 0, S2, false);
    expect_eq_i64(alloc_process_events(), CCA_OK);
    s = take();
    expect_eq_u64(s->segments[0].block_count, 1);
    expect_eq_i64(s->segments[0].blocks[0].state, CCA_BLOCK_INACTIVE);
    expect_eq_u64(s->segments[0].active_size, 0);
    cca_snapshot_free(s);
}

TEST(snapshot_streams_and_devices_sorted)
{
    setup(0);
    void *p[4] = {xmalloc_dev(100, 0, S1), xmalloc_dev(100, 0, S2), xmalloc_dev(2 * MiB, 1, S1),
                  xmalloc_dev(100, 1, NULL)};
    cca_snapshot_t *s = take();
    expect_eq_u64(s->segment_count, 4);
    size_t per_device[2] = {0, 0};
    for (size_t i = 0; i < s->segment_count; i++) {
        cca_segment_info_t *seg = &s->segments[i];
        per_device[seg->device]++;
        if (i > 0) {
            cca_segment_info_t *prev = &s->segments[i - 1];
            expect_true(prev->device < seg->device ||
                        (prev->device == seg->device && prev->address < seg->address));
        }
        /* each segment holds exactly the allocation made on its (device, stream) */
        expect_eq_u64(seg->blocks[0].state, CCA_BLOCK_ACTIVE_ALLOCATED);
        for (int k = 0; k < 4; k++)
            if ((uintptr_t)p[k] == seg->address)
                expect_true(seg->stream == (k == 0 ? S1 : k == 1 ? S2 : k == 2 ? S1 : NULL));
    }
    expect_eq_u64(per_device[0], 2);
    expect_eq_u64(per_device[1], 2);
    cca_snapshot_free(s);
    for (int k = 0; k < 4; k++)
        cca_free(p[k]);
    expect_eq_i64(cca_snapshot(NULL), CCA_ERR_INVALID_ARGUMENT);
    cca_snapshot_free(NULL);
}

/* ---- history ------------------------------------------------------------------------ */

static cca_trace_entry_t *history(size_t *n)
{
    cca_trace_entry_t *e = NULL;
    *n = 0;
    if (cca_history_get(&e, n) != CCA_OK)
        printf("  cca_history_get failed\n");
    return e;
}

TEST(history_order_and_fields)
{
    setup(0);
    size_t n;
    cca_trace_entry_t *e = history(&n);
    expect_eq_u64(n, 0); /* off by default */
    cca_history_free(e);
    expect_false(cca_history_enabled());
    expect_eq_i64(cca_record_history(true, NULL, NULL, 100, CCA_RECORD_CONTEXT_NEVER), CCA_OK);
    expect_true(cca_history_enabled());
    void *a = xmalloc_dev(1000, 1, S1);
    expect_eq_i64(cca_record_stream(a, S2), CCA_OK);
    cca_free(a);
    cca_sim_complete_stream(sim, 1, S2, false);
    alloc_process_events();
    cca_empty_cache();
    e = history(&n);
    cca_trace_action_t want[] = {CCA_TRACE_SEGMENT_ALLOC, CCA_TRACE_ALLOC, CCA_TRACE_FREE_REQUESTED,
                                 CCA_TRACE_FREE_COMPLETED, CCA_TRACE_SEGMENT_FREE};
    expect_eq_u64(n, 5);
    for (size_t i = 0; i < n && i < 5; i++) {
        expect_eq_i64(e[i].action, want[i]);
        expect_eq_i64(e[i].device, 1);
        expect_eq_u64(e[i].addr, (uintptr_t)a);
        expect_true(e[i].stream == S1);
        expect_true(e[i].context == NULL);
        if (i)
            expect_true(e[i].time_us >= e[i - 1].time_us);
    }
    expect_eq_u64(e[0].size, CCA_SMALL_BUFFER);
    expect_eq_u64(e[1].size, 1000); /* requested bytes */
    expect_eq_u64(e[2].size, 1000);
    expect_eq_u64(e[4].size, CCA_SMALL_BUFFER);
    cca_history_free(e);
    expect_eq_str(cca_trace_action_name(CCA_TRACE_FREE_COMPLETED), "free_completed");
    expect_eq_str(cca_trace_action_name(CCA_TRACE_USER_DEFINED), "user_defined");
    expect_eq_str(cca_trace_action_name(CCA_TRACE_ACTION_COUNT), "unknown");
    /* disabling clears */
    cca_record_history(false, NULL, NULL, 0, CCA_RECORD_CONTEXT_NEVER);
    void *b = xmalloc_dev(100, 0, S1);
    cca_free(b);
    e = history(&n);
    expect_eq_u64(n, 0);
    cca_history_free(e);
    expect_eq_i64(cca_history_get(NULL, &n), CCA_ERR_INVALID_ARGUMENT);
}

TEST(history_ring_wraps)
{
    setup(0);
    cca_record_history(true, NULL, NULL, 3, CCA_RECORD_CONTEXT_NEVER);
    void *keep = xmalloc_dev(100, 0, S1); /* segment_alloc + alloc */
    uintptr_t addrs[4];
    for (int i = 0; i < 4; i++) {
        void *p = xmalloc_dev(512 * (size_t)(i + 1), 0, S1);
        addrs[i] = (uintptr_t)p;
        cca_free(p);
    }
    size_t n;
    cca_trace_entry_t *e = history(&n);
    expect_eq_u64(n, 3);
    /* the newest three: alloc, free_requested, free_completed of the last one */
    expect_eq_i64(e[0].action, CCA_TRACE_ALLOC);
    expect_eq_i64(e[1].action, CCA_TRACE_FREE_REQUESTED);
    expect_eq_i64(e[2].action, CCA_TRACE_FREE_COMPLETED);
    for (size_t i = 0; i < n; i++) {
        expect_eq_u64(e[i].addr, addrs[3]);
        expect_eq_u64(e[i].size, 2048);
    }
    cca_history_free(e);
    /* growing keeps the entries; shrinking keeps the newest */
    expect_eq_i64(cca_record_history(true, NULL, NULL, 10, CCA_RECORD_CONTEXT_NEVER), CCA_OK);
    e = history(&n);
    expect_eq_u64(n, 3);
    cca_history_free(e);
    expect_eq_i64(cca_record_history(true, NULL, NULL, 2, CCA_RECORD_CONTEXT_NEVER), CCA_OK);
    e = history(&n);
    expect_eq_u64(n, 2);
    expect_eq_i64(e[0].action, CCA_TRACE_FREE_REQUESTED);
    expect_eq_i64(e[1].action, CCA_TRACE_FREE_COMPLETED);
    cca_history_free(e);
    /* 0 entries counts as 1 */
    expect_eq_i64(cca_record_history(true, NULL, NULL, 0, CCA_RECORD_CONTEXT_NEVER), CCA_OK);
    cca_free(keep);
    e = history(&n);
    expect_eq_u64(n, 1);
    expect_eq_i64(e[0].action, CCA_TRACE_FREE_COMPLETED);
    expect_eq_u64(e[0].addr, (uintptr_t)keep);
    cca_history_free(e);
}

/* Rounds first.. first + count - 1: malloc and free of 512 * (1 + i % 50) bytes, 3 entries each. */
static void history_rounds(int first, int count)
{
    for (int i = first; i < first + count; i++)
        cca_free(xmalloc_dev(512 * (size_t)(1 + i % 50), 0, S1));
}

/* Entries [from, n) of e are rounds first.. of history_rounds, in order. */
static void expect_rounds(const cca_trace_entry_t *e, size_t from, size_t n, int first)
{
    size_t bad = 0;
    for (size_t k = from; k < n; k++) {
        size_t round = (size_t)first + (k - from) / 3;
        cca_trace_action_t want[3] = {CCA_TRACE_ALLOC, CCA_TRACE_FREE_REQUESTED, CCA_TRACE_FREE_COMPLETED};
        if (e[k].action != want[(k - from) % 3] || e[k].size != 512 * (1 + round % 50))
            bad++;
    }
    expect_eq_u64(bad, 0);
}

/*
 * max_entries is a bound, not a size (PyTorch's default is sys.maxsize): the ring
 * grows as entries come, past its first slots, and keeps every entry in order;
 * a bound reached later still keeps the newest.
 */
TEST(history_huge_bound_grows)
{
    setup(0);
    expect_eq_i64(cca_record_history(true, NULL, NULL, (size_t)INT64_MAX, CCA_RECORD_CONTEXT_NEVER), CCA_OK);
    expect_true(cca_history_enabled());
    void *keep = xmalloc_dev(100, 0, S1); /* segment_alloc + alloc */
    history_rounds(0, 1500);                /* 4,500 entries: the ring grows several times */
    size_t n;
    cca_trace_entry_t *e = history(&n);
    expect_eq_u64(n, 2 + 3 * 1500);
    expect_eq_i64(e[0].action, CCA_TRACE_SEGMENT_ALLOC);
    expect_eq_i64(e[1].action, CCA_TRACE_ALLOC);
    expect_rounds(e, 2, n, 0);
    cca_history_free(e);
    /* SIZE_MAX too; the same bound again changes nothing */
    expect_eq_i64(cca_record_history(true, NULL, NULL, SIZE_MAX, CCA_RECORD_CONTEXT_NEVER), CCA_OK);
    expect_eq_i64(cca_record_history(true, NULL, NULL, SIZE_MAX, CCA_RECORD_CONTEXT_NEVER), CCA_OK);
    history_rounds(1500, 10);
    e = history(&n);
    expect_eq_u64(n, 2 + 3 * 1510);
    expect_rounds(e, 2, n, 0);
    cca_history_free(e);
    /* a bound below the entries held keeps the newest, then wraps */
    expect_eq_i64(cca_record_history(true, NULL, NULL, 3000, CCA_RECORD_CONTEXT_NEVER), CCA_OK);
    e = history(&n);
    expect_eq_u64(n, 3000);
    expect_rounds(e, 0, n, 1510 - 1000);
    cca_history_free(e);
    history_rounds(1510, 700);
    e = history(&n);
    expect_eq_u64(n, 3000);
    expect_rounds(e, 0, n, 2210 - 1000);
    cca_history_free(e);
    /* a bound not reached yet grows from a partly filled ring */
    expect_eq_i64(cca_record_history(false, NULL, NULL, 0, CCA_RECORD_CONTEXT_NEVER), CCA_OK);
    expect_eq_i64(cca_record_history(true, NULL, NULL, 2500, CCA_RECORD_CONTEXT_NEVER), CCA_OK);
    history_rounds(0, 100);
    expect_eq_i64(cca_record_history(true, NULL, NULL, 2001, CCA_RECORD_CONTEXT_NEVER), CCA_OK);
    history_rounds(100, 900);
    e = history(&n);
    expect_eq_u64(n, 2001);
    expect_rounds(e, 0, n, 1000 - 667);
    cca_history_free(e);
    cca_free(keep);
}

static int context_calls;

static const char *context_fn(void *arg)
{
    static char buf[64];
    snprintf(buf, sizeof(buf), "%s-%d\nframe two", (const char *)arg, ++context_calls);
    return buf;
}

/* One malloc, a snapshot, a free; then the history. */
static cca_trace_entry_t *context_round(cca_record_context_t when, char **block_context, size_t *n)
{
    setup(0);
    context_calls = 0;
    expect_eq_i64(cca_record_history(true, context_fn, "ctx", 100, when), CCA_OK);
    void *a = xmalloc_dev(1000, 0, S1);
    cca_snapshot_t *s = take();
    const char *bc = s->segments[0].blocks[0].context;
    *block_context = bc ? strdup(bc) : NULL;
    cca_snapshot_free(s);
    cca_free(a);
    return history(n);
}

TEST(context_levels)
{
    char *bc;
    size_t n;
    cca_trace_entry_t *e = context_round(CCA_RECORD_CONTEXT_NEVER, &bc, &n);
    expect_eq_i64(context_calls, 0);
    expect_true(bc == NULL);
    for (size_t i = 0; i < n; i++)
        expect_true(e[i].context == NULL);
    cca_history_free(e);

    e = context_round(CCA_RECORD_CONTEXT_STATE, &bc, &n);
    expect_eq_i64(context_calls, 1); /* at malloc only */
    expect_true(bc && !strcmp(bc, "ctx-1\nframe two"));
    for (size_t i = 0; i < n; i++)
        expect_true(e[i].context == NULL);
    free(bc);
    cca_history_free(e);

    /* segment_alloc, alloc, snapshot x2, free_requested, free_completed */
    e = context_round(CCA_RECORD_CONTEXT_ALLOC, &bc, &n);
    expect_eq_i64(context_calls, 1);
    expect_eq_u64(n, 6);
    expect_eq_str(e[0].context ? e[0].context : "", "ctx-1\nframe two");
    expect_eq_str(e[1].context ? e[1].context : "", "ctx-1\nframe two");
    expect_true(e[2].context == NULL && e[2].action == CCA_TRACE_SNAPSHOT);
    expect_eq_i64(e[4].action, CCA_TRACE_FREE_REQUESTED);
    expect_eq_str(e[4].context ? e[4].context : "", "ctx-1\nframe two"); /* the allocation's */
    expect_eq_str(e[5].context ? e[5].context : "", "ctx-1\nframe two");
    free(bc);
    cca_history_free(e);

    e = context_round(CCA_RECORD_CONTEXT_ALL, &bc, &n);
    expect_eq_i64(context_calls, 2); /* at malloc and at free */
    expect_eq_u64(n, 6);
    expect_eq_str(e[4].context ? e[4].context : "", "ctx-2\nframe two"); /* the free's own */
    expect_eq_str(e[5].context ? e[5].context : "", "ctx-1\nframe two");
    free(bc);
    cca_history_free(e);

    /* the block's context is gone once it is free */
    cca_snapshot_t *s = take();
    expect_true(s->segments[0].blocks[0].context == NULL);
    cca_snapshot_free(s);

    expect_eq_i64(cca_record_history(true, NULL, NULL, 10, CCA_RECORD_CONTEXT_ALLOC),
                  CCA_ERR_INVALID_ARGUMENT);
    expect_eq_i64(cca_record_history(true, context_fn, NULL, 10, (cca_record_context_t)7),
                  CCA_ERR_INVALID_ARGUMENT);
    cca_record_history(false, NULL, NULL, 0, CCA_RECORD_CONTEXT_NEVER);
}

/* ---- trackers, observers, annotations, snapshot entries ---------------------------- */

typedef struct seen {
    int count;
    cca_trace_action_t last;
    char last_context[32];
} seen_t;

static void tracker(const cca_trace_entry_t *e, void *arg)
{
    seen_t *s = arg;
    s->count++;
    s->last = e->action;
    snprintf(s->last_context, sizeof(s->last_context), "%s", e->context ? e->context : "");
}

static int oom_calls;
static size_t oom_size;

static void oom_observer(int device, size_t alloc_size, size_t total, size_t device_free, void *arg)
{
    (void)device, (void)total, (void)device_free, (void)arg;
    oom_calls++;
    oom_size = alloc_size;
}

TEST(trackers_observers_annotations)
{
    setup(64 * MiB);
    seen_t s = {0};
    expect_eq_i64(cca_attach_trace_tracker(tracker, &s), CCA_OK);
    /* trackers see entries with the history off */
    void *a = xmalloc_dev(1000, 0, S1);
    expect_eq_i64(s.count, 2);
    expect_eq_i64(s.last, CCA_TRACE_ALLOC);
    cca_free(a);
    expect_eq_i64(s.count, 4);
    expect_eq_i64(s.last, CCA_TRACE_FREE_COMPLETED);
    size_t n;
    cca_trace_entry_t *e = history(&n);
    expect_eq_u64(n, 0);
    cca_history_free(e);

    /* OOM: an oom entry (addr: the device's free bytes) and the observer */
    cca_record_history(true, NULL, NULL, 100, CCA_RECORD_CONTEXT_NEVER);
    expect_eq_i64(cca_attach_oom_observer(oom_observer, NULL), CCA_OK);
    void *big = NULL;
    expect_eq_i64(cca_malloc_device(&big, 100 * MiB, 0, S1), CCA_ERR_OUT_OF_MEMORY);
    expect_eq_i64(oom_calls, 1);
    expect_eq_u64(oom_size, 100 * MiB);
    expect_eq_i64(s.last, CCA_TRACE_OOM);
    size_t free_bytes = 0;
    cca_mem_get_info(0, &free_bytes, NULL);
    e = history(&n);
    expect_true(n >= 1);
    if (n >= 1) {
        expect_eq_i64(e[n - 1].action, CCA_TRACE_OOM);
        expect_eq_u64(e[n - 1].size, 100 * MiB);
        expect_eq_u64(e[n - 1].addr, free_bytes);
    }
    cca_history_free(e);

    /* annotations: one user_defined entry, on the current device only (as PyTorch 2.11's) */
    int before = s.count;
    expect_eq_i64(cca_record_annotation("phase one"), CCA_OK);
    expect_eq_i64(s.count, before + 1);
    expect_eq_str(s.last_context, "phase one");
    expect_eq_i64(cca_record_annotation(NULL), CCA_ERR_INVALID_ARGUMENT);

    /* a snapshot records one snapshot entry per device with its active bytes */
    void *b = xmalloc_dev(4096, 1, S1);
    cca_snapshot_t *snap = take();
    cca_snapshot_free(snap);
    e = history(&n);
    expect_true(n >= 2);
    if (n >= 2) {
        expect_eq_i64(e[n - 2].action, CCA_TRACE_SNAPSHOT);
        expect_eq_i64(e[n - 2].device, 0);
        expect_eq_u64(e[n - 2].size, 0);
        expect_eq_i64(e[n - 1].action, CCA_TRACE_SNAPSHOT);
        expect_eq_i64(e[n - 1].device, 1);
        expect_eq_u64(e[n - 1].size, 4096);
        expect_eq_i64(e[n - 5].action, CCA_TRACE_USER_DEFINED);
        expect_eq_str(e[n - 5].context ? e[n - 5].context : "", "phase one");
    }
    cca_history_free(e);
    cca_free(b);

    expect_eq_i64(cca_detach_trace_tracker(tracker, &s), CCA_OK);
    expect_eq_i64(cca_detach_trace_tracker(tracker, &s), CCA_ERR_INVALID_ARGUMENT);
    expect_eq_i64(cca_attach_trace_tracker(NULL, NULL), CCA_ERR_INVALID_ARGUMENT);
    before = s.count;
    void *c = xmalloc_dev(1000, 0, S1);
    cca_free(c);
    expect_eq_i64(s.count, before);
    cca_record_history(false, NULL, NULL, 0, CCA_RECORD_CONTEXT_NEVER);
    /* with neither history nor trackers, an annotation records nothing */
    expect_eq_i64(cca_record_annotation("ignored"), CCA_OK);
}

/* ---- consistency under concurrency ----------------------------------------------- */

static atomic_bool churn_stop;

/* Allocate and free on one stream (with a cross-stream use now and then) until told to stop. */
static void *churn(void *arg)
{
    cca_stream_t stream = (cca_stream_t)arg;
    uint64_t x = (uint64_t)(uintptr_t)arg * 2654435761u + 1;
    void *held[16] = {0};
    while (!atomic_load(&churn_stop)) {
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        int slot = (int)((x >> 33) % 16);
        if (held[slot]) {
            cca_free(held[slot]);
            held[slot] = NULL;
        } else {
            size_t size = (size_t)((x >> 40) % (3 * MiB)) + 1;
            if (cca_malloc_device(&held[slot], size, 0, stream) != CCA_OK)
                held[slot] = NULL;
        }
    }
    for (int i = 0; i < 16; i++)
        cca_free(held[i]);
    return NULL;
}

static void count_entry(const cca_trace_entry_t *e, void *arg)
{
    (void)e;
    atomic_fetch_add((atomic_long *)arg, 1);
}

TEST(snapshot_consistent_under_concurrency)
{
    cca_sim_config_t cfg = {0};
    cfg.devices = 1;
    cfg.total_memory = 8ull << 30;
    cca_shutdown();
    if (cca_sim_create(&cfg, &sim) != CCA_OK || cca_init_with_backend(sim, "") != CCA_OK)
        exit(1);
    atomic_long tracked = 0;
    cca_record_history(true, NULL, NULL, 4096, CCA_RECORD_CONTEXT_NEVER);
    cca_attach_trace_tracker(count_entry, &tracked);
    atomic_store(&churn_stop, false);
    pthread_t threads[4];
    for (uintptr_t i = 0; i < 4; i++)
        pthread_create(&threads[i], NULL, churn, (void *)(0x1000 * (i + 1)));
    while (atomic_load(&tracked) < 2000)
        sched_yield(); /* the threads are under way */
    int bad = 0;
    for (int round = 0; round < 200 && !bad; round++) {
        cca_snapshot_t *s = take();
        for (size_t i = 0; s && i < s->segment_count; i++) {
            cca_segment_info_t *seg = &s->segments[i];
            uint64_t next = seg->address, total = 0;
            for (size_t j = 0; j < seg->block_count; j++) {
                cca_block_info_t *b = &seg->blocks[j];
                bad += b->address != next; /* blocks tile the segment */
                if (j && b->state == CCA_BLOCK_INACTIVE && seg->blocks[j - 1].state == CCA_BLOCK_INACTIVE)
                    bad++; /* free neighbours are always merged */
                next += b->size;
                total += b->size;
            }
            bad += total != seg->total_size;
            bad += seg->allocated_size > seg->active_size || seg->active_size > seg->total_size;
        }
        cca_snapshot_free(s);
    }
    atomic_store(&churn_stop, true);
    for (int i = 0; i < 4; i++)
        pthread_join(threads[i], NULL);
    expect_eq_i64(bad, 0);
    expect_true(atomic_load(&tracked) > 0);
    cca_detach_trace_tracker(count_entry, &tracked);
    cca_record_history(false, NULL, NULL, 0, CCA_RECORD_CONTEXT_NEVER);
}

/* ---- writers ------------------------------------------------------------------------ */

static char tmpdir[64];

static void path_in_tmp(char *buf, size_t len, const char *name)
{
    snprintf(buf, len, "%s/%s", tmpdir, name);
}

/* A scripted state with every block state, a context and an annotation. */
static void scripted_state(void **keep)
{
    setup(0);
    context_calls = 0;
    cca_record_history(true, context_fn, "tag", 1000, CCA_RECORD_CONTEXT_ALLOC);
    keep[0] = xmalloc_dev(1000, 0, S1);
    keep[1] = xmalloc_dev(5 * MiB, 0, S2);
    void *pending = xmalloc_dev(3000, 0, S1);
    cca_record_stream(pending, S2);
    cca_free(pending);
    keep[2] = xmalloc_dev(2 * MiB, 1, NULL);
    cca_record_annotation("step 1");
}

static const pv_node_t *key(const pv_node_t *d, const char *k)
{
    const pv_node_t *v = pv_dict_get(d, k);
    if (!v)
        HARNESS_FAIL("missing key %s", k);
    return v;
}

TEST(dump_pickle_read_back_by_cca)
{
    void *keep[3];
    scripted_state(keep);
    char path[128];
    path_in_tmp(path, sizeof(path), "snap.pickle.gz");
    expect_eq_i64(cca_dump_snapshot(path), CCA_OK);
    pv_doc_t *doc = NULL;
    expect_eq_i64(pickle_load_file(path, &doc), CCA_OK);
    const pv_node_t *root = pv_doc_root(doc);
    const pv_node_t *segs = key(root, "segments");
    expect_eq_u64(pv_len(segs), 3);
    size_t states[3] = {0, 0, 0};
    for (size_t i = 0; i < pv_len(segs); i++) {
        const pv_node_t *seg = pv_at(segs, i);
        expect_eq_i64(pv_kind(key(seg, "segment_pool_id")), PV_TUPLE);
        expect_eq_i64(pv_kind(key(seg, "is_expandable")), PV_BOOL);
        const pv_node_t *blocks = key(seg, "blocks");
        for (size_t j = 0; j < pv_len(blocks); j++) {
            const pv_node_t *st = key(pv_at(blocks, j), "state");
            states[0] += pv_str_eq(st, "active_allocated");
            states[1] += pv_str_eq(st, "active_pending_free");
            states[2] += pv_str_eq(st, "inactive");
        }
    }
    expect_eq_u64(states[0], 3);
    expect_eq_u64(states[1], 1);
    expect_true(states[2] >= 2);
    const pv_node_t *traces = key(root, "device_traces");
    expect_eq_u64(pv_len(traces), 2);
    const pv_node_t *t0 = pv_at(traces, 0);
    const pv_node_t *first = pv_at(t0, 0);
    expect_true(pv_str_eq(key(first, "action"), "segment_alloc"));
    expect_true(pv_str_eq(key(first, "compile_context"), "N/A"));
    const pv_node_t *frames = key(first, "frames");
    expect_eq_u64(pv_len(frames), 2); /* two lines of context, two frames */
    expect_true(pv_str_eq(pv_dict_get(pv_at(frames, 0), "filename"), "tag-1"));
    expect_true(pv_str_eq(pv_dict_get(pv_at(frames, 1), "filename"), "frame two"));
    const pv_node_t *ann = key(root, "external_annotations");
    expect_eq_u64(pv_len(ann), 1); /* on the current device only */
    expect_true(pv_str_eq(pv_dict_get(pv_at(ann, 0), "name"), "step 1"));
    const pv_node_t *as = key(root, "allocator_settings");
    int64_t mss = 0;
    expect_true(pv_get_int(key(as, "max_split_size"), &mss) && mss == -1);
    pv_doc_free(doc);

    /* JSON of the same content */
    path_in_tmp(path, sizeof(path), "snap.json");
    expect_eq_i64(cca_dump_snapshot_json(path), CCA_OK);
    FILE *f = fopen(path, "r");
    char head[64] = "";
    expect_true(f && fgets(head, sizeof(head), f));
    if (f)
        fclose(f);
    expect_eq_str(head, "{\n");

    /* errors */
    expect_eq_i64(cca_dump_snapshot(NULL), CCA_ERR_INVALID_ARGUMENT);
    expect_eq_i64(cca_dump_snapshot_json(""), CCA_ERR_INVALID_ARGUMENT);
    expect_eq_i64(cca_dump_snapshot("/nonexistent-dir/x.pickle"), CCA_ERR_IO);
    expect_eq_i64(cca_dump_snapshot_svg("/nonexistent-dir/x.svg"), CCA_ERR_IO);
    char *text = NULL;
    expect_eq_i64(cca_snapshot_file_to_json("/nonexistent-file.pickle", &text), CCA_ERR_IO);
    expect_eq_i64(cca_snapshot_file_to_json(path, NULL), CCA_ERR_INVALID_ARGUMENT);
    expect_eq_i64(cca_snapshot_file_to_json(path, &text), CCA_ERR_FORMAT); /* JSON is no pickle */
    for (int k = 0; k < 3; k++)
        cca_free(keep[k]);
    cca_record_history(false, NULL, NULL, 0, CCA_RECORD_CONTEXT_NEVER);
}

/* A tracker that keeps the stage of the annotations it sees. */
static void stage_tracker(const cca_trace_entry_t *e, void *arg)
{
    const char *stage = cca_trace_entry_field(e, "stage");
    if (stage)
        snprintf(arg, 16, "%s", stage);
}

TEST(annotation_fields)
{
    setup(0);
    char tracked[16] = "";
    expect_eq_i64(cca_attach_trace_tracker(stage_tracker, tracked), CCA_OK);
    expect_eq_i64(cca_record_history(true, NULL, NULL, 1000, CCA_RECORD_CONTEXT_NEVER), CCA_OK);
    void *a = xmalloc_dev(1000, 0, S1);
    const char *keys[2] = {"name", "stage"};
    const char *start[2] = {"forward", "START"}, *end[2] = {"forward", "END"};
    expect_eq_i64(cca_record_annotation_fields(keys, start, 2), CCA_OK);
    expect_eq_str(tracked, "START");
    expect_eq_i64(cca_record_annotation_fields(keys, end, 2), CCA_OK);
    expect_eq_str(tracked, "END");
    const char *other_keys[1] = {"phase"}, *other_values[1] = {"warm-up"};
    expect_eq_i64(cca_set_device(1), CCA_OK); /* recorded on device 1 alone */
    expect_eq_i64(cca_record_annotation_fields(other_keys, other_values, 1), CCA_OK);
    expect_eq_i64(cca_set_device(0), CCA_OK);
    expect_eq_i64(cca_record_annotation("plain"), CCA_OK);
    const char *bad_keys[1] = {"\xff key"}, *bad_values[1] = {"\xfe"};
    expect_eq_i64(cca_record_annotation_fields(bad_keys, bad_values, 1), CCA_OK);
    expect_eq_i64(cca_record_annotation_fields(NULL, NULL, 0), CCA_OK); /* no field: no name */

    /* refused, and nothing recorded */
    size_t before = 0;
    cca_history_free(history(&before));
    const char *empty_key[1] = {""}, *null_key[1] = {NULL}, *null_value[1] = {NULL};
    expect_eq_i64(cca_record_annotation_fields(NULL, other_values, 1), CCA_ERR_INVALID_ARGUMENT);
    expect_eq_i64(cca_record_annotation_fields(other_keys, NULL, 1), CCA_ERR_INVALID_ARGUMENT);
    expect_eq_i64(cca_record_annotation_fields(empty_key, other_values, 1), CCA_ERR_INVALID_ARGUMENT);
    expect_contains(cca_last_error()->message, "key 0 is empty");
    expect_eq_i64(cca_record_annotation_fields(null_key, other_values, 1), CCA_ERR_INVALID_ARGUMENT);
    expect_eq_i64(cca_record_annotation_fields(other_keys, null_value, 1), CCA_ERR_INVALID_ARGUMENT);
    expect_contains(cca_last_error()->message, "'phase'");

    /* the history: one user_defined entry each, on its device, the name as context, the fields */
    size_t n = 0;
    cca_trace_entry_t *e = history(&n);
    expect_eq_u64(n, before);
    expect_true(n >= 7);
    if (n >= 7) {
        const cca_trace_entry_t *f = &e[n - 6]; /* the first annotation */
        expect_eq_i64(f[0].action, CCA_TRACE_USER_DEFINED);
        for (int i = 0; i < 6; i++)
            expect_eq_i64(f[i].device, i == 2 ? 1 : 0);
        expect_eq_str(f[0].context, "forward");
        expect_eq_str(cca_trace_entry_field(&f[0], "stage"), "START");
        expect_eq_str(cca_trace_entry_field(&f[1], "stage"), "END");
        expect_true(cca_trace_entry_field(&f[0], "phase") == NULL);
        const char *k = NULL, *v = NULL;
        expect_true(cca_trace_entry_field_at(&f[0], 1, &k, &v));
        expect_eq_str(k, "stage");
        expect_eq_str(v, "START");
        expect_true(!cca_trace_entry_field_at(&f[0], 2, &k, &v));
        expect_eq_str(f[2].context, ""); /* no "name" field */
        expect_eq_str(cca_trace_entry_field(&f[2], "phase"), "warm-up");
        expect_eq_str(f[3].context, "plain");
        expect_eq_str(cca_trace_entry_field(&f[3], "stage"), "START");
        expect_true(!cca_trace_entry_field_at(&f[5], 0, &k, &v)); /* no field at all */
        expect_true(cca_trace_entry_field(&e[n - 7], "name") == NULL); /* not an annotation */
        expect_true(cca_trace_entry_field(NULL, "name") == NULL);
        expect_true(cca_trace_entry_field(&f[0], NULL) == NULL);
    }
    cca_history_free(e);

    /* the snapshot: annotations in external_annotations only, fields, device, time */
    char path[128];
    path_in_tmp(path, sizeof(path), "annotations.pickle");
    expect_eq_i64(cca_dump_snapshot(path), CCA_OK);
    pv_doc_t *doc = NULL;
    expect_eq_i64(pickle_load_file(path, &doc), CCA_OK);
    const pv_node_t *root = doc ? pv_doc_root(doc) : NULL;
    const pv_node_t *ann = root ? key(root, "external_annotations") : NULL;
    expect_eq_u64(ann ? pv_len(ann) : 0, 6);
    if (ann && pv_len(ann) == 6) {
        expect_true(pv_str_eq(key(pv_at(ann, 1), "name"), "forward"));
        expect_true(pv_str_eq(key(pv_at(ann, 1), "stage"), "END"));
        int64_t dev = -1, t = 0;
        expect_true(pv_get_int(key(pv_at(ann, 1), "device"), &dev) && dev == 0);
        expect_true(pv_get_int(key(pv_at(ann, 2), "device"), &dev) && dev == 1);
        expect_true(pv_get_int(key(pv_at(ann, 2), "time_us"), &t) && t > 0);
        expect_true(pv_str_eq(key(pv_at(ann, 2), "phase"), "warm-up"));
        expect_true(pv_dict_get(pv_at(ann, 2), "name") == NULL);
        expect_true(pv_str_eq(key(pv_at(ann, 4), "\xef\xbf\xbd key"), "\xef\xbf\xbd"));
        expect_eq_u64(pv_len(pv_at(ann, 5)), 2); /* device and time_us alone */
    }
    const pv_node_t *traces = root ? key(root, "device_traces") : NULL;
    size_t user_defined = 0, entries = 0;
    for (size_t d = 0; traces && d < pv_len(traces); d++)
        for (size_t i = 0; i < pv_len(pv_at(traces, d)); i++, entries++)
            user_defined += pv_str_eq(key(pv_at(pv_at(traces, d), i), "action"), "user_defined");
    expect_true(entries >= 1);
    expect_eq_u64(user_defined, 0);
    pv_doc_free(doc);
    expect_eq_i64(cca_detach_trace_tracker(stage_tracker, tracked), CCA_OK);
    cca_free(a);
    cca_record_history(false, NULL, NULL, 0, CCA_RECORD_CONTEXT_NEVER);
}

static int releases;
static void count_releases(const char *context, void *arg)
{
    (void)context, (void)arg;
    releases++;
}

/* The last history entry of action on device, or NULL (entries: n of them). */
static const cca_trace_entry_t *last_of(const cca_trace_entry_t *e, size_t n, cca_trace_action_t action,
                                        int device)
{
    for (size_t i = n; i-- > 0;)
        if (e[i].action == action && e[i].device == device)
            return &e[i];
    return NULL;
}

TEST(compile_contexts_and_user_metadata)
{
    setup(0);
    releases = 0;
    cca_set_context_release(count_releases, NULL);
    expect_eq_i64(cca_set_device(0), CCA_OK);
    /* no history: PyTorch keeps no compile context */
    expect_eq_i64(cca_push_compile_context("before"), CCA_OK);
    expect_eq_i64(cca_record_history(true, NULL, NULL, 1000, CCA_RECORD_CONTEXT_NEVER), CCA_OK);
    void *a = xmalloc_dev(1000, 0, S1);
    size_t n = 0;
    cca_trace_entry_t *e = history(&n);
    const cca_trace_entry_t *x = last_of(e, n, CCA_TRACE_ALLOC, 0);
    expect_true(x && !x->compile_context && !x->user_metadata);
    cca_history_free(e);

    /* metadata per device, the current one's */
    expect_eq_i64(cca_set_user_metadata("run A"), CCA_OK);
    char *md = NULL;
    expect_eq_i64(cca_get_user_metadata(&md), CCA_OK);
    expect_eq_str(md, "run A");
    free(md);
    expect_eq_i64(cca_set_device(1), CCA_OK);
    expect_eq_i64(cca_get_user_metadata(&md), CCA_OK);
    expect_eq_str(md, "");
    free(md);
    expect_eq_i64(cca_push_compile_context("on device 1"), CCA_OK);
    expect_eq_i64(cca_set_device(0), CCA_OK);

    /* a stack per device: each entry takes its device's top */
    expect_eq_i64(cca_push_compile_context("frame 1"), CCA_OK);
    void *b = xmalloc_dev(2000, 0, S1);
    expect_eq_i64(cca_push_compile_context("frame 2"), CCA_OK);
    void *c = xmalloc_dev(3000, 0, S1);
    expect_eq_i64(cca_pop_compile_context(), CCA_OK);
    expect_eq_i64(cca_free(c), CCA_OK);
    expect_eq_i64(cca_pop_compile_context(), CCA_OK);
    expect_eq_i64(cca_pop_compile_context(), CCA_OK); /* empty: nothing */
    void *d0 = xmalloc_dev(4000, 0, S1);
    void *d1 = xmalloc_dev(5000, 1, S1);
    e = history(&n);
    const cca_trace_entry_t *eb = NULL, *ec = NULL, *efree = NULL;
    for (size_t i = 0; i < n; i++) {
        if (e[i].action == CCA_TRACE_ALLOC && e[i].size == 2000)
            eb = &e[i];
        if (e[i].action == CCA_TRACE_ALLOC && e[i].size == 3000)
            ec = &e[i];
        if (e[i].action == CCA_TRACE_FREE_REQUESTED && e[i].size == 3000)
            efree = &e[i];
    }
    expect_true(eb && ec && efree);
    if (eb && ec && efree) {
        expect_eq_str(eb->compile_context, "frame 1");
        expect_eq_str(ec->compile_context, "frame 2");
        expect_eq_str(efree->compile_context, "frame 1");
        expect_eq_str(eb->user_metadata, "run A");
    }
    const cca_trace_entry_t *on0 = last_of(e, n, CCA_TRACE_ALLOC, 0), *on1 = last_of(e, n, CCA_TRACE_ALLOC, 1);
    expect_true(on0 && on1);
    if (on0 && on1) {
        expect_true(on0->compile_context == NULL); /* popped to empty */
        expect_eq_str(on0->user_metadata, "run A");
        expect_eq_str(on1->compile_context, "on device 1");
        expect_true(on1->user_metadata == NULL);
    }
    cca_history_free(e);

    /* the snapshot: compile_context ("N/A" for none) and user_metadata ("" for none) */
    char path[128];
    path_in_tmp(path, sizeof(path), "compile.pickle");
    expect_eq_i64(cca_dump_snapshot(path), CCA_OK);
    pv_doc_t *doc = NULL;
    expect_eq_i64(pickle_load_file(path, &doc), CCA_OK);
    const pv_node_t *traces = doc ? key(pv_doc_root(doc), "device_traces") : NULL;
    bool frame2 = false, na = false, on_dev1 = false;
    for (size_t dv = 0; traces && dv < pv_len(traces); dv++)
        for (size_t i = 0; i < pv_len(pv_at(traces, dv)); i++) {
            const pv_node_t *t = pv_at(pv_at(traces, dv), i);
            int64_t size = 0;
            pv_get_int(key(t, "size"), &size);
            if (size == 3000 && pv_str_eq(key(t, "action"), "alloc"))
                frame2 = pv_str_eq(key(t, "compile_context"), "frame 2") && pv_str_eq(key(t, "user_metadata"), "run A");
            if (size == 4000 && pv_str_eq(key(t, "action"), "alloc"))
                na = pv_str_eq(key(t, "compile_context"), "N/A");
            if (size == 5000 && pv_str_eq(key(t, "action"), "alloc"))
                on_dev1 = dv == 1 && pv_str_eq(key(t, "compile_context"), "on device 1") &&
                          pv_str_eq(key(t, "user_metadata"), "");
        }
    expect_true(frame2);
    expect_true(na);
    expect_true(on_dev1);
    pv_doc_free(doc);

    /* errors */
    expect_eq_i64(cca_push_compile_context(NULL), CCA_ERR_INVALID_ARGUMENT);
    expect_eq_i64(cca_set_user_metadata(NULL), CCA_ERR_INVALID_ARGUMENT);
    expect_eq_i64(cca_get_user_metadata(NULL), CCA_ERR_INVALID_ARGUMENT);

    /* an annotation's, compile context's or metadata's text is not the context function's:
     * the release callback never hears of them (an annotation named like the function's
     * strings would drop another's object) */
    expect_eq_i64(cca_record_annotation("torch:1"), CCA_OK);
    expect_eq_i64(cca_set_user_metadata("torch:2"), CCA_OK);
    expect_eq_i64(cca_set_user_metadata("run B"), CCA_OK);
    cca_free(a);
    cca_free(b);
    cca_free(d0);
    cca_free(d1);
    expect_eq_i64(cca_set_device(1), CCA_OK);
    expect_eq_i64(cca_pop_compile_context(), CCA_OK);
    expect_eq_i64(cca_set_device(0), CCA_OK);
    cca_record_history(false, NULL, NULL, 0, CCA_RECORD_CONTEXT_NEVER);
    expect_eq_i64(releases, 0);
    cca_set_context_release(NULL, NULL);
}

TEST(dump_read_by_python_and_svg)
{
    void *keep[3];
    scripted_state(keep);
    char pk[128], svg[128], svg2[128], cmd[4096];
    path_in_tmp(pk, sizeof(pk), "py.pickle");
    path_in_tmp(svg, sizeof(svg), "live.svg");
    path_in_tmp(svg2, sizeof(svg2), "file.svg");
    expect_eq_i64(cca_dump_snapshot(pk), CCA_OK);
    expect_eq_i64(cca_dump_snapshot_svg(svg), CCA_OK);
    expect_eq_i64(cca_snapshot_file_to_svg(pk, svg2), CCA_OK);
    expect_eq_i64(cca_snapshot_file_to_svg(pk, NULL), CCA_ERR_INVALID_ARGUMENT);
    /* Python's pickle reads it with PyTorch's keys and types; the SVGs parse as XML */
    snprintf(cmd, sizeof(cmd),
             "python3 -c \"\n"
             "import pickle, gzip, xml.etree.ElementTree as ET\n"
             "me = pickle.load(open('%s', 'rb'))\n"
             "ref = pickle.load(gzip.open('%s/tests/data/traces/two_stream_pipeline_default.pickle.gz'))\n"
             "sig = lambda d: {k: type(v) for k, v in d.items()}\n"
             "assert set(ref) - {'cca_meta'} <= set(me), set(me)\n"
             "assert sig(me['segments'][0]) == sig(ref['segments'][0])\n"
             "assert sig(me['segments'][0]['blocks'][0]) == sig(ref['segments'][0]['blocks'][0])\n"
             "assert sig(me['allocator_settings']) == sig(ref['allocator_settings'])\n"
             "e = [x for x in me['device_traces'][0] if x['action'] == 'alloc'][0]\n"
             "assert sig({k: v for k, v in e.items() if k != 'frames'}) == sig(ref['device_traces'][0][1])\n"
             "assert e['frames'][0] == {'filename': 'tag-1', 'line': 0, 'name': ''}, e\n"
             "assert me['segments'][0]['segment_pool_id'] == (0, 0)\n"
             "for p in ('%s', '%s'):\n"
             "    r = ET.parse(p).getroot()\n"
             "    assert r.tag.endswith('svg') and len(list(r.iter())) > 10\n"
             "\"",
             pk, CCA_SOURCE_DIR, svg, svg2);
    int rc = system(cmd);
    expect_eq_i64(rc, 0);
    for (int k = 0; k < 3; k++)
        cca_free(keep[k]);
    cca_record_history(false, NULL, NULL, 0, CCA_RECORD_CONTEXT_NEVER);
}

/* ---- text from the program or a file ---- */

static const char *latin1_context(void *arg)
{
    (void)arg;
    return "/home/jos\xe9/train.py:12"; /* a Latin-1 path: not UTF-8 */
}

/* The segment of a snapshot holding p, or NULL. */
static const cca_segment_info_t *segment_of(const cca_snapshot_t *snap, const void *p)
{
    for (size_t i = 0; snap && i < snap->segment_count; i++) {
        const cca_segment_info_t *seg = &snap->segments[i];
        if ((uintptr_t)p >= seg->address && (uintptr_t)p < seg->address + seg->total_size)
            return seg;
    }
    return NULL;
}

static const char *segment_context_of(const cca_snapshot_t *snap, const void *p)
{
    const cca_segment_info_t *seg = segment_of(snap, p);
    return seg && seg->context ? seg->context : "";
}

/*
 * A segment carries the context of the allocation that created it (PyTorch's
 * context_when_segment_allocated: the segment's `frames` in snapshots), at level
 * STATE and up, as PyTorch keeps it: on the segment's first block struct. A split
 * at the segment's head makes a new head block, which has none (the context
 * stays with the rest, and merges keep the head's), so the segment shows no
 * frames from then on: a small request's new segment never does, a request that
 * takes its segment whole does until its head is split. For an expandable
 * segment, the allocation that mapped its start; its growth keeps that.
 */
TEST(segment_context)
{
    setup(0);
    context_calls = 0;
    expect_eq_i64(cca_record_history(true, context_fn, "seg", 100, CCA_RECORD_CONTEXT_STATE), CCA_OK);
    void *g = xmalloc_dev(12 * MiB, 0, S1); /* takes its 12 MiB segment whole: seg-1 */
    void *a = xmalloc_dev(1000, 0, S1);     /* splits a new small segment: seg-2 */
    void *b = xmalloc_dev(1000, 0, S1);     /* in the same segment: seg-3 */
    cca_snapshot_t *snap = take();
    expect_eq_str(segment_context_of(snap, g), "seg-1\nframe two");
    expect_eq_str(segment_context_of(snap, a), "");
    expect_true(segment_of(snap, a) == segment_of(snap, b));
    cca_snapshot_free(snap);
    /* the pickle: the segment's frames, one per line, on the whole one only */
    char path[128];
    path_in_tmp(path, sizeof(path), "segment_frames.pickle");
    expect_eq_i64(cca_dump_snapshot(path), CCA_OK);
    pv_doc_t *doc = NULL;
    expect_eq_i64(pickle_load_file(path, &doc), CCA_OK);
    const pv_node_t *root = doc ? pv_doc_root(doc) : NULL;
    const pv_node_t *segs = root ? key(root, "segments") : NULL;
    size_t with_frames = 0, frames_seg1 = 0;
    for (size_t i = 0; segs && i < pv_len(segs); i++) {
        const pv_node_t *frames = key(pv_at(segs, i), "frames");
        if (frames && pv_len(frames) > 0)
            with_frames++;
        if (frames && pv_len(frames) == 2 && pv_str_eq(pv_dict_get(pv_at(frames, 0), "filename"), "seg-1") &&
            pv_str_eq(pv_dict_get(pv_at(frames, 1), "filename"), "frame two"))
            frames_seg1++;
    }
    expect_eq_u64(with_frames, 1);
    expect_eq_u64(frames_seg1, 1);
    pv_doc_free(doc);
    /* a split at the whole segment's head: its frames go, and stay gone once merged back */
    cca_free(g);
    void *h = xmalloc_dev(4 * MiB, 0, S1); /* from g's free block, at its start: seg-4 */
    expect_true(h == g);
    snap = take();
    expect_eq_str(segment_context_of(snap, h), "");
    cca_snapshot_free(snap);
    cca_free(h);
    snap = take();
    expect_true(segment_of(snap, g) != NULL);
    expect_eq_str(segment_context_of(snap, g), "");
    cca_snapshot_free(snap);
    cca_free(a);
    cca_free(b);
    expect_eq_i64(cca_empty_cache(), CCA_OK);
    /* the segment goes: a new one takes the context of its own creation */
    void *c = xmalloc_dev(12 * MiB, 0, S1); /* seg-5 */
    snap = take();
    expect_eq_str(segment_context_of(snap, c), "seg-5\nframe two");
    cca_snapshot_free(snap);
    cca_free(c);
    expect_eq_i64(cca_empty_cache(), CCA_OK);
    /* an expandable segment: the allocation that mapped its start (taking what it mapped
     * whole); a growth keeps that context */
    expect_eq_i64(cca_set_settings("expandable_segments:True"), CCA_OK);
    void *d = xmalloc_dev(40 * MiB, 0, S1); /* maps the segment's start: seg-6 */
    void *e = xmalloc_dev(30 * MiB, 0, S1); /* grows it: seg-7 */
    snap = take();
    expect_true(segment_of(snap, d) && segment_of(snap, d)->is_expandable);
    expect_true(segment_of(snap, d) == segment_of(snap, e));
    expect_eq_str(segment_context_of(snap, d), "seg-6\nframe two");
    cca_snapshot_free(snap);
    cca_free(d);
    cca_free(e);
    expect_eq_i64(cca_empty_cache(), CCA_OK);
    /* below STATE: none */
    expect_eq_i64(cca_record_history(true, NULL, NULL, 100, CCA_RECORD_CONTEXT_NEVER), CCA_OK);
    void *f = xmalloc_dev(12 * MiB, 0, S1);
    snap = take();
    expect_true(segment_of(snap, f) && segment_of(snap, f)->context == NULL);
    cca_snapshot_free(snap);
    cca_free(f);
    expect_eq_i64(cca_empty_cache(), CCA_OK);
    cca_record_history(false, NULL, NULL, 0, CCA_RECORD_CONTEXT_NEVER);
}

/*
 * A context or annotation that is not UTF-8 (a Latin-1 path) is written with
 * each bad byte as U+FFFD, as Python decodes with errors="replace"; before,
 * every dump failed for as long as the entry stayed in the ring.
 */
TEST(dump_of_text_that_is_not_utf8)
{
    setup(0);
    expect_eq_i64(cca_record_history(true, latin1_context, NULL, 100, CCA_RECORD_CONTEXT_STATE),
                  CCA_OK);
    void *a = xmalloc_dev(1000, 0, S1);
    expect_eq_i64(cca_record_annotation("\xff phase"), CCA_OK);
    char path[128];
    path_in_tmp(path, sizeof(path), "latin1.pickle");
    expect_eq_i64(cca_dump_snapshot(path), CCA_OK);
    pv_doc_t *doc = NULL;
    expect_eq_i64(pickle_load_file(path, &doc), CCA_OK);
    const pv_node_t *root = doc ? pv_doc_root(doc) : NULL;
    const pv_node_t *segs = root ? key(root, "segments") : NULL;
    bool found = false; /* the live block's frames (the context at its allocation) */
    for (size_t i = 0; segs && i < pv_len(segs); i++) {
        const pv_node_t *blocks = key(pv_at(segs, i), "blocks");
        for (size_t j = 0; j < pv_len(blocks); j++) {
            const pv_node_t *frames = pv_dict_get(pv_at(blocks, j), "frames");
            if (frames && pv_len(frames))
                found |= pv_str_eq(pv_dict_get(pv_at(frames, 0), "filename"),
                                   "/home/jos\xef\xbf\xbd/train.py:12");
        }
    }
    expect_true(found);
    const pv_node_t *ann = root ? key(root, "external_annotations") : NULL;
    expect_true(ann && pv_len(ann) >= 1 &&
                pv_str_eq(pv_dict_get(pv_at(ann, 0), "name"), "\xef\xbf\xbd phase"));
    pv_doc_free(doc);
    path_in_tmp(path, sizeof(path), "latin1.json");
    expect_eq_i64(cca_dump_snapshot_json(path), CCA_OK);
    cca_free(a);
    cca_record_history(false, NULL, NULL, 0, CCA_RECORD_CONTEXT_NEVER);
}

/*
 * A snapshot that runs out of host memory copying a live block's context
 * fails with CCA_ERR_OUT_OF_MEMORY and keeps nothing (the copies made so far
 * go too); the next one has every context. Before, the block was reported
 * with no context (a dump with its frames empty) and the call succeeded.
 */
TEST(snapshot_out_of_memory_for_a_context)
{
    setup(0);
    context_calls = 0;
    expect_eq_i64(cca_record_history(true, context_fn, "ctx", 100, CCA_RECORD_CONTEXT_STATE),
                  CCA_OK);
    void *a = xmalloc_dev(1000, 0, S1), *b = xmalloc_dev(3000, 0, S1); /* one segment */
    for (long n = 1; n <= 2; n++) {
        cca_snapshot_t *s = NULL;
        trace_test_fail_copies(n);
        expect_eq_i64(cca_snapshot(&s), CCA_ERR_OUT_OF_MEMORY);
        trace_test_fail_copies(0);
        expect_contains(cca_last_error()->message, "out of host memory");
        expect_true(s == NULL);
    }
    cca_snapshot_t *s = take();
    expect_eq_u64(s->segment_count, 1);
    expect_true(s->segments[0].block_count >= 2);
    expect_eq_str(s->segments[0].blocks[0].context ? s->segments[0].blocks[0].context : "",
                  "ctx-1\nframe two");
    expect_eq_str(s->segments[0].blocks[1].context ? s->segments[0].blocks[1].context : "",
                  "ctx-2\nframe two");
    cca_snapshot_free(s);
    cca_free(a);
    cca_free(b);
    cca_record_history(false, NULL, NULL, 0, CCA_RECORD_CONTEXT_NEVER);
}

/* A snapshot file's segment type goes into the SVG escaped (it was written as it came). */
TEST(svg_escapes_a_files_segment_type)
{
    pv_doc_t *doc = pv_doc_new();
    pv_node_t *root = pv_new_dict(doc), *segs = pv_new_list(doc), *seg = pv_new_dict(doc);
    pv_node_t *blocks = pv_new_list(doc), *b = pv_new_dict(doc), *traces = pv_new_list(doc);
    pv_dict_set(doc, b, "size", pv_new_int(doc, 100));
    pv_dict_set(doc, b, "requested_size", pv_new_int(doc, 0));
    pv_dict_set(doc, b, "state", pv_new_str(doc, "inactive"));
    pv_list_append(doc, blocks, b);
    pv_dict_set(doc, seg, "device", pv_new_int(doc, 0));
    pv_dict_set(doc, seg, "address", pv_new_int(doc, 4096));
    pv_dict_set(doc, seg, "total_size", pv_new_int(doc, 100));
    pv_dict_set(doc, seg, "active_size", pv_new_int(doc, 0));
    pv_dict_set(doc, seg, "segment_type", pv_new_str(doc, "a<b&c"));
    pv_dict_set(doc, seg, "blocks", blocks);
    pv_list_append(doc, segs, seg);
    pv_list_append(doc, traces, pv_new_list(doc));
    pv_dict_set(doc, root, "segments", segs);
    pv_dict_set(doc, root, "device_traces", traces);
    pv_doc_set_root(doc, root);
    char in[128], out[128];
    path_in_tmp(in, sizeof(in), "crafted.pickle");
    path_in_tmp(out, sizeof(out), "crafted.svg");
    expect_eq_i64(pickle_write_file(root, in), CCA_OK);
    pv_doc_free(doc);
    expect_eq_i64(cca_snapshot_file_to_svg(in, out), CCA_OK);
    FILE *f = fopen(out, "r");
    static char text[1 << 16];
    size_t n = f ? fread(text, 1, sizeof(text) - 1, f) : 0;
    if (f)
        fclose(f);
    text[n] = 0;
    expect_true(strstr(text, "a&lt;b&amp;c") != NULL);
    expect_true(strstr(text, "a<b&c") == NULL);
}

int main(void)
{
    snprintf(tmpdir, sizeof(tmpdir), "/tmp/cca_test_snapshot_XXXXXX");
    if (!mkdtemp(tmpdir)) {
        printf("cannot create a temporary directory\n");
        return 1;
    }
    RUN(snapshot_split_blocks);
    RUN(snapshot_pending_free);
    RUN(snapshot_streams_and_devices_sorted);
    RUN(history_order_and_fields);
    RUN(history_ring_wraps);
    RUN(history_huge_bound_grows);
    RUN(context_levels);
    RUN(trackers_observers_annotations);
    RUN(snapshot_consistent_under_concurrency);
    RUN(dump_pickle_read_back_by_cca);
    RUN(annotation_fields);
    RUN(compile_contexts_and_user_metadata);
    RUN(dump_read_by_python_and_svg);
    RUN(dump_of_text_that_is_not_utf8);
    RUN(segment_context);
    RUN(snapshot_out_of_memory_for_a_context);
    RUN(svg_escapes_a_files_segment_type);
    cca_shutdown();
    char cmd[160];
    snprintf(cmd, sizeof(cmd), "rm -rf '%s'", tmpdir);
    if (system(cmd) != 0)
        printf("could not remove %s\n", tmpdir);
    return harness_done();
}
