/*
 * cmd_replay.c - `cca replay TRACE [options]`: replay a PyTorch memory
 * snapshot through cca on a simulated device and report what it needed;
 * --compare replays it under several settings strings (--explain and --fit:
 * cmd_replay_explain.c).
 */
#include <errno.h>
#include <inttypes.h>
#include <stdint.h>
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
            "                        [--event-lag N] [--sequential] [--strict]\n"
            "                        [--compare SETTINGS [SETTINGS...]]\n"
            "                        [--explain] [--fit [SETTINGS...]]\n"
            "Replays TRACE (a PyTorch memory snapshot, .pickle or .pickle.gz) through cca on a\n"
            "simulated device. BYTES accept K/M/G/T suffixes. --addresses trace (the default\n"
            "without --settings) hands out PyTorch's segment addresses and compares every\n"
            "allocation with PyTorch's. --compare replays under each settings string (up to\n"
            "the next option; '' is PyTorch's default) and prints a table (--json: a list).\n"
            "--explain tells what was live at the peak of reserved memory by call site,\n"
            "annotation and stream, where the cached free memory lay, and the peak under\n"
            "other settings. --fit finds, by replay, the smallest device on which TRACE runs\n"
            "without an out-of-memory error under each settings string given (by default\n"
            "the trace's own, expandable segments and compact memory).\n"
            "--snapshot writes the allocator's state at the end with the history recorded\n"
            "during the replay (PyTorch's snapshot format); --svg draws them.\n"
            "--event-lag N: an event cca records on a trace's stream completes N trace events\n"
            "later, as on a GPU running behind the host (default 0: at once).\n"
            "The replay runs on a second thread while TRACE is read, and again after the\n"
            "reading if the trace's settings (at the end of the file) differ from what it\n"
            "assumed; --sequential reads the whole file first. The result is the same.\n"
            "A snapshot recorded mid-run replays from the state before its first event,\n"
            "inferred from its segments. Every device is replayed unless --device is given\n"
            "(--explain, --fit and --compare: device 0 unless --device is given).\n"
            "Inconsistent input is counted and named; --strict stops at it.\n");
}

static void print_mib(const char *label, int64_t bytes)
{
    printf("  %-28s %14" PRId64 " bytes  (%.1f MiB)\n", label, bytes, (double)bytes / 1048576.0);
}

