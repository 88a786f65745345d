/*
 * test_torch_cases.c - memory tests of PyTorch's test/test_cuda.py (2.11) that
 * cca must pass as PyTorch does, each reproduced step by step on the simulated
 * backend with the C API the adapter calls: the same settings strings, sizes,
 * allocations, frees and expected figures.
 */
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "device.h"
#include "harness.h"

#define MiB ((size_t)1 << 20)
#define S1 ((cca_stream_t)(uintptr_t)0x1000)

static cca_backend_t *sim;

/* cca up on a fresh simulated device of memory bytes with settings. */
static void setup(const char *settings, size_t memory)
{
    cca_sim_config_t cfg = {0};
    cfg.devices = 1;
    cfg.total_memory = memory;
    cca_shutdown();
    if (cca_sim_create(&cfg, &sim) != CCA_OK || cca_init_with_backend(sim, settings) != CCA_OK) {
        printf("cannot set up the simulated backend: %s\n", cca_last_error()->message);
        exit(1);
    }
}

static cca_device_stats_t stats(void)
{
    cca_device_stats_t s;
    memset(&s, 0, sizeof(s));
    cca_get_device_stats(0, &s);
    return s;
}

static void *xmalloc(size_t size)
{
    void *p = NULL;
    if (cca_malloc(&p, size, S1) != CCA_OK)
        printf("  cca_malloc(%zu) failed: %s\n", size, cca_last_error()->message);
    return p;
}

static void expect_valid(void)
{
    char why[512];
    cca_status_t st = device_check_invariants(why, sizeof(why));
    if (st != CCA_OK)
        printf("  invariant: %s\n", why);
    expect_ok(st);
}

/* ---- test_allocator_settings -------------------------------------------------------- */

/* The test's power2_div: size rounded up to the next of div_factor steps between powers of two. */
static size_t power2_div(size_t size, size_t div_factor)
{
    size_t pow2 = 1;
    while (pow2 < size)
        pow2 *= 2;
    if (pow2 == size)
        return pow2;
    size_t step = pow2 / 2 / div_factor, ret = pow2 / 2;
    while (ret < size)
        ret += step;
    return ret;
}

static int64_t active_allocated(void) { return stats().active_bytes[CCA_STAT_ALL].allocated; }

/*
 * PyTorch's test_allocator_settings, in its order. Each _set_allocator_settings
 * string first resets max_split_size_mb, roundup_power2_divisions and
 * garbage_collection_threshold (PyTorch's parseArgs): after a string without
 * roundup_power2_divisions the 84 MiB request is 84 MiB again. Before, the
 * divisions of an earlier string stayed: 96 MiB (100663296 bytes, not 88080384).
 */
