/*
 * placement_model.h - PyTorch's placement alone, as a reference, on cca's
 * own block structs and free bins (bins.h): sizes rounded up to 512 bytes (or
 * to a power-of-two division, roundup_power2_divisions); requests of up to
 * 1 MiB from 2 MiB segments, larger ones from 20 MiB segments (rounded up to
 * 2 MiB from 10 MiB); best fit by (size, address) with max_split_size's two
 * refusals; a small block split where 512 bytes or more remain, a large one
 * below max_split_size where more than 1 MiB does; free neighbours merged; a
 * small and a large pool per stream; frees that wait for another stream's
 * work (record_stream) back at the next allocation once it is done (a
 * segment's release, a cudaFree, synchronises the device); empty_cache; and
 * past a device's memory, PyTorch's sequence: the oversize blocks that make
 * room given back, then every cached block, a retry, out of memory; with a
 * per-process memory fraction (the cap) and garbage_collection_threshold,
 * PyTorch's collection by age before a new segment. With expandable, PyTorch's
 * expandable segments instead of segments: one reservation per stream and
 * kind (9/8 of the device), mapped in granules (2 MiB small, 20 MiB large)
 * from the lowest unmapped run that holds the request, best fit preferring
 * blocks that could grow less, every block split where 512 bytes remain, and
 * release unmapping the whole granules of free blocks (a reservation with
 * nothing mapped given back), and past the cap the same sequence (a growth
 * that fails keeps what it mapped before); no collection with it. No
 * private pools, statistics, locks or history. Segments get ids in the order they are made,
 * at addresses the caller offers (an allocator's, for ties) or of their own.
 *
 * Used by bench/bench_floor.c (what the placement alone costs) and by
 * tests/unit/test_placement_model.c and tests/fuzz/fuzz_placement.c (cca's
 * default placement against it, in lockstep). Include device.h first (and
 * ptrmap.h, whose bucket function the model's pointer map uses).
 */
#ifndef CCA_PLACEMENT_MODEL_H
#define CCA_PLACEMENT_MODEL_H

#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MODEL_MiB ((size_t)1 << 20)
#define MODEL_MAX_SEGMENTS 4096
#define MODEL_STREAMS 8

typedef struct model_pool {
    cca_bins_t bins;
    cca_block_t *unmapped; /* expandable: unmapped runs by address (bin_next, bin_prev) */
} model_pool_t;

typedef struct model_map {
    cca_block_t **buckets; /* chained through map_next, keyed by address */
    size_t cap;            /* a power of two */
} model_map_t;

typedef struct model {
    model_pool_t pools[MODEL_STREAMS][2]; /* per stream: small, large */
    cca_block_t *spare;       /* free block structs, through bin_next */
    uintptr_t next_base;      /* the model's own address space */
    size_t segments, reserved;
    uintptr_t seg_base[MODEL_MAX_SEGMENTS];
    model_map_t map;
    bool with_map;            /* a free finds its block by address */
    bool failed;              /* out of host memory, or of segment ids */
    size_t small_split_min;   /* a small block is split where this much remains (PyTorch:
                                 512; tests change it to see that a changed rule shows) */
    size_t max_split;         /* max_split_size (SIZE_MAX: unlimited, the default) */
    size_t max_non_split_rounding; /* an oversize request takes a block less than this larger */
    size_t divisions[16];     /* roundup_power2_divisions per interval: [1 MiB, 2 MiB) ...
                                 (below 1 MiB the first); 0 or 1: none */
    uintptr_t offered_base;   /* where the next segment goes (then 0), 0: the model's own
                                 address space (best fit's ties go by address: a caller
                                 comparing with an allocator gives it that one's addresses) */
    size_t cap;               /* device memory segments may take; 0: no limit */
    cca_block_t *pending;     /* freed while another stream uses them (bin_next) */
    cca_block_t *ready;       /* those whose uses are done, back at the next allocation */
    bool released[MODEL_MAX_SEGMENTS]; /* segments given back (the caller clears them) */
    bool any_released;
    uint64_t retries, ooms;   /* allocations retried after releasing every cached block;
                                 out of memory */
    uint64_t cap_hits;        /* new segments the cap refused */
    double gc_threshold;      /* garbage_collection_threshold, the cap being a memory fraction's
                                 allowed bytes; 0: no collection */
    int64_t gc_calls[2];      /* best-fit searches of the small and of the large pools, counted
                                 while collecting: a free block's age is the searches of its
                                 kind since it went into its bin */
    uint64_t gc_released;     /* segments the collection gave back */
    bool expandable;          /* expandable segments (segments: reservations) */
    size_t total_memory;      /* the device's, which a reservation spans 9/8 of */
    uint64_t maps, unmaps;    /* expandable: ranges mapped, unmapped */
    const uint64_t *address_list; /* expandable: where new reservations go, in turn (the
                                 addresses a simulated device hands out in order), as long
                                 as address_next < address_count */
    size_t address_count, address_next;
} model_t;

