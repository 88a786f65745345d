/*
 * ptrmap.c - the pointer map: live blocks by address, in shards that each
 * have their own lock. A shard is chosen by the 2 MiB region of the address,
 * so the blocks of one segment (which belongs to one stream) share a shard
 * and threads on different streams rarely touch the same lock.
 *
 * While the process has a single stream pool (one device, one stream: the
 * common program), that pool's lock guards the whole map instead of the
 * shards' (solo mode): its allocations and frees, which hold it anyway, then
 * take no second lock (the _held calls). Every other user takes that lock in
 * place of a shard's. A second stream pool ends solo mode for good
 * (ptrmap_pool_made), under the first pool's lock. Solo mode keeps its blocks
 * in a table of its own (shards[PTRMAP_SOLO]), whose few buckets stay in the
 * cache where the shards' tables, one per 2 MiB region, would not; as it ends
 * they move to their shards (solo_spill), and one a shard cannot take for want
 * of host memory stays there, where the shards' lookups look last.
 * Invariant: a block is in the map exactly while it is allocated, or held
 * back from merging in solo mode (pool->held_in_map: not allocated, found by
 * no lookup).
 */
#include <stdlib.h>

#include "ptrmap.h"

cca_status_t ptrmap_create(struct cca_ptrmap **out, void (*solo_end)(cca_spinlock_t *solo))
{
    struct cca_ptrmap *m = calloc(1, sizeof(*m));
    if (!m)
        return cca_raise(CCA_ERR_OUT_OF_MEMORY, "out of host memory creating the pointer map");
    for (int i = 0; i <= PTRMAP_SHARDS; i++)
        cca_spin_init(&m->shards[i].lock);
    pthread_mutex_init(&m->pools_lock, NULL);
    atomic_init(&m->head.solo, NULL);
    m->solo_end = solo_end;
    *out = m;
    return CCA_OK;
}

void ptrmap_destroy(struct cca_ptrmap *m)
{
    if (!m)
        return;
    for (int i = 0; i <= PTRMAP_SHARDS; i++)
        free(m->shards[i].buckets);
    pthread_mutex_destroy(&m->pools_lock);
    free(m);
}

