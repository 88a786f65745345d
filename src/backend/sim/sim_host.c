/*
 * sim_host.c - the simulated backend's host memory (page-aligned host_alloc,
 * host_register records) and IPC: handles that encode (backend, device,
 * pointer, serial), open counts within a process, and in ipc_shared mode the
 * mapping of another process's memory file.
 * Invariant: a host record is either host_alloc'ed or registered, never both;
 * an IPC handle opens only while its allocation (same serial) is live.
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "simulator.h"

static const unsigned char ipc_magic[8] = {'c', 'c', 'a', 's', 'i', 'm', '1', 0};

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
        st = sim_host_oom(CCA_OP_HOST_REGISTER);
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
        return sim_host_oom(CCA_OP_IPC_OPEN);
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
        st = sim_host_oom(CCA_OP_IPC_OPEN);
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

/* Install the host memory and IPC operations into the table. */
void sim_host_install(cca_backend_t *b)
{
    b->host_alloc = sim_host_alloc;
    b->host_free = sim_host_free;
    b->host_register = sim_host_register;
    b->host_unregister = sim_host_unregister;
    b->ipc_get_handle = sim_ipc_get_handle;
    b->ipc_open = sim_ipc_open;
    b->ipc_close = sim_ipc_close;
}
