/*
 * test_placement_model.c - cca's placement against a second implementation
 * of PyTorch's rules (tests/placement_model.h), driven in lockstep on the
 * anchor benchmark's random workloads (bench/anchor_rng.h): every allocation
 * must land in the same segment (counted in the order the segments were
 * made) at the same offset, or run out of memory on both sides, and at the
 * end both must have made and kept the same segments (with expandable
 * segments: mapped and unmapped the same ranges), with the same retries and
 * out-of-memory counts. Runs: default settings, under max_split_size (and
 * max_non_split_rounding) and roundup_power2_divisions, on one stream and on
 * four, with blocks used on another stream (record_stream) coming back once
 * its events complete, with empty_cache now and then, on devices too small
 * for the workload (the out-of-memory sequence), under a memory fraction
 * with garbage_collection_threshold, and with expandable segments. The
 * bundled traces check the placement against PyTorch's recorded addresses;
 * this checks it on sizes and orders no trace has, over many steps;
 * fuzz_placement drives the same comparison from fuzzer input.
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
#include "ptrmap.h"
#include "placement_model.h"

#define MiB ((size_t)1 << 20)
#define MAX_SLOTS 512

static cca_backend_t *sim;

/* One lockstep run: the workload, cca's settings, and what happens beside the requests. */
typedef struct run {
    const char *settings;
    int slots;
    long steps;
    size_t max_size;         /* sizes log-uniform in [512 B, max_size] */
    unsigned seed;
    unsigned streams;        /* each request on one of them, drawn (0 or 1: one) */
    bool uses;               /* a quarter of the blocks used on another stream (record_stream) */
    bool empties;            /* cca_empty_cache at about one step in 2,000 */
    size_t cap;              /* the device's memory, 0: 64 GiB (no out of memory) */
    size_t small_split_min;  /* the model's small split rule, 0: PyTorch's (512) */
    double fraction;         /* cca_set_memory_fraction (with garbage_collection_threshold in
                                settings: the collection by age), 0: none */
} run_t;

/* Expandable segments: the addresses the simulated device hands reservations out at, in turn;
 * the model takes them in the same turn, so the same reservation is at the same address. */
static uint64_t reservation_addresses[MODEL_MAX_SEGMENTS];

