/*
 * cuda_runtime.c - the CUDA backend's operations on the runtime API: raw device
 * memory, synchronisation and events, graph capture queries, IPC, peer access
 * and copies, streams, and the stream-ordered pool (cudaMallocAsync). Each
 * runs with the device made current and restored (cuda.c).
 */
#include "cuda_internal.h"

/* ---- raw device memory ---------------------------------------------------------- */

/*
 * cudaMalloc and cudaFree are not allowed while a stream of this thread is
 * being captured in global mode; relaxed mode allows them. The previous mode
 * is restored after the call, so this costs two cheap calls outside capture.
 */
cca_status_t cuda_malloc(void *ctx, int device, size_t size, void **ptr)
{
    (void)ctx;
    int previous = device;
    cca_status_t st = cuda_enter_device(device, &previous);
    if (st != CCA_OK)
        return st;
    enum cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
    cudaError_t err = cudaThreadExchangeStreamCaptureMode(&mode);
    if (err != cudaSuccess) {
        st = cuda_fail(err, "cudaThreadExchangeStreamCaptureMode");
        goto out_device;
    }
    void *p = NULL;
    err = cudaMalloc(&p, size);
    cudaError_t restore = cudaThreadExchangeStreamCaptureMode(&mode);
    if (err != cudaSuccess) {
        st = cuda_fail(err, "cudaMalloc");
        goto out_device;
    }
    if (restore != cudaSuccess) {
        st = cuda_fail(restore, "cudaThreadExchangeStreamCaptureMode");
        (void)cudaFree(p);
        goto out_device;
    }
    *ptr = p;
out_device:
    cuda_leave_device(device, previous);
    return st;
}

cca_status_t cuda_free(void *ctx, int device, void *ptr)
{
    (void)ctx;
    int previous = device;
    cca_status_t st = cuda_enter_device(device, &previous);
    if (st != CCA_OK)
        return st;
    enum cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
    cudaError_t err = cudaThreadExchangeStreamCaptureMode(&mode);
    if (err != cudaSuccess) {
        st = cuda_fail(err, "cudaThreadExchangeStreamCaptureMode");
        goto out_device;
    }
    err = cudaFree(ptr);
    cudaError_t restore = cudaThreadExchangeStreamCaptureMode(&mode);
    if (err != cudaSuccess)
        st = cuda_fail(err, "cudaFree");
    else if (restore != cudaSuccess)
        st = cuda_fail(restore, "cudaThreadExchangeStreamCaptureMode");
out_device:
    cuda_leave_device(device, previous);
    return st;
}

/* ---- synchronization and events ---------------------------------------------------- */

cca_status_t cuda_stream_synchronize(void *ctx, int device, cca_stream_t stream)
{
    (void)ctx;
    int previous = device;
    cca_status_t st = cuda_enter_device(device, &previous);
    if (st != CCA_OK)
        return st;
    cudaError_t err = cudaStreamSynchronize((cudaStream_t)stream);
    cuda_leave_device(device, previous);
    return err == cudaSuccess ? CCA_OK : cuda_fail(err, "cudaStreamSynchronize");
}

cca_status_t cuda_device_synchronize(void *ctx, int device)
{
    (void)ctx;
    int previous = device;
    cca_status_t st = cuda_enter_device(device, &previous);
    if (st != CCA_OK)
        return st;
    cudaError_t err = cudaDeviceSynchronize();
    cuda_leave_device(device, previous);
    return err == cudaSuccess ? CCA_OK : cuda_fail(err, "cudaDeviceSynchronize");
}

cca_status_t cuda_event_create(void *ctx, int device, cca_event_t *event)
{
    (void)ctx;
    int previous = device;
    cca_status_t st = cuda_enter_device(device, &previous);
    if (st != CCA_OK)
        return st;
    cudaEvent_t ev = NULL;
    cudaError_t err = cudaEventCreateWithFlags(&ev, cudaEventDisableTiming);
    cuda_leave_device(device, previous);
    if (err != cudaSuccess)
        return cuda_fail(err, "cudaEventCreateWithFlags");
    *event = (cca_event_t)ev;
    return CCA_OK;
}

