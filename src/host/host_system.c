/*
 * host_system.c - pinned memory from the system for the host allocator:
 * backend host_alloc (cudaHostAlloc), or malloc + parallel page pre-fault +
 * host_register, or a bump carve from the reserve segment; and giving
 * blocks back the way they were obtained.
 * Invariant: no allocator lock is held across a backend call.
 */
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#include "pinned.h"

/* ------------------------------------------------------------------------ */
/* The system (slow) path                                                    */
/* ------------------------------------------------------------------------ */

typedef struct prefault_range {
    char *start;
    char *end;
} prefault_range_t;

static void *prefault_run(void *arg)
{
    prefault_range_t *r = arg;
    for (char *p = r->start; p < r->end; p += HOST_PAGE)
        *(volatile char *)p = 0;
    return NULL;
}

/*
 * Touch one byte per page of [ptr, ptr + size) (ptr page-aligned) so the
 * pages exist before registration, on up to nthreads threads, each on a
 * contiguous run of pages. Falls back to fewer threads if one cannot start.
 */
static void prefault(char *ptr, size_t size, size_t nthreads)
{
    size_t pages = size / HOST_PAGE + (size % HOST_PAGE != 0);
    if (nthreads > HOST_MAX_REGISTER_THREADS)
        nthreads = HOST_MAX_REGISTER_THREADS;
    if (nthreads > pages)
        nthreads = pages;
    if (nthreads <= 1) {
        prefault_range_t all = {ptr, ptr + size};
        prefault_run(&all);
        return;
    }
    pthread_t threads[HOST_MAX_REGISTER_THREADS];
    bool started[HOST_MAX_REGISTER_THREADS];
    prefault_range_t ranges[HOST_MAX_REGISTER_THREADS];
    for (size_t i = 0; i < nthreads; i++) {
        ranges[i].start = ptr + pages * i / nthreads * HOST_PAGE;
        ranges[i].end = i + 1 == nthreads ? ptr + size : ptr + pages * (i + 1) / nthreads * HOST_PAGE;
    }
    /* Range 0 runs on the calling thread. */
    for (size_t i = 1; i < nthreads; i++)
        started[i] = pthread_create(&threads[i], NULL, prefault_run, &ranges[i]) == 0;
    prefault_run(&ranges[0]);
    for (size_t i = 1; i < nthreads; i++) {
        if (started[i])
            pthread_join(threads[i], NULL);
        else
            prefault_run(&ranges[i]);
    }
}

/*
 * Register mode: page-aligned malloc (2 MiB-aligned, transparent huge pages
 * where large), parallel pre-fault, host_register, and a check that the
 * device sees the same address. Returns CCA_OK, CCA_ERR_OUT_OF_MEMORY,
 * CCA_ERR_NOT_SUPPORTED (addresses differ), or the backend's status.
 */
static cca_status_t register_alloc(host_alloc_t *h, size_t size, void **out)
{
    cca_backend_t *be = h->backend;
    size_t length = host_round_up(size, HOST_PAGE);
    size_t align = length >= HOST_HUGE ? HOST_HUGE : HOST_PAGE;
    void *ptr = NULL, *device_ptr = NULL;
    cca_status_t status;

    if (posix_memalign(&ptr, align, length) != 0)
        return cca_raise(CCA_ERR_OUT_OF_MEMORY,
                         "out of host memory: malloc of %zu bytes for pinned memory failed", length);
#ifdef MADV_HUGEPAGE
    if (align == HOST_HUGE)
        (void)madvise(ptr, length, MADV_HUGEPAGE);
#endif
    prefault(ptr, length, atomic_load_explicit(&h->register_threads, memory_order_relaxed));

    status = be->host_register(be->ctx, ptr, length, &device_ptr);
    if (status != CCA_OK)
        goto out_free;
    if (device_ptr != ptr) {
        (void)be->host_unregister(be->ctx, ptr);
        status = cca_raise(CCA_ERR_NOT_SUPPORTED,
                           "host and device pointers differ after host_register (%p vs %p): "
                           "this system cannot use pinned_use_cuda_host_register:True; "
                           "leave it False (the default)",
                           ptr, device_ptr);
        goto out_free;
    }
    *out = ptr;
    return CCA_OK;

out_free:
    free(ptr);
    return status;
}

/* Obtain size bytes of pinned memory from the system, timed and counted. */
cca_status_t host_sys_alloc(host_alloc_t *h, size_t size, void **ptr, host_origin_t *origin)
{
    cca_backend_t *be = h->backend;
    bool use_register = atomic_load_explicit(&h->use_register, memory_order_relaxed);
    uint64_t t0 = cca_now_ns();
    cca_status_t status = use_register ? register_alloc(h, size, ptr)
                                       : be->host_alloc(be->ctx, size, ptr);
    uint64_t t1 = cca_now_ns();
    if (status != CCA_OK)
        return status;
    *origin = use_register ? HOST_ORIGIN_REGISTER : HOST_ORIGIN_ALLOC;
    pthread_mutex_lock(&h->stats_lock);
    h->num_host_alloc++;
    host_duration_add(&h->alloc_time, (int64_t)((t1 - t0) / 1000));
    pthread_mutex_unlock(&h->stats_lock);
    return CCA_OK;
}

