/*
 * fuzz_ops.c - libFuzzer target: random operation sequences on the device
 * allocator over a simulated backend (2 devices, manual events, 256 MiB
 * each). The first byte picks the mode:
 *  - odd: general mode: allocations of every size class on 4 streams and 2
 *    devices, frees, record_stream, completion of a stream's events,
 *    empty_cache, memory fraction, run-time settings changes, peer access,
 *    IPC handles, fixed and serialized (frees of shared blocks deferred,
 *    references released, collection), private pools (routes by stream and thread, their end,
 *    create, release, empty_cache of a pool, a checkpoint saved and restored
 *    at once, an allocator of the pool's own (the backend's memory through
 *    the user's functions), each status checked against the pool's use count, the
 *    simulated capture graph driven for graph_capture_record_stream_reuse,
 *    on with bit 3 of the first byte), loops of large requests repeated a few
 *    times (planned under compact_memory, plan.c); after
 *    every operation the invariant checker must pass;
 *    when the first byte's second bit is set too, the same operations run
 *    with backend:cudaMallocAsync (its routes are PyTorch's graph captures
 *    of that backend: one at a time, frees of earlier allocations deferred
 *    while one is underway, pools refused); with the third bit set instead, the run
 *    starts with expandable segments on (settings changes switch them on
 *    and off in every run); outside cudaMallocAsync each device's backend
 *    memory must equal what the allocator accounts for after every operation;
 *  - even: model mode: allocations, frees and empty_cache on one stream of
 *    one device with the default settings, each also run through an
 *    independent reference model of PyTorch's policy below (rounding, pools,
 *    segment sizes, best fit by (size, address), splitting, merging, the
 *    release-and-retry on a full device); the address of every allocation
 *    served from the cache, the reserved and allocated bytes and every
 *    out-of-memory failure must match the model.
 * At the end everything is freed, the cache emptied, and the backend must
 * hold no byte, allocation or event. Any violation aborts.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "async.h"
#include "check.h"
#include "runtime.h"
#include "device.h"
#include "plan.h"

#define MiB ((size_t)1 << 20)
#define DEVICE_MEMORY (256 * MiB)
#define MAX_LIVE 256
#define MAX_OPS 512

#include "fuzz_check.h"

/* ---- the reference model (one stream, default settings) ------------------------- */

typedef struct mblock {
    uintptr_t addr;
    size_t size;
    bool free;
    bool small;   /* pool kind of its segment */
    int seg;      /* index into model.segs */
} mblock_t;

typedef struct mseg {
    uintptr_t base;
    size_t size;
    bool small;
    bool live;
} mseg_t;

static struct {
    mblock_t *blocks; /* sorted by address */
    size_t n, cap;
    mseg_t segs[4096];
    size_t nsegs;
    size_t reserved, allocated;
} model;

static void model_reset(void)
{
    free(model.blocks);
    memset(&model, 0, sizeof(model));
}

static size_t model_round(size_t size)
{
    return size < 512 ? 512 : (size + 511) / 512 * 512;
}

static size_t model_segment_size(size_t rsize)
{
    if (rsize <= MiB)
        return 2 * MiB;
    if (rsize < 10 * MiB)
        return 20 * MiB;
    return (rsize + 2 * MiB - 1) / (2 * MiB) * (2 * MiB);
}

static void model_insert_at(size_t i, mblock_t b)
{
    if (model.n == model.cap) {
        model.cap = model.cap ? model.cap * 2 : 64;
        model.blocks = realloc(model.blocks, model.cap * sizeof(*model.blocks));
        CHECK(model.blocks, "out of memory");
    }
    memmove(&model.blocks[i + 1], &model.blocks[i], (model.n - i) * sizeof(*model.blocks));
    model.blocks[i] = b;
    model.n++;
}

static void model_remove_at(size_t i)
{
    memmove(&model.blocks[i], &model.blocks[i + 1], (model.n - i - 1) * sizeof(*model.blocks));
    model.n--;
}