/* Events need no device switch to be destroyed, queried or waited for. */
cca_status_t cuda_event_destroy(void *ctx, int device, cca_event_t event)
{
    (void)ctx;
    (void)device;
    cudaError_t err = cudaEventDestroy((cudaEvent_t)event);
    return err == cudaSuccess ? CCA_OK : cuda_fail(err, "cudaEventDestroy");
}

cca_status_t cuda_event_record(void *ctx, int device, cca_event_t event,
                               cca_stream_t stream)
{
    (void)ctx;
    int previous = device;
    cca_status_t st = cuda_enter_device(device, &previous);
    if (st != CCA_OK)
        return st;
    cudaError_t err = cudaEventRecord((cudaEvent_t)event, (cudaStream_t)stream);
    cuda_leave_device(device, previous);
    return err == cudaSuccess ? CCA_OK : cuda_fail(err, "cudaEventRecord");
}

/* CCA_OK when complete; CCA_ERR_NOT_READY (CUDA's error state cleared) when not. */
cca_status_t cuda_event_query(void *ctx, int device, cca_event_t event)
{
    (void)ctx;
    (void)device;
    cudaError_t err = cudaEventQuery((cudaEvent_t)event);
    if (err == cudaSuccess)
        return CCA_OK;
    if (err == cudaErrorNotReady) {
        (void)cudaGetLastError();
        return CCA_ERR_NOT_READY;
    }
    return cuda_fail(err, "cudaEventQuery");
}

cca_status_t cuda_event_synchronize(void *ctx, int device, cca_event_t event)
{
    (void)ctx;
    (void)device;
    cudaError_t err = cudaEventSynchronize((cudaEvent_t)event);
    return err == cudaSuccess ? CCA_OK : cuda_fail(err, "cudaEventSynchronize");
}

cca_status_t cuda_stream_capture_status(void *ctx, int device, cca_stream_t stream,
                                        int *status)
{
    (void)ctx;
    (void)device;
    enum cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    cudaError_t err = cudaStreamIsCapturing((cudaStream_t)stream, &capture);
    if (err != cudaSuccess)
        return cuda_fail(err, "cudaStreamIsCapturing");
    switch (capture) {
    case cudaStreamCaptureStatusActive: *status = CCA_CAPTURE_ACTIVE; break;
    case cudaStreamCaptureStatusInvalidated: *status = CCA_CAPTURE_INVALIDATED; break;
    default: *status = CCA_CAPTURE_NONE; break;
    }
    return CCA_OK;
}

/* The capture's id and the stream's terminal nodes (cudaStreamGetCaptureInfo). */
cca_status_t cuda_stream_capture_info(void *ctx, int device, cca_stream_t stream, int *status,
                                      uint64_t *capture_id, const cca_graph_node_t **terminals,
                                      size_t *count)
{
    (void)ctx;
    (void)device;
    enum cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    unsigned long long id = 0;
    cudaGraph_t graph = NULL;
    const cudaGraphNode_t *nodes = NULL;
    size_t n = 0;
#if CUDART_VERSION >= 13000
    cudaError_t err = cudaStreamGetCaptureInfo((cudaStream_t)stream, &capture, &id, &graph, &nodes,
                                               NULL, &n);
#else
    cudaError_t err = cudaStreamGetCaptureInfo_v2((cudaStream_t)stream, &capture, &id, &graph, &nodes,
                                                  &n);
#endif
    if (err != cudaSuccess)
        return cuda_fail(err, "cudaStreamGetCaptureInfo");
    switch (capture) {
    case cudaStreamCaptureStatusActive: *status = CCA_CAPTURE_ACTIVE; break;
    case cudaStreamCaptureStatusInvalidated: *status = CCA_CAPTURE_INVALIDATED; break;
    default: *status = CCA_CAPTURE_NONE; break;
    }
    bool active = capture == cudaStreamCaptureStatusActive;
    *capture_id = active ? (uint64_t)id : 0;
    *terminals = active ? (const cca_graph_node_t *)nodes : NULL;
    *count = active ? n : 0;
    return CCA_OK;
}

