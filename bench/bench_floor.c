/*
 * bench_floor.c - what the random workload costs below cca: the anchor's
 * random_1thread steps (anchor_rng.h: 512 slots, log-uniform sizes in
 * [512 B, 8 MiB], seed 42) through PyTorch's placement alone, on cca's own
 * block structs and free bins (bins.h), with nothing else: no statistics, no
 * locks, no device question, no history, no events, no settings. Four
 * figures, each the best of ROUNDS runs of STEPS steps, in one process:
 *   draws       the draws and slot bookkeeping, no allocator;
 *   placement   + best fit, split, merge (a slot keeps its block);
 *   + map       + a pointer map from address to block, as a free by address needs;
 *   cca         cca_malloc / cca_free on the simulated device (the whole library).
 * The placement is PyTorch's: sizes rounded up to 512 bytes, requests of up
 * to 1 MiB from 2 MiB segments, larger ones from 20 MiB segments (rounded up
 * to 2 MiB from 10 MiB), best fit by (size, address), a small block split
 * where 512 bytes or more remain, a large one where more than 1 MiB does,
 * free neighbours merged. The bench checks that it made the segments cca
 * made (count and bytes): the same placement, so the figures differ only by
 * what cca does around it.
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

#define SLOTS 512
#define MiB ((size_t)1 << 20)

typedef struct floor_pool {
    cca_bins_t bins;
} floor_pool_t;

typedef struct floor_map {
    cca_block_t **buckets; /* chained through map_next, keyed by address */
    size_t cap;            /* a power of two */
} floor_map_t;

typedef struct floor_alloc {
    floor_pool_t small, large;
    cca_block_t *spare;     /* free block structs, through bin_next */
    uintptr_t next_base;    /* the simulated address space */
    size_t segments, reserved;
    floor_map_t map;
    bool with_map;
} floor_alloc_t;

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

static cca_block_t *block_new(floor_alloc_t *a)
{
    cca_block_t *b = a->spare;
    if (b) {
        a->spare = b->bin_next;
    } else {
        b = aligned_alloc(64, sizeof(*b));
        if (!b)
            die("out of host memory");
    }
    memset(b, 0, sizeof(*b));
    return b;
}

static void block_delete(floor_alloc_t *a, cca_block_t *b)
{
    b->bin_next = a->spare;
    a->spare = b;
}

static size_t map_bucket(uintptr_t addr, size_t cap)
{
    uint64_t x = (uint64_t)addr >> 9;
    x ^= x >> 29;
    x *= 0x9e3779b97f4a7c15ull;
    x ^= x >> 32;
    return (size_t)(x >> 6) & (cap - 1);
}

static void map_insert(floor_map_t *m, cca_block_t *b)
{
    cca_block_t **bucket = &m->buckets[map_bucket(b->addr, m->cap)];
    b->map_next = *bucket;
    *bucket = b;
}

static cca_block_t *map_take(floor_map_t *m, uintptr_t addr)
{
    cca_block_t **link = &m->buckets[map_bucket(addr, m->cap)];
    while (*link && (*link)->addr != addr)
        link = &(*link)->map_next;
    cca_block_t *b = *link;
    if (b)
        *link = b->map_next;
    return b;
}

static void *floor_malloc(floor_alloc_t *a, size_t size, cca_block_t **out)
{
    size_t rsize = size < 512 ? 512 : (size + 511) & ~(size_t)511;
    bool small = rsize <= MiB;
    floor_pool_t *pool = small ? &a->small : &a->large;
    cca_block_t *block = bins_best_fit(&pool->bins, rsize);
    if (block) {
        bins_remove(&pool->bins, block);
    } else {
        size_t seg = small ? 2 * MiB : rsize < 10 * MiB ? 20 * MiB : (rsize + 2 * MiB - 1) & ~(2 * MiB - 1);
        block = block_new(a);
        block->addr = a->next_base;
        block->size = seg;
        a->next_base += seg + 2 * MiB;
        a->segments++;
        a->reserved += seg;
    }
    size_t rest = block->size - rsize;
    if (small ? rest >= 512 : rest > MiB) {
        cca_block_t *front = block_new(a);
        front->addr = block->addr;
        front->size = rsize;
        front->prev = block->prev;
        if (front->prev)
            front->prev->next = front;
        front->next = block;
        block->prev = front;
        block->addr += rsize;
        block->size = rest;
        bins_insert(&pool->bins, block);
        block = front;
    }
    block->allocated = true;
    block->pool = (cca_pool_t *)pool; /* (only which pool: never read as a cca_pool_t) */
    if (a->with_map)
        map_insert(&a->map, block);
    *out = block;
    return (void *)block->addr;
}