static size_t model_find(uintptr_t addr)
{
    for (size_t i = 0; i < model.n; i++)
        if (model.blocks[i].addr == addr)
            return i;
    return SIZE_MAX;
}

static bool model_whole_segment(size_t i)
{
    const mblock_t *b = &model.blocks[i];
    return b->addr == model.segs[b->seg].base && b->size == model.segs[b->seg].size;
}

/* Release every free block that is a whole segment (PyTorch's release_cached_blocks). */
static void model_release_cached(void)
{
    for (size_t i = 0; i < model.n;) {
        if (model.blocks[i].free && model_whole_segment(i)) {
            model.segs[model.blocks[i].seg].live = false;
            model.reserved -= model.blocks[i].size;
            model_remove_at(i);
        } else {
            i++;
        }
    }
}

/* Best fit by (size, address) among the free blocks of the pool; SIZE_MAX if none. */
static size_t model_best_fit(size_t rsize, bool small)
{
    size_t best = SIZE_MAX;
    for (size_t i = 0; i < model.n; i++) {
        const mblock_t *b = &model.blocks[i];
        if (!b->free || b->small != small || b->size < rsize)
            continue;
        if (best == SIZE_MAX || b->size < model.blocks[best].size)
            best = i; /* blocks are in address order: ties keep the lower address */
    }
    return best;
}

/* Allocate: i is the chosen free block; split per PyTorch's rule. Returns its address. */
static uintptr_t model_take(size_t i, size_t rsize)
{
    mblock_t *b = &model.blocks[i];
    size_t remaining = b->size - rsize;
    bool split = b->small ? remaining >= 512 : remaining > MiB;
    if (split) {
        mblock_t rest = *b;
        rest.addr = b->addr + rsize;
        rest.size = remaining;
        rest.free = true;
        b->size = rsize;
        model_insert_at(i + 1, rest);
        b = &model.blocks[i];
    }
    b->free = false;
    model.allocated += b->size;
    return b->addr;
}

static void model_free(uintptr_t addr)
{
    size_t i = model_find(addr);
    CHECK(i != SIZE_MAX && !model.blocks[i].free, "model: free of unknown block");
    model.blocks[i].free = true;
    model.allocated -= model.blocks[i].size;
    if (i + 1 < model.n && model.blocks[i + 1].free && model.blocks[i + 1].seg == model.blocks[i].seg) {
        model.blocks[i].size += model.blocks[i + 1].size;
        model_remove_at(i + 1);
    }
    if (i > 0 && model.blocks[i - 1].free && model.blocks[i - 1].seg == model.blocks[i].seg) {
        model.blocks[i - 1].size += model.blocks[i].size;
        model_remove_at(i);
    }
}

/* ---- driver ----------------------------------------------------------------------- */

static cca_backend_t *sim;
static void *live[MAX_LIVE];
static size_t nlive;
static const cca_stream_t streams[4] = {NULL, (cca_stream_t)0x1000, (cca_stream_t)0x2000,
                                        (cca_stream_t)0x3000};
static const char *const settings_choices[] = {
    "max_split_size_mb:40",
    "roundup_power2_divisions:4",
    "garbage_collection_threshold:0.5",
    "max_split_size_mb:40,max_non_split_rounding_mb:40",
    "expandable_segments:True",
    "compact_memory:False,expandable_segments:False",
    "expandable_segments:True,max_split_size_mb:40",
    "expandable_segments:True,large_segment_size_mb:12",
    "compact_memory:True",
};
#define SETTINGS_CHOICES (sizeof(settings_choices) / sizeof(settings_choices[0]))

typedef struct reader {
    const uint8_t *data;
    size_t size, pos;
} reader_t;

static uint8_t next_byte(reader_t *r)
{
    return r->pos < r->size ? r->data[r->pos++] : 0;
}