static inline void model_free(model_t *m, uintptr_t addr, cca_block_t *block);
static inline void model_synchronize(model_t *m);

/* Whether pool is a large one (pools[stream][1]). */
static inline int model_kind(const model_t *m, const model_pool_t *pool)
{
    return (int)((pool - &m->pools[0][0]) % 2);
}

/* A free block into pool's bin, its age counted from now (PyTorch's insert_into_blocks). */
static inline void model_bin(model_t *m, model_pool_t *pool, cca_block_t *b)
{
    b->gc_count_base = m->gc_calls[model_kind(m, pool)];
    bins_insert(&pool->bins, b);
}

/* A block's segment id: kept in requested_size, a field the model has no other use for. */
static inline size_t model_segment(const cca_block_t *b)
{
    return b->requested_size;
}

static inline bool model_init(model_t *m)
{
    memset(m, 0, sizeof(*m));
    m->next_base = (uintptr_t)1 << 40;
    m->small_split_min = 512;
    m->max_split = SIZE_MAX;
    m->max_non_split_rounding = 20 * MODEL_MiB;
    m->map.cap = 4096;
    m->map.buckets = calloc(m->map.cap, sizeof(*m->map.buckets));
    return m->map.buckets != NULL;
}

/* Every block struct given back (all blocks freed first: the segments' whole blocks stay in
 * the bins and are freed here with the spares). */
static inline void model_destroy(model_t *m)
{
    model_synchronize(m);
    for (int p = 0; p < 2 * MODEL_STREAMS; p++) {
        model_pool_t *pool = &m->pools[p / 2][p % 2];
        for (unsigned bin = 0; bin < CCA_BIN_COUNT; bin++)
            while (pool->bins.heads[bin]) {
                cca_block_t *b = pool->bins.heads[bin];
                bins_remove(&pool->bins, b);
                free(b);
            }
        while (pool->unmapped) {
            cca_block_t *b = pool->unmapped;
            pool->unmapped = b->bin_next;
            free(b);
        }
    }
    while (m->spare) {
        cca_block_t *b = m->spare;
        m->spare = b->bin_next;
        free(b);
    }
    free(m->map.buckets);
    m->map.buckets = NULL;
}

static inline cca_block_t *model_block_new(model_t *m)
{
    cca_block_t *b = m->spare;
    if (b) {
        m->spare = b->bin_next;
    } else {
        b = aligned_alloc(64, sizeof(*b));
        if (!b) {
            m->failed = true;
            return NULL;
        }
    }
    memset(b, 0, sizeof(*b));
    return b;
}

static inline void model_block_delete(model_t *m, cca_block_t *b)
{
    b->bin_next = m->spare;
    m->spare = b;
}

/* PyTorch's round_size: 512 bytes at least, then a multiple of 512, or past 512 * divisions
 * the next power-of-two division of the size's interval. */
static inline size_t model_round(const model_t *m, size_t size)
{
    if (size < 512)
        return 512;
    size_t index = 0;
    if (size >= MODEL_MiB) {
        index = (size_t)(63 - __builtin_clzll((unsigned long long)size)) - 20;
        if (index > 15)
            index = 15;
    }
    size_t divisions = m->divisions[index];
    if (divisions <= 1 || size <= 512 * divisions)
        return (size + 511) & ~(size_t)511;
    if (!(size & (size - 1)))
        return size;
    size_t floor2 = (size_t)1 << (63 - __builtin_clzll((unsigned long long)size));
    size_t step = floor2 >> (63 - __builtin_clzll((unsigned long long)divisions));
    if (!step)
        return floor2 << 1;
    size_t down = size & ~(step - 1);
    return down == size ? size : down + step;
}

