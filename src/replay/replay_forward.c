/*
 * replay_forward.c - a trace played forward from an empty allocator as it is
 * read (replay_events.h): which blocks are live and which bytes are mapped.
 *
 * It decides, at the cost of one table probe per allocation or free while
 * the event is at hand, what the inference of the state before the first
 * event (replay_start.c) would otherwise find by undoing every event from the
 * end: a trace that breaks nothing here, and whose snapshot's end state is
 * the one reached here, began on an empty allocator, and undoing it leaves
 * nothing and meets no inconsistency. Each rule below is the inverse of the
 * inference's undoing of that event: an allocation undone removes its block
 * (here: it must not be live, and becomes so), a free_requested undone keeps
 * or adds its block (here: it must be live), a free_completed undone adds a
 * block (here: it must be live, and leaves; as the recording's first event it
 * is a free made whole before, and changes nothing); a mapping undone takes
 * its bytes out (here: they must not be mapped, and become so), an unmapping
 * undone puts them back (here: they must be mapped, and leave). Invalid
 * events other than allocations are left out by both.
 */
#include <stdlib.h>
#include <string.h>

#include "replay_events.h"
#include "replay_start.h"

bool replay_forward_off;

#define FORWARD_MAX_RANGES 4096 /* past this many apart mapped ranges the inference decides */

/* The index of the first range ending at or after lo. */
static size_t span_at(const replay_forward_t *f, uint64_t lo)
{
    size_t a = 0, b = f->nranges;
    while (a < b) {
        size_t mid = (a + b) / 2;
        if (f->ranges[mid].hi < lo)
            a = mid + 1;
        else
            b = mid;
    }
    return a;
}

/* Map [lo, hi), which must not be mapped; false: it was, or no room. */
static bool span_map(replay_forward_t *f, uint64_t lo, uint64_t hi)
{
    size_t k = span_at(f, lo); /* ranges before k end below lo */
    bool join_left = k < f->nranges && f->ranges[k].hi == lo;
    size_t right = join_left ? k + 1 : k; /* the first range ending above lo */
    if (right < f->nranges && f->ranges[right].lo < hi)
        return false; /* overlaps */
    bool join_right = right < f->nranges && f->ranges[right].lo == hi;
    if (join_left && join_right) {
        f->ranges[k].hi = f->ranges[right].hi;
        memmove(&f->ranges[right], &f->ranges[right + 1], (f->nranges - right - 1) * sizeof(*f->ranges));
        f->nranges--;
    } else if (join_left) {
        f->ranges[k].hi = hi;
    } else if (join_right) {
        f->ranges[right].lo = lo;
    } else {
        if (f->nranges == FORWARD_MAX_RANGES)
            return false;
        if (f->nranges == f->cap) {
            size_t cap = f->cap ? 2 * f->cap : 16;
            struct replay_span *r = realloc(f->ranges, cap * sizeof(*r));
            if (!r)
                return false;
            f->ranges = r;
            f->cap = cap;
        }
        memmove(&f->ranges[k + 1], &f->ranges[k], (f->nranges - k) * sizeof(*f->ranges));
        f->ranges[k] = (struct replay_span){lo, hi};
        f->nranges++;
    }
    return true;
}

/* Unmap [lo, hi), which must be mapped whole; false: it was not, or no room. */
static bool span_unmap(replay_forward_t *f, uint64_t lo, uint64_t hi)
{
    size_t k = span_at(f, lo + 1); /* the range holding byte lo, if any */
    if (k == f->nranges || f->ranges[k].lo > lo || f->ranges[k].hi < hi)
        return false;
    struct replay_span r = f->ranges[k];
    if (r.lo < lo && r.hi > hi) { /* a hole in the middle */
        f->ranges[k].hi = lo;
        return span_map(f, hi, r.hi);
    }
    if (r.lo < lo) {
        f->ranges[k].hi = lo;
    } else if (r.hi > hi) {
        f->ranges[k].lo = hi;
    } else {
        memmove(&f->ranges[k], &f->ranges[k + 1], (f->nranges - k - 1) * sizeof(*f->ranges));
        f->nranges--;
    }
    return true;
}

/* Grow the table of live blocks to twice its size; false: no memory. */
static bool keys_grow(struct replay_keys *k)
{
    size_t cap = k->cap ? 2 * k->cap : 1024;
    uint64_t *keys = calloc(cap, sizeof(*keys));
    if (!keys)
        return false;
    struct replay_keys n = {keys, cap, k->count};
    for (size_t i = 0; i < k->cap; i++)
        if (k->keys[i])
            keys[replay_key_slot(&n, k->keys[i])] = k->keys[i];
    free(k->keys);
    *k = n;
    return true;
}

void replay_forward_rare(replay_forward_t *f, const replay_event_t *e)
{
    switch (e->kind) {
    case EV_ALLOC:
        if (!e->addr || !keys_grow(&f->blocks)) {
            f->broken = true; /* address 0 is the table's empty slot: the inference decides */
            return;
        }
        replay_forward_event(f, e, 1);
        break;
    case EV_SEGMENT_ALLOC:
    case EV_SEGMENT_MAP:
        f->broken = !e->size || e->addr + e->size < e->addr || !span_map(f, e->addr, e->addr + e->size);
        break;
    case EV_SEGMENT_FREE:
    case EV_SEGMENT_UNMAP:
        f->broken = !e->size || e->addr + e->size < e->addr || !span_unmap(f, e->addr, e->addr + e->size);
        break;
    default:
        break;
    }
}

static int cmp_span(const void *a, const void *b)
{
    uint64_t x = ((const struct replay_span *)a)->lo, y = ((const struct replay_span *)b)->lo;
    return x < y ? -1 : x > y;
}

bool replay_forward_ranges(const replay_forward_t *f, const start_range_t *ranges, size_t n)
{
    struct replay_span *s = malloc((n ? n : 1) * sizeof(*s));
    if (!s)
        return false;
    for (size_t i = 0; i < n; i++)
        s[i] = (struct replay_span){ranges[i].addr, ranges[i].addr + ranges[i].size};
    qsort(s, n, sizeof(*s), cmp_span);
    bool same = true;
    size_t m = 0; /* the bytes, as the mapped ranges are kept: apart, touching ones merged */
    for (size_t i = 0; i < n && same; i++) {
        same = s[i].hi > s[i].lo;
        if (m && s[i].lo <= s[m - 1].hi) {
            if (s[i].hi > s[m - 1].hi)
                s[m - 1].hi = s[i].hi;
        } else {
            s[m++] = s[i];
        }
    }
    same = same && m == f->nranges && !memcmp(s, f->ranges, m * sizeof(*s));
    free(s);
    return same;
}

void replay_forward_free(replay_forward_t *f)
{
    free(f->blocks.keys);
    free(f->ranges);
    memset(f, 0, sizeof(*f));
}