static bool setup(const run_t *r)
{
    cca_sim_config_t cfg = {0};
    cfg.devices = 1;
    cfg.manual_events = r->uses;
    cfg.total_memory = r->cap ? r->cap : 64ull << 30;
    if (strstr(r->settings, "expandable_segments:True")) {
        model_reservation_addresses(reservation_addresses, MODEL_MAX_SEGMENTS, cfg.total_memory);
        cfg.addresses = reservation_addresses;
        cfg.address_count = MODEL_MAX_SEGMENTS;
    }
    cca_shutdown();
    if (cca_sim_create(&cfg, &sim) != CCA_OK || cca_init_with_backend(sim, r->settings) != CCA_OK) {
        HARNESS_FAIL("cannot bring cca up: %s", cca_last_error()->message);
        return false;
    }
    if (r->fraction > 0.0 && cca_set_memory_fraction(r->fraction, 0) != CCA_OK) {
        HARNESS_FAIL("cannot set the memory fraction: %s", cca_last_error()->message);
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

/* Segments the model gave back: their bases no longer name them (the device may hand the
 * addresses out again, to a new segment). */
static void forget_released(seen_segments_t *seen, model_t *m)
{
    if (!m->any_released)
        return;
    for (size_t i = 0; i < seen->count; i++)
        if (m->released[i])
            seen->base[i] = 0;
    memset(m->released, 0, sizeof(m->released));
    m->any_released = false;
}

/* Segments cca has made so far. */
static int64_t device_allocs(void)
{
    cca_device_stats_t ds;
    return cca_get_device_stats(0, &ds) == CCA_OK ? ds.num_device_alloc : -1;
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
 * r->steps steps of the random workload through cca and the model at once (the model given
 * cca's max_split_size and roundup_power2_divisions as cca parsed them, and the device's
 * memory as its cap; the model's segments placed at the addresses of cca's, as best fit's
 * ties go by address and the device may hand a released segment's addresses out again).
 * With uses, a used block's free waits for the use stream's events, which the test
 * completes at about one step in sixteen; both look at them at the next allocation. An
 * allocation that runs out of memory must do so on both sides. The number of allocations
 * whose segment or offset differed, or whose outcome did (the first few printed).
 */
static long lockstep_run(const run_t *r)
{
    if (!setup(r))
        return -1;
    model_t *m = malloc(sizeof(*m));
    seen_segments_t *seen = calloc(1, sizeof(*seen));
    if (!m || !seen || !model_init(m)) {
        HARNESS_FAIL("out of host memory");
        free(m);
        free(seen);
        return -1;
    }
    if (r->small_split_min)
        m->small_split_min = r->small_split_min;
    const cca_settings_t *cs = cca_state->settings;
    m->max_split = cs->max_split_size;
    m->max_non_split_rounding = cs->max_non_split_rounding;
    for (int i = 0; i < 16; i++)
        m->divisions[i] = cs->roundup_power2_divisions[i];
    m->cap = r->cap;
    m->expandable = cs->expandable_segments;
    if (m->expandable) {
        m->address_list = reservation_addresses;
        m->address_count = MODEL_MAX_SEGMENTS;
    }
    m->total_memory = cca_state->devices[0].total_memory;
    if (r->fraction > 0.0) { /* the fraction's allowed bytes as cca computed them */
        m->cap = cca_state->devices[0].allowed_memory_maximum;
        m->gc_threshold = cs->garbage_collection_threshold;
    }
    unsigned streams = r->streams > 1 ? r->streams : 1;
    void *live[MAX_SLOTS] = {0};
    cca_block_t *blocks[MAX_SLOTS] = {0};
    bool used[MAX_SLOTS] = {0};
    long differ = 0, allocs = 0, deferred = 0, emptied = 0, ooms = 0;
    int64_t device_allocs_before = 0;
    mt64_t rng;
    mt64_seed(&rng, r->seed);
    const mt64_log_sizes_t sizes = mt64_log_sizes(r->max_size);
    for (long i = 0; i < r->steps && !m->failed; i++) {
        if (r->uses && mt64_pick(&rng, 16) == 0) { /* the use stream's work so far done */
            expect_ok(cca_sim_complete_stream(sim, 0, USE_STREAM, false));
            model_complete(m);
        }
        if (r->empties && mt64_pick(&rng, 2000) == 0) {
            expect_ok(cca_empty_cache());
            model_empty_cache(m);
            forget_released(seen, m);
            emptied++;
        }
        int k = mt64_pick(&rng, (uint64_t)r->slots);
        if (live[k]) {
            expect_ok(cca_free(live[k]));
            if (used[k])
                model_free_used(m, blocks[k]), deferred++;
            else
                model_free(m, blocks[k]->addr, blocks[k]);
            live[k] = NULL;
            continue;
        }
        size_t size = mt64_log_size(&rng, &sizes);
        unsigned stream = streams > 1 ? (unsigned)mt64_pick(&rng, streams) : 0;
        cca_stream_t s = (cca_stream_t)(uintptr_t)(0x1000 * (stream + 1));
        cca_status_t st = cca_malloc(&live[k], size, s);
        if (st != CCA_OK && st != CCA_ERR_OUT_OF_MEMORY) {
            HARNESS_FAIL("step %ld: cca_malloc(%zu): %s", i, size, cca_last_error()->message);
            break;
        }
        void *base = NULL;
        size_t seg_size = 0;
        if (m->expandable) { /* the block's reservation */
            if (st == CCA_OK)
                base = (void *)ptrmap_find(cca_state->ptrmap, (uintptr_t)live[k], false)->segment->base;
        } else if (st == CCA_OK) {
            expect_ok(cca_get_base_allocation(live[k], &base, &seg_size));
            /* a segment cca made for this request (maybe at the address of one it gave back in
             * the same call): the model's new one, if it makes one, goes there too */
            int64_t made = device_allocs();
            if (made != device_allocs_before)
                m->offered_base = (uintptr_t)base;
            device_allocs_before = made;
        }
        blocks[k] = model_malloc(m, size, stream);
        m->offered_base = 0;
        forget_released(seen, m); /* (before cca's new segments are counted) */
        if (m->failed) {
            HARNESS_FAIL("step %ld: the model ran out of host memory or segment ids", i);
            break;
        }
        if ((st == CCA_OK) != (blocks[k] != NULL)) {
            if (differ++ < 5)
                printf("  step %ld, %zu bytes: cca %s, the model %s\n", i, size,
                       st == CCA_OK ? "allocated" : "out of memory", blocks[k] ? "allocated" : "out of memory");
            if (st == CCA_OK)
                expect_ok(cca_free(live[k]));
            else
                model_free(m, blocks[k]->addr, blocks[k]);
            live[k] = NULL;
            continue;
        }
        if (st != CCA_OK) { /* out of memory on both sides */
            live[k] = NULL;
            ooms++;
            continue;
        }
        allocs++;
        used[k] = r->uses && mt64_pick(&rng, 4) == 0;
        if (used[k])
            expect_ok(cca_record_stream(live[k], USE_STREAM));
        size_t offset = (uintptr_t)live[k] - (uintptr_t)base;
        size_t model_ordinal = model_segment(blocks[k]);
        size_t model_offset = blocks[k]->addr - m->seg_base[model_ordinal];
        /* the same segment: the same in the order segments were made (expandable: the same
         * reservation, at the same address) */
        size_t ordinal = !m->expandable ? segment_ordinal(seen, (uintptr_t)base)
                         : (uintptr_t)base == m->seg_base[model_ordinal] ? model_ordinal
                                                                         : SIZE_MAX;
        if (ordinal != model_ordinal || offset != model_offset) {
            if (differ++ < 5)
                printf("  step %ld, %zu bytes: cca segment %zu offset %zu, the model segment %zu offset %zu\n",
                       i, size, ordinal, offset, model_ordinal, model_offset);
        }
    }
    cca_device_stats_t ds;
    expect_ok(cca_get_device_stats(0, &ds));
    if (!differ && m->expandable) { /* the same placement maps and unmaps the same ranges */
        expect_eq_u64((uint64_t)ds.num_device_alloc, m->maps);
        expect_eq_u64((uint64_t)ds.num_device_free, m->unmaps);
        expect_eq_u64((uint64_t)ds.reserved_bytes[CCA_STAT_ALL].current, m->reserved);
        expect_eq_u64((uint64_t)ds.num_alloc_retries, m->retries);
        expect_eq_u64((uint64_t)ds.num_ooms, m->ooms);
    } else if (!differ) { /* the same placement makes the same segments, gives back the same ones */
        expect_eq_u64((uint64_t)ds.num_device_alloc, m->segments);
        expect_eq_u64((uint64_t)ds.reserved_bytes[CCA_STAT_ALL].current, m->reserved);
        expect_eq_u64((uint64_t)ds.num_alloc_retries, m->retries);
        expect_eq_u64((uint64_t)ds.num_ooms, m->ooms);
    }
    expect_true(allocs > r->steps / 4); /* the workload allocated about as much as it freed */
    if (r->uses)
        expect_true(deferred > 0);
    if (r->empties)
        expect_true(emptied > 0);
    if (r->cap)
        expect_true(m->cap_hits > 0);
    if (m->gc_threshold > 0.0)
        expect_true(m->gc_released > 0);
    printf("  '%s', %d slots, %u stream(s)%s, sizes to %zu MiB%s%s, seed %u: %ld allocations (%ld frees "
           "deferred, %ld empty_cache, %llu retries, %ld out of memory, %llu segments collected), %zu "
           "segments made (%zu MiB held), %ld differ\n",
           r->settings, r->slots, streams, r->uses ? ", record_stream" : "", r->max_size / MiB,
           r->cap ? ", a capped device" : "", r->fraction > 0.0 ? ", a memory fraction" : "", r->seed, allocs,
           deferred, emptied, (unsigned long long)m->retries, ooms, (unsigned long long)m->gc_released,
           m->segments, m->reserved / MiB, differ);
    if (m->expandable)
        printf("    expandable: %llu ranges mapped, %llu unmapped\n", (unsigned long long)m->maps,
               (unsigned long long)m->unmaps);
    for (int k = 0; k < r->slots; k++)
        if (live[k]) {
            expect_ok(cca_free(live[k]));
            if (used[k])
                model_free_used(m, blocks[k]);
            else
                model_free(m, blocks[k]->addr, blocks[k]);
        }
    model_destroy(m);
    free(m);
    free(seen);
    cca_shutdown();
    return differ;
}

/* Every run of runs agrees with the model. */
static void expect_agree(const run_t *runs, size_t n)
{
    for (size_t i = 0; i < n; i++)
        expect_eq_i64(lockstep_run(&runs[i]), 0);
}

#define EXPECT_AGREE(...)                                                             \
    do {                                                                              \
        static const run_t runs_[] = {__VA_ARGS__};                                   \
        expect_agree(runs_, sizeof(runs_) / sizeof(runs_[0]));                         \
    } while (0)

/* A run with nothing beside the requests, on one stream. */
static long lockstep(const char *settings, int slots, long steps, size_t max_size, unsigned seed,
                     size_t small_split_min)
{
    run_t r = {settings, slots, steps, max_size, seed, 1, false, false, 0, small_split_min, 0.0};
    return lockstep_run(&r);
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
    EXPECT_AGREE({"", 512, 100000, 8 * MiB, 11, 4, false, false, 0, 0, 0.0},
                 {"max_split_size_mb:32", 128, 50000, 96 * MiB, 12, 4, false, false, 0, 0, 0.0});
}

/* record_stream: a quarter of the blocks used on another stream, their frees deferred until
 * its events complete; on one stream and on four. */
TEST(record_stream_lands_where_the_model_puts_it)
{
    EXPECT_AGREE({"", 512, 100000, 8 * MiB, 21, 1, true, false, 0, 0, 0.0},
                 {"max_split_size_mb:32", 128, 50000, 96 * MiB, 22, 4, true, false, 0, 0, 0.0});
}

/* empty_cache now and then: free whole segments given back, new ones made later (at
 * addresses the device may hand out again); with record_stream's deferred frees too. */
TEST(empty_cache_lands_where_the_model_puts_it)
{
    EXPECT_AGREE({"", 512, 100000, 8 * MiB, 31, 1, false, true, 0, 0, 0.0},
                 {"max_split_size_mb:32", 128, 50000, 96 * MiB, 32, 4, true, true, 0, 0, 0.0});
}

/* A device too small for the workload: PyTorch's sequence past a failed cudaMalloc (the
 * oversize blocks that make room given back under max_split_size, then every cached block,
 * a retry, out of memory), alone, with record_stream (a cudaFree synchronises the device:
 * the uses it waited for are done at the next allocation), on four streams with empty_cache. */
TEST(out_of_memory_lands_where_the_model_puts_it)
{
    EXPECT_AGREE({"", 512, 100000, 8 * MiB, 41, 1, false, false, 300 * MiB, 0, 0.0},
                 {"max_split_size_mb:32", 128, 50000, 96 * MiB, 42, 1, false, false, 1024 * MiB, 0, 0.0},
                 {"", 512, 100000, 8 * MiB, 44, 1, true, false, 300 * MiB, 0, 0.0},
                 {"max_split_size_mb:32", 128, 50000, 96 * MiB, 43, 1, true, false, 1536 * MiB, 0, 0.0},
                 {"max_split_size_mb:32", 128, 50000, 96 * MiB, 43, 4, true, true, 1536 * MiB, 0, 0.0});
}

/* A per-process memory fraction with garbage_collection_threshold: before each new segment,
 * past the threshold, the whole free large segments of every stream at least as old as their
 * average given back, pass after pass (PyTorch's collection by age), and the fraction's cap
 * on the segments; alone, under max_split_size, on four streams with record_stream. */
TEST(garbage_collection_lands_where_the_model_puts_it)
{
    EXPECT_AGREE({"garbage_collection_threshold:0.6", 512, 100000, 8 * MiB, 51, 1, false, false, 0, 0,
                  1.0 / 128},
                 {"garbage_collection_threshold:0.9", 512, 100000, 8 * MiB, 54, 1, true, false, 0, 0,
                  1.0 / 256},
                 {"garbage_collection_threshold:0.8,max_split_size_mb:32", 128, 50000, 96 * MiB, 52, 1, false,
                  false, 0, 0, 1.0 / 32},
                 {"garbage_collection_threshold:0.5", 256, 100000, 16 * MiB, 53, 4, true, false, 0, 0,
                  1.0 / 64});
}

/* Expandable segments: one reservation per stream and kind, mapped in 2 MiB and 20 MiB
 * granules as it grows from its lowest unmapped run, best fit preferring blocks that could
 * grow less, every block split where 512 bytes remain; empty_cache unmapping the whole
 * granules of free blocks (a reservation with nothing mapped given back); on one stream and
 * on four, with record_stream; on devices too small for the workload (every free block's
 * granules unmapped, a retry, out of memory), with max_split_size. */
TEST(expandable_segments_land_where_the_model_puts_them)
{
    EXPECT_AGREE({"expandable_segments:True", 512, 100000, 8 * MiB, 61, 1, false, false, 0, 0, 0.0},
                 {"expandable_segments:True", 128, 50000, 96 * MiB, 62, 1, false, true, 0, 0, 0.0},
                 {"expandable_segments:True", 256, 100000, 16 * MiB, 63, 4, true, true, 0, 0, 0.0},
                 {"expandable_segments:True", 512, 100000, 8 * MiB, 64, 1, true, false, 300 * MiB, 0, 0.0},
                 {"expandable_segments:True,max_split_size_mb:32", 128, 50000, 96 * MiB, 65, 4, true, true,
                  1536 * MiB, 0, 0.0});
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
    RUN(out_of_memory_lands_where_the_model_puts_it);
    RUN(garbage_collection_lands_where_the_model_puts_it);
    RUN(expandable_segments_land_where_the_model_puts_them);
    RUN(a_changed_rule_differs);
    return harness_done();
}
