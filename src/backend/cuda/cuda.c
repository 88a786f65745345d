/*
 * cuda.c - the CUDA backend: cca's backend contract (cca_backend.h) on the
 * CUDA runtime API, with the virtual-memory driver functions reached through
 * cudaGetDriverEntryPointByVersion so that nothing links libcuda directly.
 * This file: errors, device switching, the device queries and creation (the
 * operation table); cuda_runtime.c, cuda_vmm.c and cuda_host.c the rest.
 *
 * Invariant: the backend's state is immutable after cca_cuda_create (device
 * count, driver entry points), so every operation is thread-safe without a
 * lock. Per-device operations run with the calling thread switched to the
 * device and switch back afterwards, calling cudaSetDevice only when the
 * device differs. Only src/backend/cuda/ includes CUDA headers.
 */
#include "cuda_internal.h"

/*
 * Devices (bit per ordinal, up to 64) whose primary context this thread has
 * made current through cudaSetDevice. Driver entry points need a current
 * context, which cudaGetDevice alone does not guarantee.
 */
static _Thread_local uint64_t thread_bound_devices;

/* ---- errors ------------------------------------------------------------------ */

/*
 * True for the errors that leave the CUDA context unusable: every later call
 * in this process fails with them, so they are reported, never cleared away.
 */
static bool is_sticky(cudaError_t err)
{
    switch (err) {
    case cudaErrorIllegalAddress:
    case cudaErrorLaunchFailure:
    case cudaErrorHardwareStackError:
    case cudaErrorIllegalInstruction:
    case cudaErrorMisalignedAddress:
    case cudaErrorInvalidAddressSpace:
    case cudaErrorInvalidPc:
    case cudaErrorAssert:
    case cudaErrorECCUncorrectable:
    case cudaErrorLaunchTimeout:
    case cudaErrorContextIsDestroyed:
    case cudaErrorCudartUnloading:
        return true;
    default:
        return false;
    }
}

/*
 * Turn a failed runtime call into a cca status: cudaErrorMemoryAllocation is
 * CCA_ERR_OUT_OF_MEMORY, anything else CCA_ERR_BACKEND with the raw code and
 * CUDA's text. The thread's CUDA error state is cleared unless the error is
 * sticky (which cannot be cleared), so later calls do not see a stale error.
 */
cca_status_t cuda_fail(cudaError_t err, const char *call)
{
    if (!is_sticky(err))
        (void)cudaGetLastError();
    if (err == cudaErrorMemoryAllocation)
        return cca_backend_error(CCA_ERR_OUT_OF_MEMORY, (long)err, "CUDA out of memory (%s: %s)",
                                 call, cudaGetErrorString(err));
    if (is_sticky(err))
        return cca_backend_error(CCA_ERR_BACKEND, (long)err,
                                 "%s failed: %s (CUDA error %d); the CUDA context is broken and "
                                 "every later CUDA call in this process will fail",
                                 call, cudaGetErrorString(err), (int)err);
    return cca_backend_error(CCA_ERR_BACKEND, (long)err, "%s failed: %s (CUDA error %d)", call,
                             cudaGetErrorString(err), (int)err);
}

/* As cuda_fail for a driver call: CUDA_ERROR_OUT_OF_MEMORY is CCA_ERR_OUT_OF_MEMORY. */
cca_status_t cuda_driver_fail(const cuda_ctx_t *cx, CUresult res, const char *call)
{
    const char *text = NULL;
    if (!cx->driver.get_error_string || cx->driver.get_error_string(res, &text) != CUDA_SUCCESS ||
        !text)
        text = "unknown driver error";
    if (res == CUDA_ERROR_OUT_OF_MEMORY)
        return cca_backend_error(CCA_ERR_OUT_OF_MEMORY, (long)res, "CUDA out of memory (%s: %s)",
                                 call, text);
    return cca_backend_error(CCA_ERR_BACKEND, (long)res, "%s failed: %s (CUDA driver error %d)",
                             call, text, (int)res);
}

