/*
 * bench_plan_loops.c - compact_memory's planned placement on loops drawn at
 * random (tests/plan_loop.h: N large requests a step, sizes and lifetimes
 * from a seed, every block freed by the step's end), each seed run twice on a
 * simulated 16 GiB device under compact_memory:True: with plans made as the
 * mode makes them, and with none (plan_test_off: every request by best fit).
 * Prints, per seed, the maps in the second half of the steps and peak
 * reserved / peak requested of both runs, the plans made, then a summary.
 *
 * Usage: bench_plan_loops [SEEDS [N [STEPS]]]   (defaults: 30 48 30)
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cca.h"
#include "cca_backend.h"
#include "device.h" /* plan_test_off (plan.h) */

#include "../tests/plan_loop.h"

typedef struct run {
    long long late_maps, plans;
    double ratio;
} run_t;

static long long extra(const char *key)
{
    cca_stat_entry_t e[CCA_MEMORY_STATS_EXTRA_COUNT];
    if (cca_memory_stats_extra(0, e, CCA_MEMORY_STATS_EXTRA_COUNT) != CCA_OK)
        return -1;
    for (int i = 0; i < CCA_MEMORY_STATS_EXTRA_COUNT; i++)
        if (!strcmp(e[i].key, key))
            return e[i].value;
    return -1;
}

static int run(unsigned seed, int n, int steps, bool plans, run_t *out)
{
    cca_sim_config_t cfg = {0};
    cfg.devices = 1;
    cfg.total_memory = 16ull << 30;
    cca_backend_t *sim = NULL;
    cca_shutdown();
    if (cca_sim_create(&cfg, &sim) != CCA_OK || cca_init_with_backend(sim, "compact_memory:True") != CCA_OK) {
        fprintf(stderr, "bench_plan_loops: %s\n", cca_last_error()->message);
        return 1;
    }
    plan_test_off(!plans);
    plan_loop_t l;
    plan_loop_init(&l, seed, n, 1, NULL);
    out->late_maps = 0;
    for (int step = 0; step < steps; step++) {
        cca_device_stats_t a, b;
        cca_get_device_stats(0, &a);
        if (plan_loop_step(&l) != CCA_OK) {
            fprintf(stderr, "bench_plan_loops: seed %u: %s\n", seed, cca_last_error()->message);
            return 1;
        }
        cca_get_device_stats(0, &b);
        if (step >= steps / 2)
            out->late_maps += b.num_device_alloc - a.num_device_alloc;
    }
    cca_device_stats_t s;
    cca_get_device_stats(0, &s);
    out->ratio = (double)s.reserved_bytes[CCA_STAT_ALL].peak / (double)s.requested_bytes[CCA_STAT_ALL].peak;
    out->plans = extra("cca.compact_plans");
    plan_loop_end(&l);
    plan_test_off(false);
    cca_shutdown();
    return 0;
}

int main(int argc, char **argv)
{
    int seeds = argc > 1 ? atoi(argv[1]) : 30, n = argc > 2 ? atoi(argv[2]) : 48;
    int steps = argc > 3 ? atoi(argv[3]) : 30;
    int moving = 0, settled = 0, higher = 0;
    printf("seed | best fit: maps in 2nd half, peak res/req | planned: plans, maps in 2nd half, peak res/req\n");
    for (int seed = 1; seed <= seeds; seed++) {
        run_t off, on;
        if (run((unsigned)seed, n, steps, false, &off) || run((unsigned)seed, n, steps, true, &on))
            return 1;
        printf("%4d | %4lld %.3f | %lld %4lld %.3f\n", seed, off.late_maps, off.ratio, on.plans, on.late_maps,
               on.ratio);
        moving += off.late_maps > 0;
        settled += off.late_maps > 0 && on.late_maps == 0;
        higher += on.ratio > off.ratio + 0.0005;
    }
    printf("plan loops: %d seeds, %d moving at every step by best fit, %d of them planned to no map, "
           "%d with a higher peak planned\n", seeds, moving, settled, higher);
    return 0;
}