static bool shard_grow(ptrmap_shard_t *s)
{
    size_t cap = s->cap ? s->cap * 2 : 64;
    cca_block_t **buckets = pool_host_alloc_fails() ? NULL : calloc(cap, sizeof(*buckets));
    if (!buckets)
        return false;
    for (size_t i = 0; i < s->cap; i++) {
        cca_block_t *b = s->buckets[i];
        while (b) {
            cca_block_t *next = b->map_next;
            size_t j = ptrmap_bucket(b->addr, cap);
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

static bool shard_insert(ptrmap_shard_t *s, cca_block_t *block)
{
    if (s->count * 2 >= s->cap && !shard_grow(s) && s->cap == 0)
        return false;
    size_t j = ptrmap_bucket(block->addr, s->cap);
    block->map_next = s->buckets[j];
    s->buckets[j] = block;
    s->count++;
    return true;
}

static bool spill_no_memory; /* tests: solo_spill as if no shard could get buckets */

void ptrmap_test_spill_no_memory(bool on)
{
    spill_no_memory = on;
}

/*
 * Solo mode ends for a second pool: its table's blocks move to their shards (the solo
 * lock held: nobody else is in the map). A block whose shard cannot get its first
 * buckets stays in the solo table, where the shards' lookups look last (leftover_find).
 * (As the solo pool goes, at shutdown, its blocks are gone: nothing moves.)
 */
static void solo_spill(struct cca_ptrmap *m)
{
    ptrmap_shard_t *t = &m->shards[PTRMAP_SOLO];
    for (size_t j = 0; j < t->cap; j++) {
        cca_block_t **link = &t->buckets[j];
        while (*link) {
            cca_block_t *b = *link;
            ptrmap_shard_t *s = &m->shards[ptrmap_shard_of(b->addr)];
            if (!s->cap && (spill_no_memory || !shard_grow(s))) {
                link = &b->map_next;
                continue;
            }
            ptrmap_shard_unlink(t, link);
            shard_insert(s, b); /* (a shard with buckets takes every block) */
        }
    }
    if (!t->count) { /* nothing left over: its buckets are not needed again */
        free(t->buckets);
        t->buckets = NULL;
        t->cap = 0;
    }
}

void ptrmap_pool_made(struct cca_ptrmap *m, cca_spinlock_t *pool_lock)
{
    pthread_mutex_lock(&m->pools_lock);
    if (!m->pool_made) {
        m->pool_made = true;
        atomic_store_explicit(&m->head.solo, pool_lock, memory_order_release); /* NULL: none */
    } else {
        cca_spinlock_t *solo = atomic_load_explicit(&m->head.solo, memory_order_relaxed);
        if (solo) {
            cca_spin_lock(solo); /* its operation in flight ends first */
            if (m->solo_end)
                m->solo_end(solo); /* its pool's held block out of the map */
            solo_spill(m);
            atomic_store_explicit(&m->head.solo, NULL, memory_order_release);
            cca_spin_unlock(solo);
        }
    }
    pthread_mutex_unlock(&m->pools_lock);
}

void ptrmap_pool_gone(struct cca_ptrmap *m, cca_spinlock_t *pool_lock)
{
    pthread_mutex_lock(&m->pools_lock);
    if (atomic_load_explicit(&m->head.solo, memory_order_relaxed) == pool_lock)
        atomic_store_explicit(&m->head.solo, NULL, memory_order_release); /* its blocks are gone */
    pthread_mutex_unlock(&m->pools_lock);
}

cca_spinlock_t *ptrmap_solo(struct cca_ptrmap *m)
{
    return atomic_load_explicit(&m->head.solo, memory_order_acquire);
}

/* Lock the map for one operation: the only pool's lock in solo mode (returned), else
 * NULL, the caller then taking a shard's. held: a lock the caller holds already. */
static inline cca_spinlock_t *map_lock(struct cca_ptrmap *m, const cca_spinlock_t *held)
{
    cca_spinlock_t *solo = atomic_load_explicit(&m->head.solo, memory_order_acquire);
    if (!solo)
        return NULL;
    if (solo == held)
        return solo; /* unchanged while it is held */
    return ptrmap_solo_lock(m);
}

static inline void map_unlock(cca_spinlock_t *solo, const cca_spinlock_t *held)
{
    if (solo && solo != held)
        cca_spin_unlock(solo);
}

/* The table of addr for one operation, locked: in solo mode the solo table under the
 * solo lock (*solop), else addr's shard under its own lock (*solop NULL). */
static inline ptrmap_shard_t *table_lock(struct cca_ptrmap *m, uintptr_t addr,
                                         const cca_spinlock_t *held, cca_spinlock_t **solop)
{
    cca_spinlock_t *solo = map_lock(m, held);
    *solop = solo;
    if (solo)
        return &m->shards[PTRMAP_SOLO];
    ptrmap_shard_t *s = &m->shards[ptrmap_shard_of(addr)];
    cca_spin_lock(&s->lock);
    return s;
}

static inline void table_unlock(ptrmap_shard_t *s, cca_spinlock_t *solo, const cca_spinlock_t *held)
{
    if (!solo)
        cca_spin_unlock(&s->lock);
    map_unlock(solo, held);
}

bool ptrmap_insert_held(struct cca_ptrmap *m, cca_block_t *block, const cca_spinlock_t *held)
{
    cca_spinlock_t *solo;
    ptrmap_shard_t *s = table_lock(m, block->addr, held, &solo);
    bool ok = shard_insert(s, block);
    table_unlock(s, solo, held);
    return ok;
}

bool ptrmap_insert(struct cca_ptrmap *m, cca_block_t *block)
{
    return ptrmap_insert_held(m, block, NULL);
}

bool ptrmap_reserve(struct cca_ptrmap *m, uintptr_t addr)
{
    cca_spinlock_t *solo;
    ptrmap_shard_t *t = table_lock(m, addr, NULL, &solo);
    bool ok = t->cap || shard_grow(t);
    if (ok && solo) { /* the shard too, should solo mode end before the insert (the solo
                       * lock held: nobody else uses the shards meanwhile) */
        ptrmap_shard_t *s = &m->shards[ptrmap_shard_of(addr)];
        ok = s->cap || shard_grow(s);
    }
    table_unlock(t, solo, NULL);
    return ok;
}

static cca_block_t *shard_find(ptrmap_shard_t *s, uintptr_t addr, bool remove)
{
    cca_block_t **link = ptrmap_shard_link(s, addr);
    if (!link)
        return NULL;
    cca_block_t *found = *link;
    if (remove)
        ptrmap_shard_unlink(s, link);
    return found;
}

/* Shards' mode: the solo table's leftovers (solo_spill), looked at where a shard had no
 * answer; under the table's own lock, taken alone. */
static cca_block_t *leftover_find(struct cca_ptrmap *m, uintptr_t addr, bool remove)
{
    ptrmap_shard_t *t = &m->shards[PTRMAP_SOLO];
    cca_spin_lock(&t->lock);
    cca_block_t *found = shard_find(t, addr, remove);
    cca_spin_unlock(&t->lock);
    return found;
}

cca_block_t *ptrmap_find_held(struct cca_ptrmap *m, uintptr_t addr, bool remove,
                              const cca_spinlock_t *held)
{
    cca_spinlock_t *solo;
    ptrmap_shard_t *s = table_lock(m, addr, held, &solo);
    cca_block_t *found = shard_find(s, addr, remove);
    table_unlock(s, solo, held);
    if (!found && !solo)
        found = leftover_find(m, addr, remove);
    return found;
}

/* (Only a block held back in solo mode is taken out this way, solo_end taking the last one
 * out before solo_spill: it is never among the solo table's leftovers.) */
void ptrmap_remove_block(struct cca_ptrmap *m, cca_block_t *block, const cca_spinlock_t *held)
{
    cca_spinlock_t *solo;
    ptrmap_shard_t *s = table_lock(m, block->addr, held, &solo);
    if (s->cap) {
        cca_block_t **link = &s->buckets[ptrmap_bucket(block->addr, s->cap)];
        while (*link && *link != block)
            link = &(*link)->map_next;
        if (*link)
            ptrmap_shard_unlink(s, link);
    }
    table_unlock(s, solo, held);
}

cca_block_t *ptrmap_find(struct cca_ptrmap *m, uintptr_t addr, bool remove)
{
    return ptrmap_find_held(m, addr, remove, NULL);
}

cca_block_t *ptrmap_find_containing(struct cca_ptrmap *m, uintptr_t addr)
{
    cca_spinlock_t *solo = map_lock(m, NULL);
    cca_block_t *found = NULL;
    for (int i = 0; i <= PTRMAP_SHARDS && !found; i++) {
        ptrmap_shard_t *s = &m->shards[i];
        if (!solo)
            cca_spin_lock(&s->lock);
        for (size_t j = 0; j < s->cap && !found; j++)
            for (cca_block_t *b = s->buckets[j]; b; b = b->map_next)
                if (addr >= b->addr && addr < b->addr + b->size && (!b->pool || b->allocated)) {
                    found = b; /* (solo mode keeps a held-back free in the map: not live) */
                    break;
                }
        if (!solo)
            cca_spin_unlock(&s->lock);
    }
    map_unlock(solo, NULL);
    return found;
}

void ptrmap_for_each(struct cca_ptrmap *m, void (*fn)(cca_block_t *, void *), void *arg,
                     const cca_spinlock_t *held)
{
    cca_spinlock_t *solo = map_lock(m, held);
    for (int i = 0; i <= PTRMAP_SHARDS; i++) {
        ptrmap_shard_t *s = &m->shards[i];
        if (!solo)
            cca_spin_lock(&s->lock);
        /* (most shards are empty: the checker walks the map after every step of a test) */
        for (size_t j = 0; s->count && j < s->cap; j++) {
            cca_block_t *next;
            for (cca_block_t *b = s->buckets[j]; b; b = next) {
                next = b->map_next; /* fn may free b */
                fn(b, arg);
            }
        }
        if (!solo)
            cca_spin_unlock(&s->lock);
    }
    map_unlock(solo, held);
}

size_t ptrmap_count(struct cca_ptrmap *m, const cca_spinlock_t *held)
{
    cca_spinlock_t *solo = map_lock(m, held);
    size_t n = 0;
    for (int i = 0; i <= PTRMAP_SHARDS; i++) {
        if (!solo)
            cca_spin_lock(&m->shards[i].lock);
        n += m->shards[i].count;
        if (!solo)
            cca_spin_unlock(&m->shards[i].lock);
    }
    map_unlock(solo, held);
    return n;
}
