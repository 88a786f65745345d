/*
 * trace.c - the allocation history: a ring buffer of entries, the user
 * context attached to them, trace trackers, and annotations.
 *
 * Invariant: while recording is on, the ring holds the last `capacity`
 * entries in the order they happened (one global sequence under trace_lock,
 * so entries of all devices and threads interleave correctly). trace_lock is
 * a leaf lock: it is taken inside the allocator's locks and takes none.
 *
 * The user context is gathered before the allocator takes any lock (the
 * callback may need locks of its own), held in a thread-local reference, and
 * picked up by the entries this thread records until it is released. The
 * context of each live allocation (level STATE and up) is kept in a small
 * table keyed by (device, address) until its free completes, for snapshots
 * and for the free entries.
 */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "trace.h"
#include "trace_ring.h"

atomic_bool cca_trace_active;
atomic_int cca_trace_context_level;

/* A live allocation's context. */
typedef struct live_ctx {
    int device;
    uintptr_t addr;
    trace_ctx_t *context;
    struct live_ctx *next;
} live_ctx_t;

#define LIVE_BUCKETS 4096

/* A registered tracker. */
typedef struct tracker {
    cca_trace_tracker_fn fn;
    void *arg;
} tracker_t;

static pthread_mutex_t trace_lock = PTHREAD_MUTEX_INITIALIZER;
static trace_ring_t ring;
static bool history_on;                /* recording into the ring */
static cca_context_fn context_fn;      /* the user's context callback */
static void *context_arg;
static int context_level;              /* cca_record_context_t */
static live_ctx_t *live[LIVE_BUCKETS]; /* contexts of live allocations */
/* contexts of the allocations that created segments, by the segment's first address (PyTorch's
 * context_when_segment_allocated): set by segment_alloc, and by segment_map where none is */
static live_ctx_t *segs[LIVE_BUCKETS];
static tracker_t *trackers;
static size_t tracker_count;
/* PyTorch's compile contexts (a stack per device) and user metadata (one per device) */
static trace_ctx_t **compile_stack[CCA_MAX_DEVICES];
static size_t compile_depth[CCA_MAX_DEVICES], compile_cap[CCA_MAX_DEVICES];
static trace_ctx_t *user_md[CCA_MAX_DEVICES];

/* The context gathered by this thread for its current call, or NULL. */
static _Thread_local trace_ctx_t *thread_ctx;
static _Thread_local int thread_ctx_level;

static const char *const action_names[CCA_TRACE_ACTION_COUNT] = {
    "alloc", "free_requested", "free_completed", "segment_alloc", "segment_free",
    "segment_map", "segment_unmap", "snapshot", "oom", "user_defined",
};

const char *trace_action_name(cca_trace_action_t action)
{
    return (unsigned)action < CCA_TRACE_ACTION_COUNT ? action_names[action] : "unknown";
}

const char *cca_trace_action_name(cca_trace_action_t action)
{
    return trace_action_name(action);
}

/* ---- context strings -------------------------------------------------------- */

static trace_ctx_t *ctx_new(const char *text)
{
    size_t len = strlen(text);
    trace_ctx_t *c = malloc(sizeof(*c) + len + 1);
    if (!c)
        return NULL;
    atomic_init(&c->refs, 1);
    c->notify = false;
    memcpy(c->text, text, len + 1);
    return c;
}

static trace_ctx_t *ctx_ref(trace_ctx_t *c)
{
    if (c)
        atomic_fetch_add_explicit(&c->refs, 1, memory_order_relaxed);
    return c;
}

/* Told when a context string is dropped (cca_set_context_release). */
static _Atomic(cca_context_release_fn) context_release_fn;
static void *_Atomic context_release_arg;

static void ctx_unref(trace_ctx_t *c)
{
    if (c && atomic_fetch_sub_explicit(&c->refs, 1, memory_order_acq_rel) == 1) {
        cca_context_release_fn fn = atomic_load_explicit(&context_release_fn, memory_order_acquire);
        if (fn && c->notify) /* (not an annotation's, compile context's or metadata's text) */
            fn(c->text, atomic_load_explicit(&context_release_arg, memory_order_relaxed));
        free(c);
    }
}

