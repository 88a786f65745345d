/*
 * test_settings_threads.c - cca_set_settings while other threads use the
 * allocator: 4 threads allocate and free on streams of their own, sizes
 * across every rounding interval (malloc's rounding reads the settings
 * before it takes a lock), with record_stream now and then; a reader takes
 * snapshots, serializes one with its settings, reads the statistics
 * (max_split_size) and the summary, and empties the cache (release); a
 * writer switches among six settings strings, ten rounds (rounding
 * divisions, split sizes, garbage collection under a fraction, expandable
 * segments on and off), the workers going on until it is done. Every call
 * must succeed; at the end the invariants hold, nothing is allocated, the
 * emptied cache leaves the backend empty, and the settings kept for readers
 * without a lock are the distinct settings set, reused when they come back:
 * at most the first round's six (each key's source still default until
 * set), the next round's six and the initial one, and two more rounds add
 * none.
 * Run under TSan by `make test` (-L stress): before the settings were
 * replaced whole through one pointer, each reader here raced the writer.
 * Fixed-seed PRNGs; no sleeps. STRESS_OPS overrides the operations per thread.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "check.h"
#include "device.h"
#include "harness.h"
#include "runtime.h"
#include "state.h"

#define WORKERS 4
#define LIVE 16
#define MiB ((size_t)1 << 20)

static const char *const settings_cycle[] = {
    "roundup_power2_divisions:4,max_split_size_mb:64",
    "roundup_power2_divisions:[1:8,64:2,>:1],max_split_size_mb:40,max_non_split_rounding_mb:60",
    "garbage_collection_threshold:0.6,per_process_memory_fraction:0.9",
    "expandable_segments:True,per_process_memory_fraction:0",
    "expandable_segments:False,roundup_power2_divisions:1",
    "large_segment_size_mb:40,max_split_size_mb:1000000000",
};
#define SETTINGS_COUNT (sizeof(settings_cycle) / sizeof(settings_cycle[0]))

#define ROUNDS 10

static atomic_bool stop, writer_done;
static atomic_uint_fast64_t errors, changes, reads;
static int ops_per_worker = 3000;

static uint64_t rng_next(uint64_t *s)
{
    uint64_t x = *s += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

static void failed(const char *what)
{
    atomic_fetch_add(&errors, 1);
    printf("  %s: %s\n", what, cca_last_error()->message);
}

static void *worker(void *arg)
{
    uint64_t rng = 0x5eed0000u + (uintptr_t)arg;
    cca_stream_t stream = (cca_stream_t)(uintptr_t)(0x1000 * (1 + (uintptr_t)arg));
    cca_stream_t other = (cca_stream_t)(uintptr_t)0x9000;
    void *live[LIVE] = {0};
    for (int i = 0; i < ops_per_worker || !atomic_load(&writer_done); i++) {
        size_t k = rng_next(&rng) % LIVE;
        if (live[k]) {
            if (rng_next(&rng) % 8 == 0 && cca_record_stream(live[k], other) != CCA_OK)
                failed("cca_record_stream");
            if (cca_free(live[k]) != CCA_OK)
                failed("cca_free");
            live[k] = NULL;
            continue;
        }
        /* 512 B to 96 MiB: the small pool, then each rounding interval up to 64 MiB+ */
        int shift = 9 + (int)(rng_next(&rng) % 18);
        size_t size = ((size_t)1 << shift) + rng_next(&rng) % ((size_t)1 << shift);
        if (cca_malloc(&live[k], size, stream) != CCA_OK) {
            failed("cca_malloc");
            live[k] = NULL;
        }
    }
    for (size_t k = 0; k < LIVE; k++)
        if (live[k] && cca_free(live[k]) != CCA_OK)
            failed("cca_free");
    return NULL;
}

