/*
 * nvml.c - optional NVML queries: which processes use a GPU and how much
 * memory each holds, for the out-of-memory message and
 * cca_list_gpu_processes (torch.cuda.list_gpu_processes).
 *
 * libnvidia-ml.so.1 is opened with dlopen on first use (once per process,
 * under pthread_once) and never linked, so cca runs where NVML is absent;
 * every query then reports "not available". The loaded function table is
 * immutable after loading, which makes every query thread-safe.
 *
 * Device mapping: NVML numbers GPUs by PCI order over all GPUs, CUDA by its
 * own order over the visible ones. A CUDA ordinal is mapped through
 * CUDA_VISIBLE_DEVICES when that holds plain indices; otherwise the CUDA
 * ordinal is used as the NVML index (exact unless CUDA_DEVICE_ORDER or
 * UUIDs reorder devices).
 */
#include <dlfcn.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "nvml.h"

/* The few NVML types and codes used, declared here so no NVML header is needed. */
typedef int nvml_return_t;
typedef struct nvml_device *nvml_device_t;
enum {
    NVML_OK = 0,
    NVML_ERR_INSUFFICIENT_SIZE = 7,
    NVML_ERR_DRIVER_NOT_LOADED = 9,
};
#define NVML_VALUE_NOT_AVAILABLE (~0ULL)

/* nvmlProcessInfo_t as nvmlDeviceGetComputeRunningProcesses_v3 fills it. */
typedef struct nvml_process_v2 {
    unsigned int pid;
    unsigned long long used_gpu_memory; /* bytes, or NVML_VALUE_NOT_AVAILABLE */
    unsigned int gpu_instance_id;
    unsigned int compute_instance_id;
} nvml_process_v2_t;

/* nvmlProcessInfo_v1_t, for drivers without the _v3 entry point. */
typedef struct nvml_process_v1 {
    unsigned int pid;
    unsigned long long used_gpu_memory;
} nvml_process_v1_t;

typedef struct nvml_api {
    bool loaded;              /* library opened and every needed symbol found */
    nvml_return_t init_result;/* nvmlInit_v2's result when loaded */
    nvml_return_t (*init)(void);
    const char *(*error_string)(nvml_return_t);
    nvml_return_t (*device_count)(unsigned int *);
    nvml_return_t (*handle_by_index)(unsigned int, nvml_device_t *);
    nvml_return_t (*processes_v3)(nvml_device_t, unsigned int *, nvml_process_v2_t *);
    nvml_return_t (*processes_v1)(nvml_device_t, unsigned int *, nvml_process_v1_t *);
} nvml_api_t;

static nvml_api_t nvml;
static pthread_once_t nvml_once = PTHREAD_ONCE_INIT;

