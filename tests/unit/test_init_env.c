/*
 * test_init_env.c - initialisation from the environment: backend selection,
 * the simulated backend's size, settings from CCA_ALLOC_CONF, and the clear
 * failure (naming CCA_BACKEND=sim) when the cuda backend finds no GPU.
 */
#include <stdlib.h>
#include <string.h>

#include "cca.h"
#include "harness.h"

static void reset_env(void)
{
    cca_shutdown();
    unsetenv("CCA_BACKEND");
    unsetenv("CCA_SIM_DEVICES");
    unsetenv("CCA_SIM_MEMORY");
    unsetenv("CCA_ALLOC_CONF");
    unsetenv("CCA_NO_CACHING");
}

TEST(sim_from_environment)
{
    reset_env();
    setenv("CCA_BACKEND", "sim", 1);
    setenv("CCA_SIM_DEVICES", "3", 1);
    setenv("CCA_SIM_MEMORY", "1G", 1);
    setenv("CCA_ALLOC_CONF", "max_split_size_mb:64", 1);
    expect_ok(cca_init());
    expect_true(cca_is_initialized());
    expect_eq_str(cca_backend_name(), "sim");
    int n = 0;
    expect_ok(cca_device_count(&n));
    expect_eq_i64(n, 3);
    size_t free_b = 0, total = 0;
    expect_ok(cca_mem_get_info(2, &free_b, &total));
    expect_eq_u64(total, 1ull << 30);
    cca_device_stats_t s;
    expect_ok(cca_get_device_stats(0, &s));
    expect_eq_i64(s.max_split_size, 64 << 20);
    expect_ok(cca_set_device(2));
    int d = -1;
    expect_ok(cca_get_device(&d));
    expect_eq_i64(d, 2);
    void *p = NULL;
    expect_ok(cca_malloc(&p, 100, NULL));
    expect_ok(cca_get_device_stats(2, &s));
    expect_eq_i64(s.allocation[CCA_STAT_ALL].current, 1);
    expect_ok(cca_free(p));
    expect_status(cca_set_device(3), CCA_ERR_INVALID_ARGUMENT);
    expect_ok(cca_init()); /* a second call does nothing */
    reset_env();
    expect_false(cca_is_initialized());
}

TEST(cuda_malloc_async_from_environment)
{
    reset_env();
    setenv("CCA_BACKEND", "sim", 1);
    setenv("CCA_SIM_DEVICES", "2", 1);
    setenv("CCA_SIM_MEMORY", "1G", 1);
    setenv("CCA_ALLOC_CONF", "backend:cudaMallocAsync", 1);
    expect_ok(cca_init());
    void *p = NULL;
    expect_ok(cca_malloc_device(&p, 3 << 20, 1, NULL));
    cca_device_stats_t s;
    expect_ok(cca_get_device_stats(1, &s));
    expect_eq_i64(s.allocated_bytes[CCA_STAT_ALL].current, 3 << 20);
    expect_eq_i64(s.segment[CCA_STAT_ALL].current, 0); /* no segments of cca's own */
    expect_ok(cca_free(p));
    expect_status(cca_set_settings("backend:native"), CCA_ERR_NOT_SUPPORTED);
    reset_env();
}