/* ---- device switching --------------------------------------------------------- */

/*
 * Make device current on the calling thread; *previous gets the device to
 * restore with cuda_leave_device. Returns CCA_OK or CCA_ERR_BACKEND.
 */
cca_status_t cuda_enter_device(int device, int *previous)
{
    int current = 0;
    cudaError_t err = cudaGetDevice(&current);
    if (err != cudaSuccess)
        return cuda_fail(err, "cudaGetDevice");
    uint64_t bit = device < 64 ? (uint64_t)1 << device : 0;
    if (current != device || !(thread_bound_devices & bit)) {
        err = cudaSetDevice(device);
        if (err != cudaSuccess)
            return cuda_fail(err, "cudaSetDevice");
        thread_bound_devices |= bit;
    }
    *previous = current;
    return CCA_OK;
}

/* Restore the device saved by cuda_enter_device (errors here cannot be acted upon). */
void cuda_leave_device(int device, int previous)
{
    if (previous != device && cudaSetDevice(previous) != cudaSuccess)
        (void)cudaGetLastError();
}

/* ---- devices ------------------------------------------------------------------ */

static cca_status_t cuda_device_count(void *ctx, int *count)
{
    *count = ((cuda_ctx_t *)ctx)->device_count;
    return CCA_OK;
}

static cca_status_t cuda_device_props(void *ctx, int device, cca_device_props_t *props)
{
    (void)ctx;
    struct cudaDeviceProp prop;
    cudaError_t err = cudaGetDeviceProperties(&prop, device);
    if (err != cudaSuccess)
        return cuda_fail(err, "cudaGetDeviceProperties");
    memset(props, 0, sizeof(*props));
    size_t n = strnlen(prop.name, sizeof(prop.name));
    if (n >= sizeof(props->name))
        n = sizeof(props->name) - 1;
    memcpy(props->name, prop.name, n);
    props->total_memory = prop.totalGlobalMem;
    return CCA_OK;
}

/*
 * The calling thread's current device as cudaGetDevice last gave it, with the
 * context current then. Every way of changing the device (cudaSetDevice, ours
 * or the program's; cuCtxSetCurrent, cuCtxPushCurrent / PopCurrent) changes
 * the current context, and the device of a context never changes, so one
 * cuCtxGetCurrent (a thread-local read in the driver) tells whether the
 * cached device still holds. A thread with no current context (one that
 * never chose a device) asks cudaGetDevice every time (device 0, as
 * PyTorch's). Limit: a context destroyed and another created for a
 * different device at the same handle, made current on this thread without
 * cudaSetDevice, would be taken for the old one.
 */
static CCA_THREAD_HOT struct {
    CUcontext ctx;
    int device;
} current_device_cache;

static cca_status_t cuda_get_device(void *ctx, int *device)
{
    cuda_ctx_t *cx = ctx;
    CUcontext current_ctx = NULL;
    if (cx->driver.ctx_get_current && cx->driver.ctx_get_current(&current_ctx) == CUDA_SUCCESS &&
        current_ctx && current_ctx == current_device_cache.ctx) {
        *device = current_device_cache.device;
        return CCA_OK;
    }
    int current = 0;
    cudaError_t err = cudaGetDevice(&current);
    if (err != cudaSuccess)
        return cuda_fail(err, "cudaGetDevice");
    current_device_cache.ctx = current_ctx; /* NULL: no context, never a hit */
    current_device_cache.device = current;
    *device = current;
    return CCA_OK;
}

static cca_status_t cuda_set_device(void *ctx, int device)
{
    (void)ctx;
    cudaError_t err = cudaSetDevice(device);
    if (err != cudaSuccess)
        return cuda_fail(err, "cudaSetDevice");
    if (device < 64)
        thread_bound_devices |= (uint64_t)1 << device;
    return CCA_OK;
}