/* A size from every class: tiny, small pool, large pool sharing 20 MiB segments, own segments. */
static size_t next_size(reader_t *r)
{
    uint8_t cls = next_byte(r);
    size_t v = (size_t)next_byte(r) << 8 | next_byte(r);
    switch (cls % 5) {
    case 0: return 1 + v % 2048;
    case 1: return 1 + v * 16;                        /* up to 1 MiB */
    case 2: return MiB + 1 + v * 128;                 /* 1 .. 9 MiB */
    case 3: return 10 * MiB + v * 512;                /* 10 .. 42 MiB */
    default: return (size_t)(1 + cls % 8) * 512 * (1 + v % 64);
    }
}

static void check_invariants(const char *after)
{
    char why[512];
    CHECK(alloc_check_invariants(why, sizeof(why)) == CCA_OK, "after %s: %s", after, why);
}

static int64_t stat_all(const cca_stat_t *s)
{
    return s[CCA_STAT_ALL].current;
}

static void model_alloc(size_t size)
{
    size_t rsize = model_round(size);
    bool small = rsize <= MiB;
    size_t i = model_best_fit(rsize, small);
    bool fresh = i == SIZE_MAX;
    bool expect_oom = false;
    size_t segsize = model_segment_size(rsize);
    if (fresh && model.reserved + segsize > DEVICE_MEMORY) {
        model_release_cached();
        expect_oom = model.reserved + segsize > DEVICE_MEMORY;
    }
    void *p = NULL;
    cca_status_t st = cca_malloc_device(&p, size, 0, NULL);
    if (expect_oom) {
        CHECK(st == CCA_ERR_OUT_OF_MEMORY, "model predicts OOM for %zu bytes, cca says %s", size,
              cca_status_str(st));
        return;
    }
    CHECK(st == CCA_OK, "model predicts success for %zu bytes: %s", size, cca_last_error()->message);
    if (fresh) {
        uintptr_t base = (uintptr_t)p;
        for (size_t k = 0; k < model.nsegs; k++)
            CHECK(!model.segs[k].live || base + segsize <= model.segs[k].base ||
                  base >= model.segs[k].base + model.segs[k].size,
                  "new segment at %p overlaps a live one", p);
        CHECK(model.nsegs < 4096, "too many segments");
        model.segs[model.nsegs] = (mseg_t){base, segsize, small, true};
        size_t at = 0;
        while (at < model.n && model.blocks[at].addr < base)
            at++;
        model_insert_at(at, (mblock_t){base, segsize, true, small, (int)model.nsegs});
        model.nsegs++;
        model.reserved += segsize;
        i = at;
    }
    uintptr_t want = model_take(i, rsize);
    CHECK((uintptr_t)p == want, "alloc of %zu bytes: cca gave %p, the model 0x%lx", size, p,
          (unsigned long)want);
    live[nlive++] = p;
}

static void compare_with_model(void)
{
    cca_device_stats_t s;
    CHECK(cca_get_device_stats(0, &s) == CCA_OK, "stats");
    CHECK(stat_all(s.reserved_bytes) == (int64_t)model.reserved, "reserved: cca %lld, model %zu",
          (long long)stat_all(s.reserved_bytes), model.reserved);
    CHECK(stat_all(s.allocated_bytes) == (int64_t)model.allocated, "allocated: cca %lld, model %zu",
          (long long)stat_all(s.allocated_bytes), model.allocated);
}

static void run_model(reader_t *r)
{
    for (int op = 0; op < MAX_OPS && r->pos < r->size; op++) {
        uint8_t code = next_byte(r) % 8;
        if (code < 4 || nlive == 0) {
            if (nlive < MAX_LIVE)
                model_alloc(next_size(r));
        } else if (code < 7) {
            size_t i = next_byte(r) % nlive;
            CHECK(cca_free(live[i]) == CCA_OK, "free: %s", cca_last_error()->message);
            model_free((uintptr_t)live[i]);
            live[i] = live[--nlive];
        } else {
            CHECK(cca_empty_cache() == CCA_OK, "empty_cache: %s", cca_last_error()->message);
            model_release_cached();
        }
        check_invariants("a model-mode operation");
        compare_with_model();
    }
}

/* IPC handles made and not released yet. */
static cca_ipc_mem_handle_t handles[64];
static size_t nhandles;

