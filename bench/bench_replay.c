/*
 * bench_replay.c - CPU benchmark of `cca replay` against Python's own reading
 * of the same file: the whole replay of a PyTorch memory snapshot, loading
 * included (cca_replay_file with the trace's addresses, as `cca replay` does),
 * beside Python's gunzip + unpickle of that file, in the same run.
 *
 *   bench_replay [TRACE] [--runs N]
 *     TRACE   default tests/data/traces/gpt2_generate_default.pickle.gz
 *
 * Each cca replay runs in a child process, so its peak resident memory is its
 * own. Both sides are timed the same two ways: the first run in a fresh
 * process (cold: every page faulted in, as one `cca replay` command does) and
 * the best of N runs in one process (warm, as Python's best of N in one
 * interpreter is). Python is run as `python3` (gzip.open(TRACE).read(), then
 * pickle.loads); without python3 the ratios are not printed. Goal
 * (DESIGN.md): ratio <= 0.2, peak RSS <= 60 MB.
 *
 * cca_replay_file replays on a second thread while it reads the file (the
 * default, whose figures the ratios use); the same runs are made again with
 * the replay after the reading (options.sequential), for comparison.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "cca.h"

typedef struct child_report {
    double seconds;          /* cca_replay_file, load included: the child's first run */
    double warm_seconds;     /* the best of the child's runs after the first */
    double load_seconds;     /* of which reading and decoding */
    double replay_seconds;   /* the replay's own time (during the reading when overlapped) */
    bool overlapped;         /* replayed while the file was read */
    /* the process's CPU time (every thread), voluntary context switches and minor page
     * faults during the first run and during the fastest later one */
    double cpu_seconds, warm_cpu_seconds;
    long waits, warm_waits, faults, warm_faults;
    uint64_t events, address_mismatches, stats_mismatches;
    bool summary_matches, ok;
} child_report_t;

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static double cpu_s(const struct rusage *ru)
{
    return (double)(ru->ru_utime.tv_sec + ru->ru_stime.tv_sec) +
           (double)(ru->ru_utime.tv_usec + ru->ru_stime.tv_usec) * 1e-6;
}

/* One cca_replay_file: its wall time; *cpu, *waits, *faults as in child_report_t. */
static cca_status_t timed_replay(const char *path, const cca_replay_options_t *opt,
                                 cca_replay_result_t *r, double *wall, double *cpu, long *waits,
                                 long *faults)
{
    struct rusage a, b;
    getrusage(RUSAGE_SELF, &a);
    double t0 = now_s();
    cca_status_t st = cca_replay_file(path, opt, r);
    *wall = now_s() - t0;
    getrusage(RUSAGE_SELF, &b);
    *cpu = cpu_s(&b) - cpu_s(&a);
    *waits = b.ru_nvcsw - a.ru_nvcsw;
    *faults = b.ru_minflt - a.ru_minflt;
    return st;
}

/* Replays in a child (the first, then `again` more); fills *rep and *rss_kb (the child's peak RSS). */
static bool replay_in_child(const char *path, bool sequential, int again, child_report_t *rep,
                            long *rss_kb)
{
    int fds[2];
    if (pipe(fds) != 0)
        return false;
    pid_t pid = fork();
    if (pid < 0)
        return false;
    if (pid == 0) {
        close(fds[0]);
        child_report_t out;
        memset(&out, 0, sizeof(out));
        cca_replay_options_t opt;
        memset(&opt, 0, sizeof(opt));
        opt.trace_addresses = true;
        opt.sequential = sequential;
        cca_replay_result_t r;
        cca_status_t st = timed_replay(path, &opt, &r, &out.seconds, &out.cpu_seconds, &out.waits,
                                       &out.faults);
        out.warm_seconds = 1e9;
        for (int i = 0; i < again && st == CCA_OK; i++) {
            cca_replay_result_t w;
            double dt, cpu;
            long waits, faults;
            st = timed_replay(path, &opt, &w, &dt, &cpu, &waits, &faults);
            if (st == CCA_OK)
                cca_replay_result_free(&w);
            if (dt < out.warm_seconds) {
                out.warm_seconds = dt;
                out.warm_cpu_seconds = cpu;
                out.warm_waits = waits;
                out.warm_faults = faults;
            }
        }
        if (st == CCA_OK) {
            out.ok = true;
            out.load_seconds = r.load_seconds;
            out.replay_seconds = r.seconds;
            out.overlapped = r.overlapped;
            out.events = r.events;
            out.address_mismatches = r.address_mismatches;
            out.stats_mismatches = r.stats_mismatches;
            out.summary_matches = r.summary_matches;
            cca_replay_result_free(&r);
        } else {
            fprintf(stderr, "replay failed: %s\n", cca_last_error()->message);
        }
        ssize_t w = write(fds[1], &out, sizeof(out));
        _exit(w == (ssize_t)sizeof(out) && out.ok ? 0 : 1);
    }
    close(fds[1]);
    ssize_t got = read(fds[0], rep, sizeof(*rep));
    close(fds[0]);
    int status = 0;
    struct rusage ru;
    if (wait4(pid, &status, 0, &ru) < 0)
        return false;
    *rss_kb = ru.ru_maxrss;
    return got == (ssize_t)sizeof(*rep) && WIFEXITED(status) && WEXITSTATUS(status) == 0;
}

