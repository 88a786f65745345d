/*
 * test_replay_cuts.c - traces whose recording began late: each bundled trace
 * with its first K events left out (as a wrapped ring or a late
 * _record_memory_history leaves it; the snapshot's segments stay those of the
 * end) replays from the inferred state before its first event with every
 * allocation at PyTorch's address, PyTorch's peak reserved over the recorded
 * part and PyTorch's current statistics at the end.
 *
 * The reference is the whole trace replayed with its peaks reset before event
 * K (the whole trace replays exactly as PyTorch ran it: test_replay_traces.c):
 * the cut replay's every current and peak statistic equals that one's, and
 * the peak reserved equals PyTorch's own over the recorded part (its reserved
 * bytes at the end with the segment events undone back to K).
 *
 * With arguments, a checker of every cut: test_replay_cuts TRACE [STEP
 * [FIRST]] cuts TRACE at every STEP-th event from FIRST on, comparing with
 * PyTorch's figures only (one replay per cut).
 */
#include <dirent.h>
#include <stdlib.h>
#include <string.h>

#include "cca.h"
#include "harness.h"

static const char *trace_dir = "tests/data/traces";

static int64_t stat_of(const cca_replay_result_t *r, const char *key)
{
    for (size_t i = 0; i < CCA_MEMORY_STATS_COUNT; i++)
        if (!strcmp(r->memory_stats[i].key, key))
            return r->memory_stats[i].value;
    return -1;
}

/* Replay path cut at event k; the result is PyTorch's (0 differences), else print why. */
static bool cut_matches_pytorch(const char *path, uint64_t k, cca_replay_result_t *r, bool quiet)
{
    cca_replay_options_t opt = {0};
    opt.trace_addresses = true;
    opt.first_event = k;
    cca_status_t st = cca_replay_file(path, &opt, r);
    if (st != CCA_OK) {
        printf("  %s cut at %llu: replay failed: %s\n", path, (unsigned long long)k,
               cca_last_error()->message);
        memset(r, 0, sizeof(*r));
        return false;
    }
    bool ok = r->has_expected && !r->address_mismatches && !r->unexpected_ooms && !r->inconsistencies &&
              !r->stats_mismatches && r->peak_reserved_bytes == r->expected_peak_reserved_bytes &&
              r->allocs == r->expected_allocs && r->segment_allocs == r->expected_segment_allocs &&
              r->segment_frees == r->expected_segment_frees;
    if (!ok && !quiet)
        printf("  %s cut at %llu: %llu address mismatches (%s), %llu stats (%s), peak reserved %lld vs "
               "PyTorch %lld, %llu inconsistencies (%s), segments %llu/%llu vs %llu/%llu\n",
               path, (unsigned long long)k, (unsigned long long)r->address_mismatches,
               r->first_address_mismatch, (unsigned long long)r->stats_mismatches, r->first_stats_mismatch,
               (long long)r->peak_reserved_bytes, (long long)r->expected_peak_reserved_bytes,
               (unsigned long long)r->inconsistencies, r->first_inconsistency,
               (unsigned long long)r->segment_allocs, (unsigned long long)r->segment_frees,
               (unsigned long long)r->expected_segment_allocs, (unsigned long long)r->expected_segment_frees);
    return ok;
}