void cca_set_context_release(cca_context_release_fn fn, void *arg)
{
    atomic_store_explicit(&context_release_arg, arg, memory_order_relaxed);
    atomic_store_explicit(&context_release_fn, fn, memory_order_release);
}

bool trace_context_gather_slow(int level)
{
    pthread_mutex_lock(&trace_lock);
    cca_context_fn fn = context_fn;
    void *arg = context_arg;
    int current = context_level;
    pthread_mutex_unlock(&trace_lock);
    if (!fn || current < level)
        return false;
    const char *text = fn(arg);
    if (!text)
        return false;
    trace_ctx_t *c = ctx_new(text);
    if (!c)
        return false; /* the context is an aid: without memory, the entry goes without */
    c->notify = true;
    ctx_unref(thread_ctx);
    thread_ctx = c;
    thread_ctx_level = level;
    return true;
}

void trace_context_release(void)
{
    ctx_unref(thread_ctx);
    thread_ctx = NULL;
}

/* ---- the live-allocation table (trace_lock held) ------------------------------ */

static size_t live_bucket(int device, uintptr_t addr)
{
    uint64_t x = (uint64_t)addr ^ ((uint64_t)(unsigned)device << 56);
    x ^= x >> 29;
    x *= 0xbf58476d1ce4e5b9ull;
    x ^= x >> 32;
    return (size_t)(x & (LIVE_BUCKETS - 1));
}

static live_ctx_t **table_find_locked(live_ctx_t **table, int device, uintptr_t addr)
{
    live_ctx_t **link = &table[live_bucket(device, addr)];
    while (*link && !((*link)->device == device && (*link)->addr == addr))
        link = &(*link)->next;
    return link;
}

static live_ctx_t **live_find_locked(int device, uintptr_t addr)
{
    return table_find_locked(live, device, addr);
}

static void table_put_locked(live_ctx_t **table, int device, uintptr_t addr, trace_ctx_t *c)
{
    live_ctx_t **link = table_find_locked(table, device, addr);
    if (*link) {
        ctx_unref((*link)->context);
        (*link)->context = ctx_ref(c);
        return;
    }
    live_ctx_t *l = malloc(sizeof(*l));
    if (!l)
        return;
    l->device = device;
    l->addr = addr;
    l->context = ctx_ref(c);
    l->next = NULL;
    *link = l;
}

/* Drop the entries of table on device within [addr, addr + size) (all of them: device -1). */
static void table_drop_locked(live_ctx_t **table, int device, uintptr_t addr, size_t size)
{
    for (size_t i = 0; i < LIVE_BUCKETS; i++) {
        live_ctx_t **link = &table[i];
        while (*link) {
            live_ctx_t *l = *link;
            if (device < 0 || (l->device == device && l->addr >= addr && l->addr - addr < size)) {
                *link = l->next;
                ctx_unref(l->context);
                free(l);
            } else {
                link = &l->next;
            }
        }
    }
}

static void live_clear_locked(void)
{
    table_drop_locked(live, -1, 0, 0);
    table_drop_locked(segs, -1, 0, 0);
}

static _Atomic long copies_countdown; /* tests (trace_test_fail_copies) */

void trace_test_fail_copies(long n)
{
    atomic_store_explicit(&copies_countdown, n, memory_order_relaxed);
}

bool trace_block_context(int device, uintptr_t addr, char **out)
{
    char *copy = NULL;
    bool ok = true;
    pthread_mutex_lock(&trace_lock);
    live_ctx_t *l = *live_find_locked(device, addr);
    if (l && l->context) {
        copy = cca_countdown_hit(&copies_countdown) ? NULL : strdup(l->context->text);
        ok = copy != NULL; /* a block with a context never reads as one without */
    }
    pthread_mutex_unlock(&trace_lock);
    *out = copy;
    return ok;
}

bool trace_segment_context(int device, uintptr_t addr, char **out)
{
    char *copy = NULL;
    bool ok = true;
    pthread_mutex_lock(&trace_lock);
    live_ctx_t *l = *table_find_locked(segs, device, addr);
    if (l && l->context) {
        copy = cca_countdown_hit(&copies_countdown) ? NULL : strdup(l->context->text);
        ok = copy != NULL;
    }
    pthread_mutex_unlock(&trace_lock);
    *out = copy;
    return ok;
}

/* ---- recording ------------------------------------------------------------------ */

