/*
 * test_replay_forward.c - the trace played forward as it is read
 * (replay_forward.c), which spares the inference of the state before the
 * first event its undoing of every event when the trace began on an empty
 * allocator.
 *
 * Its rules, event by event; and the outcome: every bundled trace, whole and
 * cut at a few points (mid-run recordings), replays to the same result
 * whether the inference decides from it or undoes every event
 * (replay_forward_off).
 */
#include <dirent.h>
#include <stdlib.h>
#include <string.h>

#include "cca.h"
#include "harness.h"
#include "replay_events.h"

static const char *trace_dir = "tests/data/traces";

static void play(replay_forward_t *f, size_t i, replay_kind_t kind, uint64_t addr, uint64_t size)
{
    replay_event_t e = {addr, size, 0, (uint8_t)kind, false, false};
    replay_forward_event(f, &e, i);
}

/* Blocks: an allocation must be new, a free's block live; a free_completed first is a whole free. */
TEST(blocks_forward)
{
    replay_forward_t f = {0};
    play(&f, 0, EV_FREE_COMPLETED, 0x5000, 512); /* the recording began between request and completion */
    play(&f, 1, EV_ALLOC, 0x1000, 512);
    play(&f, 2, EV_ALLOC, 0x2000, 512);
    play(&f, 3, EV_FREE_REQUESTED, 0x1000, 512);
    play(&f, 4, EV_OOM, 0, 1ull << 40);
    play(&f, 5, EV_FREE_COMPLETED, 0x1000, 512);
    expect_false(f.broken);
    expect_eq_u64(f.blocks.count, 1);
    play(&f, 6, EV_ALLOC, 0x1000, 512); /* its address again, once freed */
    expect_false(f.broken);
    expect_eq_u64(f.blocks.count, 2);
    replay_forward_free(&f);

    play(&f, 0, EV_ALLOC, 0x1000, 512);
    play(&f, 1, EV_ALLOC, 0x1000, 512); /* at a live block */
    expect_true(f.broken);
    replay_forward_free(&f);

    play(&f, 0, EV_ALLOC, 0x1000, 512);
    play(&f, 1, EV_FREE_REQUESTED, 0x3000, 512); /* a block from before: checked with the next event */
    play(&f, 2, EV_ALLOC, 0x2000, 512);
    expect_true(f.broken);
    replay_forward_free(&f);

    play(&f, 0, EV_ALLOC, 0x1000, 512);
    play(&f, 1, EV_FREE_REQUESTED, 0x3000, 512);
    play(&f, 2, EV_FREE_COMPLETED, 0x3000, 512); /* with its completion */
    expect_true(f.broken);
    replay_forward_free(&f);

    play(&f, 0, EV_ALLOC, 0x1000, 512);
    play(&f, 1, EV_FREE_REQUESTED, 0x1000, 512);
    replay_forward_end(&f);
    expect_false(f.broken);
    play(&f, 2, EV_FREE_REQUESTED, 0x3000, 512); /* the last event: checked at the end */
    expect_false(f.broken);
    replay_forward_end(&f);
    expect_true(f.broken);
    replay_forward_free(&f);

    play(&f, 0, EV_ALLOC, 0x1000, 512);
    play(&f, 1, EV_FREE_COMPLETED, 0x3000, 512); /* not first: a block from before */
    expect_true(f.broken);
    replay_forward_free(&f);

    /* an invalid free is left out; an invalid allocation still takes its address */
    replay_event_t bad = {0x1000, 1ull << 62, 0, EV_FREE_REQUESTED, false, true};
    replay_forward_event(&f, &bad, 0);
    expect_false(f.broken);
    bad.kind = EV_ALLOC;
    replay_forward_event(&f, &bad, 1);
    expect_eq_u64(f.blocks.count, 1);
    replay_forward_free(&f);
}

/* Mapped bytes: a mapping must be of unmapped bytes, an unmapping of mapped ones; touching ranges merge. */
TEST(ranges_forward)
{
    replay_forward_t f = {0};
    play(&f, 0, EV_SEGMENT_MAP, 0x10000, 0x2000);
    play(&f, 1, EV_SEGMENT_MAP, 0x14000, 0x1000);
    play(&f, 2, EV_SEGMENT_MAP, 0x12000, 0x2000); /* fills the gap: one range */
    expect_false(f.broken);
    expect_eq_u64(f.nranges, 1);
    expect_eq_u64(f.ranges[0].lo, 0x10000);
    expect_eq_u64(f.ranges[0].hi, 0x15000);
    play(&f, 3, EV_SEGMENT_UNMAP, 0x11000, 0x1000); /* a hole */
    expect_false(f.broken);
    expect_eq_u64(f.nranges, 2);
    expect_eq_u64(f.ranges[0].hi, 0x11000);
    expect_eq_u64(f.ranges[1].lo, 0x12000);
    play(&f, 4, EV_SEGMENT_ALLOC, 0x40000, 0x1000);
    play(&f, 5, EV_SEGMENT_FREE, 0x40000, 0x1000);
    play(&f, 6, EV_SEGMENT_UNMAP, 0x10000, 0x1000);
    expect_false(f.broken);
    expect_eq_u64(f.nranges, 1);
    play(&f, 7, EV_SEGMENT_MAP, 0x20000, 0x1000);
    expect_eq_u64(f.nranges, 2);
    play(&f, 8, EV_SEGMENT_MAP, 0x15000, 0xb800); /* touches the first range's end, overlaps the next */
    expect_true(f.broken);
    replay_forward_free(&f);

    play(&f, 0, EV_SEGMENT_ALLOC, 0x10000, 0x2000);
    play(&f, 1, EV_SEGMENT_FREE, 0x11000, 0x2000); /* partly memory from before */
    expect_true(f.broken);
    replay_forward_free(&f);

    play(&f, 0, EV_SEGMENT_UNMAP, 0x10000, 0x2000); /* memory from before */
    expect_true(f.broken);
    replay_forward_free(&f);

    play(&f, 0, EV_SEGMENT_MAP, 0x10000, 0); /* nothing mapped: the inference decides */
    expect_true(f.broken);
    replay_forward_free(&f);
}