/* Cut name at k and compare with PyTorch's figures; with whole, with the whole replay measured from k. */
static void check_cut(const char *name, uint64_t k, bool whole_too)
{
    char path[512];
    snprintf(path, sizeof(path), "%s/%s", trace_dir, name);
    cca_replay_result_t cut;
    expect_true(cut_matches_pytorch(path, k, &cut, false));
    if (!cut.events) /* the replay failed (printed): nothing to compare */
        return;
    expect_true(cut.recorded_part_only);
    expect_true(cut.inferred_segments > 0);
    if (!whole_too) {
        cca_replay_result_free(&cut);
        return;
    }
    cca_replay_options_t opt = {0};
    opt.trace_addresses = true;
    opt.peaks_from_event = k;
    cca_replay_result_t whole;
    if (cca_replay_file(path, &opt, &whole) != CCA_OK) {
        HARNESS_FAIL("%s: replay failed: %s", name, cca_last_error()->message);
        cca_replay_result_free(&cut);
        return;
    }
    expect_eq_i64(cut.peak_reserved_bytes, whole.peak_reserved_bytes);
    expect_eq_i64(whole.expected_peak_reserved_bytes, whole.peak_reserved_bytes);
    size_t differ = 0;
    for (size_t i = 0; i < CCA_MEMORY_STATS_COUNT; i++) {
        const char *key = whole.memory_stats[i].key;
        size_t n = strlen(key);
        bool current = n > 8 && !strcmp(key + n - 8, ".current");
        bool peak = n > 5 && !strcmp(key + n - 5, ".peak");
        if ((current || peak) && stat_of(&cut, key) != whole.memory_stats[i].value) {
            if (!differ++)
                printf("  %s cut at %llu: %s %lld, measured on the whole trace %lld\n", name,
                       (unsigned long long)k, key, (long long)stat_of(&cut, key),
                       (long long)whole.memory_stats[i].value);
        }
    }
    expect_eq_u64(differ, 0);
    cca_replay_result_free(&cut);
    cca_replay_result_free(&whole);
}

static int cmp_name(const void *a, const void *b)
{
    return strcmp(*(char *const *)a, *(char *const *)b);
}

/*
 * Every bundled trace cut at a few points: early (the first segments'
 * blocks live), a third and two thirds in (mid-step: blocks live, free
 * stretches and, with expandable segments, mapped and unmapped ranges), and
 * the last event (nearly all of the state inferred; often a free_completed
 * whose request is cut off); traces of 200,000 events or more at the third
 * and the last only. The third is also compared with the whole replay
 * measured from there, statistic by statistic.
 */
TEST(every_trace_cut_at_several_points)
{
    DIR *dir = opendir(trace_dir);
    if (!dir) {
        HARNESS_FAIL("cannot open %s", trace_dir);
        return;
    }
    char *names[128];
    size_t count = 0;
    struct dirent *de;
    while ((de = readdir(dir)) && count < 128) {
        size_t len = strlen(de->d_name);
        if (len >= 10 && !strcmp(de->d_name + len - 10, ".pickle.gz"))
            names[count++] = strdup(de->d_name);
    }
    closedir(dir);
    qsort(names, count, sizeof(*names), cmp_name);
    for (size_t t = 0; t < count; t++) {
        char path[512];
        snprintf(path, sizeof(path), "%s/%s", trace_dir, names[t]);
        cca_replay_options_t opt = {0};
        cca_replay_result_t r;
        if (cca_replay_file(path, &opt, &r) != CCA_OK) {
            HARNESS_FAIL("%s: replay failed", names[t]);
            continue;
        }
        uint64_t n = r.events;
        cca_replay_result_free(&r);
        const uint64_t cuts[] = {n / 50 + 1, n / 3, 2 * n / 3 + 1, n - 1};
        for (size_t c = 0; c < sizeof(cuts) / sizeof(cuts[0]); c++)
            if (n < 200000 || c % 2) /* the longest traces (generation) at two points */
                check_cut(names[t], cuts[c], c == 1);
        printf("  %-48s cut at %llu, %llu, %llu, %llu\n", names[t], (unsigned long long)cuts[0],
               (unsigned long long)cuts[1], (unsigned long long)cuts[2], (unsigned long long)cuts[3]);
        free(names[t]);
    }
    expect_eq_i64((int64_t)count, 39);
}

