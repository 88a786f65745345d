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
 * A block of an expandable segment is shared as PyTorch 2.11 shares it
 * (ExpandableSegment::share / fromShared): its handle names the granules
 * that hold the block (granule size, count, the block's offset in the first)
 * and, for each, the file descriptor through which the producer exported the
 * granule's physical memory (backend vmm_export: the backend keeps it open
 * while the granule is mapped); the consumer takes those descriptors from
 * the producer with pidfd_open + pidfd_getfd, imports them (vmm_import),
 * reserves a range, maps each granule there and sets access; it unmaps and
 * frees the range when the last block opened in it is closed. Reference
 * counting is the same as above.
 * The cudaMallocAsync backend gives PyTorch's errors: it shares nothing.
 * Handle layout (host byte order): a head of CCA_IPC_HANDLE_SIZE bytes
 * (ipc_wire_t, zero-padded), which is the whole handle and the fixed
 * cca_ipc_mem_handle_t unless the block spans more than IPC_HEAD_GRANULES
 * granules; their descriptors beyond the first IPC_HEAD_GRANULES follow the
 * head (int32 each), so the serialized form (cca_ipc_get_handle_bytes) has
 * no limit. The head's check covers the head and what follows it.
 * Invariant: every opened block refers to one mapped segment, whose `opens`
 * is the number of such blocks. One lock guards the consumer's tables.
 */
#include <errno.h>
#include <stdio.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "async.h"
#include "device.h"
#include "ipc.h"
#include "shared.h"
#include "state.h"

static const char ipc_magic[8] = {'c', 'c', 'a', 'i', 'p', 'c', '1', 0};

enum { IPC_KIND_SEGMENT = 0, IPC_KIND_EXPANDABLE = 1 };

/* Granules whose descriptors the head holds (its backend field); more follow the head. */
#define IPC_HEAD_GRANULES 16
/* Granules a handle may name at most (a sanity bound on what a parser accepts: 2^24
 * granules of the smallest granularity, 2 MiB, are 32 TiB). */
#define IPC_MAX_GRANULES (1u << 24)

/* What a handle holds. */
typedef struct ipc_wire {
    char magic[8];
    uint32_t kind;        /* IPC_KIND_SEGMENT: a segment from the backend's malloc;
                             IPC_KIND_EXPANDABLE: granules of an expandable segment */
    int32_t device;
    int32_t ref_pid;      /* the producer */
    int32_t ref_fd;       /* its counter file */
    uint32_t ref_slot;
    uint32_t granules;    /* IPC_KIND_EXPANDABLE: granules named (0 otherwise) */
    uint64_t ref_serial;
    uint64_t ticket;      /* this handle, unique in the producer */
    uint64_t offset;      /* of the block in the segment (expandable: in its first granule) */
    uint64_t size;        /* bytes the program asked for */
    uint64_t segment_size; /* expandable: bytes of the granules named */
    unsigned char backend[64]; /* the backend's handle of the segment; expandable: the
                                  producer's descriptors of the granules (int32 each) */
    unsigned char event[64];   /* the producer's interprocess event */
    uint64_t check;
} ipc_wire_t;

_Static_assert(sizeof(ipc_wire_t) <= CCA_IPC_HANDLE_SIZE, "the IPC handle is too small");
_Static_assert(IPC_HEAD_GRANULES * sizeof(int32_t) <= sizeof(((ipc_wire_t *)0)->backend),
               "the IPC handle's head cannot hold its descriptors");

/* Bytes of the serialized handle of a block over granules granules (0: not expandable). */
static size_t handle_length(size_t granules)
{
    size_t tail = granules > IPC_HEAD_GRANULES ? granules - IPC_HEAD_GRANULES : 0;
    return CCA_IPC_HANDLE_SIZE + tail * sizeof(int32_t);
}

static _Atomic uint64_t next_ticket;

