/*
 * replay_compare.h - whether two replay results are the same but for how
 * they ran (the times, `overlapped`): the overlapped replay's test and the
 * replay fuzz target compare `sequential` with the default this way.
 */
#ifndef CCA_TEST_REPLAY_COMPARE_H
#define CCA_TEST_REPLAY_COMPARE_H

#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "cca.h"

/* The name of the first field where a and b differ, or NULL if none does. */
static inline const char *replay_result_diff(const cca_replay_result_t *a, const cca_replay_result_t *b)
{
#define SAME(f)                                                                                  \
    do {                                                                                         \
        if (a->f != b->f)                                                                        \
            return #f;                                                                           \
    } while (0)
    SAME(events);
    SAME(allocs);
    SAME(frees);
    SAME(segment_allocs);
    SAME(segment_frees);
    SAME(ooms);
    SAME(pool_ops);
    SAME(address_mismatches);
    SAME(unexpected_ooms);
    SAME(peak_reserved_bytes);
    SAME(peak_allocated_bytes);
    SAME(peak_requested_bytes);
    SAME(peak_active_bytes);
    SAME(has_expected);
    SAME(expected_allocs);
    SAME(expected_segment_allocs);
    SAME(expected_segment_frees);
    SAME(expected_ooms);
    SAME(expected_peak_reserved_bytes);
    SAME(stats_mismatches);
    SAME(summary_matches);
    SAME(late_segment_allocs);
    SAME(late_segment_frees);
    SAME(step_allocations);
    SAME(last_step_segment_allocs);
    SAME(last_step_segment_frees);
    SAME(cached_free_bytes);
    SAME(largest_free_bytes);
    SAME(compact_moves);
    SAME(compact_pending_growths);
    SAME(device);
    SAME(device_count);
    SAME(inferred_segments);
    SAME(inferred_blocks);
    SAME(inferred_reserved_bytes);
    SAME(inferred_requested_bytes);
    SAME(ambiguous_blocks);
    SAME(recorded_part_only);
    SAME(inconsistencies);
    SAME(first_inconsistency_event);
#undef SAME
    if (strcmp(a->settings, b->settings))
        return "settings";
    if (strcmp(a->first_stats_mismatch, b->first_stats_mismatch))
        return "first_stats_mismatch";
    if (strcmp(a->first_address_mismatch, b->first_address_mismatch))
        return "first_address_mismatch";
    if (strcmp(a->first_inconsistency, b->first_inconsistency))
        return "first_inconsistency";
    for (size_t i = 0; i < CCA_MEMORY_STATS_COUNT; i++) {
        const char *ka = a->memory_stats[i].key, *kb = b->memory_stats[i].key;
        if ((ka && kb) ? strcmp(ka, kb) != 0 : ka != kb)
            return "memory_stats (keys)";
        if (a->memory_stats[i].value != b->memory_stats[i].value)
            return "memory_stats (values)";
    }
    if (!a->memory_summary || !b->memory_summary)
        return a->memory_summary == b->memory_summary ? NULL : "memory_summary";
    return strcmp(a->memory_summary, b->memory_summary) ? "memory_summary" : NULL;
}

/*
 * The replay fuzzers' input: its first byte picks the options both share
 * (PyTorch's addresses or fresh ones, given settings, a small memory cap, a
 * device size, the fraction ignored), the rest is the file, written to
 * /tmp/cca_fuzz_NAME_PID (path, path_size bytes). Returns the pick byte, or -1
 * (nothing to replay: the input is empty or the file could not be written).
 */
static inline int fuzz_replay_input(const uint8_t *data, size_t size, const char *name, char *path,
                                    size_t path_size, cca_replay_options_t *opt)
{
    static const char *const settings[] = {NULL, "", "max_split_size_mb:20", "expandable_segments:True"};
    if (size < 1)
        return -1;
    snprintf(path, path_size, "/tmp/cca_fuzz_%s_%ld", name, (long)getpid());
    FILE *f = fopen(path, "wb");
    if (!f)
        return -1;
    size_t n = fwrite(data + 1, 1, size - 1, f);
    fclose(f);
    if (n != size - 1) {
        unlink(path);
        return -1;
    }
    uint8_t pick = data[0];
    memset(opt, 0, sizeof(*opt));
    opt->trace_addresses = !(pick & 1);
    opt->settings = settings[(pick >> 1) & 3];
    opt->cap = pick & 8 ? (size_t)64 << 20 : 0;
    opt->total_memory = pick & 16 ? (size_t)1 << 30 : 0;
    opt->ignore_fraction = pick & 32;
    return pick;
}

#endif /* CCA_TEST_REPLAY_COMPARE_H */
