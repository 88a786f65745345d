/*
 * backend_ops.c - names of the backend operations (cca_backend_op_t), shared
 * by every backend, fault injection messages and the statistics printers.
 * Invariant: one name per enumerator, in enumeration order.
 */
#include "internal.h"

static const char *const op_names[CCA_OP_COUNT] = {
    [CCA_OP_MALLOC] = "malloc",
    [CCA_OP_FREE] = "free",
    [CCA_OP_MEM_GET_INFO] = "mem_get_info",
    [CCA_OP_STREAM_SYNCHRONIZE] = "stream_synchronize",
    [CCA_OP_DEVICE_SYNCHRONIZE] = "device_synchronize",
    [CCA_OP_EVENT_CREATE] = "event_create",
    [CCA_OP_EVENT_DESTROY] = "event_destroy",
    [CCA_OP_EVENT_RECORD] = "event_record",
    [CCA_OP_EVENT_QUERY] = "event_query",
    [CCA_OP_EVENT_SYNCHRONIZE] = "event_synchronize",
    [CCA_OP_STREAM_CAPTURE_STATUS] = "stream_capture_status",
    [CCA_OP_VMM_GRANULARITY] = "vmm_granularity",
    [CCA_OP_VMM_RESERVE] = "vmm_reserve",
    [CCA_OP_VMM_FREE] = "vmm_free",
    [CCA_OP_VMM_CREATE] = "vmm_create",
    [CCA_OP_VMM_RELEASE] = "vmm_release",
    [CCA_OP_VMM_MAP] = "vmm_map",
    [CCA_OP_VMM_UNMAP] = "vmm_unmap",
    [CCA_OP_VMM_SET_ACCESS] = "vmm_set_access",
    [CCA_OP_HOST_ALLOC] = "host_alloc",
    [CCA_OP_HOST_FREE] = "host_free",
    [CCA_OP_HOST_REGISTER] = "host_register",
    [CCA_OP_HOST_UNREGISTER] = "host_unregister",
    [CCA_OP_IPC_GET] = "ipc_get_handle",
    [CCA_OP_IPC_OPEN] = "ipc_open",
    [CCA_OP_IPC_CLOSE] = "ipc_close",
    [CCA_OP_CAN_ACCESS_PEER] = "can_access_peer",
    [CCA_OP_ENABLE_PEER_ACCESS] = "enable_peer_access",
    [CCA_OP_MEMCPY_PEER] = "memcpy_peer_async",
    [CCA_OP_STREAM_CREATE] = "stream_create",
    [CCA_OP_STREAM_DESTROY] = "stream_destroy",
    [CCA_OP_STREAM_WAIT_EVENT] = "stream_wait_event",
    [CCA_OP_MALLOC_ASYNC] = "malloc_async",
    [CCA_OP_FREE_ASYNC] = "free_async",
    [CCA_OP_MEMPOOL_TRIM] = "mempool_trim",
    [CCA_OP_MEMPOOL_GET_ATTR] = "mempool_get_attr",
    [CCA_OP_MEMPOOL_SET_ATTR] = "mempool_set_attr",
    [CCA_OP_MEMPOOL_SET_ACCESS] = "mempool_set_access",
    [CCA_OP_IPC_EVENT_CREATE] = "ipc_event_create",
    [CCA_OP_IPC_EVENT_GET] = "ipc_event_get_handle",
    [CCA_OP_IPC_EVENT_OPEN] = "ipc_event_open",
    [CCA_OP_STREAM_CAPTURE_INFO] = "stream_capture_info",
    [CCA_OP_GRAPH_NODE_DEPENDENCIES] = "graph_node_dependencies",
    [CCA_OP_VMM_EXPORT] = "vmm_export",
    [CCA_OP_VMM_IMPORT] = "vmm_import",
};

/* Name of a backend operation; "unknown" for a value outside the enum. */
const char *cca_backend_op_name(cca_backend_op_t op)
{
    if ((int)op < 0 || op >= CCA_OP_COUNT || !op_names[op])
        return "unknown";
    return op_names[op];
}