/* A captured node's dependencies (cudaGraphNodeGetDependencies). */
cca_status_t cuda_graph_node_dependencies(void *ctx, int device, cca_graph_node_t node,
                                          cca_graph_node_t *deps, size_t *count)
{
    (void)ctx;
    (void)device;
    cudaError_t err;
#if CUDART_VERSION >= 13000
    if (!deps) {
        err = cudaGraphNodeGetDependencies((cudaGraphNode_t)node, NULL, NULL, count);
    } else {
        /* with edge data, so edges with non-default data are not a lossy query */
        cudaGraphEdgeData *edges = calloc(*count ? *count : 1, sizeof(*edges));
        if (!edges)
            return cca_raise(CCA_ERR_OUT_OF_MEMORY, "out of host memory reading graph edges");
        err = cudaGraphNodeGetDependencies((cudaGraphNode_t)node, (cudaGraphNode_t *)deps, edges, count);
        free(edges);
    }
#else
    err = cudaGraphNodeGetDependencies((cudaGraphNode_t)node, (cudaGraphNode_t *)deps, count);
#endif
    if (err != cudaSuccess)
        return cuda_fail(err, "cudaGraphNodeGetDependencies");
    return CCA_OK;
}


/* ---- IPC ----------------------------------------------------------------------------------- */

cca_status_t cuda_ipc_get_handle(void *ctx, int device, void *ptr, cca_ipc_handle_t *handle)
{
    (void)ctx;
    _Static_assert(sizeof(cudaIpcMemHandle_t) == sizeof(cca_ipc_handle_t),
                   "cca_ipc_handle_t must hold a cudaIpcMemHandle_t");
    int previous = device;
    cca_status_t st = cuda_enter_device(device, &previous);
    if (st != CCA_OK)
        return st;
    cudaIpcMemHandle_t h;
    cudaError_t err = cudaIpcGetMemHandle(&h, ptr);
    cuda_leave_device(device, previous);
    if (err != cudaSuccess)
        return cuda_fail(err, "cudaIpcGetMemHandle");
    memcpy(handle->bytes, &h, sizeof(h));
    return CCA_OK;
}

cca_status_t cuda_ipc_open(void *ctx, int device, const cca_ipc_handle_t *handle,
                           void **ptr)
{
    (void)ctx;
    int previous = device;
    cca_status_t st = cuda_enter_device(device, &previous);
    if (st != CCA_OK)
        return st;
    cudaIpcMemHandle_t h;
    memcpy(&h, handle->bytes, sizeof(h));
    void *p = NULL;
    cudaError_t err = cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess);
    cuda_leave_device(device, previous);
    if (err != cudaSuccess)
        return cuda_fail(err, "cudaIpcOpenMemHandle");
    *ptr = p;
    return CCA_OK;
}

cca_status_t cuda_ipc_close(void *ctx, int device, void *ptr)
{
    (void)ctx;
    int previous = device;
    cca_status_t st = cuda_enter_device(device, &previous);
    if (st != CCA_OK)
        return st;
    cudaError_t err = cudaIpcCloseMemHandle(ptr);
    cuda_leave_device(device, previous);
    return err == cudaSuccess ? CCA_OK : cuda_fail(err, "cudaIpcCloseMemHandle");
}

cca_status_t cuda_ipc_event_create(void *ctx, int device, cca_event_t *event)
{
    (void)ctx;
    int previous = device;
    cca_status_t st = cuda_enter_device(device, &previous);
    if (st != CCA_OK)
        return st;
    cudaEvent_t e = NULL;
    cudaError_t err =
        cudaEventCreateWithFlags(&e, cudaEventDisableTiming | cudaEventInterprocess);
    cuda_leave_device(device, previous);
    if (err != cudaSuccess)
        return cuda_fail(err, "cudaEventCreateWithFlags(cudaEventInterprocess)");
    *event = e;
    return CCA_OK;
}

