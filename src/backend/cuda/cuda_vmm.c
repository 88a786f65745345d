/*
 * cuda_vmm.c - the CUDA backend's virtual memory for expandable segments: the
 * driver's cuMem* entry points (looked up at creation, never linked), address
 * reservations, physical handles, mappings, access and shareable handles for
 * IPC. Every operation answers CCA_ERR_NOT_SUPPORTED when the driver lacks them.
 */
#include "cuda_internal.h"

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

cca_status_t cuda_vmm_granularity(void *ctx, int device, size_t *granularity)
{
    cuda_ctx_t *cx = ctx;
    if (!cx->driver.vmm)
        return vmm_unsupported();
    CUmemAllocationProp prop = device_prop(device);
    size_t g = 0;
    CUresult res = cx->driver.mem_get_allocation_granularity(&g, &prop,
                                                             CU_MEM_ALLOC_GRANULARITY_MINIMUM);
    if (res != CUDA_SUCCESS)
        return cuda_driver_fail(cx, res, "cuMemGetAllocationGranularity");
    *granularity = g;
    return CCA_OK;
}

cca_status_t cuda_vmm_reserve(void *ctx, int device, size_t size, void **addr)
{
    cuda_ctx_t *cx = ctx;
    if (!cx->driver.vmm)
        return vmm_unsupported();
    int previous = device;
    cca_status_t st = cuda_enter_device(device, &previous);
    if (st != CCA_OK)
        return st;
    CUdeviceptr base = 0;
    CUresult res = cx->driver.mem_address_reserve(&base, size, 0, 0, 0);
    cuda_leave_device(device, previous);
    if (res != CUDA_SUCCESS)
        return cuda_driver_fail(cx, res, "cuMemAddressReserve");
    *addr = (void *)(uintptr_t)base;
    return CCA_OK;
}

cca_status_t cuda_vmm_free(void *ctx, int device, void *addr, size_t size)
{
    cuda_ctx_t *cx = ctx;
    if (!cx->driver.vmm)
        return vmm_unsupported();
    int previous = device;
    cca_status_t st = cuda_enter_device(device, &previous);
    if (st != CCA_OK)
        return st;
    CUresult res = cx->driver.mem_address_free((CUdeviceptr)(uintptr_t)addr, size);
    cuda_leave_device(device, previous);
    return res == CUDA_SUCCESS ? CCA_OK : cuda_driver_fail(cx, res, "cuMemAddressFree");
}

cca_status_t cuda_vmm_create(void *ctx, int device, size_t size, cca_phys_handle_t *handle)
{
    cuda_ctx_t *cx = ctx;
    if (!cx->driver.vmm)
        return vmm_unsupported();
    int previous = device;
    cca_status_t st = cuda_enter_device(device, &previous);
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
    cuda_leave_device(device, previous);
    if (res != CUDA_SUCCESS)
        return cuda_driver_fail(cx, res, "cuMemCreate");
    *handle = (cca_phys_handle_t)h;
    return CCA_OK;
}

