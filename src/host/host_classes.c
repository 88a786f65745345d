/*
 * host_classes.c - the pinned host allocator's free lists: one LIFO list per
 * power-of-two size class, and the per-class counters, all under the
 * allocator's lock.
 * Invariant: a block is in at most one list, only when it is not allocated
 * and has no pending event.
 */
#include "pinned.h"

/* Cache b (not allocated, no pending event) at the head of its class. Lock held. */
void host_class_push_locked(host_alloc_t *h, host_block_t *b)
{
    size_t index = host_ceil_log2(b->size);
    host_class_t *c = &h->classes[index];
    b->free_next = c->head;
    c->head = b;
    c->count++;
    if (b->size != (size_t)1 << index)
        c->odd++;
}

/*
 * host_class_pop_locked's general case: the smallest block that fits where
 * the class holds page-rounded blocks, else the most recently freed one;
 * counted as taken and active. NULL if none. Lock held.
 */
host_block_t *host_class_take_locked(host_alloc_t *h, size_t index, size_t size)
{
    host_class_t *c = &h->classes[index];
    host_block_t **link = &c->head;
    if (c->odd) {
        host_block_t **best = NULL;
        for (host_block_t **it = &c->head; *it; it = &(*it)->free_next)
            if ((*it)->size >= size && (!best || (*it)->size < (*best)->size))
                best = it;
        if (!best)
            return NULL;
        link = best;
    }
    host_block_t *found = *link;
    if (!found)
        return NULL;
    *link = found->free_next;
    found->free_next = NULL;
    c->count--;
    if (found->size != (size_t)1 << index)
        c->odd--;
    found->allocated = true;
    host_count_taken_locked(h, c, found->size);
    return found;
}
