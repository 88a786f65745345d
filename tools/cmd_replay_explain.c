/*
 * cmd_replay_explain.c - `cca replay TRACE --explain` (what was live at the
 * peak of reserved memory, where the cached free memory lay, and what other
 * settings would reserve) and `cca replay TRACE --fit [SETTINGS...]` (the
 * smallest device each settings string runs the trace on without an
 * out-of-memory error, found by replaying it under capped devices).
 */
#include <inttypes.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cca.h"
#include "cli.h"

#define MIB 1048576.0

/* PyTorch settings whose effect --explain shows, each added to the replay's own. */
static const char *const what_if[] = {
    "expandable_segments:True",
    "max_split_size_mb:256",
    "roundup_power2_divisions:4",
    "garbage_collection_threshold:0.8",
};

/* base + "," + extra in buf (extra alone when base is empty); false if it does not fit. */
static bool join_settings(char *buf, size_t size, const char *base, const char *extra)
{
    int n = snprintf(buf, size, "%s%s%s", base, base[0] ? "," : "", extra);
    return n >= 0 && (size_t)n < size;
}

/* Whether settings already sets extra's key (the text up to its ':'). */
static bool sets_key(const char *settings, const char *extra)
{
    size_t n = (size_t)(strchr(extra, ':') - extra) + 1;
    for (const char *q = settings; *q; q++)
        if ((q == settings || q[-1] == ',' || q[-1] == ' ') && !strncmp(q, extra, n))
            return true;
    return false;
}

static void print_ranking(const char *title, const cca_explain_entry_t *e, size_t n, uint64_t distinct,
                          uint64_t total, const char *unit)
{
    printf("%s (top %zu of %" PRIu64 "):\n", title, n, distinct);
    for (size_t i = 0; i < n; i++)
        printf("  %10.1f MiB %5.1f%% %7" PRIu64 " %-6s %s\n", (double)e[i].bytes / MIB,
               total ? 100.0 * (double)e[i].bytes / (double)total : 0.0, e[i].count, unit, e[i].name);
}

static void json_ranking(const char *key, const cca_explain_entry_t *e, size_t n, const char *count_key)
{
    printf(", \"%s\": [", key);
    for (size_t i = 0; i < n; i++) {
        printf("%s{\"name\": ", i ? ", " : "");
        cli_json_string(stdout, e[i].name);
        printf(", \"bytes\": %" PRIu64 ", \"%s\": %" PRIu64 "}", e[i].bytes, count_key, e[i].count);
    }
    printf("]");
}