/* Give system memory back the way host_sys_alloc obtained it, timed and counted. */
cca_status_t host_sys_free(host_alloc_t *h, void *ptr, host_origin_t origin)
{
    cca_backend_t *be = h->backend;
    uint64_t t0 = cca_now_ns();
    cca_status_t status;
    if (origin == HOST_ORIGIN_REGISTER) {
        status = be->host_unregister(be->ctx, ptr);
        if (status == CCA_OK)
            free(ptr);
    } else {
        status = be->host_free(be->ctx, ptr);
    }
    uint64_t t1 = cca_now_ns();
    if (status != CCA_OK)
        return status;
    pthread_mutex_lock(&h->stats_lock);
    h->num_host_free++;
    host_duration_add(&h->free_time, (int64_t)((t1 - t0) / 1000));
    pthread_mutex_unlock(&h->stats_lock);
    return CCA_OK;
}

/*
 * Carve size bytes (page-rounded) from the reserve segment, creating the
 * segment on first use. *ptr = NULL when there is no reserve, it is being
 * created by another thread, or it has no room left. Returns CCA_OK or the
 * status of the segment's creation.
 */
cca_status_t host_reserve_take(host_alloc_t *h, size_t size, void **ptr)
{
    size_t carve = host_round_up(size, HOST_PAGE);
    *ptr = NULL;
    pthread_mutex_lock(&h->reserve_lock);
    if (h->reserve_state == 0) {
        size_t want = atomic_load_explicit(&h->reserve_request, memory_order_relaxed);
        if (want == 0) {
            pthread_mutex_unlock(&h->reserve_lock);
            return CCA_OK;
        }
        h->reserve_state = 1;
        pthread_mutex_unlock(&h->reserve_lock);

        void *base = NULL;
        host_origin_t origin = HOST_ORIGIN_ALLOC;
        cca_status_t status = host_sys_alloc(h, want, &base, &origin);

        pthread_mutex_lock(&h->reserve_lock);
        if (status != CCA_OK) {
            h->reserve_state = 0;
            pthread_mutex_unlock(&h->reserve_lock);
            return status;
        }
        h->reserve_base = base;
        h->reserve_size = want;
        h->reserve_used = 0;
        h->reserve_origin = origin;
        h->reserve_state = 2;
    }
    if (h->reserve_state == 2 && carve <= h->reserve_size - h->reserve_used) {
        *ptr = h->reserve_base + h->reserve_used;
        h->reserve_used += carve;
    }
    pthread_mutex_unlock(&h->reserve_lock);
    return CCA_OK;
}

/*
 * Give a block (not carved, in no free list, not allocated, no pending
 * event) back to the system and forget it. On failure the block is
 * unchanged and still known; the caller caches it again.
 */
cca_status_t host_block_release(host_alloc_t *h, host_block_t *b)
{
    /* Forget it first: the system may hand the address out again at once. Its place in
     * the range array stays kept, for its return should the system refuse it. */
    host_map_remove(h, b);
    host_ranges_remove(h, b, true);
    cca_status_t status = host_sys_free(h, b->ptr, b->origin);
    if (status != CCA_OK) {
        host_ranges_insert(h, b);
        host_map_insert(h, b);
        return status;
    }
    host_ranges_unreserve(h);
    pthread_mutex_lock(&h->stats_lock);
    host_stat_decrease(&h->allocations, 1);
    host_stat_decrease(&h->allocated_bytes, (int64_t)b->size);
    pthread_mutex_unlock(&h->stats_lock);
    if (b->uses != b->inline_uses)
        free(b->uses);
    free(b);
    return CCA_OK;
}

/*
 * Give back a block that host_block_available_locked did not cache (larger
 * than pinned_max_cached_size); cached after all if that fails: empty_cache
 * retries. Lock not held.
 */
void host_block_discard(host_alloc_t *h, host_block_t *b)
{
    if (host_block_release(h, b) == CCA_OK)
        return;
    cca_spin_lock(&h->lock);
    host_class_push_locked(h, b);
    cca_spin_unlock(&h->lock);
}

/* A freed block whose events all completed: available again (cached, or given back). */
void host_block_available(host_alloc_t *h, host_block_t *b)
{
    cca_spin_lock(&h->lock);
    bool discard = host_block_available_locked(h, b);
    cca_spin_unlock(&h->lock);
    if (discard)
        host_block_discard(h, b);
}