static cca_status_t cuda_mem_get_info(void *ctx, int device, size_t *free_bytes,
                                      size_t *total_bytes)
{
    (void)ctx;
    int previous = device;
    cca_status_t st = cuda_enter_device(device, &previous);
    if (st != CCA_OK)
        return st;
    size_t free_now = 0, total = 0;
    cudaError_t err = cudaMemGetInfo(&free_now, &total);
    cuda_leave_device(device, previous);
    if (err != cudaSuccess)
        return cuda_fail(err, "cudaMemGetInfo");
    *free_bytes = free_now;
    *total_bytes = total;
    return CCA_OK;
}


/* ---- creation ---------------------------------------------------------------------------------- */

static void cuda_destroy(void *ctx)
{
    /* CUDA resources belong to the core, which gives them back before this;
     * the operation table is part of ctx. */
    cuda_ctx_t *cx = ctx;
    for (size_t i = 0; i < cx->export_count; i++)
        close(cx->exports[i].fd);
    free(cx->exports);
    pthread_mutex_destroy(&cx->export_lock);
    free(ctx);
}

/* Look up one driver entry point by name; NULL when the driver lacks it. */
static void *driver_symbol(const char *name)
{
    void *fn = NULL;
    enum cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
#if CUDART_VERSION >= 12050
    /* The unversioned lookup is deprecated from CUDA 13: ask for the 12.0 ABI. */
    cudaError_t err = cudaGetDriverEntryPointByVersion(name, &fn, 12000, cudaEnableDefault, &found);
#else
    cudaError_t err = cudaGetDriverEntryPoint(name, &fn, cudaEnableDefault, &found);
#endif
    if (err != cudaSuccess || found != cudaDriverEntryPointSuccess) {
        (void)cudaGetLastError();
        return NULL;
    }
    return fn;
}

static void load_driver(cuda_driver_t *d)
{
    d->get_error_string = (PFN_cuGetErrorString_v6000)driver_symbol("cuGetErrorString");
    d->mem_get_allocation_granularity =
        (PFN_cuMemGetAllocationGranularity_v10020)driver_symbol("cuMemGetAllocationGranularity");
    d->mem_address_reserve = (PFN_cuMemAddressReserve_v10020)driver_symbol("cuMemAddressReserve");
    d->mem_address_free = (PFN_cuMemAddressFree_v10020)driver_symbol("cuMemAddressFree");
    d->mem_create = (PFN_cuMemCreate_v10020)driver_symbol("cuMemCreate");
    d->mem_release = (PFN_cuMemRelease_v10020)driver_symbol("cuMemRelease");
    d->mem_map = (PFN_cuMemMap_v10020)driver_symbol("cuMemMap");
    d->mem_unmap = (PFN_cuMemUnmap_v10020)driver_symbol("cuMemUnmap");
    d->mem_set_access = (PFN_cuMemSetAccess_v10020)driver_symbol("cuMemSetAccess");
    d->mem_export =
        (PFN_cuMemExportToShareableHandle_v10020)driver_symbol("cuMemExportToShareableHandle");
    d->mem_import =
        (PFN_cuMemImportFromShareableHandle_v10020)driver_symbol("cuMemImportFromShareableHandle");
    d->device_get_attribute = (PFN_cuDeviceGetAttribute_v2000)driver_symbol("cuDeviceGetAttribute");
    d->ctx_get_current = (PFN_cuCtxGetCurrent_v4000)driver_symbol("cuCtxGetCurrent");
    d->vmm = d->mem_get_allocation_granularity && d->mem_address_reserve && d->mem_address_free &&
             d->mem_create && d->mem_release && d->mem_map && d->mem_unmap && d->mem_set_access;
}

/*
 * Create the CUDA backend. Returns CCA_OK, CCA_ERR_INVALID_ARGUMENT (backend
 * NULL), CCA_ERR_NO_DEVICE (no GPU, no driver, or a driver too old for this
 * runtime; the message names CCA_BACKEND=sim), CCA_ERR_OUT_OF_MEMORY (host).
 * The table is freed by its own destroy operation, never with free().
 * Thread-safe.
 */
