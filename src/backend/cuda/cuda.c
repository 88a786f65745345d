/*
 * cuda.c - the CUDA backend: cca's backend contract (cca_backend.h) on the
 * CUDA runtime API, with the virtual-memory driver functions reached through
 * cudaGetDriverEntryPointByVersion so that nothing links libcuda directly.
 *
 * Invariant: the backend's state is immutable after cca_cuda_create (device
 * count, driver entry points), so every operation is thread-safe without a
 * lock. Per-device operations run with the calling thread switched to the
 * device and switch back afterwards, calling cudaSetDevice only when the
 * device differs. This is the only file of cca that includes CUDA headers.
 */
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
static cca_status_t cuda_fail(cudaError_t err, const char *call)
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
static cca_status_t driver_fail(const cuda_ctx_t *cx, CUresult res, const char *call)
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
 * restore with leave_device. Returns CCA_OK or CCA_ERR_BACKEND.
 */
static cca_status_t enter_device(int device, int *previous)
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

/* Restore the device saved by enter_device (errors here cannot be acted upon). */
static void leave_device(int device, int previous)
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
    cca_status_t st = enter_device(device, &previous);
    if (st != CCA_OK)
        return st;
    size_t free_now = 0, total = 0;
    cudaError_t err = cudaMemGetInfo(&free_now, &total);
    leave_device(device, previous);
    if (err != cudaSuccess)
        return cuda_fail(err, "cudaMemGetInfo");
    *free_bytes = free_now;
    *total_bytes = total;
    return CCA_OK;
}

/* ---- raw device memory ---------------------------------------------------------- */

/*
 * cudaMalloc and cudaFree are not allowed while a stream of this thread is
 * being captured in global mode; relaxed mode allows them. The previous mode
 * is restored after the call, so this costs two cheap calls outside capture.
 */
static cca_status_t cuda_malloc(void *ctx, int device, size_t size, void **ptr)
{
    (void)ctx;
    int previous = device;
    cca_status_t st = enter_device(device, &previous);
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
    leave_device(device, previous);
    return st;
}

static cca_status_t cuda_free(void *ctx, int device, void *ptr)
{
    (void)ctx;
    int previous = device;
    cca_status_t st = enter_device(device, &previous);
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
    leave_device(device, previous);
    return st;
}

/* ---- synchronization and events ---------------------------------------------------- */

static cca_status_t cuda_stream_synchronize(void *ctx, int device, cca_stream_t stream)
{
    (void)ctx;
    int previous = device;
    cca_status_t st = enter_device(device, &previous);
    if (st != CCA_OK)
        return st;
    cudaError_t err = cudaStreamSynchronize((cudaStream_t)stream);
    leave_device(device, previous);
    return err == cudaSuccess ? CCA_OK : cuda_fail(err, "cudaStreamSynchronize");
}

static cca_status_t cuda_device_synchronize(void *ctx, int device)
{
    (void)ctx;
    int previous = device;
    cca_status_t st = enter_device(device, &previous);
    if (st != CCA_OK)
        return st;
    cudaError_t err = cudaDeviceSynchronize();
    leave_device(device, previous);
    return err == cudaSuccess ? CCA_OK : cuda_fail(err, "cudaDeviceSynchronize");
}

static cca_status_t cuda_event_create(void *ctx, int device, cca_event_t *event)
{
    (void)ctx;
    int previous = device;
    cca_status_t st = enter_device(device, &previous);
    if (st != CCA_OK)
        return st;
    cudaEvent_t ev = NULL;
    cudaError_t err = cudaEventCreateWithFlags(&ev, cudaEventDisableTiming);
    leave_device(device, previous);
    if (err != cudaSuccess)
        return cuda_fail(err, "cudaEventCreateWithFlags");
    *event = (cca_event_t)ev;
    return CCA_OK;
}

/* Events need no device switch to be destroyed, queried or waited for. */
static cca_status_t cuda_event_destroy(void *ctx, int device, cca_event_t event)
{
    (void)ctx;
    (void)device;
    cudaError_t err = cudaEventDestroy((cudaEvent_t)event);
    return err == cudaSuccess ? CCA_OK : cuda_fail(err, "cudaEventDestroy");
}

static cca_status_t cuda_event_record(void *ctx, int device, cca_event_t event,
                                      cca_stream_t stream)
{
    (void)ctx;
    int previous = device;
    cca_status_t st = enter_device(device, &previous);
    if (st != CCA_OK)
        return st;
    cudaError_t err = cudaEventRecord((cudaEvent_t)event, (cudaStream_t)stream);
    leave_device(device, previous);
    return err == cudaSuccess ? CCA_OK : cuda_fail(err, "cudaEventRecord");
}

