/*
 * cuda_internal.h - what the CUDA backend's files share: the CUDA headers,
 * the backend's state (cuda_ctx_t, immutable after cca_cuda_create but for
 * the export table under its lock), the error and device-switching helpers
 * (cuda.c) and the operations of the contract each file defines, for
 * cca_cuda_create's table. Only src/backend/cuda/ includes it (the only
 * code of cca that includes CUDA headers).
 */
#ifndef CCA_CUDA_INTERNAL_H
#define CCA_CUDA_INTERNAL_H

#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime_api.h>

#include "internal.h"

/* Driver entry points used for virtual memory (NULL when unavailable). */
typedef struct cuda_driver {
    PFN_cuGetErrorString_v6000 get_error_string;
    PFN_cuMemGetAllocationGranularity_v10020 mem_get_allocation_granularity;
    PFN_cuMemAddressReserve_v10020 mem_address_reserve;
    PFN_cuMemAddressFree_v10020 mem_address_free;
    PFN_cuMemCreate_v10020 mem_create;
    PFN_cuMemRelease_v10020 mem_release;
    PFN_cuMemMap_v10020 mem_map;
    PFN_cuMemUnmap_v10020 mem_unmap;
    PFN_cuMemSetAccess_v10020 mem_set_access;
    PFN_cuMemExportToShareableHandle_v10020 mem_export;   /* IPC of expandable segments */
    PFN_cuMemImportFromShareableHandle_v10020 mem_import;
    PFN_cuDeviceGetAttribute_v2000 device_get_attribute;
    PFN_cuCtxGetCurrent_v4000 ctx_get_current;            /* the current device, cached */
    bool vmm;  /* every VMM entry point was found */
} cuda_driver_t;

/* A physical handle's exported file descriptor, closed when the handle is released. */
typedef struct cuda_export {
    CUmemGenericAllocationHandle handle;
    int fd;
} cuda_export_t;

#define CUDA_MAX_SHAREABLE_DEVICES 64

/* The backend's state; the operation table lives inside it, so destroy frees both. */
typedef struct cuda_ctx {
    cca_backend_t backend; /* the table handed to the core; backend.ctx points here */
    int device_count;      /* devices visible to this process, > 0 */
    cuda_driver_t driver;  /* read-only after creation */
    /* Per device: 0 unknown, 1 physical memory is created shareable as a POSIX
     * file descriptor, -1 it cannot be (attribute, or cuMemCreate refused it). */
    _Atomic int shareable[CUDA_MAX_SHAREABLE_DEVICES];
    pthread_mutex_t export_lock; /* guards exports */
    cuda_export_t *exports;
    size_t export_count, export_cap;
} cuda_ctx_t;

/* ---- cuda.c: errors and device switching ------------------------------------- */

/* A failed runtime call as a cca status (its comment in cuda.c). */
cca_status_t cuda_fail(cudaError_t err, const char *call);
/* A failed driver call as a cca status. */
cca_status_t cuda_driver_fail(const cuda_ctx_t *cx, CUresult res, const char *call);
/* Make device current on the calling thread; *previous: the device to restore. */
cca_status_t cuda_enter_device(int device, int *previous);
/* Restore the device saved by cuda_enter_device. */
void cuda_leave_device(int device, int previous);

/* ---- cuda_runtime.c: memory, events, graphs, IPC, peers, streams, mempool -------- */

cca_status_t cuda_malloc(void *ctx, int device, size_t size, void **ptr);
cca_status_t cuda_free(void *ctx, int device, void *ptr);
cca_status_t cuda_stream_synchronize(void *ctx, int device, cca_stream_t stream);
cca_status_t cuda_device_synchronize(void *ctx, int device);
cca_status_t cuda_event_create(void *ctx, int device, cca_event_t *event);
cca_status_t cuda_event_destroy(void *ctx, int device, cca_event_t event);
cca_status_t cuda_event_record(void *ctx, int device, cca_event_t event,
                               cca_stream_t stream);
cca_status_t cuda_event_query(void *ctx, int device, cca_event_t event);
cca_status_t cuda_event_synchronize(void *ctx, int device, cca_event_t event);
cca_status_t cuda_stream_capture_status(void *ctx, int device, cca_stream_t stream,
                                        int *status);