static void update_active_locked(void)
{
    atomic_store_explicit(&cca_trace_active, history_on || tracker_count > 0, memory_order_relaxed);
    atomic_store_explicit(&cca_trace_context_level, history_on && context_fn ? context_level : 0,
                          memory_order_relaxed);
}

/* The context an entry carries (PyTorch's rules), as a borrowed pointer. */
static trace_ctx_t *entry_context_locked(int device, cca_trace_action_t action, uintptr_t addr)
{
    trace_ctx_t *own = thread_ctx;
    if (own && context_level >= CCA_RECORD_CONTEXT_STATE) {
        if (action == CCA_TRACE_ALLOC)
            table_put_locked(live, device, addr, own);
        else if (action == CCA_TRACE_SEGMENT_ALLOC ||
                 (action == CCA_TRACE_SEGMENT_MAP && !*table_find_locked(segs, device, addr)))
            table_put_locked(segs, device, addr, own);
    }
    if (context_level < CCA_RECORD_CONTEXT_ALLOC)
        return NULL;
    switch (action) {
    case CCA_TRACE_FREE_REQUESTED:
        if (own && thread_ctx_level >= CCA_RECORD_CONTEXT_ALL)
            return own;
        __attribute__((fallthrough)); /* else the allocation's context */
    case CCA_TRACE_FREE_COMPLETED: {
        live_ctx_t *l = *live_find_locked(device, addr);
        return l ? l->context : NULL;
    }
    default:
        return own;
    }
}

/* Append one entry and call the trackers (trace_lock held). */
static void ring_grow_locked(void);

static void record_locked(int device, cca_trace_action_t action, uintptr_t addr, size_t size,
                          cca_stream_t stream, trace_ctx_t *context, cca_mempool_id_t pool)
{
    int64_t now = cca_wall_us();
    bool known = device >= 0 && device < CCA_MAX_DEVICES;
    trace_ctx_t *compile =
        known && compile_depth[device] ? compile_stack[device][compile_depth[device] - 1] : NULL;
    trace_ctx_t *md = known ? user_md[device] : NULL;
    if (tracker_count) {
        cca_trace_entry_t pub = {action, device, (uint64_t)addr, size, stream, now,
                                 context ? context->text : NULL, compile ? compile->text : NULL,
                                 md ? md->text : NULL, pool};
        for (size_t i = 0; i < tracker_count; i++)
            trackers[i].fn(&pub, trackers[i].arg);
    }
    if (!history_on || !ring.capacity)
        return;
    if (ring.count == ring.capacity && ring.capacity < ring.bound)
        ring_grow_locked();
    trace_entry_t *e = &ring.entries[ring.next];
    ctx_unref(e->context);
    ctx_unref(e->compile);
    ctx_unref(e->user_md);
    e->action = action;
    e->device = device;
    e->addr = addr;
    e->size = size;
    e->stream = stream;
    e->time_us = now;
    e->context = ctx_ref(context);
    e->compile = ctx_ref(compile);
    e->user_md = ctx_ref(md);
    e->pool = pool;
    ring.next = (ring.next + 1) % ring.capacity;
    if (ring.count < ring.capacity)
        ring.count++;
    ring.total++;
}

void trace_record_slow(int device, cca_trace_action_t action, uintptr_t addr, size_t size,
                       cca_stream_t stream, cca_mempool_id_t pool)
{
    pthread_mutex_lock(&trace_lock);
    trace_ctx_t *context = NULL;
    live_ctx_t **link = NULL;
    if (history_on && context_level > CCA_RECORD_CONTEXT_NEVER) {
        context = entry_context_locked(device, action, addr);
        if (action == CCA_TRACE_FREE_COMPLETED)
            link = live_find_locked(device, addr);
    }
    record_locked(device, action, addr, size, stream, context, pool);
    if (action == CCA_TRACE_SEGMENT_FREE) { /* the segment's context goes with it */
        live_ctx_t **seg = table_find_locked(segs, device, addr);
        if (*seg) {
            live_ctx_t *l = *seg;
            *seg = l->next;
            ctx_unref(l->context);
            free(l);
        }
    } else if (action == CCA_TRACE_SEGMENT_UNMAP && history_on && context_level > CCA_RECORD_CONTEXT_NEVER) {
        /* (rare: empty_cache, out of memory) a range mapped again later takes the context
         * of that mapping, where PyTorch keeps a segment's first context through its unmap */
        table_drop_locked(segs, device, addr, size);
    }
    if (link && *link) {
        live_ctx_t *l = *link;
        *link = l->next;
        ctx_unref(l->context);
        free(l);
    }
    pthread_mutex_unlock(&trace_lock);
}

