/*
 * test_replay_overlap.c - a replay run on a second thread while its trace is
 * read gives exactly the result of a replay after the reading: on every
 * bundled PyTorch trace, and on made-up traces whose configuration (written
 * at the end of the file) breaks the thread's guess in each way it can: its
 * settings, its memory fraction, a device too small for the replay, an
 * out-of-memory event, expandable segments without a device size. A file
 * that cannot be read to its end fails the same way in both modes. Runs under
 * TSan too (label stress), there on the bundled traces of up to 400 KB only:
 * what TSan checks is the threading of the overlap (the reader handing
 * batches to the replay, the guess standing or the replay redone), and those
 * traces hold every class (the guess standing; redone for settings, for a
 * graph, a MemPool, a model used after training), each read in many batches;
 * the eleven larger ones (15 of the 20 MB) add events, not paths, and take three
 * quarters of the time. Every trace still runs under ASan and without a
 * sanitizer.
 */
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cca.h"
#include "harness.h"
#include "pickle.h"
#include "replay_compare.h"

static const char *trace_dir = "tests/data/traces";

#if defined(__SANITIZE_THREAD__)
#define UNDER_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define UNDER_TSAN 1
#endif
#endif
/* The bundled traces replayed: all, or under TSan those of up to 400 KB (see above). */
#ifdef UNDER_TSAN
#define TRACE_MAX_BYTES (400 * 1024)
#else
#define TRACE_MAX_BYTES ((off_t)1 << 40)
#endif

/* Replay path both ways; returns whether the second thread's replay stood (-1: failed). */
static uint64_t last_unexpected_ooms; /* of the last replay_both */

static int replay_both(const char *path, const cca_replay_options_t *base)
{
    cca_replay_options_t opt = *base;
    cca_replay_result_t seq, ovl;
    opt.sequential = true;
    cca_status_t st = cca_replay_file(path, &opt, &seq);
    if (st != CCA_OK) {
        HARNESS_FAIL("%s: sequential replay failed: %s", path, cca_last_error()->message);
        return -1;
    }
    expect_false(seq.overlapped);
    opt.sequential = false;
    st = cca_replay_file(path, &opt, &ovl);
    if (st != CCA_OK) {
        HARNESS_FAIL("%s: replay failed: %s", path, cca_last_error()->message);
        cca_replay_result_free(&seq);
        return -1;
    }
    const char *diff = replay_result_diff(&seq, &ovl);
    if (diff)
        HARNESS_FAIL("%s: the results differ in %s", path, diff);
    last_unexpected_ooms = seq.unexpected_ooms;
    int overlapped = ovl.overlapped;
    cca_replay_result_free(&seq);
    cca_replay_result_free(&ovl);
    expect_false(cca_is_initialized());
    return overlapped;
}

/* Every bundled trace: the same result. The thread's replay stands where the trace ran
 * with PyTorch's default settings and no fraction or program operation (whatever its device
 * size), and is redone where not. */
TEST(bundled_traces_same_either_way)
{
    DIR *dir = opendir(trace_dir);
    expect_true(dir != NULL);
    if (!dir)
        return;
    struct dirent *de;
    int traces = 0, skipped = 0;
    while ((de = readdir(dir))) {
        if (!strstr(de->d_name, ".pickle"))
            continue;
        char path[512];
        snprintf(path, sizeof(path), "%s/%s", trace_dir, de->d_name);
        struct stat sb;
        if (stat(path, &sb) != 0) {
            HARNESS_FAIL("cannot stat %s", path);
            continue;
        }
        if (sb.st_size > TRACE_MAX_BYTES) {
            skipped++;
            continue;
        }
        cca_replay_options_t opt = {0};
        opt.trace_addresses = true;
        int overlapped = replay_both(path, &opt);
        /* traces with program operations (cca_meta["pool_events"], at the end of the file):
         * graph, MemPool, and a model trained then used after an empty_cache */
        bool plain = strstr(de->d_name, "_default.") && !strstr(de->d_name, "graph_") &&
                     !strstr(de->d_name, "mempool_") && !strstr(de->d_name, "_train_generate") &&
                     !strstr(de->d_name, "_train_infer");
        printf("  %-40s %s\n", de->d_name, overlapped == 1 ? "replayed while read" : "replayed after");
        expect_eq_i64(overlapped, plain ? 1 : 0);
        traces++;
    }
    closedir(dir);
    expect_true(traces >= 10);
    if (skipped)
        printf("  %d larger traces left to the runs without TSan\n", skipped);
}

