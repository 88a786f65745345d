/*
 * sim_containers.h - the containers of the simulated backend (src/backend/sim/):
 * a hash map from 64-bit keys to pointers, and ordered sets of address ranges
 * (treaps keyed by start address, each node knowing the longest range below it).
 * Not thread-safe: the backend's lock guards them.
 */
#ifndef CCA_SIM_CONTAINERS_H
#define CCA_SIM_CONTAINERS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* Open addressing, linear probing, backward-shift deletion. A slot is in use
 * iff its value is non-NULL, so every key (0 included) can be stored. */
typedef struct sim_slot {
    uint64_t key;
    void *value;
} sim_slot_t;

typedef struct sim_map {
    sim_slot_t *slots; /* NULL until the first insertion */
    size_t mask;       /* capacity - 1 (capacity a power of two) */
    size_t count;      /* slots in use */
} sim_map_t;

enum { SIM_RANGE_FREE = 0, SIM_RANGE_ALLOC, SIM_RANGE_RESV, SIM_RANGE_MAPPING };

typedef struct sim_range {
    uint64_t start;   /* first address */
    uint64_t len;     /* bytes */
    uint64_t max_len; /* largest len in this subtree */
    uint32_t prio;    /* heap priority */
    int kind;         /* SIM_RANGE_* */
    void *data;       /* record of the live range, if any */
    uint64_t access;  /* a mapping: the devices given access to it (bit per device) */
    struct sim_range *left, *right;
} sim_range_t;

/* A 64-bit mixing function (splitmix64 finaliser). */
uint64_t simmap_hash(uint64_t x);

/* The value of key, or NULL if absent. */
void *simmap_get(const sim_map_t *m, uint64_t key);

/* Make room for one more entry. Returns false when host memory runs out. */
bool simmap_reserve(sim_map_t *m);

/* Insert an absent key; simmap_reserve() must have succeeded just before. */
void simmap_put(sim_map_t *m, uint64_t key, void *value);

/* Remove key; returns its value, or NULL if it was absent. */
void *simmap_remove(sim_map_t *m, uint64_t key);

/* Free the table (not the values); the map is empty and reusable after. */
void simmap_free(sim_map_t *m);

/* Insert n (start, len, prio set; its start absent from the set). */
void simrange_insert(sim_range_t **root, sim_range_t *n);

/* Detach the range starting exactly at start; NULL if there is none. */
sim_range_t *simrange_remove(sim_range_t **root, uint64_t start);

/* Recompute max_len on the path to the node at start, after its len changed
 * (its start may have moved too, as long as the order of starts holds). */
void simrange_refresh(sim_range_t *t, uint64_t start);

/* The range with the greatest start <= addr. */
sim_range_t *simrange_find_le(sim_range_t *t, uint64_t addr);

/* The range with the smallest start >= addr. */
sim_range_t *simrange_find_ge(sim_range_t *t, uint64_t addr);

/* The lowest range where size bytes fit at an align-aligned address. */
sim_range_t *simrange_first_fit(sim_range_t *t, uint64_t size, uint64_t align);

/* Free every node, calling release (if not NULL) on each first. */
void simrange_destroy(sim_range_t *t, void (*release)(sim_range_t *, void *), void *arg);

#endif /* CCA_SIM_CONTAINERS_H */
