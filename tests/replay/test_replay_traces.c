/*
 * test_replay_traces.c - the exactness oracle: every real PyTorch trace in
 * tests/data/traces replays through cca with PyTorch's segment addresses
 * (graph and MemPool traces with their private-pool operations applied), and
 * every allocation lands where PyTorch put it, with PyTorch's segment counts
 * (segment_map / segment_unmap events for expandable segments), OOMs, peaks,
 * all 122 memory_stats values and the memory_summary text. The expected figures come from the
 * trace files themselves.
 */
#include <dirent.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cca.h"
#include "harness.h"
#include "pickle.h"

static const char *trace_dir = "tests/data/traces";

static void check_trace(const char *name)
{
    char path[512];
    snprintf(path, sizeof(path), "%s/%s", trace_dir, name);
    cca_replay_options_t opt = {0};
    opt.trace_addresses = true;
    cca_replay_result_t r;
    cca_status_t st = cca_replay_file(path, &opt, &r);
    if (st != CCA_OK) {
        HARNESS_FAIL("%s: replay failed: %s", name, cca_last_error()->message);
        return;
    }
    printf("  %-40s %7llu events %6.2f M events/s, %llu allocs, %llu segments\n", name,
           (unsigned long long)r.events, r.events_per_second / 1e6, (unsigned long long)r.allocs,
           (unsigned long long)r.segment_allocs);
    expect_true(r.has_expected);
    /* recorded from an empty allocator, consistent: nothing inferred, nothing reported */
    expect_false(r.recorded_part_only);
    expect_eq_u64(r.inferred_segments + r.inferred_blocks, 0);
    expect_eq_u64(r.inconsistencies, 0);
    if (r.inconsistencies)
        printf("  first inconsistency: %s\n", r.first_inconsistency);
    expect_eq_u64(r.address_mismatches, 0);
    if (r.address_mismatches)
        printf("  first mismatch: %s\n", r.first_address_mismatch);
    expect_eq_u64(r.unexpected_ooms, 0);
    expect_eq_u64(r.allocs, r.expected_allocs);
    expect_eq_u64(r.segment_allocs, r.expected_segment_allocs);
    expect_eq_u64(r.segment_frees, r.expected_segment_frees);
    expect_eq_u64(r.ooms, r.expected_ooms);
    expect_eq_i64(r.peak_reserved_bytes, r.expected_peak_reserved_bytes);
    expect_eq_u64(r.stats_mismatches, 0);
    if (r.stats_mismatches)
        printf("  first stats mismatch: %s\n", r.first_stats_mismatch);
    expect_true(r.summary_matches);
    /* graph and MemPool traces carry their private-pool operations, the traces of a model
     * trained then used the program's empty_cache and reset of the peaks */
    if (strstr(name, "graph_") || strstr(name, "mempool_") || strstr(name, "_train_generate") ||
        strstr(name, "_train_infer"))
        expect_true(r.pool_ops > 0);
    else
        expect_eq_u64(r.pool_ops, 0);
    cca_replay_result_free(&r);
}

TEST(all_traces_exact)
{
    DIR *dir = opendir(trace_dir);
    if (!dir) {
        HARNESS_FAIL("cannot open %s", trace_dir);
        return;
    }
    int checked = 0;
    struct dirent *de;
    while ((de = readdir(dir))) {
        const char *n = de->d_name;
        size_t len = strlen(n);
        if (len < 10 || strcmp(n + len - 10, ".pickle.gz") != 0)
            continue;
        check_trace(n);
        checked++;
    }
    closedir(dir);
    expect_eq_i64(checked, 39);
}

TEST(fresh_addresses)
{
    /* Without PyTorch's addresses, ties between equal-size blocks break by
     * other addresses, so figures may differ; the replay itself is complete. */
    cca_replay_options_t opt = {0};
    cca_replay_result_t r;
    expect_ok(cca_replay_file("tests/data/traces/gpt2_train_default.pickle.gz", &opt, &r));
    expect_eq_u64(r.allocs, r.expected_allocs);
    expect_eq_u64(r.unexpected_ooms, 0);
    expect_true(r.peak_reserved_bytes >= r.peak_allocated_bytes);
    expect_true(r.peak_allocated_bytes >= r.peak_requested_bytes);
    expect_true(r.memory_summary != NULL);
    cca_replay_result_free(&r);
}

