/*
 * test_replay_input.c - snapshots as users have them, made by hand: a
 * recording begun after the allocator had begun (the state before the first
 * event inferred as PyTorch's memory viewer infers it), several devices, and
 * input that contradicts itself (counted and named with its first event,
 * an error under strict).
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cca.h"
#include "harness.h"
#include "pickle.h"

#define MIB (1ull << 20)
#define BASE 0x7f0000000000ull

/* A snapshot being made: its segments, its traces (one per device) and cca_meta. */
typedef struct snap {
    pv_doc_t *doc;
    pv_node_t *root, *segments, *traces, *meta;
} snap_t;

static void snap_begin(snap_t *s, int devices)
{
    s->doc = pv_doc_new();
    s->root = pv_new_dict(s->doc);
    s->segments = pv_new_list(s->doc);
    s->traces = pv_new_list(s->doc);
    s->meta = NULL;
    pv_dict_set(s->doc, s->root, "segments", s->segments);
    pv_dict_set(s->doc, s->root, "device_traces", s->traces);
    for (int d = 0; d < devices; d++)
        pv_list_append(s->doc, s->traces, pv_new_list(s->doc));
}

static void event(snap_t *s, int device, const char *action, uint64_t addr, int64_t size)
{
    pv_node_t *e = pv_new_dict(s->doc);
    pv_dict_set(s->doc, e, "action", pv_new_str(s->doc, action));
    pv_dict_set(s->doc, e, "addr", pv_new_u64(s->doc, addr));
    pv_dict_set(s->doc, e, "size", pv_new_int(s->doc, size));
    pv_dict_set(s->doc, e, "stream", pv_new_int(s->doc, 0));
    pv_list_append(s->doc, (pv_node_t *)pv_at(s->traces, (size_t)device), e);
}

/* A plain segment at the end; live: a block live in it at its base (0: none). */
static pv_node_t *segment(snap_t *s, int device, uint64_t addr, uint64_t size, const char *type)
{
    pv_node_t *seg = pv_new_dict(s->doc);
    pv_dict_set(s->doc, seg, "device", pv_new_int(s->doc, device));
    pv_dict_set(s->doc, seg, "address", pv_new_u64(s->doc, addr));
    pv_dict_set(s->doc, seg, "total_size", pv_new_u64(s->doc, size));
    pv_dict_set(s->doc, seg, "stream", pv_new_int(s->doc, 0));
    pv_dict_set(s->doc, seg, "segment_type", pv_new_str(s->doc, type));
    pv_dict_set(s->doc, seg, "is_expandable", pv_new_bool(s->doc, false));
    pv_dict_set(s->doc, seg, "blocks", pv_new_list(s->doc));
    pv_list_append(s->doc, s->segments, seg);
    return seg;
}

static void block(snap_t *s, pv_node_t *seg, uint64_t addr, uint64_t size, const char *state)
{
    pv_node_t *b = pv_new_dict(s->doc);
    pv_dict_set(s->doc, b, "address", pv_new_u64(s->doc, addr));
    pv_dict_set(s->doc, b, "size", pv_new_u64(s->doc, size));
    pv_dict_set(s->doc, b, "requested_size", pv_new_u64(s->doc, size));
    pv_dict_set(s->doc, b, "state", pv_new_str(s->doc, state));
    pv_list_append(s->doc, (pv_node_t *)pv_dict_get(seg, "blocks"), b);
}

static pv_node_t *meta(snap_t *s)
{
    if (!s->meta) {
        s->meta = pv_new_dict(s->doc);
        pv_dict_set(s->doc, s->root, "cca_meta", s->meta);
    }
    return s->meta;
}

/* Write the snapshot, replay it with opt (trace addresses), remove it; the status. */
static cca_status_t snap_replay(snap_t *s, cca_replay_options_t *opt, cca_replay_result_t *r)
{
    char path[] = "/tmp/cca_replay_input_XXXXXX";
    int fd = mkstemp(path);
    expect_true(fd >= 0);
    close(fd);
    expect_ok(pickle_write_file(s->root, path));
    pv_doc_free(s->doc);
    opt->trace_addresses = true;
    cca_status_t st = cca_replay_file(path, opt, r);
    unlink(path);
    return st;
}

/*
 * The viewer's rules: a segment in the snapshot never allocated in the trace
 * existed before it, and so did one the trace frees without allocating it; a
 * block live at the end never allocated, and one the trace frees without
 * allocating it, were live before it (a block live at the end that the trace
 * allocates was not). The replay starts from there: the new
 * allocation lands at PyTorch's address, after the live block, and the
 * figures cover the recorded part.
 */
