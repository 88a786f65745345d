/*
 * test_async_capture_threads.c - backend:cudaMallocAsync's graph capture
 * under threads (run under ASan and TSan): 4 threads on 2 simulated devices
 * allocate, free and record_stream on streams of their own while the main
 * thread begins and ends captures over and over (a modelled capture on its
 * stream, allocations and frees inside it). Frees of allocations made before
 * a capture are deferred while it is underway and completed after it; every
 * free must succeed (the simulated driver would refuse an uncaptured free
 * inside a capture, so a free that reached it after a capture began would
 * fail). At the end nothing is deferred, nothing is live, and the backend
 * holds no allocation or event. Fixed-seed PRNGs, no sleeps.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "async.h"
#include "device.h"
#include "harness.h"

#define THREADS 4
#define KiB ((size_t)1 << 10)
#define MiB ((size_t)1 << 20)
#define CAPTURE_STREAM ((cca_stream_t)(uintptr_t)0x100)

static cca_backend_t *sim;
static atomic_uint_fast64_t errors;
static atomic_int workers_finished;

static uint64_t rng_next(uint64_t *s)
{
    uint64_t x = *s += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

static void fail(const char *what)
{
    atomic_fetch_add(&errors, 1);
    printf("  %s failed: %s\n", what, cca_last_error()->message);
}

static void quiet(const char *text, void *arg)
{
    (void)text; /* the warnings of captured frees: many, expected */
    (void)arg;
}

static void *worker(void *arg)
{
    int id = (int)(intptr_t)arg;
    uint64_t rng = 0xa57c0000ull + (uint64_t)id;
    cca_stream_t stream = (cca_stream_t)(uintptr_t)(0x1000 * (size_t)(id + 1));
    cca_stream_t other = (cca_stream_t)(uintptr_t)(0x1000 * (size_t)(id + 1) + 0x800);
    void *live[8] = {NULL};
    for (int op = 0; op < 3000; op++) {
        int slot = (int)(rng_next(&rng) % 8);
        if (live[slot]) {
            if (rng_next(&rng) % 4 == 0 && cca_record_stream(live[slot], other) != CCA_OK)
                fail("record_stream");
            if (cca_free(live[slot]) != CCA_OK)
                fail("free");
            live[slot] = NULL;
        } else {
            size_t size = 1 + rng_next(&rng) % (256 * KiB);
            if (cca_malloc_device(&live[slot], size, id % 2, stream) != CCA_OK)
                fail("malloc");
        }
    }
    for (int i = 0; i < 8; i++)
        if (live[i] && cca_free(live[i]) != CCA_OK)
            fail("final free");
    atomic_fetch_add(&workers_finished, 1);
    return NULL;
}

TEST(captures_under_threads)
{
    cca_sim_config_t cfg = {0};
    cfg.devices = 2;
    cfg.total_memory = 4ull << 30;
    cca_shutdown();
    if (cca_sim_create(&cfg, &sim) != CCA_OK ||
        cca_init_with_backend(sim, "backend:cudaMallocAsync") != CCA_OK) {
        HARNESS_FAIL("cannot set up: %s", cca_last_error()->message);
        return;
    }
    cca_register_output(quiet, NULL);
    pthread_t t[THREADS];
    for (int i = 0; i < THREADS; i++)
        pthread_create(&t[i], NULL, worker, (void *)(intptr_t)i);
    uint64_t captures = 0;
    cca_mempool_id_t id = cca_mempool_id_new(false);
    /* the main thread captures until every worker is done, then 20 times more */
    for (int after = 0; after < 20; after += atomic_load(&workers_finished) == THREADS) {
        if (cca_begin_allocate_stream_to_pool(0, id, CAPTURE_STREAM) != CCA_OK)
            fail("begin");
        if (cca_sim_capture_begin(sim, CAPTURE_STREAM) != CCA_OK)
            fail("capture begin");
        void *a = NULL, *b = NULL;
        if (cca_malloc(&a, MiB, CAPTURE_STREAM) != CCA_OK ||
            cca_malloc(&b, 64 * KiB, CAPTURE_STREAM) != CCA_OK)
            fail("malloc in the capture");
        if (a && cca_free(a) != CCA_OK)
            fail("free in the capture");
        if (cca_end_allocate_to_pool(0, id) != CCA_OK)
            fail("end");
        if (cca_sim_capture_end(sim, CAPTURE_STREAM) != CCA_OK)
            fail("capture end");
        if (b && cca_free(b) != CCA_OK) /* the graph's output, freed after it */
            fail("free after the capture");
        captures++;
    }
    for (int i = 0; i < THREADS; i++)
        pthread_join(t[i], NULL);
    /* the next allocation completes what the last capture deferred */
    void *p = NULL;
    expect_ok(cca_malloc(&p, 512, NULL));
    expect_ok(cca_free(p));
    cca_register_output(NULL, NULL);
    printf("  %llu captures\n", (unsigned long long)captures);
    expect_eq_u64(atomic_load(&errors), 0);
    expect_eq_u64(async_deferred_count(), 0);
    expect_eq_u64(async_live_count(), 0);
    expect_ok(cca_empty_cache());
    cca_sim_usage_t u;
    expect_ok(cca_sim_usage(sim, &u));
    expect_eq_u64(u.live_allocations, 0);
    expect_eq_u64(u.live_events, 0);
    cca_shutdown();
}

int main(void)
{
    RUN(captures_under_threads);
    return harness_done();
}
