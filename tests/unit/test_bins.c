/*
 * test_bins.c - the free bins' inline operations (src/device/bins.h) on their
 * own: the size classes (exact below 16 KiB, then 32 a power of two, in the
 * order of sizes, with no branch), and best fit against a plain search over
 * every free block - the smallest block of at least the size, the lowest
 * address among equals - through random inserts, removes and requests.
 */
#include <stdint.h>
#include <stdlib.h>

#include "device.h"
#include "harness.h"

/* The classes as documented in bins.h, with the branch between the exact classes and the
 * others written out. */
static unsigned class_spec(size_t size)
{
    size_t v = size >> 9;
    if (v < (1u << CCA_BIN_SUB_BITS))
        return (unsigned)v;
    unsigned e = 63u - (unsigned)__builtin_clzll((unsigned long long)v);
    unsigned sub = (unsigned)(v >> (e - CCA_BIN_SUB_BITS)) & ((1u << CCA_BIN_SUB_BITS) - 1);
    return ((e - CCA_BIN_SUB_BITS + 1) << CCA_BIN_SUB_BITS) + sub;
}

TEST(classes_follow_sizes)
{
    unsigned last = 0;
    uint64_t wrong = 0, backwards = 0;
    for (size_t v = 0; v < ((size_t)1 << 21); v++) { /* every block size up to 1 GiB */
        unsigned b = bin_of(v << 9);
        wrong += b != class_spec(v << 9);
        backwards += b < last;
        last = b;
    }
    expect_eq_u64(wrong, 0);
    expect_eq_u64(backwards, 0);
    /* both ends of every power of two up to the largest size, inside the table */
    for (unsigned e = 0; e < 54; e++) {
        size_t lo = ((size_t)1 << e) << 9, hi = ((((size_t)2 << e) - 1) << 9);
        expect_eq_u64(bin_of(lo), class_spec(lo));
        expect_eq_u64(bin_of(hi), class_spec(hi));
        expect_true(bin_of(hi) < CCA_BIN_COUNT);
    }
    expect_eq_u64(bin_of(512), 1);
    expect_eq_u64(bin_of(16384), 32);     /* the first octave's first sub-class */
    expect_eq_u64(bin_of(32767 & ~511u), 63);
}

/* The best fit by looking at every block. */
static cca_block_t *best_fit_spec(cca_block_t *blocks, const bool *in, size_t n, size_t size)
{
    cca_block_t *best = NULL;
    for (size_t i = 0; i < n; i++) {
        cca_block_t *b = &blocks[i];
        if (!in[i] || b->size < size)
            continue;
        if (!best || b->size < best->size || (b->size == best->size && b->addr < best->addr))
            best = b;
    }
    return best;
}

TEST(best_fit_is_the_smallest_then_the_lowest)
{
    enum { N = 600 };
    static cca_block_t blocks[N];
    static bool in[N];
    cca_bins_t *bins = calloc(1, sizeof(*bins));
    expect_true(bins != NULL);
    if (!bins)
        return;
    uint64_t x = 88172645463325252ull;
    uint64_t mismatches = 0;
    for (int step = 0; step < 40000; step++) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        size_t i = (size_t)(x % N);
        /* sizes of 512 B to 64 MiB, few of them, so that equal sizes are common */
        size_t size = ((size_t)1 << (9 + (x >> 20) % 18)) * (1 + (x >> 40) % 3);
        if (in[i]) {
            bins_remove(bins, &blocks[i]);
            in[i] = false;
            expect_false(blocks[i].in_bin);
        } else {
            blocks[i] = (cca_block_t){.addr = (uintptr_t)((x >> 8) & 0xffffff) << 9, .size = size};
            bins_insert(bins, &blocks[i]);
            in[i] = true;
        }
        size_t want = ((size_t)1 << (9 + (x >> 50) % 18)) + ((x >> 33) % 2) * 512;
        mismatches += bins_best_fit(bins, want) != best_fit_spec(blocks, in, N, want);
    }
    size_t count = 0;
    for (size_t i = 0; i < N; i++)
        count += in[i];
    expect_eq_u64(mismatches, 0);
    expect_eq_u64(bins->count, count);
    free(bins);
}

int main(void)
{
    RUN(classes_follow_sizes);
    RUN(best_fit_is_the_smallest_then_the_lowest);
    return harness_done();
}
