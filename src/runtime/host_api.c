/*
 * host_api.c - the process-global pinned host allocator and the public
 * cca_host_* functions, thin wrappers over host.h that initialise cca first.
 * Invariant: the global instance is created once by cca_init and destroyed
 * by cca_shutdown; the wrappers never run on a destroyed one.
 */
#include <stdatomic.h>

#include "host.h"

/* ------------------------------------------------------------------------ */
/* The global instance and the public functions                             */
/* ------------------------------------------------------------------------ */

static _Atomic(host_alloc_t *) global_host;

cca_status_t host_global_init(cca_backend_t *backend, const cca_settings_t *settings)
{
    if (atomic_load(&global_host))
        return cca_raise(CCA_ERR_BUSY, "the pinned host allocator is already initialised");
    host_alloc_t *h;
    cca_status_t status = host_create(backend, settings, &h);
    if (status != CCA_OK)
        return status;
    atomic_store(&global_host, h);
    return CCA_OK;
}

void host_global_shutdown(void)
{
    host_alloc_t *h = atomic_exchange(&global_host, NULL);
    host_destroy(h);
}

host_alloc_t *host_global(void)
{
    return atomic_load_explicit(&global_host, memory_order_acquire);
}

/* Initialise cca and return the global host allocator in *h (the first call's path). */
static __attribute__((noinline)) cca_status_t global_start(host_alloc_t **h)
{
    cca_status_t status = cca_init();
    if (status != CCA_OK)
        return status;
    *h = host_global();
    if (!*h)
        return cca_raise(CCA_ERR_NOT_INITIALIZED, "the pinned host allocator is not initialised");
    return CCA_OK;
}

/* Initialise cca if needed and return the global host allocator in *h. */
static inline cca_status_t global_get(host_alloc_t **h)
{
    /* read directly: a call to host_global() is not inlined in the position-independent build */
    *h = atomic_load_explicit(&global_host, memory_order_acquire);
    if (*h) /* it exists only while cca is up */
        return CCA_OK;
    return global_start(h);
}

/* cca_host_malloc and cca_host_free before cca is up (out of line: the calls
 * after it need no stack frame). */
static __attribute__((noinline)) cca_status_t host_malloc_first(void **ptr, size_t size)
{
    host_alloc_t *h;
    cca_status_t status = global_start(&h);
    return status != CCA_OK ? status : host_malloc(h, ptr, size);
}

static __attribute__((noinline)) cca_status_t host_free_first(void *ptr)
{
    host_alloc_t *h;
    cca_status_t status = global_start(&h);
    return status != CCA_OK ? status : host_release_ptr(h, ptr);
}

cca_status_t cca_host_malloc(void **ptr, size_t size)
{
    host_alloc_t *h = atomic_load_explicit(&global_host, memory_order_acquire);
    return h ? host_malloc(h, ptr, size) : host_malloc_first(ptr, size);
}

cca_status_t cca_host_free(void *ptr)
{
    host_alloc_t *h = atomic_load_explicit(&global_host, memory_order_acquire);
    return h ? host_release_ptr(h, ptr) : host_free_first(ptr);
}

cca_status_t cca_host_record_event(void *ptr, cca_stream_t stream)
{
    host_alloc_t *h;
    cca_status_t status = global_get(&h);
    return status != CCA_OK ? status : host_record_event(h, ptr, stream);
}

cca_status_t cca_host_empty_cache(void)
{
    host_alloc_t *h;
    cca_status_t status = global_get(&h);
    return status != CCA_OK ? status : host_empty_cache(h);
}

cca_status_t cca_host_get_stats(cca_host_stats_t *stats)
{
    host_alloc_t *h;
    cca_status_t status = global_get(&h);
    return status != CCA_OK ? status : host_get_stats(h, stats);
}

cca_status_t cca_host_reset_accumulated_stats(void)
{
    host_alloc_t *h;
    cca_status_t status = global_get(&h);
    if (status == CCA_OK)
        host_reset_accumulated_stats(h);
    return status;
}

cca_status_t cca_host_reset_peak_stats(void)
{
    host_alloc_t *h;
    cca_status_t status = global_get(&h);
    if (status == CCA_OK)
        host_reset_peak_stats(h);
    return status;
}