/* A neighbour merged into block where it is free. */
static void merge(floor_alloc_t *a, floor_pool_t *pool, cca_block_t *block, cca_block_t *n)
{
    if (!n || !n->in_bin)
        return;
    bins_remove(&pool->bins, n);
    if (n == block->prev) {
        block->addr = n->addr;
        block->prev = n->prev;
        if (block->prev)
            block->prev->next = block;
    } else {
        block->next = n->next;
        if (block->next)
            block->next->prev = block;
    }
    block->size += n->size;
    block_delete(a, n);
}

static void floor_free(floor_alloc_t *a, void *ptr, cca_block_t *block)
{
    if (a->with_map)
        block = map_take(&a->map, (uintptr_t)ptr);
    floor_pool_t *pool = (floor_pool_t *)(void *)block->pool;
    block->allocated = false;
    merge(a, pool, block, block->prev);
    merge(a, pool, block, block->next);
    bins_insert(&pool->bins, block);
}

enum { RUN_DRAWS, RUN_PLACEMENT, RUN_MAP, RUN_CCA, RUN_KINDS };

/* One run of steps steps; ns a step. */
static double run(int kind, long steps, floor_alloc_t *a)
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
                floor_free(a, live[k], blocks[k]);
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
                live[k] = floor_malloc(a, size, &blocks[k]);
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
            floor_free(a, live[k], blocks[k]);
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
    floor_alloc_t *a = calloc(1, sizeof(*a));
    if (!a)
        die("out of host memory");
    a->next_base = (uintptr_t)1 << 40;
    a->map.cap = 4096;
    a->map.buckets = calloc(a->map.cap, sizeof(*a->map.buckets));
    if (!a->map.buckets)
        die("out of host memory");
    static const char *names[RUN_KINDS] = {"draws", "placement", "placement_map", "cca"};
    double best[RUN_KINDS];
    for (int kind = 0; kind < RUN_KINDS; kind++)
        best[kind] = 1e300;
    /* the kinds in turn, round after round: a slow moment of the machine meets each */
    for (int r = 0; r < rounds; r++) {
        for (int kind = 0; kind < RUN_KINDS; kind++) {
            a->with_map = kind == RUN_MAP;
            double ns = run(kind, steps, a);
            if (ns < best[kind])
                best[kind] = ns;
        }
    }
    /* the segments both made over all runs (both keep them cached from run to run) */
    size_t floor_segments = a->segments, floor_reserved = a->reserved;
    cca_device_stats_t ds;
    if (cca_get_device_stats(0, &ds) != CCA_OK)
        die(cca_last_error()->message);
    bool same = floor_segments == (size_t)ds.num_device_alloc &&
                floor_reserved == (size_t)ds.reserved_bytes[CCA_STAT_ALL].current;
    for (int kind = 0; kind < RUN_KINDS; kind++)
        printf("RESULT %s random_1thread ns_per_op=%.1f\n", names[kind], best[kind]);
    printf("# the random workload, %ld steps, best of %d runs each (ns a step):\n", steps, rounds);
    printf("#   draws alone %.1f; PyTorch's placement %.1f (%.1f of it the allocator's); with a pointer map "
           "%.1f (%.1f); cca %.1f (%.1f)\n",
           best[RUN_DRAWS], best[RUN_PLACEMENT], best[RUN_PLACEMENT] - best[RUN_DRAWS], best[RUN_MAP],
           best[RUN_MAP] - best[RUN_DRAWS], best[RUN_CCA], best[RUN_CCA] - best[RUN_DRAWS]);
    printf("# segments: placement %zu (%.1f MiB), cca %lld (%.1f MiB): %s\n", floor_segments,
           (double)floor_reserved / (double)MiB, (long long)ds.num_device_alloc,
           (double)ds.reserved_bytes[CCA_STAT_ALL].current / (double)MiB,
           same ? "the same placement" : "DIFFERENT");
    cca_shutdown();
    return same ? 0 : 1;
}