cca_status_t cuda_ipc_event_get_handle(void *ctx, int device, cca_event_t event,
                                       cca_ipc_handle_t *handle)
{
    (void)ctx;
    _Static_assert(sizeof(cudaIpcEventHandle_t) == sizeof(cca_ipc_handle_t),
                   "cca_ipc_handle_t must hold a cudaIpcEventHandle_t");
    int previous = device;
    cca_status_t st = cuda_enter_device(device, &previous);
    if (st != CCA_OK)
        return st;
    cudaIpcEventHandle_t h;
    cudaError_t err = cudaIpcGetEventHandle(&h, (cudaEvent_t)event);
    cuda_leave_device(device, previous);
    if (err != cudaSuccess)
        return cuda_fail(err, "cudaIpcGetEventHandle");
    memcpy(handle->bytes, &h, sizeof(h));
    return CCA_OK;
}

cca_status_t cuda_ipc_event_open(void *ctx, int device, const cca_ipc_handle_t *handle,
                                 cca_event_t *event)
{
    (void)ctx;
    int previous = device;
    cca_status_t st = cuda_enter_device(device, &previous);
    if (st != CCA_OK)
        return st;
    cudaIpcEventHandle_t h;
    memcpy(&h, handle->bytes, sizeof(h));
    cudaEvent_t e = NULL;
    cudaError_t err = cudaIpcOpenEventHandle(&e, h);
    cuda_leave_device(device, previous);
    if (err != cudaSuccess)
        return cuda_fail(err, "cudaIpcOpenEventHandle");
    *event = e;
    return CCA_OK;
}

/* ---- peer access and copies ----------------------------------------------------------------- */

cca_status_t cuda_can_access_peer(void *ctx, int device, int peer, int *can_access)
{
    (void)ctx;
    int can = 0;
    cudaError_t err = cudaDeviceCanAccessPeer(&can, device, peer);
    if (err != cudaSuccess)
        return cuda_fail(err, "cudaDeviceCanAccessPeer");
    *can_access = can;
    return CCA_OK;
}

/* cudaDeviceEnablePeerAccess from device; "already enabled" is success, as in PyTorch. */
cca_status_t cuda_enable_peer_access(void *ctx, int device, int peer)
{
    (void)ctx;
    int previous = device;
    cca_status_t st = cuda_enter_device(device, &previous);
    if (st != CCA_OK)
        return st;
    cudaError_t err = cudaDeviceEnablePeerAccess(peer, 0);
    cuda_leave_device(device, previous);
    if (err == cudaErrorPeerAccessAlreadyEnabled) {
        (void)cudaGetLastError();
        return CCA_OK;
    }
    if (err == cudaErrorPeerAccessUnsupported) {
        (void)cudaGetLastError();
        return cca_backend_error(CCA_ERR_NOT_SUPPORTED, (long)err,
                                 "device %d cannot access device %d's memory "
                                 "(cudaDeviceEnablePeerAccess: %s)",
                                 device, peer, cudaGetErrorString(err));
    }
    return err == cudaSuccess ? CCA_OK : cuda_fail(err, "cudaDeviceEnablePeerAccess");
}

cca_status_t cuda_memcpy_peer_async(void *ctx, void *dst, int dst_device, const void *src,
                                    int src_device, size_t size, cca_stream_t stream)
{
    (void)ctx;
    cudaError_t err = cudaMemcpyPeerAsync(dst, dst_device, src, src_device, size,
                                          (cudaStream_t)stream);
    return err == cudaSuccess ? CCA_OK : cuda_fail(err, "cudaMemcpyPeerAsync");
}

/* ---- streams ------------------------------------------------------------------------------- */

