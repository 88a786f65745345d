/*
 * sim_create.c - creation and destruction of a simulated backend: the
 * configuration checks, the device windows and the operation table
 * (cca_sim_create), the address list of replays, and the release of
 * everything a backend holds, leaked allocations included.
 * Invariant: a backend that cca_sim_create returns has every window in its
 * device's free tree; on any error nothing it made is left behind.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "simulator.h"

#define SIM_WINDOW_BASE ((uint64_t)0x7f0000000000ull)
#define SIM_WINDOW_MIN ((uint64_t)1 << 40)
#define SIM_MAX_TOTAL ((uint64_t)1 << 44)     /* 16 TiB per device */
#define SIM_DEFAULT_TOTAL ((size_t)80 << 30)

static atomic_uint_fast64_t sim_instances;

/* ---- creation and destruction ------------------------------------------------------ */

static void release_live_range(sim_range_t *n, void *arg)
{
    sim_ctx_t *c = arg;
    if (n->kind != SIM_RANGE_RESV)
        return;
    sim_resv_t *r = n->data;
    simrange_destroy(r->mapped, NULL, NULL);
    if (c->backed)
        munmap((void *)(uintptr_t)r->addr, r->size);
    free(r);
}

/* Release everything the backend holds, leaked allocations included. */
void sim_destroy(void *ctx)
{
    sim_ctx_t *c = ctx;
    if (!c)
        return;
    for (size_t i = 0; c->allocs.slots && i <= c->allocs.mask; i++) {
        sim_alloc_t *a = c->allocs.slots[i].value;
        if (!a)
            continue;
        if (a->fd >= 0 || c->backed)
            sim_alloc_memory_release(c, a); /* address-only ranges go with the tree below */
        free(a);
    }
    for (size_t i = 0; c->phys.slots && i <= c->phys.mask; i++)
        free(c->phys.slots[i].value);
    for (size_t i = 0; c->events.slots && i <= c->events.mask; i++)
        free(c->events.slots[i].value);
    for (size_t i = 0; c->host.slots && i <= c->host.mask; i++) {
        sim_host_t *h = c->host.slots[i].value;
        if (h && !h->registered)
            free(h->ptr);
        free(h);
    }
    simrange_destroy(c->live, release_live_range, c);
    for (int d = 0; d < c->device_count; d++) {
        sim_map_t *m = &c->devices[d].streams;
        for (size_t i = 0; m->slots && i <= m->mask; i++)
            free(m->slots[i].value);
        simmap_free(m);
        simrange_destroy(c->devices[d].free_ranges, NULL, NULL);
    }
    while (c->spare) {
        sim_range_t *r = c->spare;
        c->spare = r->right;
        free(r);
    }
    simmap_free(&c->allocs);
    simmap_free(&c->phys);
    simmap_free(&c->events);
    simmap_free(&c->host);
    simmap_free(&c->ipc_opens);
    for (size_t i = 0; c->ipc_maps.slots && i <= c->ipc_maps.mask; i++)
        if (c->ipc_maps.slots[i].value)
            munmap((void *)(uintptr_t)c->ipc_maps.slots[i].key,
                   (size_t)(uintptr_t)c->ipc_maps.slots[i].value);
    simmap_free(&c->ipc_maps);
    simmap_free(&c->created_streams);
    simmap_free(&c->capturing);
    sim_capture_free(c);
    free(c->addr_list);
    pthread_key_delete(c->current);
    pthread_mutex_destroy(&c->lock);
    free(c);
}

/* Append count addresses to the list (lock held or not yet shared). */
cca_status_t sim_append_addresses(sim_ctx_t *c, const uint64_t *addresses, size_t count)
{
    if (count && !addresses)
        return cca_backend_error(CCA_ERR_INVALID_ARGUMENT, 0, "sim: address list is NULL");
    if (count && c->backed)
        return cca_backend_error(CCA_ERR_INVALID_ARGUMENT, 0,
                                 "sim: an address list cannot be used in backed mode (device "
                                 "pointers are host pointers there)");
    for (size_t i = 0; i < count; i++)
        if (addresses[i] == 0)
            return cca_backend_error(CCA_ERR_INVALID_ARGUMENT, 0,
                                     "sim: address list entry %zu is 0", i);
    if (count > c->addr_cap - c->addr_count) {
        size_t cap = c->addr_cap ? c->addr_cap : 64;
        while (cap - c->addr_count < count) {
            if (cap > SIZE_MAX / 2 / sizeof(uint64_t))
                return cca_backend_error(CCA_ERR_OUT_OF_MEMORY, 0,
                                         "sim: address list: out of host memory");
            cap *= 2;
        }
        uint64_t *list = realloc(c->addr_list, cap * sizeof(uint64_t));
        if (!list)
            return cca_backend_error(CCA_ERR_OUT_OF_MEMORY, 0,
                                         "sim: address list: out of host memory");
        c->addr_list = list;
        c->addr_cap = cap;
    }
    if (count)
        memcpy(c->addr_list + c->addr_count, addresses, count * sizeof(uint64_t));
    c->addr_count += count;
    return CCA_OK;
}