/* A new segment of seg bytes as one block, or NULL: past the cap, or out of host memory or
 * segment ids (m->failed). */
static inline cca_block_t *model_new_segment(model_t *m, size_t seg)
{
    if (m->cap && m->reserved + seg > m->cap) {
        m->cap_hits++;
        return NULL;
    }
    cca_block_t *block;
    if (m->segments == MODEL_MAX_SEGMENTS || !(block = model_block_new(m))) {
        m->failed = true;
        return NULL;
    }
    block->addr = m->offered_base ? m->offered_base : m->next_base;
    block->size = seg;
    block->requested_size = m->segments; /* its segment id */
    m->seg_base[m->segments++] = block->addr;
    if (!m->offered_base)
        m->next_base += seg + 2 * MODEL_MiB;
    m->offered_base = 0;
    m->reserved += seg;
    return block;
}

static inline void model_complete(model_t *m);

/* A free block that is a whole segment given back. cudaFree synchronises the device: every
 * use done, the pending frees back at the next allocation. */
static inline void model_release_block(model_t *m, model_pool_t *pool, cca_block_t *b)
{
    model_complete(m);
    bins_remove(&pool->bins, b);
    m->released[model_segment(b)] = true;
    m->any_released = true;
    m->reserved -= b->size;
    model_block_delete(m, b);
}

/* The frees whose uses are done, back (PyTorch's process_events, at each allocation). */
static inline void model_process(model_t *m)
{
    while (m->ready) {
        cca_block_t *b = m->ready;
        m->ready = b->bin_next;
        b->bin_next = NULL;
        model_free(m, b->addr, b);
    }
}

/* Every use done (a synchronisation): the pending frees back as well. */
static inline void model_synchronize(model_t *m)
{
    model_complete(m);
    model_process(m);
}

/* The free of a block another stream still uses: back once model_complete says its uses are
 * done, at the next allocation. */
static inline void model_free_used(model_t *m, cca_block_t *block)
{
    block->bin_next = m->pending;
    m->pending = block;
}

/* The other stream's work so far done: the pending frees come back at the next allocation. */
static inline void model_complete(model_t *m)
{
    while (m->pending) {
        cca_block_t *b = m->pending;
        m->pending = b->bin_next;
        b->bin_next = m->ready;
        m->ready = b;
    }
}

/* ---- expandable segments ---------------------------------------------------------- */

static inline void model_merge(model_t *m, model_pool_t *pool, cca_block_t *block, cca_block_t *n);

/* Addresses for n reservations of a device of total_memory bytes, apart (a simulated device
 * hands reservations out from such a list in turn, and the model, given it as address_list,
 * takes them in the same turn: the same reservation is at the same address on both sides). */
static inline void model_reservation_addresses(uint64_t *out, size_t n, size_t total_memory)
{
    uint64_t stride = (total_memory + total_memory / 8 + (44ull << 20)) & ~((2ull << 20) - 1);
    for (size_t i = 0; i < n; i++)
        out[i] = 0x100000000000ull + i * stride;
}

/* The bytes a reservation of pool's kind maps at a time. */
static inline size_t model_granule(bool small)
{
    return small ? 2 * MODEL_MiB : 20 * MODEL_MiB;
}

/* An unmapped run into its pool's list, by address; out of it. */
static inline void model_unmapped_insert(model_pool_t *pool, cca_block_t *b)
{
    cca_block_t *prev = NULL, *at = pool->unmapped;
    while (at && at->addr < b->addr) {
        prev = at;
        at = at->bin_next;
    }
    b->bin_prev = prev;
    b->bin_next = at;
    if (at)
        at->bin_prev = b;
    if (prev)
        prev->bin_next = b;
    else
        pool->unmapped = b;
}

static inline void model_unmapped_remove(model_pool_t *pool, cca_block_t *b)
{
    if (b->bin_prev)
        b->bin_prev->bin_next = b->bin_next;
    else
        pool->unmapped = b->bin_next;
    if (b->bin_next)
        b->bin_next->bin_prev = b->bin_prev;
    b->bin_prev = b->bin_next = NULL;
}

