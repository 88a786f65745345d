/*
 * ipc.c - device memory shared between processes, as PyTorch shares CUDA
 * tensors (shareIpcHandle / getIpcDevPtr / _share_cuda_ / _new_shared_cuda):
 *  - the producer's handle names the segment that holds the block (the
 *    backend's IPC handle of the segment's base, cudaIpcGetMemHandle) and the
 *    block's offset in it, plus a reference counter in its shared memory
 *    (device/shared.c keeps the block alive while the counter is above 0);
 *  - the consumer maps each segment once (CUDA allows one mapping of an
 *    allocation per process) whatever the number of blocks it opens in it,
 *    and unmaps it when the last of them is closed; closing a block
 *    decrements the producer's counter.
 * The cudaMallocAsync backend gives PyTorch's errors: it shares nothing.
 * Handle layout (CCA_IPC_HANDLE_SIZE bytes, host byte order): see ipc_wire_t.
 * Invariant: every opened block refers to one mapped segment, whose `opens`
 * is the number of such blocks. One lock guards the consumer's tables.
 */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "async.h"
#include "device.h"
#include "ipc.h"
#include "shared.h"
#include "state.h"

static const char ipc_magic[8] = {'c', 'c', 'a', 'i', 'p', 'c', '1', 0};

enum { IPC_KIND_SEGMENT = 0 };

/* What a handle holds. */
typedef struct ipc_wire {
    char magic[8];
    uint32_t kind;        /* IPC_KIND_SEGMENT: a segment from the backend's malloc */
    int32_t device;
    int32_t ref_pid;      /* the producer */
    int32_t ref_fd;       /* its counter file */
    uint32_t ref_slot;
    uint32_t reserved;
    uint64_t ref_serial;
    uint64_t ticket;      /* this handle, unique in the producer */
    uint64_t offset;      /* of the block in the segment */
    uint64_t size;        /* bytes the program asked for */
    uint64_t segment_size;
    unsigned char backend[64]; /* the backend's handle of the segment */
    unsigned char event[64];   /* the producer's interprocess event */
    uint64_t check;
} ipc_wire_t;

_Static_assert(sizeof(ipc_wire_t) <= CCA_IPC_HANDLE_SIZE, "the IPC handle is too small");

static _Atomic uint64_t next_ticket;

/* A segment of another process mapped here. */
typedef struct ipc_segment {
    int32_t pid;
    int device;
    unsigned char backend[64];
    uintptr_t base;
    size_t opens;            /* opened blocks in it */
    struct ipc_segment *next;
} ipc_segment_t;

/* A block opened here. */
typedef struct ipc_open {
    uintptr_t ptr;
    ipc_segment_t *segment;
    shmcount_ref_t ref;
    uint64_t ticket;
    struct ipc_open *next;
} ipc_open_t;

static pthread_mutex_t ipc_lock = PTHREAD_MUTEX_INITIALIZER;
static ipc_segment_t *segments;
static ipc_open_t *opens;

/* FNV-1a over the handle before its check field. */
static uint64_t wire_check(const ipc_wire_t *w)
{
    const unsigned char *p = (const unsigned char *)w;
    uint64_t h = 0xcbf29ce484222325ull;
    for (size_t i = 0; i < offsetof(ipc_wire_t, check); i++) {
        h ^= p[i];
        h *= 0x100000001b3ull;
    }
    return h;
}