/* ---- the ring ------------------------------------------------------------------- */

static void ring_free_locked(void)
{
    for (size_t i = 0; i < ring.capacity; i++) {
        ctx_unref(ring.entries[i].context);
        ctx_unref(ring.entries[i].compile);
        ctx_unref(ring.entries[i].user_md);
    }
    free(ring.entries);
    memset(&ring, 0, sizeof(ring));
}

/* Slots first allocated for a history (more as entries come, up to its bound). */
#define RING_FIRST_SLOTS 1024

/*
 * The ring is full below its bound: double its slots (at most to the bound). It has
 * not wrapped (trace_ring_t), so the entries stay where they are and the next one
 * goes after them. Out of host memory: the bound becomes the slots held, and the
 * ring keeps the newest entries from then on.
 */
static void ring_grow_locked(void)
{
    size_t slots = ring.capacity <= ring.bound / 2 ? ring.capacity * 2 : ring.bound;
    trace_entry_t *entries = NULL;
    if (slots <= SIZE_MAX / sizeof(*entries))
        entries = realloc(ring.entries, slots * sizeof(*entries));
    if (!entries) {
        ring.bound = ring.capacity;
        return;
    }
    memset(entries + ring.capacity, 0, (slots - ring.capacity) * sizeof(*entries));
    ring.next = ring.capacity;
    ring.entries = entries;
    ring.capacity = slots;
}

cca_status_t trace_enable(size_t bound)
{
    if (bound == 0)
        bound = 1;
    pthread_mutex_lock(&trace_lock);
    if (ring.capacity && ring.bound == bound) {
        history_on = true;
        update_active_locked();
        pthread_mutex_unlock(&trace_lock);
        return CCA_OK;
    }
    /* keep the newest entries that fit, in a ring of their number of slots or more */
    size_t keep = ring.count < bound ? ring.count : bound;
    size_t slots = bound < RING_FIRST_SLOTS ? bound : RING_FIRST_SLOTS;
    if (slots < keep)
        slots = keep;
    trace_entry_t *entries = calloc(slots, sizeof(*entries));
    if (!entries) {
        pthread_mutex_unlock(&trace_lock);
        return cca_raise(CCA_ERR_OUT_OF_MEMORY, "out of host memory for %zu history entries", slots);
    }
    size_t first = ring.capacity ? (ring.next + ring.capacity - keep) % ring.capacity : 0;
    for (size_t i = 0; i < keep; i++) {
        trace_entry_t *src = &ring.entries[(first + i) % ring.capacity];
        entries[i] = *src;
        src->context = src->compile = src->user_md = NULL;
    }
    uint64_t total = ring.total;
    ring_free_locked();
    ring.entries = entries;
    ring.capacity = slots;
    ring.bound = bound;
    ring.count = keep;
    ring.next = keep % slots;
    ring.total = total;
    history_on = true;
    update_active_locked();
    pthread_mutex_unlock(&trace_lock);
    return CCA_OK;
}

void trace_disable(void)
{
    pthread_mutex_lock(&trace_lock);
    history_on = false;
    context_fn = NULL;
    context_arg = NULL;
    context_level = CCA_RECORD_CONTEXT_NEVER;
    ring_free_locked();
    live_clear_locked();
    update_active_locked();
    pthread_mutex_unlock(&trace_lock);
}

/* ---- public API --------------------------------------------------------------------- */

