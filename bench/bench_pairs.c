/*
 * bench_pairs.c - one cached pair, nothing else: N times cca_malloc + cca_free
 * of one size on one stream (or cca_host_malloc + cca_host_free), on the
 * simulated backend, after 1000 warm-up pairs; prints ns per pair. Made for
 * counting what a pair executes: run it under
 *   valgrind --tool=callgrind build/bench/bench_pairs 512 200000
 * and again with 0 pairs; the difference over 200,000 is the pair's
 * instruction count (BENCHMARKS.md).
 *
 * Usage: bench_pairs [SIZE [N [device|host|random]]]   (defaults: 512 1000000 device)
 *   random: N steps of bench_gpu's random_1thread workload instead (512 slots,
 *   log-uniform sizes in [512 B, 8 MiB], seed 42; SIZE unused); ns per step.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* setenv, clock_gettime under -std=c11 */
#endif
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "anchor_rng.h"
#include "cca.h"

static void pair(size_t size, cca_stream_t s, int host)
{
    void *p = NULL;
    cca_status_t st = host ? cca_host_malloc(&p, size) : cca_malloc(&p, size, s);
    if (st == CCA_OK)
        st = host ? cca_host_free(p) : cca_free(p);
    if (st != CCA_OK) {
        fprintf(stderr, "bench_pairs: %s: %s\n", cca_status_str(st), cca_last_error()->message);
        exit(1);
    }
}

/* bench_gpu's random workload on stream s: n steps, each a free of a live slot or an allocation. */
static void random_steps(cca_stream_t s, long n)
{
    enum { SLOTS = 512 };
    static void *live[SLOTS];
    mt64_t rng;
    mt64_seed(&rng, 42);
    const mt64_log_sizes_t sizes = mt64_log_sizes((size_t)8 << 20);
    for (long i = 0; i < n; i++) {
        int k = mt64_pick(&rng, SLOTS);
        cca_status_t st;
        if (live[k]) {
            st = cca_free(live[k]);
            live[k] = NULL;
        } else {
            st = cca_malloc(&live[k], mt64_log_size(&rng, &sizes), s);
        }
        if (st != CCA_OK) {
            fprintf(stderr, "bench_pairs: %s: %s\n", cca_status_str(st), cca_last_error()->message);
            exit(1);
        }
    }
}

int main(int argc, char **argv)
{
    size_t size = argc > 1 ? strtoull(argv[1], NULL, 0) : 512;
    long n = argc > 2 ? atol(argv[2]) : 1000000;
    int host = argc > 3 && !strcmp(argv[3], "host");
    int random = argc > 3 && !strcmp(argv[3], "random");
    setenv("CCA_BACKEND", "sim", 1);
    cca_status_t st = cca_init();
    if (st == CCA_OK)
        st = cca_set_device(0);
    if (st != CCA_OK) {
        fprintf(stderr, "bench_pairs: cca_init: %s\n", cca_last_error()->message);
        return 1;
    }
    cca_stream_t s = (cca_stream_t)(uintptr_t)0x1000;
    if (random) {
        struct timespec r0, r1;
        clock_gettime(CLOCK_MONOTONIC, &r0);
        random_steps(s, n);
        clock_gettime(CLOCK_MONOTONIC, &r1);
        double ns = (double)(r1.tv_sec - r0.tv_sec) * 1e9 + (double)(r1.tv_nsec - r0.tv_nsec);
        printf("random workload: %.1f ns per step\n", n > 0 ? ns / (double)n : 0.0);
        cca_device_stats_t ds;
        if (cca_get_device_stats(0, &ds) == CCA_OK)
            printf("backend allocations %lld, frees %lld, peak reserved %.1f MiB\n",
                   (long long)ds.num_device_alloc, (long long)ds.num_device_free,
                   (double)ds.reserved_bytes[CCA_STAT_ALL].peak / 1048576.0);
        cca_shutdown();
        return 0;
    }
    for (int i = 0; i < 1000; i++)
        pair(size, s, host);
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (long i = 0; i < n; i++)
        pair(size, s, host);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    double ns = (double)(t1.tv_sec - t0.tv_sec) * 1e9 + (double)(t1.tv_nsec - t0.tv_nsec);
    printf("%s pair %zu B: %.1f ns\n", host ? "pinned host" : "device", size, n > 0 ? ns / (double)n : 0.0);
    cca_shutdown();
    return 0;
}
