/*
 * torch_adapter.cpp - cca as PyTorch's CUDA allocator.
 *
 * PyTorch keeps its CUDA allocator behind one C++ interface,
 * c10::cuda::CUDACachingAllocator::CUDAAllocator; every torch.cuda.memory
 * function (memory_stats, empty_cache, _snapshot, ...) and every CUDA tensor
 * goes through the object installed there. This file implements that
 * interface over cca's C API and nothing else: each method converts its
 * arguments, calls cca, and converts the result or the error. No decision
 * about memory is taken here.
 *
 * It is the only C++ in cca and is built only where torch is installed
 * (python/cca/torch.py compiles it against the installed headers). It
 * exports C functions for ctypes: cca_torch_adapter_install (the device
 * allocator), cca_torch_adapter_install_pinned (cca's pinned host allocator
 * as PyTorch's host allocator for CUDA), cca_torch_adapter_note_settings
 * (a run-time settings string, for snapshots), cca_torch_adapter_defer_settings
 * (a run-time settings string given before cca started), cca_torch_adapter_force_uncached
 * (PYTORCH_NO_CUDA_MEMORY_CACHING), cca_torch_adapter_abi and two measuring
 * calls.
 *
 * It is longer than the house's 1,200 lines: cca.torch compiles this one
 * source against the installed torch when a program installs cca, and the
 * interface it implements is PyTorch's whole allocator interface.
 */
#include <ATen/core/CachingHostAllocator.h>
#include <c10/core/Allocator.h>
#include <c10/core/impl/GPUTrace.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "cca.h"