static bool same_result(const char *name, uint64_t k, const cca_replay_result_t *a, const cca_replay_result_t *b)
{
    bool same = a->recorded_part_only == b->recorded_part_only && a->inferred_segments == b->inferred_segments &&
                a->inferred_blocks == b->inferred_blocks &&
                a->inferred_reserved_bytes == b->inferred_reserved_bytes &&
                a->inferred_requested_bytes == b->inferred_requested_bytes &&
                a->inconsistencies == b->inconsistencies &&
                !strcmp(a->first_inconsistency, b->first_inconsistency) &&
                a->address_mismatches == b->address_mismatches && a->allocs == b->allocs &&
                a->segment_allocs == b->segment_allocs && a->segment_frees == b->segment_frees &&
                a->peak_reserved_bytes == b->peak_reserved_bytes &&
                a->expected_peak_reserved_bytes == b->expected_peak_reserved_bytes &&
                a->stats_mismatches == b->stats_mismatches;
    for (size_t i = 0; same && i < CCA_MEMORY_STATS_COUNT; i++)
        same = a->memory_stats[i].value == b->memory_stats[i].value;
    if (!same)
        HARNESS_FAIL("%s cut at %llu: the replay differs when the start is decided forward (inferred %llu "
                     "blocks, %llu inconsistencies; undone: %llu, %llu)", name, (unsigned long long)k,
                     (unsigned long long)a->inferred_blocks, (unsigned long long)a->inconsistencies,
                     (unsigned long long)b->inferred_blocks, (unsigned long long)b->inconsistencies);
    return same;
}

static void check_both_ways(const char *name, uint64_t k)
{
    char path[512];
    snprintf(path, sizeof(path), "%s/%s", trace_dir, name);
    cca_replay_options_t opt = {0};
    opt.trace_addresses = true;
    opt.sequential = true;
    opt.first_event = k;
    cca_replay_result_t a, b;
    replay_forward_off = false;
    cca_status_t sa = cca_replay_file(path, &opt, &a);
    replay_forward_off = true;
    cca_status_t sb = cca_replay_file(path, &opt, &b);
    replay_forward_off = false;
    expect_eq_i64(sa, sb);
    if (sa == CCA_OK && sb == CCA_OK)
        same_result(name, k, &a, &b);
    if (sa == CCA_OK)
        cca_replay_result_free(&a);
    if (sb == CCA_OK)
        cca_replay_result_free(&b);
}

/* Every bundled trace below 200,000 events, whole and cut early, a third in and at its last event. */
TEST(same_replay_either_way)
{
    DIR *dir = opendir(trace_dir);
    if (!dir) {
        HARNESS_FAIL("cannot open %s", trace_dir);
        return;
    }
    size_t traces = 0;
    struct dirent *de;
    while ((de = readdir(dir))) {
        size_t len = strlen(de->d_name);
        if (len < 10 || strcmp(de->d_name + len - 10, ".pickle.gz"))
            continue;
        char path[512];
        snprintf(path, sizeof(path), "%s/%s", trace_dir, de->d_name);
        cca_replay_options_t opt = {0};
        cca_replay_result_t r;
        if (cca_replay_file(path, &opt, &r) != CCA_OK) {
            HARNESS_FAIL("%s: replay failed", de->d_name);
            continue;
        }
        uint64_t n = r.events;
        cca_replay_result_free(&r);
        if (n >= 200000)
            continue;
        const uint64_t cuts[] = {0, 1, n / 50 + 1, n / 3, n - 1};
        for (size_t c = 0; c < sizeof(cuts) / sizeof(cuts[0]); c++)
            check_both_ways(de->d_name, cuts[c]);
        traces++;
    }
    closedir(dir);
    expect_true(traces >= 10);
}

int main(void)
{
    RUN(blocks_forward);
    RUN(ranges_forward);
    RUN(same_replay_either_way);
    return harness_done();
}
