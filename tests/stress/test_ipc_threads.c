/*
 * test_ipc_threads.c - the IPC bookkeeping under threads (run under ASan and
 * TSan): 8 threads on 2 simulated devices allocate blocks, make 0 to 3 IPC
 * handles for each, free them (deferred while a handle is unreleased),
 * release the handles in a random order (before or after the free), collect
 * concurrently and allocate on the slow path (which collects too). At the
 * end every handle is released: one collection leaves nothing pending, the
 * statistics balance, the invariants hold and the backend holds nothing.
 * Fixed-seed PRNGs, no sleeps.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "device.h"
#include "harness.h"
#include "runtime.h"

#define THREADS 8
#define KiB ((size_t)1 << 10)
#define MiB ((size_t)1 << 20)

static cca_backend_t *sim;
static atomic_uint_fast64_t errors, deferred_frees, handles_made;

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

typedef struct pending {
    cca_ipc_mem_handle_t h[3];
    int n;
} pending_t;

static void *worker(void *arg)
{
    int id = (int)(intptr_t)arg;
    uint64_t rng = 0x1bc0000ull + (uint64_t)id;
    cca_stream_t stream = (cca_stream_t)(uintptr_t)(0x1000 * (size_t)(id + 1));
    pending_t later[16];
    int nlater = 0;
    for (int op = 0; op < 600; op++) {
        void *p = NULL;
        size_t size = rng_next(&rng) % 4 == 0 ? MiB + rng_next(&rng) % (8 * MiB)
                                              : 1 + rng_next(&rng) % (64 * KiB);
        if (cca_malloc_device(&p, size, id % 2, stream) != CCA_OK) {
            fail("malloc");
            continue;
        }
        pending_t pd;
        pd.n = (int)(rng_next(&rng) % 4);
        for (int k = 0; k < pd.n; k++) {
            if (cca_ipc_get_handle(p, stream, &pd.h[k]) != CCA_OK)
                fail("ipc_get_handle");
            atomic_fetch_add(&handles_made, 1);
        }
        bool release_first = rng_next(&rng) & 1;
        if (release_first)
            for (int k = 0; k < pd.n; k++)
                if (cca_ipc_release_handle(&pd.h[k]) != CCA_OK)
                    fail("ipc_release_handle");
        if (cca_free(p) != CCA_OK)
            fail("free");
        if (!release_first && pd.n) {
            atomic_fetch_add(&deferred_frees, 1);
            if (nlater == 16) { /* release the oldest set now */
                for (int k = 0; k < later[0].n; k++)
                    if (cca_ipc_release_handle(&later[0].h[k]) != CCA_OK)
                        fail("ipc_release_handle");
                memmove(&later[0], &later[1], 15 * sizeof(later[0]));
                nlater--;
            }
            later[nlater++] = pd;
        }
        uint64_t r = rng_next(&rng) % 10;
        if (r == 0) {
            size_t left = 0;
            if (cca_ipc_collect(&left) != CCA_OK)
                fail("ipc_collect");
        } else if (r == 1 && nlater) {
            int i = (int)(rng_next(&rng) % (uint64_t)nlater);
            for (int k = 0; k < later[i].n; k++)
                if (cca_ipc_release_handle(&later[i].h[k]) != CCA_OK)
                    fail("ipc_release_handle");
            later[i] = later[--nlater];
        }
    }
    for (int i = 0; i < nlater; i++)
        for (int k = 0; k < later[i].n; k++)
            if (cca_ipc_release_handle(&later[i].h[k]) != CCA_OK)
                fail("ipc_release_handle");
    return NULL;
}

TEST(threads_share_free_release_collect)
{
    cca_sim_config_t cfg = {0};
    cfg.devices = 2;
    cfg.total_memory = 4ull << 30;
    cca_shutdown();
    if (cca_sim_create(&cfg, &sim) != CCA_OK || cca_init_with_backend(sim, "") != CCA_OK) {
        HARNESS_FAIL("setup: %s", cca_last_error()->message);
        return;
    }
    pthread_t t[THREADS];
    for (int i = 0; i < THREADS; i++)
        pthread_create(&t[i], NULL, worker, (void *)(intptr_t)i);
    for (int i = 0; i < THREADS; i++)
        pthread_join(t[i], NULL);
    size_t left = 99;
    expect_ok(cca_ipc_collect(&left));
    expect_eq_u64(left, 0);
    expect_ok(cca_empty_cache());
    char why[512];
    if (alloc_check_invariants(why, sizeof(why)) != CCA_OK)
        HARNESS_FAIL("at the end: %s", why);
    for (int d = 0; d < 2; d++) {
        cca_device_stats_t s;
        expect_ok(cca_get_device_stats(d, &s));
        expect_eq_i64(s.allocated_bytes[CCA_STAT_ALL].current, 0);
        expect_eq_i64(s.reserved_bytes[CCA_STAT_ALL].current, 0);
    }
    cca_sim_usage_t u;
    expect_ok(cca_sim_usage(sim, &u));
    expect_eq_u64(u.device_bytes[0] + u.device_bytes[1], 0);
    expect_eq_u64(u.live_allocations, 0);
    expect_eq_u64(u.live_events, 0);
    expect_eq_u64(atomic_load(&errors), 0);
    expect_true(atomic_load(&deferred_frees) > 0);
    printf("ipc threads: %d threads, %llu handles, %llu frees deferred\n", THREADS,
           (unsigned long long)atomic_load(&handles_made),
           (unsigned long long)atomic_load(&deferred_frees));
    cca_shutdown();
}

int main(void)
{
    RUN(threads_share_free_release_collect);
    return harness_done();
}
