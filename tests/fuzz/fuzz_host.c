/*
 * fuzz_host.c - libFuzzer target for the pinned host allocator on the
 * simulated backend (manual events): allocations of every size class (the
 * reserve segment and the page-rounded sizes past the round threshold
 * included), frees, uses recorded on three streams through interior
 * pointers, streams entering and leaving a capture, completion of a stream's
 * events, empty_cache, and the run-time switch of its settings. Each input
 * byte picks an operation.
 *
 * A model keeps each live block's bytes (filled with a tag at allocation,
 * checked at free: no block is handed out twice) and, once freed, the blocks
 * a capture used (host_record_event while their stream was captured) or that
 * were freed while a stream they were used on was captured: those must never
 * be handed out again, nor given back before the allocator goes. After every operation the allocator must be valid and its
 * statistics must hold the live and kept blocks; at the end everything is
 * freed and destroying the allocator must give the backend every byte and
 * event back. Any violation aborts.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cca_backend.h"
#include "host.h"
#include "settings.h"

#include "fuzz_check.h"

enum { SLOTS = 32, MAX_KEPT = 256, STREAMS = 3 };

typedef struct slot {
    unsigned char *ptr;
    size_t size;
    unsigned char tag;
    bool captured;   /* a use was recorded while its stream was captured */
    unsigned used;   /* the streams its uses were recorded on (bit i: stream_of(i)) */
} slot_t;

static cca_stream_t stream_of(unsigned i)
{
    return (cca_stream_t)(uintptr_t)(0x100 + i % STREAMS);
}