cca_status_t trace_record_history(bool enabled, cca_context_fn fn, void *arg, size_t max_entries,
                                  cca_record_context_t when, bool refused)
{
    if ((int)when < CCA_RECORD_CONTEXT_NEVER || (int)when > CCA_RECORD_CONTEXT_ALL)
        return cca_raise(CCA_ERR_INVALID_ARGUMENT, "cca_record_history: context level %d is not one of "
                         "NEVER (0), STATE (1), ALLOC (2), ALL (3)", (int)when);
    if (!enabled) {
        trace_disable();
        return CCA_OK;
    }
    if (refused) /* the backend's pool places blocks: nothing to record (PyTorch's error) */
        return cca_raise(CCA_ERR_NOT_SUPPORTED, "cudaMallocAsync does not yet support recordHistory. "
                         "If you need it, please file an issue describing your use case.");
    if (when != CCA_RECORD_CONTEXT_NEVER && !fn)
        return cca_raise(CCA_ERR_INVALID_ARGUMENT,
                         "cca_record_history: a context level above NEVER needs a context function");
    cca_status_t st = trace_enable(max_entries);
    if (st != CCA_OK)
        return st;
    pthread_mutex_lock(&trace_lock);
    context_fn = when == CCA_RECORD_CONTEXT_NEVER ? NULL : fn;
    context_arg = arg;
    context_level = (int)when;
    if (context_level == CCA_RECORD_CONTEXT_NEVER)
        live_clear_locked();
    update_active_locked();
    pthread_mutex_unlock(&trace_lock);
    return CCA_OK;
}

bool cca_history_enabled(void)
{
    pthread_mutex_lock(&trace_lock);
    bool on = history_on;
    pthread_mutex_unlock(&trace_lock);
    return on;
}

/*
 * An annotation's context: its name (the value of "name", else "") as the text, then
 * after the text's NUL each field as key NUL value NUL, then an empty key. Every
 * user_defined entry has one (cca_trace_entry_field reads past the text only there).
 */
static trace_ctx_t *ctx_new_annotation(const char *const *keys, const char *const *values, size_t count)
{
    const char *name = "";
    size_t bytes = 1; /* the closing empty key */
    for (size_t i = 0; i < count; i++) {
        if (!strcmp(keys[i], "name") && !*name)
            name = values[i];
        bytes += strlen(keys[i]) + 1 + strlen(values[i]) + 1;
    }
    size_t name_len = strlen(name) + 1;
    trace_ctx_t *c = malloc(sizeof(*c) + name_len + bytes);
    if (!c)
        return NULL;
    atomic_init(&c->refs, 1);
    c->notify = false;
    char *p = c->text;
    memcpy(p, name, name_len);
    p += name_len;
    for (size_t i = 0; i < count; i++) {
        size_t k = strlen(keys[i]) + 1, v = strlen(values[i]) + 1;
        memcpy(p, keys[i], k);
        memcpy(p + k, values[i], v);
        p += k + v;
    }
    *p = '\0';
    return c;
}

/* The bytes of an entry's context to copy: an annotation's fields too. */
static size_t ctx_bytes(cca_trace_action_t action, const char *text)
{
    size_t n = strlen(text) + 1;
    if (action != CCA_TRACE_USER_DEFINED)
        return n;
    while (text[n]) { /* key, value */
        n += strlen(text + n) + 1;
        n += strlen(text + n) + 1;
    }
    return n + 1;
}

bool cca_trace_entry_field_at(const cca_trace_entry_t *entry, size_t i, const char **key, const char **value)
{
    if (!entry || !key || !value || entry->action != CCA_TRACE_USER_DEFINED || !entry->context)
        return false;
    const char *p = entry->context + strlen(entry->context) + 1;
    for (size_t k = 0; *p; k++) {
        const char *v = p + strlen(p) + 1;
        if (k == i) {
            *key = p;
            *value = v;
            return true;
        }
        p = v + strlen(v) + 1;
    }
    return false;
}

const char *cca_trace_entry_field(const cca_trace_entry_t *entry, const char *key)
{
    const char *k, *v;
    for (size_t i = 0; key && cca_trace_entry_field_at(entry, i, &k, &v); i++)
        if (!strcmp(k, key))
            return v;
    return NULL;
}

