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
 * the backend, also when initialisation fails; CCA_ERR_BUSY (backend not
 * taken) if already initialised.
 */
cca_status_t state_init_with_backend(cca_backend_t *backend, const char *settings_text);
/* Tear the device allocator down (no-op when it is not up). */
void state_shutdown(void);
/* CCA_ERR_NOT_SUPPORTED for settings this version cannot honour. */
cca_status_t state_check_supported(const cca_settings_t *s);

#endif /* CCA_STATE_H */
