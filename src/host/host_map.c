/*
 * host_map.c - the pinned host allocator's block lookups: the pointer map
 * (a chained hash table of exact block addresses, under the allocator's
 * lock; its lookup is inline in pinned.h) and the range array sorted by
 * address (interior pointers, and every block at destroy; ranges_lock).
 * Invariant: every block held from the system is in both until it is given
 * back; each structure is changed only under its own lock.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "pinned.h"

/* ------------------------------------------------------------------------ */
/* The pointer map and the range array                                      */
/* ------------------------------------------------------------------------ */

static _Atomic long records_countdown; /* tests (host_test_fail_records) */

void host_test_fail_records(long n)
{
    atomic_store_explicit(&records_countdown, n, memory_order_relaxed);
}

bool host_records_alloc_fails(void)
{
    return cca_countdown_hit(&records_countdown);
}

/* Double the bucket array; best effort (chains grow on failure). Lock held. */
static void map_grow_locked(host_alloc_t *h)
{
    size_t n = h->nbuckets * 2;
    host_block_t **buckets = host_records_alloc_fails() ? NULL : calloc(n, sizeof(*buckets));
    if (!buckets)
        return;
    for (size_t i = 0; i < h->nbuckets; i++) {
        host_block_t *b = h->buckets[i];
        while (b) {
            host_block_t *next = b->map_next;
            size_t j = host_ptr_hash(b->ptr) & (n - 1);
            b->map_next = buckets[j];
            buckets[j] = b;
            b = next;
        }
    }
    free(h->buckets);
    h->buckets = buckets;
    h->nbuckets = n;
}

void host_map_insert_locked(host_alloc_t *h, host_block_t *b)
{
    if (h->mapped >= h->nbuckets)
        map_grow_locked(h);
    size_t i = host_ptr_hash(b->ptr) & (h->nbuckets - 1);
    b->map_next = h->buckets[i];
    h->buckets[i] = b;
    h->mapped++;
}

void host_map_insert(host_alloc_t *h, host_block_t *b)
{
    cca_spin_lock(&h->lock);
    host_map_insert_locked(h, b);
    cca_spin_unlock(&h->lock);
}

void host_map_remove(host_alloc_t *h, host_block_t *b)
{
    cca_spin_lock(&h->lock);
    host_block_t **link = &h->buckets[host_ptr_hash(b->ptr) & (h->nbuckets - 1)];
    while (*link && *link != b)
        link = &(*link)->map_next;
    if (*link) {
        *link = b->map_next;
        h->mapped--;
    }
    cca_spin_unlock(&h->lock);
}

/* Index of the first block whose address is > ptr. ranges_lock held. */
static size_t ranges_upper_locked(host_alloc_t *h, const void *ptr)
{
    size_t lo = 0, hi = h->nranges;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if ((uintptr_t)h->ranges[mid]->ptr <= (uintptr_t)ptr)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

/* Keep room for one more block in the range array. Returns CCA_OK or CCA_ERR_OUT_OF_MEMORY. */
cca_status_t host_ranges_reserve(host_alloc_t *h)
{
    cca_status_t status = CCA_OK;
    pthread_mutex_lock(&h->ranges_lock);
    if (h->nranges + h->ranges_reserved == h->ranges_cap) {
        size_t cap = h->ranges_cap ? h->ranges_cap * 2 : 64;
        host_block_t **ranges = host_records_alloc_fails()
                                    ? NULL
                                    : realloc(h->ranges, cap * sizeof(*ranges));
        if (!ranges) {
            status = cca_raise(CCA_ERR_OUT_OF_MEMORY,
                               "out of host memory for the pinned block table (%zu blocks)",
                               h->nranges);
            goto out_unlock;
        }
        h->ranges = ranges;
        h->ranges_cap = cap;
    }
    h->ranges_reserved++;
out_unlock:
    pthread_mutex_unlock(&h->ranges_lock);
    return status;
}

void host_ranges_unreserve(host_alloc_t *h)
{
    pthread_mutex_lock(&h->ranges_lock);
    cca_assert_internal(h->ranges_reserved > 0);
    h->ranges_reserved--;
    pthread_mutex_unlock(&h->ranges_lock);
}

void host_ranges_insert(host_alloc_t *h, host_block_t *b)
{
    pthread_mutex_lock(&h->ranges_lock);
    cca_assert_internal(h->ranges_reserved > 0);
    h->ranges_reserved--;
    size_t at = ranges_upper_locked(h, b->ptr);
    memmove(&h->ranges[at + 1], &h->ranges[at], (h->nranges - at) * sizeof(*h->ranges));
    h->ranges[at] = b;
    h->nranges++;
    pthread_mutex_unlock(&h->ranges_lock);
}

void host_ranges_remove(host_alloc_t *h, host_block_t *b, bool keep_room)
{
    pthread_mutex_lock(&h->ranges_lock);
    size_t at = ranges_upper_locked(h, b->ptr);
    if (at > 0 && h->ranges[at - 1] == b) {
        memmove(&h->ranges[at - 1], &h->ranges[at], (h->nranges - at) * sizeof(*h->ranges));
        h->nranges--;
        if (keep_room)
            h->ranges_reserved++;
    }
    pthread_mutex_unlock(&h->ranges_lock);
}

/* Start and size of the block holding ptr (interior included); false if none. */
bool host_ranges_find(host_alloc_t *h, const void *ptr, void **base, size_t *size)
{
    bool found = false;
    pthread_mutex_lock(&h->ranges_lock);
    size_t at = ranges_upper_locked(h, ptr);
    if (at > 0) {
        host_block_t *b = h->ranges[at - 1];
        if ((uintptr_t)ptr < (uintptr_t)b->ptr + b->size) {
            *base = b->ptr;
            *size = b->size;
            found = true;
        }
    }
    pthread_mutex_unlock(&h->ranges_lock);
    return found;
}

/* Raise CCA_ERR_INVALID_POINTER for a pointer that is not the start of a block. */
cca_status_t host_raise_unknown(host_alloc_t *h, const void *ptr, const char *what)
{
    void *base;
    size_t size;
    if (host_ranges_find(h, ptr, &base, &size))
        return cca_raise(CCA_ERR_INVALID_POINTER,
                         "%s: pointer %p is inside the pinned block at %p (%zu bytes), not at "
                         "its start",
                         what, ptr, base, size);
    return cca_raise(CCA_ERR_INVALID_POINTER,
                     "%s: pointer %p was not allocated by cca's pinned host allocator", what,
                     ptr);
}