static void release_handles(void)
{
    for (size_t i = 0; i < nhandles; i++)
        CHECK(cca_ipc_release_handle(&handles[i]) == CCA_OK, "release_handle: %s",
              cca_last_error()->message);
    nhandles = 0;
}

/* Private pools of the general mode: 3 ids per device, and which are routed. */
static bool routed[2][3];
/* Under cudaMallocAsync: whether a capture is underway (a route begun and not ended). */
static bool async_capturing;

static cca_mempool_id_t pool_id(int k)
{
    cca_mempool_id_t id = {(uint64_t)k + 1, (uint64_t)(k & 1)}; /* (1,0) (2,1) (3,0) */
    return id;
}

/* Forget a live pointer that a checkpoint restore freed. */
static void forget_live(void *p)
{
    for (size_t i = 0; i < nlive; i++)
        if (live[i] == p) {
            live[i] = live[--nlive];
            return;
        }
}

/* A pool's own allocator: the backend's memory through the user's functions, so the accounting holds. */
static void *fuzz_pool_alloc(size_t size, int device, cca_stream_t stream, void *ctx)
{
    (void)stream;
    (void)ctx;
    void *p = NULL;
    return sim->malloc(sim->ctx, device, size, &p) == CCA_OK ? p : NULL;
}

static cca_status_t fuzz_pool_free(void *ptr, size_t size, int device, cca_stream_t stream, void *ctx)
{
    (void)size;
    (void)stream;
    (void)ctx;
    return sim->free(sim->ctx, device, ptr);
}