/* Python's gunzip + unpickle time of the file: its first run (*first) and the best of
 * runs, in one interpreter; false if python3 is missing. */
static bool python_seconds(const char *path, int runs, double *first, double *best)
{
    char cmd[4096];
    snprintf(cmd, sizeof(cmd),
             "python3 -c 'import gzip, pickle, sys, time\n"
             "times = []\n"
             "for _ in range(%d):\n"
             "    t = time.perf_counter()\n"
             "    with gzip.open(sys.argv[1], \"rb\") as f:\n"
             "        data = f.read()\n"
             "    obj = pickle.loads(data)\n"
             "    times.append(time.perf_counter() - t)\n"
             "    del obj, data\n"
             "print(times[0], min(times[1:] or times))' '%s' 2>/dev/null",
             runs + 1, path);
    FILE *p = popen(cmd, "r");
    if (!p)
        return false;
    bool ok = fscanf(p, "%lf %lf", first, best) == 2;
    if (pclose(p) != 0)
        ok = false;
    return ok;
}

/* runs children replaying path: *best the fastest first run, *first the first child (with
 * its warm runs), *rss_max the largest peak RSS of a child that replayed once. */
static bool replay_runs(const char *path, bool sequential, int runs, child_report_t *best,
                        child_report_t *first, long *rss_max)
{
    memset(best, 0, sizeof(*best));
    memset(first, 0, sizeof(*first));
    best->seconds = 1e9;
    *rss_max = 0;
    for (int i = 0; i < runs; i++) {
        child_report_t rep;
        long rss = 0;
        if (!replay_in_child(path, sequential, i == 0 || runs == 1 ? runs : 0, &rep, &rss))
            return false;
        if (rep.seconds < best->seconds)
            *best = rep;
        if (i == 0)
            *first = rep;
        /* the peak RSS of one replay: from the children that ran one (unless there is none) */
        if ((i > 0 || runs == 1) && rss > *rss_max)
            *rss_max = rss;
    }
    return true;
}

int main(int argc, char **argv)
{
    const char *path = "tests/data/traces/gpt2_generate_default.pickle.gz";
    int runs = 5;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--runs") && i + 1 < argc)
            runs = atoi(argv[++i]);
        else if (argv[i][0] != '-')
            path = argv[i];
        else {
            fprintf(stderr, "usage: bench_replay [TRACE] [--runs N]\n");
            return 2;
        }
    }
    if (runs < 1)
        runs = 1;
    if (access(path, R_OK) != 0) {
        fprintf(stderr, "bench_replay: cannot read %s (run from the source root)\n", path);
        return 1;
    }
    child_report_t best, first_child, seq_best, seq_first;
    long rss_max = 0, seq_rss = 0;
    if (!replay_runs(path, false, runs, &best, &first_child, &rss_max) ||
        !replay_runs(path, true, runs, &seq_best, &seq_first, &seq_rss)) {
        fprintf(stderr, "bench_replay: the replay failed\n");
        return 1;
    }
    double py_first = 0, py_best = 0;
    bool have_py = python_seconds(path, runs, &py_first, &py_best);
    printf("replay benchmark: %s (%llu events), %d runs\n", path, (unsigned long long)best.events, runs);
    printf("  cca replay, load included, cold  %8.1f ms  (best first run of a process: load %.1f ms, "
           "replay %.1f ms%s), peak RSS %.1f MB\n",
           best.seconds * 1e3, best.load_seconds * 1e3, best.replay_seconds * 1e3,
           best.overlapped ? " on a second thread during the load" : " after the load",
           (double)rss_max / 1024.0);
    double warm = first_child.warm_seconds;
    printf("  cca replay, load included, warm  %8.1f ms  (best of %d more runs in one process)\n",
           warm * 1e3, runs);
    printf("  replay after the load (sequential): cold %.1f ms (load %.1f ms, replay %.1f ms), "
           "warm %.1f ms, peak RSS %.1f MB\n",
           seq_best.seconds * 1e3, seq_best.load_seconds * 1e3, seq_best.replay_seconds * 1e3,
           seq_first.warm_seconds * 1e3, (double)seq_rss / 1024.0);
    printf("  cold run: CPU %.1f ms (every thread), %ld waits, %ld page faults; "
           "warm run: CPU %.1f ms, %ld waits, %ld page faults\n",
           best.cpu_seconds * 1e3, best.waits, best.faults, first_child.warm_cpu_seconds * 1e3,
           first_child.warm_waits, first_child.warm_faults);
    printf("  exact: %llu address mismatches, %llu statistics mismatches, summary %s\n",
           (unsigned long long)best.address_mismatches, (unsigned long long)best.stats_mismatches,
           best.summary_matches ? "identical" : "DIFFERENT");
    if (!have_py) {
        printf("  python3 gunzip + unpickle        (python3 not available: ratios not measured)\n");
        return 0;
    }
    printf("  python3 gunzip + unpickle, cold  %8.1f ms  (the first run of the interpreter)\n", py_first * 1e3);
    printf("  python3 gunzip + unpickle, warm  %8.1f ms  (best of %d more runs)\n", py_best * 1e3, runs);
    printf("  ratio cca / python, cold         %8.3f\n", best.seconds / py_first);
    printf("  ratio cca / python, warm         %8.3f  (goal <= 0.2; peak RSS goal <= 60 MB)\n",
           warm / py_best);
    return 0;
}