static void *reader(void *arg)
{
    (void)arg;
    uint64_t n = 0;
    while (!atomic_load(&stop)) {
        cca_snapshot_t *snap = NULL;
        if (cca_snapshot(&snap) != CCA_OK)
            failed("cca_snapshot");
        cca_snapshot_free(snap);
        cca_device_stats_t stats;
        if (cca_get_device_stats(0, &stats) != CCA_OK)
            failed("cca_get_device_stats");
        if (n % 8 == 0) {
            char path[64];
            snprintf(path, sizeof(path), "/tmp/cca-settings-threads-%d.pickle", (int)getpid());
            if (cca_dump_snapshot(path) != CCA_OK)
                failed("cca_dump_snapshot");
            remove(path);
            char *text = NULL;
            if (cca_memory_summary(0, true, &text) != CCA_OK)
                failed("cca_memory_summary");
            free(text);
            if (cca_empty_cache() != CCA_OK)
                failed("cca_empty_cache");
        }
        n++;
    }
    atomic_store(&reads, n);
    return NULL;
}

static void *writer(void *arg)
{
    (void)arg;
    uint64_t n = 0;
    for (; n < ROUNDS * SETTINGS_COUNT; n++)
        if (cca_set_settings(settings_cycle[n % SETTINGS_COUNT]) != CCA_OK)
            failed("cca_set_settings");
    atomic_store(&changes, n);
    atomic_store(&writer_done, true);
    return NULL;
}

TEST(settings_change_under_allocations)
{
    cca_shutdown();
    cca_sim_config_t cfg = {0};
    cfg.devices = 1;
    cfg.total_memory = 16ull << 30;
    cca_backend_t *sim = NULL;
    expect_ok(cca_sim_create(&cfg, &sim));
    expect_ok(cca_init_with_backend(sim, ""));
    atomic_store(&stop, false);
    atomic_store(&writer_done, false);
    pthread_t w[WORKERS], r, s;
    pthread_create(&s, NULL, writer, NULL);
    pthread_create(&r, NULL, reader, NULL);
    for (uintptr_t i = 0; i < WORKERS; i++)
        pthread_create(&w[i], NULL, worker, (void *)i);
    for (int i = 0; i < WORKERS; i++)
        pthread_join(w[i], NULL);
    atomic_store(&stop, true);
    pthread_join(r, NULL);
    pthread_join(s, NULL);
    printf("settings threads: %d workers x %d ops, %llu settings changes, %llu reads, "
           "%zu settings kept\n",
           WORKERS, ops_per_worker, (unsigned long long)atomic_load(&changes),
           (unsigned long long)atomic_load(&reads), state_settings_kept());
    expect_eq_u64(atomic_load(&errors), 0);
    expect_eq_u64(atomic_load(&changes), ROUNDS * SETTINGS_COUNT);
    size_t kept = state_settings_kept();
    expect_true(kept > SETTINGS_COUNT && kept <= 1 + 2 * SETTINGS_COUNT);
    for (size_t i = 0; i < 2 * SETTINGS_COUNT; i++) /* two more rounds keep nothing new */
        expect_ok(cca_set_settings(settings_cycle[i % SETTINGS_COUNT]));
    expect_eq_u64(state_settings_kept(), kept);
    char why[512];
    expect_ok(alloc_check_invariants(why, sizeof(why)));
    cca_device_stats_t st;
    expect_ok(cca_get_device_stats(0, &st));
    expect_eq_i64(st.allocation[CCA_STAT_ALL].current, 0);
    expect_ok(cca_set_settings("expandable_segments:False"));
    expect_ok(cca_empty_cache());
    cca_sim_usage_t usage;
    cca_sim_usage(sim, &usage);
    expect_eq_u64(usage.device_bytes[0], 0);
    expect_eq_u64(usage.live_reservations, 0);
    cca_shutdown();
}

int main(void)
{
    const char *ops = getenv("STRESS_OPS");
    if (ops && atoi(ops) > 0)
        ops_per_worker = atoi(ops);
    RUN(settings_change_under_allocations);
    return harness_done();
}