TEST(state_before_the_first_event)
{
    snap_t s;
    snap_begin(&s, 1);
    pv_node_t *seg = segment(&s, 0, BASE, 20 * MIB, "large");
    block(&s, seg, BASE, 4 * MIB, "active_allocated");
    block(&s, seg, BASE + 4 * MIB, 2 * MIB, "active_allocated");
    block(&s, seg, BASE + 6 * MIB, 14 * MIB, "inactive");
    uint64_t gone = BASE + 64 * MIB; /* a segment freed in the trace, its block freed before */
    event(&s, 0, "free_requested", gone, 3 * MIB);
    event(&s, 0, "free_completed", gone, 3 * MIB);
    event(&s, 0, "segment_free", gone, 20 * MIB); /* by the program's empty_cache */
    event(&s, 0, "alloc", BASE + 4 * MIB, 2 * MIB);
    pv_node_t *ops = pv_new_list(s.doc), *op = pv_new_dict(s.doc);
    pv_dict_set(s.doc, op, "at", pv_new_int(s.doc, 2));
    pv_dict_set(s.doc, op, "op", pv_new_str(s.doc, "empty_cache"));
    pv_list_append(s.doc, ops, op);
    pv_dict_set(s.doc, meta(&s), "pool_events", ops);
    cca_replay_options_t opt = {0};
    cca_replay_result_t r;
    expect_ok(snap_replay(&s, &opt, &r));
    expect_eq_u64(r.address_mismatches, 0);
    if (r.address_mismatches)
        printf("  %s\n", r.first_address_mismatch);
    expect_eq_u64(r.inconsistencies, 0);
    expect_true(r.recorded_part_only);
    expect_eq_u64(r.inferred_segments, 2);
    expect_eq_u64(r.inferred_blocks, 2);
    expect_eq_u64(r.inferred_reserved_bytes, 40 * MIB);
    expect_eq_u64(r.inferred_requested_bytes, 7 * MIB);
    expect_eq_u64(r.segment_frees, 1); /* the trace's, not the building's */
    expect_eq_u64(r.segment_allocs, 0);
    expect_eq_i64(r.peak_reserved_bytes, 40 * MIB);
    expect_eq_i64(r.peak_allocated_bytes, 7 * MIB); /* 4 + 3 live before, 4 + 2 after */
    cca_replay_result_free(&r);
}

/*
 * A block live at the start whose end nothing after the cut lands at, freed
 * in the trace (so the snapshot does not give its size): PyTorch may have
 * left a rest of up to 1 MiB unsplit in it. With no later placement to tell,
 * the replay counts it in ambiguous_blocks; when PyTorch put an allocation
 * elsewhere that would fit only in the block's rounded end's free space (16
 * MiB there, PyTorch's another segment's 20 MiB: its own free block there was
 * smaller), the replay grows the block by the least that keeps it out and
 * replays again, every allocation then at PyTorch's address.
 */
static void unsplit_rest_snapshot(snap_t *s, bool placed_elsewhere)
{
    snap_begin(s, 1);
    pv_node_t *a = segment(s, 0, BASE, 20 * MIB, "large");
    block(s, a, BASE, 20 * MIB, "inactive");
    pv_node_t *b = segment(s, 0, BASE + 64 * MIB, 20 * MIB, "large");
    block(s, b, BASE + 64 * MIB, 20 * MIB, "inactive");
    if (placed_elsewhere)
        event(s, 0, "alloc", BASE + 64 * MIB, 16 * MIB);
    event(s, 0, "free_requested", BASE, 4 * MIB); /* live at the start, 4 MiB asked for */
    event(s, 0, "free_completed", BASE, 4 * MIB);
    if (placed_elsewhere) {
        event(s, 0, "free_requested", BASE + 64 * MIB, 16 * MIB);
        event(s, 0, "free_completed", BASE + 64 * MIB, 16 * MIB);
    }
}