/* One private-pool operation; its status must follow from the pool's use count. */
static const char *pool_op(uint8_t b, bool async)
{
    int d = (b >> 3) & 1, k = ((b >> 4) & 3) % 3;
    cca_mempool_id_t id = pool_id(k);
    int uc = -1;
    cca_status_t qs = cca_pool_use_count(d, id, &uc);
    if (async) {
        /* PyTorch's CudaMallocAsync: no pools; a route is a capture, one at a time */
        CHECK(qs == CCA_ERR_NOT_SUPPORTED, "pools under cudaMallocAsync: %s", cca_status_str(qs));
        cca_status_t st;
        switch (b % 4) {
        case 0:
            st = b & 0x40 ? cca_begin_allocate_thread_to_pool(d, id)
                          : cca_begin_allocate_stream_to_pool(d, id, streams[(b >> 6) & 3]);
            CHECK(st == (async_capturing ? CCA_ERR_BUSY : CCA_OK), "async begin: %s",
                  cca_status_str(st));
            async_capturing = true;
            return "cca_begin_allocate_to_pool";
        case 1:
            st = cca_end_allocate_to_pool(d, id);
            CHECK(st == (async_capturing ? CCA_OK : CCA_ERR_BUSY), "async end: %s",
                  cca_last_error()->message);
            async_capturing = false;
            return "cca_end_allocate_to_pool";
        case 2:
            CHECK(cca_release_pool(d, id) == CCA_OK, "async release: %s", cca_last_error()->message);
            return "cca_release_pool";
        default:
            CHECK(cca_empty_cache_pool(id) == CCA_OK, "async empty_cache_pool: %s",
                  cca_last_error()->message);
            return "cca_empty_cache_pool";
        }
    }
    CHECK(qs == CCA_OK || qs == CCA_ERR_INVALID_ARGUMENT, "use_count: %s", cca_last_error()->message);
    bool exists = qs == CCA_OK, freeable = exists && uc == 0;
    cca_status_t st;
    switch (b % 8) {
    case 0:
    case 1:
        st = b % 7 ? cca_begin_allocate_thread_to_pool(d, id)
                   : cca_begin_allocate_stream_to_pool(d, id, streams[(b >> 6) & 3]);
        CHECK(st == ((routed[d][k] || freeable) ? CCA_ERR_BUSY : CCA_OK), "begin: %s",
              cca_status_str(st));
        routed[d][k] |= st == CCA_OK;
        return "cca_begin_allocate_to_pool";
    case 2:
        st = cca_end_allocate_to_pool(d, id);
        CHECK(st == (routed[d][k] ? CCA_OK : CCA_ERR_BUSY), "end: %s", cca_status_str(st));
        routed[d][k] = false;
        return "cca_end_allocate_to_pool";
    case 3:
        st = cca_release_pool(d, id);
        CHECK(st == (!exists ? CCA_ERR_INVALID_ARGUMENT
                     : (freeable || (uc == 1 && routed[d][k])) ? CCA_ERR_BUSY : CCA_OK),
              "release: %s", cca_status_str(st));
        return "cca_release_pool";
    case 4:
        CHECK(cca_empty_cache_pool(id) == CCA_OK, "empty_cache_pool: %s", cca_last_error()->message);
        return "cca_empty_cache_pool";
    case 5: {
        cca_pool_state_t *state = NULL;
        st = cca_pool_get_checkpoint(d, id, &state);
        /* NOT_SUPPORTED: a pool holding expandable segments (as PyTorch) */
        CHECK(st == CCA_OK || st == CCA_ERR_BUSY || st == CCA_ERR_INVALID_ARGUMENT ||
                  st == CCA_ERR_NOT_SUPPORTED,
              "checkpoint: %s", cca_last_error()->message);
        if (st != CCA_OK)
            return "cca_pool_get_checkpoint";
        cca_checkpoint_delta_t delta;
        st = cca_pool_set_checkpoint(d, state, &delta);
        cca_pool_state_free(state);
        /* BUSY: a block of the pool is mapped by another process (an IPC handle); nothing changed */
        CHECK(st == CCA_OK || st == CCA_ERR_BUSY, "set_checkpoint: %s", cca_last_error()->message);
        if (st != CCA_OK)
            return "cca_pool_set_checkpoint";
        for (size_t i = 0; i < delta.freed_count; i++)
            forget_live(delta.freed[i]);
        for (size_t i = 0; i < delta.allocated_count; i++) {
            if (nlive < MAX_LIVE)
                live[nlive++] = delta.allocated[i];
            else
                CHECK(cca_free(delta.allocated[i]) == CCA_OK, "free");
        }
        /* restoring the state just taken changes nothing: what was freed is allocated again */
        CHECK(delta.freed_count == delta.allocated_count, "checkpoint: %zu freed, %zu allocated",
              delta.freed_count, delta.allocated_count);
        cca_checkpoint_delta_free(&delta);
        return "cca_pool_set_checkpoint";
    }
    case 7: {
        /* the simulated capture graph (graph_capture_record_stream_reuse reads it) */
        cca_stream_t s1 = streams[(b >> 6) & 3], s2 = streams[(b >> 4) & 3];
        switch ((b >> 3) & 3) {
        case 0: st = cca_sim_capture_begin(sim, s1); break;
        case 1: st = cca_sim_capture_work(sim, s1); break;
        case 2: st = cca_sim_capture_join(sim, s1, s2); break;
        default: st = cca_sim_capture_end(sim, s1); break;
        }
        CHECK(st == CCA_OK || st == CCA_ERR_INVALID_ARGUMENT, "capture graph: %s",
              cca_last_error()->message);
        return "simulated capture";
    }
    default:
        if (b >= 0xc0) {
            /* an allocator of its own: only before the pool holds memory */
            cca_private_pool_t *pp = exists ? pools_find_locked(&cca_state->devices[d], id) : NULL;
            st = cca_pool_set_allocator(d, id, fuzz_pool_alloc, fuzz_pool_free, NULL);
            CHECK(st == (!exists ? CCA_ERR_INVALID_ARGUMENT
                         : (freeable || pp->segment_count) ? CCA_ERR_BUSY : CCA_OK),
                  "set_allocator: %s", cca_status_str(st));
            return "cca_pool_set_allocator";
        }
        st = cca_pool_create(d, id);
        CHECK(st == (freeable ? CCA_ERR_BUSY : CCA_OK), "create: %s", cca_status_str(st));
        return "cca_pool_create";
    }
}