/* Free and no use pending (an unmapped run, or a free block in its bin). */
static inline bool model_allocatable(const cca_block_t *b)
{
    return b && (b->in_bin || (!b->mapped && !b->allocated));
}

/* The size a free block could grow to: itself and the unmapped run after it. */
static inline size_t model_growable(const cca_block_t *b)
{
    return b->size + (b->next && !b->next->mapped && !b->next->allocated ? b->next->size : 0);
}

/* Best fit among a pool's expandable blocks: from the first that fits, on to the next ones
 * in (size, address) order as long as each could grow less than the one before. */
static inline cca_block_t *model_expandable_fit(model_pool_t *pool, cca_block_t *b)
{
    for (cca_block_t *n = bins_next(&pool->bins, b); n && model_growable(n) < model_growable(b);
         n = bins_next(&pool->bins, n))
        b = n;
    return b;
}

/* Link b between before and after (either may be NULL). */
static inline void model_link(cca_block_t *b, cca_block_t *before, cca_block_t *after)
{
    b->prev = before;
    b->next = after;
    if (before)
        before->next = b;
    if (after)
        after->prev = b;
}

/* The neighbour n (out of its bin or list) joined into block, its struct given back. */
static inline void model_absorb(model_t *m, cca_block_t *block, cca_block_t *n)
{
    if (n == block->prev) {
        block->addr = n->addr;
        model_link(block, n->prev, block->next);
    } else {
        model_link(block, block->prev, n->next);
    }
    block->size += n->size;
    model_block_delete(m, n);
}

/* PyTorch's find_expandable_block: the lowest unmapped run of the pool (or the free block
 * just below it) from which size bytes of free address space run; else a new reservation
 * (at offered_base if given). NULL: out of host memory or of segment ids (m->failed). */
static inline cca_block_t *model_find_expandable(model_t *m, model_pool_t *pool, bool small, size_t size)
{
    for (cca_block_t *u = pool->unmapped; u; u = u->bin_next) {
        cca_block_t *c = model_allocatable(u->prev) ? u->prev : u;
        size_t bytes = 0;
        for (const cca_block_t *b = c; b && bytes < size && model_allocatable(b); b = b->next)
            bytes += b->size;
        if (bytes >= size)
            return c;
    }
    size_t g = model_granule(small);
    size_t space = m->total_memory + m->total_memory / 8;
    size_t reservation = (space + g - 1) / g * g;
    cca_block_t *block;
    if (m->segments == MODEL_MAX_SEGMENTS || !(block = model_block_new(m))) {
        m->failed = true;
        return NULL;
    }
    uintptr_t at = m->offered_base;
    if (!at && m->address_next < m->address_count)
        at = (uintptr_t)m->address_list[m->address_next++];
    block->addr = at ? at : m->next_base;
    block->size = reservation;
    block->requested_size = m->segments; /* its reservation's id */
    m->seg_base[m->segments++] = block->addr;
    if (!at)
        m->next_base += reservation + 2 * MODEL_MiB;
    m->offered_base = 0;
    model_unmapped_insert(pool, block);
    return block;
}

/* PyTorch's map_block: the first size bytes of the unmapped run b mapped (whole granules),
 * the rest left unmapped, the mapped part merged with its free neighbours and binned; the
 * free block holding it. NULL: past the cap (nothing mapped), or out of host memory. */
static inline cca_block_t *model_map_block(model_t *m, model_pool_t *pool, bool small, cca_block_t *b,
                                           size_t size)
{
    size_t g = model_granule(small);
    size_t mapped = (size + g - 1) / g * g;
    if (mapped > b->size)
        mapped = b->size;
    if (m->cap && m->reserved + mapped > m->cap) {
        m->cap_hits++;
        return NULL;
    }
    if (mapped < b->size) {
        cca_block_t *rest = model_block_new(m);
        if (!rest)
            return NULL;
        rest->addr = b->addr + mapped;
        rest->size = b->size - mapped;
        rest->requested_size = b->requested_size;
        model_link(rest, b, b->next);
        model_unmapped_insert(pool, rest);
        b->size = mapped;
    }
    model_unmapped_remove(pool, b);
    b->mapped = true;
    model_merge(m, pool, b, b->prev);
    model_merge(m, pool, b, b->next);
    model_bin(m, pool, b);
    m->reserved += mapped;
    m->maps++;
    return b;
}

