/*
 * sim.c - the simulated device backend: N devices of configurable capacity,
 * without a GPU. Every allocator path is tested through it, and `cca replay`
 * replays large traces through it on any machine.
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
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "sim_internal.h"

#define SIM_WINDOW_BASE ((uint64_t)0x7f0000000000ull)
#define SIM_WINDOW_MIN ((uint64_t)1 << 40)
#define SIM_MAX_TOTAL ((uint64_t)1 << 44)     /* 16 TiB per device */
#define SIM_SMALL_ALIGN ((uint64_t)512)
#define SIM_LARGE_ALIGN ((uint64_t)2 << 20)
#define SIM_DEFAULT_TOTAL ((size_t)80 << 30)
#define SIM_SPARE_MAX 64                      /* cached free tree nodes */

static const unsigned char ipc_magic[8] = {'c', 'c', 'a', 's', 'i', 'm', '1', 0};

static uint64_t align_up(uint64_t x, uint64_t align)
{
    return (x + align - 1) & ~(align - 1);
}

static atomic_uint_fast64_t sim_instances;

static void sim_destroy(void *ctx);

/* ---- helpers (lock held) ---------------------------------------------------------- */

/* Count a call of op and fire its injected fault, if due. */
cca_status_t sim_enter_locked(sim_ctx_t *c, cca_backend_op_t op)
{
    sim_fault_t *f = &c->faults[op];
    c->calls[op]++;
    if (f->failing)
        goto fail;
    if (f->countdown == 0 || --f->countdown > 0)
        return CCA_OK;
    if (f->persistent)
        f->failing = true;
fail:
    return cca_backend_error(f->status, 0, "sim: %s: injected fault (call %llu)",
                             cca_backend_op_name(op), (unsigned long long)c->calls[op]);
}

cca_status_t sim_bad_device(sim_ctx_t *c, cca_backend_op_t op, int device)
{
    return cca_backend_error(CCA_ERR_INVALID_ARGUMENT, SIM_CUDA_INVALID_VALUE,
                             "sim: %s: invalid device ordinal %d (the backend has %d devices)",
                             cca_backend_op_name(op), device, c->device_count);
}

static cca_status_t host_oom(cca_backend_op_t op)
{
    return cca_backend_error(CCA_ERR_BACKEND, 0, "sim: %s: host out of memory for bookkeeping",
                             cca_backend_op_name(op));
}

static size_t device_limit(const sim_device_t *dev)
{
    return dev->cap < dev->total ? dev->cap : dev->total;
}