namespace {

namespace cc = c10::cuda::CUDACachingAllocator;

/* Raise cca's last error as PyTorch does: out of memory as OutOfMemoryError. */
[[noreturn]] void raise_cca(cca_status_t st, const char *what)
{
    const char *msg = cca_last_error()->message;
    if (st == CCA_ERR_OUT_OF_MEMORY)
        TORCH_CHECK_WITH(OutOfMemoryError, false, msg);
    TORCH_CHECK(false, "cca: ", what, ": ", cca_status_str(st), ": ", msg);
}

inline void check(cca_status_t st, const char *what)
{
    if (st != CCA_OK)
        raise_cca(st, what);
}

/*
 * torch.cuda._gpu_trace (and CSAN, torch.cuda._sanitizer, over it): PyTorch's
 * allocator tells the Python tracer of every allocation it hands out and every
 * free it is asked for (c10::impl::GPUTrace). The call is looked up by its
 * signature, so a torch whose tracer has another shape builds (and traces nothing).
 */
template <typename VTable>
auto call_trace_allocation(const VTable *vt, uintptr_t p, int)
    -> decltype(vt->trace_gpu_memory_allocation(c10::DeviceType::CUDA, p), void())
{
    vt->trace_gpu_memory_allocation(c10::DeviceType::CUDA, p);
}
template <typename VTable> void call_trace_allocation(const VTable *, uintptr_t, long) {}
template <typename VTable>
auto call_trace_deallocation(const VTable *vt, uintptr_t p, int)
    -> decltype(vt->trace_gpu_memory_deallocation(c10::DeviceType::CUDA, p), void())
{
    vt->trace_gpu_memory_deallocation(c10::DeviceType::CUDA, p);
}
template <typename VTable> void call_trace_deallocation(const VTable *, uintptr_t, long) {}

inline void gpu_trace_allocation(void *ptr)
{
    const c10::impl::PyInterpreter *interp = c10::impl::GPUTrace::get_trace();
    if (C10_UNLIKELY(interp != nullptr) && ptr)
        call_trace_allocation((*interp).operator->(), reinterpret_cast<uintptr_t>(ptr), 0);
}
inline void gpu_trace_deallocation(void *ptr)
{
    const c10::impl::PyInterpreter *interp = c10::impl::GPUTrace::get_trace();
    if (C10_UNLIKELY(interp != nullptr) && ptr)
        call_trace_deallocation((*interp).operator->(), reinterpret_cast<uintptr_t>(ptr), 0);
}

/*
 * torch.profiler(profile_memory=True): PyTorch's allocator reports each
 * allocation (+ the block's size) and free (- its size) with the device's
 * allocated and reserved totals after it. cca gives no block size by pointer,
 * so the size is the change of allocated_bytes across the call (the block's
 * rounded size, as PyTorch's block->size; another thread allocating on the
 * device at the same instant can blur one report). Only while the profiler
 * records memory: otherwise one thread-local read per call.
 */
int64_t allocated_now(c10::DeviceIndex device)
{
    cca_device_stats_t s;
    if (cca_get_device_stats(device, &s) != CCA_OK)
        return 0;
    return s.allocated_bytes[CCA_STAT_ALL].current;
}
void report_to_profiler(void *ptr, int64_t size, c10::DeviceIndex device)
{
    cca_device_stats_t s;
    if (!ptr || cca_get_device_stats(device, &s) != CCA_OK)
        return;
    c10::reportMemoryUsageToProfiler(ptr, size, static_cast<size_t>(s.allocated_bytes[CCA_STAT_ALL].current),
                                     static_cast<size_t>(s.reserved_bytes[CCA_STAT_ALL].current),
                                     c10::Device(c10::DeviceType::CUDA, device));
}
/* The device of a pointer cca handed out (for the profiler's free reports). */
c10::DeviceIndex device_of(void *ptr)
{
    cudaPointerAttributes attr;
    if (cudaPointerGetAttributes(&attr, ptr) != cudaSuccess) {
        (void)cudaGetLastError();
        return c10::cuda::current_device();
    }
    return static_cast<c10::DeviceIndex>(attr.device);
}

/* Free a block cca handed out, with PyTorch's trace and profiler reports. */
cca_status_t free_block(void *ptr)
{
    if (!ptr)
        return CCA_OK;
    gpu_trace_deallocation(ptr);
    if (C10_UNLIKELY(c10::memoryProfilingEnabled())) {
        c10::DeviceIndex device = device_of(ptr);
        int64_t before = allocated_now(device);
        cca_status_t st = cca_free(ptr);
        if (st == CCA_OK)
            report_to_profiler(ptr, allocated_now(device) - before, device);
        return st;
    }
    return cca_free(ptr);
}

/* The deleter of every DataPtr cca hands out; also how recordStream knows its own. */
void delete_block(void *ptr)
{
    cca_status_t st = free_block(ptr);
    if (st != CCA_OK) /* a deleter cannot throw: say it */
        std::fprintf(stderr, "cca: free: %s: %s\n", cca_status_str(st), cca_last_error()->message);
}

/*
 * Uncached allocations, as PyTorch makes them while its caching allocator is
 * disabled (torch.cuda.caching_allocator_enable(False)) or under
 * PYTORCH_NO_CUDA_MEMORY_CACHING: cudaMalloc and cudaFree on each call,
 * outside the cache and its statistics, traced as PyTorch traces them. The
 * set lets raw_delete tell them from cca's blocks whatever the mode is then.
 */
std::mutex uncached_lock;
std::unordered_set<void *> uncached_ptrs;
std::atomic<size_t> uncached_count{0};

void *uncached_alloc(size_t size)
{
    void *ptr = nullptr;
    if (size == 0)
        return nullptr;
    C10_CUDA_CHECK(cudaMalloc(&ptr, size));
    {
        std::lock_guard<std::mutex> g(uncached_lock);
        uncached_ptrs.insert(ptr);
        uncached_count.store(uncached_ptrs.size(), std::memory_order_relaxed);
    }
    gpu_trace_allocation(ptr);
    return ptr;
}
/* Forget ptr if it is an uncached allocation: true if it was. */
bool take_uncached(void *ptr)
{
    if (uncached_count.load(std::memory_order_relaxed) == 0)
        return false;
    std::lock_guard<std::mutex> g(uncached_lock);
    if (!uncached_ptrs.erase(ptr))
        return false;
    uncached_count.store(uncached_ptrs.size(), std::memory_order_relaxed);
    return true;
}
void uncached_delete(void *ptr)
{
    if (!ptr)
        return;
    take_uncached(ptr);
    gpu_trace_deallocation(ptr);
    cudaError_t err = cudaFree(ptr);
    if (err != cudaSuccess) /* a deleter cannot throw: say it */
        std::fprintf(stderr, "cca: cudaFree of an uncached allocation: %s\n", cudaGetErrorString(err));
}

/*
 * The user context of the history: PyTorch's recorder returns a
 * GatheredContext object; cca keeps strings. The string is "torch:<id>", the
 * id a key into this table; cca says when it drops a string
 * (cca_set_context_release) and the object goes. Objects dropped inside cca's
 * locks are destroyed later, outside them.
 */
struct ContextTable {
    std::mutex lock;
    std::unordered_map<uint64_t, std::shared_ptr<c10::GatheredContext>> live;
    std::vector<std::shared_ptr<c10::GatheredContext>> dropped;
    uint64_t next_id = 1;
    cc::CreateContextFn recorder = nullptr;
};
ContextTable contexts;

const char *gather_context(void *)
{
    static thread_local char text[32];
    cc::CreateContextFn fn;
    std::vector<std::shared_ptr<c10::GatheredContext>> to_drop;
    {
        std::lock_guard<std::mutex> g(contexts.lock);
        fn = contexts.recorder;
        to_drop.swap(contexts.dropped);
    }
    to_drop.clear();
    if (!fn)
        return nullptr;
    std::shared_ptr<c10::GatheredContext> ctx = fn();
    if (!ctx)
        return nullptr;
    std::lock_guard<std::mutex> g(contexts.lock);
    uint64_t id = contexts.next_id++;
    contexts.live.emplace(id, std::move(ctx));
    std::snprintf(text, sizeof text, "torch:%llu", (unsigned long long)id);
    return text;
}

bool context_id(const char *text, uint64_t *id)
{
    if (!text || std::strncmp(text, "torch:", 6) != 0)
        return false;
    *id = std::strtoull(text + 6, nullptr, 10);
    return true;
}

void release_context(const char *text, void *)
{
    uint64_t id;
    if (!context_id(text, &id))
        return;
    std::lock_guard<std::mutex> g(contexts.lock);
    auto it = contexts.live.find(id);
    if (it == contexts.live.end())
        return;
    contexts.dropped.push_back(std::move(it->second));
    contexts.live.erase(it);
}

std::shared_ptr<c10::GatheredContext> find_context(const char *text)
{
    uint64_t id;
    if (!context_id(text, &id))
        return nullptr;
    std::lock_guard<std::mutex> g(contexts.lock);
    auto it = contexts.live.find(id);
    return it == contexts.live.end() ? nullptr : it->second;
}

/* OOM observers registered by PyTorch (torch.cuda.memory._record_memory_history, users). */
std::mutex observer_lock;
std::vector<cc::OutOfMemoryObserver> oom_observers;
void on_oom(int device, size_t size, size_t total, size_t free_bytes, void *)
{
    std::vector<cc::OutOfMemoryObserver> copy;
    {
        std::lock_guard<std::mutex> g(observer_lock);
        copy = oom_observers;
    }
    for (auto &fn : copy)
        fn(device, size, total, free_bytes);
}

/* Trace trackers: cca's entries, converted (tracker_lock is a leaf: taken inside cca's locks). */
std::mutex tracker_lock;
std::vector<cc::AllocatorTraceTracker> trackers;

bool to_action(cca_trace_action_t a, cc::TraceEntry::Action *out)
{
    switch (a) {
    case CCA_TRACE_ALLOC: *out = cc::TraceEntry::ALLOC; return true;
    case CCA_TRACE_FREE_REQUESTED: *out = cc::TraceEntry::FREE_REQUESTED; return true;
    case CCA_TRACE_FREE_COMPLETED: *out = cc::TraceEntry::FREE_COMPLETED; return true;
    case CCA_TRACE_SEGMENT_ALLOC: *out = cc::TraceEntry::SEGMENT_ALLOC; return true;
    case CCA_TRACE_SEGMENT_FREE: *out = cc::TraceEntry::SEGMENT_FREE; return true;
    case CCA_TRACE_SEGMENT_MAP: *out = cc::TraceEntry::SEGMENT_MAP; return true;
    case CCA_TRACE_SEGMENT_UNMAP: *out = cc::TraceEntry::SEGMENT_UNMAP; return true;
    case CCA_TRACE_SNAPSHOT: *out = cc::TraceEntry::SNAPSHOT; return true;
    case CCA_TRACE_OOM: *out = cc::TraceEntry::OOM; return true;
    default: return false; /* cca's annotations have no TraceEntry action */
    }
}

cc::TraceEntry to_entry(const cca_trace_entry_t &e, cc::TraceEntry::Action action,
                        std::shared_ptr<c10::GatheredContext> ctx)
{
    cc::TraceEntry te(action, static_cast<c10::DeviceIndex>(e.device), static_cast<size_t>(e.addr), e.size,
                      reinterpret_cast<cudaStream_t>(e.stream),
                      c10::cuda::MempoolId_t{e.pool.first, e.pool.second}, 0,
                      std::move(ctx));
    te.time_.t_ = static_cast<time_t>(e.time_us);
    te.compile_context_ = e.compile_context ? e.compile_context : "N/A";
    te.user_metadata_ = e.user_metadata ? e.user_metadata : "";
    return te;
}

/* An annotation entry (user_defined) as PyTorch's snapshot keeps it: its fields, device, time. */
c10::CachingDeviceAllocator::AnnotationEntry to_annotation(const cca_trace_entry_t &e)
{
    c10::CachingDeviceAllocator::AnnotationEntry ae(static_cast<c10::DeviceIndex>(e.device), 0);
    ae.time_.t_ = static_cast<time_t>(e.time_us);
    const char *key, *value;
    for (size_t i = 0; cca_trace_entry_field_at(&e, i, &key, &value); i++)
        ae.recordUserMetadata(key, value);
    return ae;
}

void on_trace(const cca_trace_entry_t *e, void *)
{
    cc::TraceEntry::Action action;
    if (!to_action(e->action, &action))
        return;
    cc::TraceEntry te = to_entry(*e, action, nullptr);
    std::lock_guard<std::mutex> g(tracker_lock);
    for (auto &fn : trackers)
        fn(te);
}

template <typename Stat> void fill_stat(Stat &out, const cca_stat_t &in)
{
    out.current = in.current;
    out.peak = in.peak;
    out.allocated = in.allocated;
    out.freed = in.freed;
}

void fill_stats(c10::CachingDeviceAllocator::StatArray &out, const cca_stat_t *in)
{
    for (size_t i = 0; i < CCA_STAT_TYPES; i++)
        fill_stat(out[i], in[i]);
}

cca_mempool_id_t to_pool(c10::cuda::MempoolId_t id)
{
    return {static_cast<uint64_t>(id.first), static_cast<uint64_t>(id.second)};
}

/* A routing filter of PyTorch's (graph capture, use_mem_pool), called by cca inside its lock. */
using StreamFilter = std::function<bool(cudaStream_t)>;
bool run_filter(cca_stream_t stream, void *arg)
{
    try {
        return (*static_cast<StreamFilter *>(arg))(reinterpret_cast<cudaStream_t>(stream));
    } catch (const std::exception &e) { /* nothing may cross cca's C frames */
        std::fprintf(stderr, "cca: a pool routing filter failed: %s\n", e.what());
        return false;
    }
}

/*
 * MemPool(allocator=a): the pool's segments from a's raw_alloc / raw_delete, as PyTorch's
 * allocPrimitive and release_block do (called by cca inside its lock; ctx is a).
 */
void *pool_alloc(size_t size, int device, cca_stream_t stream, void *ctx)
{
    (void)device;
    (void)stream;
    try {
        return static_cast<cc::CUDAAllocator *>(ctx)->raw_alloc(size); /* nullptr: out of memory */
    } catch (const std::exception &e) { /* nothing may cross cca's C frames */
        std::fprintf(stderr, "cca: a MemPool's allocator failed: %s\n", e.what());
        return nullptr;
    }
}
cca_status_t pool_free(void *ptr, size_t size, int device, cca_stream_t stream, void *ctx)
{
    (void)size;
    (void)device;
    (void)stream;
    try {
        static_cast<cc::CUDAAllocator *>(ctx)->raw_delete(ptr);
        return CCA_OK;
    } catch (const std::exception &e) {
        std::fprintf(stderr, "cca: a MemPool's allocator failed to free: %s\n", e.what());
        return CCA_ERR_BACKEND;
    }
}

/*
 * Handles opened in this process (getIpcDevPtr), by handle: PyTorch opens a
 * handle once however many storages use it. Never destroyed: deleters may run
 * late in the process's exit.
 */
struct IpcTable {
    std::mutex lock;
    std::unordered_map<std::string, std::weak_ptr<void>> open;
};
IpcTable &ipc_table()
{
    static IpcTable *t = new IpcTable;
    return *t;
}

/* The last user of an opened handle is gone: wait for the work queued on it, then close. */
void ipc_close(const std::string &handle, c10::DeviceIndex device, void *ptr)
{
    IpcTable &t = ipc_table();
    std::lock_guard<std::mutex> g(t.lock);
    cudaError_t err = cudaStreamSynchronize(c10::cuda::getCurrentCUDAStream(device).stream());
    if (err != cudaSuccess) /* a deleter cannot throw: say it */
        std::fprintf(stderr, "cca: closing a CUDA IPC handle: %s\n", cudaGetErrorString(err));
    cca_status_t st = cca_ipc_close(ptr);
    if (st != CCA_OK)
        std::fprintf(stderr, "cca: closing a CUDA IPC handle: %s: %s\n", cca_status_str(st),
                     cca_last_error()->message);
    auto it = t.open.find(handle);
    if (it != t.open.end() && it->second.expired())
        t.open.erase(it);
}

/*
 * _snapshot()["allocator_settings"]: PyTorch's AllocatorConfigInfo leaves its
 * fields uninitialised, so each is set here from cca's settings in force (its
 * field names have changed between versions: each is set only where the
 * installed torch has it).
 */
#define CCA_CONFIG_SETTER(field)                                                                   \
    template <typename Info, typename Value>                                                       \
    auto set_##field(Info &info, const Value &v, int)->decltype(info.field = v, void())            \
    {                                                                                              \
        info.field = v;                                                                            \
    }                                                                                              \
    template <typename Info, typename Value> void set_##field(Info &, const Value &, long) {}
CCA_CONFIG_SETTER(garbage_collection_threshold)
CCA_CONFIG_SETTER(max_split_size)
CCA_CONFIG_SETTER(pinned_num_register_threads)
CCA_CONFIG_SETTER(expandable_segments)
CCA_CONFIG_SETTER(release_lock_on_malloc)
CCA_CONFIG_SETTER(pinned_use_host_register)
CCA_CONFIG_SETTER(graph_capture_record_stream_reuse)
CCA_CONFIG_SETTER(last_allocator_settings)
CCA_CONFIG_SETTER(roundup_power2_divisions)
#undef CCA_CONFIG_SETTER

/* cca's settings in force ("key value (source)" lines of cca_settings_current) by key. */
std::unordered_map<std::string, std::string> current_settings()
{
    std::unordered_map<std::string, std::string> out;
    char *text = nullptr;
    if (cca_settings_current(&text) != CCA_OK)
        return out;
    const char *line = text;
    while (*line) {
        const char *end = std::strchr(line, '\n');
        std::string l(line, end ? static_cast<size_t>(end - line) : std::strlen(line));
        size_t space = l.find(' '), paren = l.rfind(" (");
        if (space != std::string::npos && paren != std::string::npos && paren > space)
            out[l.substr(0, space)] = l.substr(space + 1, paren - space - 1);
        if (!end)
            break;
        line = end + 1;
    }
    std::free(text);
    return out;
}

/*
 * The settings cca starts with are read when PyTorch initialises its allocator
 * (init(device_count), or a first use before it), as PyTorch reads its own
 * then: a program may set PYTORCH_ALLOC_CONF after install() and before its
 * first CUDA call. install()'s explicit string wins (the caller applied it);
 * else CCA_ALLOC_CONF when not empty (cca_init reads it); else PyTorch
 * 2.11's variables: PYTORCH_CUDA_ALLOC_CONF where set (even empty), else
 * PYTORCH_ALLOC_CONF.
 */
std::atomic<bool> settings_explicit{false};

struct StartupSettings {
    std::string variable; /* the variable read ("" when none) */
    std::string raw;      /* its value, as written (snapshots report it) */
    std::string text;     /* what cca applies of PyTorch's ("": cca reads CCA_ALLOC_CONF itself) */
};

/* text split at its top-level commas (commas inside [...] do not end a setting). */
std::vector<std::string> split_settings(const std::string &text)
{
    std::vector<std::string> parts;
    int depth = 0;
    size_t start = 0;
    for (size_t i = 0; i <= text.size(); i++) {
        char c = i < text.size() ? text[i] : ',';
        if (c == '[')
            depth++;
        else if (c == ']')
            depth = depth > 0 ? depth - 1 : 0;
        else if (c == ',' && depth == 0) {
            parts.push_back(text.substr(start, i - start));
            start = i + 1;
        }
    }
    return parts;
}

/* s without its whitespace (PyTorch's tokenizer drops it). */
std::string squeeze(const std::string &s)
{
    std::string out;
    for (char c : s)
        if (c != ' ' && c != '\t' && c != '\n' && c != '\r')
            out += c;
    return out;
}

/* The key of one "key:value" setting, and its value. */
std::string setting_key(const std::string &part) { return squeeze(part.substr(0, part.find(':'))); }
std::string setting_value(const std::string &part)
{
    size_t colon = part.find(':');
    return colon == std::string::npos ? std::string() : squeeze(part.substr(colon + 1));
}

/*
 * Under backend:cudaMallocAsync PyTorch never reads its native allocator's
 * keys, so a value it would refuse there goes unnoticed (its own test sets
 * release_lock_on_cudamalloc:none). cca keeps each setting it accepts alone and
 * leaves the others out, with a warning naming them.
 */
std::string async_settings(const std::string &text)
{
    std::vector<std::string> parts = split_settings(text);
    bool async = false;
    for (const std::string &p : parts)
        if (setting_key(p) == "backend")
            async = setting_value(p) == "cudaMallocAsync";
    if (!async)
        return text;
    std::string kept, dropped;
    for (const std::string &p : parts) {
        if (squeeze(p).empty())
            continue;
        char *described = nullptr;
        if (cca_settings_describe(p.c_str(), &described) == CCA_OK) {
            kept += (kept.empty() ? "" : ",") + p;
            std::free(described);
        } else {
            dropped += (dropped.empty() ? "" : ",") + p;
        }
    }
    if (!dropped.empty())
        TORCH_WARN("cca: backend:cudaMallocAsync does not read ", dropped, ": left out");
    return kept;
}

/* The settings of PyTorch's variables cca starts with (text empty: cca reads its own). */
StartupSettings startup_settings()
{
    StartupSettings out;
    if (settings_explicit.load())
        return out;
    const char *own = std::getenv("CCA_ALLOC_CONF");
    if (own && *own) { /* cca_init reads it */
        out.variable = "CCA_ALLOC_CONF";
        out.raw = own;
        return out;
    }
    for (const char *name : {"PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"}) {
        const char *value = std::getenv(name);
        if (value) {
            out.variable = name;
            out.raw = value;
            out.text = async_settings(value);
            break;
        }
    }
    return out;
}

/*
 * Start cca with startup_settings() (CCA_ALLOC_CONF holds them while cca_init
 * reads them, and is then restored), unless cca runs already. A bad setting
 * raises naming PyTorch's variable. per_process_memory_fraction:0 is a limit of
 * 0 bytes in PyTorch (cca's own 0 means none): the limit is set so.
 */
std::mutex start_lock;
std::vector<std::string> deferred_settings; /* run-time strings given before cca started (start_lock) */

void apply_deferred_settings()
{
    std::vector<std::string> pending;
    pending.swap(deferred_settings);
    for (const std::string &text : pending)
        check(cca_set_settings(text.c_str()), "_set_allocator_settings");
}

void start_cca()
{
    std::lock_guard<std::mutex> g(start_lock);
    if (cca_is_initialized())
        return;
    StartupSettings s = startup_settings();
    if (s.text.empty()) {
        check(cca_init(), "init");
        apply_deferred_settings();
        return;
    }
    char *described = nullptr;
    cca_status_t st = cca_settings_describe(s.text.c_str(), &described);
    if (st != CCA_OK)
        TORCH_CHECK_VALUE(false, "cca: ", s.variable, "=", s.raw, ": ", cca_last_error()->message);
    std::free(described);
    const char *own = std::getenv("CCA_ALLOC_CONF"); /* unset or empty here */
    bool was_set = own != nullptr;
    setenv("CCA_ALLOC_CONF", s.text.c_str(), 1);
    st = cca_init();
    if (was_set)
        setenv("CCA_ALLOC_CONF", "", 1);
    else
        unsetenv("CCA_ALLOC_CONF");
    check(st, "init");
    bool zero_fraction = false;
    for (const std::string &p : split_settings(s.text))
        if (setting_key(p) == "per_process_memory_fraction")
            zero_fraction = std::strtod(setting_value(p).c_str(), nullptr) == 0.0;
    int devices = 0;
    if (zero_fraction && cca_device_count(&devices) == CCA_OK)
        for (int d = 0; d < devices; d++)
            check(cca_set_memory_fraction(0.0, d), "init");
    apply_deferred_settings();
}

/* A run-time settings string given before cca started: applied once it starts, after the
 * settings it starts with (at once when it runs already). */
void defer_settings(const std::string &text)
{
    std::lock_guard<std::mutex> g(start_lock);
    if (cca_is_initialized())
        check(cca_set_settings(text.c_str()), "_set_allocator_settings");
    else
        deferred_settings.push_back(text);
}

/*
 * roundup_power2_divisions as cca prints it: "[]" (none), one value for every
 * interval, or a list "[a:x,b:y,>:z]" where each entry covers the intervals up
 * to its own (interval a in MiB is index log2(a)) and '>' the rest. PyTorch
 * keeps one number per interval (16).
 */
std::vector<size_t> parse_roundup(const std::string &text, size_t intervals)
{
    std::vector<size_t> out(intervals, 0);
    if (text.empty() || text == "[]")
        return out;
    if (text[0] != '[') {
        std::fill(out.begin(), out.end(), static_cast<size_t>(std::strtoull(text.c_str(), nullptr, 10)));
        return out;
    }
    size_t next = 0, pos = 1;
    while (pos < text.size() && next < intervals) {
        size_t comma = text.find_first_of(",]", pos);
        std::string entry = text.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
        size_t colon = entry.find(':');
        if (colon == std::string::npos)
            break;
        size_t value = static_cast<size_t>(std::strtoull(entry.c_str() + colon + 1, nullptr, 10));
        size_t last = intervals - 1;
        if (entry.compare(0, colon, ">") != 0) {
            unsigned long long mib = std::strtoull(entry.c_str(), nullptr, 10);
            size_t index = 0;
            while (mib > 1 && index < intervals - 1) {
                mib >>= 1;
                index++;
            }
            last = index;
        }
        for (; next <= last && next < intervals; next++)
            out[next] = value;
        if (comma == std::string::npos || text[comma] == ']')
            break;
        pos = comma + 1;
    }
    return out;
}

/* A private pool's checkpoint, owned by PyTorch's cudagraph trees. */
struct PoolState final : cc::AllocatorState {
    explicit PoolState(cca_pool_state_t *s) : state(s) {}
    ~PoolState() override { cca_pool_state_free(state); }
    cca_pool_state_t *state;
};

class CcaAllocator final : public cc::CUDAAllocator {
  public:
    c10::DataPtr allocate(size_t size) override
    {
        c10::DeviceIndex device = c10::cuda::current_device();
        if (C10_UNLIKELY(uncached())) {
            void *p = uncached_alloc(size);
            return {p, p, &uncached_delete, c10::Device(c10::DeviceType::CUDA, device)};
        }
        void *ptr = malloc_on(size, device, c10::cuda::getCurrentCUDAStream(device).stream(), "allocate");
        return {ptr, ptr, &delete_block, c10::Device(c10::DeviceType::CUDA, device)};
    }
    c10::DeleterFnPtr raw_deleter() const override { return uncached() ? &uncached_delete : &delete_block; }
    void copy_data(void *dest, const void *src, std::size_t count) const override
    {
        C10_CUDA_CHECK(cudaMemcpy(dest, src, count, cudaMemcpyDeviceToDevice));
    }