TEST(bad_environment)
{
    reset_env();
    setenv("CCA_BACKEND", "tpu", 1);
    expect_status(cca_init(), CCA_ERR_INVALID_ARGUMENT);
    expect_contains(cca_last_error()->message, "CCA_BACKEND=tpu");
    setenv("CCA_BACKEND", "sim", 1);
    setenv("CCA_SIM_DEVICES", "0", 1);
    expect_status(cca_init(), CCA_ERR_INVALID_ARGUMENT);
    expect_contains(cca_last_error()->message, "CCA_SIM_DEVICES=0");
    setenv("CCA_SIM_DEVICES", "abc", 1);
    expect_status(cca_init(), CCA_ERR_INVALID_ARGUMENT);
    unsetenv("CCA_SIM_DEVICES");
    setenv("CCA_SIM_MEMORY", "12Q", 1);
    expect_status(cca_init(), CCA_ERR_INVALID_ARGUMENT);
    expect_contains(cca_last_error()->message, "CCA_SIM_MEMORY=12Q");
    unsetenv("CCA_SIM_MEMORY");
    setenv("CCA_ALLOC_CONF", "max_split_size_mb:1", 1);
    expect_status(cca_init(), CCA_ERR_BAD_SETTINGS);
    expect_contains(cca_last_error()->message, "max_split_size_mb");
    expect_false(cca_is_initialized());
    /* the public entry points report the init failure, and do not crash */
    void *p = NULL;
    expect_status(cca_malloc(&p, 10, NULL), CCA_ERR_BAD_SETTINGS);
    expect_status(cca_free((void *)16), CCA_ERR_INVALID_POINTER);
    reset_env();
}

TEST(cuda_backend_without_gpu_says_so)
{
    reset_env();
    cca_status_t st = cca_init(); /* the default backend is cuda */
    if (st == CCA_OK) {
        printf("  (a GPU is present: the no-GPU message is checked by the GPU suite)\n");
        expect_eq_str(cca_backend_name(), "cuda");
    } else {
        expect_true(st == CCA_ERR_NO_DEVICE || st == CCA_ERR_NOT_SUPPORTED);
        expect_contains(cca_last_error()->message, "CCA_BACKEND=sim");
        expect_false(cca_is_initialized());
    }
    reset_env();
}

TEST(no_caching_from_environment)
{
    reset_env();
    setenv("CCA_BACKEND", "sim", 1);
    setenv("CCA_NO_CACHING", "1", 1);
    expect_ok(cca_init());
    void *p = NULL;
    expect_ok(cca_malloc(&p, 100, NULL));
    expect_ok(cca_free(p));
    size_t cached = 1;
    expect_ok(cca_cache_info(0, &cached, NULL));
    expect_eq_u64(cached, 0);
    cca_device_stats_t s;
    expect_ok(cca_get_device_stats(0, &s));
    expect_eq_i64(s.num_device_free, 1);
    reset_env();
}

/* The settings in force: from the environment at init, then each cca_set_settings. */
TEST(settings_current_follows_runtime_changes)
{
    reset_env();
    setenv("CCA_BACKEND", "sim", 1);
    setenv("CCA_ALLOC_CONF", "max_split_size_mb:64", 1);
    char *text = NULL;
    expect_ok(cca_settings_current(&text)); /* before init: what init would start with */
    expect_contains(text, "max_split_size_mb 64 (environment)\n");
    free(text);
    expect_ok(cca_init());
    expect_ok(cca_set_settings("roundup_power2_divisions:[256:1,512:2,>:8],expandable_segments:True"));
    unsetenv("CCA_ALLOC_CONF"); /* no longer read: the live settings answer */
    text = NULL;
    expect_ok(cca_settings_current(&text));
    /* a run-time string resets max_split_size_mb first, as PyTorch's setAllocatorSettings */
    expect_contains(text, "max_split_size_mb unlimited (default)\n");
    expect_contains(text, "roundup_power2_divisions [256:1,512:2,>:8] (argument)\n");
    expect_contains(text, "expandable_segments True (argument)\n");
    free(text);
    expect_status(cca_set_settings("garbage_collection_threshold:2"), CCA_ERR_BAD_SETTINGS);
    text = NULL;
    expect_ok(cca_settings_current(&text)); /* a refused string changed nothing */
    expect_contains(text, "garbage_collection_threshold 0 (default)\n");
    free(text);
    expect_status(cca_settings_current(NULL), CCA_ERR_INVALID_ARGUMENT);
    reset_env();
}

int main(void)
{
    RUN(sim_from_environment);
    RUN(cuda_malloc_async_from_environment);
    RUN(bad_environment);
    RUN(cuda_backend_without_gpu_says_so);
    RUN(no_caching_from_environment);
    RUN(settings_current_follows_runtime_changes);
    return harness_done();
}
