/*
 * sim.c - the simulated device backend: N devices of configurable capacity,
 * without a GPU. Every allocator path is tested through it, and `cca replay`
 * replays large traces through it on any machine. This file holds the address
 * windows and the address list, capacity, and the records of device
 * memory; the operations on them are in sim_device.c; simulator.h lists
 * the other files.
 *
 * Memory modes:
 *  - address-only (default): no host memory stands behind device memory; the
 *    backend only hands out and tracks address ranges, so an 80 GiB device
 *    costs a few MB of RAM;
 *  - backed: malloc returns real host memory (posix_memalign, 512-byte
 *    aligned; the device pointer is the host pointer), so AddressSanitizer
 *    sees out-of-bounds use. VMM reservations are mmap(PROT_NONE) ranges that
 *    vmm_map makes read/write and vmm_unmap makes inaccessible again.
 *
 * Address rule of address-only mode (deterministic): device d owns the window
 * [0x7f0000000000 + d * W, 0x7f0000000000 + (d + 1) * W), W = 1 TiB (or the
 * smallest multiple of 1 TiB holding twice the device's total memory). A block
 * of size >= 2 MiB takes round_up(size, 2 MiB) bytes at the lowest 2 MiB
 * aligned address of the window where they are free; a smaller one takes
 * round_up(size, 512) bytes at the lowest free 512-byte aligned address;
 * vmm_reserve aligns to max(granularity, that). Freed ranges go back to the
 * window, merged with free neighbours, and are reused: the same sequence of
 * calls always gets the same addresses.
 *
 * Address list (replay): while entries remain, malloc and vmm_reserve take
 * the next address of the list, whatever the device. An entry that would
 * overlap a live allocation or reservation fails (CCA_ERR_BACKEND) and is not
 * consumed. Once the list is exhausted the rule above applies again; ranges
 * taken from the list are carved out of the windows, so the rule never hands
 * out an address that overlaps them.
 *
 * Invariant: live ranges (allocations and reservations, in `live`) never
 * overlap, and every byte of a device window is either in that device's free
 * tree or in exactly one live range. One mutex per backend guards all state.
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include "simulator.h"

#define SIM_SPARE_MAX 64                    /* cached free tree nodes */

static uint64_t align_up(uint64_t x, uint64_t align)
{
    return (x + align - 1) & ~(align - 1);
}



size_t sim_device_limit(const sim_device_t *dev)
{
    return dev->cap < dev->total ? dev->cap : dev->total;
}

/* CCA_OK if size more bytes fit under the device's cap, else the OOM error. */
cca_status_t sim_check_capacity(sim_ctx_t *c, cca_backend_op_t op, int device, size_t size)
{
    sim_device_t *dev = &c->devices[device];
    size_t limit = sim_device_limit(dev);
    if (dev->used <= limit && size <= limit - dev->used)
        return CCA_OK;
    size_t free_bytes = dev->used < limit ? limit - dev->used : 0;
    return cca_backend_error(CCA_ERR_OUT_OF_MEMORY, SIM_CUDA_OUT_OF_MEMORY,
                             "CUDA error: out of memory (sim: %s of %zu bytes on device %d: "
                             "%zu bytes free of %zu)",
                             cca_backend_op_name(op), size, device, free_bytes, dev->total);
}

static uint32_t next_prio(sim_ctx_t *c)
{
    uint32_t x = c->prio_state;
    x ^= x << 13;
    x ^= x >> 17;
    x ^= x << 5;
    c->prio_state = x;
    return x;
}

/* Make sure n tree nodes can be taken without allocating. */
bool sim_spare_reserve(sim_ctx_t *c, size_t n)
{
    while (c->spare_count < n) {
        sim_range_t *r = malloc(sizeof(*r));
        if (!r)
            return false;
        r->right = c->spare;
        c->spare = r;
        c->spare_count++;
    }
    return true;
}

/* A node from the spare list (NULL only if sim_spare_reserve was not called). */
sim_range_t *sim_spare_take(sim_ctx_t *c, uint64_t start, uint64_t len, int kind, void *data)
{
    sim_range_t *r = c->spare;
    if (!r)
        return NULL;
    c->spare = r->right;
    c->spare_count--;
    memset(r, 0, sizeof(*r));
    r->start = start;
    r->len = len;
    r->kind = kind;
    r->data = data;
    r->prio = next_prio(c);
    return r;
}

void sim_spare_give(sim_ctx_t *c, sim_range_t *r)
{
    if (c->spare_count >= SIM_SPARE_MAX) {
        free(r);
        return;
    }
    r->right = c->spare;
    c->spare = r;
    c->spare_count++;
}

/* Spares any single placement or release may need. */
size_t sim_spare_need(const sim_ctx_t *c)
{
    return (size_t)c->device_count + 2;
}

/* Take [start, start + len) out of dev's free ranges; it must lie inside one
 * of them. Needs one spare node. Returns false if it does not. Free ranges are
 * changed in place where possible: carving from the front of a range (the
 * common case) costs one path walk. */