TEST(allocator_settings)
{
    setup("", 8ull << 30);
    const size_t nbytes = 4 * 21 * MiB, nbytes_big = 4 * 100 * MiB;
    expect_ok(cca_empty_cache());
    int64_t start_mem = active_allocated();
    expect_ok(cca_set_settings(""));
    void *x = xmalloc(nbytes);

    /* the single value syntax */
    int64_t reg_mem = active_allocated();
    int64_t start_requested = stats().requested_bytes[CCA_STAT_ALL].allocated;
    expect_ok(cca_set_settings("roundup_power2_divisions:4"));
    void *y = xmalloc(nbytes);
    int64_t pow2_div4_mem = active_allocated();
    int64_t current_requested = stats().requested_bytes[CCA_STAT_ALL].allocated;
    expect_eq_i64(reg_mem - start_mem, (int64_t)nbytes);
    expect_eq_i64(pow2_div4_mem - reg_mem, (int64_t)power2_div(nbytes, 4));
    expect_eq_i64(current_requested - start_requested, (int64_t)nbytes);

    expect_ok(cca_set_settings("garbage_collection_threshold:0.5"));
    expect_ok(cca_set_settings("garbage_collection_threshold:0.5,max_split_size_mb:40"));
    /* should have reset the power2 divisions now */
    expect_ok(cca_empty_cache());
    start_mem = active_allocated();
    void *z = xmalloc(nbytes);
    reg_mem = active_allocated();
    expect_eq_i64(reg_mem - start_mem, (int64_t)nbytes);
    expect_eq_i64(stats().max_split_size, 40 * (int64_t)MiB);

    /* the list syntax */
    expect_ok(cca_empty_cache());
    expect_ok(cca_set_settings(
        "garbage_collection_threshold:0.5,roundup_power2_divisions:[64:8,128:2,256:2,512:2,1024:1,>:1]"));
    expect_eq_i64(stats().max_split_size, -1); /* reset: none */
    start_mem = active_allocated();
    void *w = xmalloc(nbytes);
    int64_t pow2_div8_mem = active_allocated();
    expect_eq_i64(pow2_div8_mem - start_mem, (int64_t)power2_div(nbytes, 8));
    expect_ok(cca_empty_cache());
    start_mem = active_allocated();
    void *v = xmalloc(nbytes_big);
    int64_t pow2_div2_mem = active_allocated();
    expect_eq_i64(pow2_div2_mem - start_mem, (int64_t)power2_div(nbytes_big, 2));

    expect_ok(cca_empty_cache());
    expect_ok(cca_set_settings("release_lock_on_cudamalloc:True"));
    start_mem = active_allocated();
    void *w2 = xmalloc(nbytes); /* w = torch.rand(...): the new tensor, then the old one freed */
    expect_ok(cca_free(w));
    reg_mem = active_allocated();
    expect_eq_i64(reg_mem - start_mem, (int64_t)nbytes);

    const char *bad[] = {"foo:1,bar:2", "garbage_collection_threshold:1.2", "max_split_size_mb:2",
                         "release_lock_on_cudamalloc:none", "pinned_use_cuda_host_register:none",
                         "pinned_num_register_threads:none", "pinned_num_register_threads:1024"};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++)
        expect_status(cca_set_settings(bad[i]), CCA_ERR_BAD_SETTINGS);
    /* a refused string resets nothing */
    expect_true(cca_state->settings.release_lock_on_cudamalloc);

    void *live[] = {x, y, z, v, w2};
    for (size_t i = 0; i < sizeof(live) / sizeof(live[0]); i++)
        expect_ok(cca_free(live[i]));
    expect_valid();
    cca_shutdown();
}

/* Keys PyTorch does not reset keep their values across strings; the reset ones return to
 * their defaults and say so in the effective settings. */
TEST(run_time_strings_reset_only_pytorchs_keys)
{
    setup("", 8ull << 30);
    expect_ok(cca_set_settings("max_split_size_mb:40,garbage_collection_threshold:0.6,"
                               "roundup_power2_divisions:2,max_non_split_rounding_mb:64,"
                               "expandable_segments:True,per_process_memory_fraction:0.5"));
    expect_ok(cca_set_settings("release_lock_on_cudamalloc:True"));
    const cca_settings_t *s = &cca_state->settings;
    expect_eq_u64(s->max_split_size, SIZE_MAX);
    expect_true(s->garbage_collection_threshold == 0.0);
    expect_eq_u64(settings_roundup_divisions(s, 100 * MiB), 0);
    expect_eq_i64(s->source[CCA_SET_MAX_SPLIT_SIZE_MB], CCA_SRC_DEFAULT);
    expect_eq_u64(s->max_non_split_rounding, 64 * MiB);
    expect_true(s->expandable_segments);
    expect_true(s->per_process_memory_fraction == 0.5);
    expect_true(s->release_lock_on_cudamalloc);
    cca_shutdown();
}

/* ---- test_max_split_expandable -------------------------------------------------------- */

/*
 * PyTorch's test_max_split_expandable: a memory fraction leaving 120 MiB, three
 * 40 MiB allocations (plain, expandable, plain: max_split_size_mb 40 each time),
 * a fourth runs out of memory; all three freed, 120 MiB must succeed by releasing
 * every cached block, the expandable segment's free pages included.
 */
