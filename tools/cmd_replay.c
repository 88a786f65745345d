/*
 * cmd_replay.c - `cca replay TRACE [options]`: replay a PyTorch memory
 * snapshot through cca on a simulated device and report what it needed.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cca.h"
#include "cli.h"

static void usage(FILE *out)
{
    fprintf(out,
            "usage: cca replay TRACE [--settings STR] [--cap BYTES] [--total-memory BYTES]\n"
            "                        [--addresses trace|fresh] [--device N] [--no-fraction]\n"
            "                        [--json] [--snapshot OUT.pickle[.gz]] [--svg OUT.svg]\n"
            "                        [--event-lag N] [--sequential]\n"
            "                        [--compare 'SETTINGS' ['SETTINGS'...]]\n"
            "Replays TRACE (a PyTorch memory snapshot, .pickle or .pickle.gz) through cca on a\n"
            "simulated device. BYTES accept K/M/G/T suffixes. --addresses trace (the default\n"
            "without --settings) hands out PyTorch's segment addresses and compares every\n"
            "allocation with PyTorch's. --compare replays under each settings string and\n"
            "prints a table. --snapshot writes the allocator's state at the end with the\n"
            "history recorded during the replay (PyTorch's snapshot format); --svg draws them.\n"
            "--event-lag N: an event cca records on a trace's stream completes N trace events\n"
            "later, as on a GPU running behind the host (default 0: at once).\n"
            "The replay runs on a second thread while TRACE is read, and again after the\n"
            "reading if the trace's settings (at the end of the file) differ from what it\n"
            "assumed; --sequential reads the whole file first. The result is the same.\n");
}

static int parse_size(const char *text, size_t *out)
{
    char *end = NULL;
    unsigned long long v = strtoull(text, &end, 10);
    unsigned shift = 0;
    if (end == text || text[0] == '-')
        return -1;
    switch (*end) {
    case '\0': break;
    case 'K': case 'k': shift = 10; end++; break;
    case 'M': case 'm': shift = 20; end++; break;
    case 'G': case 'g': shift = 30; end++; break;
    case 'T': case 't': shift = 40; end++; break;
    default: return -1;
    }
    if (*end == 'i')
        end++;
    if (*end == 'B')
        end++;
    if (*end)
        return -1;
    *out = (size_t)(v << shift);
    return 0;
}

static void print_mib(const char *label, int64_t bytes)
{
    printf("  %-28s %14" PRId64 " bytes  (%.1f MiB)\n", label, bytes, (double)bytes / 1048576.0);
}

static void print_human(const char *path, const cca_replay_result_t *r, bool trace_addresses)
{
    printf("cca replay: %s\n", path);
    printf("  settings                     '%s'\n", r->settings);
    printf("  events                       %" PRIu64 " (%.2f M events/s; load %.3f s, replay %.3f s%s)\n",
           r->events, r->events_per_second / 1e6, r->load_seconds, r->seconds,
           r->overlapped ? ", during the load" : "");
    printf("  allocations                  %" PRIu64 "\n", r->allocs);
    printf("  segment allocs / frees       %" PRIu64 " / %" PRIu64 "\n", r->segment_allocs, r->segment_frees);
    printf("    in the second half         %" PRIu64 " / %" PRIu64 "\n", r->late_segment_allocs,
           r->late_segment_frees);
    if (r->step_allocations)
        printf("    in the last step           %" PRIu64 " / %" PRIu64 "  (a step: %" PRIu64
               " allocations, the trace's period)\n",
               r->last_step_segment_allocs, r->last_step_segment_frees, r->step_allocations);
    else
        printf("    in the last step           -  (the allocations do not repeat)\n");
    printf("  out-of-memory errors         %" PRIu64 "\n", r->ooms);
    if (r->pool_ops)
        printf("  private-pool operations      %" PRIu64 "\n", r->pool_ops);
    print_mib("peak reserved", r->peak_reserved_bytes);
    print_mib("peak allocated", r->peak_allocated_bytes);
    print_mib("peak requested", r->peak_requested_bytes);
    print_mib("free in the cache at the end", (int64_t)r->cached_free_bytes);
    if (r->compact_moves || r->compact_pending_growths)
        printf("  compact_memory               %" PRIu64 " moves, %" PRIu64 " growths past pending granules\n",
               r->compact_moves, r->compact_pending_growths);
    print_mib("largest free piece", (int64_t)r->largest_free_bytes);
    if (r->peak_requested_bytes > 0)
        printf("  peak reserved / requested    %.3f\n",
               (double)r->peak_reserved_bytes / (double)r->peak_requested_bytes);
    if (trace_addresses)
        printf("  address mismatches           %" PRIu64 "%s%s\n", r->address_mismatches,
               r->address_mismatches ? "  first: " : "", r->first_address_mismatch);
    if (r->has_expected) {
        printf("PyTorch (from the trace):\n");
        printf("  allocations %" PRIu64 ", segment allocs %" PRIu64 ", frees %" PRIu64
               ", OOMs %" PRIu64 ", peak reserved %" PRId64 "\n",
               r->expected_allocs, r->expected_segment_allocs, r->expected_segment_frees,
               r->expected_ooms, r->expected_peak_reserved_bytes);
        printf("  memory_stats keys differing  %" PRIu64 "%s%s\n", r->stats_mismatches,
               r->stats_mismatches ? "  first: " : "", r->first_stats_mismatch);
        printf("  memory_summary identical     %s\n", r->summary_matches ? "yes" : "no");
    }
    if (r->memory_summary)
        printf("\n%s", r->memory_summary);
}

static void json_string(const char *s)
{
    putchar('"');
    for (; *s; s++) {
        if (*s == '"' || *s == '\\')
            printf("\\%c", *s);
        else if (*s == '\n')
            printf("\\n");
        else if ((unsigned char)*s < 0x20)
            printf("\\u%04x", (unsigned char)*s);
        else
            putchar(*s);
    }
    putchar('"');
}

static void print_json(const cca_replay_result_t *r, bool trace_addresses)
{
    printf("{\"settings\": ");
    json_string(r->settings);
    printf(", \"events\": %" PRIu64 ", \"allocs\": %" PRIu64 ", \"segment_allocs\": %" PRIu64
           ", \"segment_frees\": %" PRIu64 ", \"ooms\": %" PRIu64 ", \"pool_ops\": %" PRIu64,
           r->events, r->allocs, r->segment_allocs, r->segment_frees, r->ooms, r->pool_ops);
    printf(", \"late_segment_allocs\": %" PRIu64 ", \"late_segment_frees\": %" PRIu64
           ", \"cached_free_bytes\": %" PRIu64 ", \"largest_free_bytes\": %" PRIu64,
           r->late_segment_allocs, r->late_segment_frees, r->cached_free_bytes, r->largest_free_bytes);
    printf(", \"step_allocations\": %" PRIu64 ", \"last_step_segment_allocs\": %" PRIu64
           ", \"last_step_segment_frees\": %" PRIu64,
           r->step_allocations, r->last_step_segment_allocs, r->last_step_segment_frees);
    printf(", \"compact_moves\": %" PRIu64 ", \"compact_pending_growths\": %" PRIu64, r->compact_moves,
           r->compact_pending_growths);
    printf(", \"peak_reserved_bytes\": %" PRId64 ", \"peak_allocated_bytes\": %" PRId64
           ", \"peak_requested_bytes\": %" PRId64,
           r->peak_reserved_bytes, r->peak_allocated_bytes, r->peak_requested_bytes);
    if (trace_addresses)
        printf(", \"address_mismatches\": %" PRIu64, r->address_mismatches);
    printf(", \"events_per_second\": %.0f, \"replay_seconds\": %.6f, \"load_seconds\": %.6f"
           ", \"overlapped\": %s",
           r->events_per_second, r->seconds, r->load_seconds, r->overlapped ? "true" : "false");
    if (r->has_expected)
        printf(", \"expected\": {\"allocs\": %" PRIu64 ", \"segment_allocs\": %" PRIu64
               ", \"segment_frees\": %" PRIu64 ", \"ooms\": %" PRIu64
               ", \"peak_reserved_bytes\": %" PRId64 ", \"memory_stats_mismatches\": %" PRIu64
               ", \"memory_summary_matches\": %s}",
               r->expected_allocs, r->expected_segment_allocs, r->expected_segment_frees,
               r->expected_ooms, r->expected_peak_reserved_bytes, r->stats_mismatches,
               r->summary_matches ? "true" : "false");
    printf(", \"memory_stats\": {");
    for (int i = 0; i < 122; i++)
        printf("%s\"%s\": %" PRId64, i ? ", " : "", r->memory_stats[i].key, r->memory_stats[i].value);
    printf("}, \"memory_summary\": ");
    json_string(r->memory_summary ? r->memory_summary : "");
    printf("}\n");
}

static int compare(const char *path, const cca_replay_options_t *base, char **settings, int count)
{
    printf("%-48s %14s %14s %9s %9s %10s %5s %11s %10s %11s\n", "settings", "peak reserved", "peak alloc",
           "segments", "res/req", "frag@peak", "OOMs", "2nd half", "last step", "moves");
    int rc = 0;
    for (int i = 0; i < count; i++) {
        cca_replay_options_t opt = *base;
        opt.settings = settings[i];
        opt.trace_addresses = false;
        opt.snapshot_path = opt.svg_path = NULL; /* one picture per replay: not with --compare */
        cca_replay_result_t r;
        cca_status_t st = cca_replay_file(path, &opt, &r);
        if (st != CCA_OK) {
            printf("%-48s error: %s\n", settings[i][0] ? settings[i] : "(default)", cca_last_error()->message);
            rc = 1;
            continue;
        }
        double ratio = r.peak_requested_bytes ? (double)r.peak_reserved_bytes / (double)r.peak_requested_bytes : 0;
        double frag = r.peak_reserved_bytes ? 1.0 - (double)r.peak_allocated_bytes / (double)r.peak_reserved_bytes : 0;
        char late[32];
        snprintf(late, sizeof(late), "%" PRIu64 "/%" PRIu64, r.late_segment_allocs, r.late_segment_frees);
        char step[32] = "-";
        if (r.step_allocations)
            snprintf(step, sizeof(step), "%" PRIu64 "/%" PRIu64, r.last_step_segment_allocs,
                     r.last_step_segment_frees);
        char moves[32];
        snprintf(moves, sizeof(moves), "%" PRIu64 "/%" PRIu64, r.compact_moves, r.compact_pending_growths);
        printf("%-48s %11.1f MiB %11.1f MiB %9" PRIu64 " %9.3f %9.1f%% %5" PRIu64 " %11s %10s %11s\n",
               settings[i][0] ? settings[i] : "(default)", (double)r.peak_reserved_bytes / 1048576.0,
               (double)r.peak_allocated_bytes / 1048576.0, r.segment_allocs, ratio, frag * 100.0, r.ooms,
               late, step, moves);
        cca_replay_result_free(&r);
    }
    return rc;
}

