/*
 * bench_floor.c - what the random workload costs below cca: the anchor's
 * random_1thread steps (anchor_rng.h: 512 slots, log-uniform sizes in
 * [512 B, 8 MiB], seed 42) through PyTorch's placement alone
 * (tests/placement_model.h: cca's own block structs and free bins, with no
 * statistics, locks, device question, history, events or settings). Four
 * figures, each the best of ROUNDS runs of STEPS steps, in one process:
 *   draws       the draws and slot bookkeeping, no allocator;
 *   placement   + best fit, split, merge (a slot keeps its block);
 *   + map       + a pointer map from address to block, as a free by address needs;
 *   cca         cca_malloc / cca_free on the simulated device (the whole library).
 * The bench checks that the model made the segments cca made (count and
 * bytes): the same placement, so the figures differ only by what cca does
 * around it (tests/unit/test_placement_model.c checks every allocation).
 *
 * Usage: bench_floor [STEPS [ROUNDS]]   (defaults: 1000000 7)
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "anchor_rng.h"
#include "cca.h"
#include "device.h" /* cca_block_t, cca_bins_t, bins.h */

#include "ptrmap.h"

#include "../tests/placement_model.h"

#define SLOTS 512
#define MiB ((size_t)1 << 20)

static double now_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec * 1e9 + (double)t.tv_nsec;
}

static void die(const char *what)
{
    fprintf(stderr, "bench_floor: %s\n", what);
    exit(1);
}

enum { RUN_DRAWS, RUN_PLACEMENT, RUN_MAP, RUN_CCA, RUN_KINDS };

/* One run of steps steps; ns a step. */
static double run(int kind, long steps, model_t *m)
{
    static void *live[SLOTS];
    static cca_block_t *blocks[SLOTS];
    static size_t sizes_held[SLOTS];
    memset(live, 0, sizeof(live));
    mt64_t rng;
    mt64_seed(&rng, 42);
    const mt64_log_sizes_t sizes = mt64_log_sizes(8 * MiB);
    cca_stream_t s = (cca_stream_t)(uintptr_t)0x1000;
    double t0 = now_ns();
    for (long i = 0; i < steps; i++) {
        int k = mt64_pick(&rng, SLOTS);
        if (live[k]) {
            if (kind == RUN_CCA) {
                if (cca_free(live[k]) != CCA_OK)
                    die(cca_last_error()->message);
            } else if (kind != RUN_DRAWS) {
                model_free(m, (uintptr_t)live[k], blocks[k]);
            }
            live[k] = NULL;
        } else {
            size_t size = mt64_log_size(&rng, &sizes);
            if (kind == RUN_CCA) {
                if (cca_malloc(&live[k], size, s) != CCA_OK)
                    die(cca_last_error()->message);
            } else if (kind == RUN_DRAWS) {
                sizes_held[k] = size;
                live[k] = &sizes_held[k];
            } else {
                if (!(blocks[k] = model_malloc(m, size, 0)))
                    die("the model ran out of host memory or segment ids");
                live[k] = (void *)blocks[k]->addr;
            }
        }
    }
    double dt = now_ns() - t0;
    for (int k = 0; k < SLOTS; k++) {
        if (!live[k])
            continue;
        if (kind == RUN_CCA)
            cca_free(live[k]);
        else if (kind != RUN_DRAWS)
            model_free(m, (uintptr_t)live[k], blocks[k]);
    }
    return steps ? dt / (double)steps : 0.0;
}

int main(int argc, char **argv)
{
    long steps = argc > 1 ? atol(argv[1]) : 1000000;
    int rounds = argc > 2 ? atoi(argv[2]) : 7;
    if (steps < 0 || rounds < 1)
        die("usage: bench_floor [STEPS [ROUNDS]]");
    setenv("CCA_BACKEND", "sim", 1);
    if (cca_init() != CCA_OK || cca_set_device(0) != CCA_OK)
        die(cca_last_error()->message);
    model_t *m = malloc(sizeof(*m));
    if (!m || !model_init(m))
        die("out of host memory");
    static const char *names[RUN_KINDS] = {"draws", "placement", "placement_map", "cca"};
    double best[RUN_KINDS];
    for (int kind = 0; kind < RUN_KINDS; kind++)
        best[kind] = 1e300;
    /* the kinds in turn, round after round: a slow moment of the machine meets each */
    for (int r = 0; r < rounds; r++) {
        for (int kind = 0; kind < RUN_KINDS; kind++) {
            m->with_map = kind == RUN_MAP;
            double ns = run(kind, steps, m);
            if (ns < best[kind])
                best[kind] = ns;
        }
    }
    /* the segments both made over all runs (both keep them cached from run to run) */
    cca_device_stats_t ds;
    if (cca_get_device_stats(0, &ds) != CCA_OK)
        die(cca_last_error()->message);
    bool same = m->segments == (size_t)ds.num_device_alloc &&
                m->reserved == (size_t)ds.reserved_bytes[CCA_STAT_ALL].current;
    for (int kind = 0; kind < RUN_KINDS; kind++)
        printf("RESULT %s random_1thread ns_per_op=%.1f\n", names[kind], best[kind]);
    printf("# the random workload, %ld steps, best of %d runs each (ns a step):\n", steps, rounds);
    printf("#   draws alone %.1f; PyTorch's placement %.1f (%.1f of it the allocator's); with a pointer map "
           "%.1f (%.1f); cca %.1f (%.1f)\n",
           best[RUN_DRAWS], best[RUN_PLACEMENT], best[RUN_PLACEMENT] - best[RUN_DRAWS], best[RUN_MAP],
           best[RUN_MAP] - best[RUN_DRAWS], best[RUN_CCA], best[RUN_CCA] - best[RUN_DRAWS]);
    printf("# segments: placement %zu (%.1f MiB), cca %lld (%.1f MiB): %s\n", m->segments,
           (double)m->reserved / (double)MiB, (long long)ds.num_device_alloc,
           (double)ds.reserved_bytes[CCA_STAT_ALL].current / (double)MiB,
           same ? "the same placement" : "DIFFERENT");
    model_destroy(m);
    free(m);
    cca_shutdown();
    return same ? 0 : 1;
}