    void *raw_alloc(size_t nbytes) override
    {
        c10::DeviceIndex device = c10::cuda::current_device();
        return raw_alloc_on(nbytes, device, c10::cuda::getCurrentCUDAStream(device).stream());
    }
    void *raw_alloc_with_stream(size_t nbytes, cudaStream_t stream) override
    {
        return raw_alloc_on(nbytes, c10::cuda::current_device(), stream);
    }
    void raw_delete(void *ptr) override
    {
        if (take_uncached(ptr)) { /* made while caching was off, whatever the mode is now */
            gpu_trace_deallocation(ptr);
            C10_CUDA_CHECK(cudaFree(ptr));
            return;
        }
        check(free_block(ptr), "raw_delete");
    }

    void init(int device_count) override
    {
        (void)device_count;
        start_cca();
        {
            std::lock_guard<std::mutex> g(settings_lock_);
            if (settings_.empty() && !settings_explicit.load()) /* PyTorch reports its variable's */
                settings_ = startup_settings().raw;
        }
        check(cca_register_free_memory_callback(&run_free_memory_callbacks, nullptr), "init");
        attach_oom_forwarder(false);
        async_ = setting_is("backend cudaMallocAsync");
        initialized_ = true;
    }
    bool initialized() override { return initialized_; }
    double getMemoryFraction(c10::DeviceIndex device) override
    {
        double f = 1.0;
        check(cca_get_memory_fraction(device, &f), "getMemoryFraction");
        return f;
    }
    void setMemoryFraction(double fraction, c10::DeviceIndex device) override
    {
        check(cca_set_memory_fraction(fraction, device), "setMemoryFraction");
    }
    /*
     * PyTorch's answer: one entry per expandable segment (cca's reservation of a stream, pool
     * kind and private pool), with the bytes mapped in it, leaving out the segments of the
     * null stream (PyTorch skips a segment whose stream is 0: its default stream's). From a
     * snapshot (mapped ranges, in address order), which, like PyTorch's own snapshots, adds
     * a snapshot entry to the history when history is recorded.
     */
    std::vector<cc::StreamSegmentSize> getExpandableSegmentSizes(c10::DeviceIndex device) override
    {
        cca_snapshot_t *raw = nullptr;
        check(cca_snapshot(&raw), "getExpandableSegmentSizes");
        std::unique_ptr<cca_snapshot_t, void (*)(cca_snapshot_t *)> snap(raw, &cca_snapshot_free);
        std::vector<cc::StreamSegmentSize> out;
        std::vector<const cca_segment_info_t *> keys; /* the first range of each entry */
        for (size_t i = 0; i < snap->segment_count; i++) {
            const cca_segment_info_t &seg = snap->segments[i];
            if (seg.device != device || !seg.is_expandable || !seg.stream)
                continue;
            size_t j = 0;
            while (j < keys.size() &&
                   !(keys[j]->stream == seg.stream && keys[j]->is_large == seg.is_large &&
                     keys[j]->owner_private_pool_id[0] == seg.owner_private_pool_id[0] &&
                     keys[j]->owner_private_pool_id[1] == seg.owner_private_pool_id[1]))
                j++;
            if (j == keys.size()) {
                keys.push_back(&seg);
                out.emplace_back(reinterpret_cast<cudaStream_t>(seg.stream), !seg.is_large, 0);
            }
            out[j].total_size += seg.total_size;
        }
        return out;
    }
    /* torch.cuda.caching_allocator_enable: off, every allocation is uncached (as PyTorch's) */
    void enable(bool value) override { enabled_.store(value, std::memory_order_relaxed); }
    bool isEnabled() const override { return enabled_.load(std::memory_order_relaxed); }
    void emptyCache(c10::cuda::MempoolId_t mempool_id) override
    {
        if (mempool_id.first == 0 && mempool_id.second == 0)
            check(cca_empty_cache(), "emptyCache");
        else
            check(cca_empty_cache_pool(to_pool(mempool_id)), "emptyCache");
    }
    void cacheInfo(c10::DeviceIndex device, size_t *largest) override
    {
        check(cca_cache_info_largest(device, largest), "cacheInfo"); /* PyTorch: 0 in starts from free memory */
    }
    void *getBaseAllocation(void *ptr, size_t *size) override
    {
        void *base = nullptr;
        check(cca_get_base_allocation(ptr, &base, size), "getBaseAllocation");
        return base;
    }
    void recordStream(const c10::DataPtr &ptr, c10::cuda::CUDAStream stream) override
    {
        /* empty tensors have no block; memory cca did not hand out is not its business */
        if (!ptr.get() || ptr.get_deleter() != &delete_block)
            return;
        check(cca_record_stream(ptr.get(), reinterpret_cast<cca_stream_t>(stream.stream())), "recordStream");
    }
    c10::CachingDeviceAllocator::DeviceStats getDeviceStats(c10::DeviceIndex device) override
    {
        cca_device_stats_t s;
        check(cca_get_device_stats(device, &s), "getDeviceStats");
        c10::CachingDeviceAllocator::DeviceStats out;
        fill_stats(out.allocation, s.allocation);
        fill_stats(out.segment, s.segment);
        fill_stats(out.active, s.active);
        fill_stats(out.inactive_split, s.inactive_split);
        fill_stats(out.allocated_bytes, s.allocated_bytes);
        fill_stats(out.reserved_bytes, s.reserved_bytes);
        fill_stats(out.active_bytes, s.active_bytes);
        fill_stats(out.inactive_split_bytes, s.inactive_split_bytes);
        fill_stats(out.requested_bytes, s.requested_bytes);
        out.num_alloc_retries = s.num_alloc_retries;
        out.num_ooms = s.num_ooms;
        out.num_sync_all_streams = s.num_sync_all_streams;
        out.num_device_alloc = s.num_device_alloc;
        out.num_device_free = s.num_device_free;
        fill_stat(out.oversize_allocations, s.oversize_allocations);
        fill_stat(out.oversize_segments, s.oversize_segments);
        out.max_split_size = s.max_split_size;
        return out;
    }
    void resetAccumulatedStats(c10::DeviceIndex device) override
    {
        check(cca_reset_accumulated_stats(device), "resetAccumulatedStats");
    }
    void resetPeakStats(c10::DeviceIndex device) override { check(cca_reset_peak_stats(device), "resetPeakStats"); }

