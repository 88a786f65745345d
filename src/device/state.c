/*
 * state.c - the device allocator's process-wide state and the questions
 * every layer may ask of it (is cca up, which backend, how many devices).
 * It calls nothing: setup.c brings the state up and down.
 * Invariant: cca_state is non-NULL exactly while cca_is_initialized().
 */

#include "device.h"
#include "state.h"

cca_state_t *cca_state;
static atomic_bool initialized;

bool cca_is_initialized(void)
{
    return atomic_load_explicit(&initialized, memory_order_acquire);
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
    atomic_store_explicit(&initialized, up, memory_order_release);
}