int replay_explain(const char *path, const cca_replay_options_t *opt, bool json)
{
    cca_replay_result_t r;
    cca_replay_explain_t x;
    if (cca_replay_explain(path, opt, &r, &x) != CCA_OK) {
        cli_report_error("replay", path);
        return 1;
    }
    /* the same trace under other settings: the peak each reserves */
    size_t nwhat = sizeof(what_if) / sizeof(what_if[0]);
    struct {
        char settings[1024];
        int64_t peak;
        uint64_t ooms;
        bool ok, skipped;
    } alt[sizeof(what_if) / sizeof(what_if[0])];
    for (size_t k = 0; k < nwhat; k++) {
        alt[k].skipped = !join_settings(alt[k].settings, sizeof(alt[k].settings), r.settings, what_if[k]) ||
                         sets_key(r.settings, what_if[k]);
        alt[k].ok = false;
        if (alt[k].skipped)
            continue;
        cca_replay_options_t o = *opt;
        o.settings = alt[k].settings;
        o.trace_addresses = false;
        o.snapshot_path = o.svg_path = NULL;
        cca_replay_result_t a;
        if (cca_replay_file(path, &o, &a) == CCA_OK) {
            alt[k].ok = true;
            alt[k].peak = a.peak_reserved_bytes;
            alt[k].ooms = a.unexpected_ooms;
        }
        cca_replay_result_free(&a);
    }
    if (json) {
        printf("{\"replay\": ");
        replay_print_json_object(&r, opt->trace_addresses);
        printf(", \"explain\": {\"peak_event\": %" PRIu64 ", \"reserved_bytes\": %" PRIu64
               ", \"live_bytes\": %" PRIu64 ", \"live_requested_bytes\": %" PRIu64
               ", \"live_allocations\": %" PRIu64 ", \"cached_free_bytes\": %" PRIu64
               ", \"largest_free_bytes\": %" PRIu64 ", \"segments\": %" PRIu64
               ", \"segments_with_free\": %" PRIu64,
               x.peak_event, x.reserved_bytes, x.live_bytes, x.live_requested_bytes, x.live_allocations,
               x.cached_free_bytes, x.largest_free_bytes, x.segments, x.segments_with_free);
        json_ranking("frames", x.frames, x.frame_count, "allocations");
        json_ranking("annotations", x.annotations, x.annotation_count, "allocations");
        json_ranking("streams", x.streams, x.stream_count, "allocations");
        json_ranking("free_segments", x.free_segments, x.segment_count, "free_pieces");
        printf("}, \"settings\": [");
        bool first = true;
        for (size_t k = 0; k < nwhat; k++) {
            if (alt[k].skipped)
                continue;
            printf("%s{\"settings\": ", first ? "" : ", ");
            cli_json_string(stdout, alt[k].settings);
            if (alt[k].ok)
                printf(", \"peak_reserved_bytes\": %" PRId64 ", \"unexpected_ooms\": %" PRIu64 "}",
                       alt[k].peak, alt[k].ooms);
            else
                printf(", \"error\": true}");
            first = false;
        }
        printf("]}\n");
        cca_replay_result_free(&r);
        return 0;
    }
    printf("cca replay --explain: %s\n", path);
    printf("  settings '%s': peak reserved %.1f MiB, at event %" PRIu64 " of %" PRIu64 "\n", r.settings,
           (double)x.reserved_bytes / MIB, x.peak_event, r.events);
    bool reset = (uint64_t)r.peak_reserved_bytes != x.reserved_bytes; /* the program reset the peaks */
    if (reset)
        printf("  the trace resets the peak statistics: peak reserved since its last reset %.1f MiB",
               (double)r.peak_reserved_bytes / MIB);
    else if (r.has_expected)
        printf("  PyTorch's peak reserved");
    if (r.has_expected)
        printf("%s %.1f MiB", reset ? " (PyTorch's" : ":", (double)r.expected_peak_reserved_bytes / MIB);
    if (reset || r.has_expected)
        printf("%s\n", reset && r.has_expected ? ")" : "");
    printf("At the peak:\n");
    printf("  live         %10.1f MiB in %" PRIu64 " allocations (%.1f MiB requested)\n",
           (double)x.live_bytes / MIB, x.live_allocations, (double)x.live_requested_bytes / MIB);
    printf("  cached free  %10.1f MiB (%.1f%% of reserved) in %" PRIu64 " of %" PRIu64
           " segments; the largest free piece %.1f MiB\n",
           (double)x.cached_free_bytes / MIB,
           x.reserved_bytes ? 100.0 * (double)x.cached_free_bytes / (double)x.reserved_bytes : 0.0,
           x.segments_with_free, x.segments, (double)x.largest_free_bytes / MIB);
    print_ranking("Live memory by call site (first frame outside torch)", x.frames, x.frame_count,
                  x.frames_distinct, x.live_bytes, "allocs");
    print_ranking("Live memory by annotation open at the allocation", x.annotations, x.annotation_count,
                  x.annotations_distinct, x.live_bytes, "allocs");
    print_ranking("Live memory by stream", x.streams, x.stream_count, x.streams_distinct, x.live_bytes, "allocs");
    print_ranking("Cached free memory by segment", x.free_segments, x.segment_count, x.segments_with_free,
                  x.cached_free_bytes, "pieces");
    printf("Peak reserved under other settings (replayed%s):\n", reset ? "; since the last reset of the peaks" : "");
    printf("  %-56s %10.1f MiB\n", r.settings[0] ? r.settings : "(PyTorch's default)",
           (double)r.peak_reserved_bytes / MIB);
    for (size_t k = 0; k < nwhat; k++) {
        if (alt[k].skipped)
            continue;
        if (!alt[k].ok) {
            printf("  %-56s error: the replay failed\n", alt[k].settings);
            continue;
        }
        double change = r.peak_reserved_bytes
                            ? 100.0 * (double)(alt[k].peak - r.peak_reserved_bytes) / (double)r.peak_reserved_bytes
                            : 0.0;
        printf("  %-56s %10.1f MiB %+6.1f%%", alt[k].settings, (double)alt[k].peak / MIB, change);
        if (alt[k].ooms)
            printf("  (%" PRIu64 " allocations out of memory)", alt[k].ooms);
        else if (!strncmp(what_if[k], "garbage_collection", 18) && alt[k].peak == r.peak_reserved_bytes)
            printf("  (acts only under a per-process memory fraction)");
        printf("\n");
    }
    cca_replay_result_free(&r);
    return 0;
}

