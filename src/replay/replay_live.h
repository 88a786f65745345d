/*
 * replay_live.h - the replay's live blocks: a trace address -> the pointer
 * cca gave for it (and the private stream holding it after a deferred
 * free_requested), in an open-addressing table. Shared by replay.c and the
 * start state's construction (replay_start.c).
 */
#ifndef CCA_REPLAY_LIVE_H
#define CCA_REPLAY_LIVE_H

#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>

/* Live blocks: trace address -> cca pointer (and the private stream if deferred). */
typedef struct live_entry {
    uint64_t key;      /* trace address; 0 = empty */
    uint64_t ptr;      /* cca's pointer */
    uint64_t hold;     /* private stream holding it after free_requested, 0 if none */
    bool tomb;
} live_entry_t;

typedef struct live_map {
    live_entry_t *slots;
    size_t cap, count, used;
} live_map_t;

/* One multiplication: the high bits of the product mix every bit of an address below them. */
static inline size_t live_hash(uint64_t k)
{
    return (size_t)((k * 0x9e3779b97f4a7c15ull) >> 32);
}

/* Make room for an entry: a table of deleted entries mostly is rebuilt at its size (a replay
 * deletes nearly every block it puts, and doubling then would grow the table with the number
 * of allocations, not of live blocks), else at twice its size. */
static inline bool live_grow(live_map_t *m)
{
    size_t cap = !m->cap ? 1024 : (m->count + 1) * 4 <= m->cap ? m->cap : m->cap * 2;
    live_entry_t *slots = calloc(cap, sizeof(*slots));
    if (!slots)
        return false;
    for (size_t i = 0; i < m->cap; i++) {
        live_entry_t *e = &m->slots[i];
        if (!e->key || e->tomb)
            continue;
        size_t j = live_hash(e->key) & (cap - 1);
        while (slots[j].key)
            j = (j + 1) & (cap - 1);
        slots[j] = *e;
    }
    free(m->slots);
    m->slots = slots;
    m->cap = cap;
    m->used = m->count;
    return true;
}

static inline live_entry_t *live_find(live_map_t *m, uint64_t key)
{
    if (!m->cap)
        return NULL;
    for (size_t j = live_hash(key) & (m->cap - 1);; j = (j + 1) & (m->cap - 1)) {
        live_entry_t *e = &m->slots[j];
        if (!e->key)
            return NULL;
        if (e->key == key && !e->tomb)
            return e;
    }
}

/*
 * The entry of key, made (ptr and hold 0) if it had none: one probe where
 * live_find and then live_put would make two; *had: it was there (its ptr and
 * hold kept). NULL when out of memory.
 */
static inline live_entry_t *live_get(live_map_t *m, uint64_t key, bool *had)
{
    if ((m->used + 1) * 2 > m->cap && !live_grow(m))
        return NULL;
    live_entry_t *tomb = NULL;
    size_t j = live_hash(key) & (m->cap - 1);
    for (;; j = (j + 1) & (m->cap - 1)) {
        live_entry_t *e = &m->slots[j];
        if (!e->key)
            break;
        if (e->key == key && !e->tomb) {
            *had = true;
            return e;
        }
        if (e->tomb && !tomb)
            tomb = e;
    }
    *had = false;
    live_entry_t *e = tomb ? tomb : &m->slots[j];
    if (!e->key)
        m->used++;
    e->key = key;
    e->tomb = false;
    e->ptr = 0;
    e->hold = 0;
    m->count++;
    return e;
}

/* The entry of key, made (ptr and hold 0) or, where key has one, that one with its ptr and
 * hold reset: never a second entry of a key. NULL when out of memory. */
static inline live_entry_t *live_put(live_map_t *m, uint64_t key)
{
    bool had;
    live_entry_t *e = live_get(m, key, &had);
    if (e && had) {
        e->ptr = 0;
        e->hold = 0;
    }
    return e;
}

/* Delete e. A deleted entry before an empty slot ends no probe: it and the deleted ones just
 * before it empty (a table whose blocks come and go keeps its probes short, and is seldom
 * rebuilt). */
static inline void live_del(live_map_t *m, live_entry_t *e)
{
    size_t j = (size_t)(e - m->slots);
    e->tomb = true;
    m->count--;
    if (m->slots[(j + 1) & (m->cap - 1)].key)
        return;
    while (m->slots[j].key && m->slots[j].tomb) {
        m->slots[j].key = 0;
        m->slots[j].tomb = false;
        m->used--;
        j = (j - 1) & (m->cap - 1);
    }
}

#endif /* CCA_REPLAY_LIVE_H */
