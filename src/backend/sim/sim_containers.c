/*
 * sim_containers.c - a hash map (uint64 -> pointer; open addressing, linear
 * probing, backward-shift deletion) and ordered range sets (treaps by start
 * address, augmented with the longest range of each subtree for first fit),
 * used by the simulated backend. Invariant: ranges of one set never share a
 * start; max_len is the largest len of the subtree.
 */
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "sim_containers.h"

static uint64_t align_up(uint64_t x, uint64_t align)
{
    return (x + align - 1) & ~(align - 1);
}

uint64_t simmap_hash(uint64_t x)
{
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ull;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebull;
    x ^= x >> 31;
    return x;
}

void *simmap_get(const sim_map_t *m, uint64_t key)
{
    if (!m->slots)
        return NULL;
    for (size_t i = simmap_hash(key) & m->mask;; i = (i + 1) & m->mask) {
        if (!m->slots[i].value)
            return NULL;
        if (m->slots[i].key == key)
            return m->slots[i].value;
    }
}

/* Make room for one more entry. Returns false when host memory runs out. */
bool simmap_reserve(sim_map_t *m)
{
    if (m->slots && (m->count + 1) * 4 <= (m->mask + 1) * 3)
        return true;
    size_t cap = m->slots ? (m->mask + 1) * 2 : 16;
    sim_slot_t *slots = calloc(cap, sizeof(*slots));
    if (!slots)
        return false;
    if (m->slots) {
        for (size_t i = 0; i <= m->mask; i++) {
            if (!m->slots[i].value)
                continue;
            size_t j = simmap_hash(m->slots[i].key) & (cap - 1);
            while (slots[j].value)
                j = (j + 1) & (cap - 1);
            slots[j] = m->slots[i];
        }
        free(m->slots);
    }
    m->slots = slots;
    m->mask = cap - 1;
    return true;
}

/* Insert an absent key; simmap_reserve() must have succeeded just before. */
void simmap_put(sim_map_t *m, uint64_t key, void *value)
{
    size_t i = simmap_hash(key) & m->mask;
    while (m->slots[i].value)
        i = (i + 1) & m->mask;
    m->slots[i].key = key;
    m->slots[i].value = value;
    m->count++;
}

/* Remove key; returns its value, or NULL if it was absent. */
void *simmap_remove(sim_map_t *m, uint64_t key)
{
    if (!m->slots)
        return NULL;
    size_t i = simmap_hash(key) & m->mask;
    while (m->slots[i].value && m->slots[i].key != key)
        i = (i + 1) & m->mask;
    void *value = m->slots[i].value;
    if (!value)
        return NULL;
    for (size_t j = i;;) {
        j = (j + 1) & m->mask;
        if (!m->slots[j].value)
            break;
        size_t home = simmap_hash(m->slots[j].key) & m->mask;
        /* slot j may move to the hole at i unless its home lies in (i, j] */
        bool stays = i < j ? (home > i && home <= j) : (home > i || home <= j);
        if (!stays) {
            m->slots[i] = m->slots[j];
            i = j;
        }
    }
    m->slots[i].value = NULL;
    m->slots[i].key = 0;
    m->count--;
    return value;
}

void simmap_free(sim_map_t *m)
{
    free(m->slots);
    memset(m, 0, sizeof(*m));
}

/* ---- ordered range sets: a treap keyed by start address ----------------------- */

static void simrange_update(sim_range_t *n)
{
    n->max_len = n->len;
    if (n->left && n->left->max_len > n->max_len)
        n->max_len = n->left->max_len;
    if (n->right && n->right->max_len > n->max_len)
        n->max_len = n->right->max_len;
}

/* Split t into ranges starting below key (*lo) and at or above it (*hi). */
static void simrange_split(sim_range_t *t, uint64_t key, sim_range_t **lo, sim_range_t **hi)
{
    if (!t) {
        *lo = *hi = NULL;
        return;
    }
    if (t->start < key) {
        simrange_split(t->right, key, &t->right, hi);
        *lo = t;
    } else {
        simrange_split(t->left, key, lo, &t->left);
        *hi = t;
    }
    simrange_update(t);
}

