/*
 * bins.c - segregated free bins with occupancy bitmaps: walks in (size,
 * address) order. The hot operations (insert, remove, best fit) are inline,
 * in bins.h, with the bins' layout described there.
 */
#include "device.h"

/* Last non-empty bin with index <= from, or -1. */
static int last_bin_upto(const cca_bins_t *bins, int from)
{
    if (from < 0)
        return -1;
    unsigned w = (unsigned)from >> 6;
    unsigned bit = (unsigned)from & 63;
    uint64_t mask = bit == 63 ? ~0ull : ((1ull << (bit + 1)) - 1);
    uint64_t word = bins->words[w] & mask;
    if (word)
        return (int)((w << 6) + 63u - (unsigned)__builtin_clzll(word));
    uint64_t rest = w ? bins->summary & ((1ull << w) - 1) : 0;
    if (!rest)
        return -1;
    w = 63u - (unsigned)__builtin_clzll(rest);
    return (int)((w << 6) + 63u - (unsigned)__builtin_clzll(bins->words[w]));
}

cca_block_t *bins_largest(const cca_bins_t *bins)
{
    int last = last_bin_upto(bins, CCA_BIN_COUNT - 1);
    if (last < 0)
        return NULL;
    cca_block_t *b = bins->heads[last];
    while (b->bin_next)
        b = b->bin_next;
    return b;
}

cca_block_t *bins_next(const cca_bins_t *bins, const cca_block_t *b)
{
    if (b->bin_next)
        return b->bin_next;
    int next = bins_first_from(bins, (unsigned)b->bin + 1);
    return next < 0 ? NULL : bins->heads[next];
}

cca_block_t *bins_prev(const cca_bins_t *bins, const cca_block_t *b)
{
    if (b->bin_prev)
        return b->bin_prev;
    int prev = last_bin_upto(bins, (int)b->bin - 1);
    if (prev < 0)
        return NULL;
    cca_block_t *p = bins->heads[prev];
    while (p->bin_next)
        p = p->bin_next;
    return p;
}

void bins_for_each(const cca_bins_t *bins, void (*fn)(cca_block_t *, void *), void *arg)
{
    int bin = bins_first_from(bins, 0);
    while (bin >= 0) {
        for (cca_block_t *b = bins->heads[bin]; b; b = b->bin_next)
            fn(b, arg);
        bin = bins_first_from(bins, (unsigned)bin + 1);
    }
}