static bool window_carve(sim_ctx_t *c, sim_device_t *dev, uint64_t start, uint64_t len)
{
    sim_range_t *f = simrange_find_le(dev->free_ranges, start);
    if (!f || f->start + f->len < start + len)
        return false;
    uint64_t f_start = f->start, f_end = f->start + f->len, end = start + len;
    if (f_start == start && f_end == end) {
        sim_spare_give(c, simrange_remove(&dev->free_ranges, f_start));
    } else if (f_start == start) {
        f->start = end;
        f->len = f_end - end;
        simrange_refresh(dev->free_ranges, end);
    } else {
        f->len = start - f_start;
        simrange_refresh(dev->free_ranges, f_start);
        if (end < f_end)
            simrange_insert(&dev->free_ranges, sim_spare_take(c, end, f_end - end, SIM_RANGE_FREE, NULL));
    }
    return true;
}

/* Give [start, start + len) back to dev's free ranges, merged with free
 * neighbours. Without a spare node the range is dropped (lost address space,
 * never corruption). */
static void window_release(sim_ctx_t *c, sim_device_t *dev, uint64_t start, uint64_t len)
{
    uint64_t end = start + len;
    sim_range_t *prev = simrange_find_le(dev->free_ranges, start);
    sim_range_t *next = simrange_find_ge(dev->free_ranges, end);
    if (prev && prev->start + prev->len != start)
        prev = NULL;
    if (next && next->start != end)
        next = NULL;
    if (prev && next) {
        prev->len += len + next->len;
        sim_spare_give(c, simrange_remove(&dev->free_ranges, end));
        simrange_refresh(dev->free_ranges, prev->start);
    } else if (prev) {
        prev->len += len;
        simrange_refresh(dev->free_ranges, prev->start);
    } else if (next) {
        next->start = start;
        next->len += len;
        simrange_refresh(dev->free_ranges, start);
    } else {
        sim_range_t *n = sim_spare_take(c, start, len, SIM_RANGE_FREE, NULL);
        if (n)
            simrange_insert(&dev->free_ranges, n);
    }
}

/* Clip [start, start + len) to dev's window; false if they do not meet. */
static bool window_clip(const sim_device_t *dev, uint64_t start, uint64_t len, uint64_t *cs,
                        uint64_t *cl)
{
    uint64_t lo = start > dev->window_start ? start : dev->window_start;
    uint64_t hi = start + len < dev->window_end ? start + len : dev->window_end;
    if (lo >= hi)
        return false;
    *cs = lo;
    *cl = hi - lo;
    return true;
}

/* The live range overlapping [start, start + len), if any. */
static sim_range_t *live_overlap(sim_ctx_t *c, uint64_t start, uint64_t len)
{
    sim_range_t *n = simrange_find_le(c->live, start + len - 1);
    return n && n->start + n->len > start ? n : NULL;
}

/*
 * Choose the address of a new live range of size bytes on device (address-only
 * mode): the next list entry, else the deterministic rule with alignment
 * align. Inserts the live node (kind, data). sim_spare_need() spares must be
 * reserved. Returns CCA_OK, CCA_ERR_BACKEND (list entry overlaps),
 * CCA_ERR_OUT_OF_MEMORY (window exhausted).
 */
cca_status_t sim_place_range(sim_ctx_t *c, cca_backend_op_t op, int device, uint64_t size,
                             uint64_t align, int kind, void *data, uint64_t *addr)
{
    sim_device_t *dev = &c->devices[device];
    uint64_t start, len;
    while (c->addr_next == c->addr_count && c->addr_source) {
        /* the list grows while a replay's trace is read: wait for its next entries */
        uint64_t more[64];
        size_t got = 0;
        bool open = c->addr_source(c->addr_source_ctx, more, 64, &got);
        cca_status_t st = sim_append_addresses(c, more, got);
        if (st != CCA_OK)
            return st;
        if (!open || !got) /* ended (a source that gives nothing has ended too) */
            c->addr_source = NULL;
    }
    if (c->addr_next < c->addr_count) {
        start = c->addr_list[c->addr_next];
        len = size;
        if (start + len < start)
            return cca_backend_error(CCA_ERR_BACKEND, 0,
                                     "sim: %s: address 0x%llx from the address list cannot "
                                     "hold %llu bytes",
                                     cca_backend_op_name(op), (unsigned long long)start,
                                     (unsigned long long)size);
        sim_range_t *o = live_overlap(c, start, len);
        if (o)
            return cca_backend_error(CCA_ERR_BACKEND, 0,
                                     "sim: %s: address 0x%llx (+%llu bytes) from the address "
                                     "list overlaps the live range at 0x%llx (+%llu bytes)",
                                     cca_backend_op_name(op), (unsigned long long)start,
                                     (unsigned long long)len, (unsigned long long)o->start,
                                     (unsigned long long)o->len);
        for (int d = 0; d < c->device_count; d++) {
            uint64_t cs, cl;
            if (window_clip(&c->devices[d], start, len, &cs, &cl) &&
                !window_carve(c, &c->devices[d], cs, cl))
                return cca_backend_error(CCA_ERR_INTERNAL, 0,
                                         "sim: %s: free ranges of device %d disagree with "
                                         "the live ranges at 0x%llx",
                                         cca_backend_op_name(op), d, (unsigned long long)cs);
        }
        c->addr_next++;
    } else {
        len = align_up(size, align);
        sim_range_t *f = len >= size ? simrange_first_fit(dev->free_ranges, len, align) : NULL;
        if (!f)
            return cca_backend_error(CCA_ERR_OUT_OF_MEMORY, SIM_CUDA_OUT_OF_MEMORY,
                                     "CUDA error: out of memory (sim: %s: the simulated address "
                                     "space of device %d has no free range of %llu bytes)",
                                     cca_backend_op_name(op), device, (unsigned long long)size);
        start = align_up(f->start, align);
        window_carve(c, dev, start, len);
    }
    simrange_insert(&c->live, sim_spare_take(c, start, len, kind, data));
    *addr = start;
    return CCA_OK;
}

