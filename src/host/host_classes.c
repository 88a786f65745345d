/*
 * host_classes.c - the pinned host allocator's free lists: one LIFO list per
 * power-of-two size class, each with its own lock, and the per-class
 * counters.
 * Invariant: a block is in at most one list, only when it is not allocated
 * and has no pending event.
 */
#include "pinned.h"

/* Cache b in its class; returned: b comes back from a caller (counted as such). */
void host_class_push(host_alloc_t *h, host_block_t *b, bool returned)
{
    size_t index = host_ceil_log2(b->size);
    host_class_t *c = &h->classes[index];
    cca_spin_lock(&c->lock);
    if (returned) {
        c->returned++;
        c->returned_bytes += (int64_t)b->size;
    }
    b->free_next = c->head;
    c->head = b;
    c->count++;
    if (b->size != (size_t)1 << index)
        c->odd++;
    cca_spin_unlock(&c->lock);
}

/*
 * Take a free block of at least size bytes from size's class: the most
 * recently freed one, or, where the class holds page-rounded blocks, the
 * smallest that fits. NULL if none.
 */
host_block_t *host_class_take(host_alloc_t *h, size_t size)
{
    size_t index = host_ceil_log2(size);
    host_class_t *c = &h->classes[index];
    host_block_t *found = NULL;
    cca_spin_lock(&c->lock);
    host_block_t **link = &c->head;
    if (c->odd) {
        host_block_t **best = NULL;
        for (host_block_t **it = &c->head; *it; it = &(*it)->free_next)
            if ((*it)->size >= size && (!best || (*it)->size < (*best)->size))
                best = it;
        link = best;
    }
    if (link && *link) {
        found = *link;
        *link = found->free_next;
        found->free_next = NULL;
        c->count--;
        if (found->size != (size_t)1 << index)
            c->odd--;
        c->taken++;
        c->taken_bytes += (int64_t)found->size;
    }
    cca_spin_unlock(&c->lock);
    return found;
}

/* Count a block handed out (taken) or returned outside the free-list operations. */
void host_class_count(host_alloc_t *h, size_t size, bool taken)
{
    host_class_t *c = &h->classes[host_ceil_log2(size)];
    cca_spin_lock(&c->lock);
    if (taken) {
        c->taken++;
        c->taken_bytes += (int64_t)size;
    } else {
        c->returned++;
        c->returned_bytes += (int64_t)size;
    }
    cca_spin_unlock(&c->lock);
}

/* ------------------------------------------------------------------------ */
/* Creation and destruction                                                  */
