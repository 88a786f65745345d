/*
 * init.c - bringing cca up and down as a whole: the device allocator
 * (device/state.c) composed with the pinned host allocator, and settings
 * changed at run time, applied to both. This file sits above every
 * allocator; nothing below calls into it.
 */
#include <pthread.h>

#include "async.h"
#include "device.h"
#include "host.h"
#include "ipc.h"
#include "shmcount.h"
#include "state.h"

/* Serialises bringing the host allocator up and down, and settings changes: each reads
 * the settings, changes and applies them as one, and the host allocator comes up on
 * settings no change is half way through. */
static pthread_mutex_t host_init_lock = PTHREAD_MUTEX_INITIALIZER;

/* Bring the pinned host allocator up on the running device state. */
static cca_status_t host_ensure(void)
{
    if (host_global())
        return CCA_OK;
    pthread_mutex_lock(&host_init_lock);
    cca_status_t st = CCA_OK;
    if (!host_global())
        st = host_global_init(cca_state->backend, &cca_state->settings);
    pthread_mutex_unlock(&host_init_lock);
    return st;
}

cca_status_t cca_init(void)
{
    cca_status_t st = state_ensure();
    if (st != CCA_OK)
        return st;
    return host_ensure();
}

cca_status_t cca_init_with_backend(cca_backend_t *backend, const char *settings_text)
{
    if (!backend)
        return cca_raise(CCA_ERR_INVALID_ARGUMENT, "cca_init_with_backend: backend is NULL");
    cca_status_t st = state_init_with_backend(backend, settings_text);
    if (st != CCA_OK)
        return st;
    st = host_ensure();
    if (st != CCA_OK)
        state_shutdown();
    return st;
}

void cca_shutdown(void)
{
    pthread_mutex_lock(&host_init_lock);
    host_global_shutdown();
    if (cca_is_initialized())
        ipc_shutdown(); /* mappings of other processes' memory, before the backend goes */
    state_shutdown();
    shmcount_shutdown();
    pthread_mutex_unlock(&host_init_lock);
}

/* Lock every device and stream pool, so settings change under no allocation. */
static void lock_world(bool lock)
{
    for (int d = 0; d < cca_state->device_count; d++) {
        cca_device_t *dev = &cca_state->devices[d];
        if (lock)
            pthread_mutex_lock(&dev->lock);
        for (size_t i = 0; i < dev->pool_table_cap; i++) {
            cca_stream_pool_t *sp = atomic_load(&dev->pool_table[i]);
            if (sp) {
                if (lock)
                    pool_lock(sp);
                else
                    cca_spin_unlock(&sp->lock);
            }
        }
        if (!lock)
            pthread_mutex_unlock(&dev->lock);
    }
}

/* cca_set_settings past initialisation, host_init_lock held. */
static cca_status_t set_settings_locked(const char *text)
{
    cca_settings_t next = cca_state->settings;
    settings_reset_for_new_string(&next); /* as PyTorch's setAllocatorSettings */
    cca_status_t st = settings_parse(&next, text, CCA_SRC_ARGUMENT);
    if (st != CCA_OK)
        return st;
    if (next.backend != cca_state->settings.backend)
        return cca_raise(CCA_ERR_NOT_SUPPORTED,
                         "the backend key can only be set before initialisation (CCA_ALLOC_CONF)");
    if (next.exact_peak_stats != cca_state->settings.exact_peak_stats)
        return cca_raise(CCA_ERR_NOT_SUPPORTED,
                         "exact_peak_stats can only be set before initialisation (CCA_ALLOC_CONF)");
    st = state_check_supported(&next);
    if (st != CCA_OK)
        return st;
    /* the pinned allocator first: it alone can fail (its event thread), and then it has
     * changed nothing; nothing below fails, so the device side changes only after it */
    if (host_global()) {
        st = host_apply_settings(host_global(), &next);
        if (st != CCA_OK)
            return st;
    }
    lock_world(true);
    bool fraction_changed =
        next.per_process_memory_fraction != cca_state->settings.per_process_memory_fraction;
    cca_state->settings = next;
    if (fraction_changed) { /* 0: no limit, as at initialisation */
        double fraction = next.per_process_memory_fraction;
        if (async_enabled())
            async_settings_fraction(fraction);
        for (int d = 0; d < cca_state->device_count; d++) {
            cca_device_t *dev = &cca_state->devices[d];
            dev->set_fraction = fraction > 0.0;
            dev->allowed_memory_maximum =
                fraction > 0.0 ? (size_t)(fraction * (double)dev->total_memory) : 0;
        }
    }
    lock_world(false);
    return CCA_OK;
}

cca_status_t cca_settings_current(char **text)
{
    if (!text)
        return cca_raise(CCA_ERR_INVALID_ARGUMENT, "cca_settings_current: text is NULL");
    cca_strbuf_t sb;
    sb_init(&sb);
    pthread_mutex_lock(&host_init_lock); /* set_settings_locked's and cca_shutdown's lock */
    bool live = cca_is_initialized();
    if (live)
        settings_describe(&cca_state->settings, &sb);
    pthread_mutex_unlock(&host_init_lock);
    if (!live)
        return cca_settings_describe(NULL, text);
    if (sb.failed || !sb.data) {
        sb_free(&sb);
        return cca_raise(CCA_ERR_OUT_OF_MEMORY, "cca_settings_current: out of host memory");
    }
    *text = sb.data;
    return CCA_OK;
}

cca_status_t cca_set_settings(const char *text)
{
    cca_status_t st = state_ensure();
    if (st != CCA_OK)
        return st;
    pthread_mutex_lock(&host_init_lock);
    st = set_settings_locked(text);
    pthread_mutex_unlock(&host_init_lock);
    return st;
}
