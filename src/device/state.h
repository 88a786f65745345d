/*
 * state.h - what the rest of cca needs of the process-wide allocator state,
 * and nothing more: whether it is up, bringing it up from the environment
 * on first use, and the device count. Files outside src/device include this
 * rather than device.h when that is all they need.
 */
#ifndef CCA_STATE_H
#define CCA_STATE_H

#include "internal.h"
#include "settings.h"

/* ---- state.c -------------------------------------------------------------------- */

/* True while the allocator is up (cca_is_initialized, inline for the hot paths). */
extern CCA_HIDDEN atomic_bool state_up;
static inline bool state_is_up(void)
{
    return atomic_load_explicit(&state_up, memory_order_acquire);
}

/* Devices of the running allocator; 0 when it is not initialised. */
int state_device_count(void);
/* Mark the state up or down (setup.c, with cca_state set first). */
void state_publish(bool up);

/* ---- setup.c -------------------------------------------------------------------- */

/* state_ensure's initialisation, when the allocator is not up. */
cca_status_t state_ensure_slow(void);

/* Initialise the device allocator from the environment if it is not up. */
static inline cca_status_t state_ensure(void)
{
    return state_is_up() ? CCA_OK : state_ensure_slow();
}
/*
 * Initialise it on backend with settings_text (NULL: CCA_ALLOC_CONF). Takes
 * the backend, also when initialisation fails or returns CCA_ERR_BUSY
 * (already initialised; destroyed then, unless it is the running backend).
 */
cca_status_t state_init_with_backend(cca_backend_t *backend, const char *settings_text);
/* Tear the device allocator down (no-op when it is not up). */
void state_shutdown(void);
/* CCA_ERR_NOT_SUPPORTED for settings this version cannot honour. */
cca_status_t state_check_supported(const cca_settings_t *s);
/*
 * The running state's settings object equal to *s: one kept already, or a
 * copy made and kept until shutdown (settings objects are never freed while
 * the state lives: a reader without a lock may still read an old one, and
 * settings switched back and forth reuse theirs, so they number no more than
 * the distinct settings ever set). Callers serialise (cca_set_settings'
 * lock). NULL: out of host memory (raised).
 */
const cca_settings_t *state_settings_keep(const cca_settings_t *s);
/* The settings objects the running state keeps (0 when not up). */
size_t state_settings_kept(void);

#endif /* CCA_STATE_H */