    /*
     * As PyTorch's: the history is read before the segments are walked, so the
     * snapshot entry this call records shows in the next snapshot's history,
     * not in its own (a C++ snapshot's last entry is the program's last action).
     */
    cc::SnapshotInfo snapshot(c10::cuda::MempoolId_t mempool_id, bool include_traces) override
    {
        cc::SnapshotInfo out;
        cca_trace_entry_t *list = nullptr;
        size_t count = 0;
        if (include_traces)
            check(cca_history_get(&list, &count), "snapshot");
        std::unique_ptr<cca_trace_entry_t, void (*)(cca_trace_entry_t *)> entries(list, &cca_history_free);
        cca_snapshot_t *raw = nullptr;
        check(cca_snapshot(&raw), "snapshot");
        std::unique_ptr<cca_snapshot_t, void (*)(cca_snapshot_t *)> snap(raw, &cca_snapshot_free);
        for (size_t i = 0; i < snap->segment_count; i++) {
            const cca_segment_info_t &s = snap->segments[i];
            c10::cuda::MempoolId_t owner{s.owner_private_pool_id[0], s.owner_private_pool_id[1]};
            if ((mempool_id.first || mempool_id.second) && owner != mempool_id)
                continue;
            cc::SegmentInfo si;
            si.device = static_cast<c10::DeviceIndex>(s.device);
            si.address = static_cast<size_t>(s.address);
            si.total_size = s.total_size;
            si.requested_size = s.requested_size;
            si.allocated_size = s.allocated_size;
            si.active_size = s.active_size;
            si.stream = reinterpret_cast<cudaStream_t>(s.stream);
            si.is_large = s.is_large;
            si.is_expandable = s.is_expandable;
            si.owner_private_pool_id = owner;
            si.context_when_allocated = find_context(s.context); /* the segment's creation */
            for (size_t b = 0; b < s.block_count; b++) {
                const cca_block_info_t &blk = s.blocks[b];
                cc::BlockInfo bi;
                bi.size = blk.size;
                bi.requested_size = blk.requested_size;
                bi.allocated = blk.state == CCA_BLOCK_ACTIVE_ALLOCATED;
                bi.active = blk.state != CCA_BLOCK_INACTIVE;
                bi.context_when_allocated = find_context(blk.context);
                si.blocks.push_back(std::move(bi));
            }
            out.segments.push_back(std::move(si));
        }
        snap.reset();

        int devices = 0;
        check(cca_device_count(&devices), "snapshot");
        out.device_traces.resize(devices);
        fill_config(out.config_metadata, devices);
        if (!include_traces)
            return out;
        for (size_t i = 0; i < count; i++) {
            const cca_trace_entry_t &e = list[i];
            cc::TraceEntry::Action action;
            if (e.device < 0 || e.device >= devices)
                continue;
            if (e.action == CCA_TRACE_USER_DEFINED) { /* record_function's, torch's own list */
                out.external_annotations.push_back(to_annotation(e));
                continue;
            }
            if (!to_action(e.action, &action))
                continue;
            if (skip_[e.action])
                continue;
            out.device_traces[e.device].push_back(to_entry(e, action, find_context(e.context)));
        }
        return out;
    }