cca_status_t cca_cuda_create(cca_backend_t **backend)
{
    if (!backend)
        return cca_raise(CCA_ERR_INVALID_ARGUMENT, "cca_cuda_create: backend is NULL");
    int count = 0;
    cudaError_t err = cudaGetDeviceCount(&count);
    if (err != cudaSuccess || count <= 0) {
        if (err != cudaSuccess)
            (void)cudaGetLastError();
        const char *why = err != cudaSuccess ? cudaGetErrorString(err) : "no device is visible";
        return cca_backend_error(CCA_ERR_NO_DEVICE, (long)err,
                                 "no usable CUDA device was found (cudaGetDeviceCount: %s); set "
                                 "CCA_BACKEND=sim to run cca on its simulated device",
                                 why);
    }
    cuda_ctx_t *cx = calloc(1, sizeof(*cx));
    if (!cx)
        return cca_raise(CCA_ERR_OUT_OF_MEMORY, "cca_cuda_create: out of host memory");
    cca_backend_t *b = &cx->backend;
    cx->device_count = count;
    pthread_mutex_init(&cx->export_lock, NULL);
    load_driver(&cx->driver);

    b->name = "cuda";
    b->ctx = cx;
    b->device_count = cuda_device_count;
    b->device_props = cuda_device_props;
    b->get_device = cuda_get_device;
    b->set_device = cuda_set_device;
    b->mem_get_info = cuda_mem_get_info;
    b->malloc = cuda_malloc;
    b->free = cuda_free;
    b->stream_synchronize = cuda_stream_synchronize;
    b->device_synchronize = cuda_device_synchronize;
    b->event_create = cuda_event_create;
    b->event_destroy = cuda_event_destroy;
    b->event_record = cuda_event_record;
    b->event_query = cuda_event_query;
    b->event_synchronize = cuda_event_synchronize;
    b->stream_capture_status = cuda_stream_capture_status;
    b->stream_capture_info = cuda_stream_capture_info;
    b->graph_node_dependencies = cuda_graph_node_dependencies;
    b->vmm_granularity = cuda_vmm_granularity;
    b->vmm_reserve = cuda_vmm_reserve;
    b->vmm_free = cuda_vmm_free;
    b->vmm_create = cuda_vmm_create;
    b->vmm_release = cuda_vmm_release;
    b->vmm_map = cuda_vmm_map;
    b->vmm_unmap = cuda_vmm_unmap;
    b->vmm_set_access = cuda_vmm_set_access;
    b->vmm_export = cuda_vmm_export;
    b->vmm_import = cuda_vmm_import;
    b->host_alloc = cuda_host_alloc;
    b->host_free = cuda_host_free;
    b->host_register = cuda_host_register;
    b->host_unregister = cuda_host_unregister;
    b->ipc_get_handle = cuda_ipc_get_handle;
    b->ipc_open = cuda_ipc_open;
    b->ipc_close = cuda_ipc_close;
    b->ipc_event_create = cuda_ipc_event_create;
    b->ipc_event_get_handle = cuda_ipc_event_get_handle;
    b->ipc_event_open = cuda_ipc_event_open;
    b->can_access_peer = cuda_can_access_peer;
    b->enable_peer_access = cuda_enable_peer_access;
    b->memcpy_peer_async = cuda_memcpy_peer_async;
    b->stream_create = cuda_stream_create;
    b->stream_destroy = cuda_stream_destroy;
    b->stream_wait_event = cuda_stream_wait_event;
    b->malloc_async = cuda_malloc_async;
    b->free_async = cuda_free_async;
    b->mempool_trim = cuda_mempool_trim;
    b->mempool_get_attr = cuda_mempool_get_attr;
    b->mempool_set_attr = cuda_mempool_set_attr;
    b->mempool_set_access = cuda_mempool_set_access;
    b->destroy = cuda_destroy;
    *backend = b;
    return CCA_OK;
}