TEST(unsplit_rest_of_a_start_block)
{
    for (int elsewhere = 0; elsewhere < 2; elsewhere++) {
        snap_t s;
        unsplit_rest_snapshot(&s, elsewhere);
        cca_replay_options_t opt = {0};
        cca_replay_result_t r;
        expect_ok(snap_replay(&s, &opt, &r));
        expect_eq_u64(r.address_mismatches, 0);
        if (r.address_mismatches)
            printf("  %s\n", r.first_address_mismatch);
        expect_eq_u64(r.inconsistencies, 0);
        expect_eq_u64(r.inferred_blocks, 1);
        expect_eq_u64(r.ambiguous_blocks, elsewhere ? 0 : 1);
        cca_replay_result_free(&r);
    }
}

/* A recording from an empty allocator infers nothing. */
TEST(nothing_inferred_from_an_empty_start)
{
    snap_t s;
    snap_begin(&s, 1);
    event(&s, 0, "segment_alloc", BASE, 20 * MIB);
    event(&s, 0, "alloc", BASE, 4 * MIB);
    pv_node_t *seg = segment(&s, 0, BASE, 20 * MIB, "large");
    block(&s, seg, BASE, 4 * MIB, "active_allocated");
    cca_replay_options_t opt = {0};
    cca_replay_result_t r;
    expect_ok(snap_replay(&s, &opt, &r));
    expect_false(r.recorded_part_only);
    expect_eq_u64(r.inferred_segments, 0);
    expect_eq_u64(r.inferred_blocks, 0);
    expect_eq_u64(r.inconsistencies, 0);
    expect_eq_u64(r.address_mismatches, 0);
    cca_replay_result_free(&r);
}

/*
 * A trace that breaks nothing played from an empty allocator, but whose
 * snapshot ends otherwise: the block it allocates is not live at the end,
 * and a segment it never made is there. The end state decides: an
 * inconsistency, and the segment inferred.
 */
TEST(empty_start_but_another_end)
{
    snap_t s;
    snap_begin(&s, 1);
    event(&s, 0, "segment_alloc", BASE, 20 * MIB);
    event(&s, 0, "alloc", BASE, 4 * MIB);
    segment(&s, 0, BASE, 20 * MIB, "large");
    segment(&s, 0, BASE + 64 * MIB, 20 * MIB, "large");
    cca_replay_options_t opt = {0};
    cca_replay_result_t r;
    expect_ok(snap_replay(&s, &opt, &r));
    expect_eq_u64(r.inconsistencies, 1);
    expect_contains(r.first_inconsistency, "neither freed later nor live");
    expect_true(r.recorded_part_only);
    expect_eq_u64(r.inferred_segments, 1);
    expect_eq_u64(r.inferred_blocks, 0);
    cca_replay_result_free(&r);
}

/* Each device_traces entry is replayed, with its own segments. */
TEST(several_devices)
{
    snap_t s;
    snap_begin(&s, 2);
    event(&s, 0, "segment_alloc", BASE, 2 * MIB);
    event(&s, 0, "alloc", BASE, 4096);
    event(&s, 0, "free_requested", BASE, 4096);
    event(&s, 0, "free_completed", BASE, 4096);
    /* device 1 began before its recording: a 40 MiB segment with a block live */
    uint64_t base1 = BASE + (1ull << 36);
    pv_node_t *seg = segment(&s, 1, base1, 40 * MIB, "large");
    block(&s, seg, base1, 30 * MIB, "active_allocated");
    block(&s, seg, base1 + 30 * MIB, 10 * MIB, "inactive");
    segment(&s, 0, BASE, 2 * MIB, "small");
    event(&s, 1, "alloc", base1 + 30 * MIB, 6 * MIB);
    event(&s, 1, "free_requested", base1 + 30 * MIB, 6 * MIB);
    event(&s, 1, "free_completed", base1 + 30 * MIB, 6 * MIB);
    char path[] = "/tmp/cca_replay_devices_XXXXXX";
    int fd = mkstemp(path);
    expect_true(fd >= 0);
    close(fd);
    expect_ok(pickle_write_file(s.root, path));
    pv_doc_free(s.doc);
    cca_replay_options_t opt = {0};
    opt.trace_addresses = true;
    cca_replay_result_t *rs = NULL;
    size_t n = 0;
    cca_status_t st = cca_replay_file_devices(path, &opt, &rs, &n);
    unlink(path);
    expect_ok(st);
    expect_eq_u64(n, 2);
    if (st != CCA_OK || n != 2)
        return;
    expect_eq_i64(rs[0].device, 0);
    expect_eq_i64(rs[1].device, 1);
    expect_eq_u64(rs[0].device_count, 2);
    expect_eq_u64(rs[0].allocs, 1);
    expect_eq_u64(rs[1].allocs, 1);
    expect_false(rs[0].recorded_part_only);
    expect_true(rs[1].recorded_part_only);
    expect_eq_u64(rs[1].inferred_blocks, 1);
    expect_eq_i64(rs[0].peak_reserved_bytes, 2 * MIB);
    expect_eq_i64(rs[1].peak_reserved_bytes, 40 * MIB);
    expect_eq_i64(rs[1].peak_allocated_bytes, 36 * MIB);
    expect_eq_u64(rs[0].address_mismatches + rs[1].address_mismatches, 0);
    cca_replay_results_free(rs, n);
}