/* ---- made-up traces ------------------------------------------------------------------ */

typedef struct fake {
    const char *conf;      /* cca_meta.conf */
    uint64_t total;        /* cca_meta.total_memory (0: none) */
    double fraction;       /* cca_meta.fraction */
    bool oom_event;        /* one oom event at the end */
} fake_t;

static void add_event(pv_doc_t *doc, pv_node_t *events, const char *action, uint64_t addr, uint64_t size,
                      uint64_t stream)
{
    pv_node_t *e = pv_new_dict(doc);
    expect_ok(pv_dict_set(doc, e, "action", pv_new_str(doc, action)));
    expect_ok(pv_dict_set(doc, e, strcmp(action, "oom") ? "addr" : "device_free", pv_new_u64(doc, addr)));
    expect_ok(pv_dict_set(doc, e, "size", pv_new_u64(doc, size)));
    expect_ok(pv_dict_set(doc, e, "stream", pv_new_u64(doc, stream)));
    expect_ok(pv_list_append(doc, events, e));
}

/* Write doc's root to a new file from template path (its XXXXXX replaced) and free doc;
 * false if no file could be made. */
static bool write_temp(pv_doc_t *doc, pv_node_t *root, char *path)
{
    int fd = mkstemp(path);
    expect_true(fd >= 0);
    if (fd >= 0) {
        close(fd);
        expect_ok(pickle_write_file(root, path));
    }
    pv_doc_free(doc);
    return fd >= 0;
}

/*
 * Write a trace of 3,000 allocations of 1 to 10 MiB on two streams, eight live
 * at a time (over 9,000 events: several batches of the reader), every fifth
 * free completed one event late, with the configuration f. Returns the path
 * (static buffer) or NULL.
 */
static const char *write_fake(const fake_t *f)
{
    static char path[64];
    pv_doc_t *doc = pv_doc_new();
    expect_true(doc != NULL);
    if (!doc)
        return NULL;
    pv_node_t *root = pv_new_dict(doc), *traces = pv_new_list(doc), *events = pv_new_list(doc);
    expect_ok(pv_dict_set(doc, root, "segments", pv_new_list(doc)));
    expect_ok(pv_dict_set(doc, root, "device_traces", traces));
    expect_ok(pv_list_append(doc, traces, events));
    enum { N = 3000, LIVE = 8 };
    uint64_t pending = 0; /* a free whose completion comes after the next event */
    for (uint64_t k = 0; k < N; k++) {
        uint64_t stream = 0x5500 + (k % 2) * 0x10;
        add_event(doc, events, "alloc", 0x100000 * (k + 1), ((k * 7) % 10 + 1) << 20, stream);
        if (pending) {
            add_event(doc, events, "free_completed", pending, 0, 0);
            pending = 0;
        }
        if (k >= LIVE) {
            uint64_t j = k - LIVE, addr = 0x100000 * (j + 1), size = ((j * 7) % 10 + 1) << 20;
            add_event(doc, events, "free_requested", addr, size, 0x5500 + (j % 2) * 0x10);
            if (k % 5)
                add_event(doc, events, "free_completed", addr, size, 0x5500 + (j % 2) * 0x10);
            else
                pending = addr;
        }
    }
    if (f->oom_event)
        add_event(doc, events, "oom", 0, 1ull << 40, 0x5500);
    pv_node_t *meta = pv_new_dict(doc);
    expect_ok(pv_dict_set(doc, meta, "conf", pv_new_str(doc, f->conf)));
    if (f->total)
        expect_ok(pv_dict_set(doc, meta, "total_memory", pv_new_u64(doc, f->total)));
    expect_ok(pv_dict_set(doc, meta, "fraction", pv_new_float(doc, f->fraction)));
    expect_ok(pv_dict_set(doc, root, "cca_meta", meta));
    snprintf(path, sizeof(path), "/tmp/cca_overlap_XXXXXX");
    return write_temp(doc, root, path) ? path : NULL;
}