void replay_print_human(const char *path, const cca_replay_result_t *r, bool trace_addresses)
{
    if (r->device_count > 1)
        printf("cca replay: %s, device %d\n", path, r->device);
    else
        printf("cca replay: %s\n", path);
    printf("  settings                     '%s'\n", r->settings);
    if (r->recorded_part_only)
        printf("  before the first event       %" PRIu64 " segments (%.1f MiB), %" PRIu64
               " blocks live (%.1f MiB), inferred; the figures cover the recorded part\n",
               r->inferred_segments, (double)r->inferred_reserved_bytes / 1048576.0, r->inferred_blocks,
               (double)r->inferred_requested_bytes / 1048576.0);
    if (r->ambiguous_blocks)
        printf("  sizes not in the file        %" PRIu64 " of those blocks may hold up to 1 MiB more, left "
               "unsplit by PyTorch (each taken at its rounded size)\n", r->ambiguous_blocks);
    if (r->inconsistencies)
        printf("  inconsistent input           %" PRIu64 "  first: %s\n", r->inconsistencies,
               r->first_inconsistency);
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

/* The replay's JSON object (no newline): the keys of cca.replay() in Python. */
void replay_print_json_object(const cca_replay_result_t *r, bool trace_addresses)
{
    printf("{\"settings\": ");
    cli_json_string(stdout, r->settings);
    printf(", \"device\": %d, \"device_count\": %zu, \"recorded_part_only\": %s, \"inferred_segments\": %" PRIu64
           ", \"inferred_blocks\": %" PRIu64 ", \"inferred_reserved_bytes\": %" PRIu64
           ", \"inferred_requested_bytes\": %" PRIu64 ", \"ambiguous_blocks\": %" PRIu64
           ", \"inconsistencies\": %" PRIu64 ", \"first_inconsistency\": ",
           r->device, r->device_count, r->recorded_part_only ? "true" : "false", r->inferred_segments,
           r->inferred_blocks, r->inferred_reserved_bytes, r->inferred_requested_bytes, r->ambiguous_blocks,
           r->inconsistencies);
    cli_json_string(stdout, r->first_inconsistency);
    printf(", \"events\": %" PRIu64 ", \"allocs\": %" PRIu64 ", \"frees\": %" PRIu64
           ", \"segment_allocs\": %" PRIu64 ", \"segment_frees\": %" PRIu64 ", \"ooms\": %" PRIu64
           ", \"unexpected_ooms\": %" PRIu64 ", \"pool_ops\": %" PRIu64,
           r->events, r->allocs, r->frees, r->segment_allocs, r->segment_frees, r->ooms,
           r->unexpected_ooms, r->pool_ops);
    printf(", \"late_segment_allocs\": %" PRIu64 ", \"late_segment_frees\": %" PRIu64
           ", \"cached_free_bytes\": %" PRIu64 ", \"largest_free_bytes\": %" PRIu64,
           r->late_segment_allocs, r->late_segment_frees, r->cached_free_bytes, r->largest_free_bytes);
    printf(", \"step_allocations\": %" PRIu64 ", \"last_step_segment_allocs\": %" PRIu64
           ", \"last_step_segment_frees\": %" PRIu64,
           r->step_allocations, r->last_step_segment_allocs, r->last_step_segment_frees);
    printf(", \"compact_moves\": %" PRIu64 ", \"compact_pending_growths\": %" PRIu64, r->compact_moves,
           r->compact_pending_growths);
    printf(", \"peak_reserved_bytes\": %" PRId64 ", \"peak_allocated_bytes\": %" PRId64
           ", \"peak_requested_bytes\": %" PRId64 ", \"peak_active_bytes\": %" PRId64,
           r->peak_reserved_bytes, r->peak_allocated_bytes, r->peak_requested_bytes, r->peak_active_bytes);
    if (trace_addresses) {
        printf(", \"address_mismatches\": %" PRIu64 ", \"first_address_mismatch\": ", r->address_mismatches);
        cli_json_string(stdout, r->first_address_mismatch);
    }
    printf(", \"events_per_second\": %.0f, \"replay_seconds\": %.6f, \"load_seconds\": %.6f"
           ", \"overlapped\": %s",
           r->events_per_second, r->seconds, r->load_seconds, r->overlapped ? "true" : "false");
    if (r->has_expected) {
        printf(", \"expected\": {\"allocs\": %" PRIu64 ", \"segment_allocs\": %" PRIu64
               ", \"segment_frees\": %" PRIu64 ", \"ooms\": %" PRIu64
               ", \"peak_reserved_bytes\": %" PRId64 ", \"memory_stats_mismatches\": %" PRIu64
               ", \"first_memory_stats_mismatch\": ",
               r->expected_allocs, r->expected_segment_allocs, r->expected_segment_frees,
               r->expected_ooms, r->expected_peak_reserved_bytes, r->stats_mismatches);
        cli_json_string(stdout, r->first_stats_mismatch);
        printf(", \"memory_summary_matches\": %s}", r->summary_matches ? "true" : "false");
    }
    printf(", \"memory_stats\": {");
    for (int i = 0; i < CCA_MEMORY_STATS_COUNT; i++)
        printf("%s\"%s\": %" PRId64, i ? ", " : "", r->memory_stats[i].key, r->memory_stats[i].value);
    printf("}, \"memory_summary\": ");
    cli_json_string(stdout, r->memory_summary ? r->memory_summary : "");
    printf("}");
}

/* --compare: one replay per settings string, a table (or a JSON list). */
static int compare(const char *path, const cca_replay_options_t *base, char **settings, int count,
                   bool json)
{
    if (json)
        printf("[");
    else
        printf("%-48s %14s %14s %9s %9s %10s %5s %11s %10s %11s%s\n", "settings", "peak reserved",
               "peak alloc", "segments", "res/req", "frag@peak", "OOMs", "2nd half", "last step", "moves",
               base->trace_addresses ? "  addr mismatches" : "");
    int rc = 0;
    for (int i = 0; i < count; i++) {
        cca_replay_options_t opt = *base;
        opt.settings = settings[i];
        opt.snapshot_path = opt.svg_path = NULL; /* one picture per replay: not with --compare */
        const char *label = settings[i][0] ? settings[i] : "(default)";
        cca_replay_result_t r;
        cca_status_t st = cca_replay_file(path, &opt, &r);
        if (st != CCA_OK) {
            if (json) {
                printf("%s{\"settings\": ", i ? ", " : "");
                cli_json_string(stdout, settings[i]);
                printf(", \"error\": ");
                cli_json_string(stdout, cca_last_error()->message);
                printf("}");
            } else {
                printf("%-48s error: %s\n", label, cca_last_error()->message);
            }
            cca_replay_result_free(&r);
            rc = 1;
            continue;
        }
        if (json) {
            printf("%s", i ? ", " : "");
            replay_print_json_object(&r, opt.trace_addresses);
            cca_replay_result_free(&r);
            continue;
        }
        double ratio = r.peak_requested_bytes ? (double)r.peak_reserved_bytes / (double)r.peak_requested_bytes : 0;
        double frag = r.peak_reserved_bytes ? 1.0 - (double)r.peak_allocated_bytes / (double)r.peak_reserved_bytes : 0;
        char late[48];
        snprintf(late, sizeof(late), "%" PRIu64 "/%" PRIu64, r.late_segment_allocs, r.late_segment_frees);
        char step[48] = "-";
        if (r.step_allocations)
            snprintf(step, sizeof(step), "%" PRIu64 "/%" PRIu64, r.last_step_segment_allocs,
                     r.last_step_segment_frees);
        char moves[48];
        snprintf(moves, sizeof(moves), "%" PRIu64 "/%" PRIu64, r.compact_moves, r.compact_pending_growths);
        printf("%-48s %11.1f MiB %11.1f MiB %9" PRIu64 " %9.3f %9.1f%% %5" PRIu64 " %11s %10s %11s",
               label, (double)r.peak_reserved_bytes / 1048576.0,
               (double)r.peak_allocated_bytes / 1048576.0, r.segment_allocs, ratio, frag * 100.0, r.ooms,
               late, step, moves);
        if (opt.trace_addresses)
            printf("  %" PRIu64, r.address_mismatches);
        printf("\n");
        cca_replay_result_free(&r);
    }
    if (json)
        printf("]\n");
    return rc;
}

/* The options that take a value. */
static bool takes_value(const char *a)
{
    static const char *const names[] = {"--settings", "--cap", "--total-memory", "--addresses",
                                        "--event-lag", "--device", "--snapshot", "--svg"};
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++)
        if (!strcmp(a, names[i]))
            return true;
    return false;
}

