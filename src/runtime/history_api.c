/*
 * history_api.c - the public history functions that need the device
 * allocator: the current device of annotations, compile contexts and user
 * metadata (bringing cca up as cca_get_device does), and cudaMallocAsync's
 * refusal of a recorded history. observe/trace.c keeps the history itself
 * and is handed the device through trace_device_fn, so that it calls nothing
 * above it.
 */
#include "async.h"
#include "state.h"
#include "trace.h"

/* The current device for entry point what (cca up first). */
static cca_status_t current_device(const char *what, int *device)
{
    cca_status_t st = cca_get_device(device);
    if (st != CCA_OK)
        return st;
    if (*device < 0 || *device >= CCA_MAX_DEVICES)
        return cca_raise(CCA_ERR_INVALID_ARGUMENT, "%s: device %d is out of range", what, *device);
    return CCA_OK;
}

/* The current device once cca is up; before, *device stays (device 0, as PyTorch 2.11's). */
static cca_status_t annotation_device(const char *what, int *device)
{
    return state_device_count() > 0 ? current_device(what, device) : CCA_OK;
}

cca_status_t cca_record_history(bool enabled, cca_context_fn fn, void *arg, size_t max_entries,
                                cca_record_context_t when)
{
    return trace_record_history(enabled, fn, arg, max_entries, when, async_enabled());
}

cca_status_t cca_record_annotation_fields(const char *const *keys, const char *const *values, size_t count)
{
    return trace_record_annotation(keys, values, count, annotation_device);
}

cca_status_t cca_record_annotation(const char *name)
{
    if (!name)
        return cca_raise(CCA_ERR_INVALID_ARGUMENT, "cca_record_annotation: name is NULL");
    static const char *const keys[2] = {"name", "stage"};
    const char *values[2] = {name, "START"};
    return cca_record_annotation_fields(keys, values, 2);
}

cca_status_t cca_push_compile_context(const char *context)
{
    return trace_push_compile_context(context, current_device);
}

cca_status_t cca_pop_compile_context(void)
{
    return trace_pop_compile_context(current_device);
}

cca_status_t cca_set_user_metadata(const char *metadata)
{
    return trace_set_user_metadata(metadata, current_device);
}

cca_status_t cca_get_user_metadata(char **metadata)
{
    return trace_get_user_metadata(metadata, current_device);
}