/* Replay a made-up trace both ways with options opt; returns whether the thread's replay stood. */
static int fake_both(const fake_t *f, const cca_replay_options_t *opt)
{
    const char *path = write_fake(f);
    if (!path)
        return -1;
    int overlapped = replay_both(path, opt);
    unlink(path);
    return overlapped;
}

TEST(guess_checked_at_the_end)
{
    cca_replay_options_t opt = {0};
    /* PyTorch's default settings on a 1 GiB device: the guess holds (the device size did
     * not matter: nothing failed, the simulator never held more than 1 GiB) */
    expect_eq_i64(fake_both(&(fake_t){"", 1ull << 30, 0.0, false}, &opt), 1);
    expect_eq_u64(last_unexpected_ooms, 0);
    /* no device size in the trace: the default 80 GiB */
    expect_eq_i64(fake_both(&(fake_t){"", 0, 0.0, false}, &opt), 1);
    /* a device smaller than the replay needs: out of memory there, not on the guessed one */
    expect_eq_i64(fake_both(&(fake_t){"", 24ull << 20, 0.0, false}, &opt), 0);
    expect_true(last_unexpected_ooms > 0);
    /* the trace's settings, its fraction, its out-of-memory event */
    expect_eq_i64(fake_both(&(fake_t){"max_split_size_mb:20", 1ull << 30, 0.0, false}, &opt), 0);
    expect_eq_i64(fake_both(&(fake_t){"", 1ull << 30, 0.5, false}, &opt), 0);
    expect_eq_i64(fake_both(&(fake_t){"", 1ull << 30, 0.0, true}, &opt), 0);
    /* the fraction ignored: the guess holds again */
    opt.ignore_fraction = true;
    expect_eq_i64(fake_both(&(fake_t){"", 1ull << 30, 0.5, false}, &opt), 1);
    opt.ignore_fraction = false;
    /* settings given: known from the start, whatever the trace says */
    opt.settings = "roundup_power2_divisions:4";
    expect_eq_i64(fake_both(&(fake_t){"max_split_size_mb:20", 1ull << 30, 0.0, false}, &opt), 1);
    /* expandable segments: the device size shapes the reservations, so it must be given */
    opt.settings = "expandable_segments:True";
    expect_eq_i64(fake_both(&(fake_t){"", 1ull << 30, 0.0, false}, &opt), 0);
    opt.total_memory = 1ull << 30;
    expect_eq_i64(fake_both(&(fake_t){"", 1ull << 30, 0.0, false}, &opt), 1);
    /* a memory cap below what the replay needs: out-of-memory errors, whose messages
     * name the device size, so the guessed size does not stand; the size given, it does */
    opt.settings = NULL;
    opt.total_memory = 0;
    opt.cap = 24ull << 20;
    expect_eq_i64(fake_both(&(fake_t){"", 1ull << 30, 0.0, false}, &opt), 0);
    expect_true(last_unexpected_ooms > 0);
    opt.total_memory = 1ull << 30;
    expect_eq_i64(fake_both(&(fake_t){"", 1ull << 30, 0.0, false}, &opt), 1);
    expect_true(last_unexpected_ooms > 0);
}