static size_t size_of(uint8_t a, uint8_t b)
{
    switch (a % 4) {
    case 0: return 1 + b;                             /* small: the reserve segment */
    case 1: return ((size_t)1 << (b % 18)) + (a >> 2); /* every class up to 256 KiB */
    case 2: return (size_t)(1 + b % 8) << 20;          /* MiB sizes, page-rounded past the threshold */
    default: return (size_t)4096 * (1 + b);
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    cca_sim_config_t cfg = {0};
    cfg.manual_events = true;
    cca_backend_t *be = NULL;
    CHECK(cca_sim_create(&cfg, &be) == CCA_OK, "sim: %s", cca_last_error()->message);
    cca_settings_t s;
    settings_default(&s);
    s.pinned_reserve_segment_size = 64 * 1024;
    s.pinned_max_round_threshold = 1 << 20;
    host_alloc_t *h = NULL;
    CHECK(host_create(be, &s, &h) == CCA_OK, "host_create: %s", cca_last_error()->message);

    slot_t slots[SLOTS] = {{0}};
    void *kept[MAX_KEPT];
    size_t nkept = 0;
    bool capturing[STREAMS] = {false};
    size_t pos = 0;
#define NEXT() (pos < size ? data[pos++] : 0)
    for (int steps = 0; pos < size && steps < 512; steps++) {
        uint8_t op = NEXT();
        slot_t *sl = &slots[(op >> 3) % SLOTS];
        switch (op % 8) {
        case 0:
        case 1: { /* allocate into a free slot */
            if (sl->ptr)
                break;
            uint8_t a = NEXT(), b = NEXT();
            size_t bytes = size_of(a, b);
            void *p = NULL;
            CHECK(host_malloc(h, &p, bytes) == CCA_OK, "malloc %zu: %s", bytes, cca_last_error()->message);
            for (size_t k = 0; k < nkept; k++)
                CHECK(p != kept[k], "a block a capture used was handed out again (%p)", p);
            for (size_t k = 0; k < SLOTS; k++)
                CHECK(slots[k].ptr != p, "a live block was handed out again (%p)", p);
            sl->ptr = p;
            sl->size = bytes;
            sl->tag = (uint8_t)(a ^ b ^ steps);
            sl->captured = false;
            sl->used = 0;
            memset(p, sl->tag, bytes);
            break;
        }
        case 2: { /* free */
            if (!sl->ptr)
                break;
            CHECK(sl->ptr[0] == sl->tag && sl->ptr[sl->size - 1] == sl->tag && sl->ptr[sl->size / 2] == sl->tag,
                  "a live block's bytes changed");
            CHECK(host_release_ptr(h, sl->ptr) == CCA_OK, "free: %s", cca_last_error()->message);
            for (unsigned i = 0; i < STREAMS; i++) /* freed while a stream it was used on is captured */
                sl->captured |= (sl->used >> i & 1) && capturing[i];
            if (sl->captured && nkept < MAX_KEPT)
                kept[nkept++] = sl->ptr;
            CHECK(host_release_ptr(h, sl->ptr) == CCA_ERR_INVALID_POINTER, "a second free accepted");
            sl->ptr = NULL;
            break;
        }
        case 3: { /* a use on a stream, through an interior pointer */
            if (!sl->ptr)
                break;
            unsigned st = NEXT();
            size_t off = sl->size > 1 ? NEXT() % sl->size : 0;
            CHECK(host_record_event(h, sl->ptr + off, stream_of(st)) == CCA_OK, "record: %s",
                  cca_last_error()->message);
            sl->captured |= capturing[st % STREAMS];
            sl->used |= 1u << (st % STREAMS);
            break;
        }
        case 4: { /* a stream enters or leaves a capture */
            unsigned st = (op >> 3) % STREAMS;
            capturing[st] = !capturing[st];
            CHECK(cca_sim_set_capturing(be, stream_of(st), capturing[st]) == CCA_OK, "set_capturing");
            break;
        }
        case 5: /* a stream's work completes */
            (void)cca_sim_complete_stream(be, 0, stream_of((op >> 3) % STREAMS), false);
            break;
        case 6:
            CHECK(host_empty_cache(h) == CCA_OK, "empty_cache: %s", cca_last_error()->message);
            break;
        default: { /* the settings switched at run time */
            s.pinned_max_cached_size = (op >> 3) % 2 ? (size_t)256 * 1024 : SIZE_MAX;
            s.pinned_use_background_threads = false;
            CHECK(host_apply_settings(h, &s) == CCA_OK, "settings: %s", cca_last_error()->message);
            break;
        }
        }
        CHECK(host_is_valid(h), "invalid after operation %d (%u)", steps, op % 8);
        cca_host_stats_t st;
        CHECK(host_get_stats(h, &st) == CCA_OK, "stats");
        size_t live = 0;
        for (size_t k = 0; k < SLOTS; k++)
            live += slots[k].ptr != NULL;
        CHECK(st.allocations.current >= (int64_t)(live + nkept) && st.active_requests.current >= (int64_t)(live + nkept),
              "held %lld, active %lld, live %zu, kept %zu", (long long)st.allocations.current,
              (long long)st.active_requests.current, live, nkept);
    }
#undef NEXT
    for (unsigned i = 0; i < STREAMS; i++) /* the captures end; what they used stays kept */
        CHECK(cca_sim_set_capturing(be, stream_of(i), false) == CCA_OK, "set_capturing");
    for (size_t k = 0; k < SLOTS; k++)
        if (slots[k].ptr) {
            CHECK(host_release_ptr(h, slots[k].ptr) == CCA_OK, "final free");
            if (slots[k].captured && nkept < MAX_KEPT)
                kept[nkept++] = slots[k].ptr;
        }
    (void)cca_sim_complete_stream(be, 0, NULL, true);
    CHECK(host_empty_cache(h) == CCA_OK, "final empty_cache");
    cca_host_stats_t st;
    CHECK(host_get_stats(h, &st) == CCA_OK, "stats");
    /* what stays active is the kept blocks (the reserve segment's freed blocks stay held, idle) */
    CHECK(st.active_requests.current == (int64_t)nkept || nkept == MAX_KEPT, "active %lld after the end, kept %zu",
          (long long)st.active_requests.current, nkept);
    host_destroy(h);
    cca_sim_usage_t u;
    memset(&u, 0, sizeof(u));
    cca_sim_usage(be, &u);
    CHECK(u.live_host == 0 && u.live_events == 0, "the backend holds %llu host blocks and %llu events",
          (unsigned long long)u.live_host, (unsigned long long)u.live_events);
    be->destroy(be->ctx);
    return 0;
}