/* PyTorch's try_allocate_expandable_block: size bytes mapped from the run find_expandable_block
 * gives, as one free block, out of its bin; NULL: past the cap (what was mapped before the
 * map that failed stays mapped and cached), or out of host memory (m->failed). */
static inline cca_block_t *model_grow(model_t *m, model_pool_t *pool, bool small, size_t size)
{
    cca_block_t *c = model_find_expandable(m, pool, small, size);
    if (c && !c->mapped)
        c = model_map_block(m, pool, small, c, c->size < size ? c->size : size);
    while (c && c->size < size) {
        cca_block_t *next = c->next;
        size_t left = size - c->size;
        c = model_map_block(m, pool, small, next, left < next->size ? left : next->size);
    }
    if (!c)
        return NULL;
    bins_remove(&pool->bins, c);
    return c;
}

/* PyTorch's unmap_block: the whole granules of the free block b unmapped, the parts of
 * granules at either end left as free blocks, the unmapped run merged with unmapped
 * neighbours; a reservation left with nothing mapped given back. */
static inline void model_unmap_block(model_t *m, model_pool_t *pool, cca_block_t *b)
{
    bool small = model_kind(m, pool) == 0;
    size_t g = model_granule(small);
    uintptr_t base = m->seg_base[model_segment(b)];
    uintptr_t lo = base + (b->addr - base + g - 1) / g * g;
    uintptr_t hi = base + (b->addr + b->size - base) / g * g;
    if (lo >= hi)
        return;
    bins_remove(&pool->bins, b);
    if (lo > b->addr) {
        cca_block_t *before = model_block_new(m);
        if (!before)
            return;
        before->addr = b->addr;
        before->size = lo - b->addr;
        before->requested_size = b->requested_size;
        before->mapped = true;
        model_link(before, b->prev, b);
        model_bin(m, pool, before);
    }
    if (hi < b->addr + b->size) {
        cca_block_t *after = model_block_new(m);
        if (!after)
            return;
        after->addr = hi;
        after->size = b->addr + b->size - hi;
        after->requested_size = b->requested_size;
        after->mapped = true;
        model_link(after, b, b->next);
        model_bin(m, pool, after);
    }
    b->addr = lo;
    b->size = hi - lo;
    b->mapped = false;
    m->reserved -= hi - lo;
    m->unmaps++;
    for (int side = 0; side < 2; side++) {
        cca_block_t *n = side ? b->next : b->prev;
        if (!n || n->mapped || n->allocated)
            continue;
        model_unmapped_remove(pool, n);
        model_absorb(m, b, n);
    }
    if (!b->prev && !b->next) { /* the reservation, nothing mapped: given back */
        m->released[model_segment(b)] = true;
        m->any_released = true;
        model_block_delete(m, b);
        return;
    }
    model_unmapped_insert(pool, b);
}

/* PyTorch's release_cached_blocks: every use waited for, then every free block that is a
 * whole segment given back (every stream's). */
static inline void model_release_all(model_t *m)
{
    model_synchronize(m);
    if (m->expandable) { /* every free block's whole granules unmapped (gathered first: the
                          * unmaps change the bins) */
        for (int p = 0; p < 2 * MODEL_STREAMS; p++) {
            model_pool_t *pool = &m->pools[p / 2][p % 2];
            size_t n = 0, i = 0;
            for (cca_block_t *b = bins_best_fit(&pool->bins, 0); b; b = bins_next(&pool->bins, b))
                n++;
            cca_block_t **list = n ? malloc(n * sizeof(*list)) : NULL;
            if (n && !list) {
                m->failed = true;
                return;
            }
            for (cca_block_t *b = bins_best_fit(&pool->bins, 0); b; b = bins_next(&pool->bins, b))
                list[i++] = b;
            for (i = 0; i < n; i++)
                model_unmap_block(m, pool, list[i]);
            free(list);
        }
        return;
    }
    for (int p = 0; p < 2 * MODEL_STREAMS; p++) {
        model_pool_t *pool = &m->pools[p / 2][p % 2];
        for (unsigned bin = 0; bin < CCA_BIN_COUNT; bin++) {
            cca_block_t *b = pool->bins.heads[bin];
            while (b) {
                cca_block_t *next = b->bin_next;
                if (!b->prev && !b->next)
                    model_release_block(m, pool, b);
                b = next;
            }
        }
    }
}

