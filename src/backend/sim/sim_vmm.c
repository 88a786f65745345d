/*
 * sim_vmm.c - the simulated backend's virtual memory (cuMem*): reservations
 * of address space (placed by the address rules of sim.c, or mmap(PROT_NONE)
 * in backed mode), physical handles counted against the device cap, and
 * mappings of handles into reservations.
 * In ipc_shared mode a physical handle is a shared memory file mapped over
 * its range (MAP_SHARED), which vmm_export hands out as a file descriptor
 * and another process's vmm_import maps in turn (the CUDA model of
 * CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR).
 * Invariant: a reservation's mappings never overlap and lie inside it; a
 * physical handle's memory is freed only once it is released and unmapped.
 */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "simulator.h"

/* ---- virtual memory ---------------------------------------------------------------- */

static cca_status_t vmm_invalid(cca_backend_op_t op, const char *why, const void *addr,
                                size_t size)
{
    return cca_backend_error(CCA_ERR_INVALID_ARGUMENT, SIM_CUDA_INVALID_VALUE,
                             "sim: %s: invalid argument (%p, %zu bytes): %s",
                             cca_backend_op_name(op), addr, size, why);
}

/* The reservation of device (-1: of any device) holding [addr, addr + size), or NULL. */
static sim_resv_t *find_resv(sim_ctx_t *c, int device, uint64_t addr, uint64_t size)
{
    if (size == 0 || addr + size < addr)
        return NULL;
    sim_range_t *n = simrange_find_le(c->live, addr);
    if (!n || n->kind != SIM_RANGE_RESV || addr + size > n->start + n->len)
        return NULL;
    sim_resv_t *r = n->data;
    return device < 0 || r->device == device ? r : NULL;
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
    if (!r || !sim_spare_reserve(c, sim_spare_need(c))) {
        st = sim_host_oom(CCA_OP_VMM_RESERVE);
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
        simrange_insert(&c->live, sim_spare_take(c, base, size, SIM_RANGE_RESV, r));
    } else {
        uint64_t align = size >= SIM_LARGE_ALIGN ? SIM_LARGE_ALIGN : SIM_SMALL_ALIGN;
        if (align < c->granularity)
            align = c->granularity;
        st = sim_place_range(c, CCA_OP_VMM_RESERVE, device, size, align, SIM_RANGE_RESV, r, &base);
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
    sim_spare_reserve(c, sim_spare_need(c)); /* best effort: see window_release */
    sim_unplace_range(c, base);
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
        st = sim_host_oom(CCA_OP_VMM_CREATE);
        goto out_unlock;
    }
    p->fd = -1;
    if (c->ipc_shared) {
        p->fd = memfd_create("cca-sim-physical-memory", MFD_CLOEXEC);
        if (p->fd < 0 || ftruncate(p->fd, (off_t)size) != 0) {
            if (p->fd >= 0)
                close(p->fd);
            free(p);
            st = cca_backend_error(CCA_ERR_OUT_OF_MEMORY, SIM_CUDA_OUT_OF_MEMORY,
                                   "CUDA error: out of memory (sim: vmm_create of %zu bytes: no "
                                   "shared memory file)",
                                   size);
            goto out_unlock;
        }
    }
    p->id = ++c->next_serial;
    p->device = device;
    p->size = size;
    simmap_put(&c->phys, p->id, p);
    sim_use(&c->devices[device], size);
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
    if (!p->imported)
        c->devices[p->device].used -= p->size;
    if (p->fd >= 0)
        close(p->fd);
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
    if (!sim_spare_reserve(c, 1)) {
        st = sim_host_oom(CCA_OP_VMM_MAP);
        goto out_unlock;
    }
    if (p->fd >= 0) {
        if (mmap(addr, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, p->fd, 0) ==
            MAP_FAILED) {
            st = cca_backend_error(CCA_ERR_BACKEND, 0,
                                   "sim: vmm_map: mmap of %p (%zu bytes) failed", addr, size);
            goto out_unlock;
        }
    } else if (c->backed && mprotect(addr, size, PROT_READ | PROT_WRITE) != 0) {
        st = cca_backend_error(CCA_ERR_BACKEND, 0,
                               "sim: vmm_map: mprotect of %p (%zu bytes) failed", addr, size);
        goto out_unlock;
    }
    simrange_insert(&r->mapped, sim_spare_take(c, start, size, SIM_RANGE_MAPPING, p));
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
        sim_spare_give(c, m);
        r->mapping_count--;
        p->map_count--;
        phys_maybe_free(c, p);
    }
    if (c->ipc_shared) /* back to reserved address space */
        mmap(addr, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
    else if (c->backed) {
        mprotect(addr, size, PROT_NONE);
        madvise(addr, size, MADV_DONTNEED);
    }
out_unlock:
    pthread_mutex_unlock(&c->lock);
    return st;
}

/* Check that the range is entirely mapped (mapping already grants access);
 * device is the one given access: the owner, or a peer of it.
 * Returns CCA_OK, CCA_ERR_INVALID_ARGUMENT, or a fault. */