int cmd_replay(int argc, char **argv)
{
    cca_replay_options_t opt;
    memset(&opt, 0, sizeof(opt));
    const char *path = NULL, *addresses = NULL;
    bool json = false;
    int compare_at = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        bool has_value = i + 1 < argc;
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            usage(stdout);
            return 0;
        } else if (!strcmp(a, "--json")) {
            json = true;
        } else if (!strcmp(a, "--no-fraction")) {
            opt.ignore_fraction = true;
        } else if (!strcmp(a, "--sequential")) {
            opt.sequential = true;
        } else if (!strcmp(a, "--compare")) {
            compare_at = i + 1;
            break;
        } else if (!strcmp(a, "--snapshot") && has_value) {
            opt.snapshot_path = argv[++i];
        } else if (!strcmp(a, "--svg") && has_value) {
            opt.svg_path = argv[++i];
        } else if (!strcmp(a, "--settings") && has_value) {
            opt.settings = argv[++i];
        } else if ((!strcmp(a, "--cap") || !strcmp(a, "--total-memory")) && has_value) {
            size_t v = 0;
            if (parse_size(argv[i + 1], &v) != 0 || v == 0) {
                fprintf(stderr, "cca replay: %s %s: expected a size in bytes (K/M/G/T suffixes allowed)\n", a, argv[i + 1]);
                return 2;
            }
            if (!strcmp(a, "--cap"))
                opt.cap = v;
            else
                opt.total_memory = v;
            i++;
        } else if (!strcmp(a, "--addresses") && has_value) {
            addresses = argv[++i];
            if (strcmp(addresses, "trace") && strcmp(addresses, "fresh")) {
                fprintf(stderr, "cca replay: --addresses %s: expected trace or fresh\n", addresses);
                return 2;
            }
        } else if (!strcmp(a, "--event-lag") && has_value) {
            char *end = NULL;
            unsigned long long lag = strtoull(argv[++i], &end, 10);
            if (*end || argv[i][0] == '-' || !argv[i][0]) {
                fprintf(stderr, "cca replay: --event-lag %s: expected a count of trace events\n", argv[i]);
                return 2;
            }
            opt.event_lag = lag;
        } else if (!strcmp(a, "--device") && has_value) {
            char *end = NULL;
            long d = strtol(argv[++i], &end, 10);
            if (*end || d < 0 || d > 1024) {
                fprintf(stderr, "cca replay: --device %s: expected a device index\n", argv[i]);
                return 2;
            }
            opt.device = (int)d;
        } else if (a[0] == '-' || path) {
            fprintf(stderr, "cca replay: unexpected argument '%s'\n", a);
            usage(stderr);
            return 2;
        } else {
            path = a;
        }
    }
    if (!path) {
        usage(stderr);
        return 2;
    }
    if (compare_at) {
        if (compare_at >= argc) {
            fprintf(stderr, "cca replay: --compare needs at least one settings string\n");
            return 2;
        }
        return compare(path, &opt, argv + compare_at, argc - compare_at);
    }
    opt.trace_addresses = addresses ? !strcmp(addresses, "trace") : opt.settings == NULL;
    cca_replay_result_t r;
    cca_status_t st = cca_replay_file(path, &opt, &r);
    if (st != CCA_OK) {
        fprintf(stderr, "cca replay: %s: %s\n", path, cca_last_error()->message);
        return 1;
    }
    if (json)
        print_json(&r, opt.trace_addresses);
    else
        print_human(path, &r, opt.trace_addresses);
    cca_replay_result_free(&r);
    return 0;
}