TEST(settings_override_changes_outcome)
{
    cca_replay_options_t opt = {0};
    opt.settings = "max_split_size_mb:64";
    cca_replay_result_t r;
    expect_ok(cca_replay_file("tests/data/traces/gpt2_train_default.pickle.gz", &opt, &r));
    expect_true(r.stats_mismatches > 0); /* not PyTorch's default run any more */
    expect_true(r.peak_reserved_bytes != r.expected_peak_reserved_bytes);
    cca_replay_result_free(&r);
}

/* compact_memory with the GPU at once (event_lag 0) and running behind (100 trace
 * events): at once every move is made and no growth passes pending granules;
 * behind, a growth aliases its stream's pending granules only past the alias
 * limit (the most reserved so far plus the bytes aliased before), so the loop
 * settles: its second half maps almost nothing (with aliasing at every growth:
 * 12 maps and 19 unmaps there) and peak reserved stays within 2 % of peak
 * requested. */
TEST(compact_event_lag)
{
    const char *path = "tests/data/traces/resnet50_train_default.pickle.gz";
    cca_replay_options_t opt = {0};
    opt.settings = "compact_memory:True";
    cca_replay_result_t now, behind;
    expect_ok(cca_replay_file(path, &opt, &now));
    opt.event_lag = 100;
    expect_ok(cca_replay_file(path, &opt, &behind));
    expect_true(now.compact_moves > 0);
    expect_eq_u64(now.compact_pending_growths, 0);
    /* a single stream: its own pending granules are aliased, the lag-0 peak kept */
    expect_eq_u64(behind.compact_pending_growths, 0);
    expect_true(behind.compact_moves > 0);
    expect_true(now.peak_reserved_bytes * 1000 <= now.peak_requested_bytes * 1020);
    expect_true(behind.peak_reserved_bytes * 1000 <= behind.peak_requested_bytes * 1020);
    expect_true(behind.late_segment_allocs <= 3);
    expect_true(behind.late_segment_frees <= 5);
    expect_eq_u64(behind.unexpected_ooms, 0);
    printf("  resnet50 compact: lag 0 %.3f, %llu moves; lag 100 %.3f, %llu moves, %llu growths past "
           "pending granules\n",
           (double)now.peak_reserved_bytes / (double)now.peak_requested_bytes,
           (unsigned long long)now.compact_moves,
           (double)behind.peak_reserved_bytes / (double)behind.peak_requested_bytes,
           (unsigned long long)behind.compact_moves, (unsigned long long)behind.compact_pending_growths);
    cca_replay_result_free(&now);
    cca_replay_result_free(&behind);
}

/* A compact run: replay the bundled trace under compact_memory:True with the
 * GPU lag events behind, check the peak is within 2% of the requested one and
 * no unexpected OOM, print the figures. The caller frees *r. */
typedef struct {
    const char *trace;
    uint64_t lag;
} compact_run_t;

static void replay_compact(compact_run_t run, cca_replay_result_t *r)
{
    char path[256];
    snprintf(path, sizeof(path), "%s/%s.pickle.gz", trace_dir, run.trace);
    cca_replay_options_t opt = {0};
    opt.settings = "compact_memory:True";
    opt.event_lag = run.lag;
    expect_ok(cca_replay_file(path, &opt, r));
    expect_true(r->peak_reserved_bytes * 1000 <= r->peak_requested_bytes * 1020);
    expect_eq_u64(r->unexpected_ooms, 0);
    printf("  %s compact, lag %llu: %.3f, %llu moves\n", run.trace, (unsigned long long)run.lag,
           (double)r->peak_reserved_bytes / (double)r->peak_requested_bytes,
           (unsigned long long)r->compact_moves);
}