/* Open NVML (CCA_NVML_LIBRARY overrides the library name) and initialise it. */
static void nvml_load(void)
{
    const char *name = getenv("CCA_NVML_LIBRARY");
    void *lib = dlopen(name && *name ? name : "libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib)
        return;
    /* POSIX allows casting dlsym's result to a function pointer through memcpy. */
    void *sym;
#define NVML_SYM(field, symbol)                      \
    do {                                             \
        sym = dlsym(lib, symbol);                    \
        memcpy(&nvml.field, &sym, sizeof(sym));      \
    } while (0)
    NVML_SYM(init, "nvmlInit_v2");
    NVML_SYM(error_string, "nvmlErrorString");
    NVML_SYM(device_count, "nvmlDeviceGetCount_v2");
    NVML_SYM(handle_by_index, "nvmlDeviceGetHandleByIndex_v2");
    NVML_SYM(processes_v3, "nvmlDeviceGetComputeRunningProcesses_v3");
    NVML_SYM(processes_v1, "nvmlDeviceGetComputeRunningProcesses");
#undef NVML_SYM
    if (!nvml.init || !nvml.error_string || !nvml.device_count || !nvml.handle_by_index ||
        (!nvml.processes_v3 && !nvml.processes_v1)) {
        dlclose(lib);
        memset(&nvml, 0, sizeof(nvml));
        return;
    }
    /* The library stays open for the life of the process. */
    nvml.init_result = nvml.init();
    nvml.loaded = true;
}

static const nvml_api_t *nvml_get(void)
{
    pthread_once(&nvml_once, nvml_load);
    return &nvml;
}

/*
 * NVML index of CUDA ordinal device: its entry in CUDA_VISIBLE_DEVICES when
 * that lists plain indices (as PyTorch's _get_nvml_device_index does), else
 * device itself. Returns -1 when device is past the end of the list.
 */
static int nvml_index_of(int device)
{
    const char *visible = getenv("CUDA_VISIBLE_DEVICES");
    if (!visible || !*visible)
        return device;
    int position = 0;
    const char *p = visible;
    while (*p) {
        while (*p == ' ')
            p++;
        char *end = NULL;
        long value = strtol(p, &end, 10);
        if (end == p)
            return position == 0 ? device : -1; /* UUIDs or names: use the ordinal */
        if (value < 0)
            return -1; /* a negative entry hides it and every later one */
        if (position == device)
            return (int)value;
        position++;
        p = end;
        while (*p == ' ')
            p++;
        if (*p != ',')
            break;
        p++;
    }
    return -1;
}

/* One process's use of a GPU. */
typedef struct gpu_process {
    unsigned int pid;
    unsigned long long bytes; /* NVML_VALUE_NOT_AVAILABLE if unknown */
} gpu_process_t;

/*
 * The processes using NVML device index; *list is malloc'ed. Returns NVML's
 * status; -1 when host memory ran out.
 */
static nvml_return_t nvml_processes(const nvml_api_t *api, unsigned int index,
                                    gpu_process_t **list, unsigned int *count)
{
    nvml_device_t dev = NULL;
    nvml_return_t r = api->handle_by_index(index, &dev);
    if (r != NVML_OK)
        return r;
    unsigned int capacity = 8;
    for (;;) {
        size_t entry = api->processes_v3 ? sizeof(nvml_process_v2_t) : sizeof(nvml_process_v1_t);
        void *raw = calloc(capacity, entry);
        if (!raw)
            return -1;
        unsigned int n = capacity;
        r = api->processes_v3 ? api->processes_v3(dev, &n, raw) : api->processes_v1(dev, &n, raw);
        if (r == NVML_ERR_INSUFFICIENT_SIZE) {
            free(raw);
            capacity = n > capacity ? n + 4 : capacity * 2;
            continue;
        }
        if (r != NVML_OK) {
            free(raw);
            return r;
        }
        gpu_process_t *out = calloc(n ? n : 1, sizeof(*out));
        if (!out) {
            free(raw);
            return -1;
        }
        for (unsigned int i = 0; i < n; i++) {
            if (api->processes_v3) {
                const nvml_process_v2_t *p = (const nvml_process_v2_t *)raw + i;
                out[i].pid = p->pid;
                out[i].bytes = p->used_gpu_memory;
            } else {
                const nvml_process_v1_t *p = (const nvml_process_v1_t *)raw + i;
                out[i].pid = p->pid;
                out[i].bytes = p->used_gpu_memory;
            }
        }
        free(raw);
        *list = out;
        *count = n;
        return NVML_OK;
    }
}

void nvml_format_size(cca_strbuf_t *out, unsigned long long bytes)
{
    /* PyTorch's format_size: the unit changes just above 1 KiB, 1 MiB and 1 GiB. */
    if (bytes <= 1024)
        sb_printf(out, "%llu bytes", bytes);
    else if (bytes <= 1048576ULL)
        sb_printf(out, "%.2f KiB", (double)bytes / 1024.0);
    else if (bytes <= 1073741824ULL)
        sb_printf(out, "%.2f MiB", (double)bytes / 1048576.0);
    else
        sb_printf(out, "%.2f GiB", (double)bytes / 1073741824.0);
}

bool nvml_process_usage(int device, cca_strbuf_t *out)
{
    const nvml_api_t *api = nvml_get();
    if (!api->loaded || api->init_result != NVML_OK || device < 0)
        return false;
    int index = nvml_index_of(device);
    if (index < 0)
        return false;
    gpu_process_t *procs = NULL;
    unsigned int count = 0;
    if (nvml_processes(api, (unsigned int)index, &procs, &count) != NVML_OK)
        return false;
    unsigned int self = (unsigned int)getpid();
    for (unsigned int i = 0; i < count; i++) {
        if (procs[i].pid == self)
            sb_append(out, "Including memory not allocated by cca, this process");
        else
            sb_printf(out, "Process %u", procs[i].pid);
        if (procs[i].bytes == NVML_VALUE_NOT_AVAILABLE) {
            sb_append(out, " has an unknown amount of memory in use. ");
        } else {
            sb_append(out, " has ");
            nvml_format_size(out, procs[i].bytes);
            sb_append(out, " memory in use. ");
        }
    }
    free(procs);
    return true;
}

/*
 * The text of torch.cuda.list_gpu_processes(device). Returns CCA_OK (also
 * when NVML is missing: the text says so), CCA_ERR_INVALID_ARGUMENT (text
 * NULL, device < 0 or not a GPU NVML knows), CCA_ERR_BACKEND (an NVML call
 * failed), CCA_ERR_OUT_OF_MEMORY (host). Thread-safe.
 */
cca_status_t cca_list_gpu_processes(int device, char **text)
{
    if (!text)
        return cca_raise(CCA_ERR_INVALID_ARGUMENT, "cca_list_gpu_processes: text is NULL");
    if (device < 0)
        return cca_raise(CCA_ERR_INVALID_ARGUMENT,
                         "cca_list_gpu_processes: device %d is not a device index", device);
    cca_strbuf_t sb;
    sb_init(&sb);
    cca_status_t st = CCA_OK;
    gpu_process_t *procs = NULL;
    const nvml_api_t *api = nvml_get();
    if (!api->loaded) {
        sb_append(&sb, "NVML not found, unable to list processes");
        goto out_text;
    }
    if (api->init_result == NVML_ERR_DRIVER_NOT_LOADED) {
        sb_append(&sb, "cuda driver can't be loaded, is cuda enabled?");
        goto out_text;
    }
    if (api->init_result != NVML_OK) {
        st = cca_raise_backend(CCA_ERR_BACKEND, api->init_result, "nvmlInit failed: %s",
                               api->error_string(api->init_result));
        goto out_free;
    }
    int index = nvml_index_of(device);
    unsigned int nvml_count = 0;
    nvml_return_t r = api->device_count(&nvml_count);
    if (r != NVML_OK) {
        st = cca_raise_backend(CCA_ERR_BACKEND, r, "nvmlDeviceGetCount failed: %s",
                               api->error_string(r));
        goto out_free;
    }
    if (index < 0 || (unsigned int)index >= nvml_count) {
        st = cca_raise(CCA_ERR_INVALID_ARGUMENT,
                       "cca_list_gpu_processes: device %d is not among the %u GPUs NVML sees",
                       device, nvml_count);
        goto out_free;
    }
    unsigned int count = 0;
    r = nvml_processes(api, (unsigned int)index, &procs, &count);
    if (r == -1) {
        st = cca_raise(CCA_ERR_OUT_OF_MEMORY, "cca_list_gpu_processes: out of host memory");
        goto out_free;
    }
    if (r != NVML_OK) {
        st = cca_raise_backend(CCA_ERR_BACKEND, r,
                               "nvmlDeviceGetComputeRunningProcesses failed: %s",
                               api->error_string(r));
        goto out_free;
    }
    sb_printf(&sb, "GPU:%d", index);
    if (count == 0)
        sb_append(&sb, "\nno processes are running");
    for (unsigned int i = 0; i < count; i++) {
        double mb = procs[i].bytes == NVML_VALUE_NOT_AVAILABLE
                        ? 0.0
                        : (double)procs[i].bytes / (1024.0 * 1024.0);
        sb_printf(&sb, "\nprocess %10u uses %12.3f MB GPU memory", procs[i].pid, mb);
    }
out_text:
    if (sb.failed || !sb.data) {
        st = cca_raise(CCA_ERR_OUT_OF_MEMORY, "cca_list_gpu_processes: out of host memory");
        goto out_free;
    }
    *text = sb.data;
    free(procs);
    return CCA_OK;
out_free:
    free(procs);
    sb_free(&sb);
    return st;
}