/* The last block of the highest non-empty bin of pool at or below bin, or NULL. */
static inline cca_block_t *model_last_from(const model_pool_t *pool, int bin)
{
    for (; bin >= 0; bin--) {
        cca_block_t *b = pool->bins.heads[bin];
        if (!b)
            continue;
        while (b->bin_next)
            b = b->bin_next;
        return b;
    }
    return NULL;
}

/* The largest free block of pool (ties: the highest address), or NULL. */
static inline cca_block_t *model_largest(const model_pool_t *pool)
{
    return model_last_from(pool, CCA_BIN_COUNT - 1);
}

/* The free block of pool before b in (size, address) order, or NULL. */
static inline cca_block_t *model_before(const model_pool_t *pool, const cca_block_t *b)
{
    return b->bin_prev ? b->bin_prev : model_last_from(pool, (int)b->bin - 1);
}

/*
 * PyTorch's release_available_cached_blocks, with max_split_size set: the smallest free
 * oversize block of at least max(rsize, max_split_size) given back; without one, oversize
 * blocks from the largest down until as many bytes are given back (those given back stay
 * so, even where that is not enough). Whether it gave back enough.
 */
static inline bool model_release_available(model_t *m, model_pool_t *pool, size_t rsize)
{
    if (m->max_split == SIZE_MAX)
        return false;
    size_t key = rsize < m->max_split ? m->max_split : rsize;
    cca_block_t *b = bins_best_fit(&pool->bins, key);
    if (b) {
        model_release_block(m, pool, b);
        return true;
    }
    size_t total = 0;
    b = model_largest(pool);
    while (b && total < key && b->size >= m->max_split) {
        cca_block_t *before = model_before(pool, b);
        total += b->size;
        model_release_block(m, pool, b);
        b = before;
    }
    return total >= key;
}

/*
 * PyTorch's garbage_collect_cached_blocks, before a new segment while collecting: past
 * gc_threshold of the allowed bytes, the free large blocks that are whole segments (every
 * stream's) whose age is at least their average are given back, the average taken again
 * after each pass, until the bytes past the threshold are reclaimed or a pass gives back
 * nothing.
 */
static inline void model_garbage_collect(model_t *m)
{
    size_t threshold = (size_t)(m->gc_threshold * (double)m->cap);
    if (m->reserved <= threshold)
        return;
    size_t target = m->reserved - threshold, reclaimed = 0, total_age = 0;
    int64_t count = 0, now = m->gc_calls[1];
    for (int s = 0; s < MODEL_STREAMS; s++)
        for (unsigned bin = 0; bin < CCA_BIN_COUNT; bin++)
            for (cca_block_t *b = m->pools[s][1].bins.heads[bin]; b; b = b->bin_next)
                if (!b->prev && !b->next) {
                    total_age += (size_t)(now - b->gc_count_base);
                    count++;
                }
    bool freed = true;
    while (reclaimed < target && freed && count > 0) {
        double age_threshold = (double)total_age / (double)count;
        freed = false;
        for (int s = 0; s < MODEL_STREAMS; s++)
            for (unsigned bin = 0; bin < CCA_BIN_COUNT; bin++) {
                cca_block_t *b = m->pools[s][1].bins.heads[bin];
                while (b) {
                    cca_block_t *next = b->bin_next;
                    int64_t age = now - b->gc_count_base;
                    if (!b->prev && !b->next && (double)age >= age_threshold) {
                        freed = true;
                        reclaimed += b->size;
                        total_age -= (size_t)age;
                        count--;
                        m->gc_released++;
                        model_release_block(m, &m->pools[s][1], b);
                    }
                    b = next;
                }
            }
    }
}

/* An allocation of size bytes on stream (0 .. MODEL_STREAMS - 1): its block, or NULL: out of
 * memory (m->ooms counted, nothing else changed but the blocks the attempt gave back), or out
 * of host memory or of segment ids (m->failed). PyTorch's malloc: the finished frees back,
 * best fit, then (after the collection, if on) a new segment or a growth; past the cap, the
 * oversize blocks that make room given back, then every cached block, then a retry. */