/* CCA_OK when complete; CCA_ERR_NOT_READY (CUDA's error state cleared) when not. */
static cca_status_t cuda_event_query(void *ctx, int device, cca_event_t event)
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

static cca_status_t cuda_event_synchronize(void *ctx, int device, cca_event_t event)
{
    (void)ctx;
    (void)device;
    cudaError_t err = cudaEventSynchronize((cudaEvent_t)event);
    return err == cudaSuccess ? CCA_OK : cuda_fail(err, "cudaEventSynchronize");
}

static cca_status_t cuda_stream_capture_status(void *ctx, int device, cca_stream_t stream,
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
static cca_status_t cuda_stream_capture_info(void *ctx, int device, cca_stream_t stream, int *status,
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
static cca_status_t cuda_graph_node_dependencies(void *ctx, int device, cca_graph_node_t node,
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

/* ---- virtual memory ------------------------------------------------------------------ */

static cca_status_t vmm_unsupported(void)
{
    return cca_backend_error(CCA_ERR_NOT_SUPPORTED, 0,
                             "the CUDA driver does not provide the virtual memory functions "
                             "(cuMemCreate, cuMemMap, ...) that expandable segments need");
}

/* True if physical memory of device is to be created shareable (POSIX fd). */
static bool shareable_device(cuda_ctx_t *cx, int device)
{
    if (!cx->driver.mem_export || !cx->driver.mem_import || !cx->driver.device_get_attribute ||
        device < 0 ||
        device >= CUDA_MAX_SHAREABLE_DEVICES)
        return false;
    int known = cx->shareable[device];
    if (known)
        return known > 0;
    int supported = 0;
    if (cx->driver.device_get_attribute(
            &supported, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
            (CUdevice)device) != CUDA_SUCCESS)
        supported = 0;
    cx->shareable[device] = supported ? 1 : -1;
    return supported != 0;
}

/* Physical memory properties: pinned device memory on device. */
static CUmemAllocationProp device_prop(int device)
{
    CUmemAllocationProp prop;
    memset(&prop, 0, sizeof(prop));
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = device;
    return prop;
}

static cca_status_t cuda_vmm_granularity(void *ctx, int device, size_t *granularity)
{
    cuda_ctx_t *cx = ctx;
    if (!cx->driver.vmm)
        return vmm_unsupported();
    CUmemAllocationProp prop = device_prop(device);
    size_t g = 0;
    CUresult res = cx->driver.mem_get_allocation_granularity(&g, &prop,
                                                             CU_MEM_ALLOC_GRANULARITY_MINIMUM);
    if (res != CUDA_SUCCESS)
        return driver_fail(cx, res, "cuMemGetAllocationGranularity");
    *granularity = g;
    return CCA_OK;
}

static cca_status_t cuda_vmm_reserve(void *ctx, int device, size_t size, void **addr)
{
    cuda_ctx_t *cx = ctx;
    if (!cx->driver.vmm)
        return vmm_unsupported();
    int previous = device;
    cca_status_t st = enter_device(device, &previous);
    if (st != CCA_OK)
        return st;
    CUdeviceptr base = 0;
    CUresult res = cx->driver.mem_address_reserve(&base, size, 0, 0, 0);
    leave_device(device, previous);
    if (res != CUDA_SUCCESS)
        return driver_fail(cx, res, "cuMemAddressReserve");
    *addr = (void *)(uintptr_t)base;
    return CCA_OK;
}

static cca_status_t cuda_vmm_free(void *ctx, int device, void *addr, size_t size)
{
    cuda_ctx_t *cx = ctx;
    if (!cx->driver.vmm)
        return vmm_unsupported();
    int previous = device;
    cca_status_t st = enter_device(device, &previous);
    if (st != CCA_OK)
        return st;
    CUresult res = cx->driver.mem_address_free((CUdeviceptr)(uintptr_t)addr, size);
    leave_device(device, previous);
    return res == CUDA_SUCCESS ? CCA_OK : driver_fail(cx, res, "cuMemAddressFree");
}

static cca_status_t cuda_vmm_create(void *ctx, int device, size_t size, cca_phys_handle_t *handle)
{
    cuda_ctx_t *cx = ctx;
    if (!cx->driver.vmm)
        return vmm_unsupported();
    int previous = device;
    cca_status_t st = enter_device(device, &previous);
    if (st != CCA_OK)
        return st;
    CUmemAllocationProp prop = device_prop(device);
    CUmemGenericAllocationHandle h = 0;
    CUresult res = CUDA_ERROR_NOT_SUPPORTED;
    if (shareable_device(cx, device)) {
        /* as PyTorch: shareable when the driver allows, plain after a refusal */
        prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
        res = cx->driver.mem_create(&h, size, &prop, 0);
        if (res == CUDA_ERROR_NOT_SUPPORTED || res == CUDA_ERROR_NOT_PERMITTED)
            cx->shareable[device] = -1;
        prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_NONE;
    }
    if (res == CUDA_ERROR_NOT_SUPPORTED || res == CUDA_ERROR_NOT_PERMITTED)
        res = cx->driver.mem_create(&h, size, &prop, 0);
    leave_device(device, previous);
    if (res != CUDA_SUCCESS)
        return driver_fail(cx, res, "cuMemCreate");
    *handle = (cca_phys_handle_t)h;
    return CCA_OK;
}

static cca_status_t cuda_vmm_release(void *ctx, int device, cca_phys_handle_t handle)
{
    cuda_ctx_t *cx = ctx;
    if (!cx->driver.vmm)
        return vmm_unsupported();
    int previous = device;
    cca_status_t st = enter_device(device, &previous);
    if (st != CCA_OK)
        return st;
    CUresult res = cx->driver.mem_release((CUmemGenericAllocationHandle)handle);
    leave_device(device, previous);
    if (res != CUDA_SUCCESS)
        return driver_fail(cx, res, "cuMemRelease");
    pthread_mutex_lock(&cx->export_lock);
    for (size_t i = 0; i < cx->export_count; i++)
        if (cx->exports[i].handle == (CUmemGenericAllocationHandle)handle) {
            close(cx->exports[i].fd);
            cx->exports[i] = cx->exports[--cx->export_count];
            break;
        }
    pthread_mutex_unlock(&cx->export_lock);
    return CCA_OK;
}

static cca_status_t cuda_vmm_map(void *ctx, int device, void *addr, size_t size,
                                 cca_phys_handle_t handle)
{
    cuda_ctx_t *cx = ctx;
    if (!cx->driver.vmm)
        return vmm_unsupported();
    int previous = device;
    cca_status_t st = enter_device(device, &previous);
    if (st != CCA_OK)
        return st;
    CUresult res = cx->driver.mem_map((CUdeviceptr)(uintptr_t)addr, size, 0,
                                      (CUmemGenericAllocationHandle)handle, 0);
    leave_device(device, previous);
    return res == CUDA_SUCCESS ? CCA_OK : driver_fail(cx, res, "cuMemMap");
}

static cca_status_t cuda_vmm_unmap(void *ctx, int device, void *addr, size_t size)
{
    cuda_ctx_t *cx = ctx;
    if (!cx->driver.vmm)
        return vmm_unsupported();
    int previous = device;
    cca_status_t st = enter_device(device, &previous);
    if (st != CCA_OK)
        return st;
    CUresult res = cx->driver.mem_unmap((CUdeviceptr)(uintptr_t)addr, size);
    leave_device(device, previous);
    return res == CUDA_SUCCESS ? CCA_OK : driver_fail(cx, res, "cuMemUnmap");
}

static cca_status_t cuda_vmm_set_access(void *ctx, int device, void *addr, size_t size)
{
    cuda_ctx_t *cx = ctx;
    if (!cx->driver.vmm)
        return vmm_unsupported();
    int previous = device;
    cca_status_t st = enter_device(device, &previous);
    if (st != CCA_OK)
        return st;
    CUmemAccessDesc desc;
    memset(&desc, 0, sizeof(desc));
    desc.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    desc.location.id = device;
    desc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    CUresult res = cx->driver.mem_set_access((CUdeviceptr)(uintptr_t)addr, size, &desc, 1);
    leave_device(device, previous);
    return res == CUDA_SUCCESS ? CCA_OK : driver_fail(cx, res, "cuMemSetAccess");
}

static cca_status_t cuda_vmm_export(void *ctx, int device, cca_phys_handle_t handle, int *fd)
{
    cuda_ctx_t *cx = ctx;
    if (!cx->driver.vmm)
        return vmm_unsupported();
    if (!fd)
        return cca_backend_error(CCA_ERR_INVALID_ARGUMENT, 0, "vmm_export: fd is NULL");
    if (!shareable_device(cx, device))
        return cca_backend_error(CCA_ERR_NOT_SUPPORTED, 0,
                                 "device %d cannot create physical memory shareable as a POSIX "
                                 "file descriptor (cuMemExportToShareableHandle)",
                                 device);
    CUmemGenericAllocationHandle h = (CUmemGenericAllocationHandle)handle;
    pthread_mutex_lock(&cx->export_lock);
    for (size_t i = 0; i < cx->export_count; i++)
        if (cx->exports[i].handle == h) {
            *fd = cx->exports[i].fd;
            pthread_mutex_unlock(&cx->export_lock);
            return CCA_OK;
        }
    cca_status_t st = CCA_OK;
    if (cx->export_count == cx->export_cap) {
        size_t cap = cx->export_cap ? cx->export_cap * 2 : 16;
        cuda_export_t *grown = realloc(cx->exports, cap * sizeof(*grown));
        if (!grown) {
            st = cca_backend_error(CCA_ERR_OUT_OF_MEMORY, 0,
                                   "out of host memory recording an exported handle");
            goto out_unlock;
        }
        cx->exports = grown;
        cx->export_cap = cap;
    }
    int previous = device;
    st = enter_device(device, &previous);
    if (st != CCA_OK)
        goto out_unlock;
    int out = -1;
    CUresult res = cx->driver.mem_export(&out, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
    leave_device(device, previous);
    if (res != CUDA_SUCCESS) {
        st = res == CUDA_ERROR_NOT_SUPPORTED || res == CUDA_ERROR_NOT_PERMITTED ||
                     res == CUDA_ERROR_INVALID_VALUE
                 ? cca_backend_error(CCA_ERR_NOT_SUPPORTED, (long)res,
                                     "cuMemExportToShareableHandle refused the handle (it was "
                                     "not created shareable as a POSIX file descriptor)")
                 : driver_fail(cx, res, "cuMemExportToShareableHandle");
        goto out_unlock;
    }
    cx->exports[cx->export_count++] = (cuda_export_t){h, out};
    *fd = out;
out_unlock:
    pthread_mutex_unlock(&cx->export_lock);
    return st;
}

static cca_status_t cuda_vmm_import(void *ctx, int device, int fd, cca_phys_handle_t *handle)
{
    cuda_ctx_t *cx = ctx;
    if (!cx->driver.vmm)
        return vmm_unsupported();
    if (!cx->driver.mem_import)
        return cca_backend_error(CCA_ERR_NOT_SUPPORTED, 0,
                                 "the CUDA driver does not provide cuMemImportFromShareableHandle");
    int previous = device;
    cca_status_t st = enter_device(device, &previous);
    if (st != CCA_OK)
        return st;
    CUmemGenericAllocationHandle h = 0;
    CUresult res = cx->driver.mem_import(&h, (void *)(uintptr_t)fd,
                                         CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
    leave_device(device, previous);
    if (res != CUDA_SUCCESS)
        return driver_fail(cx, res, "cuMemImportFromShareableHandle");
    *handle = (cca_phys_handle_t)h;
    return CCA_OK;
}

/* ---- host memory ------------------------------------------------------------------------ */

static cca_status_t cuda_host_alloc(void *ctx, size_t size, void **ptr)
{
    (void)ctx;
    void *p = NULL;
    cudaError_t err = cudaHostAlloc(&p, size, cudaHostAllocDefault);
    if (err != cudaSuccess)
        return cuda_fail(err, "cudaHostAlloc");
    *ptr = p;
    return CCA_OK;
}

static cca_status_t cuda_host_free(void *ctx, void *ptr)
{
    (void)ctx;
    cudaError_t err = cudaFreeHost(ptr);
    return err == cudaSuccess ? CCA_OK : cuda_fail(err, "cudaFreeHost");
}

static cca_status_t cuda_host_register(void *ctx, void *ptr, size_t size, void **device_ptr)
{
    (void)ctx;
    cudaError_t err = cudaHostRegister(ptr, size, cudaHostRegisterDefault);
    if (err != cudaSuccess)
        return cuda_fail(err, "cudaHostRegister");
    void *dptr = NULL;
    err = cudaHostGetDevicePointer(&dptr, ptr, 0);
    if (err != cudaSuccess) {
        cca_status_t st = cuda_fail(err, "cudaHostGetDevicePointer");
        if (cudaHostUnregister(ptr) != cudaSuccess)
            (void)cudaGetLastError();
        return st;
    }
    *device_ptr = dptr;
    return CCA_OK;
}

static cca_status_t cuda_host_unregister(void *ctx, void *ptr)
{
    (void)ctx;
    cudaError_t err = cudaHostUnregister(ptr);
    return err == cudaSuccess ? CCA_OK : cuda_fail(err, "cudaHostUnregister");
}

/* ---- IPC ----------------------------------------------------------------------------------- */

static cca_status_t cuda_ipc_get_handle(void *ctx, int device, void *ptr, cca_ipc_handle_t *handle)
{
    (void)ctx;
    _Static_assert(sizeof(cudaIpcMemHandle_t) == sizeof(cca_ipc_handle_t),
                   "cca_ipc_handle_t must hold a cudaIpcMemHandle_t");
    int previous = device;
    cca_status_t st = enter_device(device, &previous);
    if (st != CCA_OK)
        return st;
    cudaIpcMemHandle_t h;
    cudaError_t err = cudaIpcGetMemHandle(&h, ptr);
    leave_device(device, previous);
    if (err != cudaSuccess)
        return cuda_fail(err, "cudaIpcGetMemHandle");
    memcpy(handle->bytes, &h, sizeof(h));
    return CCA_OK;
}

static cca_status_t cuda_ipc_open(void *ctx, int device, const cca_ipc_handle_t *handle,
                                  void **ptr)
{
    (void)ctx;
    int previous = device;
    cca_status_t st = enter_device(device, &previous);
    if (st != CCA_OK)
        return st;
    cudaIpcMemHandle_t h;
    memcpy(&h, handle->bytes, sizeof(h));
    void *p = NULL;
    cudaError_t err = cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess);
    leave_device(device, previous);
    if (err != cudaSuccess)
        return cuda_fail(err, "cudaIpcOpenMemHandle");
    *ptr = p;
    return CCA_OK;
}

static cca_status_t cuda_ipc_close(void *ctx, int device, void *ptr)
{
    (void)ctx;
    int previous = device;
    cca_status_t st = enter_device(device, &previous);
    if (st != CCA_OK)
        return st;
    cudaError_t err = cudaIpcCloseMemHandle(ptr);
    leave_device(device, previous);
    return err == cudaSuccess ? CCA_OK : cuda_fail(err, "cudaIpcCloseMemHandle");
}

static cca_status_t cuda_ipc_event_create(void *ctx, int device, cca_event_t *event)
{
    (void)ctx;
    int previous = device;
    cca_status_t st = enter_device(device, &previous);
    if (st != CCA_OK)
        return st;
    cudaEvent_t e = NULL;
    cudaError_t err =
        cudaEventCreateWithFlags(&e, cudaEventDisableTiming | cudaEventInterprocess);
    leave_device(device, previous);
    if (err != cudaSuccess)
        return cuda_fail(err, "cudaEventCreateWithFlags(cudaEventInterprocess)");
    *event = e;
    return CCA_OK;
}

static cca_status_t cuda_ipc_event_get_handle(void *ctx, int device, cca_event_t event,
                                              cca_ipc_handle_t *handle)
{
    (void)ctx;
    _Static_assert(sizeof(cudaIpcEventHandle_t) == sizeof(cca_ipc_handle_t),
                   "cca_ipc_handle_t must hold a cudaIpcEventHandle_t");
    int previous = device;
    cca_status_t st = enter_device(device, &previous);
    if (st != CCA_OK)
        return st;
    cudaIpcEventHandle_t h;
    cudaError_t err = cudaIpcGetEventHandle(&h, (cudaEvent_t)event);
    leave_device(device, previous);
    if (err != cudaSuccess)
        return cuda_fail(err, "cudaIpcGetEventHandle");
    memcpy(handle->bytes, &h, sizeof(h));
    return CCA_OK;
}

static cca_status_t cuda_ipc_event_open(void *ctx, int device, const cca_ipc_handle_t *handle,
                                        cca_event_t *event)
{
    (void)ctx;
    int previous = device;
    cca_status_t st = enter_device(device, &previous);
    if (st != CCA_OK)
        return st;
    cudaIpcEventHandle_t h;
    memcpy(&h, handle->bytes, sizeof(h));
    cudaEvent_t e = NULL;
    cudaError_t err = cudaIpcOpenEventHandle(&e, h);
    leave_device(device, previous);
    if (err != cudaSuccess)
        return cuda_fail(err, "cudaIpcOpenEventHandle");
    *event = e;
    return CCA_OK;
}

/* ---- peer access and copies ----------------------------------------------------------------- */

static cca_status_t cuda_can_access_peer(void *ctx, int device, int peer, int *can_access)
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
static cca_status_t cuda_enable_peer_access(void *ctx, int device, int peer)
{
    (void)ctx;
    int previous = device;
    cca_status_t st = enter_device(device, &previous);
    if (st != CCA_OK)
        return st;
    cudaError_t err = cudaDeviceEnablePeerAccess(peer, 0);
    leave_device(device, previous);
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

static cca_status_t cuda_memcpy_peer_async(void *ctx, void *dst, int dst_device, const void *src,
                                           int src_device, size_t size, cca_stream_t stream)
{
    (void)ctx;
    cudaError_t err = cudaMemcpyPeerAsync(dst, dst_device, src, src_device, size,
                                          (cudaStream_t)stream);
    return err == cudaSuccess ? CCA_OK : cuda_fail(err, "cudaMemcpyPeerAsync");
}

/* ---- streams ------------------------------------------------------------------------------- */

static cca_status_t cuda_stream_create(void *ctx, int device, cca_stream_t *stream)
{
    (void)ctx;
    int previous = device;
    cca_status_t st = enter_device(device, &previous);
    if (st != CCA_OK)
        return st;
    cudaStream_t s = NULL;
    cudaError_t err = cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
    leave_device(device, previous);
    if (err != cudaSuccess)
        return cuda_fail(err, "cudaStreamCreateWithFlags");
    *stream = (cca_stream_t)s;
    return CCA_OK;
}

static cca_status_t cuda_stream_destroy(void *ctx, int device, cca_stream_t stream)
{
    (void)ctx;
    int previous = device;
    cca_status_t st = enter_device(device, &previous);
    if (st != CCA_OK)
        return st;
    cudaError_t err = cudaStreamDestroy((cudaStream_t)stream);
    leave_device(device, previous);
    return err == cudaSuccess ? CCA_OK : cuda_fail(err, "cudaStreamDestroy");
}

static cca_status_t cuda_stream_wait_event(void *ctx, int device, cca_stream_t stream,
                                           cca_event_t event)
{
    (void)ctx;
    int previous = device;
    cca_status_t st = enter_device(device, &previous);
    if (st != CCA_OK)
        return st;
    cudaError_t err = cudaStreamWaitEvent((cudaStream_t)stream, (cudaEvent_t)event, 0);
    leave_device(device, previous);
    return err == cudaSuccess ? CCA_OK : cuda_fail(err, "cudaStreamWaitEvent");
}

/* ---- stream-ordered memory pool (cudaMallocAsync) -------------------------------------------- */

/*
 * The default stream infers its device from the current context, so both
 * calls run with device current, as PyTorch's CUDAGuard does.
 */
static cca_status_t cuda_malloc_async(void *ctx, int device, size_t size, cca_stream_t stream,
                                      void **ptr)
{
    (void)ctx;
    int previous = device;
    cca_status_t st = enter_device(device, &previous);
    if (st != CCA_OK)
        return st;
    void *p = NULL;
    cudaError_t err = cudaMallocAsync(&p, size, (cudaStream_t)stream);
    leave_device(device, previous);
    if (err != cudaSuccess)
        return cuda_fail(err, "cudaMallocAsync");
    *ptr = p;
    return CCA_OK;
}

static cca_status_t cuda_free_async(void *ctx, int device, void *ptr, cca_stream_t stream)
{
    (void)ctx;
    int previous = device;
    cca_status_t st = enter_device(device, &previous);
    if (st != CCA_OK)
        return st;
    cudaError_t err = cudaFreeAsync(ptr, (cudaStream_t)stream);
    leave_device(device, previous);
    return err == cudaSuccess ? CCA_OK : cuda_fail(err, "cudaFreeAsync");
}

static cca_status_t default_pool(int device, cudaMemPool_t *pool)
{
    cudaError_t err = cudaDeviceGetDefaultMemPool(pool, device);
    return err == cudaSuccess ? CCA_OK : cuda_fail(err, "cudaDeviceGetDefaultMemPool");
}

static cca_status_t cuda_mempool_trim(void *ctx, int device, size_t keep_bytes)
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

static cca_status_t cuda_mempool_get_attr(void *ctx, int device, cca_mempool_attr_t attr,
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

static cca_status_t cuda_mempool_set_attr(void *ctx, int device, cca_mempool_attr_t attr,
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
static cca_status_t cuda_mempool_set_access(void *ctx, int device, int peer)
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