/*
 * The longer training traces (20 GPT-2 steps, 16 ResNet-50 steps, 12 steps of
 * GPT-2 in bf16 with activation checkpointing) under compact_memory, with the
 * GPU keeping up and behind: a step after warm-up maps and unmaps nothing,
 * and the peak stays within 2% of the requested one. The checkpointed loop
 * settles through its planned placement (plan.c): placed as its requests
 * came, it moved granules at every step at the limit's cap (7 maps and 36 to
 * 41 unmaps in its second half, at 1.020).
 */
TEST(compact_long_loops_settle)
{
    static const compact_run_t runs[] = {
        {"gpt2_train20_default", 0},     {"gpt2_train20_default", 10},
        {"gpt2_train20_default", 1000},  {"resnet50_train16_default", 0},
        {"resnet50_train16_default", 10}, {"resnet50_train16_default", 1000},
        {"gpt2_train_ckpt_bf16_12_default", 0}, {"gpt2_train_ckpt_bf16_12_default", 100},
    };
    for (size_t i = 0; i < sizeof(runs) / sizeof(runs[0]); i++) {
        cca_replay_result_t r;
        replay_compact(runs[i], &r);
        expect_true(r.step_allocations > 0);
        expect_eq_u64(r.late_segment_allocs, 0);
        expect_eq_u64(r.late_segment_frees, 0);
        expect_eq_u64(r.last_step_segment_allocs, 0);
        expect_eq_u64(r.last_step_segment_frees, 0);
        cca_replay_result_free(&r);
    }
}

/*
 * Loops whose shapes change at every step (BERT at a drawn sequence length,
 * ViT at a drawn batch), where PyTorch's default reserves 1.28 and 2.38 times
 * the peak requested, and the short GPT-2 traces with the GPU behind: under
 * compact_memory the peak stays within 2% of the requested one (the limit's
 * cap; before it, ViT at lag 1000 reached 1.023, GPT-2 training at lag 100
 * 1.064, generation at lag 1000 1.026). ResNet-50 inference on drawn
 * batches after its training (the peaks reset after an empty_cache): 1.27
 * while the limit kept training's peak across the empty_cache, and 1.21 at
 * lag 10 while a growth whose run changed under it (aliases settled, a lower
 * run opened) mapped the new run's granules without lending for them.
 * Training with an evaluation pass at a larger batch every third step
 * (ResNet-50 at 64 and 256, GPT-2 at 8 x 512 and 32 x 512, no empty_cache
 * between): PyTorch's expandable segments reserve 1.017 and 1.274. Three
 * workloads recorded after the mode's rules were set, to see whether they
 * hold beyond the traces they were measured on: a Llama-style decoder under
 * bf16 autocast with gradients accumulated over 4 micro-batches (PyTorch's
 * expandable segments 1.063), T5 at drawn encoder and decoder lengths
 * (1.038) and DeepLabV3 under fp16 autocast at drawn image sizes (1.043).
 */
TEST(compact_within_two_percent)
{
    static const compact_run_t runs[] = {
        {"bert_train_varlen24_default", 0},     {"bert_train_varlen24_default", 1000},
        {"vit_train_varbatch24_default", 0},    {"vit_train_varbatch24_default", 100},
        {"vit_train_varbatch24_default", 1000}, {"gpt2_train_default", 100},
        {"gpt2_generate_default", 1000},        {"resnet50_train_infer8_default", 0},
        {"resnet50_train_infer8_default", 10},  {"resnet50_train_infer8_default", 1000},
        {"resnet50_train_eval12_default", 0},   {"resnet50_train_eval12_default", 1000},
        {"gpt2_train_eval12_default", 0},       {"gpt2_train_eval12_default", 1000},
        {"gpt2_train_ckpt_bf16_12_default", 0}, {"gpt2_train_ckpt_bf16_12_default", 1000},
        {"llama_train_accum8_default", 0},      {"llama_train_accum8_default", 1000},
        {"t5_train_varlen24_default", 0},       {"t5_train_varlen24_default", 1000},
        {"deeplab_train_amp_varsize24_default", 0}, {"deeplab_train_amp_varsize24_default", 1000},
    };
    for (size_t i = 0; i < sizeof(runs) / sizeof(runs[0]); i++) {
        cca_replay_result_t r;
        replay_compact(runs[i], &r);
        expect_true(r.compact_moves > 0);
        cca_replay_result_free(&r);
    }
}