/* A segment of another process mapped here. */
typedef struct ipc_segment {
    int32_t pid;
    int device;
    unsigned char backend[64];
    uint32_t granules;       /* expandable: granules mapped at base (else 0) */
    uintptr_t base;
    size_t size;             /* expandable: bytes mapped at base */
    size_t opens;            /* opened blocks in it */
    bool unmapped;           /* expandable: its granules unmapped by a close whose
                                reservation's release failed (retried by the next) */
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

/* FNV-1a over the head before its check field, then over the tail (tail_len bytes). */
static uint64_t wire_check(const ipc_wire_t *w, const unsigned char *tail, size_t tail_len)
{
    const unsigned char *p = (const unsigned char *)w;
    uint64_t h = 0xcbf29ce484222325ull;
    for (size_t i = 0; i < offsetof(ipc_wire_t, check); i++) {
        h ^= p[i];
        h *= 0x100000001b3ull;
    }
    for (size_t i = 0; i < tail_len; i++) {
        h ^= tail[i];
        h *= 0x100000001b3ull;
    }
    return h;
}

static cca_status_t expandable_refused(const char *why)
{
    return cca_raise(CCA_ERR_NOT_SUPPORTED,
                     "Tensors allocated with expandable_segments:True cannot be shared between "
                     "processes here (%s). Consider using expandable_segments:False in data "
                     "loading workers via cca_set_settings(\"expandable_segments:False\")",
                     why);
}

/* The granules [*first, *end) of block's expandable segment that hold it. */
static void block_granules(const cca_block_t *block, size_t *first, size_t *end)
{
    const cca_segment_t *seg = block->segment;
    size_t g = seg->es->granule;
    *first = (block->addr - seg->base) / g;
    *end = (block->addr + block->size - seg->base + g - 1) / g;
}

/* The live block at ptr, or an error naming what. */
static cca_status_t find_block(const char *what, void *ptr, cca_block_t **out)
{
    cca_block_t *block = ptrmap_find(cca_state->ptrmap, (uintptr_t)ptr, false);
    if (!block || (block->pool && !block->allocated))
        return pool_invalid_pointer(what, ptr);
    *out = block;
    return CCA_OK;
}

/* Bytes of block's serialized handle. */
static size_t block_handle_length(const cca_block_t *block)
{
    if (!block->pool || !block->segment->es)
        return handle_length(0);
    size_t first, end;
    block_granules(block, &first, &end);
    return handle_length(end - first);
}

/*
 * Describe the granules holding block, an allocated block of an expandable
 * segment, in w and tail (room for the descriptors beyond the head's): each
 * one's exported descriptor (the backend keeps it open while the granule is
 * mapped, which it stays while the block lives).
 */
static cca_status_t export_expandable(cca_block_t *block, ipc_wire_t *w, unsigned char *tail)
{
    cca_segment_t *seg = block->segment;
    cca_device_t *dev = block->pool->owner->device;
    cca_backend_t *be = cca_state->backend;
    cca_status_t st = CCA_OK;
    size_t first, end;
    block_granules(block, &first, &end);
    size_t g = seg->es->granule;
    pthread_mutex_lock(&dev->lock); /* growth may move the granule table */
    cca_expandable_t *es = seg->es;
    for (size_t i = first; i < end; i++) {
        int fd = -1;
        if (i >= es->handle_count || !es->handles[i].present) {
            st = cca_raise(CCA_ERR_INTERNAL, "cca_ipc_get_handle: granule %zu of an allocated "
                                             "block is not mapped", i);
            goto out_unlock;
        }
        st = be->vmm_export(be->ctx, dev->index, es->handles[i].handle, &fd);
        if (st == CCA_ERR_NOT_SUPPORTED) {
            char why[512];
            snprintf(why, sizeof(why), "%.500s", cca_last_error()->message);
            st = expandable_refused(why);
            goto out_unlock;
        }
        if (st != CCA_OK)
            goto out_unlock;
        int32_t fd32 = fd;
        size_t k = i - first;
        if (k < IPC_HEAD_GRANULES)
            memcpy(w->backend + k * sizeof(fd32), &fd32, sizeof(fd32));
        else
            memcpy(tail + (k - IPC_HEAD_GRANULES) * sizeof(fd32), &fd32, sizeof(fd32));
    }
    w->kind = IPC_KIND_EXPANDABLE;
    w->device = dev->index;
    w->granules = (uint32_t)(end - first);
    w->segment_size = (end - first) * g;
    w->offset = block->addr - (seg->base + first * g);
out_unlock:
    pthread_mutex_unlock(&dev->lock);
    return st;
}

/*
 * Write the serialized handle of the block at ptr into buf (len bytes, exactly
 * its handle_length, checked by the caller) and take its reference.
 */
static cca_status_t make_handle(cca_block_t *block, cca_stream_t stream, unsigned char *buf,
                                size_t len)
{
    ipc_wire_t w;
    memset(&w, 0, sizeof(w));
    memcpy(w.magic, ipc_magic, sizeof(w.magic));
    w.kind = IPC_KIND_SEGMENT;
    unsigned char *tail = buf + CCA_IPC_HANDLE_SIZE;
    size_t tail_len = len - CCA_IPC_HANDLE_SIZE;
    uintptr_t base = block->addr;
    cca_backend_t *be = cca_state->backend;
    cca_status_t st;
    if (block->pool && block->segment->es) {
        st = export_expandable(block, &w, tail);
        if (st != CCA_OK)
            return st;
    } else if (block->pool) {
        /* The block is the caller's: its segment and offset cannot change. */
        w.device = block->pool->owner->device->index;
        base = block->segment->base;
        w.segment_size = block->segment->size;
    } else {
        w.device = block->device; /* uncached: the block is the allocation */
        w.segment_size = block->size;
    }
    if (w.kind == IPC_KIND_SEGMENT) {
        w.offset = block->addr - base;
        cca_ipc_handle_t bh;
        st = be->ipc_get_handle(be->ctx, w.device, (void *)base, &bh);
        if (st != CCA_OK)
            return st;
        memcpy(w.backend, bh.bytes, sizeof(w.backend));
    }
    w.size = block->requested_size;
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
    w.check = wire_check(&w, tail, tail_len);
    memset(buf, 0, CCA_IPC_HANDLE_SIZE);
    memcpy(buf, &w, sizeof(w));
    return CCA_OK;
}

/* The common checks of the producer's entry points; *block on CCA_OK. */
static cca_status_t producer_args(const char *what, void *ptr, const void *out, const char *out_name,
                                   cca_block_t **block)
{
    cca_status_t st = state_ensure();
    if (st != CCA_OK)
        return st;
    if (!out || !ptr)
        return cca_raise(CCA_ERR_INVALID_ARGUMENT, "%s: %s is NULL", what, !ptr ? "ptr" : out_name);
    if (async_enabled())
        return cca_raise(CCA_ERR_NOT_SUPPORTED,
                         "cudaMallocAsync does not yet support shareIpcHandle. If you need it, "
                         "please file an issue describing your use case.");
    return find_block(what, ptr, block);
}

cca_status_t cca_ipc_get_handle(void *ptr, cca_stream_t stream, cca_ipc_mem_handle_t *handle)
{
    cca_block_t *block = NULL;
    cca_status_t st = producer_args("cca_ipc_get_handle", ptr, handle, "handle", &block);
    if (st != CCA_OK)
        return st;
    size_t len = block_handle_length(block);
    if (len > sizeof(handle->bytes)) {
        size_t first, end;
        block_granules(block, &first, &end);
        return cca_raise(CCA_ERR_NOT_SUPPORTED,
                         "cca_ipc_get_handle: the block spans %zu granules of its expandable "
                         "segment; cca_ipc_mem_handle_t names at most %d: use "
                         "cca_ipc_handle_size and cca_ipc_get_handle_bytes (a handle of %zu bytes)",
                         end - first, IPC_HEAD_GRANULES, len);
    }
    return make_handle(block, stream, handle->bytes, sizeof(handle->bytes));
}

cca_status_t cca_ipc_handle_size(void *ptr, size_t *size)
{
    cca_block_t *block = NULL;
    cca_status_t st = producer_args("cca_ipc_handle_size", ptr, size, "size", &block);
    if (st != CCA_OK)
        return st;
    *size = block_handle_length(block);
    return CCA_OK;
}

cca_status_t cca_ipc_get_handle_bytes(void *ptr, cca_stream_t stream, void *buf, size_t cap,
                                      size_t *size)
{
    cca_block_t *block = NULL;
    cca_status_t st = producer_args("cca_ipc_get_handle_bytes", ptr, size, "size", &block);
    if (st != CCA_OK)
        return st;
    size_t len = block_handle_length(block);
    *size = len;
    if (!buf || cap < len)
        return cca_raise(CCA_ERR_INVALID_ARGUMENT,
                         "cca_ipc_get_handle_bytes: the handle takes %zu bytes, the buffer has %zu "
                         "(cca_ipc_handle_size gives the length)",
                         len, buf ? cap : (size_t)0);
    return make_handle(block, stream, buf, len);
}

static cca_status_t bad_handle(const char *why)
{
    return cca_raise(CCA_ERR_INVALID_ARGUMENT, "cca_ipc_open: %s", why);
}

/* The error of a system that cannot take descriptors from another process (PyTorch's). */
static cca_status_t no_syscall(const char *name)
{
    return cca_raise(CCA_ERR_NOT_SUPPORTED,
                     "The kernel on this machine does not support the %s syscall needed to use "
                     "IPC for CUDA tensors when expandable_segments:True is set. Consider using "
                     "expandable_segments:False via cca_set_settings(\"expandable_segments:False\") "
                     "for this allocation.",
                     name);
}

/* Take descriptor fd of the process of pidfd into this one. */
static cca_status_t take_fd(int pidfd, int32_t pid, int fd, int *out)
{
#ifdef SYS_pidfd_getfd
    long r = syscall(SYS_pidfd_getfd, pidfd, fd, 0);
#else
    long r = -1;
    errno = ENOSYS;
#endif
    if (r >= 0) {
        *out = (int)r;
        return CCA_OK;
    }
    if (errno == ENOSYS)
        return no_syscall("pidfd_getfd");
    if (errno == EPERM)
        return cca_raise(CCA_ERR_NOT_SUPPORTED,
                         "cca_ipc_open: this process may not take descriptors of process %d "
                         "(pidfd_getfd: %s); IPC of expandable segments needs ptrace access to "
                         "the producer",
                         (int)pid, strerror(errno));
    return cca_raise(CCA_ERR_INVALID_ARGUMENT,
                     "cca_ipc_open: descriptor %d of process %d cannot be taken (pidfd_getfd: %s): "
                     "a stale handle",
                     fd, (int)pid, strerror(errno));
}

/*
 * Map the granules of an expandable handle into a new reservation: take each
 * descriptor from the producer, import it, map it, drop the handle (the
 * mapping keeps the memory), then set access. Nothing stays on failure.
 */
static cca_status_t map_expandable(const ipc_wire_t *w, const int32_t *fds, void **base_out)
{
    cca_backend_t *be = cca_state->backend;
    size_t g = w->segment_size / w->granules;
#ifdef SYS_pidfd_open
    long pidfd = syscall(SYS_pidfd_open, (pid_t)w->ref_pid, 0);
#else
    long pidfd = -1;
    errno = ENOSYS;
#endif
    if (pidfd < 0)
        return errno == ENOSYS
                   ? no_syscall("pidfd_open")
                   : cca_raise(CCA_ERR_INVALID_ARGUMENT,
                               "cca_ipc_open: process %d cannot be reached (pidfd_open: %s): it "
                               "may have exited",
                               (int)w->ref_pid, strerror(errno));
    void *base = NULL;
    cca_status_t st = be->vmm_reserve(be->ctx, w->device, w->segment_size, &base);
    if (st != CCA_OK)
        goto out_close;
    uint32_t mapped = 0;
    bool held = false; /* h mapped, its release failed: retried after the unmap */
    cca_phys_handle_t h = 0;
    for (; mapped < w->granules; mapped++) {
        int fd = -1;
        st = take_fd((int)pidfd, w->ref_pid, fds[mapped], &fd);
        if (st != CCA_OK)
            break;
        st = be->vmm_import(be->ctx, w->device, fd, &h);
        close(fd);
        if (st != CCA_OK)
            break;
        st = be->vmm_map(be->ctx, w->device, (char *)base + mapped * g, g, h);
        if (st != CCA_OK) {
            (void)be->vmm_release(be->ctx, w->device, h);
            break;
        }
        st = be->vmm_release(be->ctx, w->device, h);
        if (st != CCA_OK) {
            held = true;
            mapped++; /* to unmap below */
            break;
        }
    }
    if (st == CCA_OK)
        st = be->vmm_set_access(be->ctx, w->device, base, w->segment_size);
    if (st == CCA_OK) {
        *base_out = base;
        goto out_close;
    }
    cca_error_t saved = *cca_last_error();
    bool freeable = !mapped || be->vmm_unmap(be->ctx, w->device, base, mapped * g) == CCA_OK;
    if (held)
        (void)be->vmm_release(be->ctx, w->device, h);
    if (freeable)
        (void)be->vmm_free(be->ctx, w->device, base, w->segment_size);
    cca_raise(saved.status, "%s", saved.message);
out_close:
    close((int)pidfd);
    return st;
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

/*
 * Read the serialized handle of len bytes at buf into *w, checked; *fds gets
 * the granules' descriptors of an expandable handle (malloc'd; the caller
 * frees it), else NULL. what names the entry point.
 */
static cca_status_t parse_handle(const char *what, const void *buf, size_t len, ipc_wire_t *w,
                                 int32_t **fds)
{
    *fds = NULL;
    if (len < CCA_IPC_HANDLE_SIZE)
        return cca_raise(CCA_ERR_INVALID_ARGUMENT, "%s: %zu bytes are not a cca IPC handle (it "
                         "takes at least %d)", what, len, CCA_IPC_HANDLE_SIZE);
    memcpy(w, buf, sizeof(*w));
    if (memcmp(w->magic, ipc_magic, sizeof(w->magic)) != 0)
        return cca_raise(CCA_ERR_INVALID_ARGUMENT, "%s: not a cca IPC handle, or a corrupt one",
                         what);
    if (w->kind != IPC_KIND_SEGMENT && w->kind != IPC_KIND_EXPANDABLE)
        return cca_raise(CCA_ERR_INVALID_ARGUMENT, "%s: unknown kind of IPC handle, or a corrupt "
                         "one", what);
    if (w->kind == IPC_KIND_SEGMENT && w->granules != 0)
        return cca_raise(CCA_ERR_INVALID_ARGUMENT, "%s: a segment's handle naming granules: "
                         "corrupt", what);
    /* the head's bytes past its fields are zero as made (the check covers the fields) */
    for (size_t i = sizeof(*w); i < CCA_IPC_HANDLE_SIZE; i++)
        if (((const unsigned char *)buf)[i])
            return cca_raise(CCA_ERR_INVALID_ARGUMENT, "%s: not a cca IPC handle, or a corrupt "
                             "one", what);
    uint32_t granules = w->kind == IPC_KIND_EXPANDABLE ? w->granules : 0;
    if (granules > IPC_MAX_GRANULES || len != handle_length(granules))
        return cca_raise(CCA_ERR_INVALID_ARGUMENT, "%s: a handle of %zu bytes, %s: truncated, "
                         "padded or corrupt", what, len,
                         granules > IPC_MAX_GRANULES ? "naming too many granules"
                                                     : "not the length its granules make");
    const unsigned char *tail = (const unsigned char *)buf + CCA_IPC_HANDLE_SIZE;
    if (w->check != wire_check(w, tail, len - CCA_IPC_HANDLE_SIZE))
        return cca_raise(CCA_ERR_INVALID_ARGUMENT, "%s: not a cca IPC handle, or a corrupt one",
                         what);
    if (!granules)
        return CCA_OK;
    int32_t *all = malloc(granules * sizeof(*all));
    if (!all)
        return cca_raise(CCA_ERR_OUT_OF_MEMORY, "out of host memory for IPC bookkeeping");
    size_t head = granules < IPC_HEAD_GRANULES ? granules : IPC_HEAD_GRANULES;
    memcpy(all, w->backend, head * sizeof(*all));
    memcpy(all + head, tail, (granules - head) * sizeof(*all));
    *fds = all;
    return CCA_OK;
}

/* cca_ipc_open of a parsed handle (fds: its descriptors, or NULL). */
static cca_status_t open_parsed(const ipc_wire_t *handle_wire, const int32_t *fds,
                                cca_stream_t stream, void **ptr, size_t *size)
{
    ipc_wire_t w = *handle_wire;
    cca_status_t st;
    if (w.kind == IPC_KIND_EXPANDABLE &&
        (w.granules == 0 || w.segment_size % w.granules != 0 ||
         w.size > w.segment_size - w.offset))
        return bad_handle("the handle's granules do not hold its block");
    if (w.device < 0 || w.device >= cca_state->device_count)
        return cca_raise(CCA_ERR_INVALID_ARGUMENT,
                         "cca_ipc_open: the handle's device %d is out of range (%d devices)",
                         (int)w.device, cca_state->device_count);
    if (w.ref_pid == (int32_t)getpid())
        return bad_handle("the handle was made by this process: use the pointer itself");
    if (w.offset >= w.segment_size || w.size > w.segment_size - w.offset)
        return bad_handle("the block lies outside its segment");
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
    /* The counter file the handle names must be one, and the handle's reference still
     * held, before anything is mapped (the close releases it): a handle released already
     * may name a block freed since (an expandable handle's descriptors are reused then). */
    shmcount_ref_t ref = {w.ref_pid, w.ref_fd, w.ref_slot, w.ref_serial};
    st = shmcount_check_foreign(&ref);
    if (st != CCA_OK)
        goto out_free;
    st = wait_for_producer(&w, stream);
    if (st != CCA_OK)
        goto out_free;
    ipc_segment_t *seg = segments;
    while (seg && !(seg->pid == w.ref_pid && seg->granules == w.granules &&
                    !memcmp(seg->backend, w.backend, sizeof(w.backend)) &&
                    (!w.granules || seg->size == w.segment_size)))
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
        if (w.kind == IPC_KIND_EXPANDABLE)
            st = map_expandable(&w, fds, &base);
        else
            st = be->ipc_open(be->ctx, w.device, &bh, &base);
        if (st != CCA_OK) {
            free(seg);
            goto out_free;
        }
        seg->granules = w.granules;
        seg->size = w.granules ? w.segment_size : 0;
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
    o->ref = ref;
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

/* The checks of the consumer's entry points. */
static cca_status_t consumer_args(const char *what, const void *buf, void **ptr)
{
    cca_status_t st = state_ensure();
    if (st != CCA_OK)
        return st;
    if (!buf || !ptr)
        return cca_raise(CCA_ERR_INVALID_ARGUMENT, "%s: %s is NULL", what,
                         !buf ? "the handle" : "ptr");
    if (async_enabled())
        return cca_raise(CCA_ERR_NOT_SUPPORTED,
                         "cudaMallocAsync does not yet support getIpcDevPtr. If you need it, "
                         "please file an issue describing your use case.");
    return CCA_OK;
}

cca_status_t cca_ipc_open_bytes(const void *handle, size_t len, cca_stream_t stream, void **ptr,
                                size_t *size)
{
    cca_status_t st = consumer_args("cca_ipc_open_bytes", handle, ptr);
    if (st != CCA_OK)
        return st;
    ipc_wire_t w;
    int32_t *fds = NULL;
    st = parse_handle("cca_ipc_open_bytes", handle, len, &w, &fds);
    if (st == CCA_OK)
        st = open_parsed(&w, fds, stream, ptr, size);
    free(fds);
    return st;
}

cca_status_t cca_ipc_open(const cca_ipc_mem_handle_t *handle, cca_stream_t stream, void **ptr,
                          size_t *size)
{
    cca_status_t st = consumer_args("cca_ipc_open", handle, ptr);
    if (st != CCA_OK)
        return st;
    ipc_wire_t w;
    int32_t *fds = NULL;
    st = parse_handle("cca_ipc_open", handle->bytes, sizeof(handle->bytes), &w, &fds);
    if (st == CCA_OK)
        st = open_parsed(&w, fds, stream, ptr, size);
    free(fds);
    return st;
}

cca_status_t cca_ipc_release_handle_bytes(const void *handle, size_t len)
{
    if (!handle)
        return cca_raise(CCA_ERR_INVALID_ARGUMENT, "cca_ipc_release_handle_bytes: handle is NULL");
    ipc_wire_t w;
    int32_t *fds = NULL;
    cca_status_t st = parse_handle("cca_ipc_release_handle", handle, len, &w, &fds);
    free(fds);
    if (st != CCA_OK)
        return st;
    shmcount_ref_t ref = {w.ref_pid, w.ref_fd, w.ref_slot, w.ref_serial};
    if (ref.pid == (int32_t)getpid())
        return shmcount_drop(&ref);
    return shmcount_release_foreign(&ref);
}

cca_status_t cca_ipc_release_handle(const cca_ipc_mem_handle_t *handle)
{
    if (!handle)
        return cca_raise(CCA_ERR_INVALID_ARGUMENT, "cca_ipc_release_handle: handle is NULL");
    return cca_ipc_release_handle_bytes(handle->bytes, sizeof(handle->bytes));
}

/* Take seg out of the list and free it (ipc_lock held). */
static void segment_forget_locked(ipc_segment_t *seg)
{
    ipc_segment_t **link = &segments;
    while (*link != seg)
        link = &(*link)->next;
    *link = seg->next;
    free(seg);
}

/* Drop one open of seg; unmap it after the last (ipc_lock held). Where the backend fails,
 * the open stays (seg as it was, but for granules already unmapped): a later close retries. */
static cca_status_t segment_put_locked(ipc_segment_t *seg)
{
    if (seg->opens > 1) {
        seg->opens--;
        return CCA_OK;
    }
    cca_backend_t *be = cca_state->backend;
    cca_status_t st = CCA_OK;
    if (seg->granules) {
        if (!seg->unmapped) {
            st = be->vmm_unmap(be->ctx, seg->device, (void *)seg->base, seg->size);
            seg->unmapped = st == CCA_OK;
        }
        if (st == CCA_OK)
            st = be->vmm_free(be->ctx, seg->device, (void *)seg->base, seg->size);
    } else {
        st = be->ipc_close(be->ctx, seg->device, (void *)seg->base);
    }
    if (st != CCA_OK)
        return st;
    segment_forget_locked(seg);
    return CCA_OK;
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
    cca_status_t st = segment_put_locked(o->segment);
    if (st != CCA_OK) { /* still mapped: the open and its reference stay, for a retry */
        pthread_mutex_unlock(&ipc_lock);
        return st;
    }
    *link = o->next;
    pthread_mutex_unlock(&ipc_lock);
    /* Best effort, as PyTorch: a producer that exited has nothing left to free. */
    (void)shmcount_release_foreign(&o->ref);
    free(o);
    cca_clear_error();
    return CCA_OK;
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
        if (segment_put_locked(o->segment) != CCA_OK)
            segment_forget_locked(o->segment); /* best effort: the backend goes too */
        (void)shmcount_release_foreign(&o->ref);
        free(o);
    }
    pthread_mutex_unlock(&ipc_lock);
}