/*
 * Cuts where the start state is hard to get right: right after a free
 * requested while its block's stream still used it (the block pending at the
 * start); a block freed in the trace that PyTorch had left with an unsplit
 * rest (its end found by the next allocation beyond it); a small-pool
 * reservation just past the large one's span; in the middle of empty_cache's
 * unmaps and just after them (reservations with holes).
 *
 * With private pools: inside a graph capture's first events (among the frees
 * of its empty_cache, which must go on; after the segment made for the
 * generator's seed and offset, which stay in the default pools, and after
 * either of them, which must not be redone; after the pool's first segment,
 * whose use the capture's route takes over); among the unmaps of a deleted
 * MemPool (which go on from the start) and of the empty_cache after it, when
 * the pool's reservation kept only a live range above its unmapped ones (its
 * base lies lower, clear of the reservation the driver placed after it).
 * Among a pool operation's frees, the whole replay (which makes them at the
 * operation) is no reference from the cut on: PyTorch's figures are.
 *
 * A block live at the start that PyTorch had left with an unsplit rest whose
 * end nothing lands at: only an allocation PyTorch put elsewhere, that the
 * block's rounded size leaves room for, shows it.
 */
TEST(tricky_cuts)
{
    static const struct {
        const char *name;
        uint64_t cut;
        bool partial; /* among a pool operation's frees, which the whole replay makes at once */
    } cuts[] = {
        {"two_stream_pipeline_default.pickle.gz", 23, false},
        {"resnet50_train_default.pickle.gz", 2992, false},
        {"gpt2_train_expandable.pickle.gz", 4986, false},
        {"resnet50_train_infer8_expandable.pickle.gz", 17069, false},
        {"resnet50_train_infer8_expandable.pickle.gz", 17075, false},
        {"graph_mlp_default.pickle.gz", 300, false},
        {"graph_mlp_default.pickle.gz", 305, false},
        {"graph_mlp_default.pickle.gz", 306, false},
        {"graph_mlp_default.pickle.gz", 308, false},
        {"graph_mlp_expandable.pickle.gz", 297, false},
        {"graph_mlp_expandable.pickle.gz", 298, false},
        {"graph_mlp_expandable.pickle.gz", 300, false},
        {"mempool_expandable.pickle.gz", 230, true},
        {"mempool_expandable.pickle.gz", 232, false},
        {"mempool_expandable.pickle.gz", 233, true},
        {"mempool_expandable.pickle.gz", 234, true},
        /* a start block with a rest PyTorch left unsplit that only PyTorch's placing an
         * allocation elsewhere tells (the replay grows it and replays again) */
        {"t5_train_varlen24_default.pickle.gz", 22223, false},
        {"llama_generate8_default.pickle.gz", 160518, false},
        {"llama_generate8_default.pickle.gz", 487534, false},
    };
    for (size_t i = 0; i < sizeof(cuts) / sizeof(cuts[0]); i++)
        check_cut(cuts[i].name, cuts[i].cut, !cuts[i].partial);
}

/* The checker of every cut (see the banner). */
static int check_every_cut(const char *path, uint64_t step, uint64_t first)
{
    cca_replay_options_t opt = {0};
    cca_replay_result_t r;
    if (cca_replay_file(path, &opt, &r) != CCA_OK) {
        fprintf(stderr, "%s: %s\n", path, cca_last_error()->message);
        return 1;
    }
    uint64_t n = r.events, checked = 0, failed = 0;
    cca_replay_result_free(&r);
    for (uint64_t k = first; k < n; k += step) {
        bool ok = cut_matches_pytorch(path, k, &r, failed >= 10);
        failed += !ok;
        checked++;
        cca_replay_result_free(&r);
    }
    printf("%s: %llu cuts checked (every %llu events from %llu of %llu), %llu differ from PyTorch\n", path,
           (unsigned long long)checked, (unsigned long long)step, (unsigned long long)first,
           (unsigned long long)n, (unsigned long long)failed);
    return failed ? 1 : 0;
}

int main(int argc, char **argv)
{
    if (argc > 1 && !strcmp(argv[1], "--tricky")) {
        RUN(tricky_cuts);
        return harness_done();
    }
    if (argc > 1)
        return check_every_cut(argv[1], argc > 2 ? strtoull(argv[2], NULL, 10) : 1,
                               argc > 3 ? strtoull(argv[3], NULL, 10) : 1);
    RUN(tricky_cuts);
    RUN(every_trace_cut_at_several_points);
    return harness_done();
}