/* CCA_OK if size more bytes fit under the device's cap, else the OOM error. */
cca_status_t sim_check_capacity(sim_ctx_t *c, cca_backend_op_t op, int device, size_t size)
{
    sim_device_t *dev = &c->devices[device];
    size_t limit = device_limit(dev);
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
static bool spare_reserve(sim_ctx_t *c, size_t n)
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

/* A node from the spare list (NULL only if spare_reserve was not called). */
static sim_range_t *spare_take(sim_ctx_t *c, uint64_t start, uint64_t len, int kind, void *data)
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

static void spare_give(sim_ctx_t *c, sim_range_t *r)
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
static size_t spare_need(const sim_ctx_t *c)
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
        spare_give(c, simrange_remove(&dev->free_ranges, f_start));
    } else if (f_start == start) {
        f->start = end;
        f->len = f_end - end;
        simrange_refresh(dev->free_ranges, end);
    } else {
        f->len = start - f_start;
        simrange_refresh(dev->free_ranges, f_start);
        if (end < f_end)
            simrange_insert(&dev->free_ranges, spare_take(c, end, f_end - end, SIM_RANGE_FREE, NULL));
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
        spare_give(c, simrange_remove(&dev->free_ranges, end));
        simrange_refresh(dev->free_ranges, prev->start);
    } else if (prev) {
        prev->len += len;
        simrange_refresh(dev->free_ranges, prev->start);
    } else if (next) {
        next->start = start;
        next->len += len;
        simrange_refresh(dev->free_ranges, start);
    } else {
        sim_range_t *n = spare_take(c, start, len, SIM_RANGE_FREE, NULL);
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
 * align. Inserts the live node (kind, data). spare_need() spares must be
 * reserved. Returns CCA_OK, CCA_ERR_BACKEND (list entry overlaps),
 * CCA_ERR_OUT_OF_MEMORY (window exhausted).
 */
static cca_status_t place_range(sim_ctx_t *c, cca_backend_op_t op, int device, uint64_t size,
                                uint64_t align, int kind, void *data, uint64_t *addr)
{
    sim_device_t *dev = &c->devices[device];
    uint64_t start, len;
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
    simrange_insert(&c->live, spare_take(c, start, len, kind, data));
    *addr = start;
    return CCA_OK;
}

/* Remove the live range at start and give its address space back. */
static void unplace_range(sim_ctx_t *c, uint64_t start)
{
    sim_range_t *n = simrange_remove(&c->live, start);
    if (!n)
        return;
    uint64_t len = n->len;
    spare_give(c, n); /* first, so the windows can use it */
    if (c->backed)
        return;
    for (int d = 0; d < c->device_count; d++) {
        uint64_t cs, cl;
        if (window_clip(&c->devices[d], start, len, &cs, &cl))
            window_release(c, &c->devices[d], cs, cl);
    }
}

/* ---- events (manual mode) ------------------------------------------------------ */

static void event_unlink(sim_ctx_t *c, sim_event_t *e)
{
    sim_stream_t *s = e->stream;
    if (!e->pending)
        return;
    if (e->prev)
        e->prev->next = e->next;
    else
        s->head = e->next;
    if (e->next)
        e->next->prev = e->prev;
    else
        s->tail = e->prev;
    e->prev = e->next = NULL;
    e->stream = NULL;
    e->pending = false;
    c->pending_events--;
}

/* Complete the events of s recorded up to and including last (NULL: all). */
static void stream_complete(sim_ctx_t *c, sim_stream_t *s, sim_event_t *last)
{
    while (s->head) {
        sim_event_t *e = s->head;
        event_unlink(c, e);
        if (e == last)
            break;
    }
}

static void device_complete(sim_ctx_t *c, int device)
{
    sim_map_t *m = &c->devices[device].streams;
    for (size_t i = 0; m->slots && i <= m->mask; i++)
        if (m->slots[i].value)
            stream_complete(c, m->slots[i].value, NULL);
}

/* ---- device, memory ---------------------------------------------------------------- */

/* Number of simulated devices. Returns CCA_OK. */
static cca_status_t sim_device_count(void *ctx, int *count)
{
    sim_ctx_t *c = ctx;
    *count = c->device_count;
    return CCA_OK;
}

/* Name and total memory of a device. Returns CCA_OK, CCA_ERR_BACKEND (bad device). */
static cca_status_t sim_device_props(void *ctx, int device, cca_device_props_t *props)
{
    sim_ctx_t *c = ctx;
    if (device < 0 || device >= c->device_count)
        return cca_backend_error(CCA_ERR_BACKEND, SIM_CUDA_INVALID_VALUE,
                                 "sim: device_props: invalid device ordinal %d", device);
    memset(props, 0, sizeof(*props));
    snprintf(props->name, sizeof(props->name), "cca simulated device %d", device);
    props->total_memory = c->devices[device].total;
    return CCA_OK;
}

/* Current device of the calling thread for this backend (0 until set). Returns CCA_OK. */
static cca_status_t sim_get_device(void *ctx, int *device)
{
    sim_ctx_t *c = ctx;
    intptr_t v = (intptr_t)pthread_getspecific(c->current);
    *device = v > 0 ? (int)(v - 1) : 0;
    return CCA_OK;
}

/* Set the calling thread's current device. Returns CCA_OK, CCA_ERR_INVALID_ARGUMENT,
 * CCA_ERR_BACKEND (no thread-local storage). */
static cca_status_t sim_set_device(void *ctx, int device)
{
    sim_ctx_t *c = ctx;
    if (device < 0 || device >= c->device_count)
        return cca_backend_error(CCA_ERR_INVALID_ARGUMENT, SIM_CUDA_INVALID_VALUE,
                                 "sim: set_device: invalid device ordinal %d (the backend has "
                                 "%d devices)",
                                 device, c->device_count);
    if (pthread_setspecific(c->current, (void *)(intptr_t)(device + 1)) != 0)
        return cca_backend_error(CCA_ERR_BACKEND, 0, "sim: set_device: host out of memory");
    return CCA_OK;
}

/* Free = min(cap, total) - used, and the total. Returns CCA_OK,
 * CCA_ERR_INVALID_ARGUMENT, or an injected fault. */
static cca_status_t sim_mem_get_info(void *ctx, int device, size_t *free_bytes, size_t *total)
{
    sim_ctx_t *c = ctx;
    pthread_mutex_lock(&c->lock);
    cca_status_t st = sim_enter_locked(c, CCA_OP_MEM_GET_INFO);
    if (st != CCA_OK)
        goto out_unlock;
    if (device < 0 || device >= c->device_count) {
        st = sim_bad_device(c, CCA_OP_MEM_GET_INFO, device);
        goto out_unlock;
    }
    sim_device_t *dev = &c->devices[device];
    size_t limit = device_limit(dev);
    *free_bytes = dev->used < limit ? limit - dev->used : 0;
    *total = dev->total;
out_unlock:
    pthread_mutex_unlock(&c->lock);
    return st;
}

/* Allocate size bytes of device memory (see the banner for the address). Returns
 * CCA_OK, CCA_ERR_OUT_OF_MEMORY (cap reached), CCA_ERR_INVALID_ARGUMENT,
 * CCA_ERR_BACKEND (list entry overlaps, host bookkeeping failed), or a fault. */
static cca_status_t sim_malloc(void *ctx, int device, size_t size, void **ptr)
{
    sim_ctx_t *c = ctx;
    sim_alloc_t *rec = NULL;
    pthread_mutex_lock(&c->lock);
    cca_status_t st = sim_enter_locked(c, CCA_OP_MALLOC);
    if (st != CCA_OK)
        goto out_unlock;
    if (device < 0 || device >= c->device_count) {
        st = sim_bad_device(c, CCA_OP_MALLOC, device);
        goto out_unlock;
    }
    if (!ptr || size == 0) {
        st = cca_backend_error(CCA_ERR_INVALID_ARGUMENT, SIM_CUDA_INVALID_VALUE,
                               "sim: malloc: invalid argument (size %zu)", size);
        goto out_unlock;
    }
    st = sim_check_capacity(c, CCA_OP_MALLOC, device, size);
    if (st != CCA_OK)
        goto out_unlock;
    st = sim_alloc_locked(c, CCA_OP_MALLOC, device, size, &rec);
    if (st != CCA_OK)
        goto out_unlock;
    c->devices[device].used += size;
    *ptr = (void *)(uintptr_t)rec->addr;
out_unlock:
    pthread_mutex_unlock(&c->lock);
    return st;
}

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
    if (!rec || !simmap_reserve(&c->allocs) || !spare_reserve(c, spare_need(c))) {
        st = host_oom(op);
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
        st = place_range(c, op, device, size, align, SIM_RANGE_ALLOC, rec, &addr);
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
static void alloc_memory_release(sim_ctx_t *c, sim_alloc_t *rec)
{
    if (rec->fd >= 0) {
        munmap((void *)(uintptr_t)rec->addr, rec->size);
        close(rec->fd);
    } else if (c->backed) {
        free((void *)(uintptr_t)rec->addr);
    } else {
        unplace_range(c, rec->addr);
    }
}

void sim_alloc_release_locked(sim_ctx_t *c, sim_alloc_t *rec)
{
    spare_reserve(c, spare_need(c)); /* best effort: see window_release */
    simmap_remove(&c->allocs, rec->addr);
    alloc_memory_release(c, rec);
    free(rec);
}

/* Free a malloc'd block; completes the device's events first, as cudaFree
 * synchronizes. Returns CCA_OK, CCA_ERR_INVALID_ARGUMENT (unknown pointer), or a fault. */
static cca_status_t sim_free(void *ctx, int device, void *ptr)
{
    sim_ctx_t *c = ctx;
    pthread_mutex_lock(&c->lock);
    cca_status_t st = sim_enter_locked(c, CCA_OP_FREE);
    if (st != CCA_OK)
        goto out_unlock;
    if (device < 0 || device >= c->device_count) {
        st = sim_bad_device(c, CCA_OP_FREE, device);
        goto out_unlock;
    }
    if (!ptr)
        goto out_unlock; /* cudaFree(NULL) does nothing */
    uint64_t addr = (uint64_t)(uintptr_t)ptr;
    sim_alloc_t *rec = simmap_get(&c->allocs, addr);
    if (!rec || rec->device != device || rec->async) {
        st = cca_backend_error(CCA_ERR_INVALID_ARGUMENT, SIM_CUDA_INVALID_VALUE,
                               "sim: free: invalid argument (%p is not a live allocation of "
                               "device %d%s)",
                               ptr, device, rec && rec->async ? " from malloc: it is from malloc_async" : "");
        goto out_unlock;
    }
    /* cudaFree synchronizes the device */
    device_complete(c, device);
    sim_pool_sync_locked(c, device);
    c->devices[device].used -= rec->size;
    sim_alloc_release_locked(c, rec);
out_unlock:
    pthread_mutex_unlock(&c->lock);
    return st;
}

/* ---- streams and events ---------------------------------------------------------- */

/* Complete every event recorded on stream. Returns CCA_OK, CCA_ERR_INVALID_ARGUMENT,
 * or a fault. */
static cca_status_t sim_stream_synchronize(void *ctx, int device, cca_stream_t stream)
{
    sim_ctx_t *c = ctx;
    pthread_mutex_lock(&c->lock);
    cca_status_t st = sim_enter_locked(c, CCA_OP_STREAM_SYNCHRONIZE);
    if (st != CCA_OK)
        goto out_unlock;
    if (device < 0 || device >= c->device_count) {
        st = sim_bad_device(c, CCA_OP_STREAM_SYNCHRONIZE, device);
        goto out_unlock;
    }
    sim_stream_t *s = simmap_get(&c->devices[device].streams, (uint64_t)(uintptr_t)stream);
    if (s)
        stream_complete(c, s, NULL);
    sim_pool_sync_locked(c, device);
out_unlock:
    pthread_mutex_unlock(&c->lock);
    return st;
}

/* Complete every event of device. Returns CCA_OK, CCA_ERR_INVALID_ARGUMENT, or a fault. */
static cca_status_t sim_device_synchronize(void *ctx, int device)
{
    sim_ctx_t *c = ctx;
    pthread_mutex_lock(&c->lock);
    cca_status_t st = sim_enter_locked(c, CCA_OP_DEVICE_SYNCHRONIZE);
    if (st != CCA_OK)
        goto out_unlock;
    if (device < 0 || device >= c->device_count) {
        st = sim_bad_device(c, CCA_OP_DEVICE_SYNCHRONIZE, device);
        goto out_unlock;
    }
    device_complete(c, device);
    sim_pool_sync_locked(c, device);
out_unlock:
    pthread_mutex_unlock(&c->lock);
    return st;
}

/* Create an event; the handle is its record. Returns CCA_OK,
 * CCA_ERR_INVALID_ARGUMENT, CCA_ERR_BACKEND (host memory), or a fault. */
static cca_status_t sim_event_create(void *ctx, int device, cca_event_t *event)
{
    sim_ctx_t *c = ctx;
    pthread_mutex_lock(&c->lock);
    cca_status_t st = sim_enter_locked(c, CCA_OP_EVENT_CREATE);
    if (st != CCA_OK)
        goto out_unlock;
    if (device < 0 || device >= c->device_count) {
        st = sim_bad_device(c, CCA_OP_EVENT_CREATE, device);
        goto out_unlock;
    }
    if (!event) {
        st = cca_backend_error(CCA_ERR_INVALID_ARGUMENT, SIM_CUDA_INVALID_VALUE,
                               "sim: event_create: NULL output pointer");
        goto out_unlock;
    }
    sim_event_t *e = NULL;
    st = sim_event_new_locked(c, CCA_OP_EVENT_CREATE, device, &e);
    if (st == CCA_OK)
        *event = e;
out_unlock:
    pthread_mutex_unlock(&c->lock);
    return st;
}

cca_status_t sim_event_new_locked(sim_ctx_t *c, cca_backend_op_t op, int device, sim_event_t **out)
{
    sim_event_t *e = calloc(1, sizeof(*e));
    if (!e || !simmap_reserve(&c->events)) {
        free(e);
        return host_oom(op);
    }
    e->device = device;
    simmap_put(&c->events, (uint64_t)(uintptr_t)e, e);
    *out = e;
    return CCA_OK;
}

/* The live event of handle on device, or NULL after recording the error. */
sim_event_t *sim_find_event(sim_ctx_t *c, cca_backend_op_t op, int device, cca_event_t event,
                            cca_status_t *st)
{
    sim_event_t *e = simmap_get(&c->events, (uint64_t)(uintptr_t)event);
    if (e && e->device == device)
        return e;
    *st = cca_backend_error(CCA_ERR_INVALID_ARGUMENT, SIM_CUDA_INVALID_VALUE,
                            "sim: %s: %p is not a live event of device %d",
                            cca_backend_op_name(op), (void *)event, device);
    return NULL;
}

/* Destroy an event, pending or not. Returns CCA_OK, CCA_ERR_INVALID_ARGUMENT
 * (unknown event), or a fault. */
static cca_status_t sim_event_destroy(void *ctx, int device, cca_event_t event)
{
    sim_ctx_t *c = ctx;
    pthread_mutex_lock(&c->lock);
    cca_status_t st = sim_enter_locked(c, CCA_OP_EVENT_DESTROY);
    if (st != CCA_OK)
        goto out_unlock;
    sim_event_t *e = sim_find_event(c, CCA_OP_EVENT_DESTROY, device, event, &st);
    if (!e)
        goto out_unlock;
    event_unlink(c, e);
    simmap_remove(&c->events, (uint64_t)(uintptr_t)e);
    free(e);
out_unlock:
    pthread_mutex_unlock(&c->lock);
    return st;
}

/* Record an event on stream: complete at once, or (manual mode) pending at the end
 * of the stream's list. Returns CCA_OK, CCA_ERR_INVALID_ARGUMENT, CCA_ERR_BACKEND,
 * or a fault. */
static cca_status_t sim_event_record(void *ctx, int device, cca_event_t event, cca_stream_t stream)
{
    sim_ctx_t *c = ctx;
    pthread_mutex_lock(&c->lock);
    cca_status_t st = sim_enter_locked(c, CCA_OP_EVENT_RECORD);
    if (st != CCA_OK)
        goto out_unlock;
    sim_event_t *e = sim_find_event(c, CCA_OP_EVENT_RECORD, device, event, &st);
    if (!e || !c->manual_events)
        goto out_unlock;
    sim_map_t *streams = &c->devices[device].streams;
    uint64_t key = (uint64_t)(uintptr_t)stream;
    sim_stream_t *s = simmap_get(streams, key);
    if (!s) {
        s = calloc(1, sizeof(*s));
        if (!s || !simmap_reserve(streams)) {
            free(s);
            st = host_oom(CCA_OP_EVENT_RECORD);
            goto out_unlock;
        }
        simmap_put(streams, key, s);
    }
    event_unlink(c, e); /* re-recording re-arms the event */
    e->stream = s;
    e->pending = true;
    e->prev = s->tail;
    e->next = NULL;
    if (s->tail)
        s->tail->next = e;
    else
        s->head = e;
    s->tail = e;
    c->pending_events++;
out_unlock:
    pthread_mutex_unlock(&c->lock);
    return st;
}

/* CCA_OK if the event completed (or was never recorded), CCA_ERR_NOT_READY if
 * pending; CCA_ERR_INVALID_ARGUMENT, or a fault. */
static cca_status_t sim_event_query(void *ctx, int device, cca_event_t event)
{
    sim_ctx_t *c = ctx;
    pthread_mutex_lock(&c->lock);
    cca_status_t st = sim_enter_locked(c, CCA_OP_EVENT_QUERY);
    if (st != CCA_OK)
        goto out_unlock;
    sim_event_t *e = sim_find_event(c, CCA_OP_EVENT_QUERY, device, event, &st);
    if (e && e->pending)
        st = CCA_ERR_NOT_READY; /* a state, not a failure: nothing recorded */
out_unlock:
    pthread_mutex_unlock(&c->lock);
    return st;
}

/* Complete the event and the events recorded before it on its stream. Returns
 * CCA_OK, CCA_ERR_INVALID_ARGUMENT, or a fault. */
static cca_status_t sim_event_synchronize(void *ctx, int device, cca_event_t event)
{
    sim_ctx_t *c = ctx;
    pthread_mutex_lock(&c->lock);
    cca_status_t st = sim_enter_locked(c, CCA_OP_EVENT_SYNCHRONIZE);
    if (st != CCA_OK)
        goto out_unlock;
    sim_event_t *e = sim_find_event(c, CCA_OP_EVENT_SYNCHRONIZE, device, event, &st);
    if (e && e->pending)
        stream_complete(c, e->stream, e);
    if (e)
        sim_pool_sync_locked(c, device);
out_unlock:
    pthread_mutex_unlock(&c->lock);
    return st;
}

/* CCA_CAPTURE_ACTIVE for streams marked by cca_sim_set_capturing, else
 * CCA_CAPTURE_NONE. Returns CCA_OK, CCA_ERR_INVALID_ARGUMENT, or a fault. */
static cca_status_t sim_stream_capture_status(void *ctx, int device, cca_stream_t stream,
                                              int *status)
{
    sim_ctx_t *c = ctx;
    pthread_mutex_lock(&c->lock);
    cca_status_t st = sim_enter_locked(c, CCA_OP_STREAM_CAPTURE_STATUS);
    if (st != CCA_OK)
        goto out_unlock;
    if (device < 0 || device >= c->device_count) {
        st = sim_bad_device(c, CCA_OP_STREAM_CAPTURE_STATUS, device);
        goto out_unlock;
    }
    *status = simmap_get(&c->capturing, (uint64_t)(uintptr_t)stream) ? CCA_CAPTURE_ACTIVE
                                                                    : CCA_CAPTURE_NONE;
out_unlock:
    pthread_mutex_unlock(&c->lock);
    return st;
}

/* ---- virtual memory ---------------------------------------------------------------- */

static cca_status_t vmm_invalid(cca_backend_op_t op, const char *why, const void *addr,
                                size_t size)
{
    return cca_backend_error(CCA_ERR_INVALID_ARGUMENT, SIM_CUDA_INVALID_VALUE,
                             "sim: %s: invalid argument (%p, %zu bytes): %s",
                             cca_backend_op_name(op), addr, size, why);
}

/* The reservation of device holding [addr, addr + size), or NULL. */
static sim_resv_t *find_resv(sim_ctx_t *c, int device, uint64_t addr, uint64_t size)
{
    if (size == 0 || addr + size < addr)
        return NULL;
    sim_range_t *n = simrange_find_le(c->live, addr);
    if (!n || n->kind != SIM_RANGE_RESV || addr + size > n->start + n->len)
        return NULL;
    sim_resv_t *r = n->data;
    return r->device == device ? r : NULL;
}

/* The configured granularity. Returns CCA_OK, CCA_ERR_INVALID_ARGUMENT, or a fault. */
static cca_status_t sim_vmm_granularity(void *ctx, int device, size_t *granularity)
{
    sim_ctx_t *c = ctx;
    pthread_mutex_lock(&c->lock);
    cca_status_t st = sim_enter_locked(c, CCA_OP_VMM_GRANULARITY);
    if (st != CCA_OK)
        goto out_unlock;
    if (device < 0 || device >= c->device_count) {
        st = sim_bad_device(c, CCA_OP_VMM_GRANULARITY, device);
        goto out_unlock;
    }
    *granularity = c->granularity;
out_unlock:
    pthread_mutex_unlock(&c->lock);
    return st;
}

/* Reserve address space (no device memory). Returns CCA_OK,
 * CCA_ERR_INVALID_ARGUMENT, CCA_ERR_OUT_OF_MEMORY (no address space),
 * CCA_ERR_BACKEND (list entry overlaps, host memory), or a fault. */
static cca_status_t sim_vmm_reserve(void *ctx, int device, size_t size, void **addr)
{
    sim_ctx_t *c = ctx;
    sim_resv_t *r = NULL;
    uint64_t base = 0;
    pthread_mutex_lock(&c->lock);
    cca_status_t st = sim_enter_locked(c, CCA_OP_VMM_RESERVE);
    if (st != CCA_OK)
        goto out_unlock;
    if (device < 0 || device >= c->device_count) {
        st = sim_bad_device(c, CCA_OP_VMM_RESERVE, device);
        goto out_unlock;
    }
    if (!addr || size == 0 || size % c->granularity != 0) {
        st = vmm_invalid(CCA_OP_VMM_RESERVE, "size must be a non-zero multiple of the granularity",
                         NULL, size);
        goto out_unlock;
    }
    r = calloc(1, sizeof(*r));
    if (!r || !spare_reserve(c, spare_need(c))) {
        st = host_oom(CCA_OP_VMM_RESERVE);
        goto out_free_resv;
    }
    if (c->backed) {
        void *mem = mmap(NULL, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (mem == MAP_FAILED) {
            st = cca_backend_error(CCA_ERR_OUT_OF_MEMORY, SIM_CUDA_OUT_OF_MEMORY,
                                   "CUDA error: out of memory (sim: vmm_reserve of %zu bytes: "
                                   "mmap failed)",
                                   size);
            goto out_free_resv;
        }
        base = (uint64_t)(uintptr_t)mem;
        simrange_insert(&c->live, spare_take(c, base, size, SIM_RANGE_RESV, r));
    } else {
        uint64_t align = size >= SIM_LARGE_ALIGN ? SIM_LARGE_ALIGN : SIM_SMALL_ALIGN;
        if (align < c->granularity)
            align = c->granularity;
        st = place_range(c, CCA_OP_VMM_RESERVE, device, size, align, SIM_RANGE_RESV, r, &base);
        if (st != CCA_OK)
            goto out_free_resv;
    }
    r->addr = base;
    r->size = size;
    r->device = device;
    c->live_reservations++;
    *addr = (void *)(uintptr_t)base;
    goto out_unlock;
out_free_resv:
    free(r);
out_unlock:
    pthread_mutex_unlock(&c->lock);
    return st;
}

/* Free a whole, unmapped reservation. Returns CCA_OK, CCA_ERR_INVALID_ARGUMENT,
 * or a fault. */
static cca_status_t sim_vmm_free(void *ctx, int device, void *addr, size_t size)
{
    sim_ctx_t *c = ctx;
    uint64_t base = (uint64_t)(uintptr_t)addr;
    pthread_mutex_lock(&c->lock);
    cca_status_t st = sim_enter_locked(c, CCA_OP_VMM_FREE);
    if (st != CCA_OK)
        goto out_unlock;
    if (device < 0 || device >= c->device_count) {
        st = sim_bad_device(c, CCA_OP_VMM_FREE, device);
        goto out_unlock;
    }
    sim_resv_t *r = find_resv(c, device, base, size);
    if (!r || r->addr != base || r->size != size) {
        st = vmm_invalid(CCA_OP_VMM_FREE, "not a live reservation of this device", addr, size);
        goto out_unlock;
    }
    if (r->mapping_count) {
        st = vmm_invalid(CCA_OP_VMM_FREE, "the reservation still has mappings", addr, size);
        goto out_unlock;
    }
    spare_reserve(c, spare_need(c)); /* best effort: see window_release */
    unplace_range(c, base);
    if (c->backed)
        munmap(addr, size);
    free(r);
    c->live_reservations--;
out_unlock:
    pthread_mutex_unlock(&c->lock);
    return st;
}

/* Create size bytes of physical memory, counted against the cap. Returns CCA_OK,
 * CCA_ERR_OUT_OF_MEMORY, CCA_ERR_INVALID_ARGUMENT, CCA_ERR_BACKEND, or a fault. */
static cca_status_t sim_vmm_create(void *ctx, int device, size_t size, cca_phys_handle_t *handle)
{
    sim_ctx_t *c = ctx;
    pthread_mutex_lock(&c->lock);
    cca_status_t st = sim_enter_locked(c, CCA_OP_VMM_CREATE);
    if (st != CCA_OK)
        goto out_unlock;
    if (device < 0 || device >= c->device_count) {
        st = sim_bad_device(c, CCA_OP_VMM_CREATE, device);
        goto out_unlock;
    }
    if (!handle || size == 0 || size % c->granularity != 0) {
        st = vmm_invalid(CCA_OP_VMM_CREATE, "size must be a non-zero multiple of the granularity",
                         NULL, size);
        goto out_unlock;
    }
    st = sim_check_capacity(c, CCA_OP_VMM_CREATE, device, size);
    if (st != CCA_OK)
        goto out_unlock;
    sim_phys_t *p = calloc(1, sizeof(*p));
    if (!p || !simmap_reserve(&c->phys)) {
        free(p);
        st = host_oom(CCA_OP_VMM_CREATE);
        goto out_unlock;
    }
    p->id = ++c->next_serial;
    p->device = device;
    p->size = size;
    simmap_put(&c->phys, p->id, p);
    c->devices[device].used += size;
    c->live_handles++;
    *handle = p->id;
out_unlock:
    pthread_mutex_unlock(&c->lock);
    return st;
}

/* Free a physical handle's memory once it is released and unmapped. */
static void phys_maybe_free(sim_ctx_t *c, sim_phys_t *p)
{
    if (!p->released || p->map_count)
        return;
    simmap_remove(&c->phys, p->id);
    c->devices[p->device].used -= p->size;
    free(p);
}

/* Release a handle; its memory goes with its last mapping. Returns CCA_OK,
 * CCA_ERR_INVALID_ARGUMENT (unknown or released), or a fault. */
static cca_status_t sim_vmm_release(void *ctx, int device, cca_phys_handle_t handle)
{
    sim_ctx_t *c = ctx;
    pthread_mutex_lock(&c->lock);
    cca_status_t st = sim_enter_locked(c, CCA_OP_VMM_RELEASE);
    if (st != CCA_OK)
        goto out_unlock;
    sim_phys_t *p = simmap_get(&c->phys, handle);
    if (!p || p->released || p->device != device) {
        st = cca_backend_error(CCA_ERR_INVALID_ARGUMENT, SIM_CUDA_INVALID_VALUE,
                               "sim: vmm_release: invalid argument (handle %llu is not a live "
                               "physical handle of device %d)",
                               (unsigned long long)handle, device);
        goto out_unlock;
    }
    p->released = true;
    c->live_handles--;
    phys_maybe_free(c, p);
out_unlock:
    pthread_mutex_unlock(&c->lock);
    return st;
}

/* Map a live handle at a granularity-aligned, unmapped range of a reservation.
 * Returns CCA_OK, CCA_ERR_INVALID_ARGUMENT, CCA_ERR_BACKEND, or a fault. */
static cca_status_t sim_vmm_map(void *ctx, int device, void *addr, size_t size,
                                cca_phys_handle_t handle)
{
    sim_ctx_t *c = ctx;
    uint64_t start = (uint64_t)(uintptr_t)addr;
    pthread_mutex_lock(&c->lock);
    cca_status_t st = sim_enter_locked(c, CCA_OP_VMM_MAP);
    if (st != CCA_OK)
        goto out_unlock;
    sim_resv_t *r = find_resv(c, device, start, size);
    if (!r) {
        st = vmm_invalid(CCA_OP_VMM_MAP, "not inside a live reservation of this device", addr,
                         size);
        goto out_unlock;
    }
    if ((start - r->addr) % c->granularity || size % c->granularity) {
        st = vmm_invalid(CCA_OP_VMM_MAP, "offset and size must be multiples of the granularity",
                         addr, size);
        goto out_unlock;
    }
    sim_phys_t *p = simmap_get(&c->phys, handle);
    if (!p || p->released || p->device != device || p->size < size) {
        st = vmm_invalid(CCA_OP_VMM_MAP,
                         "the handle is not a live physical handle of this device holding "
                         "at least size bytes",
                         addr, size);
        goto out_unlock;
    }
    sim_range_t *o = simrange_find_le(r->mapped, start + size - 1);
    if (o && o->start + o->len > start) {
        st = vmm_invalid(CCA_OP_VMM_MAP, "the range overlaps a mapped range", addr, size);
        goto out_unlock;
    }
    if (!spare_reserve(c, 1)) {
        st = host_oom(CCA_OP_VMM_MAP);
        goto out_unlock;
    }
    if (c->backed && mprotect(addr, size, PROT_READ | PROT_WRITE) != 0) {
        st = cca_backend_error(CCA_ERR_BACKEND, 0,
                               "sim: vmm_map: mprotect of %p (%zu bytes) failed", addr, size);
        goto out_unlock;
    }
    simrange_insert(&r->mapped, spare_take(c, start, size, SIM_RANGE_MAPPING, p));
    r->mapping_count++;
    p->map_count++;
out_unlock:
    pthread_mutex_unlock(&c->lock);
    return st;
}

/* True if [start, start + size) is exactly a run of adjacent mappings of r. */
static bool mappings_exact(sim_resv_t *r, uint64_t start, uint64_t size)
{
    uint64_t end = start + size, at = start;
    sim_range_t *m;
    while ((m = simrange_find_ge(r->mapped, at)) && m->start == at) {
        at += m->len;
        if (at >= end)
            return at == end;
    }
    return false;
}

/* Unmap a run of whole mappings. Returns CCA_OK, CCA_ERR_INVALID_ARGUMENT, or a fault. */
static cca_status_t sim_vmm_unmap(void *ctx, int device, void *addr, size_t size)
{
    sim_ctx_t *c = ctx;
    uint64_t start = (uint64_t)(uintptr_t)addr;
    pthread_mutex_lock(&c->lock);
    cca_status_t st = sim_enter_locked(c, CCA_OP_VMM_UNMAP);
    if (st != CCA_OK)
        goto out_unlock;
    sim_resv_t *r = find_resv(c, device, start, size);
    if (!r || !mappings_exact(r, start, size)) {
        st = vmm_invalid(CCA_OP_VMM_UNMAP, "the range is not exactly a run of mapped ranges", addr,
                         size);
        goto out_unlock;
    }
    for (uint64_t at = start; at < start + size;) {
        sim_range_t *m = simrange_remove(&r->mapped, at);
        sim_phys_t *p = m->data;
        at += m->len;
        spare_give(c, m);
        r->mapping_count--;
        p->map_count--;
        phys_maybe_free(c, p);
    }
    if (c->backed) {
        mprotect(addr, size, PROT_NONE);
        madvise(addr, size, MADV_DONTNEED);
    }
out_unlock:
    pthread_mutex_unlock(&c->lock);
    return st;
}

/* Check that the range is entirely mapped (mapping already grants access).
 * Returns CCA_OK, CCA_ERR_INVALID_ARGUMENT, or a fault. */
static cca_status_t sim_vmm_set_access(void *ctx, int device, void *addr, size_t size)
{
    sim_ctx_t *c = ctx;
    uint64_t start = (uint64_t)(uintptr_t)addr;
    pthread_mutex_lock(&c->lock);
    cca_status_t st = sim_enter_locked(c, CCA_OP_VMM_SET_ACCESS);
    if (st != CCA_OK)
        goto out_unlock;
    sim_resv_t *r = find_resv(c, device, start, size);
    if (!r) {
        st = vmm_invalid(CCA_OP_VMM_SET_ACCESS, "not inside a live reservation of this device",
                         addr, size);
        goto out_unlock;
    }
    /* walk from the mapping holding start; later ones must follow without gaps */
    sim_range_t *m = simrange_find_le(r->mapped, start);
    uint64_t at = start, end = start + size;
    while (m && m->start <= at && m->start + m->len > at) {
        at = m->start + m->len;
        if (at >= end)
            goto out_unlock;
        m = simrange_find_ge(r->mapped, at);
    }
    st = vmm_invalid(CCA_OP_VMM_SET_ACCESS, "the range is not entirely mapped", addr, size);
out_unlock:
    pthread_mutex_unlock(&c->lock);
    return st;
}

/* ---- host memory -------------------------------------------------------------------- */

static cca_status_t host_invalid(cca_backend_op_t op, const char *why, const void *ptr)
{
    return cca_backend_error(CCA_ERR_INVALID_ARGUMENT, SIM_CUDA_INVALID_VALUE,
                             "sim: %s: invalid argument (%p): %s", cca_backend_op_name(op), ptr,
                             why);
}

/* Page-aligned real host memory. Returns CCA_OK, CCA_ERR_INVALID_ARGUMENT,
 * CCA_ERR_OUT_OF_MEMORY, or a fault. */
static cca_status_t sim_host_alloc(void *ctx, size_t size, void **ptr)
{
    sim_ctx_t *c = ctx;
    pthread_mutex_lock(&c->lock);
    cca_status_t st = sim_enter_locked(c, CCA_OP_HOST_ALLOC);
    if (st != CCA_OK)
        goto out_unlock;
    if (!ptr || size == 0) {
        st = host_invalid(CCA_OP_HOST_ALLOC, "size must be non-zero", NULL);
        goto out_unlock;
    }
    sim_host_t *h = calloc(1, sizeof(*h));
    void *mem = NULL;
    if (!h || !simmap_reserve(&c->host) || posix_memalign(&mem, 4096, size) != 0) {
        free(h);
        st = cca_backend_error(CCA_ERR_OUT_OF_MEMORY, SIM_CUDA_OUT_OF_MEMORY,
                               "CUDA error: out of memory (sim: host_alloc of %zu bytes)", size);
        goto out_unlock;
    }
    h->ptr = mem;
    h->size = size;
    simmap_put(&c->host, (uint64_t)(uintptr_t)mem, h);
    c->live_host++;
    *ptr = mem;
out_unlock:
    pthread_mutex_unlock(&c->lock);
    return st;
}

/* Free host_alloc memory (NULL: nothing). Returns CCA_OK, CCA_ERR_INVALID_ARGUMENT,
 * or a fault. */
static cca_status_t sim_host_free(void *ctx, void *ptr)
{
    sim_ctx_t *c = ctx;
    pthread_mutex_lock(&c->lock);
    cca_status_t st = sim_enter_locked(c, CCA_OP_HOST_FREE);
    if (st != CCA_OK || !ptr)
        goto out_unlock; /* cudaFreeHost(NULL) does nothing */
    sim_host_t *h = simmap_get(&c->host, (uint64_t)(uintptr_t)ptr);
    if (!h || h->registered) {
        st = host_invalid(CCA_OP_HOST_FREE, "not memory from host_alloc", ptr);
        goto out_unlock;
    }
    simmap_remove(&c->host, (uint64_t)(uintptr_t)ptr);
    free(h->ptr);
    free(h);
    c->live_host--;
out_unlock:
    pthread_mutex_unlock(&c->lock);
    return st;
}

/* Record a registration; the device pointer is ptr. Returns CCA_OK,
 * CCA_ERR_INVALID_ARGUMENT (NULL, size 0, already registered), CCA_ERR_BACKEND, or a fault. */
static cca_status_t sim_host_register(void *ctx, void *ptr, size_t size, void **device_ptr)
{
    sim_ctx_t *c = ctx;
    pthread_mutex_lock(&c->lock);
    cca_status_t st = sim_enter_locked(c, CCA_OP_HOST_REGISTER);
    if (st != CCA_OK)
        goto out_unlock;
    if (!ptr || size == 0 || !device_ptr) {
        st = host_invalid(CCA_OP_HOST_REGISTER, "NULL pointer or size 0", ptr);
        goto out_unlock;
    }
    if (simmap_get(&c->host, (uint64_t)(uintptr_t)ptr)) {
        st = host_invalid(CCA_OP_HOST_REGISTER, "host memory already registered", ptr);
        goto out_unlock;
    }
    sim_host_t *h = calloc(1, sizeof(*h));
    if (!h || !simmap_reserve(&c->host)) {
        free(h);
        st = host_oom(CCA_OP_HOST_REGISTER);
        goto out_unlock;
    }
    h->ptr = ptr;
    h->size = size;
    h->registered = true;
    simmap_put(&c->host, (uint64_t)(uintptr_t)ptr, h);
    c->live_host++;
    *device_ptr = ptr;
out_unlock:
    pthread_mutex_unlock(&c->lock);
    return st;
}

/* Remove a registration. Returns CCA_OK, CCA_ERR_INVALID_ARGUMENT, or a fault. */
static cca_status_t sim_host_unregister(void *ctx, void *ptr)
{
    sim_ctx_t *c = ctx;
    pthread_mutex_lock(&c->lock);
    cca_status_t st = sim_enter_locked(c, CCA_OP_HOST_UNREGISTER);
    if (st != CCA_OK)
        goto out_unlock;
    sim_host_t *h = simmap_get(&c->host, (uint64_t)(uintptr_t)ptr);
    if (!h || !h->registered) {
        st = host_invalid(CCA_OP_HOST_UNREGISTER, "host memory not registered", ptr);
        goto out_unlock;
    }
    simmap_remove(&c->host, (uint64_t)(uintptr_t)ptr);
    free(h);
    c->live_host--;
out_unlock:
    pthread_mutex_unlock(&c->lock);
    return st;
}

/* ---- IPC ---------------------------------------------------------------------------- */

/*
 * Layout of a handle: magic[8], backend id, device, pointer, serial, the
 * owner's process id and, in ipc_shared mode, its shared memory file (else
 * -1), check. Another process opens the file through /proc/<pid>/fd/<fd> and
 * maps it, as cudaIpcOpenMemHandle maps the owner's allocation.
 */
typedef struct sim_ipc_fields {
    uint64_t backend_id;
    uint64_t device;
    uint64_t ptr;
    uint64_t serial;
    int64_t pid;
    int64_t fd;
} sim_ipc_fields_t;

_Static_assert(8 + sizeof(sim_ipc_fields_t) + 8 <= sizeof(cca_ipc_handle_t), "sim IPC handle size");

static uint64_t ipc_check(const sim_ipc_fields_t *f)
{
    uint64_t h = simmap_hash(f->backend_id ^ simmap_hash(f->device ^ simmap_hash(f->ptr ^ simmap_hash(f->serial))));
    return simmap_hash(h ^ simmap_hash((uint64_t)f->pid ^ simmap_hash((uint64_t)f->fd)));
}

/* Map the shared memory of another process's allocation (ipc_shared mode). */
static cca_status_t ipc_open_foreign(sim_ctx_t *c, const sim_ipc_fields_t *f, void **ptr)
{
    char path[64];
    snprintf(path, sizeof(path), "/proc/%lld/fd/%lld", (long long)f->pid, (long long)f->fd);
    int fd = f->fd >= 0 ? open(path, O_RDWR | O_CLOEXEC) : -1;
    struct stat sb;
    if (fd < 0 || fstat(fd, &sb) != 0 || sb.st_size <= 0) {
        if (fd >= 0)
            close(fd);
        return cca_backend_error(CCA_ERR_BACKEND, SIM_CUDA_INVALID_VALUE,
                                 "sim: ipc_open: the memory of process %lld cannot be opened "
                                 "(%s; it must be a simulated backend in ipc_shared mode, and "
                                 "alive)",
                                 (long long)f->pid, f->fd >= 0 ? path : "no shared memory file");
    }
    if (!simmap_reserve(&c->ipc_maps)) {
        close(fd);
        return host_oom(CCA_OP_IPC_OPEN);
    }
    void *mem = mmap(NULL, (size_t)sb.st_size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (mem == MAP_FAILED)
        return cca_backend_error(CCA_ERR_BACKEND, 0, "sim: ipc_open: mmap of %s failed", path);
    simmap_put(&c->ipc_maps, (uint64_t)(uintptr_t)mem, (void *)(uintptr_t)sb.st_size);
    *ptr = mem;
    return CCA_OK;
}

/* Encode (backend, device, pointer, serial) of a live allocation. Returns CCA_OK,
 * CCA_ERR_INVALID_ARGUMENT, or a fault. */
static cca_status_t sim_ipc_get_handle(void *ctx, int device, void *ptr, cca_ipc_handle_t *handle)
{
    sim_ctx_t *c = ctx;
    pthread_mutex_lock(&c->lock);
    cca_status_t st = sim_enter_locked(c, CCA_OP_IPC_GET);
    if (st != CCA_OK)
        goto out_unlock;
    sim_alloc_t *rec = simmap_get(&c->allocs, (uint64_t)(uintptr_t)ptr);
    if (!rec || rec->device != device || !handle) {
        st = cca_backend_error(CCA_ERR_INVALID_ARGUMENT, SIM_CUDA_INVALID_VALUE,
                               "sim: ipc_get_handle: invalid argument (%p is not a live "
                               "allocation of device %d)",
                               ptr, device);
        goto out_unlock;
    }
    sim_ipc_fields_t f = {c->ipc_id, (uint64_t)device, rec->addr, rec->serial, (int64_t)getpid(),
                          (int64_t)rec->fd};
    uint64_t check = ipc_check(&f);
    memset(handle, 0, sizeof(*handle));
    memcpy(handle->bytes, ipc_magic, sizeof(ipc_magic));
    memcpy(handle->bytes + 8, &f, sizeof(f));
    memcpy(handle->bytes + 8 + sizeof(f), &check, sizeof(check));
out_unlock:
    pthread_mutex_unlock(&c->lock);
    return st;
}

/* Open a handle of this backend: its pointer, counted as an open mapping. Returns
 * CCA_OK, CCA_ERR_INVALID_ARGUMENT (corrupt, foreign or stale), CCA_ERR_BACKEND, or a fault. */
static cca_status_t sim_ipc_open(void *ctx, int device, const cca_ipc_handle_t *handle, void **ptr)
{
    sim_ctx_t *c = ctx;
    sim_ipc_fields_t f;
    uint64_t check;
    pthread_mutex_lock(&c->lock);
    cca_status_t st = sim_enter_locked(c, CCA_OP_IPC_OPEN);
    if (st != CCA_OK)
        goto out_unlock;
    if (device < 0 || device >= c->device_count) {
        st = sim_bad_device(c, CCA_OP_IPC_OPEN, device);
        goto out_unlock;
    }
    if (!handle || !ptr || memcmp(handle->bytes, ipc_magic, sizeof(ipc_magic)) != 0)
        goto out_invalid;
    memcpy(&f, handle->bytes + 8, sizeof(f));
    memcpy(&check, handle->bytes + 8 + sizeof(f), sizeof(check));
    if (check != ipc_check(&f))
        goto out_invalid;
    if (f.pid != (int64_t)getpid()) {
        st = ipc_open_foreign(c, &f, ptr);
        goto out_unlock;
    }
    if (f.backend_id != c->ipc_id)
        goto out_invalid;
    sim_alloc_t *rec = simmap_get(&c->allocs, f.ptr);
    if (!rec || rec->serial != f.serial || (uint64_t)rec->device != f.device)
        goto out_invalid;
    uintptr_t opens = (uintptr_t)simmap_get(&c->ipc_opens, f.ptr);
    if (opens) {
        simmap_remove(&c->ipc_opens, f.ptr);
    } else if (!simmap_reserve(&c->ipc_opens)) {
        st = host_oom(CCA_OP_IPC_OPEN);
        goto out_unlock;
    }
    simmap_put(&c->ipc_opens, f.ptr, (void *)(opens + 1));
    *ptr = (void *)(uintptr_t)f.ptr;
    goto out_unlock;
out_invalid:
    st = cca_backend_error(CCA_ERR_INVALID_ARGUMENT, SIM_CUDA_INVALID_VALUE,
                           "sim: ipc_open: invalid argument (corrupt or stale IPC handle)");
out_unlock:
    pthread_mutex_unlock(&c->lock);
    return st;
}

/* Close an open mapping. Returns CCA_OK, CCA_ERR_INVALID_ARGUMENT, or a fault. */
static cca_status_t sim_ipc_close(void *ctx, int device, void *ptr)
{
    sim_ctx_t *c = ctx;
    uint64_t key = (uint64_t)(uintptr_t)ptr;
    pthread_mutex_lock(&c->lock);
    cca_status_t st = sim_enter_locked(c, CCA_OP_IPC_CLOSE);
    if (st != CCA_OK)
        goto out_unlock;
    if (device < 0 || device >= c->device_count) {
        st = sim_bad_device(c, CCA_OP_IPC_CLOSE, device);
        goto out_unlock;
    }
    uintptr_t mapped = (uintptr_t)simmap_remove(&c->ipc_maps, key);
    if (mapped) {
        munmap(ptr, (size_t)mapped);
        goto out_unlock;
    }
    uintptr_t opens = (uintptr_t)simmap_remove(&c->ipc_opens, key);
    if (!opens) {
        st = cca_backend_error(CCA_ERR_INVALID_ARGUMENT, SIM_CUDA_INVALID_VALUE,
                               "sim: ipc_close: invalid argument (%p is not an open IPC "
                               "mapping)",
                               ptr);
        goto out_unlock;
    }
    if (opens > 1)
        simmap_put(&c->ipc_opens, key, (void *)(opens - 1)); /* the slot just freed */
out_unlock:
    pthread_mutex_unlock(&c->lock);
    return st;
}

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
static void sim_destroy(void *ctx)
{
    sim_ctx_t *c = ctx;
    if (!c)
        return;
    for (size_t i = 0; c->allocs.slots && i <= c->allocs.mask; i++) {
        sim_alloc_t *a = c->allocs.slots[i].value;
        if (!a)
            continue;
        if (a->fd >= 0 || c->backed)
            alloc_memory_release(c, a); /* address-only ranges go with the tree below */
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
    free(c->addr_list);
    pthread_key_delete(c->current);
    pthread_mutex_destroy(&c->lock);
    free(c);
}

/* Append count addresses to the list (lock held or not yet shared). */
static cca_status_t append_addresses(sim_ctx_t *c, const uint64_t *addresses, size_t count)
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
        if (!spare_reserve(c, 1)) {
            st = cca_backend_error(CCA_ERR_OUT_OF_MEMORY, 0, "sim: out of host memory");
            goto out_destroy;
        }
        simrange_insert(&dev->free_ranges,
                  spare_take(c, dev->window_start, window, SIM_RANGE_FREE, NULL));
    }
    st = append_addresses(c, cfg.addresses, cfg.address_count);
    if (st != CCA_OK)
        goto out_destroy;

    cca_backend_t *b = &c->backend;
    b->name = "sim";
    b->ctx = c;
    b->device_count = sim_device_count;
    b->device_props = sim_device_props;
    b->get_device = sim_get_device;
    b->set_device = sim_set_device;
    b->mem_get_info = sim_mem_get_info;
    b->malloc = sim_malloc;
    b->free = sim_free;
    b->stream_synchronize = sim_stream_synchronize;
    b->device_synchronize = sim_device_synchronize;
    b->event_create = sim_event_create;
    b->event_destroy = sim_event_destroy;
    b->event_record = sim_event_record;
    b->event_query = sim_event_query;
    b->event_synchronize = sim_event_synchronize;
    b->stream_capture_status = sim_stream_capture_status;
    b->vmm_granularity = sim_vmm_granularity;
    b->vmm_reserve = sim_vmm_reserve;
    b->vmm_free = sim_vmm_free;
    b->vmm_create = sim_vmm_create;
    b->vmm_release = sim_vmm_release;
    b->vmm_map = sim_vmm_map;
    b->vmm_unmap = sim_vmm_unmap;
    b->vmm_set_access = sim_vmm_set_access;
    b->host_alloc = sim_host_alloc;
    b->host_free = sim_host_free;
    b->host_register = sim_host_register;
    b->host_unregister = sim_host_unregister;
    b->ipc_get_handle = sim_ipc_get_handle;
    b->ipc_open = sim_ipc_open;
    b->ipc_close = sim_ipc_close;
    sim_multi_install(b);
    b->destroy = sim_destroy;
    *backend = b;
    return CCA_OK;
out_destroy:
    sim_destroy(c);
    return st;
}

/* ---- test and replay controls --------------------------------------------------- */

/* The simulated backend behind b, or NULL if b is not one. */
static sim_ctx_t *sim_of(cca_backend_t *b)
{
    return b && b->destroy == sim_destroy ? b->ctx : NULL;
}

static cca_status_t not_sim(const char *fn)
{
    return cca_raise(CCA_ERR_INVALID_ARGUMENT, "%s: the backend is not a simulated backend", fn);
}

/* Arm (or with nth == 0 disarm) the fault of op; see cca_backend.h. */
cca_status_t cca_sim_inject_fault(cca_backend_t *backend, cca_backend_op_t op, uint64_t nth,
                                  bool persistent, cca_status_t status)
{
    sim_ctx_t *c = sim_of(backend);
    if (!c)
        return not_sim(__func__);
    if ((int)op < 0 || op >= CCA_OP_COUNT)
        return cca_raise(CCA_ERR_INVALID_ARGUMENT, "cca_sim_inject_fault: unknown operation %d",
                         (int)op);
    if (nth && status == CCA_OK)
        return cca_raise(CCA_ERR_INVALID_ARGUMENT,
                         "cca_sim_inject_fault: an injected fault needs a failure status");
    pthread_mutex_lock(&c->lock);
    sim_fault_t *f = &c->faults[op];
    memset(f, 0, sizeof(*f));
    f->countdown = nth;
    f->persistent = persistent;
    f->status = status;
    pthread_mutex_unlock(&c->lock);
    return CCA_OK;
}

void cca_sim_clear_faults(cca_backend_t *backend)
{
    sim_ctx_t *c = sim_of(backend);
    if (!c)
        return;
    pthread_mutex_lock(&c->lock);
    memset(c->faults, 0, sizeof(c->faults));
    pthread_mutex_unlock(&c->lock);
}

uint64_t cca_sim_call_count(cca_backend_t *backend, cca_backend_op_t op)
{
    sim_ctx_t *c = sim_of(backend);
    if (!c || (int)op < 0 || op >= CCA_OP_COUNT)
        return 0;
    pthread_mutex_lock(&c->lock);
    uint64_t n = c->calls[op];
    pthread_mutex_unlock(&c->lock);
    return n;
}

cca_status_t cca_sim_usage(cca_backend_t *backend, cca_sim_usage_t *usage)
{
    sim_ctx_t *c = sim_of(backend);
    if (!c)
        return not_sim(__func__);
    if (!usage)
        return cca_raise(CCA_ERR_INVALID_ARGUMENT, "cca_sim_usage: usage is NULL");
    pthread_mutex_lock(&c->lock);
    memset(usage, 0, sizeof(*usage));
    for (int d = 0; d < c->device_count; d++)
        usage->device_bytes[d] = c->devices[d].used;
    usage->live_allocations = c->allocs.count;
    usage->live_events = c->events.count;
    usage->live_reservations = c->live_reservations;
    usage->live_handles = c->live_handles;
    usage->live_host = c->live_host;
    pthread_mutex_unlock(&c->lock);
    return CCA_OK;
}

cca_status_t cca_sim_complete_stream(cca_backend_t *backend, int device, cca_stream_t stream,
                                     bool all)
{
    sim_ctx_t *c = sim_of(backend);
    if (!c)
        return not_sim(__func__);
    if (device < -1 || device >= c->device_count || (device == -1 && !all))
        return cca_raise(CCA_ERR_INVALID_ARGUMENT,
                         "cca_sim_complete_stream: invalid device %d (-1 only with all)", device);
    pthread_mutex_lock(&c->lock);
    if (device == -1) {
        for (int d = 0; d < c->device_count; d++)
            device_complete(c, d);
    } else if (all) {
        device_complete(c, device);
    } else {
        sim_stream_t *s = simmap_get(&c->devices[device].streams, (uint64_t)(uintptr_t)stream);
        if (s)
            stream_complete(c, s, NULL);
    }
    pthread_mutex_unlock(&c->lock);
    return CCA_OK;
}

uint64_t cca_sim_pending_events(cca_backend_t *backend)
{
    sim_ctx_t *c = sim_of(backend);
    if (!c)
        return 0;
    pthread_mutex_lock(&c->lock);
    uint64_t n = c->pending_events;
    pthread_mutex_unlock(&c->lock);
    return n;
}

cca_status_t cca_sim_set_cap(cca_backend_t *backend, int device, size_t cap)
{
    sim_ctx_t *c = sim_of(backend);
    if (!c)
        return not_sim(__func__);
    if (device < 0 || device >= c->device_count)
        return cca_raise(CCA_ERR_INVALID_ARGUMENT, "cca_sim_set_cap: invalid device %d", device);
    pthread_mutex_lock(&c->lock);
    c->devices[device].cap = cap ? cap : c->devices[device].total;
    pthread_mutex_unlock(&c->lock);
    return CCA_OK;
}

cca_status_t cca_sim_push_addresses(cca_backend_t *backend, const uint64_t *addresses, size_t count)
{
    sim_ctx_t *c = sim_of(backend);
    if (!c)
        return not_sim(__func__);
    pthread_mutex_lock(&c->lock);
    cca_status_t st = append_addresses(c, addresses, count);
    pthread_mutex_unlock(&c->lock);
    return st;
}

cca_status_t cca_sim_set_capturing(cca_backend_t *backend, cca_stream_t stream, bool capturing)
{
    sim_ctx_t *c = sim_of(backend);
    if (!c)
        return not_sim(__func__);
    cca_status_t st = CCA_OK;
    uint64_t key = (uint64_t)(uintptr_t)stream;
    pthread_mutex_lock(&c->lock);
    if (!capturing)
        simmap_remove(&c->capturing, key);
    else if (simmap_get(&c->capturing, key))
        ; /* already capturing */
    else if (simmap_reserve(&c->capturing))
        simmap_put(&c->capturing, key, (void *)1);
    else
        st = cca_raise(CCA_ERR_OUT_OF_MEMORY, "cca_sim_set_capturing: out of host memory");
    pthread_mutex_unlock(&c->lock);
    return st;
}
