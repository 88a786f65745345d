/*
 * test_bench_rng.c - the benchmarks' random sequence (bench/anchor_rng.h) is
 * the anchor's: std::mt19937_64 gives the value the C++ standard requires of
 * its 10000th draw, the twist in three loops equals the recurrence as the
 * definition writes it (indices modulo the state's size), and the workload's
 * draws stay in their ranges.
 */
#include <stdbool.h>
#include <stdint.h>

#include "../../bench/anchor_rng.h"
#include "harness.h"

/* The recurrence as defined: x[i] from x[i], x[(i+1) % n] and x[(i+m) % n]. */
static void twist_by_definition(uint64_t x[MT64_N])
{
    for (int i = 0; i < MT64_N; i++)
        x[i] = mt64_mix(x[i], x[(i + 1) % MT64_N], x[(i + MT64_M) % MT64_N]);
}

TEST(standard_value_of_the_10000th_draw)
{
    mt64_t mt;
    mt64_seed(&mt, 5489); /* std::mt19937_64's default seed */
    uint64_t x = 0;
    for (int i = 0; i < 10000; i++)
        x = mt64_next(&mt);
    expect_eq_u64(x, 9981545732273789042ull); /* [rand.predef] */
}

TEST(twist_equals_the_definition)
{
    mt64_t a;
    mt64_seed(&a, 42);
    uint64_t b[MT64_N];
    for (int i = 0; i < MT64_N; i++)
        b[i] = a.state[i];
    bool same = true;
    for (int round = 0; round < 4; round++) {
        mt64_twist(&a);
        twist_by_definition(b);
        for (int i = 0; i < MT64_N; i++)
            same = same && a.state[i] == b[i];
    }
    expect_true(same);
}

TEST(draws_stay_in_their_ranges)
{
    mt64_t mt;
    mt64_seed(&mt, 7);
    const mt64_log_sizes_t sizes = mt64_log_sizes((size_t)8 << 20);
    size_t lo = SIZE_MAX, hi = 0;
    int seen[64] = {0};
    bool picks_in_range = true;
    for (int i = 0; i < 100000; i++) {
        size_t s = mt64_log_size(&mt, &sizes);
        lo = s < lo ? s : lo;
        hi = s > hi ? s : hi;
        int k = mt64_pick(&mt, 64);
        picks_in_range = picks_in_range && k >= 0 && k < 64;
        if (k >= 0 && k < 64)
            seen[k]++;
    }
    expect_true(picks_in_range);
    expect_true(lo >= 512);
    expect_true(hi <= ((size_t)8 << 20));
    expect_true(lo < 1024);             /* both ends of the log-uniform range are reached */
    expect_true(hi > ((size_t)4 << 20));
    int fewest = seen[0];
    for (int k = 1; k < 64; k++)
        fewest = seen[k] < fewest ? seen[k] : fewest;
    expect_true(fewest > 1200);         /* each slot about 1/64 of 100000 */
}

int main(void)
{
    RUN(standard_value_of_the_10000th_draw);
    RUN(twist_equals_the_definition);
    RUN(draws_stay_in_their_ranges);
    return harness_done();
}