/* Join two treaps, every start of a below every start of b. */
static sim_range_t *simrange_merge(sim_range_t *a, sim_range_t *b)
{
    if (!a)
        return b;
    if (!b)
        return a;
    if (a->prio > b->prio) {
        a->right = simrange_merge(a->right, b);
        simrange_update(a);
        return a;
    }
    b->left = simrange_merge(a, b->left);
    simrange_update(b);
    return b;
}

/* Insert n below t: descend while t outranks n, then split the subtree. */
static sim_range_t *simrange_insert_into(sim_range_t *t, sim_range_t *n)
{
    if (!t || n->prio > t->prio) {
        simrange_split(t, n->start, &n->left, &n->right);
        simrange_update(n);
        return n;
    }
    if (n->start < t->start)
        t->left = simrange_insert_into(t->left, n);
    else
        t->right = simrange_insert_into(t->right, n);
    if (n->len > t->max_len)
        t->max_len = n->len;
    return t;
}

void simrange_insert(sim_range_t **root, sim_range_t *n)
{
    n->left = n->right = NULL;
    *root = simrange_insert_into(*root, n);
}

/* Unlink the node starting at start from t into *out; returns the new t. */
static sim_range_t *simrange_erase(sim_range_t *t, uint64_t start, sim_range_t **out)
{
    if (!t)
        return NULL;
    if (start < t->start) {
        t->left = simrange_erase(t->left, start, out);
    } else if (start > t->start) {
        t->right = simrange_erase(t->right, start, out);
    } else {
        sim_range_t *rest = simrange_merge(t->left, t->right);
        t->left = t->right = NULL;
        *out = t;
        return rest;
    }
    simrange_update(t);
    return t;
}

/* Detach the range starting exactly at start; NULL if there is none. */
sim_range_t *simrange_remove(sim_range_t **root, uint64_t start)
{
    sim_range_t *n = NULL;
    *root = simrange_erase(*root, start, &n);
    return n;
}

/* Recompute max_len on the path to the node at start, after its len changed
 * (its start may have moved too, as long as the order of starts holds). */
void simrange_refresh(sim_range_t *t, uint64_t start)
{
    if (!t)
        return;
    if (start < t->start)
        simrange_refresh(t->left, start);
    else if (start > t->start)
        simrange_refresh(t->right, start);
    simrange_update(t);
}

/* The range with the greatest start <= addr. */
sim_range_t *simrange_find_le(sim_range_t *t, uint64_t addr)
{
    sim_range_t *best = NULL;
    while (t) {
        if (t->start <= addr) {
            best = t;
            t = t->right;
        } else {
            t = t->left;
        }
    }
    return best;
}

/* The range with the smallest start >= addr. */
sim_range_t *simrange_find_ge(sim_range_t *t, uint64_t addr)
{
    sim_range_t *best = NULL;
    while (t) {
        if (t->start >= addr) {
            best = t;
            t = t->left;
        } else {
            t = t->right;
        }
    }
    return best;
}

static bool range_fits(const sim_range_t *r, uint64_t size, uint64_t align)
{
    uint64_t at = align_up(r->start, align);
    return at >= r->start && at - r->start <= r->len && r->len - (at - r->start) >= size;
}

/* The lowest range where size bytes fit at an align-aligned address. */
sim_range_t *simrange_first_fit(sim_range_t *t, uint64_t size, uint64_t align)
{
    if (!t || t->max_len < size)
        return NULL;
    sim_range_t *hit = simrange_first_fit(t->left, size, align);
    if (hit)
        return hit;
    if (range_fits(t, size, align))
        return t;
    return simrange_first_fit(t->right, size, align);
}

void simrange_destroy(sim_range_t *t, void (*release)(sim_range_t *, void *), void *arg)
{
    if (!t)
        return;
    simrange_destroy(t->left, release, arg);
    simrange_destroy(t->right, release, arg);
    if (release)
        release(t, arg);
    free(t);
}