    void beginAllocateToPool(c10::DeviceIndex device, c10::cuda::MempoolId_t id, StreamFilter filter) override
    {
        auto fn = std::make_unique<StreamFilter>(std::move(filter));
        std::lock_guard<std::mutex> g(filters_lock_);
        check(cca_begin_allocate_to_pool(device, to_pool(id), &run_filter, fn.get()), "beginAllocateToPool");
        filters_[{device, id}] = std::move(fn); /* lives until the route ends */
    }
    void endAllocateToPool(c10::DeviceIndex device, c10::cuda::MempoolId_t id) override
    {
        std::lock_guard<std::mutex> g(filters_lock_);
        check(cca_end_allocate_to_pool(device, to_pool(id)), "endAllocateToPool");
        filters_.erase({device, id});
    }
    void releasePool(c10::DeviceIndex device, c10::cuda::MempoolId_t id) override
    {
        check(cca_release_pool(device, to_pool(id)), "releasePool");
    }
    int getPoolUseCount(c10::DeviceIndex device, c10::cuda::MempoolId_t id) override
    {
        int count = 0;
        check(cca_pool_use_count(device, to_pool(id), &count), "getPoolUseCount");
        return count;
    }
    void createOrIncrefPool(c10::DeviceIndex device, c10::cuda::MempoolId_t id,
                            std::shared_ptr<cc::CUDAAllocator> allocator) override
    {
        int count = 0;
        bool exists = cca_pool_use_count(device, to_pool(id), &count) == CCA_OK;
        check(cca_pool_create(device, to_pool(id)), "createOrIncrefPool");
        if (exists || !allocator || allocator.get() == this)
            return;
        /* MemPool(allocator=...): a new pool's segments come from that allocator */
        std::lock_guard<std::mutex> g(filters_lock_);
        std::shared_ptr<cc::CUDAAllocator> &kept = pool_allocators_[{device, id}];
        kept = std::move(allocator); /* kept until shutdown: cca may call it while the pool holds memory */
        check(cca_pool_set_allocator(device, to_pool(id), &pool_alloc, &pool_free, kept.get()),
              "createOrIncrefPool");
    }
    void setUseOnOOM(c10::DeviceIndex device, c10::cuda::MempoolId_t id, bool use_on_oom) override
    {
        check(cca_pool_set_use_on_oom(device, to_pool(id), use_on_oom), "setUseOnOOM");
    }
    void setNoSplit(c10::DeviceIndex device, c10::cuda::MempoolId_t id) override
    {
        check(cca_pool_set_no_split(device, to_pool(id)), "setNoSplit");
    }
    bool checkPoolLiveAllocations(c10::DeviceIndex device, c10::cuda::MempoolId_t id,
                                  const std::unordered_set<void *> &expected) override
    {
        std::vector<void *> ptrs(expected.begin(), expected.end());
        bool matches = false;
        check(cca_pool_check_live_allocations(device, to_pool(id), ptrs.data(), ptrs.size(), &matches),
              "checkPoolLiveAllocations");
        return matches;
    }
    /*
     * torch.multiprocessing's CUDA tensors (StorageSharing: _share_cuda_ / _new_shared_cuda).
     * The handle is cca's serialized one (cca_ipc_get_handle_bytes: any length, so blocks of
     * expandable segments over any number of granules; a new handle, with its own reference,
     * on each call; the block's own address, so the offset is 0). PyTorch's reference-counter
     * file keeps the producer's DataPtr alive; cca's reference also holds the block until the
     * consumer closes it. Called under PyTorch's DeviceGuard of the storage's device.
     */
    cc::ShareableHandle shareIpcHandle(void *ptr) override
    {
        c10::DeviceIndex device = c10::cuda::current_device();
        size_t len = 0;
        check(cca_ipc_handle_size(ptr, &len), "shareIpcHandle");
        cc::ShareableHandle out;
        out.offset = 0;
        out.handle.resize(len);
        check(cca_ipc_get_handle_bytes(ptr, current_stream(device), &out.handle[0], len, &len),
              "shareIpcHandle");
        out.handle.resize(len);
        return out;
    }
    /* The consumer's side: opened once per handle while any storage holds it, as PyTorch caches. */
    std::shared_ptr<void> getIpcDevPtr(std::string handle) override
    {
        TORCH_CHECK(handle.size() >= CCA_IPC_HANDLE_SIZE, "cca: getIpcDevPtr: a handle of ", handle.size(),
                    " bytes is not cca's (", CCA_IPC_HANDLE_SIZE,
                    " or more): install cca in the producing process too");
        IpcTable &t = ipc_table();
        std::lock_guard<std::mutex> g(t.lock);
        auto it = t.open.find(handle);
        if (it != t.open.end()) {
            std::shared_ptr<void> live = it->second.lock();
            if (live)
                return live;
        }
        c10::DeviceIndex device = c10::cuda::current_device();
        void *ptr = nullptr;
        check(cca_ipc_open_bytes(handle.data(), handle.size(), current_stream(device), &ptr, nullptr),
              "getIpcDevPtr");
        std::shared_ptr<void> sp(ptr, [handle, device](void *p) { ipc_close(handle, device, p); });
        t.open[handle] = sp;
        return sp;
    }
    bool isHistoryEnabled() override { return cca_history_enabled(); }
    void recordHistory(bool enabled, cc::CreateContextFn recorder, size_t max_entries, cc::RecordContext when,
                       bool clear_history, const std::vector<std::string> &skip_actions) override
    {
        cca_record_context_t level = static_cast<cca_record_context_t>(static_cast<int>(when));
        if (!recorder)
            level = CCA_RECORD_CONTEXT_NEVER;
        {
            std::lock_guard<std::mutex> g(contexts.lock);
            contexts.recorder = enabled ? recorder : nullptr;
        }
        cca_set_context_release(&release_context, nullptr);
        for (int a = 0; a < CCA_TRACE_ACTION_COUNT; a++) {
            skip_[a] = false;
            for (const std::string &name : skip_actions)
                if (name == cca_trace_action_name(static_cast<cca_trace_action_t>(a)))
                    skip_[a] = true;
        }
        if (enabled && clear_history)
            check(cca_record_history(false, nullptr, nullptr, 0, CCA_RECORD_CONTEXT_NEVER), "recordHistory");
        check(cca_record_history(enabled, &gather_context, nullptr, max_entries, level), "recordHistory");
        std::vector<std::shared_ptr<c10::GatheredContext>> to_drop; /* what stopping or clearing let go */
        {
            std::lock_guard<std::mutex> g(contexts.lock);
            to_drop.swap(contexts.dropped);
        }
    }
    /* record_function scopes ({name, stage}), torch.compile's regions, and
     * torch.cuda.memory._set_memory_metadata, kept by cca's history. */
    void recordAnnotation(const std::vector<std::pair<std::string, std::string>> &md) override
    {
        std::vector<const char *> keys, values;
        for (const auto &kv : md) {
            keys.push_back(kv.first.c_str());
            values.push_back(kv.second.c_str());
        }
        check(cca_record_annotation_fields(keys.data(), values.data(), md.size()), "recordAnnotation");
    }
    void pushCompileContext(std::string &md) override
    {
        check(cca_push_compile_context(md.c_str()), "pushCompileContext");
    }
    void popCompileContext() override { check(cca_pop_compile_context(), "popCompileContext"); }
    void setUserMetadata(const std::string &metadata) override
    {
        check(cca_set_user_metadata(metadata.c_str()), "setUserMetadata");
    }
    std::string getUserMetadata() override
    {
        char *text = nullptr;
        check(cca_get_user_metadata(&text), "getUserMetadata");
        std::string out(text);
        std::free(text);
        return out;
    }
    void attachOutOfMemoryObserver(cc::OutOfMemoryObserver observer) override
    {
        attach_oom_forwarder(true); /* under backend:cudaMallocAsync: PyTorch's error */
        std::lock_guard<std::mutex> g(observer_lock);
        oom_observers.push_back(std::move(observer));
    }
    void attachAllocatorTraceTracker(cc::AllocatorTraceTracker tracker) override
    {
        bool first;
        {
            std::lock_guard<std::mutex> g(tracker_lock);
            trackers.push_back(std::move(tracker));
            first = trackers.size() == 1;
        }
        if (first)
            check(cca_attach_trace_tracker(&on_trace, nullptr), "attachAllocatorTraceTracker");
    }
    void enablePeerAccess(c10::DeviceIndex dev, c10::DeviceIndex dev_to_access) override
    {
        check(cca_enable_peer_access(dev, dev_to_access), "enablePeerAccess");
    }
    cudaError_t memcpyAsync(void *dst, int dst_device, const void *src, int src_device, size_t count,
                            cudaStream_t stream, bool p2p_enabled) override
    {
        /* cca's memory comes from cudaMalloc: plain copies work between devices with peer access */
        if (p2p_enabled || dst_device == src_device)
            return cudaMemcpyAsync(dst, src, count, cudaMemcpyDeviceToDevice, stream);
        cca_status_t st = cca_memcpy_peer_async(dst, dst_device, src, src_device, count,
                                                reinterpret_cast<cca_stream_t>(stream));
        if (st == CCA_OK)
            return cudaSuccess;
        long code = cca_last_error()->backend_code;
        return code ? static_cast<cudaError_t>(code) : cudaErrorInvalidValue;
    }
    std::shared_ptr<cc::AllocatorState> getCheckpointState(c10::DeviceIndex device, c10::cuda::MempoolId_t id) override
    {
        cca_pool_state_t *state = nullptr;
        check(cca_pool_get_checkpoint(device, to_pool(id), &state), "getCheckpointState");
        return std::make_shared<PoolState>(state);
    }
    cc::CheckpointDelta setCheckpointPoolState(c10::DeviceIndex device, std::shared_ptr<cc::AllocatorState> pps) override
    {
        auto *state = dynamic_cast<PoolState *>(pps.get());
        TORCH_CHECK(state, "cca: setCheckpointPoolState: the state was not made by cca");
        cca_checkpoint_delta_t delta{};
        check(cca_pool_set_checkpoint(device, state->state, &delta), "setCheckpointPoolState");
        cc::CheckpointDelta out;
        out.ptrs_freed.assign(delta.freed, delta.freed + delta.freed_count);
        for (size_t i = 0; i < delta.allocated_count; i++) /* the caller owns them now, as DataPtrs */
            out.dataptrs_allocd.emplace_back(delta.allocated[i], delta.allocated[i], &delete_block,
                                             c10::Device(c10::DeviceType::CUDA, device));
        cca_checkpoint_delta_free(&delta);
        return out;
    }
    /*
     * PyTorch's name of the backend cca runs: "native" (cca's caching allocator, PyTorch's
     * native one's behaviour) or "cudaMallocAsync". PyTorch checks it against a backend key
     * of its settings, its later versions keep features to "native" (a CUDA graph's
     * conditional nodes), and libraries branch on it (torch.cuda.get_allocator_backend());
     * cca.torch.installed() says that cca serves. Fixed once cca has started.
     */
    std::string name() override
    {
        if (initialized_)
            return async_ ? "cudaMallocAsync" : "native";
        return setting_is("backend cudaMallocAsync") ? "cudaMallocAsync" : "native";
    }