/* A snapshot with inconsistency `kind` (0..4): the trace's events and fields. */
static void inconsistent(snap_t *s, int kind)
{
    snap_begin(s, 1);
    event(s, 0, "segment_alloc", BASE, 20 * MIB);
    event(s, 0, "alloc", BASE, 8 * MIB);
    switch (kind) {
    case 0: event(s, 0, "alloc", BASE + 2 * MIB, 2 * MIB); break;      /* inside the live block */
    case 1: event(s, 0, "free_requested", BASE + 12 * MIB, 2 * MIB); /* a block never seen */
            event(s, 0, "free_completed", BASE + 12 * MIB, 2 * MIB); break;
    case 2: event(s, 0, "alloc", BASE + 8 * MIB, -4096); break;        /* a negative size */
    case 3: event(s, 0, "alloc", BASE + 8 * MIB, (int64_t)1 << 60); break; /* 1 EB */
    case 4: pv_dict_set(s->doc, meta(s), "fraction", pv_new_float(s->doc, NAN)); break;
    }
    event(s, 0, "free_requested", BASE, 8 * MIB);
    event(s, 0, "free_completed", BASE, 8 * MIB);
    /* the end as PyTorch's snapshot shows it */
    pv_node_t *seg = segment(s, 0, BASE, 20 * MIB, "large");
    if (kind == 0)
        block(s, seg, BASE + 2 * MIB, 2 * MIB, "active_allocated");
}

/* Each kind is counted and named with its event, and the replay goes on; strict stops there. */
TEST(inconsistent_input_reported)
{
    static const char *const named[] = {
        "event 2: an allocation at", "event 2: a free of", "event 2: size -4096",
        "event 2: size 1152921504606846976", "fraction is NaN",
    };
    for (int kind = 0; kind < 5; kind++) {
        snap_t s;
        inconsistent(&s, kind);
        cca_replay_options_t opt = {0};
        cca_replay_result_t r;
        expect_ok(snap_replay(&s, &opt, &r));
        expect_true(r.inconsistencies >= 1);
        expect_eq_u64(r.first_inconsistency_event, kind < 4 ? 2 : UINT64_MAX);
        expect_true(strstr(r.first_inconsistency, named[kind]) != NULL);
        if (!strstr(r.first_inconsistency, named[kind]))
            printf("  kind %d: %llu, first: %s\n", kind, (unsigned long long)r.inconsistencies,
                   r.first_inconsistency);
        cca_replay_result_free(&r);
        inconsistent(&s, kind);
        opt.strict = true;
        expect_status(snap_replay(&s, &opt, &r), CCA_ERR_FORMAT);
        expect_true(strstr(cca_last_error()->message, named[kind]) != NULL);
        expect_false(cca_is_initialized());
    }
}

/* A consistent trace reports none, strict or not. */
TEST(consistent_input_reports_nothing)
{
    cca_replay_options_t opt = {0};
    opt.trace_addresses = true;
    opt.strict = true;
    cca_replay_result_t r;
    expect_ok(cca_replay_file("tests/data/traces/gpt2_train_default.pickle.gz", &opt, &r));
    expect_eq_u64(r.inconsistencies, 0);
    expect_false(r.recorded_part_only);
    cca_replay_result_free(&r);
}

