/*
 * async.h - the cudaMallocAsync device allocator (`backend:cudaMallocAsync`):
 * the driver's stream-ordered pool behind cca's device API, with PyTorch
 * 2.11's semantics for that backend. The device entry points (src/device/,
 * the layer above) hand over to it when the setting is on; it keeps no
 * blocks, segments or caches of its own and includes nothing of src/device/.
 */
#ifndef CCA_ASYNC_H
#define CCA_ASYNC_H

#include "internal.h"

/* Non-NULL while cca runs with backend:cudaMallocAsync (async.c's state). */
extern CCA_HIDDEN struct async_state *async_active;

/* True while cca runs with backend:cudaMallocAsync. */
static inline bool async_enabled(void)
{
    return async_active != NULL;
}

/*
 * Set up / tear down the allocator's state (setup.c, the devices known):
 * backend, device_count devices of total_memory[d] bytes each, the memory
 * fraction per_process_memory_fraction gives (0: none). It keeps what it is
 * given: this backend sits below the device allocator and reads nothing of it.
 */
cca_status_t async_init(cca_backend_t *backend, int device_count, const size_t *total_memory,
                        double fraction);
/* Free what is still allocated (in stream order) and give streams back (before be goes). */
void async_shutdown(cca_backend_t *be);

/* The device entry points of this backend (arguments already validated). */
cca_status_t async_malloc(int device, size_t size, cca_stream_t stream, void **ptr);
cca_status_t async_free(void *ptr);
cca_status_t async_record_stream(void *ptr, cca_stream_t stream);
cca_status_t async_empty_cache(void);
cca_status_t async_cache_info(int device, size_t *total_cached, size_t *largest_block);
/* The pool's reserved minus used bytes, without cache_info's trial allocation (0: not set up). */
cca_status_t async_cached_bytes(int device, size_t *cached);
cca_status_t async_get_base_allocation(void *ptr, void **base, size_t *size);
cca_status_t async_set_memory_fraction(double fraction, int device);
/* The fraction in force on device (1.0: none set). */
double async_get_memory_fraction(int device);
/* per_process_memory_fraction set at run time: every device's limit. */
void async_settings_fraction(double fraction);
/* Tests: allocations so far that waited for another's driver call before refusing (charge). */
size_t async_test_charge_waits(void);
cca_status_t async_get_device_stats(int device, cca_device_stats_t *stats);
cca_status_t async_reset_peak_stats(int device);
cca_status_t async_reset_accumulated_stats(int device);
/*
 * Graph capture with this backend (PyTorch's beginAllocateToPool /
 * endAllocateToPool of CudaMallocAsync): begin marks a capture underway
 * (CCA_ERR_BUSY if one is: one at a time in the process); stream (may be
 * NULL) is the capture stream, which end makes wait for every stream a free
 * was queued on meanwhile (CCA_ERR_BUSY if no capture is underway).
 */
cca_status_t async_begin_capture(int device, cca_stream_t stream);
cca_status_t async_end_capture(int device);
/* Frees deferred by a capture and not done yet (tests). */
size_t async_deferred_count(void);
/* Number of live allocations (tests, shutdown checks). */
size_t async_live_count(void);

#endif /* CCA_ASYNC_H */
