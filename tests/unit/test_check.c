/*
 * test_check.c - the invariant checker: it accepts every state the allocator
 * reaches, and it reports each kind of corruption (introduced by hand, then
 * undone); empty_cache leaves no backend event behind.
 */
#include <stdint.h>
#include <stdlib.h>

#include "check.h"
#include "runtime.h"
#include "device.h"
#include "harness.h"

#define MiB ((size_t)1 << 20)
#define S1 ((cca_stream_t)(uintptr_t)0x1000)

static cca_backend_t *sim;

static void setup(bool manual_events)
{
    cca_sim_config_t cfg = {0};
    cfg.devices = 2;
    cfg.total_memory = 1ull << 30;
    cfg.manual_events = manual_events;
    cca_shutdown();
    if (cca_sim_create(&cfg, &sim) != CCA_OK || cca_init_with_backend(sim, "") != CCA_OK) {
        printf("cannot set up: %s\n", cca_last_error()->message);
        exit(1);
    }
}

static char why[512];
#define expect_valid() expect_ok(alloc_check_invariants(why, sizeof(why)))
#define expect_invalid(needle)                                               \
    do {                                                                     \
        expect_status(alloc_check_invariants(why, sizeof(why)), CCA_ERR_INTERNAL); \
        expect_contains(why, needle);                                        \
        expect_contains(cca_last_error()->message, needle);                  \
    } while (0)

TEST(valid_states)
{
    expect_valid(); /* before init */
    setup(true);
    expect_valid();
    void *a, *b, *c, *d;
    expect_ok(cca_malloc(&a, 1000, NULL));
    expect_ok(cca_malloc(&b, 3000, NULL));
    expect_ok(cca_malloc(&c, 5 * MiB, S1));
    expect_ok(cca_malloc_device(&d, 700, 1, NULL));
    expect_valid();
    expect_ok(cca_record_stream(a, S1));
    expect_ok(cca_free(a));
    expect_valid(); /* a waits for its event */
    expect_ok(cca_free(b));
    expect_ok(cca_free(c));
    expect_valid();
    expect_ok(cca_sim_complete_stream(sim, 0, NULL, true));
    expect_ok(alloc_process_events());
    expect_valid();
    expect_ok(cca_free(d));
    expect_ok(cca_empty_cache());
    expect_valid();
    cca_shutdown();
}

/* Each corruption is found, with a message naming it. */
TEST(detects_corruption)
{
    setup(true);
    void *a, *b;
    expect_ok(cca_malloc(&a, 1000, NULL));
    expect_ok(cca_malloc(&b, 2000, NULL));
    expect_ok(cca_free(a));
    cca_device_t *dev = &cca_state->devices[0];
    cca_segment_t *seg = dev->segments;
    cca_block_t *first = seg->head; /* free (a), then b allocated, then the free rest */

    /* exact statistics: the per-operation current values live in the device's ops table */
    dev->ops->cur[CCA_STAT_SMALL_POOL][OPS_ALLOCATED_BYTES] += 512;
    expect_invalid("allocated_bytes.all"); /* the sum of the kinds, checked first */
    dev->ops->cur[CCA_STAT_SMALL_POOL][OPS_ALLOCATED_BYTES] -= 512;

    /* (while one thread allocates, the ALL entries are the kinds' sums) */
    dev->ops->cur[CCA_STAT_LARGE_POOL][OPS_INACTIVE_SPLIT]++;
    expect_invalid("inactive_split.all");
    dev->ops->cur[CCA_STAT_LARGE_POOL][OPS_INACTIVE_SPLIT]--;

    dev->ops->cur[CCA_STAT_SMALL_POOL][OPS_REQUESTED_BYTES]++;
    expect_invalid("requested_bytes.all");
    dev->ops->cur[CCA_STAT_SMALL_POOL][OPS_REQUESTED_BYTES]--;

    first->size += 512;
    expect_invalid("should start at");
    first->size -= 512;

    cca_block_t *mid = first->next;
    mid->allocated = false;
    expect_invalid("exactly one");
    mid->allocated = true;

    /* an allocated block missing from the map */
    expect_true(ptrmap_find(cca_state->ptrmap, mid->addr, true) == mid);
    expect_invalid("pointer map");
    expect_true(ptrmap_insert(cca_state->ptrmap, mid));

    /* a free block taken out of its bin */
    bins_remove(&first->pool->bins, first);
    first->in_bin = true;
    expect_invalid("must be in exactly one");
    bins_insert(&first->pool->bins, first);

    /* two free neighbours: mark the allocated middle free (in its bin) */
    expect_true(ptrmap_find(cca_state->ptrmap, mid->addr, true) == mid);
    mid->allocated = false;
    bins_insert(&mid->pool->bins, mid);
    expect_invalid("not merged");
    bins_remove(&mid->pool->bins, mid);
    mid->allocated = true;
    expect_true(ptrmap_insert(cca_state->ptrmap, mid));

    dev->segment_count++;
    expect_invalid("segment_count");
    dev->segment_count--;

    dev->total_allocated_memory += 512;
    expect_invalid("total_allocated_memory");
    dev->total_allocated_memory -= 512;

    expect_valid();
    expect_ok(cca_free(b));
    cca_shutdown();
}

/* empty_cache gives back pooled record_stream events too (they used to stay live). */
TEST(empty_cache_releases_events)
{
    setup(false);
    void *a;
    expect_ok(cca_malloc(&a, 4096, NULL));
    expect_ok(cca_record_stream(a, S1));
    expect_ok(cca_free(a));
    expect_ok(alloc_process_events());
    expect_ok(cca_empty_cache());
    cca_sim_usage_t u;
    expect_ok(cca_sim_usage(sim, &u));
    expect_eq_u64(u.live_events, 0);
    expect_eq_u64(u.live_allocations, 0);
    expect_valid();
    cca_shutdown();
}

/* Oversize statistics stay right when max_split_size changes at run time
 * (they used to be decremented by the new threshold and go negative). */
TEST(oversize_stats_across_settings_change)
{
    setup(false);
    void *a, *b;
    cca_device_stats_t s;
    expect_ok(cca_malloc(&a, 30 * MiB, NULL));      /* not oversize: no limit */
    expect_ok(cca_set_settings("max_split_size_mb:20"));
    expect_ok(cca_malloc(&b, 25 * MiB, S1));        /* oversize now */
    expect_ok(cca_get_device_stats(0, &s));
    expect_eq_i64(s.oversize_allocations.current, 1);
    expect_eq_i64(s.oversize_segments.current, 1);
    expect_ok(cca_free(a));
    expect_valid();
    expect_ok(cca_set_settings("max_split_size_mb:200"));
    expect_ok(cca_free(b));
    expect_ok(cca_get_device_stats(0, &s));
    expect_eq_i64(s.oversize_allocations.current, 0);
    expect_valid();
    expect_ok(cca_empty_cache());
    expect_ok(cca_get_device_stats(0, &s));
    expect_eq_i64(s.oversize_segments.current, 0);
    expect_valid();
    cca_shutdown();
}

int main(void)
{
    RUN(valid_states);
    RUN(detects_corruption);
    RUN(empty_cache_releases_events);
    RUN(oversize_stats_across_settings_change);
    return harness_done();
}