    /* PyTorch's AllocatorConfigInfo of a snapshot, every field from cca's settings in force. */
    template <typename Info> void fill_config(Info &md, int devices)
    {
        std::unordered_map<std::string, std::string> now = current_settings();
        auto flag = [&](const char *key) { return now[key] == "True"; };
        cca_device_stats_t stats;
        size_t max_split = std::numeric_limits<size_t>::max();
        if (devices > 0 && cca_get_device_stats(0, &stats) == CCA_OK)
            max_split = static_cast<size_t>(stats.max_split_size);
        set_max_split_size(md, max_split, 0);
        double gc_threshold = std::strtod(now["garbage_collection_threshold"].c_str(), nullptr);
        size_t register_threads = std::strtoull(now["pinned_num_register_threads"].c_str(), nullptr, 10);
        set_garbage_collection_threshold(md, gc_threshold, 0);
        set_pinned_num_register_threads(md, register_threads, 0);
        set_expandable_segments(md, flag("expandable_segments"), 0);
        set_release_lock_on_malloc(md, flag("release_lock_on_cudamalloc"), 0);
        set_pinned_use_host_register(md, flag("pinned_use_cuda_host_register"), 0);
        set_graph_capture_record_stream_reuse(md, flag("graph_capture_record_stream_reuse"), 0);
        {
            std::lock_guard<std::mutex> g(settings_lock_);
            set_last_allocator_settings(md, settings_, 0);
        }
        set_roundup_power2_divisions(md, parse_roundup(now["roundup_power2_divisions"], 16), 0);
    }
    /* The last settings string applied (install's, then each _set_allocator_settings'). */
    void note_settings(const std::string &text)
    {
        std::lock_guard<std::mutex> g(settings_lock_);
        settings_ = text;
    }

    std::string settings_;
    std::mutex settings_lock_;
    std::atomic<bool> force_uncached_{false}; /* PYTORCH_NO_CUDA_MEMORY_CACHING (install's) */

