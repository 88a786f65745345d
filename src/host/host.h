/*
 * host.h - the pinned host caching allocator (PyTorch's CachingHostAllocator):
 * an internal object the public cca_host_* functions run on, and the hooks
 * the core calls at cca_init / cca_shutdown.
 *
 * Invariant: every block the allocator holds from the system is in its
 * pointer map until it is given back, exactly once, the way it was obtained
 * (backend host_free, or host_unregister + free, or, for blocks carved from
 * the reserve segment, with the segment at destroy).
 */
#ifndef CCA_HOST_H
#define CCA_HOST_H

#include "internal.h"
#include "settings.h"

typedef struct host_alloc host_alloc_t;

/*
 * Create a host allocator on backend with the pinned_* fields of settings.
 * Starts the event thread when pinned_use_background_threads is set.
 * Returns CCA_OK, CCA_ERR_INVALID_ARGUMENT, CCA_ERR_OUT_OF_MEMORY.
 */
cca_status_t host_create(cca_backend_t *backend, const cca_settings_t *settings,
                         host_alloc_t **out);

/*
 * Stop the event thread, destroy pending and pooled events and give every
 * block (cached or still in use) back to the system. NULL is a no-op. Not
 * thread-safe with any other call on h.
 */
void host_destroy(host_alloc_t *h);

/*
 * Allocate size bytes of pinned memory. Size 0 gives *ptr = NULL. Returns
 * CCA_OK, CCA_ERR_INVALID_ARGUMENT (ptr NULL, size >= 1 EB),
 * CCA_ERR_OUT_OF_MEMORY, CCA_ERR_BACKEND, CCA_ERR_NOT_SUPPORTED (register
 * mode on a system whose device pointer differs from the host pointer).
 */
cca_status_t host_malloc(host_alloc_t *h, void **ptr, size_t size);

/*
 * Free a pointer from host_malloc. NULL is a no-op. The block is reused once
 * the events recorded at this call on every stream named by
 * host_record_event have completed. On error nothing changes. Returns
 * CCA_OK, CCA_ERR_INVALID_POINTER (unknown, interior or already freed),
 * CCA_ERR_OUT_OF_MEMORY, CCA_ERR_BACKEND (event create/record failed).
 */
cca_status_t host_release_ptr(host_alloc_t *h, void *ptr);

/*
 * Mark the block holding ptr (any address inside it) as used by stream on
 * the calling thread's current device. Returns CCA_OK,
 * CCA_ERR_INVALID_POINTER (not a live block of this allocator),
 * CCA_ERR_INVALID_ARGUMENT (device index out of range),
 * CCA_ERR_OUT_OF_MEMORY, CCA_ERR_BACKEND (get_device failed).
 */
cca_status_t host_record_event(host_alloc_t *h, void *ptr, cca_stream_t stream);

/*
 * Give back every cached block whose events completed (blocks carved from
 * the reserve segment stay cached). Returns CCA_OK or the first backend
 * error; a block whose release failed stays cached.
 */
cca_status_t host_empty_cache(host_alloc_t *h);

/* Statistics (PyTorch 2.11's HostStats). Return CCA_OK, CCA_ERR_INVALID_ARGUMENT. */
cca_status_t host_get_stats(host_alloc_t *h, cca_host_stats_t *stats);
void host_reset_accumulated_stats(host_alloc_t *h);
void host_reset_peak_stats(host_alloc_t *h);

/*
 * Apply changed pinned_* settings at run time: rounding threshold, cached
 * size limit, register mode and thread count apply to later operations;
 * the event thread starts or stops; the reserve size applies only if the
 * reserve segment was not created yet. Returns CCA_OK, CCA_ERR_OUT_OF_MEMORY
 * or CCA_ERR_BACKEND (the event thread could not start); on failure no
 * setting has changed.
 */
cca_status_t host_apply_settings(host_alloc_t *h, const cca_settings_t *settings);

/* Validity check for tests and expensive assertions: free lists, map and counters agree. */
bool host_is_valid(host_alloc_t *h);

/*
 * Tests: the n-th host allocation from now for the allocators' own records
 * (block records, the range array, stream uses, events, the pointer map's
 * growth) fails (0: none), as it would with the host out of memory.
 */
void host_test_fail_records(long n);

/* Tests: starting the background event thread fails while on, as it would
 * with the system out of threads. */
void host_test_fail_background_start(bool on);

/* ---- the global instance behind cca_host_* (called by cca_init / cca_shutdown) ---- */

/* Create the global host allocator. Returns host_create's statuses, CCA_ERR_BUSY if it exists. */
cca_status_t host_global_init(cca_backend_t *backend, const cca_settings_t *settings);

/* Destroy the global host allocator (no-op if none). */
void host_global_shutdown(void);

/* The global instance, NULL if none (for the core's settings and stats plumbing). */
host_alloc_t *host_global(void);

#endif /* CCA_HOST_H */
