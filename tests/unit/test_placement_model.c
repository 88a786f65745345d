/*
 * test_placement_model.c - cca's default placement against a second, minimal
 * implementation of PyTorch's rules (tests/placement_model.h: best fit,
 * splits and merges on one stream, nothing else), driven in lockstep on the
 * anchor benchmark's random workloads (bench/anchor_rng.h): every allocation
 * must land in the same segment (counted in the order the segments were
 * made) at the same offset, and both must have made the same segments; by
 * default, under max_split_size (and max_non_split_rounding) and under
 * roundup_power2_divisions, on one stream and on four, with blocks used on
 * another stream (record_stream) coming back once its events complete. The bundled traces check the placement against
 * PyTorch's recorded addresses; this checks it on sizes and orders no trace
 * has, over many steps.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../../bench/anchor_rng.h"
#include "cca.h"
#include "device.h"
#include "harness.h"
#include "settings.h"
#include "placement_model.h"

#define MiB ((size_t)1 << 20)
#define MAX_SLOTS 512

static cca_backend_t *sim;

static bool setup(const char *settings, bool manual_events)
{
    cca_sim_config_t cfg = {0};
    cfg.devices = 1;
    cfg.manual_events = manual_events;
    cfg.total_memory = 64ull << 30;
    cca_shutdown();
    if (cca_sim_create(&cfg, &sim) != CCA_OK || cca_init_with_backend(sim, settings) != CCA_OK) {
        HARNESS_FAIL("cannot bring cca up: %s", cca_last_error()->message);
        return false;
    }
    return true;
}

/* cca's segments, by base address, in the order they were first seen (= made: a segment is
 * made for the allocation that first lands in it). */
typedef struct seen_segments {
    uintptr_t base[MODEL_MAX_SEGMENTS];
    size_t count;
} seen_segments_t;

/* Segments released (marked by the model): their bases no longer name them, a new segment
 * at one of those addresses is a new segment. */
static void forget_released(seen_segments_t *seen, const bool released[MODEL_MAX_SEGMENTS])
{
    for (size_t i = 0; i < seen->count; i++)
        if (released[i])
            seen->base[i] = 0;
}

static bool segment_known(const seen_segments_t *seen, uintptr_t base)
{
    for (size_t i = 0; i < seen->count; i++)
        if (seen->base[i] == base)
            return true;
    return false;
}

static size_t segment_ordinal(seen_segments_t *seen, uintptr_t base)
{
    for (size_t i = 0; i < seen->count; i++)
        if (seen->base[i] == base)
            return i;
    if (seen->count == MODEL_MAX_SEGMENTS)
        return SIZE_MAX;
    seen->base[seen->count] = base;
    return seen->count++;
}

#define USE_STREAM ((cca_stream_t)(uintptr_t)0x9000)

/*
 * steps steps of the random workload (slots slots, sizes log-uniform in [512 B, max_size],
 * seed) through cca under settings and the model at once (the model given cca's
 * max_split_size and roundup_power2_divisions as cca parsed them; its small blocks split
 * where small_split_min bytes remain: PyTorch's rule at 512), each request on one of streams
 * streams drawn at random; with uses, a quarter of the blocks also used on a stream of their
 * own (cca_record_stream; the simulated device's events complete when the test says, at
 * about one step in sixteen): such a block, freed, comes back once that stream's work
 * recorded before is done, at the next allocation (both look then); with empties,
 * cca_empty_cache at about one step in 2,000 (every freed block back, every free whole
 * segment given back). The model's segments are placed at the addresses of cca's (best
 * fit's ties go by address, and the device may hand a released segment's addresses out
 * again). The number of allocations whose segment or offset differed (the first few
 * printed).
 */
