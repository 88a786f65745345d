/*
 * test_relaxed_stats.c - exact_peak_stats:False under concurrency: threads on
 * their own streams hit the slow path (new segments, peak sampling) at the
 * same time, with readers summing the statistics meanwhile. It must not
 * deadlock, and the summed values must come out exact once all is freed.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>

#include "cca.h"
#include "check.h"
#include "runtime.h"
#include "cca_backend.h"
#include "harness.h"

#define THREADS 8
#define ROUNDS 60
#define LIVE 24

static atomic_int running;

static void *worker(void *arg)
{
    uintptr_t id = (uintptr_t)arg;
    cca_stream_t stream = (cca_stream_t)(0x1000 + id * 0x100);
    unsigned seed = (unsigned)id * 7919u + 1;
    void *live[LIVE];
    for (int r = 0; r < ROUNDS; r++) {
        for (int i = 0; i < LIVE; i++) {
            seed = seed * 1103515245u + 12345u;
            size_t size = 512 + (size_t)(seed >> 8) % (24u << 20);
            live[i] = NULL;
            if (cca_malloc_device(&live[i], size, 0, stream) != CCA_OK)
                live[i] = NULL;
        }
        for (int i = 0; i < LIVE; i++)
            cca_free(live[i]);
        if (r % 20 == (int)id % 20)
            cca_empty_cache();
    }
    atomic_fetch_sub(&running, 1);
    return NULL;
}

static void *reader(void *arg)
{
    (void)arg;
    cca_device_stats_t s;
    while (atomic_load(&running) > 0)
        cca_get_device_stats(0, &s);
    return NULL;
}

TEST(concurrent_slow_paths_and_reads)
{
    cca_sim_config_t cfg = {0};
    cfg.devices = 1;
    cfg.total_memory = (size_t)1 << 40;
    cca_backend_t *sim;
    expect_ok(cca_sim_create(&cfg, &sim));
    expect_ok(cca_init_with_backend(sim, "exact_peak_stats:False"));
    pthread_t t[THREADS], rd;
    atomic_store(&running, THREADS);
    for (uintptr_t i = 0; i < THREADS; i++)
        pthread_create(&t[i], NULL, worker, (void *)i);
    pthread_create(&rd, NULL, reader, NULL);
    for (int i = 0; i < THREADS; i++)
        pthread_join(t[i], NULL);
    pthread_join(rd, NULL);
    cca_device_stats_t s;
    expect_ok(cca_get_device_stats(0, &s));
    expect_eq_i64(s.allocation[CCA_STAT_ALL].current, 0);
    expect_eq_i64(s.allocated_bytes[CCA_STAT_ALL].current, 0);
    expect_eq_i64(s.active_bytes[CCA_STAT_ALL].current, 0);
    expect_eq_i64(s.allocation[CCA_STAT_ALL].allocated, (int64_t)THREADS * ROUNDS * LIVE);
    expect_eq_i64(s.allocation[CCA_STAT_ALL].freed, (int64_t)THREADS * ROUNDS * LIVE);
    expect_true(s.allocated_bytes[CCA_STAT_ALL].peak > 0);
    expect_true(s.allocated_bytes[CCA_STAT_ALL].peak <= s.reserved_bytes[CCA_STAT_ALL].peak);
    char why[512] = "";
    expect_ok(alloc_check_invariants(why, sizeof(why)));
    if (why[0])
        printf("  %s\n", why);
    cca_shutdown();
}

TEST(single_stream_relaxed_equals_exact)
{
    /* One stream: the summed statistics are the stream's, sampled peaks
     * included at every slow path; currents and totals are exact. */
    for (int mode = 0; mode < 2; mode++) {
        cca_sim_config_t cfg = {0};
        cca_backend_t *sim;
        expect_ok(cca_sim_create(&cfg, &sim));
        expect_ok(cca_init_with_backend(sim, mode ? "exact_peak_stats:False" : ""));
        void *p[10];
        for (int i = 0; i < 10; i++)
            expect_ok(cca_malloc_device(&p[i], (size_t)(i + 1) << 20, 0, NULL));
        for (int i = 0; i < 10; i += 2)
            expect_ok(cca_free(p[i]));
        char why[512] = "";
        expect_ok(alloc_check_invariants(why, sizeof(why)));
        if (why[0])
            printf("  %s\n", why);
        cca_device_stats_t s;
        expect_ok(cca_get_device_stats(0, &s));
        expect_eq_i64(s.allocation[CCA_STAT_ALL].current, 5);
        expect_eq_i64(s.allocation[CCA_STAT_ALL].freed, 5);
        expect_eq_i64(s.active[CCA_STAT_LARGE_POOL].current, 5);
        expect_eq_i64(s.segment[CCA_STAT_ALL].current, s.num_device_alloc);
        for (int i = 1; i < 10; i += 2)
            expect_ok(cca_free(p[i]));
        cca_shutdown();
    }
}

int main(void)
{
    RUN(concurrent_slow_paths_and_reads);
    RUN(single_stream_relaxed_equals_exact);
    return harness_done();
}