/* ---- --fit ---------------------------------------------------------------------------- */

#define FIT_GRAIN ((size_t)2 << 20) /* caps tried are multiples of 2 MiB */

/* Replay under cap (0: none); *fits when every allocation PyTorch served was served. */
static cca_status_t try_cap(const char *path, const cca_replay_options_t *base, const char *settings,
                            size_t cap, bool *fits, int64_t *peak)
{
    cca_replay_options_t o = *base;
    o.settings = settings;
    o.cap = cap;
    o.trace_addresses = false;
    o.snapshot_path = o.svg_path = NULL;
    cca_replay_result_t r;
    cca_status_t st = cca_replay_file(path, &o, &r);
    if (st == CCA_OK) {
        *fits = r.unexpected_ooms == 0;
        *peak = r.peak_reserved_bytes;
    }
    cca_replay_result_free(&r);
    return st;
}

int replay_fit(const char *path, const cca_replay_options_t *opt, char **settings, int count, bool json)
{
    static const char *const defaults[] = {NULL, "expandable_segments:True", "compact_memory:True"};
    const char *const *list = (const char *const *)settings;
    if (count == 0) {
        list = defaults;
        count = (int)(sizeof(defaults) / sizeof(defaults[0]));
    }
    int width = 44; /* the settings column: as wide as its longest string */
    for (int i = 0; i < count; i++)
        if (list[i] && (int)strlen(list[i]) > width)
            width = (int)strlen(list[i]) > 200 ? 200 : (int)strlen(list[i]);
    if (json)
        printf("[");
    else
        printf("cca replay --fit: %s\n%-*s %14s %16s %16s %8s\n", path, width, "settings", "peak reserved",
               "smallest device", "reserved there", "replays");
    int rc = 0;
    for (int i = 0; i < count; i++) {
        const char *s = list[i];
        char label[1100];
        snprintf(label, sizeof(label), "%s", s ? (s[0] ? s : "(PyTorch's default)") : "(the trace's own)");
        bool fits = false;
        int64_t peak = 0, peak_at_fit = 0;
        unsigned replays = 1;
        cca_status_t st = try_cap(path, opt, s, opt->cap, &fits, &peak);
        size_t hi = 0;
        if (st == CCA_OK && fits) {
            /* a device as large as the peak runs it; one below the live peak cannot */
            hi = ((size_t)peak + FIT_GRAIN - 1) / FIT_GRAIN * FIT_GRAIN;
            size_t lo = 0;
            peak_at_fit = peak;
            while (st == CCA_OK && hi - lo > FIT_GRAIN) {
                size_t mid = lo + (hi - lo) / 2 / FIT_GRAIN * FIT_GRAIN;
                bool ok = false;
                int64_t p = 0;
                st = try_cap(path, opt, s, mid, &ok, &p);
                replays++;
                if (ok) {
                    hi = mid;
                    peak_at_fit = p;
                } else {
                    lo = mid;
                }
            }
        }
        if (json) {
            printf("%s{\"settings\": ", i ? ", " : "");
            cli_json_string(stdout, s ? s : "");
            printf(", \"trace_settings\": %s", s ? "false" : "true");
            if (st != CCA_OK) {
                printf(", \"error\": ");
                cli_json_string(stdout, cca_last_error()->message);
                printf("}");
            } else {
                printf(", \"peak_reserved_bytes\": %" PRId64 ", \"fits\": %s, \"fit_bytes\": %zu"
                       ", \"reserved_at_fit_bytes\": %" PRId64 ", \"replays\": %u}",
                       peak, fits ? "true" : "false", hi, peak_at_fit, replays);
            }
        } else if (st != CCA_OK) {
            printf("%-*s error: %s\n", width, label, cca_last_error()->message);
        } else if (!fits) {
            printf("%-*s %10.1f MiB %16s\n", width, label, (double)peak / MIB, "out of memory as given");
        } else {
            printf("%-*s %10.1f MiB %12.1f MiB %12.1f MiB %8u\n", width, label, (double)peak / MIB,
                   (double)hi / MIB, (double)peak_at_fit / MIB, replays);
        }
        rc |= st != CCA_OK;
    }
    if (json)
        printf("]\n");
    return rc;
}