cca_status_t cca_ipc_get_handle(void *ptr, cca_stream_t stream, cca_ipc_mem_handle_t *handle)
{
    cca_status_t st = state_ensure();
    if (st != CCA_OK)
        return st;
    if (!handle || !ptr)
        return cca_raise(CCA_ERR_INVALID_ARGUMENT, "cca_ipc_get_handle: %s is NULL",
                         !handle ? "handle" : "ptr");
    if (async_enabled())
        return cca_raise(CCA_ERR_NOT_SUPPORTED,
                         "cudaMallocAsync does not yet support shareIpcHandle. If you need it, "
                         "please file an issue describing your use case.");
    cca_block_t *block = ptrmap_find(cca_state->ptrmap, (uintptr_t)ptr, false);
    if (!block || (block->pool && !block->allocated))
        return pool_invalid_pointer("cca_ipc_get_handle", ptr);
    if (block->pool && block->segment->es)
        return cca_raise(CCA_ERR_NOT_SUPPORTED,
                         "Tensors allocated with expandable_segments:True cannot be shared between "
                         "processes. Consider using expandable_segments:False in data loading "
                         "workers via cca_set_settings(\"expandable_segments:False\")");
    ipc_wire_t w;
    memset(&w, 0, sizeof(w));
    memcpy(w.magic, ipc_magic, sizeof(w.magic));
    w.kind = IPC_KIND_SEGMENT;
    uintptr_t base = block->addr;
    if (block->pool) {
        /* The block is the caller's: its segment and offset cannot change. */
        w.device = block->pool->owner->device->index;
        base = block->segment->base;
        w.segment_size = block->segment->size;
    } else {
        w.device = block->device; /* uncached: the block is the allocation */
        w.segment_size = block->size;
    }
    w.offset = block->addr - base;
    w.size = block->requested_size;
    cca_backend_t *be = cca_state->backend;
    cca_ipc_handle_t bh;
    st = be->ipc_get_handle(be->ctx, w.device, (void *)base, &bh);
    if (st != CCA_OK)
        return st;
    memcpy(w.backend, bh.bytes, sizeof(w.backend));
    shmcount_ref_t ref;
    cca_ipc_handle_t eh;
    st = shared_add_reference(be, block->addr, w.device, stream, &ref, &eh);
    if (st != CCA_OK)
        return st;
    memcpy(w.event, eh.bytes, sizeof(w.event));
    w.ref_pid = ref.pid;
    w.ref_fd = ref.fd;
    w.ref_slot = ref.slot;
    w.ref_serial = ref.serial;
    w.ticket = atomic_fetch_add(&next_ticket, 1) + 1;
    w.check = wire_check(&w);
    memset(handle, 0, sizeof(*handle));
    memcpy(handle->bytes, &w, sizeof(w));
    return CCA_OK;
}

static cca_status_t bad_handle(const char *why)
{
    return cca_raise(CCA_ERR_INVALID_ARGUMENT, "cca_ipc_open: %s", why);
}

/* Make stream wait for the producer's event of the handle (PyTorch's event_sync_required). */
static cca_status_t wait_for_producer(const ipc_wire_t *w, cca_stream_t stream)
{
    cca_backend_t *be = cca_state->backend;
    cca_ipc_handle_t eh;
    memcpy(eh.bytes, w->event, sizeof(eh.bytes));
    cca_event_t ev = NULL;
    cca_status_t st = be->ipc_event_open(be->ctx, w->device, &eh, &ev);
    if (st != CCA_OK)
        return st;
    st = be->stream_wait_event(be->ctx, w->device, stream, ev);
    cca_status_t dst = be->event_destroy(be->ctx, w->device, ev);
    return st != CCA_OK ? st : dst;
}

cca_status_t cca_ipc_open(const cca_ipc_mem_handle_t *handle, cca_stream_t stream, void **ptr,
                          size_t *size)
{
    cca_status_t st = state_ensure();
    if (st != CCA_OK)
        return st;
    if (!handle || !ptr)
        return bad_handle(!handle ? "handle is NULL" : "ptr is NULL");
    if (async_enabled())
        return cca_raise(CCA_ERR_NOT_SUPPORTED,
                         "cudaMallocAsync does not yet support getIpcDevPtr. If you need it, "
                         "please file an issue describing your use case.");
    ipc_wire_t w;
    memcpy(&w, handle->bytes, sizeof(w));
    if (memcmp(w.magic, ipc_magic, sizeof(w.magic)) != 0 || w.check != wire_check(&w))
        return bad_handle("not a cca IPC handle, or a corrupt one");
    if (w.kind != IPC_KIND_SEGMENT)
        return bad_handle("unknown kind of IPC handle");
    if (w.device < 0 || w.device >= cca_state->device_count)
        return cca_raise(CCA_ERR_INVALID_ARGUMENT,
                         "cca_ipc_open: the handle's device %d is out of range (%d devices)",
                         (int)w.device, cca_state->device_count);
    if (w.ref_pid == (int32_t)getpid())
        return bad_handle("the handle was made by this process: use the pointer itself");
    if (w.offset >= w.segment_size)
        return bad_handle("the block's offset lies outside its segment");
    ipc_open_t *o = calloc(1, sizeof(*o));
    if (!o)
        return cca_raise(CCA_ERR_OUT_OF_MEMORY, "out of host memory for IPC bookkeeping");
    pthread_mutex_lock(&ipc_lock);
    for (ipc_open_t *x = opens; x; x = x->next)
        if (x->ticket == w.ticket && x->ref.pid == w.ref_pid) {
            st = bad_handle("this handle is open in this process already (a handle stands for "
                            "one reference: make one per opening)");
            goto out_free;
        }
    st = wait_for_producer(&w, stream);
    if (st != CCA_OK)
        goto out_free;
    ipc_segment_t *seg = segments;
    while (seg && !(seg->pid == w.ref_pid && !memcmp(seg->backend, w.backend, sizeof(w.backend))))
        seg = seg->next;
    if (!seg) {
        seg = calloc(1, sizeof(*seg));
        if (!seg) {
            st = cca_raise(CCA_ERR_OUT_OF_MEMORY, "out of host memory for IPC bookkeeping");
            goto out_free;
        }
        cca_backend_t *be = cca_state->backend;
        cca_ipc_handle_t bh;
        memcpy(bh.bytes, w.backend, sizeof(bh.bytes));
        void *base = NULL;
        st = be->ipc_open(be->ctx, w.device, &bh, &base);
        if (st != CCA_OK) {
            free(seg);
            goto out_free;
        }
        seg->pid = w.ref_pid;
        seg->device = w.device;
        memcpy(seg->backend, w.backend, sizeof(seg->backend));
        seg->base = (uintptr_t)base;
        seg->next = segments;
        segments = seg;
    }
    seg->opens++;
    o->ptr = seg->base + w.offset;
    o->segment = seg;
    o->ref = (shmcount_ref_t){w.ref_pid, w.ref_fd, w.ref_slot, w.ref_serial};
    o->ticket = w.ticket;
    o->next = opens;
    opens = o;
    *ptr = (void *)o->ptr;
    if (size)
        *size = w.size;
    pthread_mutex_unlock(&ipc_lock);
    return CCA_OK;
out_free:
    pthread_mutex_unlock(&ipc_lock);
    free(o);
    return st;
}

