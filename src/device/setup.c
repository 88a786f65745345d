/*
 * setup.c - bringing the device allocator up and down: from the
 * environment on first use (CCA_BACKEND, CCA_SIM_DEVICES, CCA_SIM_MEMORY,
 * CCA_ALLOC_CONF, CCA_NO_CACHING) or on a given backend; the device count
 * and current device. runtime/init.c composes it with the pinned host
 * allocator.
 * Invariant: the state is published (state_publish) only once every device
 * is set up, and unpublished before anything is torn down.
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "async.h"
#include "device.h"
#include "shared.h"
#include "state.h"

static pthread_mutex_t init_lock = PTHREAD_MUTEX_INITIALIZER;

/* A settings object of the state's (state_settings_keep). */
typedef struct cca_settings_kept {
    struct cca_settings_kept *next;
    cca_settings_t settings;
} cca_settings_kept_t;

/* Keep a copy of *s on S's list (S not yet published, or cca_set_settings' lock held). */
static const cca_settings_t *settings_keep(cca_state_t *S, const cca_settings_t *s)
{
    for (cca_settings_kept_t *k = S->settings_kept; k; k = k->next)
        if (!memcmp(&k->settings, s, sizeof(*s)))
            return &k->settings;
    cca_settings_kept_t *k = calloc(1, sizeof(*k));
    if (!k) {
        cca_raise(CCA_ERR_OUT_OF_MEMORY, "out of host memory for the settings");
        return NULL;
    }
    memcpy(&k->settings, s, sizeof(*s));
    k->next = S->settings_kept;
    S->settings_kept = k;
    return &k->settings;
}

const cca_settings_t *state_settings_keep(const cca_settings_t *s)
{
    return settings_keep(cca_state, s);
}

size_t state_settings_kept(void)
{
    size_t n = 0;
    if (cca_is_initialized())
        for (cca_settings_kept_t *k = cca_state->settings_kept; k; k = k->next)
            n++;
    return n;
}

/* Free an uncached allocation still live at shutdown (the map is destroyed next). */
static void free_uncached_block(cca_block_t *b, void *arg)
{
    cca_backend_t *be = arg;
    if (!b->pool) {
        be->free(be->ctx, b->device, (void *)b->addr);
        free(b);
    }
}

/* Features the settings may ask for that this version does not provide. */
cca_status_t state_check_supported(const cca_settings_t *s)
{
    (void)s; /* everything the settings ask for is provided */
    return CCA_OK;
}

static void destroy_state(cca_state_t *S, int devices_ready)
{
    async_shutdown(S->backend);
    shared_shutdown();
    if (S->ptrmap)
        ptrmap_for_each(S->ptrmap, free_uncached_block, S->backend, NULL);
    for (int d = 0; d < devices_ready; d++) {
        expandable_device_shutdown(&S->devices[d]);
        pool_device_shutdown(&S->devices[d]);
    }
    ptrmap_destroy(S->ptrmap);
    free(S->devices);
    free(S->free_callbacks);
    free(S->oom_observers);
    pthread_mutex_destroy(&S->callbacks_lock);
    if (S->backend && S->backend->destroy)
        S->backend->destroy(S->backend->ctx);
    while (S->settings_kept) {
        cca_settings_kept_t *k = S->settings_kept;
        S->settings_kept = k->next;
        free(k);
    }
    free(S);
}

/* Bring cca up on backend with settings (init_lock held). Takes the backend. */
static cca_status_t init_locked(cca_backend_t *backend, const cca_settings_t *settings)
{
    cca_status_t st;
    int devices_ready = 0;
    cca_state_t *S = calloc(1, sizeof(*S));
    if (!S) {
        backend->destroy(backend->ctx);
        return cca_raise(CCA_ERR_OUT_OF_MEMORY, "out of host memory initialising cca");
    }
    S->backend = backend;
    pthread_mutex_init(&S->callbacks_lock, NULL);
    const cca_settings_t *first = settings_keep(S, settings);
    atomic_init(&S->settings, first);
    const char *nc = getenv("CCA_NO_CACHING");
    S->no_caching = nc && strcmp(nc, "0") != 0 && *nc;
    cca_state = S; /* pool_device_init reads the settings through it */

    if (!first) {
        st = CCA_ERR_OUT_OF_MEMORY;
        goto out_destroy;
    }
    st = state_check_supported(settings);
    if (st != CCA_OK)
        goto out_destroy;
    st = backend->device_count(backend->ctx, &S->device_count);
    if (st != CCA_OK)
        goto out_destroy;
    if (S->device_count <= 0) {
        st = cca_raise(CCA_ERR_NO_DEVICE,
                       "the %s backend reports no device; to run without a GPU set CCA_BACKEND=sim",
                       backend->name);
        goto out_destroy;
    }
    if (S->device_count > CCA_MAX_DEVICES)
        S->device_count = CCA_MAX_DEVICES;
    st = ptrmap_create(&S->ptrmap, pool_solo_end);
    if (st != CCA_OK)
        goto out_destroy;
    S->devices = calloc((size_t)S->device_count, sizeof(*S->devices));
    if (!S->devices) {
        st = cca_raise(CCA_ERR_OUT_OF_MEMORY, "out of host memory initialising cca");
        goto out_destroy;
    }
    for (int d = 0; d < S->device_count; d++) {
        cca_device_props_t props;
        st = backend->device_props(backend->ctx, d, &props);
        if (st != CCA_OK)
            goto out_destroy;
        st = pool_device_init(&S->devices[d], d, props.total_memory);
        if (st != CCA_OK)
            goto out_destroy;
        devices_ready++;
    }
    if (settings->backend == CCA_BACKEND_ASYNC) {
        size_t totals[CCA_MAX_DEVICES];
        for (int d = 0; d < S->device_count; d++)
            totals[d] = S->devices[d].total_memory;
        st = async_init(S->backend, S->device_count, totals, settings->per_process_memory_fraction);
        if (st != CCA_OK)
            goto out_destroy;
    }
    state_publish(true);
    return CCA_OK;

out_destroy:
    cca_state = NULL;
    destroy_state(S, devices_ready);
    return st;
}

