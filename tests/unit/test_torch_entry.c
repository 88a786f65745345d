/*
 * test_torch_entry.c - the PyTorch pluggable-allocator entry points on the
 * simulated backend: allocation, free, failures reported through the output
 * sink with a NULL return.
 */
#include <string.h>

#include "cca.h"
#include "cca_backend.h"
#include "harness.h"

static char captured[4096];
static void capture(const char *text, void *arg)
{
    (void)arg;
    strncat(captured, text, sizeof(captured) - strlen(captured) - 1);
}

TEST(malloc_and_free)
{
    cca_sim_config_t cfg = {0};
    cfg.devices = 2;
    cfg.total_memory = 1ull << 30;
    cca_backend_t *sim;
    expect_ok(cca_sim_create(&cfg, &sim));
    expect_ok(cca_init_with_backend(sim, ""));
    void *p = cca_torch_malloc(1000, 1, NULL);
    expect_true(p != NULL);
    cca_device_stats_t s;
    expect_ok(cca_get_device_stats(1, &s));
    expect_eq_i64(s.allocation[CCA_STAT_ALL].current, 1);
    expect_eq_i64(s.requested_bytes[CCA_STAT_ALL].current, 1000);
    cca_torch_free(p, 1000, 1, NULL);
    expect_ok(cca_get_device_stats(1, &s));
    expect_eq_i64(s.allocation[CCA_STAT_ALL].current, 0);
    expect_true(cca_torch_malloc(0, 0, NULL) == NULL);
    expect_true(cca_torch_malloc(-5, 0, NULL) == NULL);
    cca_register_output(capture, NULL);
    captured[0] = '\0';
    expect_true(cca_torch_malloc((ptrdiff_t)2 << 30, 0, NULL) == NULL);
    expect_contains(captured, "CCA_ERR_OUT_OF_MEMORY");
    expect_contains(captured, "Tried to allocate 2.00 GiB");
    captured[0] = '\0';
    int local;
    cca_torch_free(&local, 4, 0, NULL);
    expect_contains(captured, "CCA_ERR_INVALID_POINTER");
    cca_register_output(NULL, NULL);
    cca_shutdown();
}

int main(void)
{
    RUN(malloc_and_free);
    return harness_done();
}