/* A pool event that fails names its cause once (the message was formatted over its cause). */
TEST(pool_event_error_message_once)
{
    snap_t s;
    snap_begin(&s, 1);
    event(&s, 0, "segment_alloc", BASE, 2 * MIB);
    event(&s, 0, "alloc", BASE, 4096);
    pv_node_t *ops = pv_new_list(s.doc), *op = pv_new_dict(s.doc);
    pv_dict_set(s.doc, op, "at", pv_new_int(s.doc, 1));
    pv_dict_set(s.doc, op, "op", pv_new_str(s.doc, "graph_capture_end"));
    pv_node_t *id[2] = {pv_new_int(s.doc, 7), pv_new_int(s.doc, 0)};
    pv_dict_set(s.doc, op, "pool", pv_new_tuple(s.doc, 2, id));
    pv_list_append(s.doc, ops, op);
    pv_dict_set(s.doc, meta(&s), "pool_events", ops);
    cca_replay_options_t opt = {0};
    opt.sequential = true;
    cca_replay_result_t r;
    expect_status(snap_replay(&s, &opt, &r), CCA_ERR_FORMAT);
    const char *msg = cca_last_error()->message;
    const char *first = strstr(msg, "cannot be applied");
    expect_true(first != NULL);
    expect_true(first && !strstr(first + 1, "cannot be applied"));
    expect_true(strstr(msg, "pool event 0 (pool 7, 0)") != NULL);
    printf("  %s\n", msg);
}

/*
 * A recording that began inside a graph capture, after the CUDA generator's
 * seed and offset (8 bytes each, in the default pools) were allocated: the
 * capture goes on from the start without them, so its own first allocation,
 * of 8 bytes too, goes to the graph's pool (taken for the generator's, it
 * landed beside the seed and offset in the default pools' segment).
 */
TEST(capture_begun_before_the_first_event)
{
    const uint64_t rng = BASE, graph = BASE + 64 * MIB;
    for (int cut = 0; cut < 2; cut++) {
        snap_t s;
        snap_begin(&s, 1);
        pv_node_t *id[2] = {pv_new_int(s.doc, 1), pv_new_int(s.doc, 0)};
        pv_node_t *seg = segment(&s, 0, rng, 2 * MIB, "small");
        block(&s, seg, rng, 512, "active_allocated");
        block(&s, seg, rng + 512, 512, "active_allocated");
        block(&s, seg, rng + 1024, 2 * MIB - 1024, "inactive");
        seg = segment(&s, 0, graph, 2 * MIB, "small");
        pv_dict_set(s.doc, seg, "segment_pool_id", pv_new_tuple(s.doc, 2, id));
        block(&s, seg, graph, 512, "active_allocated");
        block(&s, seg, graph + 512, 2 * MIB - 512, "inactive");
        event(&s, 0, "snapshot", 0, 0);         /* the capture's marker */
        event(&s, 0, "segment_alloc", rng, 2 * MIB);
        event(&s, 0, "alloc", rng, 8);          /* the generator's seed */
        event(&s, 0, "alloc", rng + 512, 8);    /* and offset */
        event(&s, 0, "segment_alloc", graph, 2 * MIB);
        event(&s, 0, "alloc", graph, 8);        /* the graph's own */
        pv_node_t *ops = pv_new_list(s.doc), *op = pv_new_dict(s.doc);
        pv_dict_set(s.doc, op, "at", pv_new_int(s.doc, 1));
        pv_dict_set(s.doc, op, "op", pv_new_str(s.doc, "graph_capture"));
        pv_node_t *op_id[2] = {pv_new_int(s.doc, 1), pv_new_int(s.doc, 0)};
        pv_dict_set(s.doc, op, "pool", pv_new_tuple(s.doc, 2, op_id));
        pv_dict_set(s.doc, op, "stream", pv_new_int(s.doc, 0));
        pv_list_append(s.doc, ops, op);
        pv_dict_set(s.doc, meta(&s), "pool_events", ops);
        cca_replay_options_t opt = {0};
        opt.first_event = cut ? 4 : 0;
        cca_replay_result_t r;
        expect_ok(snap_replay(&s, &opt, &r));
        expect_eq_u64(r.address_mismatches, 0);
        expect_eq_u64(r.inconsistencies, 0);
        expect_eq_u64(r.inferred_segments, cut ? 1 : 0);
        expect_eq_u64(r.inferred_blocks, cut ? 2 : 0);
        if (r.address_mismatches)
            printf("  cut at %d: %s\n", cut ? 4 : 0, r.first_address_mismatch);
        cca_replay_result_free(&r);
    }
}

int main(void)
{
    RUN(state_before_the_first_event);
    RUN(unsplit_rest_of_a_start_block);
    RUN(nothing_inferred_from_an_empty_start);
    RUN(empty_start_but_another_end);
    RUN(several_devices);
    RUN(inconsistent_input_reported);
    RUN(consistent_input_reports_nothing);
    RUN(pool_event_error_message_once);
    RUN(capture_begun_before_the_first_event);
    return harness_done();
}