static long lockstep_full(const char *settings, int slots, long steps, size_t max_size, unsigned seed,
                          size_t small_split_min, unsigned streams, bool uses, bool empties)
{
    if (!setup(settings, uses))
        return -1;
    model_t *m = malloc(sizeof(*m));
    seen_segments_t *seen = calloc(1, sizeof(*seen));
    if (!m || !seen || !model_init(m)) {
        HARNESS_FAIL("out of host memory");
        free(m);
        free(seen);
        return -1;
    }
    m->small_split_min = small_split_min;
    const cca_settings_t *cs = &cca_state->settings;
    m->max_split = cs->max_split_size;
    m->max_non_split_rounding = cs->max_non_split_rounding;
    for (int i = 0; i < 16; i++)
        m->divisions[i] = cs->roundup_power2_divisions[i];
    void *live[MAX_SLOTS] = {0};
    cca_block_t *blocks[MAX_SLOTS] = {0};
    bool used[MAX_SLOTS] = {0};
    cca_block_t *pending = NULL, *ready = NULL; /* the model's blocks freed while used (bin_next) */
    long differ = 0, allocs = 0, deferred = 0, emptied = 0;
    static bool released[MODEL_MAX_SEGMENTS];
    mt64_t rng;
    mt64_seed(&rng, seed);
    const mt64_log_sizes_t sizes = mt64_log_sizes(max_size);
    for (long i = 0; i < steps && !m->failed; i++) {
        if (uses && mt64_pick(&rng, 16) == 0) { /* the use stream's work so far done */
            expect_ok(cca_sim_complete_stream(sim, 0, USE_STREAM, false));
            while (pending) {
                cca_block_t *b = pending;
                pending = b->bin_next;
                b->bin_next = ready;
                ready = b;
            }
        }
        if (empties && mt64_pick(&rng, 2000) == 0) { /* all events waited for, then released */
            expect_ok(cca_empty_cache());
            for (cca_block_t **list = &pending; list; list = list == &pending ? &ready : NULL)
                while (*list) {
                    cca_block_t *b = *list;
                    *list = b->bin_next;
                    b->bin_next = NULL;
                    model_free(m, b->addr, b);
                }
            memset(released, 0, sizeof(released));
            model_empty_cache(m, released);
            forget_released(seen, released);
            emptied++;
        }
        int k = mt64_pick(&rng, (uint64_t)slots);
        if (live[k]) {
            expect_ok(cca_free(live[k]));
            if (used[k]) { /* back once the use stream is done */
                blocks[k]->bin_next = pending;
                pending = blocks[k];
                deferred++;
            } else {
                model_free(m, blocks[k]->addr, blocks[k]);
            }
            live[k] = NULL;
            continue;
        }
        size_t size = mt64_log_size(&rng, &sizes);
        unsigned stream = streams > 1 ? (unsigned)mt64_pick(&rng, streams) : 0;
        cca_stream_t s = (cca_stream_t)(uintptr_t)(0x1000 * (stream + 1));
        while (ready) { /* both look at the events at an allocation */
            cca_block_t *b = ready;
            ready = b->bin_next;
            b->bin_next = NULL;
            model_free(m, b->addr, b);
        }
        void *base = NULL;
        size_t seg_size = 0;
        if (cca_malloc(&live[k], size, s) != CCA_OK) {
            HARNESS_FAIL("step %ld: cca_malloc(%zu): %s", i, size, cca_last_error()->message);
            break;
        }
        expect_ok(cca_get_base_allocation(live[k], &base, &seg_size));
        bool new_segment = !segment_known(seen, (uintptr_t)base);
        if (new_segment) /* a segment of cca's, new: the model's new one (if any) goes there too */
            m->offered_base = (uintptr_t)base;
        if (!(blocks[k] = model_malloc(m, size, stream))) {
            HARNESS_FAIL("step %ld: the model ran out of host memory or segment ids", i);
            break;
        }
        m->offered_base = 0;
        used[k] = uses && mt64_pick(&rng, 4) == 0;
        if (used[k])
            expect_ok(cca_record_stream(live[k], USE_STREAM));
        allocs++;
        size_t ordinal = segment_ordinal(seen, (uintptr_t)base);
        size_t offset = (uintptr_t)live[k] - (uintptr_t)base;
        size_t model_ordinal = model_segment(blocks[k]);
        size_t model_offset = blocks[k]->addr - m->seg_base[model_ordinal];
        if (ordinal != model_ordinal || offset != model_offset) {
            if (differ++ < 5)
                printf("  step %ld, %zu bytes: cca segment %zu offset %zu, the model segment %zu offset %zu\n",
                       i, size, ordinal, offset, model_ordinal, model_offset);
        }
    }
    cca_device_stats_t ds;
    expect_ok(cca_get_device_stats(0, &ds));
    if (!differ) { /* the same placement makes the same segments, releases the same ones */
        expect_eq_u64((uint64_t)ds.num_device_alloc, m->segments);
        expect_eq_u64((uint64_t)ds.reserved_bytes[CCA_STAT_ALL].current, m->reserved);
    }
    expect_true(allocs > steps / 3); /* the workload allocated as much as it freed */
    if (uses)
        expect_true(deferred > 0);
    if (empties)
        expect_true(emptied > 0);
    printf("  '%s', %d slots, %u stream(s)%s, sizes to %zu MiB, seed %u: %ld allocations (%ld frees "
           "deferred, %ld empty_cache), %zu segments made (%zu MiB held), %ld differ\n", settings, slots,
           streams, uses ? ", record_stream" : "", max_size / MiB, seed, allocs, deferred, emptied,
           m->segments, m->reserved / MiB, differ);
    for (int k = 0; k < slots; k++)
        if (live[k]) {
            expect_ok(cca_free(live[k]));
            model_free(m, blocks[k]->addr, blocks[k]);
        }
    for (cca_block_t **list = &pending; list; list = list == &pending ? &ready : NULL)
        while (*list) {
            cca_block_t *b = *list;
            *list = b->bin_next;
            b->bin_next = NULL;
            model_free(m, b->addr, b);
        }
    model_destroy(m);
    free(m);
    free(seen);
    cca_shutdown();
    return differ;
}