  private:
    static cca_stream_t current_stream(c10::DeviceIndex device)
    {
        return reinterpret_cast<cca_stream_t>(c10::cuda::getCurrentCUDAStream(device).stream());
    }
    /* Whether cca's settings (in force, else those it will start with) have the line
     * "KEY VALUE" (cca_settings_current's / cca_settings_describe's). */
    static bool setting_is(const char *key_value)
    {
        char *text = nullptr;
        cca_status_t st = cca_is_initialized() ? cca_settings_current(&text)
                                               : cca_settings_describe(startup_settings().text.c_str(), &text);
        if (st != CCA_OK)
            return false;
        bool on = std::strstr(text, key_value) != nullptr;
        std::free(text);
        return on;
    }
    void *raw_alloc_on(size_t nbytes, c10::DeviceIndex device, cudaStream_t stream)
    {
        if (C10_UNLIKELY(uncached()))
            return uncached_alloc(nbytes);
        return malloc_on(nbytes, device, stream, "raw_alloc");
    }
    /* cca's block, with PyTorch's trace and profiler reports. */
    static void *malloc_on(size_t nbytes, c10::DeviceIndex device, cudaStream_t stream, const char *what)
    {
        void *ptr = nullptr;
        if (nbytes == 0)
            return nullptr;
        if (C10_UNLIKELY(c10::memoryProfilingEnabled())) {
            int64_t before = allocated_now(device);
            check(cca_malloc_device(&ptr, nbytes, device, reinterpret_cast<cca_stream_t>(stream)), what);
            report_to_profiler(ptr, allocated_now(device) - before, device);
        } else {
            check(cca_malloc_device(&ptr, nbytes, device, reinterpret_cast<cca_stream_t>(stream)), what);
        }
        gpu_trace_allocation(ptr);
        return ptr;
    }
    bool uncached() const
    {
        return force_uncached_.load(std::memory_order_relaxed) || !enabled_.load(std::memory_order_relaxed);
    }
    /* PyTorch's own free-memory callbacks (e.g. CUDA IPC's reference counts). */
    static bool run_free_memory_callbacks(void *)
    {
        bool freed = false;
        for (const std::string &name : c10::FreeCudaMemoryCallbacksRegistry()->Keys())
            freed |= c10::FreeCudaMemoryCallbacksRegistry()->Create(name)->Execute();
        return freed;
    }

    struct PoolKeyHash {
        size_t operator()(const std::pair<int, c10::cuda::MempoolId_t> &k) const
        {
            return std::hash<unsigned long long>()(k.second.first * 31 + k.second.second) ^ (size_t)k.first;
        }
    };
    std::mutex filters_lock_;
    std::unordered_map<std::pair<int, c10::cuda::MempoolId_t>, std::unique_ptr<StreamFilter>, PoolKeyHash> filters_;
    std::unordered_map<std::pair<int, c10::cuda::MempoolId_t>, std::shared_ptr<cc::CUDAAllocator>, PoolKeyHash>
        pool_allocators_; /* MemPool(allocator=...) (filters_lock_) */
    bool initialized_ = false;
    bool async_ = false; /* cca runs backend:cudaMallocAsync (set at init) */
    bool oom_forwarded_ = false; /* (under attach_oom_forwarder's lock) */

    /* cca's OOM observer that forwards to PyTorch's, once. backend:cudaMallocAsync refuses
     * OOM observers, as PyTorch's does: init goes on without it (PyTorch's cudaMallocAsync
     * initialises without one), and a program's attach then raises PyTorch's message. */
    void attach_oom_forwarder(bool program_asked)
    {
        static std::mutex lock;
        std::lock_guard<std::mutex> g(lock);
        if (oom_forwarded_)
            return;
        cca_status_t st = cca_attach_oom_observer(&on_oom, nullptr);
        if (st == CCA_ERR_NOT_SUPPORTED && !program_asked)
            return;
        check(st, program_asked ? "attachOutOfMemoryObserver" : "init");
        oom_forwarded_ = true;
    }
    std::atomic<bool> enabled_{true};
    bool skip_[CCA_TRACE_ACTION_COUNT] = {};
};

std::shared_ptr<CcaAllocator> installed;

void delete_host_block(void *ptr)
{
    cca_status_t st = cca_host_free(ptr);
    if (st != CCA_OK) /* a deleter cannot throw: say it */
        std::fprintf(stderr, "cca: pinned free: %s: %s\n", cca_status_str(st), cca_last_error()->message);
}

template <typename Duration> void fill_duration(Duration &out, const cca_duration_stat_t &in)
{
    out.total = in.total;
    out.max = in.max;
    out.min = in.min;
    out.count = in.count;
}

template <typename Duration> void add_duration(Duration &out, const Duration &in)
{
    if (in.count && (!out.count || in.min < out.min))
        out.min = in.min;
    out.max = std::max(out.max, in.max);
    out.total += in.total;
    out.count += in.count;
}

template <typename Stat> void add_stat(Stat &out, const Stat &in)
{
    out.current += in.current;
    out.peak += in.peak; /* the two peaks may fall at different times: an upper bound, as PyTorch's buckets */
    out.allocated += in.allocated;
    out.freed += in.freed;
}

/*
 * cca's pinned host caching allocator as PyTorch's host allocator for CUDA:
 * pin_memory(), torch.empty(..., pin_memory=True), DataLoader's pinning,
 * the events non-blocking copies record (record_event), empty_cache and
 * torch.cuda.host_memory_stats. Blocks PyTorch's own allocator pinned before
 * (none in a program that installs first) stay its: record_event and
 * empty_cache reach it too.
 *
 * CUDA graph capture: PyTorch gives the pinned memory a captured stream
 * allocates to a private pool of the graph, kept until the graph goes (a
 * replay copies from the same host addresses). cca's host allocator has no
 * private pools, so those requests go to PyTorch's own allocator, which
 * keeps them in the graph's pool (begin_allocate_to_pool, end_allocate_to_pool
 * and release_pool are forwarded to it; the statistics add both).
 */
struct CcaHostAllocator final : public at::HostAllocator {
    at::HostAllocator *previous = nullptr;
    std::mutex captures_lock;
    std::vector<std::pair<c10::MempoolId_t, std::function<bool(c10::Stream)>>> captures;
    std::atomic<bool> capturing{false};

    /* Whether a capture underway takes the current stream's requests (PyTorch's filter). */
    bool captured_request()
    {
        if (!capturing.load(std::memory_order_relaxed))
            return false;
        c10::Stream stream = c10::cuda::getCurrentCUDAStream().unwrap();
        std::lock_guard<std::mutex> g(captures_lock);
        for (auto &c : captures)
            if (c.second(stream))
                return true;
        return false;
    }
    at::HostAllocator &pytorch(const char *what)
    {
        TORCH_CHECK(previous, "cca: ", what, ": PyTorch's pinned host allocator is not known");
        return *previous;
    }
    void begin_allocate_to_pool(c10::MempoolId_t id, std::function<bool(c10::Stream)> filter) override
    {
        pytorch("begin_allocate_to_pool").begin_allocate_to_pool(id, filter);
        std::lock_guard<std::mutex> g(captures_lock);
        captures.emplace_back(id, std::move(filter));
        capturing.store(true, std::memory_order_relaxed);
    }
    void end_allocate_to_pool(c10::MempoolId_t id) override
    {
        pytorch("end_allocate_to_pool").end_allocate_to_pool(id);
        std::lock_guard<std::mutex> g(captures_lock);
        for (auto it = captures.begin(); it != captures.end(); ++it)
            if (it->first == id) {
                captures.erase(it);
                break;
            }
        capturing.store(!captures.empty(), std::memory_order_relaxed);
    }
    void release_pool(c10::MempoolId_t id) override { pytorch("release_pool").release_pool(id); }