/*
 * GPT-2 trained, then generation in the same process (the cache emptied and
 * the peaks reset between): generation's requests are all small, and the
 * rests of the granules that training's gradients keep mapped serve them, so
 * generation maps nothing. Before, the small pool mapped its own granules
 * beside those rests: 1.042.
 */
TEST(compact_generation_after_training_maps_nothing)
{
    static const compact_run_t runs[] = {
        {"gpt2_train_generate6_default", 0},
        {"gpt2_train_generate6_default", 1000},
    };
    for (size_t i = 0; i < sizeof(runs) / sizeof(runs[0]); i++) {
        cca_replay_result_t r;
        replay_compact(runs[i], &r);
        expect_eq_u64(r.late_segment_allocs, 0);
        cca_replay_result_free(&r);
    }
}

/*
 * Batched generation from a Llama-style decoder in bf16 (drawn batches and
 * prompt lengths, the key-value cache growing token by token), recorded after
 * the mode's rules were set: the one bundled workload without a private pool
 * that compact_memory leaves above 2% (1.036 to 1.044 at lags 0 to 1000).
 * At its peak the cache holds no whole free granule: the 19 MiB free are the
 * rests of granules that the cache's blocks (2.9 MiB each, 16 of them) and
 * the activations keep mapped. It stays under PyTorch's expandable segments
 * on the same trace (1.098) and maps nothing in its last step.
 */
TEST(compact_generation_with_a_growing_cache)
{
    const char *path = "tests/data/traces/llama_generate8_default.pickle.gz";
    static const uint64_t lags[] = {0, 1000};
    cca_replay_options_t opt = {0};
    opt.settings = "expandable_segments:True";
    cca_replay_result_t expandable;
    expect_ok(cca_replay_file(path, &opt, &expandable));
    for (size_t i = 0; i < sizeof(lags) / sizeof(lags[0]); i++) {
        opt.settings = "compact_memory:True";
        opt.event_lag = lags[i];
        cca_replay_result_t r;
        expect_ok(cca_replay_file(path, &opt, &r));
        expect_eq_u64(r.unexpected_ooms, 0);
        expect_true(r.peak_reserved_bytes < expandable.peak_reserved_bytes);
        expect_true(r.peak_reserved_bytes * 1000 <= r.peak_requested_bytes * 1050);
        expect_true(r.step_allocations > 0);
        expect_eq_u64(r.last_step_segment_allocs, 0);
        expect_eq_u64(r.last_step_segment_frees, 0);
        printf("  llama_generate8 compact, lag %llu: %.3f (expandable segments %.3f)\n",
               (unsigned long long)lags[i], (double)r.peak_reserved_bytes / (double)r.peak_requested_bytes,
               (double)expandable.peak_reserved_bytes / (double)expandable.peak_requested_bytes);
        cca_replay_result_free(&r);
    }
    cca_replay_result_free(&expandable);
}

TEST(errors)
{
    cca_replay_options_t opt = {0};
    cca_replay_result_t r;
    expect_status(cca_replay_file("tests/data/traces/no-such-file.pickle", &opt, &r), CCA_ERR_IO);
    expect_status(cca_replay_file("CMakeLists.txt", &opt, &r), CCA_ERR_FORMAT);
    opt.device = 3;
    expect_status(cca_replay_file("tests/data/traces/two_stream_pipeline_default.pickle.gz", &opt, &r),
                  CCA_ERR_INVALID_ARGUMENT);
    opt.device = 0;
    opt.settings = "max_split_size_mb:1";
    expect_status(cca_replay_file("tests/data/traces/two_stream_pipeline_default.pickle.gz", &opt, &r),
                  CCA_ERR_BAD_SETTINGS);
    expect_false(cca_is_initialized());
}

/* The figures at the end of a replay on backend:cudaMallocAsync are the replay's: reading the
 * cache's free figures made cache_info's trial allocation, which grew the pool to the device's
 * free memory, raised memory_stats' peaks to it and reported it all as cached. */
