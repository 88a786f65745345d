/*
 * ptrmap.h - the pointer map's layout (see ptrmap.c), so that the hot paths
 * of allocation and free reach it in solo mode without a call: the insert of
 * a block into a shard with room, the lookup of a live block's link and its
 * unlinking. Everything else is ptrmap.c's.
 */
#ifndef CCA_PTRMAP_H
#define CCA_PTRMAP_H

#include <pthread.h>

#include "device.h"

#define PTRMAP_SHARDS 4096 /* many: threads on different streams rarely meet on one */
#define PTRMAP_SHARD_BITS 12
#define PTRMAP_SOLO PTRMAP_SHARDS /* the table of solo mode, past the shards (ptrmap.c) */

typedef struct ptrmap_shard {
    cca_spinlock_t lock;
    cca_block_t **buckets; /* chained through map_next */
    size_t cap;            /* power of two */
    size_t count;
    char pad[64];
} ptrmap_shard_t;

struct cca_ptrmap {
    struct cca_ptrmap_head head;    /* solo: the only stream pool's lock; NULL: the shards' */
    pthread_mutex_t pools_lock;     /* orders ptrmap_pool_made */
    bool pool_made;                 /* a stream pool was made */
    void (*solo_end)(cca_spinlock_t *solo); /* run as solo mode ends, its lock held */
    ptrmap_shard_t shards[PTRMAP_SHARDS + 1]; /* the shards, then the solo table */
};

/* ptrmap_solo_lock (device.h) reads the head through a pointer to the map */
_Static_assert(offsetof(struct cca_ptrmap, head) == 0, "the map's head comes first");

/* The shard of addr: by its 2 MiB region, so that one segment's blocks share a shard. */
static inline size_t ptrmap_shard_of(uintptr_t addr)
{
    uint64_t x = (uint64_t)addr >> 21;
    x *= 0x9e3779b97f4a7c15ull;
    return (size_t)(x >> (64 - PTRMAP_SHARD_BITS));
}

/* The bucket of addr in a shard of cap buckets. */
static inline size_t ptrmap_bucket(uintptr_t addr, size_t cap)
{
    uint64_t x = (uint64_t)addr >> 9;
    x ^= x >> 29;
    x *= 0x9e3779b97f4a7c15ull;
    x ^= x >> 32;
    return (size_t)(x >> 6) & (cap - 1);
}

/* The link holding the live block at addr in s (a held, not allocated block is not
 * live), or NULL (its lock, or the solo lock, held). */
static inline __attribute__((always_inline)) cca_block_t **ptrmap_shard_link(ptrmap_shard_t *s,
                                                                           uintptr_t addr)
{
    if (!s->cap)
        return NULL;
    cca_block_t **link = &s->buckets[ptrmap_bucket(addr, s->cap)];
    while (*link && ((*link)->addr != addr || ((*link)->pool && !(*link)->allocated)))
        link = &(*link)->map_next;
    return *link ? link : NULL;
}

static inline void ptrmap_shard_unlink(ptrmap_shard_t *s, cca_block_t **link)
{
    cca_block_t *block = *link;
    *link = block->map_next;
    block->map_next = NULL;
    s->count--;
}

/* Solo mode, its lock held (ptrmap_solo_lock): the link holding the live block at addr
 * (NULL: none), valid until the map next changes; ptrmap_unlink_solo takes it out. */
static inline cca_block_t **ptrmap_find_link_solo(struct cca_ptrmap *m, uintptr_t addr)
{
    return ptrmap_shard_link(&m->shards[PTRMAP_SOLO], addr);
}

static inline void ptrmap_unlink_solo(struct cca_ptrmap *m, cca_block_t **link)
{
    ptrmap_shard_unlink(&m->shards[PTRMAP_SOLO], link);
}

/* ptrmap_insert_held, inline where the map is in solo mode under held (the caller's lock)
 * and the block's shard has room; else through ptrmap.c. */
static inline __attribute__((always_inline)) bool ptrmap_insert_fast(struct cca_ptrmap *m,
                                                                    cca_block_t *block,
                                                                    const cca_spinlock_t *held)
{
    ptrmap_shard_t *s = &m->shards[PTRMAP_SOLO];
    if (!held || atomic_load_explicit(&m->head.solo, memory_order_acquire) != held || s->count * 2 >= s->cap)
        return ptrmap_insert_held(m, block, held);
    cca_block_t **bucket = &s->buckets[ptrmap_bucket(block->addr, s->cap)];
    block->map_next = *bucket;
    *bucket = block;
    s->count++;
    return true;
}

#endif