static void max_split_expandable(size_t live_before, bool expandable_before)
{
    const size_t total = 1024 * MiB;
    setup(expandable_before ? "expandable_segments:True" : "", total);
    void *live = live_before ? xmalloc(live_before) : NULL; /* an earlier test's (cuBLAS's workspace) */
    expect_ok(cca_empty_cache());
    size_t pre_reserved = (size_t)stats().reserved_bytes[CCA_STAT_ALL].current;
    double fraction = (double)(120 * MiB + pre_reserved) / (double)total;
    expect_ok(cca_set_memory_fraction(fraction, 0));
    expect_ok(cca_set_settings("expandable_segments:False,max_split_size_mb:40"));
    void *a = xmalloc(40 * MiB);
    expect_ok(cca_set_settings("expandable_segments:True,max_split_size_mb:40"));
    void *b = xmalloc(40 * MiB);
    expect_ok(cca_set_settings("expandable_segments:False,max_split_size_mb:40"));
    void *c = xmalloc(40 * MiB);
    expect_true(a && b && c);
    void *d = NULL;
    expect_status(cca_malloc(&d, 40 * MiB, S1), CCA_ERR_OUT_OF_MEMORY);
    expect_ok(cca_free(a));
    expect_ok(cca_free(b));
    expect_ok(cca_free(c));
    /* release_cached_blocks runs with an expandable segment in the free list */
    void *e = xmalloc(120 * MiB);
    expect_true(e != NULL);
    expect_valid();
    expect_ok(cca_free(e));
    if (live)
        expect_ok(cca_free(live));
    expect_ok(cca_set_memory_fraction(1.0, 0));
    expect_valid();
    cca_shutdown();
}

TEST(max_split_expandable)
{
    max_split_expandable(0, false);
    max_split_expandable(32 * MiB, false);
    max_split_expandable(32 * MiB, true);
    max_split_expandable(3 * MiB, true);
    max_split_expandable(1000, true);
}

/* ---- cacheInfo ------------------------------------------------------------------------- */

/*
 * PyTorch's cacheInfo (cuDNN's workspace size): *largest 0 on entry starts from the
 * device's free memory, then the largest cached free block if larger; a caller's
 * own guess is kept unless a cached block is larger. Before, cca answered from its
 * cache alone: 0 on a fresh device, so cuDNN chose algorithms without workspace.
 */
TEST(cache_info_largest)
{
    const size_t total = 1024 * MiB;
    setup("", total);
    size_t device_free = 0, device_total = 0;
    expect_ok(cca_mem_get_info(0, &device_free, &device_total));
    size_t largest = 0;
    expect_ok(cca_cache_info_largest(0, &largest)); /* a fresh device: its free memory */
    expect_eq_u64(largest, device_free);
    expect_true(largest > 0);
    void *a = xmalloc(100 * MiB);
    expect_ok(cca_free(a)); /* cached: 100 MiB */
    expect_ok(cca_mem_get_info(0, &device_free, &device_total));
    largest = 0;
    expect_ok(cca_cache_info_largest(0, &largest));
    expect_eq_u64(largest, device_free);
    largest = 1; /* the caller's guess: the cached block is larger */
    expect_ok(cca_cache_info_largest(0, &largest));
    expect_eq_u64(largest, 100 * MiB);
    largest = 4 * total; /* larger than anything: kept */
    expect_ok(cca_cache_info_largest(0, &largest));
    expect_eq_u64(largest, 4 * total);
    /* a private pool's cached block counts too */
    const cca_mempool_id_t pool = {0, 21};
    expect_ok(cca_pool_create(0, pool));
    expect_ok(cca_begin_allocate_thread_to_pool(0, pool));
    void *p = xmalloc(300 * MiB);
    expect_ok(cca_end_allocate_to_pool(0, pool));
    expect_ok(cca_free(p));
    largest = 1;
    expect_ok(cca_cache_info_largest(0, &largest));
    expect_eq_u64(largest, 300 * MiB);
    /* the device's free memory unknown: its error, *largest unchanged */
    expect_ok(cca_sim_inject_fault(sim, CCA_OP_MEM_GET_INFO, 1, false, CCA_ERR_BACKEND));
    largest = 0;
    expect_status(cca_cache_info_largest(0, &largest), CCA_ERR_BACKEND);
    expect_eq_u64(largest, 0);
    expect_status(cca_cache_info_largest(0, NULL), CCA_ERR_INVALID_ARGUMENT);
    expect_status(cca_cache_info_largest(1, &largest), CCA_ERR_INVALID_ARGUMENT);
    expect_status(cca_cache_info_largest(-1, &largest), CCA_ERR_INVALID_ARGUMENT);
    expect_ok(cca_release_pool(0, pool));
    expect_ok(cca_empty_cache());
    expect_valid();
    cca_shutdown();
}

int main(void)
{
    RUN(allocator_settings);
    RUN(run_time_strings_reset_only_pytorchs_keys);
    RUN(max_split_expandable);
    RUN(cache_info_largest);
    return harness_done();
}