/* The calling thread's current device, checked against the table's size. */
cca_status_t trace_record_annotation(const char *const *keys, const char *const *values, size_t count,
                                     trace_device_fn device_fn)
{
    if (count && (!keys || !values))
        return cca_raise(CCA_ERR_INVALID_ARGUMENT, "cca_record_annotation_fields: %s is NULL",
                         !keys ? "keys" : "values");
    for (size_t i = 0; i < count; i++) {
        if (!keys[i] || !*keys[i])
            return cca_raise(CCA_ERR_INVALID_ARGUMENT, "cca_record_annotation_fields: key %zu is %s", i,
                             keys[i] ? "empty" : "NULL");
        if (!values[i])
            return cca_raise(CCA_ERR_INVALID_ARGUMENT,
                             "cca_record_annotation_fields: the value of key '%s' is NULL", keys[i]);
    }
    if (!atomic_load_explicit(&cca_trace_active, memory_order_relaxed))
        return CCA_OK;
    int device = 0; /* on the current device, as PyTorch 2.11's; device 0 before initialisation */
    cca_status_t st = device_fn("cca_record_annotation_fields", &device);
    if (st != CCA_OK)
        return st;
    trace_ctx_t *c = ctx_new_annotation(keys, values, count);
    if (!c)
        return cca_raise(CCA_ERR_OUT_OF_MEMORY, "out of host memory recording an annotation");
    pthread_mutex_lock(&trace_lock);
    record_locked(device, CCA_TRACE_USER_DEFINED, 0, 0, NULL, c, (cca_mempool_id_t){0, 0});
    pthread_mutex_unlock(&trace_lock);
    ctx_unref(c);
    return CCA_OK;
}

cca_status_t cca_history_get(cca_trace_entry_t **out, size_t *count)
{
    if (!out || !count)
        return cca_raise(CCA_ERR_INVALID_ARGUMENT, "cca_history_get: entries and count are required");
    pthread_mutex_lock(&trace_lock);
    size_t n = ring.count;
    size_t first = ring.capacity ? (ring.next + ring.capacity - n) % ring.capacity : 0;
    size_t bytes = (n ? n : 1) * sizeof(cca_trace_entry_t);
    for (size_t i = 0; i < n; i++) {
        const trace_entry_t *e = &ring.entries[(first + i) % ring.capacity];
        if (e->context)
            bytes += ctx_bytes(e->action, e->context->text);
        if (e->compile)
            bytes += strlen(e->compile->text) + 1;
        if (e->user_md)
            bytes += strlen(e->user_md->text) + 1;
    }
    cca_trace_entry_t *copy = malloc(bytes);
    if (!copy) {
        pthread_mutex_unlock(&trace_lock);
        return cca_raise(CCA_ERR_OUT_OF_MEMORY, "out of host memory copying the history");
    }
    char *strings = (char *)(copy + (n ? n : 1));
    for (size_t i = 0; i < n; i++) {
        const trace_entry_t *e = &ring.entries[(first + i) % ring.capacity];
        copy[i] = (cca_trace_entry_t){e->action, e->device, (uint64_t)e->addr, e->size,
                                      e->stream, e->time_us, NULL, NULL, NULL, e->pool};
        if (e->context) {
            size_t len = ctx_bytes(e->action, e->context->text);
            memcpy(strings, e->context->text, len);
            copy[i].context = strings;
            strings += len;
        }
        const trace_ctx_t *more[2] = {e->compile, e->user_md};
        const char **to[2] = {&copy[i].compile_context, &copy[i].user_metadata};
        for (int k = 0; k < 2; k++)
            if (more[k]) {
                size_t len = strlen(more[k]->text) + 1;
                memcpy(strings, more[k]->text, len);
                *to[k] = strings;
                strings += len;
            }
    }
    pthread_mutex_unlock(&trace_lock);
    *out = copy;
    *count = n;
    return CCA_OK;
}

void cca_history_free(cca_trace_entry_t *entries)
{
    free(entries);
}

cca_status_t cca_attach_trace_tracker(cca_trace_tracker_fn fn, void *arg)
{
    if (!fn)
        return cca_raise(CCA_ERR_INVALID_ARGUMENT, "cca_attach_trace_tracker: fn is NULL");
    pthread_mutex_lock(&trace_lock);
    tracker_t *list = realloc(trackers, (tracker_count + 1) * sizeof(*list));
    if (!list) {
        pthread_mutex_unlock(&trace_lock);
        return cca_raise(CCA_ERR_OUT_OF_MEMORY, "out of host memory attaching a trace tracker");
    }
    list[tracker_count++] = (tracker_t){fn, arg};
    trackers = list;
    update_active_locked();
    pthread_mutex_unlock(&trace_lock);
    return CCA_OK;
}

