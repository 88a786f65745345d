/*
 * fuzz_placement.c - libFuzzer target: cca's default placement against a
 * second implementation of PyTorch's rules (tests/placement_model.h), in
 * lockstep on the simulated backend (manual events). The first byte picks
 * settings (default, max_split_size, roundup_power2_divisions, both with
 * max_non_split_rounding), the second the device's memory (plenty, or small
 * enough that the out-of-memory sequence runs), whether a per-process
 * memory fraction with garbage_collection_threshold caps it instead (the
 * collection by age before new segments), and whether expandable segments
 * are on (then without the fraction); each later byte an operation:
 * an allocation of a size from 1 byte to 128 MiB on one of four streams, a
 * free, a use of a live block on another stream (cca_record_stream), the
 * completion of that stream's work, empty_cache. Every allocation must land
 * in the same segment (counted in the order segments were made) at the same
 * offset in both, or run out of memory in both; at the end both must have made
 * and given back the same segments, with the same retries and out-of-memory
 * counts. Any difference aborts.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cca.h"
#include "cca_backend.h"
#include "device.h"
#include "ptrmap.h"
#include "placement_model.h"
#include "settings.h"

#include "fuzz_check.h"

enum { SLOTS = 64, STREAMS = 4 };
#define USE_STREAM ((cca_stream_t)(uintptr_t)0x9000)

static const char *const settings_of[4] = {
    "",
    "max_split_size_mb:32",
    "roundup_power2_divisions:4",
    "max_split_size_mb:64,max_non_split_rounding_mb:40,roundup_power2_divisions:[1:2,4:4,>:8]",
};
static const size_t caps[4] = {0, 64u << 20, 256u << 20, 1024u << 20};
/* garbage_collection_threshold and the memory fraction's share of a 64 GiB device (none, 256
 * MiB, 1 GiB, 64 MiB), by bits 2-3 of the second byte */
static const char *const gc_of[4] = {NULL, "0.5", "0.8", "0.3"};
static const double fraction_of[4] = {0.0, 1.0 / 256, 1.0 / 64, 1.0 / 1024};

typedef struct slot {
    void *ptr;
    cca_block_t *block;
    bool used;
} slot_t;

/* cca's segment bases in the order they were made (0: given back). */
static uintptr_t bases[MODEL_MAX_SEGMENTS];
static size_t base_count;

static size_t ordinal_of(uintptr_t base)
{
    for (size_t i = 0; i < base_count; i++)
        if (bases[i] == base)
            return i;
    CHECK(base_count < MODEL_MAX_SEGMENTS, "too many segments");
    bases[base_count] = base;
    return base_count++;
}

static int64_t device_allocs(void)
{
    cca_device_stats_t ds;
    CHECK(cca_get_device_stats(0, &ds) == CCA_OK, "stats: %s", cca_last_error()->message);
    return ds.num_device_alloc;
}

/* Released segments' bases forgotten (the device may hand their addresses out again). */
static void forget_released(model_t *m)
{
    if (!m->any_released)
        return;
    for (size_t i = 0; i < base_count; i++)
        if (m->released[i])
            bases[i] = 0;
    memset(m->released, 0, sizeof(m->released));
    m->any_released = false;
}