static cca_status_t sim_invalid_config(const char *why)
{
    return cca_backend_error(CCA_ERR_INVALID_ARGUMENT, 0, "sim: invalid configuration: %s", why);
}

cca_status_t cca_sim_create(const cca_sim_config_t *config, cca_backend_t **backend)
{
    cca_sim_config_t cfg;
    cca_status_t st;
    if (!backend)
        return sim_invalid_config("backend output pointer is NULL");
    if (config)
        cfg = *config;
    else
        memset(&cfg, 0, sizeof(cfg));
    if (cfg.devices == 0)
        cfg.devices = 1;
    if (cfg.total_memory == 0)
        cfg.total_memory = SIM_DEFAULT_TOTAL;
    if (cfg.memory_cap == 0)
        cfg.memory_cap = cfg.total_memory;
    if (cfg.granularity == 0)
        cfg.granularity = SIM_LARGE_ALIGN;
    if (cfg.devices < 0 || cfg.devices > SIM_MAX_DEVICES)
        return sim_invalid_config("devices must be between 1 and 16");
    if (cfg.total_memory > SIM_MAX_TOTAL)
        return sim_invalid_config("total_memory must be at most 16 TiB");
    if ((cfg.granularity & (cfg.granularity - 1)) || cfg.granularity < SIM_SMALL_ALIGN ||
        cfg.granularity > ((size_t)1 << 30) ||
        (cfg.backed && cfg.granularity % (size_t)sysconf(_SC_PAGESIZE)))
        return sim_invalid_config("granularity must be a power of two between 512 bytes (the "
                                  "page size in backed mode) and 1 GiB");
    if (cfg.ipc_shared)
        cfg.backed = true;
    if (cfg.backed && cfg.address_count)
        return sim_invalid_config("an address list cannot be used in backed mode");

    sim_ctx_t *c = calloc(1, sizeof(*c));
    if (!c)
        return cca_backend_error(CCA_ERR_OUT_OF_MEMORY, 0, "sim: out of host memory");
    if (pthread_key_create(&c->current, NULL) != 0) {
        free(c);
        return cca_backend_error(CCA_ERR_OUT_OF_MEMORY, 0, "sim: no thread-local key left");
    }
    pthread_mutex_init(&c->lock, NULL);
    static _Atomic uint64_t instances;
    c->instance = atomic_fetch_add(&instances, 1) + 1;
    c->device_count = cfg.devices;
    c->backed = cfg.backed;
    c->manual_events = cfg.manual_events;
    c->ipc_shared = cfg.ipc_shared;
    c->no_peer_access = cfg.no_peer_access;
    c->granularity = cfg.granularity;
    c->prio_state = 0x9e3779b9u;
    c->ipc_id = simmap_hash(atomic_fetch_add(&sim_instances, 1) + 1 + (uint64_t)getpid());
    uint64_t window = SIM_WINDOW_MIN;
    while (window < 2 * (uint64_t)cfg.total_memory)
        window += SIM_WINDOW_MIN;
    for (int d = 0; d < cfg.devices; d++) {
        sim_device_t *dev = &c->devices[d];
        dev->total = cfg.total_memory;
        dev->cap = cfg.memory_cap;
        dev->window_start = SIM_WINDOW_BASE + (uint64_t)d * window;
        dev->window_end = dev->window_start + window;
        if (cfg.backed)
            continue;
        if (!sim_spare_reserve(c, 1)) {
            st = cca_backend_error(CCA_ERR_OUT_OF_MEMORY, 0, "sim: out of host memory");
            goto out_destroy;
        }
        simrange_insert(&dev->free_ranges,
                  sim_spare_take(c, dev->window_start, window, SIM_RANGE_FREE, NULL));
    }
    st = sim_append_addresses(c, cfg.addresses, cfg.address_count);
    if (st != CCA_OK)
        goto out_destroy;

    cca_backend_t *b = &c->backend;
    b->name = "sim";
    b->ctx = c;
    sim_memory_install(b);
    sim_events_install(b);
    sim_vmm_install(b);
    sim_host_install(b);
    sim_multi_install(b);
    sim_capture_install(b);
    b->destroy = sim_destroy;
    *backend = b;
    return CCA_OK;
out_destroy:
    sim_destroy(c);
    return st;
}