/* End every route and drop every use of the pools, so the final empty_cache frees them. */
static void release_pools(bool async)
{
    for (int i = 0; i < 4; i++)
        cca_sim_capture_end(sim, streams[i]); /* a stream not capturing: INVALID_ARGUMENT */
    if (async) {
        /* end the capture; the next allocation completes the frees it deferred */
        if (async_capturing)
            CHECK(cca_end_allocate_to_pool(0, pool_id(0)) == CCA_OK, "async end");
        async_capturing = false;
        void *p = NULL;
        cca_status_t st = cca_malloc(&p, 512, NULL); /* may exceed a memory fraction */
        CHECK(st == CCA_ERR_OUT_OF_MEMORY || (st == CCA_OK && cca_free(p) == CCA_OK),
              "async flush: %s", cca_last_error()->message);
        CHECK(async_deferred_count() == 0, "deferred frees left: %zu", async_deferred_count());
        return;
    }
    for (int d = 0; d < 2; d++)
        for (int k = 0; k < 3; k++) {
            cca_mempool_id_t id = pool_id(k);
            if (routed[d][k])
                CHECK(cca_end_allocate_to_pool(d, id) == CCA_OK, "end");
            routed[d][k] = false;
            int uc = 0;
            if (cca_pool_use_count(d, id, &uc) == CCA_OK)
                while (uc-- > 0)
                    CHECK(cca_release_pool(d, id) == CCA_OK, "release: %s", cca_last_error()->message);
        }
}

/* A loop of 16 to 31 large requests (sizes and lifetimes from the input, each block freed by
 * the loop's end) repeated 3 to 6 times on one stream: under compact_memory its pool plans it
 * (plan_test_force) and serves its later rounds at the planned places. */
static const char *loop_op(reader_t *r)
{
    uint8_t b = next_byte(r);
    int n = 16 + b % 16, rounds = 3 + (b >> 4) % 4;
    int device = (b >> 6) & 1;
    cca_stream_t stream = streams[(b >> 7) * 2];
    size_t sizes[31];
    long life[31];
    for (int k = 0; k < n; k++) {
        sizes[k] = MiB + 1 + (size_t)next_byte(r) * 64 * 1024;
        life[k] = 1 + next_byte(r) % (n - k);
    }
    void *held[62] = {NULL};
    long dies[62] = {0}, t = 0;
    for (int round = 0; round < rounds; round++)
        for (int j = 0; j < n; j++, t++) {
            for (int k = 0; k < 2 * n; k++)
                if (held[k] && dies[k] <= t) {
                    CHECK(cca_free(held[k]) == CCA_OK, "loop free: %s", cca_last_error()->message);
                    held[k] = NULL;
                }
            int slot = (int)(t % (2 * n));
            cca_status_t st = cca_malloc_device(&held[slot], sizes[j], device, stream);
            CHECK(st == CCA_OK || st == CCA_ERR_OUT_OF_MEMORY, "loop malloc: %s", cca_last_error()->message);
            if (st != CCA_OK)
                held[slot] = NULL;
            dies[slot] = t + life[j];
        }
    for (int k = 0; k < 2 * n; k++)
        if (held[k])
            CHECK(cca_free(held[k]) == CCA_OK, "loop free: %s", cca_last_error()->message);
    return "a repeated loop";
}