/* A size from two bytes: 2^(a % 28) plus b/256 of it (1 byte to just under 256 MiB). */
static size_t size_of(uint8_t a, uint8_t b)
{
    size_t p = (size_t)1 << (a % 28);
    return p + p / 256 * b;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 2)
        return 0;
    bool expandable = (data[1] >> 4) % 4 == 3;
    unsigned gc = expandable ? 0 : (data[1] >> 2) % 4;
    char settings[192];
    snprintf(settings, sizeof(settings), "%s%s%s%s", settings_of[data[0] % 4],
             gc ? (data[0] % 4 ? ",garbage_collection_threshold:" : "garbage_collection_threshold:") : "",
             gc ? gc_of[gc] : "",
             expandable ? (data[0] % 4 ? ",expandable_segments:True" : "expandable_segments:True") : "");
    size_t cap = gc ? 0 : caps[data[1] % 4];
    cca_sim_config_t cfg = {0};
    cfg.devices = 1;
    cfg.manual_events = true;
    cfg.total_memory = cap ? cap : 64ull << 30;
    /* expandable: the device hands reservations out at these addresses in turn, and the
     * model takes them in the same turn, so the same reservation is at the same address */
    static uint64_t addresses[MODEL_MAX_SEGMENTS];
    if (expandable) {
        model_reservation_addresses(addresses, MODEL_MAX_SEGMENTS, cfg.total_memory);
        cfg.addresses = addresses;
        cfg.address_count = MODEL_MAX_SEGMENTS;
    }
    cca_backend_t *sim = NULL;
    cca_shutdown();
    CHECK(cca_sim_create(&cfg, &sim) == CCA_OK, "sim: %s", cca_last_error()->message);
    CHECK(cca_init_with_backend(sim, settings) == CCA_OK, "init: %s", cca_last_error()->message);
    if (gc)
        CHECK(cca_set_memory_fraction(fraction_of[gc], 0) == CCA_OK, "fraction: %s",
              cca_last_error()->message);
    model_t *m = malloc(sizeof(*m));
    CHECK(m && model_init(m), "out of host memory");
    const cca_settings_t *cs = cca_state->settings;
    m->max_split = cs->max_split_size;
    m->max_non_split_rounding = cs->max_non_split_rounding;
    for (int i = 0; i < 16; i++)
        m->divisions[i] = cs->roundup_power2_divisions[i];
    m->cap = cap;
    m->expandable = expandable;
    if (expandable) {
        m->address_list = addresses;
        m->address_count = MODEL_MAX_SEGMENTS;
    }
    m->total_memory = cca_state->devices[0].total_memory;
    if (gc) { /* the fraction's allowed bytes as cca computed them */
        m->cap = cca_state->devices[0].allowed_memory_maximum;
        m->gc_threshold = cs->garbage_collection_threshold;
    }
    base_count = 0;
    int64_t made_before = 0;
    slot_t slots[SLOTS];
    memset(slots, 0, sizeof(slots));
    size_t pos = 2;
    while (pos < size) {
        uint8_t op = data[pos++];
        uint8_t arg = pos < size ? data[pos] : 0;
        slot_t *sl = &slots[arg % SLOTS];
        switch (op % 8) {
        case 0: case 1: case 2: case 3: { /* an allocation into a free slot */
            if (sl->ptr || pos + 2 >= size)
                break;
            size_t bytes = size_of(data[pos + 1], data[pos + 2]);
            pos += 3;
            unsigned stream = (op >> 3) % STREAMS;
            cca_status_t st = cca_malloc(&sl->ptr, bytes, (cca_stream_t)(uintptr_t)(0x1000 * (stream + 1)));
            CHECK(st == CCA_OK || st == CCA_ERR_OUT_OF_MEMORY, "cca_malloc(%zu): %s", bytes,
                  cca_last_error()->message);
            void *base = NULL;
            size_t seg_size = 0;
            if (expandable) { /* the block's reservation */
                if (st == CCA_OK)
                    base = (void *)ptrmap_find(cca_state->ptrmap, (uintptr_t)sl->ptr, false)->segment->base;
            } else if (st == CCA_OK) {
                CHECK(cca_get_base_allocation(sl->ptr, &base, &seg_size) == CCA_OK, "base");
                int64_t made = device_allocs();
                if (made != made_before)
                    m->offered_base = (uintptr_t)base;
                made_before = made;
            }
            sl->block = model_malloc(m, bytes, stream);
            m->offered_base = 0;
                forget_released(m);
            CHECK(!m->failed, "the model ran out of host memory or segment ids");
            CHECK((st == CCA_OK) == (sl->block != NULL), "%zu bytes: cca %s, the model %s", bytes,
                  st == CCA_OK ? "allocated" : "out of memory", sl->block ? "allocated" : "out of memory");
            if (st != CCA_OK) {
                sl->ptr = NULL;
                break;
            }
            size_t offset = (uintptr_t)sl->ptr - (uintptr_t)base;
            size_t model_ordinal = model_segment(sl->block);
            size_t model_offset = sl->block->addr - m->seg_base[model_ordinal];
            if (expandable) { /* the same reservation: at the same address */
                CHECK((uintptr_t)base == m->seg_base[model_ordinal] && offset == model_offset,
                      "%zu bytes on stream %u: cca reservation %#lx offset %zu, the model's %#lx offset %zu",
                      bytes, stream, (unsigned long)(uintptr_t)base, offset,
                      (unsigned long)m->seg_base[model_ordinal], model_offset);
                sl->used = false;
                break;
            }
            size_t ordinal = ordinal_of((uintptr_t)base);
            CHECK(ordinal == model_ordinal && offset == model_offset,
                  "%zu bytes on stream %u: cca segment %zu offset %zu, the model segment %zu offset %zu", bytes,
                  stream, ordinal, offset, model_ordinal, model_offset);
            sl->used = false;
            break;
        }
        case 4: /* a free */
            pos++;
            if (!sl->ptr)
                break;
            CHECK(cca_free(sl->ptr) == CCA_OK, "cca_free: %s", cca_last_error()->message);
            if (sl->used)
                model_free_used(m, sl->block);
            else
                model_free(m, sl->block->addr, sl->block);
            sl->ptr = NULL;
            break;
        case 5: /* a use on the other stream */
            pos++;
            if (!sl->ptr || sl->used)
                break;
            CHECK(cca_record_stream(sl->ptr, USE_STREAM) == CCA_OK, "record_stream: %s",
                  cca_last_error()->message);
            sl->used = true;
            break;
        case 6: /* that stream's work so far done */
            CHECK(cca_sim_complete_stream(sim, 0, USE_STREAM, false) == CCA_OK, "complete");
            model_complete(m);
            break;
        default: /* empty_cache */
            CHECK(cca_empty_cache() == CCA_OK, "empty_cache: %s", cca_last_error()->message);
            model_empty_cache(m);
            forget_released(m);
            break;
        }
    }
    cca_device_stats_t ds;
    CHECK(cca_get_device_stats(0, &ds) == CCA_OK, "stats");
    if (expandable) {
        CHECK((uint64_t)ds.num_device_alloc == m->maps, "ranges mapped: cca %lld, the model %llu",
              (long long)ds.num_device_alloc, (unsigned long long)m->maps);
        CHECK((uint64_t)ds.num_device_free == m->unmaps, "ranges unmapped: cca %lld, the model %llu",
              (long long)ds.num_device_free, (unsigned long long)m->unmaps);
    } else {
        CHECK((uint64_t)ds.num_device_alloc == m->segments, "segments made: cca %lld, the model %zu",
              (long long)ds.num_device_alloc, m->segments);
    }
    CHECK((uint64_t)ds.reserved_bytes[CCA_STAT_ALL].current == m->reserved, "reserved: cca %lld, the model %zu",
          (long long)ds.reserved_bytes[CCA_STAT_ALL].current, m->reserved);
    CHECK((uint64_t)ds.num_alloc_retries == m->retries, "retries: cca %lld, the model %llu",
          (long long)ds.num_alloc_retries, (unsigned long long)m->retries);
    CHECK((uint64_t)ds.num_ooms == m->ooms, "out of memory: cca %lld, the model %llu", (long long)ds.num_ooms,
          (unsigned long long)m->ooms);
    for (int k = 0; k < SLOTS; k++)
        if (slots[k].ptr) {
            CHECK(cca_free(slots[k].ptr) == CCA_OK, "cca_free");
            if (slots[k].used)
                model_free_used(m, slots[k].block);
            else
                model_free(m, slots[k].block->addr, slots[k].block);
        }
    model_destroy(m);
    free(m);
    cca_shutdown();
    return 0;
}