    at::DataPtr allocate(size_t size) override
    {
        if (previous && captured_request())
            return previous->allocate(size);
        void *ptr = nullptr;
        if (size != 0) {
            if (C10_UNLIKELY(!cca_is_initialized()))
                start_cca(); /* with the settings of PyTorch's variables, as the device side */
            check(cca_host_malloc(&ptr, size), "pinned allocate");
        }
        return {ptr, ptr, &delete_host_block, c10::Device(c10::DeviceType::CPU)};
    }
    c10::DeleterFnPtr raw_deleter() const override { return &delete_host_block; }
    void copy_data(void *dest, const void *src, std::size_t count) const override
    {
        std::memcpy(dest, src, count);
    }
    bool record_event(void *ptr, void *ctx, c10::Stream stream) override
    {
        if (stream.device_type() == c10::DeviceType::CUDA) {
            c10::cuda::CUDAGuard guard(stream.device_index()); /* the event on the stream's device */
            auto s = c10::cuda::CUDAStream(c10::cuda::CUDAStream::UNCHECKED, stream).stream();
            if (cca_host_record_event(ptr, reinterpret_cast<cca_stream_t>(s)) == CCA_OK)
                return true;
        }
        return previous && previous->record_event(ptr, ctx, stream);
    }
    void empty_cache() override
    {
        check(cca_host_empty_cache(), "pinned empty_cache");
        if (previous)
            previous->empty_cache();
    }
    at::HostStats get_stats() override
    {
        cca_host_stats_t s;
        check(cca_host_get_stats(&s), "host_memory_stats");
        at::HostStats out;
        fill_stat(out.allocations, s.allocations);
        fill_stat(out.allocated_bytes, s.allocated_bytes);
        fill_stat(out.active_requests, s.active_requests);
        fill_stat(out.active_bytes, s.active_bytes);
        out.num_host_alloc = s.num_host_alloc;
        out.num_host_free = s.num_host_free;
        fill_duration(out.host_alloc_time, s.host_alloc_time);
        fill_duration(out.host_free_time, s.host_free_time);
        if (previous) { /* the graphs' pinned memory (PyTorch's) */
            at::HostStats p = previous->get_stats();
            add_stat(out.allocations, p.allocations);
            add_stat(out.allocated_bytes, p.allocated_bytes);
            add_stat(out.active_requests, p.active_requests);
            add_stat(out.active_bytes, p.active_bytes);
            out.num_host_alloc += p.num_host_alloc;
            out.num_host_free += p.num_host_free;
            add_duration(out.host_alloc_time, p.host_alloc_time);
            add_duration(out.host_free_time, p.host_free_time);
        }
        return out;
    }
    void reset_accumulated_stats() override
    {
        check(cca_host_reset_accumulated_stats(), "reset_accumulated_host_memory_stats");
        if (previous)
            previous->reset_accumulated_stats();
    }
    void reset_peak_stats() override
    {
        check(cca_host_reset_peak_stats(), "reset_peak_host_memory_stats");
        if (previous)
            previous->reset_peak_stats();
    }
};

CcaHostAllocator host_allocator;

} // namespace

/*
 * Make cca PyTorch's CUDA allocator, as torch.cuda.memory.change_current_allocator
 * does: refused once PyTorch's allocator has been initialised (after the first
 * CUDA call). settings is the settings string cca runs with, as snapshots
 * report it (the caller applies it); NULL: cca reads its settings when
 * PyTorch initialises the allocator (startup_settings). Returns 0, or -1 with
 * the reason in err.
 */
extern "C" __attribute__((visibility("default"))) int cca_torch_adapter_install(const char *settings, char *err,
                                                                                size_t err_size)
{
    try {
        cc::CUDAAllocator *current = cc::get();
        if (current && current->initialized() && (!installed || current != installed.get())) {
            std::snprintf(err, err_size,
                          "PyTorch's CUDA allocator (%s) is already initialised: install cca before the "
                          "first CUDA call of the process",
                          current->name().c_str());
            return -1;
        }
        if (installed && current == installed.get())
            return 0;
        auto alloc = std::make_shared<CcaAllocator>();
        settings_explicit.store(settings != nullptr);
        if (settings)
            alloc->settings_ = settings;
        installed = alloc; /* kept for the life of the process */
        cc::allocator.store(installed.get());
        /* torch.accelerator's memory functions find the allocator through c10's table
         * (c10::getDeviceAllocator(kCUDA)): cca there too, above PyTorch's registration */
        c10::SetAllocator(c10::DeviceType::CUDA, installed.get(), std::numeric_limits<uint8_t>::max());
        return 0;
    } catch (const std::exception &e) {
        std::snprintf(err, err_size, "%s", e.what());
        return -1;
    }
}

/*
 * Make cca's pinned host allocator PyTorch's for CUDA (at a priority above
 * PyTorch's own registration). Returns 0, or -1 with the reason in err.
 */
extern "C" __attribute__((visibility("default"))) int cca_torch_adapter_install_pinned(char *err, size_t err_size)
{
    try {
        at::HostAllocator *current = at::getHostAllocator(at::kCUDA);
        if (current != &host_allocator) {
            host_allocator.previous = current;
            at::setHostAllocator(at::kCUDA, &host_allocator, 1);
        }
        if (at::getHostAllocator(at::kCUDA) != &host_allocator) {
            std::snprintf(err, err_size, "PyTorch kept its pinned host allocator (registered above priority 1)");
            return -1;
        }
        return 0;
    } catch (const std::exception &e) {
        std::snprintf(err, err_size, "%s", e.what());
        return -1;
    }
}

/*
 * The settings string a program applied at run time
 * (torch.cuda.memory._set_allocator_settings), which snapshots report as
 * PYTORCH_CUDA_ALLOC_CONF, as PyTorch's report its last one. Returns 0, or -1
 * when cca is not installed.
 */
extern "C" __attribute__((visibility("default"))) int cca_torch_adapter_note_settings(const char *text)
{
    if (!installed || !text)
        return -1;
    try {
        installed->note_settings(text);
        return 0;
    } catch (const std::exception &) {
        return -1;
    }
}

/*
 * A run-time settings string (torch.cuda.memory._set_allocator_settings,
 * validated by the caller) given before cca started: applied when it starts,
 * after the settings it starts with (at once when cca runs already). Returns
 * 0, or -1 with the reason in err.
 */
extern "C" __attribute__((visibility("default"))) int cca_torch_adapter_defer_settings(const char *text, char *err,
                                                                                       size_t err_size)
{
    try {
        if (!text)
            throw std::invalid_argument("settings text is NULL");
        defer_settings(text);
        return 0;
    } catch (const std::exception &e) {
        std::snprintf(err, err_size, "%s", e.what());
        return -1;
    }
}

/*
 * PYTORCH_NO_CUDA_MEMORY_CACHING, as install() reads it: every allocation
 * uncached (cudaMalloc / cudaFree on each call), as PyTorch's. Returns 0, or
 * -1 when cca is not installed.
 */
extern "C" __attribute__((visibility("default"))) int cca_torch_adapter_force_uncached(int on)
{
    if (!installed)
        return -1;
    installed->force_uncached_.store(on != 0, std::memory_order_relaxed);
    return 0;
}

/* The torch version the adapter was compiled against (to rebuild when it changes). */
extern "C" __attribute__((visibility("default"))) const char *cca_torch_adapter_abi(void)
{
    return TORCH_ADAPTER_TORCH_VERSION;
}

/*
 * For the benchmark and the GPU test, in any process (cca installed or not):
 * the time of n allocate + free pairs of size bytes through PyTorch's current
 * CUDAAllocator (kind 0: allocate() and the DataPtr's deleter, what a tensor
 * costs the allocator), straight through cca (kind 1: cca_malloc_device +
 * cca_free on the current stream), or through PyTorch's current pinned host
 * allocator for CUDA (kind 2: what a pinned tensor costs it). *ns gets
 * nanoseconds per pair. Returns 0, or -1 with the reason in err.
 */
extern "C" __attribute__((visibility("default"))) int cca_torch_adapter_time_pairs(size_t size, size_t n, int kind,
                                                                                   double *ns, char *err,
                                                                                   size_t err_size)
{
    try {
        cc::CUDAAllocator *alloc = cc::get();
        at::HostAllocator *host = at::getHostAllocator(at::kCUDA);
        c10::DeviceIndex device = c10::cuda::current_device();
        cca_stream_t stream = reinterpret_cast<cca_stream_t>(c10::cuda::getCurrentCUDAStream(device).stream());
        auto t0 = std::chrono::steady_clock::now();
        for (size_t i = 0; i < n; i++) {
            if (kind == 0) {
                c10::DataPtr p = alloc->allocate(size);
            } else if (kind == 2) {
                c10::DataPtr p = host->allocate(size);
            } else {
                void *p = nullptr;
                check(cca_malloc_device(&p, size, device, stream), "time_pairs");
                check(cca_free(p), "time_pairs");
            }
        }
        auto t1 = std::chrono::steady_clock::now();
        *ns = std::chrono::duration<double, std::nano>(t1 - t0).count() / static_cast<double>(n ? n : 1);
        return 0;
    } catch (const std::exception &e) {
        std::snprintf(err, err_size, "%s", e.what());
        return -1;
    }
}

/*
 * PyTorch's CUDAAllocator::getExpandableSegmentSizes(device) of the current
 * allocator (it has no Python binding): *count segments, *total bytes. Returns
 * 0, or -1 with the reason in err.
 */
extern "C" __attribute__((visibility("default"))) int cca_torch_adapter_expandable_sizes(int device, size_t *count,
                                                                                         size_t *total, char *err,
                                                                                         size_t err_size)
{
    try {
        std::vector<cc::StreamSegmentSize> sizes =
            cc::get()->getExpandableSegmentSizes(static_cast<c10::DeviceIndex>(device));
        *count = sizes.size();
        *total = 0;
        for (const cc::StreamSegmentSize &s : sizes)
            *total += s.total_size;
        return 0;
    } catch (const std::exception &e) {
        std::snprintf(err, err_size, "%s", e.what());
        return -1;
    }
}
