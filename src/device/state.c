/*
 * state.c - the device allocator's process-wide state and the questions
 * every layer may ask of it (is cca up, which backend, how many devices).
 * It calls nothing: setup.c brings the state up and down.
 * Invariant: cca_state is non-NULL exactly while cca_is_initialized().
 */

#include "device.h"
#include "state.h"

cca_state_t *cca_state;
atomic_bool state_up;

bool cca_is_initialized(void)
{
    return state_is_up();
}

cca_backend_t *cca_current_backend(void)
{
    return cca_is_initialized() ? cca_state->backend : NULL;
}

const char *cca_backend_name(void)
{
    return cca_is_initialized() ? cca_state->backend->name : NULL;
}

int state_device_count(void)
{
    return cca_is_initialized() ? cca_state->device_count : 0;
}

void state_publish(bool up)
{
    atomic_store_explicit(&state_up, up, memory_order_release);
}