cca_status_t cuda_stream_capture_info(void *ctx, int device, cca_stream_t stream, int *status,
                                      uint64_t *capture_id, const cca_graph_node_t **terminals,
                                      size_t *count);
cca_status_t cuda_graph_node_dependencies(void *ctx, int device, cca_graph_node_t node,
                                          cca_graph_node_t *deps, size_t *count);
cca_status_t cuda_ipc_get_handle(void *ctx, int device, void *ptr, cca_ipc_handle_t *handle);
cca_status_t cuda_ipc_open(void *ctx, int device, const cca_ipc_handle_t *handle,
                           void **ptr);
cca_status_t cuda_ipc_close(void *ctx, int device, void *ptr);
cca_status_t cuda_ipc_event_create(void *ctx, int device, cca_event_t *event);
cca_status_t cuda_ipc_event_get_handle(void *ctx, int device, cca_event_t event,
                                       cca_ipc_handle_t *handle);
cca_status_t cuda_ipc_event_open(void *ctx, int device, const cca_ipc_handle_t *handle,
                                 cca_event_t *event);
cca_status_t cuda_can_access_peer(void *ctx, int device, int peer, int *can_access);
cca_status_t cuda_enable_peer_access(void *ctx, int device, int peer);
cca_status_t cuda_memcpy_peer_async(void *ctx, void *dst, int dst_device, const void *src,
                                    int src_device, size_t size, cca_stream_t stream);
cca_status_t cuda_stream_create(void *ctx, int device, cca_stream_t *stream);
cca_status_t cuda_stream_destroy(void *ctx, int device, cca_stream_t stream);
cca_status_t cuda_stream_wait_event(void *ctx, int device, cca_stream_t stream,
                                    cca_event_t event);
cca_status_t cuda_malloc_async(void *ctx, int device, size_t size, cca_stream_t stream,
                               void **ptr);
cca_status_t cuda_free_async(void *ctx, int device, void *ptr, cca_stream_t stream);
cca_status_t cuda_mempool_trim(void *ctx, int device, size_t keep_bytes);
cca_status_t cuda_mempool_get_attr(void *ctx, int device, cca_mempool_attr_t attr,
                                   uint64_t *value);
cca_status_t cuda_mempool_set_attr(void *ctx, int device, cca_mempool_attr_t attr,
                                   uint64_t value);
cca_status_t cuda_mempool_set_access(void *ctx, int device, int peer);

/* ---- cuda_vmm.c: the driver's virtual memory (expandable segments) ------------- */

cca_status_t cuda_vmm_granularity(void *ctx, int device, size_t *granularity);
cca_status_t cuda_vmm_reserve(void *ctx, int device, size_t size, void **addr);
cca_status_t cuda_vmm_free(void *ctx, int device, void *addr, size_t size);
cca_status_t cuda_vmm_create(void *ctx, int device, size_t size, cca_phys_handle_t *handle);
cca_status_t cuda_vmm_release(void *ctx, int device, cca_phys_handle_t handle);
cca_status_t cuda_vmm_map(void *ctx, int device, void *addr, size_t size,
                          cca_phys_handle_t handle);
cca_status_t cuda_vmm_unmap(void *ctx, int device, void *addr, size_t size);
cca_status_t cuda_vmm_set_access(void *ctx, int device, void *addr, size_t size);
cca_status_t cuda_vmm_export(void *ctx, int device, cca_phys_handle_t handle, int *fd);
cca_status_t cuda_vmm_import(void *ctx, int device, int fd, cca_phys_handle_t *handle);

/* ---- cuda_host.c: pinned host memory --------------------------------------------- */

cca_status_t cuda_host_alloc(void *ctx, size_t size, void **ptr);
cca_status_t cuda_host_free(void *ctx, void *ptr);
cca_status_t cuda_host_register(void *ctx, void *ptr, size_t size, void **device_ptr);
cca_status_t cuda_host_unregister(void *ctx, void *ptr);

#endif /* CCA_CUDA_INTERNAL_H */