static int64_t stat_value(const cca_replay_result_t *r, const char *key)
{
    for (size_t i = 0; i < CCA_MEMORY_STATS_COUNT; i++)
        if (!strcmp(r->memory_stats[i].key, key))
            return r->memory_stats[i].value;
    return -1;
}

TEST(async_backend_end_figures)
{
    cca_replay_options_t opt = {0};
    opt.settings = "backend:cudaMallocAsync";
    opt.total_memory = (size_t)32 << 30;
    cca_replay_result_t r;
    expect_ok(cca_replay_file("tests/data/traces/gpt2_train_default.pickle.gz", &opt, &r));
    expect_eq_u64(r.allocs, r.expected_allocs);
    expect_eq_i64(stat_value(&r, "allocated_bytes.all.peak"), r.peak_allocated_bytes);
    expect_eq_i64(stat_value(&r, "reserved_bytes.all.peak"), r.peak_reserved_bytes);
    expect_true(r.cached_free_bytes <= (uint64_t)r.peak_reserved_bytes);
    expect_true(r.cached_free_bytes <= (uint64_t)stat_value(&r, "reserved_bytes.all.current"));
    expect_true(r.largest_free_bytes <= r.cached_free_bytes);
    cca_replay_result_free(&r);
}

/* A trace over 300 streams (the loader maps stream handles to indices through a
 * table that grows several times): each stream allocates and frees 1 MiB, and
 * since blocks never move between streams each stream needs a segment of its own. */
TEST(many_streams)
{
    enum { STREAMS = 300 };
    pv_doc_t *doc = pv_doc_new();
    expect_true(doc != NULL);
    pv_node_t *root = pv_new_dict(doc), *traces = pv_new_list(doc), *events = pv_new_list(doc);
    expect_ok(pv_dict_set(doc, root, "segments", pv_new_list(doc)));
    expect_ok(pv_dict_set(doc, root, "device_traces", traces));
    expect_ok(pv_list_append(doc, traces, events));
    static const char *const actions[] = {"alloc", "free_requested", "free_completed"};
    for (int s = 0; s < STREAMS; s++) {
        for (int a = 0; a < 3; a++) {
            pv_node_t *e = pv_new_dict(doc);
            expect_ok(pv_dict_set(doc, e, "action", pv_new_str(doc, actions[a])));
            expect_ok(pv_dict_set(doc, e, "addr", pv_new_u64(doc, 0x7f0000000000ull + (uint64_t)s * 0x200000)));
            expect_ok(pv_dict_set(doc, e, "size", pv_new_int(doc, 1 << 20)));
            expect_ok(pv_dict_set(doc, e, "stream", pv_new_u64(doc, 0x5500000000ull + (uint64_t)s * 0x30)));
            expect_ok(pv_list_append(doc, events, e));
        }
    }
    char path[] = "/tmp/cca_many_streams_XXXXXX";
    int fd = mkstemp(path);
    expect_true(fd >= 0);
    close(fd);
    expect_ok(pickle_write_file(root, path));
    pv_doc_free(doc);
    cca_replay_options_t opt = {0};
    cca_replay_result_t r;
    cca_status_t st = cca_replay_file(path, &opt, &r);
    unlink(path);
    expect_ok(st);
    if (st != CCA_OK) {
        printf("  %s\n", cca_last_error()->message);
        return;
    }
    expect_eq_u64(r.events, 3 * STREAMS);
    expect_eq_u64(r.allocs, STREAMS);
    expect_eq_u64(r.segment_allocs, STREAMS);
    cca_replay_result_free(&r);
}

int main(void)
{
    RUN(all_traces_exact);
    RUN(fresh_addresses);
    RUN(settings_override_changes_outcome);
    RUN(async_backend_end_figures);
    RUN(compact_event_lag);
    RUN(compact_long_loops_settle);
    RUN(compact_within_two_percent);
    RUN(compact_generation_after_training_maps_nothing);
    RUN(compact_generation_with_a_growing_cache);
    RUN(errors);
    RUN(many_streams);
    return harness_done();
}