/* Settings from CCA_ALLOC_CONF over the defaults. */
static cca_status_t settings_from_env(cca_settings_t *s)
{
    settings_default(s);
    const char *conf = getenv("CCA_ALLOC_CONF");
    return settings_parse(s, conf, CCA_SRC_ENVIRONMENT);
}

/* The backend CCA_BACKEND names (default cuda). */
static cca_status_t backend_from_env(cca_backend_t **backend)
{
    const char *name = getenv("CCA_BACKEND");
    if (!name || !*name || !strcmp(name, "cuda"))
        return cca_cuda_create(backend);
    if (strcmp(name, "sim") != 0)
        return cca_raise(CCA_ERR_INVALID_ARGUMENT,
                         "CCA_BACKEND=%s is not a backend: use cuda or sim", name);
    cca_sim_config_t cfg;
    memset(&cfg, 0, sizeof(cfg));
    const char *devices = getenv("CCA_SIM_DEVICES");
    if (devices && *devices) {
        char *end = NULL;
        errno = 0;
        long n = strtol(devices, &end, 10);
        if (errno || *end || n < 1 || n > 16)
            return cca_raise(CCA_ERR_INVALID_ARGUMENT,
                             "CCA_SIM_DEVICES=%s: expected a number of devices from 1 to 16", devices);
        cfg.devices = (int)n;
    }
    const char *memory = getenv("CCA_SIM_MEMORY");
    if (memory && *memory && (!cca_parse_bytes(memory, &cfg.total_memory) || cfg.total_memory == 0))
        return cca_raise(CCA_ERR_INVALID_ARGUMENT,
                         "CCA_SIM_MEMORY=%s: expected a size such as 80G, 512M or 1073741824", memory);
    return cca_sim_create(&cfg, backend);
}

cca_status_t state_ensure_slow(void)
{
    pthread_mutex_lock(&init_lock);
    cca_status_t st = CCA_OK;
    if (!cca_is_initialized()) {
        cca_settings_t settings;
        cca_backend_t *backend = NULL;
        st = settings_from_env(&settings);
        if (st == CCA_OK)
            st = backend_from_env(&backend);
        if (st == CCA_OK)
            st = init_locked(backend, &settings);
    }
    pthread_mutex_unlock(&init_lock);
    return st;
}

cca_status_t state_init_with_backend(cca_backend_t *backend, const char *settings_text)
{
    pthread_mutex_lock(&init_lock);
    cca_status_t st;
    if (cca_is_initialized()) {
        /* the backend is cca's on every return, as on the other errors: destroyed here,
         * unless it is the one cca runs on (given twice), which must stay */
        if (backend != cca_state->backend)
            backend->destroy(backend->ctx);
        st = cca_raise(CCA_ERR_BUSY, "cca is already initialised; call cca_shutdown first (the "
                                     "backend given was destroyed)");
        pthread_mutex_unlock(&init_lock);
        return st;
    }
    cca_settings_t settings;
    if (settings_text) {
        settings_default(&settings);
        st = settings_parse(&settings, settings_text, CCA_SRC_ARGUMENT);
    } else {
        st = settings_from_env(&settings);
    }
    if (st == CCA_OK)
        st = init_locked(backend, &settings);
    else
        backend->destroy(backend->ctx);
    pthread_mutex_unlock(&init_lock);
    return st;
}

void state_shutdown(void)
{
    pthread_mutex_lock(&init_lock);
    if (cca_is_initialized()) {
        state_publish(false);
        cca_state_t *S = cca_state; /* device shutdown reaches the backend through it */
        destroy_state(S, S->device_count);
        cca_state = NULL;
    }
    pthread_mutex_unlock(&init_lock);
}

cca_status_t cca_device_count(int *count)
{
    cca_status_t st = state_ensure();
    if (st != CCA_OK)
        return st;
    if (!count)
        return cca_raise(CCA_ERR_INVALID_ARGUMENT, "cca_device_count: count is NULL");
    *count = cca_state->device_count;
    return CCA_OK;
}

cca_status_t cca_get_device(int *device)
{
    cca_status_t st = state_ensure();
    if (st != CCA_OK)
        return st;
    if (!device)
        return cca_raise(CCA_ERR_INVALID_ARGUMENT, "cca_get_device: device is NULL");
    return cca_state->backend->get_device(cca_state->backend->ctx, device);
}

cca_status_t cca_set_device(int device)
{
    cca_status_t st = state_ensure();
    if (st != CCA_OK)
        return st;
    if (device < 0 || device >= cca_state->device_count)
        return cca_raise(CCA_ERR_INVALID_ARGUMENT, "cca_set_device: device %d is out of range (%d devices)",
                         device, cca_state->device_count);
    return cca_state->backend->set_device(cca_state->backend->ctx, device);
}