static cca_status_t sim_vmm_set_access(void *ctx, int device, void *addr, size_t size)
{
    sim_ctx_t *c = ctx;
    uint64_t start = (uint64_t)(uintptr_t)addr;
    pthread_mutex_lock(&c->lock);
    cca_status_t st = sim_enter_locked(c, CCA_OP_VMM_SET_ACCESS);
    if (st != CCA_OK)
        goto out_unlock;
    if (device < 0 || device >= c->device_count) {
        st = sim_bad_device(c, CCA_OP_VMM_SET_ACCESS, device);
        goto out_unlock;
    }
    sim_resv_t *r = find_resv(c, -1, start, size);
    if (!r) {
        st = vmm_invalid(CCA_OP_VMM_SET_ACCESS, "not inside a live reservation",
                         addr, size);
        goto out_unlock;
    }
    /* walk from the mapping holding start; later ones must follow without gaps */
    sim_range_t *m = simrange_find_le(r->mapped, start);
    uint64_t at = start, end = start + size;
    while (m && m->start <= at && m->start + m->len > at) {
        at = m->start + m->len;
        if (at >= end) {
            /* all mapped: the device may access every mapping the range touches */
            for (m = simrange_find_le(r->mapped, start); m && m->start < end;
                 m = simrange_find_ge(r->mapped, m->start + m->len))
                m->access |= 1ull << device;
            goto out_unlock;
        }
        m = simrange_find_ge(r->mapped, at);
    }
    st = vmm_invalid(CCA_OP_VMM_SET_ACCESS, "the range is not entirely mapped", addr, size);
out_unlock:
    pthread_mutex_unlock(&c->lock);
    return st;
}

/* Whether device was given access (set_access) to the mapping holding addr; false where addr
 * is not mapped (c locked). */
bool sim_vmm_access_of(sim_ctx_t *c, uint64_t addr, int device)
{
    sim_resv_t *r = find_resv(c, -1, addr, 1);
    sim_range_t *m = r ? simrange_find_le(r->mapped, addr) : NULL;
    return m && addr < m->start + m->len && device >= 0 && device < SIM_MAX_DEVICES &&
           (m->access >> device & 1);
}

/* The memory file of a live, shareable handle (ipc_shared mode). Returns
 * CCA_OK, CCA_ERR_INVALID_ARGUMENT, CCA_ERR_NOT_SUPPORTED, or a fault. */
static cca_status_t sim_vmm_export(void *ctx, int device, cca_phys_handle_t handle, int *fd)
{
    sim_ctx_t *c = ctx;
    pthread_mutex_lock(&c->lock);
    cca_status_t st = sim_enter_locked(c, CCA_OP_VMM_EXPORT);
    if (st != CCA_OK)
        goto out_unlock;
    sim_phys_t *p = simmap_get(&c->phys, handle);
    if (!fd || !p || p->released || p->device != device) {
        st = cca_backend_error(CCA_ERR_INVALID_ARGUMENT, SIM_CUDA_INVALID_VALUE,
                               "sim: vmm_export: invalid argument (handle %llu is not a live "
                               "physical handle of device %d)",
                               (unsigned long long)handle, device);
        goto out_unlock;
    }
    if (p->fd < 0) {
        st = cca_backend_error(CCA_ERR_NOT_SUPPORTED, 801 /* cudaErrorNotSupported */,
                               "sim: vmm_export: the handle is not shareable (the simulated "
                               "backend shares physical memory in ipc_shared mode only)");
        goto out_unlock;
    }
    *fd = p->fd;
out_unlock:
    pthread_mutex_unlock(&c->lock);
    return st;
}

/* A handle for the memory file fd (kept by the caller): a duplicate of it is
 * mapped. Returns CCA_OK, CCA_ERR_INVALID_ARGUMENT, CCA_ERR_NOT_SUPPORTED,
 * CCA_ERR_BACKEND, or a fault. */
static cca_status_t sim_vmm_import(void *ctx, int device, int fd, cca_phys_handle_t *handle)
{
    sim_ctx_t *c = ctx;
    struct stat sb;
    pthread_mutex_lock(&c->lock);
    cca_status_t st = sim_enter_locked(c, CCA_OP_VMM_IMPORT);
    if (st != CCA_OK)
        goto out_unlock;
    if (device < 0 || device >= c->device_count) {
        st = sim_bad_device(c, CCA_OP_VMM_IMPORT, device);
        goto out_unlock;
    }
    if (!c->ipc_shared) {
        st = cca_backend_error(CCA_ERR_NOT_SUPPORTED, 801,
                               "sim: vmm_import: the simulated backend maps another process's "
                               "memory in ipc_shared mode only");
        goto out_unlock;
    }
    if (!handle || fd < 0 || fstat(fd, &sb) != 0 || !S_ISREG(sb.st_mode) || sb.st_size <= 0 ||
        (size_t)sb.st_size % c->granularity != 0) {
        st = cca_backend_error(CCA_ERR_INVALID_ARGUMENT, SIM_CUDA_INVALID_VALUE,
                               "sim: vmm_import: invalid argument (file descriptor %d holds no "
                               "exported physical memory)",
                               fd);
        goto out_unlock;
    }
    sim_phys_t *p = calloc(1, sizeof(*p));
    if (!p || !simmap_reserve(&c->phys) || (p->fd = fcntl(fd, F_DUPFD_CLOEXEC, 0)) < 0) {
        free(p);
        st = sim_host_oom(CCA_OP_VMM_IMPORT);
        goto out_unlock;
    }
    p->id = ++c->next_serial;
    p->device = device;
    p->size = (size_t)sb.st_size;
    p->imported = true;
    simmap_put(&c->phys, p->id, p);
    c->live_handles++;
    *handle = p->id;
out_unlock:
    pthread_mutex_unlock(&c->lock);
    return st;
}

/* Install the virtual memory operations into the table. */
void sim_vmm_install(cca_backend_t *b)
{
    b->vmm_granularity = sim_vmm_granularity;
    b->vmm_reserve = sim_vmm_reserve;
    b->vmm_free = sim_vmm_free;
    b->vmm_create = sim_vmm_create;
    b->vmm_release = sim_vmm_release;
    b->vmm_map = sim_vmm_map;
    b->vmm_unmap = sim_vmm_unmap;
    b->vmm_set_access = sim_vmm_set_access;
    b->vmm_export = sim_vmm_export;
    b->vmm_import = sim_vmm_import;
}