static void run_general(reader_t *r, bool async)
{
    for (int op = 0; op < MAX_OPS && r->pos < r->size; op++) {
        uint8_t code = next_byte(r) % 15;
        const char *what = "?";
        if (code < 4 || nlive == 0) {
            what = "cca_malloc";
            uint8_t where = next_byte(r);
            size_t size = next_size(r);
            void *p = NULL;
            cca_status_t st = cca_malloc_device(&p, size, where & 1, streams[(where >> 1) & 3]);
            CHECK(st == CCA_OK || st == CCA_ERR_OUT_OF_MEMORY, "malloc: %s", cca_last_error()->message);
            if (st == CCA_OK && nlive < MAX_LIVE)
                live[nlive++] = p;
            else if (st == CCA_OK)
                CHECK(cca_free(p) == CCA_OK, "free");
        } else if (code < 7) {
            what = "cca_free";
            size_t i = next_byte(r) % nlive;
            CHECK(cca_free(live[i]) == CCA_OK, "free: %s", cca_last_error()->message);
            live[i] = live[--nlive];
        } else if (code == 7) {
            what = "cca_record_stream";
            size_t i = next_byte(r) % nlive;
            CHECK(cca_record_stream(live[i], streams[next_byte(r) & 3]) == CCA_OK, "record_stream: %s",
                  cca_last_error()->message);
        } else if (code == 8) {
            uint8_t b = next_byte(r);
            if (b & 1) {
                what = "complete events";
                CHECK(cca_sim_complete_stream(sim, (b >> 1) & 1, streams[(b >> 2) & 3], b >= 0xc0) == CCA_OK,
                      "complete");
                CHECK(alloc_process_events() == CCA_OK, "process_events");
            } else {
                what = "cca_empty_cache";
                CHECK(cca_empty_cache() == CCA_OK, "empty_cache: %s", cca_last_error()->message);
            }
        } else if (code == 10) {
            uint8_t b = next_byte(r);
            what = "cca_enable_peer_access";
            int device = b & 1, peer = !device;
            CHECK(cca_enable_peer_access(device, peer) == CCA_OK, "peer: %s", cca_last_error()->message);
            int peers[2];
            size_t n = 0;
            CHECK(cca_peer_access_list(peer, peers, 2, &n) == CCA_OK && n == 1 && peers[0] == device,
                  "peer list of %d", peer);
        } else if (code == 14) {
            what = loop_op(r);
        } else if (code >= 12) {
            what = pool_op(next_byte(r), async);
        } else if (code == 11) {
            uint8_t b = next_byte(r);
            what = "cca_ipc_get_handle";
            size_t i = b % nlive;
            cca_ipc_mem_handle_t h;
            cca_status_t st;
            size_t len = 0, got = 0;
            if (b & 0x20) {
                /* the serialized form: its length first (no reference), a short buffer refused */
                what = "cca_ipc_get_handle_bytes";
                st = cca_ipc_handle_size(live[i], &len);
                CHECK(async ? st == CCA_ERR_NOT_SUPPORTED : st == CCA_OK && len >= CCA_IPC_HANDLE_SIZE,
                      "ipc_handle_size: %s", cca_status_str(st));
                if (st == CCA_OK) {
                    CHECK(cca_ipc_get_handle_bytes(live[i], NULL, h.bytes, len - 1, &got) ==
                              CCA_ERR_INVALID_ARGUMENT && got == len, "short buffer");
                }
                static unsigned char buf[CCA_IPC_HANDLE_SIZE + 4 * 4096];
                st = cca_ipc_get_handle_bytes(live[i], NULL, buf, sizeof(buf), &got);
                CHECK(st != CCA_OK || (got == len && got == sizeof(h.bytes)),
                      "handle length %zu, not %zu", got, len);
                if (st == CCA_OK)
                    memcpy(h.bytes, buf, sizeof(h.bytes)); /* a segment's: the fixed length */
            } else {
                st = cca_ipc_get_handle(live[i], NULL, &h);
            }
            cca_block_t *blk = async ? NULL : ptrmap_find(cca_state->ptrmap, (uintptr_t)live[i], false);
            if (async) {
                CHECK(st == CCA_ERR_NOT_SUPPORTED, "ipc under cudaMallocAsync: %s", cca_status_str(st));
            } else if (blk && blk->pool && blk->segment->es) {
                CHECK(st == CCA_ERR_NOT_SUPPORTED, "ipc of expandable memory: %s", cca_status_str(st));
            } else {
                CHECK(st == CCA_OK, "ipc_get_handle: %s", cca_last_error()->message);
                if (b & 0x80 || nhandles == 64)
                    CHECK(((b & 0x20) ? cca_ipc_release_handle_bytes(h.bytes, got)
                                      : cca_ipc_release_handle(&h)) == CCA_OK, "release_handle");
                else
                    handles[nhandles++] = h;
                if (b & 0x40) {
                    what = "cca_ipc_collect";
                    size_t pending = 0;
                    CHECK(cca_ipc_collect(&pending) == CCA_OK, "collect: %s", cca_last_error()->message);
                }
            }
        } else {
            uint8_t b = next_byte(r);
            if (b & 1) {
                what = "cca_set_memory_fraction";
                double fraction = (double)(1 + (b >> 2)) / 64.0;
                CHECK(cca_set_memory_fraction(fraction, (b >> 1) & 1) == CCA_OK, "fraction");
            } else {
                what = "cca_set_settings";
                CHECK(cca_set_settings(settings_choices[(b >> 1) % SETTINGS_CHOICES]) == CCA_OK, "settings: %s",
                      cca_last_error()->message);
            }
        }
        check_invariants(what);
        if (async)
            continue; /* the driver's pool holds memory the allocator does not count */
        cca_sim_usage_t u;
        CHECK(cca_sim_usage(sim, &u) == CCA_OK, "usage");
        for (int d = 0; d < 2; d++)
            CHECK(u.device_bytes[d] == cca_state->devices[d].total_allocated_memory,
                  "after %s: device %d: the backend holds %zu bytes, the allocator accounts for %zu",
                  what, d, u.device_bytes[d], cca_state->devices[d].total_allocated_memory);
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1)
        return 0;
    reader_t r = {data, size, 1};
    bool model_mode = (data[0] & 1) == 0;
    bool async = !model_mode && (data[0] & 2);
    cca_sim_config_t cfg = {0};
    cfg.devices = 2;
    cfg.total_memory = DEVICE_MEMORY;
    cfg.manual_events = true;
    cca_shutdown();
    CHECK(cca_sim_create(&cfg, &sim) == CCA_OK, "sim");
    /* general mode: bit 2 expandable segments, bit 3 graph_capture_record_stream_reuse */
    static const char *const general[4] = {
        "", "expandable_segments:True", "graph_capture_record_stream_reuse:True",
        "expandable_segments:True,graph_capture_record_stream_reuse:True"};
    const char *initial = async ? "backend:cudaMallocAsync"
                          : !model_mode ? general[((data[0] >> 2) & 1) | ((data[0] >> 2) & 2)]
                                        : "";
    CHECK(cca_init_with_backend(sim, initial) == CCA_OK, "init: %s", cca_last_error()->message);
    plan_test_force(true); /* (loop_op's loops planned whether they moved granules or not) */
    nlive = 0;
    nhandles = 0;
    memset(routed, 0, sizeof(routed));
    async_capturing = false;
    model_reset();
    if (model_mode)
        run_model(&r);
    else
        run_general(&r, async);
    release_pools(async || model_mode);
    for (size_t i = 0; i < nlive; i++)
        CHECK(cca_free(live[i]) == CCA_OK, "final free: %s", cca_last_error()->message);
    nlive = 0;
    release_handles();
    size_t pending = 1;
    CHECK(cca_ipc_collect(&pending) == CCA_OK && pending == 0, "final collect: %zu left", pending);
    CHECK(cca_sim_complete_stream(sim, 0, NULL, true) == CCA_OK, "complete");
    CHECK(cca_sim_complete_stream(sim, 1, NULL, true) == CCA_OK, "complete");
    CHECK(cca_empty_cache() == CCA_OK, "final empty_cache: %s", cca_last_error()->message);
    check_invariants("the final empty_cache");
    cca_sim_usage_t u;
    CHECK(cca_sim_usage(sim, &u) == CCA_OK, "usage");
    CHECK(u.device_bytes[0] == 0 && u.device_bytes[1] == 0 && u.live_allocations == 0 &&
          u.live_events == 0,
          "left behind: %zu + %zu bytes, %llu allocations, %llu events", u.device_bytes[0],
          u.device_bytes[1], (unsigned long long)u.live_allocations, (unsigned long long)u.live_events);
    cca_shutdown();
    model_reset();
    return 0;
}