/* Remove the live range at start and give its address space back. */
void sim_unplace_range(sim_ctx_t *c, uint64_t start)
{
    sim_range_t *n = simrange_remove(&c->live, start);
    if (!n)
        return;
    uint64_t len = n->len;
    sim_spare_give(c, n); /* first, so the windows can use it */
    if (c->backed)
        return;
    for (int d = 0; d < c->device_count; d++) {
        uint64_t cs, cl;
        if (window_clip(&c->devices[d], start, len, &cs, &cl))
            window_release(c, &c->devices[d], cs, cl);
    }
}

/* ---- device, memory ---------------------------------------------------------------- */

/* Shared memory for ipc_shared mode: a memory file another process can open. */
static cca_status_t shared_memory(size_t size, int device, int *fd_out, void **mem_out)
{
    int fd = memfd_create("cca-sim-device-memory", MFD_CLOEXEC);
    void *mem = MAP_FAILED;
    if (fd >= 0 && ftruncate(fd, (off_t)size) == 0)
        mem = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (mem == MAP_FAILED) {
        if (fd >= 0)
            close(fd);
        return cca_backend_error(CCA_ERR_OUT_OF_MEMORY, SIM_CUDA_OUT_OF_MEMORY,
                                 "CUDA error: out of memory (sim: shared memory of %zu bytes "
                                 "on device %d could not be made)",
                                 size, device);
    }
    *fd_out = fd;
    *mem_out = mem;
    return CCA_OK;
}

cca_status_t sim_alloc_locked(sim_ctx_t *c, cca_backend_op_t op, int device, size_t size,
                              sim_alloc_t **out)
{
    uint64_t addr = 0;
    cca_status_t st = CCA_OK;
    sim_alloc_t *rec = calloc(1, sizeof(*rec));
    if (!rec || !simmap_reserve(&c->allocs) || !sim_spare_reserve(c, sim_spare_need(c))) {
        st = sim_host_oom(op);
        goto out_free_rec;
    }
    rec->fd = -1;
    if (c->ipc_shared) {
        void *mem = NULL;
        st = shared_memory(size, device, &rec->fd, &mem);
        if (st != CCA_OK)
            goto out_free_rec;
        addr = (uint64_t)(uintptr_t)mem;
    } else if (c->backed) {
        void *mem = NULL;
        if (posix_memalign(&mem, SIM_SMALL_ALIGN, size) != 0) {
            st = cca_backend_error(CCA_ERR_OUT_OF_MEMORY, SIM_CUDA_OUT_OF_MEMORY,
                                   "CUDA error: out of memory (sim: backed %s of %zu bytes "
                                   "on device %d: host memory exhausted)",
                                   cca_backend_op_name(op), size, device);
            goto out_free_rec;
        }
        addr = (uint64_t)(uintptr_t)mem;
    } else {
        uint64_t align = size >= SIM_LARGE_ALIGN ? SIM_LARGE_ALIGN : SIM_SMALL_ALIGN;
        st = sim_place_range(c, op, device, size, align, SIM_RANGE_ALLOC, rec, &addr);
        if (st != CCA_OK)
            goto out_free_rec;
    }
    rec->addr = addr;
    rec->size = size;
    rec->device = device;
    rec->serial = ++c->next_serial;
    simmap_put(&c->allocs, addr, rec);
    *out = rec;
    return CCA_OK;
out_free_rec:
    free(rec);
    return st;
}

/* Release the memory behind a record (not the record, not the map entry). */
void sim_alloc_memory_release(sim_ctx_t *c, sim_alloc_t *rec)
{
    if (rec->fd >= 0) {
        munmap((void *)(uintptr_t)rec->addr, rec->size);
        close(rec->fd);
    } else if (c->backed) {
        free((void *)(uintptr_t)rec->addr);
    } else {
        sim_unplace_range(c, rec->addr);
    }
}

void sim_alloc_release_locked(sim_ctx_t *c, sim_alloc_t *rec)
{
    sim_spare_reserve(c, sim_spare_need(c)); /* best effort: see window_release */
    simmap_remove(&c->allocs, rec->addr);
    sim_alloc_memory_release(c, rec);
    free(rec);
}