static inline cca_block_t *model_malloc(model_t *m, size_t size, unsigned stream)
{
    model_process(m);
    size_t rsize = model_round(m, size);
    bool small = rsize <= MODEL_MiB;
    model_pool_t *pool = &m->pools[stream % MODEL_STREAMS][small ? 0 : 1];
    if (m->gc_threshold > 0.0)
        m->gc_calls[small ? 0 : 1]++;
    cca_block_t *block = bins_best_fit(&pool->bins, rsize);
    if (block && m->expandable)
        block = model_expandable_fit(pool, block);
    /* max_split_size: a request below it takes no oversize block, one at or above it none
     * max_non_split_rounding or more larger than itself */
    if (block && ((rsize < m->max_split && block->size >= m->max_split) ||
                  (rsize >= m->max_split && block->size >= rsize + m->max_non_split_rounding)))
        block = NULL;
    if (block) {
        bins_remove(&pool->bins, block);
    } else if (m->expandable) {
        /* past the cap: no oversize block is given back (they are all expandable), every free
         * block's whole granules unmapped, a retry */
        block = model_grow(m, pool, small, rsize);
        if (!block && !m->failed) {
            model_release_all(m);
            m->retries++;
            block = model_grow(m, pool, small, rsize);
        }
        if (!block) {
            m->ooms += !m->failed;
            m->offered_base = 0;
            return NULL;
        }
    } else {
        size_t seg = small ? 2 * MODEL_MiB
                           : rsize < 10 * MODEL_MiB ? 20 * MODEL_MiB
                                                    : (rsize + 2 * MODEL_MiB - 1) & ~(2 * MODEL_MiB - 1);
        if (m->gc_threshold > 0.0)
            model_garbage_collect(m);
        block = model_new_segment(m, seg);
        if (!block && !m->failed && model_release_available(m, pool, rsize))
            block = model_new_segment(m, seg);
        if (!block && !m->failed) {
            model_release_all(m);
            m->retries++;
            block = model_new_segment(m, seg);
        }
        if (!block) {
            m->ooms += !m->failed;
            m->offered_base = 0;
            return NULL;
        }
    }
    size_t rest = block->size - rsize;
    if (small ? rest >= m->small_split_min
              : m->expandable ? rest >= 512 : rsize < m->max_split && rest > MODEL_MiB) {
        cca_block_t *front = model_block_new(m);
        if (!front) {
            model_bin(m, pool, block);
            return NULL;
        }
        front->addr = block->addr;
        front->size = rsize;
        front->requested_size = block->requested_size;
        front->mapped = block->mapped;
        model_link(front, block->prev, block);
        block->addr += rsize;
        block->size = rest;
        model_bin(m, pool, block);
        block = front;
    }
    block->allocated = true;
    block->pool = (cca_pool_t *)(void *)pool; /* which pool: never read as a cca_pool_t */
    if (m->with_map) {
        cca_block_t **bucket = &m->map.buckets[ptrmap_bucket(block->addr, m->map.cap)];
        block->map_next = *bucket;
        *bucket = block;
    }
    return block;
}

/* A neighbour merged into block where it is free. */
static inline void model_merge(model_t *m, model_pool_t *pool, cca_block_t *block, cca_block_t *n)
{
    if (!n || !n->in_bin)
        return;
    bins_remove(&pool->bins, n);
    model_absorb(m, block, n);
}

/* The free of block at addr (with_map: found by its address; else block itself). */
static inline void model_free(model_t *m, uintptr_t addr, cca_block_t *block)
{
    if (m->with_map) {
        cca_block_t **link = &m->map.buckets[ptrmap_bucket(addr, m->map.cap)];
        while (*link && (*link)->addr != addr)
            link = &(*link)->map_next;
        block = *link;
        *link = block->map_next;
    }
    model_pool_t *pool = (model_pool_t *)(void *)block->pool;
    block->allocated = false;
    model_merge(m, pool, block, block->prev);
    model_merge(m, pool, block, block->next);
    model_bin(m, pool, block);
}

/* PyTorch's empty_cache: every use waited for, every free whole segment given back. */
static inline void model_empty_cache(model_t *m)
{
    model_release_all(m);
}

#endif /* CCA_PLACEMENT_MODEL_H */
