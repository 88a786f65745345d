/*
 * bins.h - the free bins' hot operations, inline (the rest is bins.c).
 *
 * A free block lives in the bin of its size class (32 classes per power of
 * two, exact classes below 16 KiB); each bin is a list sorted by (size,
 * address). Classes are ordered like sizes, so the best fit for a request is
 * the first block >= size in the request's own class, or else the head of the
 * next non-empty class found through the bitmaps: the same block an ordered
 * set keyed by (size, address) returns from lower_bound.
 *
 * Included by device_types.h after cca_bins_t.
 */
#ifndef CCA_BINS_H
#define CCA_BINS_H

/*
 * The size class of size: v = size / 512 itself below 2^(SUB_BITS + 1) (exact classes;
 * those from 2^SUB_BITS on are also the first octave's sub-classes), else, for v of
 * 2^e .. 2^(e+1) - 1, ((e - SUB_BITS) << SUB_BITS) plus v's top SUB_BITS + 1 bits. One
 * formula for both, with no branch: on a mix of sizes around 16 KiB the branch between
 * the exact classes and the others missed a third of the time.
 */
static inline unsigned bin_of(size_t size)
{
    size_t v = size >> 9; /* units of 512 bytes */
    unsigned e = 63u - (unsigned)__builtin_clzll((unsigned long long)(v | 1));
    unsigned s = e > CCA_BIN_SUB_BITS ? e - CCA_BIN_SUB_BITS : 0;
    return (s << CCA_BIN_SUB_BITS) + (unsigned)(v >> s);
}

static inline bool block_less(const cca_block_t *a, const cca_block_t *b)
{
    return a->size != b->size ? a->size < b->size : a->addr < b->addr;
}

static inline void bins_insert(cca_bins_t *bins, cca_block_t *block)
{
    unsigned bin = bin_of(block->size);
    cca_block_t **link = &bins->heads[bin];
    cca_block_t *prev = NULL;
    while (*link && block_less(*link, block)) {
        prev = *link;
        link = &(*link)->bin_next;
    }
    block->bin_next = *link;
    block->bin_prev = prev;
    if (*link)
        (*link)->bin_prev = block;
    *link = block;
    block->bin = (uint16_t)bin;
    block->in_bin = true;
    bins->words[bin >> 6] |= 1ull << (bin & 63);
    bins->summary |= 1ull << (bin >> 6);
    bins->count++;
    bins->version++;
}

static inline void bins_remove(cca_bins_t *bins, cca_block_t *block)
{
    unsigned bin = block->bin;
    if (block->bin_prev)
        block->bin_prev->bin_next = block->bin_next;
    else
        bins->heads[bin] = block->bin_next;
    if (block->bin_next)
        block->bin_next->bin_prev = block->bin_prev;
    block->bin_next = block->bin_prev = NULL;
    block->in_bin = false;
    if (!bins->heads[bin]) {
        bins->words[bin >> 6] &= ~(1ull << (bin & 63));
        if (!bins->words[bin >> 6])
            bins->summary &= ~(1ull << (bin >> 6));
    }
    bins->count--;
    bins->version++;
}

/* First non-empty bin with index >= from, or -1. */
static inline int bins_first_from(const cca_bins_t *bins, unsigned from)
{
    if (from >= CCA_BIN_COUNT)
        return -1;
    unsigned w = from >> 6;
    uint64_t word = bins->words[w] & (~0ull << (from & 63));
    if (word)
        return (int)((w << 6) + (unsigned)__builtin_ctzll(word));
    if (w + 1 >= CCA_BIN_WORDS)
        return -1;
    uint64_t rest = bins->summary & (~0ull << (w + 1));
    if (!rest)
        return -1;
    w = (unsigned)__builtin_ctzll(rest);
    return (int)((w << 6) + (unsigned)__builtin_ctzll(bins->words[w]));
}

/* Smallest free block with size >= size (ties: lowest address), or NULL. */
static inline cca_block_t *bins_best_fit(const cca_bins_t *bins, size_t size)
{
    unsigned bin = bin_of(size);
    for (cca_block_t *b = bins->heads[bin]; b; b = b->bin_next)
        if (b->size >= size)
            return b;
    int next = bins_first_from(bins, bin + 1);
    return next < 0 ? NULL : bins->heads[next];
}

#endif