cca_status_t cuda_vmm_release(void *ctx, int device, cca_phys_handle_t handle)
{
    cuda_ctx_t *cx = ctx;
    if (!cx->driver.vmm)
        return vmm_unsupported();
    int previous = device;
    cca_status_t st = cuda_enter_device(device, &previous);
    if (st != CCA_OK)
        return st;
    CUresult res = cx->driver.mem_release((CUmemGenericAllocationHandle)handle);
    cuda_leave_device(device, previous);
    if (res != CUDA_SUCCESS)
        return cuda_driver_fail(cx, res, "cuMemRelease");
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

cca_status_t cuda_vmm_map(void *ctx, int device, void *addr, size_t size,
                          cca_phys_handle_t handle)
{
    cuda_ctx_t *cx = ctx;
    if (!cx->driver.vmm)
        return vmm_unsupported();
    int previous = device;
    cca_status_t st = cuda_enter_device(device, &previous);
    if (st != CCA_OK)
        return st;
    CUresult res = cx->driver.mem_map((CUdeviceptr)(uintptr_t)addr, size, 0,
                                      (CUmemGenericAllocationHandle)handle, 0);
    cuda_leave_device(device, previous);
    return res == CUDA_SUCCESS ? CCA_OK : cuda_driver_fail(cx, res, "cuMemMap");
}

cca_status_t cuda_vmm_unmap(void *ctx, int device, void *addr, size_t size)
{
    cuda_ctx_t *cx = ctx;
    if (!cx->driver.vmm)
        return vmm_unsupported();
    int previous = device;
    cca_status_t st = cuda_enter_device(device, &previous);
    if (st != CCA_OK)
        return st;
    CUresult res = cx->driver.mem_unmap((CUdeviceptr)(uintptr_t)addr, size);
    cuda_leave_device(device, previous);
    return res == CUDA_SUCCESS ? CCA_OK : cuda_driver_fail(cx, res, "cuMemUnmap");
}

cca_status_t cuda_vmm_set_access(void *ctx, int device, void *addr, size_t size)
{
    cuda_ctx_t *cx = ctx;
    if (!cx->driver.vmm)
        return vmm_unsupported();
    int previous = device;
    cca_status_t st = cuda_enter_device(device, &previous);
    if (st != CCA_OK)
        return st;
    CUmemAccessDesc desc;
    memset(&desc, 0, sizeof(desc));
    desc.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    desc.location.id = device;
    desc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    CUresult res = cx->driver.mem_set_access((CUdeviceptr)(uintptr_t)addr, size, &desc, 1);
    cuda_leave_device(device, previous);
    return res == CUDA_SUCCESS ? CCA_OK : cuda_driver_fail(cx, res, "cuMemSetAccess");
}

cca_status_t cuda_vmm_export(void *ctx, int device, cca_phys_handle_t handle, int *fd)
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
    st = cuda_enter_device(device, &previous);
    if (st != CCA_OK)
        goto out_unlock;
    int out = -1;
    CUresult res = cx->driver.mem_export(&out, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
    cuda_leave_device(device, previous);
    if (res != CUDA_SUCCESS) {
        st = res == CUDA_ERROR_NOT_SUPPORTED || res == CUDA_ERROR_NOT_PERMITTED ||
                     res == CUDA_ERROR_INVALID_VALUE
                 ? cca_backend_error(CCA_ERR_NOT_SUPPORTED, (long)res,
                                     "cuMemExportToShareableHandle refused the handle (it was "
                                     "not created shareable as a POSIX file descriptor)")
                 : cuda_driver_fail(cx, res, "cuMemExportToShareableHandle");
        goto out_unlock;
    }
    cx->exports[cx->export_count++] = (cuda_export_t){h, out};
    *fd = out;
out_unlock:
    pthread_mutex_unlock(&cx->export_lock);
    return st;
}

cca_status_t cuda_vmm_import(void *ctx, int device, int fd, cca_phys_handle_t *handle)
{
    cuda_ctx_t *cx = ctx;
    if (!cx->driver.vmm)
        return vmm_unsupported();
    if (!cx->driver.mem_import)
        return cca_backend_error(CCA_ERR_NOT_SUPPORTED, 0,
                                 "the CUDA driver does not provide cuMemImportFromShareableHandle");
    int previous = device;
    cca_status_t st = cuda_enter_device(device, &previous);
    if (st != CCA_OK)
        return st;
    CUmemGenericAllocationHandle h = 0;
    CUresult res = cx->driver.mem_import(&h, (void *)(uintptr_t)fd,
                                         CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
    cuda_leave_device(device, previous);
    if (res != CUDA_SUCCESS)
        return cuda_driver_fail(cx, res, "cuMemImportFromShareableHandle");
    *handle = (cca_phys_handle_t)h;
    return CCA_OK;
}