/* A segment at address 0 is refused as malformed, alike in both modes. */
TEST(segment_at_address_zero_refused)
{
    pv_doc_t *doc = pv_doc_new();
    pv_node_t *root = pv_new_dict(doc), *traces = pv_new_list(doc), *events = pv_new_list(doc);
    expect_ok(pv_dict_set(doc, root, "segments", pv_new_list(doc)));
    expect_ok(pv_dict_set(doc, root, "device_traces", traces));
    expect_ok(pv_list_append(doc, traces, events));
    add_event(doc, events, "segment_alloc", 0, 2 << 20, 0x5500);
    add_event(doc, events, "alloc", 0, 512, 0x5500);
    char path[] = "/tmp/cca_overlap_zero_XXXXXX";
    if (!write_temp(doc, root, path))
        return;
    for (int mode = 0; mode < 2; mode++) {
        cca_replay_options_t opt = {0};
        opt.trace_addresses = true;
        opt.sequential = mode == 0;
        cca_replay_result_t r;
        expect_status(cca_replay_file(path, &opt, &r), CCA_ERR_FORMAT);
        expect_contains(cca_last_error()->message, "segment_alloc) is at address 0");
        expect_false(cca_is_initialized());
    }
    unlink(path);
}

/* A file cut short fails alike, after the thread has replayed what was read. */
TEST(read_error_fails_alike)
{
    const char *src = "tests/data/traces/gpt2_train_default.pickle.gz";
    FILE *in = fopen(src, "rb");
    expect_true(in != NULL);
    if (!in)
        return;
    static unsigned char buf[4 << 20];
    size_t n = fread(buf, 1, sizeof(buf), in);
    fclose(in);
    char path[] = "/tmp/cca_overlap_cut_XXXXXX";
    int fd = mkstemp(path);
    expect_true(fd >= 0 && n > 1000);
    if (fd < 0)
        return;
    expect_true(write(fd, buf, n * 2 / 3) == (ssize_t)(n * 2 / 3));
    close(fd);
    cca_status_t st[2];
    char msg[2][2048];
    for (int mode = 0; mode < 2; mode++) {
        cca_replay_options_t opt = {0};
        opt.trace_addresses = true;
        opt.sequential = mode == 0;
        cca_replay_result_t r;
        st[mode] = cca_replay_file(path, &opt, &r);
        snprintf(msg[mode], sizeof(msg[mode]), "%s", cca_last_error()->message);
        expect_false(cca_is_initialized());
    }
    unlink(path);
    expect_true(st[0] != CCA_OK);
    expect_eq_i64(st[0], st[1]);
    expect_eq_str(msg[0], msg[1]);
}

/* The comparison itself notices a difference in a count, a statistic and the summary. */
TEST(comparison_notices_differences)
{
    cca_replay_options_t opt = {0};
    cca_replay_result_t a, b;
    expect_ok(cca_replay_file("tests/data/traces/two_stream_pipeline_default.pickle.gz", &opt, &a));
    expect_ok(cca_replay_file("tests/data/traces/two_stream_pipeline_default.pickle.gz", &opt, &b));
    expect_true(replay_result_diff(&a, &b) == NULL);
    b.late_segment_frees++;
    expect_eq_str(replay_result_diff(&a, &b), "late_segment_frees");
    b.late_segment_frees--;
    b.memory_stats[7].value++;
    expect_eq_str(replay_result_diff(&a, &b), "memory_stats (values)");
    b.memory_stats[7].value--;
    b.memory_summary[10] ^= 1;
    expect_eq_str(replay_result_diff(&a, &b), "memory_summary");
    cca_replay_result_free(&a);
    cca_replay_result_free(&b);
}

int main(void)
{
    RUN(comparison_notices_differences);
    RUN(bundled_traces_same_either_way);
    RUN(guess_checked_at_the_end);
    RUN(segment_at_address_zero_refused);
    RUN(read_error_fails_alike);
    return harness_done();
}