cca_status_t cca_detach_trace_tracker(cca_trace_tracker_fn fn, void *arg)
{
    pthread_mutex_lock(&trace_lock);
    for (size_t i = 0; i < tracker_count; i++) {
        if (trackers[i].fn == fn && trackers[i].arg == arg) {
            memmove(&trackers[i], &trackers[i + 1], (tracker_count - i - 1) * sizeof(*trackers));
            if (--tracker_count == 0) {
                free(trackers);
                trackers = NULL;
            }
            update_active_locked();
            pthread_mutex_unlock(&trace_lock);
            return CCA_OK;
        }
    }
    pthread_mutex_unlock(&trace_lock);
    return cca_raise(CCA_ERR_INVALID_ARGUMENT, "cca_detach_trace_tracker: no such tracker is attached");
}

/* ---- compile contexts and user metadata ------------------------------------------------- */

cca_status_t trace_push_compile_context(const char *context, trace_device_fn device_fn)
{
    if (!context)
        return cca_raise(CCA_ERR_INVALID_ARGUMENT, "cca_push_compile_context: context is NULL");
    int d;
    cca_status_t st = device_fn("cca_push_compile_context", &d);
    if (st != CCA_OK)
        return st;
    trace_ctx_t *c = ctx_new(context);
    if (!c)
        return cca_raise(CCA_ERR_OUT_OF_MEMORY, "out of host memory recording a compile context");
    pthread_mutex_lock(&trace_lock);
    if (!history_on) { /* PyTorch keeps none while it records no history */
        pthread_mutex_unlock(&trace_lock);
        ctx_unref(c);
        return CCA_OK;
    }
    if (compile_depth[d] == compile_cap[d]) {
        size_t cap = compile_cap[d] ? 2 * compile_cap[d] : 8;
        trace_ctx_t **grown = realloc(compile_stack[d], cap * sizeof(*grown));
        if (!grown) {
            pthread_mutex_unlock(&trace_lock);
            ctx_unref(c);
            return cca_raise(CCA_ERR_OUT_OF_MEMORY, "out of host memory recording a compile context");
        }
        compile_stack[d] = grown;
        compile_cap[d] = cap;
    }
    compile_stack[d][compile_depth[d]++] = c;
    pthread_mutex_unlock(&trace_lock);
    return CCA_OK;
}

cca_status_t trace_pop_compile_context(trace_device_fn device_fn)
{
    int d;
    cca_status_t st = device_fn("cca_pop_compile_context", &d);
    if (st != CCA_OK)
        return st;
    trace_ctx_t *top = NULL;
    pthread_mutex_lock(&trace_lock);
    if (history_on && compile_depth[d])
        top = compile_stack[d][--compile_depth[d]];
    pthread_mutex_unlock(&trace_lock);
    ctx_unref(top);
    return CCA_OK;
}

cca_status_t trace_set_user_metadata(const char *metadata, trace_device_fn device_fn)
{
    if (!metadata)
        return cca_raise(CCA_ERR_INVALID_ARGUMENT, "cca_set_user_metadata: metadata is NULL");
    int d;
    cca_status_t st = device_fn("cca_set_user_metadata", &d);
    if (st != CCA_OK)
        return st;
    trace_ctx_t *c = ctx_new(metadata);
    if (!c)
        return cca_raise(CCA_ERR_OUT_OF_MEMORY, "out of host memory keeping the user metadata");
    pthread_mutex_lock(&trace_lock);
    trace_ctx_t *old = user_md[d];
    user_md[d] = c;
    pthread_mutex_unlock(&trace_lock);
    ctx_unref(old);
    return CCA_OK;
}

cca_status_t trace_get_user_metadata(char **metadata, trace_device_fn device_fn)
{
    if (!metadata)
        return cca_raise(CCA_ERR_INVALID_ARGUMENT, "cca_get_user_metadata: metadata is NULL");
    int d;
    cca_status_t st = device_fn("cca_get_user_metadata", &d);
    if (st != CCA_OK)
        return st;
    pthread_mutex_lock(&trace_lock);
    char *copy = strdup(user_md[d] ? user_md[d]->text : "");
    pthread_mutex_unlock(&trace_lock);
    if (!copy)
        return cca_raise(CCA_ERR_OUT_OF_MEMORY, "out of host memory copying the user metadata");
    *metadata = copy;
    return CCA_OK;
}
