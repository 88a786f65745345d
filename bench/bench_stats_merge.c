/*
 * bench_stats_merge.c - the exact statistics' merge on one core: what applying
 * one logged update costs the thread that merges the stream pools' logs
 * (stats_merge), which bounds the default mode's throughput once several
 * threads allocate at once (bench_gpu's threads=N rows).
 *
 *   bench_stats_merge [STREAMS] [ROUNDS]     default 16 streams (2 to 64), 2000 rounds
 *
 * On the simulated backend: one thread holds the stats lock, so that every
 * operation is logged in its stream pool's log and none is merged; it makes
 * 60 operations on each of STREAMS streams, taken in turn (the logs' entries
 * interleave in time as those of threads on their own streams do), each a
 * free of a random live slot of the stream's 16 or an allocation into an
 * empty one (sizes from 512 B to 1 MiB), then merges them, timed. Prints the merge's nanoseconds per entry. The
 * entries are in this core's cache: the transfers of another core's lines
 * that a real merge also waits for are not in the figure.
 */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "cca.h"
#include "cca_backend.h"
#include "device.h"
#include "runtime.h"

#define MAX_STREAMS 64
#define OPS_PER_STREAM 60 /* a log's entries under half of it: no producer asks for a merge */
#define SLOTS 16

static double now_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec * 1e9 + (double)t.tv_nsec;
}

static void check(cca_status_t st, const char *what)
{
    if (st != CCA_OK) {
        fprintf(stderr, "bench_stats_merge: %s: %s\n", what, cca_last_error()->message);
        exit(1);
    }
}

static cca_stream_t stream_of(int i)
{
    return (cca_stream_t)(uintptr_t)(0x1000 + (uintptr_t)i * 0x100);
}

/* An allocation by another thread while the caller holds the stats lock: its pool logs,
 * and from then on every pool does. */
static void *logging_starter(void *arg)
{
    (void)arg;
    void *p = NULL;
    check(cca_malloc_device(&p, 4096, 0, stream_of(0)), "cca_malloc_device");
    return p;
}

int main(int argc, char **argv)
{
    int streams = argc > 1 ? atoi(argv[1]) : 16;
    long rounds = argc > 2 ? atol(argv[2]) : 2000;
    if (streams < 2 || streams > MAX_STREAMS || rounds < 1) { /* one pool alone does not log */
        fprintf(stderr, "usage: bench_stats_merge [STREAMS 2-%d] [ROUNDS]\n", MAX_STREAMS);
        return 2;
    }
    cca_sim_config_t cfg = {0};
    cfg.devices = 1;
    cca_backend_t *sim;
    check(cca_sim_create(&cfg, &sim), "cca_sim_create");
    check(cca_init_with_backend(sim, ""), "cca_init_with_backend");
    cca_device_t *dev = &cca_state->devices[0];
    /* every stream's pool made, with cached segments that hold four times what its slots
     * can (a growth would take the stats lock this thread holds while operations are logged:
     * 64 small segments, of which 16 live blocks leave 48 whole, and 7 large ones, of which
     * one holds 2 blocks at most and a free run of 5 MiB) */
    for (int i = 0; i < streams; i++) {
        void *p[4 * SLOTS][2];
        for (int j = 0; j < 4 * SLOTS; j++) {
            check(cca_malloc_device(&p[j][0], 1u << 20, 0, stream_of(i)), "cca_malloc_device");
            check(cca_malloc_device(&p[j][1], 2u << 20, 0, stream_of(i)), "cca_malloc_device");
        }
        for (int j = 0; j < 4 * SLOTS; j++) {
            check(cca_free(p[j][0]), "cca_free");
            check(cca_free(p[j][1]), "cca_free");
        }
    }
    stats_lock(dev);
    pthread_t t;
    void *first = NULL;
    pthread_create(&t, NULL, logging_starter, NULL);
    pthread_join(t, &first);
    stats_merge(dev);
    stats_unlock(dev);
    check(cca_free(first), "cca_free");
    if (atomic_load(&dev->ops->log_count) == 0) {
        fprintf(stderr, "bench_stats_merge: the pools do not log (the clock is too coarse)\n");
        return 1;
    }
    double merge_ns = 0;
    uint64_t entries = 0, rng = 42;
    void *live[MAX_STREAMS][SLOTS] = {{0}};
    for (long r = 0; r < rounds; r++) {
        stats_lock(dev);
        uint64_t before = dev->ops->merged;
        for (int k = 0; k < OPS_PER_STREAM; k++)
            for (int i = 0; i < streams; i++) {
                /* bench_gpu's threads' workload, in small: a random slot freed or filled
                 * (sizes log-uniform in [512 B, 1 MiB], both pools) */
                rng = rng * 6364136223846793005ull + 1442695040888963407ull;
                void **slot = &live[i][(rng >> 33) % SLOTS];
                if (*slot) {
                    check(cca_free(*slot), "cca_free");
                    *slot = NULL;
                } else {
                    size_t size = (size_t)512 << ((rng >> 40) % 12);
                    size += (size_t)((rng >> 20) % 512) * (size / 512);
                    check(cca_malloc_device(slot, size, 0, stream_of(i)), "cca_malloc_device");
                }
            }
        double t0 = now_ns();
        stats_merge(dev);
        merge_ns += now_ns() - t0;
        entries += dev->ops->merged - before;
        stats_unlock(dev);
    }
    for (int i = 0; i < streams; i++)
        for (int j = 0; j < SLOTS; j++)
            if (live[i][j])
                check(cca_free(live[i][j]), "cca_free");
    printf("stats merge: %d streams, %llu entries, %.1f ns per entry\n", streams,
           (unsigned long long)entries, entries ? merge_ns / (double)entries : 0.0);
    cca_shutdown();
    return 0;
}
