/*
 * anchor_rng.h - the random sequence of the anchor benchmark
 * (anchor/bench_anchor.cpp) reproduced in C: std::mt19937_64, libstdc++'s
 * std::uniform_int_distribution<int> (Lemire's multiply-shift with a 128-bit
 * product, GCC 11 and later) and std::uniform_real_distribution<double>
 * (generate_canonical<double, 53> over one 64-bit draw). With the same seed
 * the benchmark makes the same sequence of frees and sizes as the anchor.
 */
#ifndef CCA_ANCHOR_RNG_H
#define CCA_ANCHOR_RNG_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>

#define MT64_N 312
#define MT64_M 156

typedef struct mt64 {
    uint64_t state[MT64_N];
    int index;
} mt64_t;

static inline void mt64_seed(mt64_t *mt, uint64_t seed)
{
    mt->state[0] = seed;
    for (int i = 1; i < MT64_N; i++)
        mt->state[i] = 6364136223846793005ULL * (mt->state[i - 1] ^ (mt->state[i - 1] >> 62)) +
                       (uint64_t)i;
    mt->index = MT64_N;
}

/* The twist of all MT64_N words, in libstdc++'s three loops (no index wraps). */
static inline uint64_t mt64_mix(uint64_t a, uint64_t b, uint64_t c)
{
    const uint64_t upper = 0xFFFFFFFF80000000ULL, lower = 0x7FFFFFFFULL;
    const uint64_t y = (a & upper) | (b & lower);
    return c ^ (y >> 1) ^ ((0 - (y & 1)) & 0xB5026F5AA96619E9ULL); /* no branch to mispredict */
}

static inline void mt64_twist(mt64_t *mt)
{
    uint64_t *x = mt->state;
    int i = 0;
    for (; i < MT64_N - MT64_M; i++)
        x[i] = mt64_mix(x[i], x[i + 1], x[i + MT64_M]);
    for (; i < MT64_N - 1; i++)
        x[i] = mt64_mix(x[i], x[i + 1], x[i + MT64_M - MT64_N]);
    x[MT64_N - 1] = mt64_mix(x[MT64_N - 1], x[0], x[MT64_M - 1]);
    mt->index = 0;
}

static inline uint64_t mt64_next(mt64_t *mt)
{
    if (mt->index >= MT64_N)
        mt64_twist(mt);
    uint64_t x = mt->state[mt->index++];
    x ^= (x >> 29) & 0x5555555555555555ULL;
    x ^= (x << 17) & 0x71D67FFFEDA60000ULL;
    x ^= (x << 37) & 0xFFF7EEE000000000ULL;
    x ^= x >> 43;
    return x;
}

/* std::uniform_int_distribution<int>(0, range - 1)(mt) as libstdc++ computes it. */
static inline int mt64_pick(mt64_t *mt, uint64_t range)
{
    unsigned __int128 product = (unsigned __int128)mt64_next(mt) * range;
    uint64_t low = (uint64_t)product;
    if (low < range) {
        uint64_t threshold = -range % range;
        while (low < threshold) {
            product = (unsigned __int128)mt64_next(mt) * range;
            low = (uint64_t)product;
        }
    }
    return (int)(product >> 64);
}

/* std::uniform_real_distribution<double>(a, b)(mt) as libstdc++ computes it. */
static inline double mt64_real(mt64_t *mt, double a, double b)
{
    double canonical = (double)mt64_next(mt) / 18446744073709551616.0;
    if (canonical >= 1.0)
        canonical = nextafter(1.0, 0.0);
    return canonical * (b - a) + a;
}

/*
 * The anchor's log-uniform size distribution over [512, max_size]: its bounds
 * computed once, as the anchor's std::uniform_real_distribution holds them.
 */
typedef struct mt64_log_sizes {
    double lo, hi;
} mt64_log_sizes_t;

static inline mt64_log_sizes_t mt64_log_sizes(size_t max_size)
{
    mt64_log_sizes_t d = {log(512.0), log((double)max_size)};
    return d;
}

/* A size of the anchor's random workload: log-uniform in [512, max_size]. */
static inline size_t mt64_log_size(mt64_t *mt, const mt64_log_sizes_t *d)
{
    return (size_t)exp(mt64_real(mt, d->lo, d->hi));
}

#endif /* CCA_ANCHOR_RNG_H */