/* An option's value: the next argument, unless there is none or it is another option. */
static bool is_option(const char *a)
{
    return a[0] == '-' && a[1] == '-';
}

int cmd_replay(int argc, char **argv)
{
    cca_replay_options_t opt;
    memset(&opt, 0, sizeof(opt));
    const char *path = NULL, *addresses = NULL;
    bool json = false, explain = false, fit = false, one_device = false;
    char **list = NULL; /* --compare's or --fit's settings strings */
    int list_count = 0, compare_count = -1;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (takes_value(a) && (i + 1 >= argc || is_option(argv[i + 1]))) {
            fprintf(stderr, "cca replay: %s needs a value\n", a);
            return 2;
        }
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            usage(stdout);
            return 0;
        } else if (!strcmp(a, "--json")) {
            json = true;
        } else if (!strcmp(a, "--explain")) {
            explain = true;
        } else if (!strcmp(a, "--no-fraction")) {
            opt.ignore_fraction = true;
        } else if (!strcmp(a, "--sequential")) {
            opt.sequential = true;
        } else if (!strcmp(a, "--strict")) {
            opt.strict = true;
        } else if (!strcmp(a, "--compare") || !strcmp(a, "--fit")) {
            if (list) {
                fprintf(stderr, "cca replay: --compare and --fit are given once, and not together\n");
                return 2;
            }
            list = argv + i + 1;
            while (i + 1 < argc && !is_option(argv[i + 1]))
                i++;
            list_count = (int)(argv + i + 1 - list);
            if (!strcmp(a, "--fit")) {
                fit = true;
            } else if (list_count == 0) {
                fprintf(stderr, "cca replay: --compare needs at least one settings string\n");
                return 2;
            } else {
                compare_count = list_count;
            }
        } else if (!strcmp(a, "--snapshot")) {
            opt.snapshot_path = argv[++i];
        } else if (!strcmp(a, "--svg")) {
            opt.svg_path = argv[++i];
        } else if (!strcmp(a, "--settings")) {
            opt.settings = argv[++i];
        } else if (!strcmp(a, "--cap") || !strcmp(a, "--total-memory")) {
            size_t v = 0;
            if (cli_parse_size(argv[i + 1], &v) != 0 || v == 0) {
                fprintf(stderr, "cca replay: %s %s: expected a size in bytes from 1 to %zu "
                        "(K/M/G/T suffixes allowed)\n", a, argv[i + 1], (size_t)SIZE_MAX);
                return 2;
            }
            if (!strcmp(a, "--cap"))
                opt.cap = v;
            else
                opt.total_memory = v;
            i++;
        } else if (!strcmp(a, "--addresses")) {
            addresses = argv[++i];
            if (strcmp(addresses, "trace") && strcmp(addresses, "fresh")) {
                fprintf(stderr, "cca replay: --addresses %s: expected trace or fresh\n", addresses);
                return 2;
            }
        } else if (!strcmp(a, "--event-lag")) {
            char *end = NULL;
            errno = 0;
            unsigned long long lag = strtoull(argv[++i], &end, 10);
            if (*end || argv[i][0] < '0' || argv[i][0] > '9' || errno == ERANGE) {
                fprintf(stderr, "cca replay: --event-lag %s: expected a count of trace events\n", argv[i]);
                return 2;
            }
            opt.event_lag = lag;
        } else if (!strcmp(a, "--device")) {
            char *end = NULL;
            long d = strtol(argv[++i], &end, 10);
            if (*end || !argv[i][0] || d < 0 || d > 1024) {
                fprintf(stderr, "cca replay: --device %s: expected a device index\n", argv[i]);
                return 2;
            }
            opt.device = (int)d;
            one_device = true;
        } else if (a[0] == '-' || path) {
            fprintf(stderr, "cca replay: unexpected argument '%s'\n", a);
            usage(stderr);
            return 2;
        } else {
            path = a;
        }
    }
    if (!path && list_count > 0) {
        fprintf(stderr, "cca replay: no TRACE given: %s takes the settings strings after it, up to the "
                "next option ('%s' is one); put TRACE first\n", fit ? "--fit" : "--compare", list[list_count - 1]);
        return 2;
    }
    if (!path) {
        usage(stderr);
        return 2;
    }
    if ((explain ? 1 : 0) + (fit ? 1 : 0) + (compare_count >= 0 ? 1 : 0) > 1) {
        fprintf(stderr, "cca replay: --explain, --fit and --compare are used one at a time\n");
        return 2;
    }
    if (!cli_input_ok("replay", path))
        return 1;
    if (compare_count >= 0) {
        opt.trace_addresses = addresses && !strcmp(addresses, "trace");
        return compare(path, &opt, list, compare_count, json);
    }
    if (fit)
        return replay_fit(path, &opt, list, list_count, json);
    opt.trace_addresses = addresses ? !strcmp(addresses, "trace") : opt.settings == NULL;
    if (explain)
        return replay_explain(path, &opt, json);
    cca_replay_result_t one, *rs = &one;
    size_t n = 1;
    cca_status_t st = one_device ? cca_replay_file(path, &opt, &one)
                                 : cca_replay_file_devices(path, &opt, &rs, &n);
    if (st != CCA_OK) {
        cli_report_error("replay", path);
        if (one_device)
            cca_replay_result_free(&one);
        return 1;
    }
    if (json && n > 1) /* one object per device, in a list */
        printf("[");
    for (size_t d = 0; d < n; d++) {
        if (json && d)
            printf(", ");
        if (json)
            replay_print_json_object(&rs[d], opt.trace_addresses);
        else
            replay_print_human(path, &rs[d], opt.trace_addresses);
    }
    if (json)
        printf("%s\n", n > 1 ? "]" : "");
    if (one_device)
        cca_replay_result_free(&one);
    else
        cca_replay_results_free(rs, n);
    return 0;
}