cca_status_t cuda_stream_create(void *ctx, int device, cca_stream_t *stream)
{
    (void)ctx;
    int previous = device;
    cca_status_t st = cuda_enter_device(device, &previous);
    if (st != CCA_OK)
        return st;
    cudaStream_t s = NULL;
    cudaError_t err = cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
    cuda_leave_device(device, previous);
    if (err != cudaSuccess)
        return cuda_fail(err, "cudaStreamCreateWithFlags");
    *stream = (cca_stream_t)s;
    return CCA_OK;
}

cca_status_t cuda_stream_destroy(void *ctx, int device, cca_stream_t stream)
{
    (void)ctx;
    int previous = device;
    cca_status_t st = cuda_enter_device(device, &previous);
    if (st != CCA_OK)
        return st;
    cudaError_t err = cudaStreamDestroy((cudaStream_t)stream);
    cuda_leave_device(device, previous);
    return err == cudaSuccess ? CCA_OK : cuda_fail(err, "cudaStreamDestroy");
}

cca_status_t cuda_stream_wait_event(void *ctx, int device, cca_stream_t stream,
                                    cca_event_t event)
{
    (void)ctx;
    int previous = device;
    cca_status_t st = cuda_enter_device(device, &previous);
    if (st != CCA_OK)
        return st;
    cudaError_t err = cudaStreamWaitEvent((cudaStream_t)stream, (cudaEvent_t)event, 0);
    cuda_leave_device(device, previous);
    return err == cudaSuccess ? CCA_OK : cuda_fail(err, "cudaStreamWaitEvent");
}

/* ---- stream-ordered memory pool (cudaMallocAsync) -------------------------------------------- */

/*
 * The default stream infers its device from the current context, so both
 * calls run with device current, as PyTorch's CUDAGuard does.
 */
cca_status_t cuda_malloc_async(void *ctx, int device, size_t size, cca_stream_t stream,
                               void **ptr)
{
    (void)ctx;
    int previous = device;
    cca_status_t st = cuda_enter_device(device, &previous);
    if (st != CCA_OK)
        return st;
    void *p = NULL;
    cudaError_t err = cudaMallocAsync(&p, size, (cudaStream_t)stream);
    cuda_leave_device(device, previous);
    if (err != cudaSuccess)
        return cuda_fail(err, "cudaMallocAsync");
    *ptr = p;
    return CCA_OK;
}

cca_status_t cuda_free_async(void *ctx, int device, void *ptr, cca_stream_t stream)
{
    (void)ctx;
    int previous = device;
    cca_status_t st = cuda_enter_device(device, &previous);
    if (st != CCA_OK)
        return st;
    cudaError_t err = cudaFreeAsync(ptr, (cudaStream_t)stream);
    cuda_leave_device(device, previous);
    return err == cudaSuccess ? CCA_OK : cuda_fail(err, "cudaFreeAsync");
}

static cca_status_t default_pool(int device, cudaMemPool_t *pool)
{
    cudaError_t err = cudaDeviceGetDefaultMemPool(pool, device);
    return err == cudaSuccess ? CCA_OK : cuda_fail(err, "cudaDeviceGetDefaultMemPool");
}

cca_status_t cuda_mempool_trim(void *ctx, int device, size_t keep_bytes)
{
    (void)ctx;
    cudaMemPool_t pool;
    cca_status_t st = default_pool(device, &pool);
    if (st != CCA_OK)
        return st;
    cudaError_t err = cudaMemPoolTrimTo(pool, keep_bytes);
    return err == cudaSuccess ? CCA_OK : cuda_fail(err, "cudaMemPoolTrimTo");
}