/* lockstep_full on one stream, with no other use. */
static long lockstep(const char *settings, int slots, long steps, size_t max_size, unsigned seed,
                     size_t small_split_min)
{
    return lockstep_full(settings, slots, steps, max_size, seed, small_split_min, 1, false, false);
}

/* The anchor's random_1thread workload, and two other seeds. */
TEST(random_workload_lands_where_the_model_puts_it)
{
    const unsigned seeds[] = {42, 7, 1234};
    for (size_t i = 0; i < sizeof(seeds) / sizeof(seeds[0]); i++)
        expect_eq_i64(lockstep("", 512, 100000, 8 * MiB, seeds[i], 512), 0);
}

/* The shape of the threaded workload's per-thread loop: 64 slots, sizes up to 4 MiB. */
TEST(threaded_workloads_shape_lands_where_the_model_puts_it)
{
    expect_eq_i64(lockstep("", 64, 100000, 4 * MiB, 42, 512), 0);
}

/* Larger requests: oversize segments (rounded to 2 MiB past 10 MiB) and their splits. */
TEST(large_requests_land_where_the_model_puts_them)
{
    expect_eq_i64(lockstep("", 128, 50000, 96 * MiB, 3, 512), 0);
}

/* max_split_size: oversize blocks never split, refused to smaller requests and to larger
 * ones they exceed by max_non_split_rounding (20 MiB by default, 40 in the second run). */
TEST(max_split_size_lands_where_the_model_puts_it)
{
    expect_eq_i64(lockstep("max_split_size_mb:32", 128, 50000, 96 * MiB, 3, 512), 0);
    expect_eq_i64(lockstep("max_split_size_mb:64,max_non_split_rounding_mb:40", 128, 50000, 96 * MiB, 5, 512), 0);
}

/* roundup_power2_divisions: one count for every size, and one per interval. */
TEST(roundup_power2_divisions_land_where_the_model_puts_them)
{
    expect_eq_i64(lockstep("roundup_power2_divisions:4", 512, 100000, 8 * MiB, 42, 512), 0);
    expect_eq_i64(lockstep("roundup_power2_divisions:[1:2,4:4,16:8,>:16],max_split_size_mb:48", 128, 50000,
                           96 * MiB, 9, 512),
                  0);
}

/* Each request on one of four streams drawn at random: each stream's pools are its own (a
 * block freed on one stream is never handed to another). */
TEST(four_streams_land_where_the_model_puts_them)
{
    expect_eq_i64(lockstep_full("", 512, 100000, 8 * MiB, 11, 512, 4, false, false), 0);
    expect_eq_i64(lockstep_full("max_split_size_mb:32", 128, 50000, 96 * MiB, 12, 512, 4, false, false), 0);
}

/* record_stream: a quarter of the blocks used on another stream, their frees deferred until
 * its events complete; on one stream and on four. */
TEST(record_stream_lands_where_the_model_puts_it)
{
    expect_eq_i64(lockstep_full("", 512, 100000, 8 * MiB, 21, 512, 1, true, false), 0);
    expect_eq_i64(lockstep_full("max_split_size_mb:32", 128, 50000, 96 * MiB, 22, 512, 4, true, false), 0);
}

/* empty_cache now and then: free whole segments given back, new ones made later (at
 * addresses the device may hand out again); with record_stream's deferred frees too. */
TEST(empty_cache_lands_where_the_model_puts_it)
{
    expect_eq_i64(lockstep_full("", 512, 100000, 8 * MiB, 31, 512, 1, false, true), 0);
    expect_eq_i64(lockstep_full("max_split_size_mb:32", 128, 50000, 96 * MiB, 32, 512, 4, true, true), 0);
}

/* The check can fail: a model whose small blocks split only where 1 MiB or more remains
 * (not PyTorch's rule) differs from cca within a few thousand steps. */
TEST(a_changed_rule_differs)
{
    long differ = lockstep("", 512, 20000, 8 * MiB, 42, MiB);
    expect_true(differ > 0);
}

int main(void)
{
    RUN(random_workload_lands_where_the_model_puts_it);
    RUN(threaded_workloads_shape_lands_where_the_model_puts_it);
    RUN(large_requests_land_where_the_model_puts_them);
    RUN(max_split_size_lands_where_the_model_puts_it);
    RUN(roundup_power2_divisions_land_where_the_model_puts_them);
    RUN(four_streams_land_where_the_model_puts_them);
    RUN(record_stream_lands_where_the_model_puts_it);
    RUN(empty_cache_lands_where_the_model_puts_it);
    RUN(a_changed_rule_differs);
    return harness_done();
}