cca_status_t cca_ipc_release_handle(const cca_ipc_mem_handle_t *handle)
{
    if (!handle)
        return cca_raise(CCA_ERR_INVALID_ARGUMENT, "cca_ipc_release_handle: handle is NULL");
    ipc_wire_t w;
    memcpy(&w, handle->bytes, sizeof(w));
    if (memcmp(w.magic, ipc_magic, sizeof(w.magic)) != 0 || w.check != wire_check(&w))
        return cca_raise(CCA_ERR_INVALID_ARGUMENT,
                         "cca_ipc_release_handle: not a cca IPC handle, or a corrupt one");
    shmcount_ref_t ref = {w.ref_pid, w.ref_fd, w.ref_slot, w.ref_serial};
    if (ref.pid == (int32_t)getpid()) {
        shmcount_add(&ref, -1);
        return CCA_OK;
    }
    return shmcount_release_foreign(&ref);
}

/* Drop one open of seg; unmap it after the last (ipc_lock held). */
static cca_status_t segment_put_locked(ipc_segment_t *seg)
{
    if (--seg->opens)
        return CCA_OK;
    ipc_segment_t **link = &segments;
    while (*link != seg)
        link = &(*link)->next;
    *link = seg->next;
    cca_backend_t *be = cca_state->backend;
    cca_status_t st = be->ipc_close(be->ctx, seg->device, (void *)seg->base);
    free(seg);
    return st;
}

cca_status_t cca_ipc_close(void *ptr)
{
    if (!cca_is_initialized())
        return cca_raise(CCA_ERR_INVALID_POINTER, "cca_ipc_close: pointer %p: cca is not initialised",
                         ptr);
    pthread_mutex_lock(&ipc_lock);
    ipc_open_t **link = &opens;
    while (*link && (*link)->ptr != (uintptr_t)ptr)
        link = &(*link)->next;
    ipc_open_t *o = *link;
    if (!o) {
        pthread_mutex_unlock(&ipc_lock);
        return cca_raise(CCA_ERR_INVALID_POINTER,
                         "cca_ipc_close: pointer %p was not opened with cca_ipc_open, or was "
                         "closed already",
                         ptr);
    }
    *link = o->next;
    cca_status_t st = segment_put_locked(o->segment);
    pthread_mutex_unlock(&ipc_lock);
    /* Best effort, as PyTorch: a producer that exited has nothing left to free. */
    (void)shmcount_release_foreign(&o->ref);
    free(o);
    if (st == CCA_OK)
        cca_clear_error();
    return st;
}

size_t ipc_open_count(void)
{
    pthread_mutex_lock(&ipc_lock);
    size_t n = 0;
    for (ipc_open_t *o = opens; o; o = o->next)
        n++;
    pthread_mutex_unlock(&ipc_lock);
    return n;
}

void ipc_shutdown(void)
{
    pthread_mutex_lock(&ipc_lock);
    while (opens) {
        ipc_open_t *o = opens;
        opens = o->next;
        (void)segment_put_locked(o->segment);
        (void)shmcount_release_foreign(&o->ref);
        free(o);
    }
    pthread_mutex_unlock(&ipc_lock);
}