/* The runtime's attribute and whether it holds a uint64_t (else an int). */
static bool pool_attr(cca_mempool_attr_t attr, enum cudaMemPoolAttr *out, bool *is_u64)
{
    static const struct {
        enum cudaMemPoolAttr attr;
        bool is_u64;
    } map[CCA_MEMPOOL_ATTR_COUNT] = {
        [CCA_MEMPOOL_RELEASE_THRESHOLD] = {cudaMemPoolAttrReleaseThreshold, true},
        [CCA_MEMPOOL_REUSE_FOLLOW_EVENT_DEPENDENCIES] = {cudaMemPoolReuseFollowEventDependencies, false},
        [CCA_MEMPOOL_REUSE_ALLOW_OPPORTUNISTIC] = {cudaMemPoolReuseAllowOpportunistic, false},
        [CCA_MEMPOOL_REUSE_ALLOW_INTERNAL_DEPENDENCIES] = {cudaMemPoolReuseAllowInternalDependencies, false},
        [CCA_MEMPOOL_RESERVED_CURRENT] = {cudaMemPoolAttrReservedMemCurrent, true},
        [CCA_MEMPOOL_RESERVED_HIGH] = {cudaMemPoolAttrReservedMemHigh, true},
        [CCA_MEMPOOL_USED_CURRENT] = {cudaMemPoolAttrUsedMemCurrent, true},
        [CCA_MEMPOOL_USED_HIGH] = {cudaMemPoolAttrUsedMemHigh, true},
    };
    if ((int)attr < 0 || attr >= CCA_MEMPOOL_ATTR_COUNT)
        return false;
    *out = map[attr].attr;
    *is_u64 = map[attr].is_u64;
    return true;
}

cca_status_t cuda_mempool_get_attr(void *ctx, int device, cca_mempool_attr_t attr,
                                   uint64_t *value)
{
    (void)ctx;
    enum cudaMemPoolAttr a;
    bool is_u64;
    if (!pool_attr(attr, &a, &is_u64))
        return cca_backend_error(CCA_ERR_INVALID_ARGUMENT, 0, "unknown memory pool attribute %d",
                                 (int)attr);
    cudaMemPool_t pool;
    cca_status_t st = default_pool(device, &pool);
    if (st != CCA_OK)
        return st;
    uint64_t v64 = 0;
    int v32 = 0;
    cudaError_t err = cudaMemPoolGetAttribute(pool, a, is_u64 ? (void *)&v64 : (void *)&v32);
    if (err != cudaSuccess)
        return cuda_fail(err, "cudaMemPoolGetAttribute");
    *value = is_u64 ? v64 : (uint64_t)v32;
    return CCA_OK;
}

cca_status_t cuda_mempool_set_attr(void *ctx, int device, cca_mempool_attr_t attr,
                                   uint64_t value)
{
    (void)ctx;
    enum cudaMemPoolAttr a;
    bool is_u64;
    if (!pool_attr(attr, &a, &is_u64))
        return cca_backend_error(CCA_ERR_INVALID_ARGUMENT, 0, "unknown memory pool attribute %d",
                                 (int)attr);
    cudaMemPool_t pool;
    cca_status_t st = default_pool(device, &pool);
    if (st != CCA_OK)
        return st;
    uint64_t v64 = value;
    int v32 = (int)value;
    cudaError_t err = cudaMemPoolSetAttribute(pool, a, is_u64 ? (void *)&v64 : (void *)&v32);
    return err == cudaSuccess ? CCA_OK : cuda_fail(err, "cudaMemPoolSetAttribute");
}

/* cudaMallocAsync pools ignore cudaDeviceEnablePeerAccess: access is per pool. */
cca_status_t cuda_mempool_set_access(void *ctx, int device, int peer)
{
    (void)ctx;
    cudaMemPool_t pool;
    cca_status_t st = default_pool(device, &pool);
    if (st != CCA_OK)
        return st;
    struct cudaMemAccessDesc desc;
    memset(&desc, 0, sizeof(desc));
    desc.location.type = cudaMemLocationTypeDevice;
    desc.location.id = peer;
    desc.flags = cudaMemAccessFlagsProtReadWrite;
    cudaError_t err = cudaMemPoolSetAccess(pool, &desc, 1);
    return err == cudaSuccess ? CCA_OK : cuda_fail(err, "cudaMemPoolSetAccess");
}
