/*
 * fuzz_explain.c - fuzz target for `cca_replay_explain`: the input (a first
 * byte picking options, as fuzz_replay's, then the file) is replayed once
 * plainly and once explained. Both must return the same status and message,
 * the explained replay's result must equal the plain one field by field (the
 * observer changes nothing), and the picture of the peak must add up: live
 * plus cached free bytes are the reservation, each ranking is sorted and sums
 * to no more than its whole, and cca is shut down after each call.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cca.h"
#include "replay_compare.h"

static void fail(const char *what)
{
    fprintf(stderr, "fuzz_explain: %s\n", what);
    abort();
}

static void check_ranking(const cca_explain_entry_t *e, size_t n, uint64_t whole, uint64_t distinct)
{
    uint64_t sum = 0;
    if (n > CCA_EXPLAIN_TOP || n > distinct)
        fail("a ranking holds more entries than it found");
    for (size_t i = 0; i < n; i++) {
        if (i && e[i].bytes > e[i - 1].bytes)
            fail("a ranking is not sorted by bytes");
        if (!memchr(e[i].name, '\0', sizeof(e[i].name)) || !e[i].name[0] || !e[i].count)
            fail("a ranking entry has no name or count");
        sum += e[i].bytes;
    }
    if (sum > whole)
        fail("a ranking sums to more than its whole");
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char path[64];
    cca_replay_options_t opt;
    int pick = fuzz_replay_input(data, size, "explain", path, sizeof(path), &opt);
    if (pick < 0)
        return 0;
    opt.sequential = true;
    static char msg[2048];
    cca_replay_result_t plain, explained;
    cca_replay_explain_t x;
    cca_status_t st = cca_replay_file(path, &opt, &plain);
    snprintf(msg, sizeof(msg), "%s", st == CCA_OK ? "" : cca_last_error()->message);
    cca_status_t xst = cca_replay_explain(path, &opt, &explained, &x);
    unlink(path);
    if (cca_is_initialized())
        fail("cca left initialised");
    /* the second reading (as a tree) may refuse what the streaming reader took */
    if (xst != st && !(st == CCA_OK && xst == CCA_ERR_FORMAT))
        fail("the explained replay's status differs");
    if (xst != CCA_OK && st == xst && strcmp(msg, cca_last_error()->message))
        fail("the explained replay's message differs");
    if (st == CCA_OK && xst == CCA_OK) {
        const char *diff = replay_result_diff(&plain, &explained);
        if (diff) {
            fprintf(stderr, "fuzz_explain: the results differ in %s\n", diff);
            abort();
        }
        if (x.live_bytes + x.cached_free_bytes != x.reserved_bytes)
            fail("live and cached free bytes are not the reservation");
        if (x.largest_free_bytes > x.cached_free_bytes || x.segments_with_free > x.segments ||
            x.live_requested_bytes > x.live_bytes)
            fail("the peak's figures are inconsistent");
        check_ranking(x.frames, x.frame_count, x.live_bytes, x.frames_distinct);
        check_ranking(x.annotations, x.annotation_count, x.live_bytes, x.annotations_distinct);
        check_ranking(x.streams, x.stream_count, x.live_bytes, x.streams_distinct);
        check_ranking(x.free_segments, x.segment_count, x.cached_free_bytes, x.segments_with_free);
        cca_replay_result_free(&explained);
    }
    cca_replay_result_free(&plain);
    return 0;
}
