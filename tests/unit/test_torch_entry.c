/*
 * test_torch_entry.c - the PyTorch pluggable-allocator entry points on the
 * simulated backend: allocation, free, failures reported through the output
 * sink with a NULL return; and what the C++ PyTorch adapter relies on: the
 * memory-fraction query and the context release callback.
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

static cca_backend_t *sim_two_devices(void)
{
    cca_sim_config_t cfg = {0};
    cfg.devices = 2;
    cfg.total_memory = 1ull << 30;
    cca_backend_t *sim = NULL;
    expect_ok(cca_sim_create(&cfg, &sim));
    return sim;
}

TEST(memory_fraction_query)
{
    expect_ok(cca_init_with_backend(sim_two_devices(), ""));
    double f = -1;
    expect_ok(cca_get_memory_fraction(0, &f));
    expect_true(f == 1.0);
    expect_ok(cca_set_memory_fraction(0.5, 1));
    expect_ok(cca_get_memory_fraction(1, &f));
    expect_true(f == 0.5);
    expect_ok(cca_get_memory_fraction(0, &f));
    expect_true(f == 1.0);
    expect_ok(cca_set_settings("per_process_memory_fraction:0.25"));
    expect_ok(cca_get_memory_fraction(0, &f));
    expect_true(f == 0.25);
    f = 7;
    expect_eq_i64(cca_get_memory_fraction(2, &f), CCA_ERR_INVALID_ARGUMENT);
    expect_true(f == 7);
    expect_eq_i64(cca_get_memory_fraction(-1, &f), CCA_ERR_INVALID_ARGUMENT);
    expect_eq_i64(cca_get_memory_fraction(0, NULL), CCA_ERR_INVALID_ARGUMENT);
    cca_shutdown();
}

/* Contexts named "c<n>": the release callback must see each exactly once, and only once cca is done with it. */
#define MAX_CONTEXTS 256
static int contexts_made;
static int released[MAX_CONTEXTS];
static int release_bad;

static const char *numbered_context(void *arg)
{
    static char text[16];
    (void)arg;
    snprintf(text, sizeof(text), "c%d", contexts_made++);
    return text;
}

static void count_release(const char *context, void *arg)
{
    int n = -1;
    expect_true(arg == (void *)&released);
    if (sscanf(context, "c%d", &n) != 1 || n < 0 || n >= contexts_made || released[n]++)
        release_bad++;
}

TEST(context_release)
{
    expect_ok(cca_init_with_backend(sim_two_devices(), ""));
    cca_set_context_release(count_release, &released);
    expect_ok(cca_record_history(true, numbered_context, NULL, 4, CCA_RECORD_CONTEXT_ALLOC));
    void *keep = NULL;
    expect_ok(cca_malloc(&keep, 4096, NULL)); /* context c0, live until freed */
    for (int i = 0; i < 20; i++) {
        void *p = NULL;
        expect_ok(cca_malloc(&p, 1000 + (size_t)i, NULL));
        expect_ok(cca_free(p));
    }
    expect_eq_i64(contexts_made, 21);
    expect_eq_i64(release_bad, 0);
    expect_eq_i64(released[0], 0);  /* out of the 4-entry ring, but its block lives */
    expect_eq_i64(released[1], 1);  /* freed and overwritten long ago */
    expect_eq_i64(released[20], 0); /* still in the ring */
    cca_snapshot_t *snap = NULL;
    expect_ok(cca_snapshot(&snap));
    expect_true(snap->segment_count > 0 && snap->segments[0].blocks[0].context &&
                !strcmp(snap->segments[0].blocks[0].context, "c0"));
    cca_snapshot_free(snap);
    expect_ok(cca_free(keep));
    expect_ok(cca_record_history(false, NULL, NULL, 0, CCA_RECORD_CONTEXT_NEVER));
    for (int i = 0; i < contexts_made; i++)
        expect_eq_i64(released[i], 1);
    expect_eq_i64(release_bad, 0);
    cca_set_context_release(NULL, NULL);
    cca_shutdown();
}

int main(void)
{
    RUN(malloc_and_free);
    RUN(memory_fraction_query);
    RUN(context_release);
    return harness_done();
}
