/*
 * ptrmap.c - the pointer map: live blocks by address, in shards that each
 * have their own lock. A shard is chosen by the 2 MiB region of the address,
 * so the blocks of one segment (which belongs to one stream) share a shard
 * and threads on different streams rarely touch the same lock.
 * Invariant: a block is in the map exactly while it is allocated.
 */
#include <pthread.h>
#include <stdlib.h>

#include "device.h"

#define PTRMAP_SHARDS 4096 /* many: threads on different streams rarely meet on one */
#define PTRMAP_SHARD_BITS 12

typedef struct ptrmap_shard {
    cca_spinlock_t lock;
    cca_block_t **buckets; /* chained through map_next */
    size_t cap;            /* power of two */
    size_t count;
    char pad[64];
} ptrmap_shard_t;

struct cca_ptrmap {
    ptrmap_shard_t shards[PTRMAP_SHARDS];
};

static inline size_t shard_of(uintptr_t addr)
{
    uint64_t x = (uint64_t)addr >> 21;
    x *= 0x9e3779b97f4a7c15ull;
    return (size_t)(x >> (64 - PTRMAP_SHARD_BITS));
}

static inline uint64_t hash_addr(uintptr_t addr)
{
    uint64_t x = (uint64_t)addr >> 9;
    x ^= x >> 29;
    x *= 0x9e3779b97f4a7c15ull;
    return x ^ (x >> 32);
}

cca_status_t ptrmap_create(struct cca_ptrmap **out)
{
    struct cca_ptrmap *m = calloc(1, sizeof(*m));
    if (!m)
        return cca_raise(CCA_ERR_OUT_OF_MEMORY, "out of host memory creating the pointer map");
    for (int i = 0; i < PTRMAP_SHARDS; i++)
        cca_spin_init(&m->shards[i].lock);
    *out = m;
    return CCA_OK;
}

void ptrmap_destroy(struct cca_ptrmap *m)
{
    if (!m)
        return;
    for (int i = 0; i < PTRMAP_SHARDS; i++) {
        free(m->shards[i].buckets);
    }
    free(m);
}

static bool shard_grow(ptrmap_shard_t *s)
{
    size_t cap = s->cap ? s->cap * 2 : 64;
    cca_block_t **buckets = calloc(cap, sizeof(*buckets));
    if (!buckets)
        return false;
    for (size_t i = 0; i < s->cap; i++) {
        cca_block_t *b = s->buckets[i];
        while (b) {
            cca_block_t *next = b->map_next;
            size_t j = (size_t)(hash_addr(b->addr) >> 6) & (cap - 1);
            b->map_next = buckets[j];
            buckets[j] = b;
            b = next;
        }
    }
    free(s->buckets);
    s->buckets = buckets;
    s->cap = cap;
    return true;
}

bool ptrmap_insert(struct cca_ptrmap *m, cca_block_t *block)
{
    uint64_t h = hash_addr(block->addr);
    ptrmap_shard_t *s = &m->shards[shard_of(block->addr)];
    cca_spin_lock(&s->lock);
    if (s->count >= s->cap && !shard_grow(s) && s->cap == 0) {
        cca_spin_unlock(&s->lock);
        return false;
    }
    size_t j = (size_t)(h >> 6) & (s->cap - 1);
    block->map_next = s->buckets[j];
    s->buckets[j] = block;
    s->count++;
    cca_spin_unlock(&s->lock);
    return true;
}

cca_block_t *ptrmap_find(struct cca_ptrmap *m, uintptr_t addr, bool remove)
{
    uint64_t h = hash_addr(addr);
    ptrmap_shard_t *s = &m->shards[shard_of(addr)];
    cca_block_t *found = NULL;
    cca_spin_lock(&s->lock);
    if (s->cap) {
        cca_block_t **link = &s->buckets[(size_t)(h >> 6) & (s->cap - 1)];
        while (*link && (*link)->addr != addr)
            link = &(*link)->map_next;
        found = *link;
        if (found && remove) {
            *link = found->map_next;
            found->map_next = NULL;
            s->count--;
        }
    }
    cca_spin_unlock(&s->lock);
    return found;
}

cca_block_t *ptrmap_find_containing(struct cca_ptrmap *m, uintptr_t addr)
{
    for (int i = 0; i < PTRMAP_SHARDS; i++) {
        ptrmap_shard_t *s = &m->shards[i];
        cca_block_t *found = NULL;
        cca_spin_lock(&s->lock);
        for (size_t j = 0; j < s->cap && !found; j++)
            for (cca_block_t *b = s->buckets[j]; b; b = b->map_next)
                if (addr >= b->addr && addr < b->addr + b->size) {
                    found = b;
                    break;
                }
        cca_spin_unlock(&s->lock);
        if (found)
            return found;
    }
    return NULL;
}

void ptrmap_for_each(struct cca_ptrmap *m, void (*fn)(cca_block_t *, void *), void *arg)
{
    for (int i = 0; i < PTRMAP_SHARDS; i++) {
        ptrmap_shard_t *s = &m->shards[i];
        cca_spin_lock(&s->lock);
        for (size_t j = 0; j < s->cap; j++) {
            cca_block_t *next;
            for (cca_block_t *b = s->buckets[j]; b; b = next) {
                next = b->map_next; /* fn may free b */
                fn(b, arg);
            }
        }
        cca_spin_unlock(&s->lock);
    }
}

size_t ptrmap_count(struct cca_ptrmap *m)
{
    size_t n = 0;
    for (int i = 0; i < PTRMAP_SHARDS; i++) {
        cca_spin_lock(&m->shards[i].lock);
        n += m->shards[i].count;
        cca_spin_unlock(&m->shards[i].lock);
    }
    return n;
}
