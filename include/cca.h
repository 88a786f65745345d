/*
 * cca.h - the public interface of cca, a stream-ordered caching allocator for
 * CUDA device memory and pinned host memory.
 *
 * This header includes no CUDA header: a stream is a `struct CUstream_st *`,
 * the same type as `cudaStream_t`, so CUDA programs pass their streams as is.
 *
 * Conventions: every fallible function returns a cca_status_t (CCA_OK == 0);
 * results come back through out-parameters, which are left untouched on
 * failure. The full text of the last failure of the calling thread is in
 * cca_last_error(). Unless a comment says otherwise every function is
 * thread-safe.
 */
#ifndef CCA_H
#define CCA_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define CCA_VERSION_MAJOR 0
#define CCA_VERSION_MINOR 1
#define CCA_VERSION_PATCH 0

/** A CUDA stream (the same type as cudaStream_t); NULL is the default stream. */
typedef struct CUstream_st *cca_stream_t;

/* ------------------------------------------------------------------------ */
/* Status codes and the last-error record                                   */
/* ------------------------------------------------------------------------ */

/** Status codes. Values are stable and never renumbered. */
typedef enum cca_status {
    CCA_OK = 0,
    CCA_ERR_INVALID_ARGUMENT = 1, /**< an argument is out of its domain */
    CCA_ERR_INVALID_POINTER = 2,  /**< a pointer cca did not hand out, or freed twice */
    CCA_ERR_OUT_OF_MEMORY = 3,    /**< the device (or the memory fraction) is exhausted */
    CCA_ERR_BACKEND = 4,          /**< the backend (CUDA) failed; raw code in cca_last_error() */
    CCA_ERR_NOT_SUPPORTED = 5,    /**< the operation is not available on this backend/mode */
    CCA_ERR_BAD_SETTINGS = 6,     /**< a settings string is malformed or out of range */
    CCA_ERR_NOT_INITIALIZED = 7,  /**< the library could not be initialised */
    CCA_ERR_NO_DEVICE = 8,        /**< no usable device (e.g. no GPU for the cuda backend) */
    CCA_ERR_NOT_READY = 9,        /**< an event has not completed yet (backend level) */
    CCA_ERR_IO = 10,              /**< a file could not be read or written */
    CCA_ERR_FORMAT = 11,          /**< a file is malformed or truncated */
    CCA_ERR_BUSY = 12,            /**< the call is not allowed in the current state */
    CCA_ERR_INTERNAL = 13,        /**< an internal invariant failed (a bug in cca) */
} cca_status_t;

/** The details of the last failure on the calling thread. */
typedef struct cca_error {
    cca_status_t status; /**< the status that was returned */
    char message[2048];  /**< human-readable text, complete sentences */
    const char *file;    /**< source file that raised it */
    int line;            /**< source line that raised it */
    long backend_code;   /**< raw backend (cudaError_t) code, 0 if none */
} cca_error_t;

/** Name of a status code, e.g. "CCA_ERR_OUT_OF_MEMORY". Never NULL. */
const char *cca_status_str(cca_status_t status);

/** The last error recorded on this thread (status CCA_OK if none). Never NULL. */
const cca_error_t *cca_last_error(void);

/** Forget the last error of this thread. */
void cca_clear_error(void);

/** Where the library's warnings and reports go (default: stderr). */
typedef void (*cca_output_fn)(const char *text, void *arg);

/** Replace the output sink; NULL restores stderr. Not thread-safe with output. */
void cca_register_output(cca_output_fn fn, void *arg);

/* ------------------------------------------------------------------------ */
/* Initialisation and backends                                              */
/* ------------------------------------------------------------------------ */

struct cca_backend; /* see cca_backend.h */

/**
 * Initialise cca from the environment: CCA_BACKEND (cuda | sim, default
 * cuda), CCA_SIM_DEVICES and CCA_SIM_MEMORY for the simulated backend,
 * CCA_ALLOC_CONF (settings) and CCA_NO_CACHING. Every other entry point calls
 * it on first use, so calling it is optional; a second call does nothing.
 * Returns CCA_OK, CCA_ERR_NO_DEVICE (no usable GPU: the message names
 * CCA_BACKEND=sim), CCA_ERR_BAD_SETTINGS, CCA_ERR_INVALID_ARGUMENT (bad
 * environment value), CCA_ERR_BACKEND.
 */
cca_status_t cca_init(void);

/**
 * Initialise cca on a given backend with a settings string (NULL: read
 * CCA_ALLOC_CONF). cca takes ownership of the backend whatever the call
 * returns: it destroys it at cca_shutdown(), or before returning an error
 * (so the caller never destroys it, and must not use it after a failure). The
 * one exception is the backend cca already runs on, given again: it is left
 * running. Returns CCA_OK, CCA_ERR_INVALID_ARGUMENT (NULL backend),
 * CCA_ERR_BUSY (cca is already initialised: call cca_shutdown first),
 * CCA_ERR_BAD_SETTINGS, CCA_ERR_NO_DEVICE, CCA_ERR_NOT_SUPPORTED,
 * CCA_ERR_OUT_OF_MEMORY, CCA_ERR_BACKEND. Thread-safe.
 */
cca_status_t cca_init_with_backend(struct cca_backend *backend, const char *settings);

/**
 * Free every cached block, release all state and the backend. Blocks still
 * allocated are given back to the backend too. Not thread-safe with any other
 * call. After it, cca can be initialised again.
 */
void cca_shutdown(void);

/** True once cca is initialised. */
bool cca_is_initialized(void);

/** Name of the active backend ("cuda", "sim", ...); NULL before initialisation. */
const char *cca_backend_name(void);

/** Number of devices of the backend. Returns CCA_OK or an init error. */
cca_status_t cca_device_count(int *count);

/** Current device of the calling thread (as cudaGetDevice / cudaSetDevice). */
cca_status_t cca_get_device(int *device);
cca_status_t cca_set_device(int device);

/* ------------------------------------------------------------------------ */
/* Settings                                                                 */
/* ------------------------------------------------------------------------ */

/**
 * Apply a settings string at run time (same syntax as PYTORCH_CUDA_ALLOC_CONF:
 * "key:value,key:value"), as PyTorch's _set_allocator_settings: the keys named
 * change, and max_split_size_mb, roundup_power2_divisions and
 * garbage_collection_threshold return to their defaults unless named (PyTorch
 * resets them before reading each string); every other key keeps its value. On
 * error nothing changes. Returns CCA_OK, CCA_ERR_BAD_SETTINGS (message names the offending
 * key:value and what is allowed), CCA_ERR_NOT_SUPPORTED (a key that can only
 * be set before initialisation, e.g. backend).
 */
cca_status_t cca_set_settings(const char *settings);

/**
 * Describe the settings that result from the defaults, then CCA_ALLOC_CONF,
 * then settings (may be NULL): one line per key with its effective value and
 * where it came from (default, environment, argument). Needs no
 * initialisation. *text is allocated with malloc; the caller frees it.
 * Returns CCA_OK, CCA_ERR_BAD_SETTINGS, CCA_ERR_INVALID_ARGUMENT,
 * CCA_ERR_OUT_OF_MEMORY.
 */
cca_status_t cca_settings_describe(const char *settings, char **text);

/**
 * The settings in force now, after initialisation and any cca_set_settings:
 * the same lines as cca_settings_describe (key, value, source), read under
 * the settings lock. Before initialisation, those cca_init would start with
 * (cca_settings_describe(NULL)). *text is allocated with malloc; the caller
 * frees it. Returns CCA_OK, CCA_ERR_INVALID_ARGUMENT (text NULL),
 * CCA_ERR_OUT_OF_MEMORY, CCA_ERR_BAD_SETTINGS (before initialisation, an
 * invalid CCA_ALLOC_CONF). Thread-safe.
 */
cca_status_t cca_settings_current(char **text);

/* ------------------------------------------------------------------------ */
/* The device caching allocator                                             */
/* ------------------------------------------------------------------------ */

/**
 * Allocate size bytes on the current device for use on stream. Size 0
 * succeeds with *ptr = NULL. Returns CCA_OK, CCA_ERR_INVALID_ARGUMENT (ptr
 * NULL), CCA_ERR_OUT_OF_MEMORY (message as PyTorch's; also for sizes >= 1 EB,
 * "Tried to allocate more than 1EB memory", as PyTorch), CCA_ERR_BACKEND, or
 * an initialisation error (see cca_init).
 */
cca_status_t cca_malloc(void **ptr, size_t size, cca_stream_t stream);

/** As cca_malloc on an explicit device. Adds CCA_ERR_INVALID_ARGUMENT for a bad device. */
cca_status_t cca_malloc_device(void **ptr, size_t size, int device, cca_stream_t stream);

/**
 * Free a pointer returned by cca_malloc. NULL is a no-op. The block becomes
 * reusable on its stream at once, or, if cca_record_stream() named other
 * streams, once the work queued on them at free time is done. Returns CCA_OK
 * or CCA_ERR_INVALID_POINTER (never allocated, inside a block, or freed twice).
 * CCA_ERR_BACKEND means the pointer WAS freed, but recording a stream's event
 * and then synchronizing that stream both failed (a broken CUDA context).
 */
cca_status_t cca_free(void *ptr);

/**
 * Mark the block holding ptr as used on stream, so that cca_free waits for
 * that stream's queued work before reuse. Returns CCA_OK,
 * CCA_ERR_INVALID_POINTER. Recording the allocation stream is a no-op.
 */
cca_status_t cca_record_stream(void *ptr, cca_stream_t stream);

/** Return every unused cached segment of every device to the backend. */
cca_status_t cca_empty_cache(void);

/** Total cached-free bytes and the largest cached free block of a device. */
cca_status_t cca_cache_info(int device, size_t *total_cached, size_t *largest_block);

/**
 * PyTorch's cacheInfo, with which cuDNN sizes its workspaces: *largest in and
 * out. On entry 0 asks for a first guess, the device's free memory (the
 * backend's mem_get_info, cudaMemGetInfo); any other value is the caller's own.
 * On return *largest is the larger of that and the largest cached free block
 * (any pool, private pools included). With backend:cudaMallocAsync, the
 * largest block found by trial allocation (cca_cache_info's). Returns CCA_OK,
 * CCA_ERR_INVALID_ARGUMENT (largest NULL, device out of range), or the
 * backend's mem_get_info error (*largest unchanged). Thread-safe.
 */
cca_status_t cca_cache_info_largest(int device, size_t *largest);

/** Base address and size of the segment holding ptr (any pointer inside a live block). */
cca_status_t cca_get_base_allocation(void *ptr, void **base, size_t *size);

/**
 * Limit this process to fraction (0..1] of the device's total memory.
 * Returns CCA_OK or CCA_ERR_INVALID_ARGUMENT (fraction outside [0,1], bad device).
 */
cca_status_t cca_set_memory_fraction(double fraction, int device);

/**
 * The memory fraction in force on a device (1.0 when none was set).
 * Returns CCA_OK or CCA_ERR_INVALID_ARGUMENT (fraction NULL, bad device).
 */
cca_status_t cca_get_memory_fraction(int device, double *fraction);

/** Free and total memory of a device, as cudaMemGetInfo. */
cca_status_t cca_mem_get_info(int device, size_t *free_bytes, size_t *total_bytes);

/**
 * A callback asked to free memory when an allocation would fail (e.g. a
 * framework dropping its own caches). Returns true if it freed anything.
 */
typedef bool (*cca_free_memory_callback_fn)(void *arg);

/** Register a free-memory callback; they run in registration order. */
cca_status_t cca_register_free_memory_callback(cca_free_memory_callback_fn fn, void *arg);

/** Called after an out-of-memory failure, outside cca's locks. */
typedef void (*cca_oom_observer_fn)(int device, size_t alloc_size, size_t device_total,
                                    size_t device_free, void *arg);

/** Register an OOM observer. */
cca_status_t cca_attach_oom_observer(cca_oom_observer_fn fn, void *arg);

/* ------------------------------------------------------------------------ */
/* Several devices: peer access                                             */
/* ------------------------------------------------------------------------ */

/**
 * Whether device can address peer's memory directly (cudaDeviceCanAccessPeer).
 * Returns CCA_OK, CCA_ERR_INVALID_ARGUMENT (bad device, can_access NULL),
 * CCA_ERR_BACKEND, or an init error.
 */
cca_status_t cca_can_access_peer(int device, int peer, bool *can_access);

/**
 * Let device access peer's memory, as PyTorch's enablePeerAccess(dev,
 * dev_to_access): cudaDeviceEnablePeerAccess from device (already enabled is
 * success), and device joins peer's list of accessing devices, so memory cca
 * maps for peer later (expandable segments, the cudaMallocAsync pool) is made
 * accessible to device too. Idempotent. Returns CCA_OK,
 * CCA_ERR_INVALID_ARGUMENT (a device out of range, device == peer),
 * CCA_ERR_NOT_SUPPORTED (the pair cannot access each other; nothing changed),
 * CCA_ERR_BACKEND, or an init error.
 */
cca_status_t cca_enable_peer_access(int device, int peer);

/**
 * The devices that enabled access to device's memory, ascending: up to cap
 * entries into peers (may be NULL when cap is 0); *count gets the total.
 * Returns CCA_OK, CCA_ERR_INVALID_ARGUMENT, or an init error.
 */
cca_status_t cca_peer_access_list(int device, int *peers, size_t cap, size_t *count);

/**
 * Copy size bytes from src (memory of src_device) to dst (memory of
 * dst_device) in the order of stream (cudaMemcpyPeerAsync). Returns CCA_OK,
 * CCA_ERR_INVALID_ARGUMENT, CCA_ERR_BACKEND, or an init error.
 */
cca_status_t cca_memcpy_peer_async(void *dst, int dst_device, const void *src, int src_device,
                                   size_t size, cca_stream_t stream);

/* ------------------------------------------------------------------------ */
/* Several processes: IPC                                                   */
/* ------------------------------------------------------------------------ */

/**
 * Bytes of an IPC handle in its fixed form (cca_ipc_mem_handle_t), and the
 * least a serialized handle takes (cca_ipc_get_handle_bytes).
 */
#define CCA_IPC_HANDLE_SIZE 224

/**
 * A handle to memory of another process, to be sent as bytes (a pipe, a
 * socket, a file). It names the segment holding the block (the backend's
 * handle of the segment) and the block's offset in it, as PyTorch shares
 * blocks, an interprocess event of the producer, and a reference counter in
 * shared memory of the producer. A block of an expandable segment is named by
 * its granules, one file descriptor each: the fixed form holds up to 16 of
 * them; the serialized form (cca_ipc_handle_size, cca_ipc_get_handle_bytes,
 * cca_ipc_open_bytes) holds any number. A fixed handle's bytes are the
 * serialized handle of its block.
 */
typedef struct cca_ipc_mem_handle {
    unsigned char bytes[CCA_IPC_HANDLE_SIZE];
} cca_ipc_mem_handle_t;

/**
 * Make a handle for the block at ptr (a pointer cca_malloc returned, still
 * allocated), as torch's shareIpcHandle / _share_cuda_. An interprocess event
 * is recorded on stream (where the producer wrote the data): the consumer's
 * stream waits for it in cca_ipc_open, as PyTorch's IPC event does. The handle carries one
 * reference: while it is not released by the process that opens it
 * (cca_ipc_close), cca_free of ptr in this process defers the free, so
 * neither the block nor its segment is reused or returned to the driver;
 * cca_ipc_collect (also run on the out-of-memory path) completes deferred
 * frees whose references are gone. Open each handle once, in one process;
 * for several consumers make one handle each. Returns CCA_OK,
 * CCA_ERR_INVALID_ARGUMENT (NULL), CCA_ERR_INVALID_POINTER (not a live
 * block, or inside one), CCA_ERR_NOT_SUPPORTED (a block of an expandable
 * segment that cannot be shared here, or that spans more than 16 granules:
 * the fixed form cannot name it, use cca_ipc_get_handle_bytes; the
 * cudaMallocAsync backend, or a backend without IPC; PyTorch's messages),
 * CCA_ERR_OUT_OF_MEMORY, CCA_ERR_BACKEND, or an init error. Nothing is
 * taken on error. Thread-safe.
 */
cca_status_t cca_ipc_get_handle(void *ptr, cca_stream_t stream, cca_ipc_mem_handle_t *handle);

/**
 * The length in bytes of the serialized handle of the block at ptr (as
 * cca_ipc_get_handle: a pointer cca_malloc returned, still allocated):
 * CCA_IPC_HANDLE_SIZE, plus 4 bytes per granule beyond 16 for a block of an
 * expandable segment. It does not change while the block lives. Takes no
 * reference. Returns CCA_OK, CCA_ERR_INVALID_ARGUMENT (NULL),
 * CCA_ERR_INVALID_POINTER, CCA_ERR_NOT_SUPPORTED (the cudaMallocAsync
 * backend), or an init error. Thread-safe.
 */
cca_status_t cca_ipc_handle_size(void *ptr, size_t *size);

/**
 * cca_ipc_get_handle into a buffer of the caller's, serialized, for a block
 * of any size (PyTorch's shareIpcHandle, whose handle of an expandable block
 * is a byte string of any length): buf gets the handle, *size its length
 * (cca_ipc_handle_size's). A buffer smaller than that (or NULL) gets
 * CCA_ERR_INVALID_ARGUMENT with *size set to the length needed, and nothing
 * is taken. Send the *size bytes as they are; open them with
 * cca_ipc_open_bytes. Returns as cca_ipc_get_handle (without the limit of 16
 * granules). Thread-safe.
 */
cca_status_t cca_ipc_get_handle_bytes(void *ptr, cca_stream_t stream, void *buf, size_t cap,
                                      size_t *size);

/**
 * Open a handle made by another process: *ptr gets the block's address in
 * this process and *size (may be NULL) its size. Work queued on stream after
 * this call waits for the producer's work recorded with the handle. Opening several blocks of
 * one segment maps the segment once (CUDA allows one mapping per process);
 * it is unmapped when the last of them is closed. Opens on the handle's
 * device index. Returns CCA_OK, CCA_ERR_INVALID_ARGUMENT (NULL, a corrupt
 * handle, a handle of this very process, or one already opened here),
 * CCA_ERR_NOT_SUPPORTED (the cudaMallocAsync backend, as PyTorch),
 * CCA_ERR_OUT_OF_MEMORY, CCA_ERR_BACKEND (e.g. the producer's memory is
 * gone), or an init error. Thread-safe.
 */
cca_status_t cca_ipc_open(const cca_ipc_mem_handle_t *handle, cca_stream_t stream, void **ptr,
                          size_t *size);

/**
 * cca_ipc_open of a serialized handle: the len bytes at handle, exactly as
 * cca_ipc_get_handle_bytes wrote them (a fixed handle's CCA_IPC_HANDLE_SIZE
 * bytes too). A truncated, padded or altered handle gets
 * CCA_ERR_INVALID_ARGUMENT and nothing is mapped. Returns as cca_ipc_open.
 * Thread-safe.
 */
cca_status_t cca_ipc_open_bytes(const void *handle, size_t len, cca_stream_t stream, void **ptr,
                                size_t *size);

/**
 * Close a pointer from cca_ipc_open, after the work using it is done (the
 * caller synchronizes): releases the handle's reference in the producer and
 * unmaps the segment after its last open block. Returns CCA_OK,
 * CCA_ERR_INVALID_POINTER (not open), CCA_ERR_BACKEND (the unmap failed; the
 * reference is still released). Thread-safe.
 */
cca_status_t cca_ipc_close(void *ptr);

/**
 * Release the reference of a handle that will not be opened (a send that
 * failed, a consumer that is gone): from the producer or any process, once.
 * A handle released already (by a release or a cca_ipc_close of its open), or
 * whose block's free has completed, is refused and nothing changes; a handle
 * released cannot be opened. Returns CCA_OK, CCA_ERR_INVALID_ARGUMENT (NULL,
 * a corrupt handle, or released already), CCA_ERR_BACKEND (the producer's
 * counters cannot be reached). Thread-safe.
 */
cca_status_t cca_ipc_release_handle(const cca_ipc_mem_handle_t *handle);
/** cca_ipc_release_handle of a serialized handle (len bytes at handle). Returns as it. */
cca_status_t cca_ipc_release_handle_bytes(const void *handle, size_t len);

/**
 * Complete the frees this process deferred because other processes held
 * references (torch.cuda.ipc_collect); *pending (may be NULL) gets the number
 * still waiting. Returns CCA_OK, or the first error of a completed free.
 */
cca_status_t cca_ipc_collect(size_t *pending);

/* ------------------------------------------------------------------------ */
/* Private pools: CUDA graph capture, MemPool, checkpoints                  */
/* ------------------------------------------------------------------------ */

/*
 * With backend:cudaMallocAsync there are no private pools: the calls below
 * that need one (create, set_use_on_oom, set_no_split, set_allocator,
 * use_count, check_live_allocations, get/set_checkpoint) return
 * CCA_ERR_NOT_SUPPORTED with PyTorch's message ("cudaMallocAsync does not yet
 * support createOrIncrefPool..."); routes are that backend's graph capture.
 */

/**
 * The id of a private pool, as PyTorch's MempoolId_t. (0, 0) names the
 * default pools and is never a private pool's id. By PyTorch's convention a
 * graph's own pool is (n, 0) and a pool the user made (MemPool,
 * graph_pool_handle()) is (0, n).
 */
typedef struct cca_mempool_id {
    uint64_t first;
    uint64_t second;
} cca_mempool_id_t;

/**
 * A new pool id, unique in this process: (n, 0) when user_created is false
 * (a graph's own pool), (0, n) when true (a MemPool). Ids PyTorch generates
 * may be used instead; cca never makes one up behind the caller's back.
 */
cca_mempool_id_t cca_mempool_id_new(bool user_created);

/**
 * Create the private pool id on device with a use count of 1, or, if it
 * exists, add one to its use count (PyTorch's createOrIncrefPool). A pool
 * holds its own cached blocks: allocations routed to it (below) never take
 * memory of the default pools or of other pools, and its memory returns to
 * the backend only after its use count falls to 0 (cca_release_pool) and its
 * blocks are free. Returns CCA_OK, CCA_ERR_INVALID_ARGUMENT (bad device, id
 * (0, 0)), CCA_ERR_BUSY (the pool was released to 0 and awaits freeing),
 * CCA_ERR_OUT_OF_MEMORY (host memory), or an init error.
 */
cca_status_t cca_pool_create(int device, cca_mempool_id_t id);

/**
 * MemPool's options. use_on_oom: when an allocation outside any private
 * pool would run out of memory, a free cached block of this pool may serve
 * it (before cached segments are released). no_split: blocks of this pool
 * are never split (each allocation takes a whole free block or segment).
 * Returns CCA_OK, CCA_ERR_INVALID_ARGUMENT (bad device, unknown id).
 */
cca_status_t cca_pool_set_use_on_oom(int device, cca_mempool_id_t id, bool use_on_oom);
cca_status_t cca_pool_set_no_split(int device, cca_mempool_id_t id);

/**
 * A private pool's own allocator (PyTorch's MemPool(allocator=...), e.g.
 * NCCL's ncclMemAlloc / ncclMemFree through a CUDAPluggableAllocator).
 * alloc returns size bytes of device memory on device for an allocation on
 * stream, or NULL when it has none: cca then goes on with the out-of-memory
 * sequence as for a failed cudaMalloc. free gives back a pointer alloc
 * returned, with the same size, device and stream, and returns CCA_OK; any
 * other status keeps the segment cached (the release reports
 * CCA_ERR_BACKEND) and a later release tries again. Both are called with the
 * device's lock held: they must not call cca.
 */
typedef void *(*cca_pool_alloc_fn)(size_t size, int device, cca_stream_t stream, void *ctx);
typedef cca_status_t (*cca_pool_free_fn)(void *ptr, size_t size, int device, cca_stream_t stream,
                                         void *ctx);

/**
 * Give the private pool id its own allocator: every segment of the pool is
 * then taken from alloc_fn and given back to free_fn (by cca_empty_cache,
 * cca_empty_cache_pool, the out-of-memory sequence, cca_shutdown), never
 * from the backend, and never as an expandable segment. Statistics count
 * these segments as any other (segment, reserved_bytes, num_device_alloc,
 * num_device_free). Both functions NULL: the backend again. ctx is passed
 * to both and must stay valid while the pool holds a segment.
 * Returns CCA_OK, CCA_ERR_INVALID_ARGUMENT (bad device, unknown id, (0, 0),
 * only one of the functions NULL), CCA_ERR_BUSY (the pool already holds
 * memory, or was released to a use count of 0), CCA_ERR_NOT_SUPPORTED
 * (backend:cudaMallocAsync); nothing changes when it fails.
 */
cca_status_t cca_pool_set_allocator(int device, cca_mempool_id_t id, cca_pool_alloc_fn alloc_fn,
                                    cca_pool_free_fn free_fn, void *ctx);

/** A routing filter: true if an allocation on stream goes to the pool. */
typedef bool (*cca_stream_filter_fn)(cca_stream_t stream, void *arg);

/**
 * Route allocations to the private pool id (created with a use count of 1
 * if it does not exist, else its use count grows by one, as PyTorch's
 * beginAllocateToPool): from now until cca_end_allocate_to_pool, every
 * allocation on device for which filter(stream, arg) is true goes to the
 * pool. With several routes active the oldest matching one wins (PyTorch's
 * order: a route begun later takes only what the older ones do not). filter is
 * called inside cca's device lock and must not call cca; arg must live until
 * the route ends. Three forms:
 *  - cca_begin_allocate_to_pool: any filter (PyTorch's graph capture filter
 *    compares the stream's capture id);
 *  - cca_begin_allocate_stream_to_pool: allocations on one stream (a graph
 *    capture on that stream);
 *  - cca_begin_allocate_thread_to_pool: allocations of the calling thread on
 *    any stream (torch.cuda.use_mem_pool).
 * While any route is active on a device, cca behaves as PyTorch during a
 * capture: no event is queried or synchronised, a freed block that was used
 * on other streams (cca_record_stream) is set aside until no route is active,
 * and the out-of-memory sequence does not release every cached block.
 * Returns CCA_OK, CCA_ERR_INVALID_ARGUMENT (bad device, id (0, 0), filter
 * NULL), CCA_ERR_BUSY (already routing to id, or id released to 0),
 * CCA_ERR_OUT_OF_MEMORY, or an init error. Nothing changes on error.
 * With backend:cudaMallocAsync (PyTorch's CudaMallocAsync): a graph capture
 * begins instead; id and filter are not used, the stream form's stream is the
 * capture stream; CCA_ERR_BUSY if a capture is underway (one at a time in the
 * process). See docs/multi-gpu.md.
 */
cca_status_t cca_begin_allocate_to_pool(int device, cca_mempool_id_t id, cca_stream_filter_fn filter,
                                        void *arg);
cca_status_t cca_begin_allocate_stream_to_pool(int device, cca_mempool_id_t id, cca_stream_t stream);
cca_status_t cca_begin_allocate_thread_to_pool(int device, cca_mempool_id_t id);

/**
 * Stop routing to id (PyTorch's endAllocateToPool; the use count is left
 * as it is). Returns CCA_OK, CCA_ERR_INVALID_ARGUMENT (bad device),
 * CCA_ERR_BUSY (no route to id is active). Nothing changes on error.
 * With backend:cudaMallocAsync: ends the capture, the capture stream waiting
 * for every stream a free was queued on during it; CCA_ERR_BUSY if none is
 * underway; CCA_ERR_BACKEND leaves it underway.
 */
cca_status_t cca_end_allocate_to_pool(int device, cca_mempool_id_t id);

/**
 * Take one from the use count of id (PyTorch's releasePool: a graph
 * destroyed, a MemPool deleted, the end of use_mem_pool). At 0 the pool's
 * segments become freeable: every cca_empty_cache (and cca_empty_cache_pool
 * of id) returns those whose blocks are all free, and the pool disappears
 * once it holds no segment. Returns CCA_OK, CCA_ERR_INVALID_ARGUMENT (bad
 * device, unknown id), CCA_ERR_BUSY (use count already 0: released twice;
 * or the last use while a route to it is active). Nothing changes on error.
 * With backend:cudaMallocAsync it does nothing (CCA_OK), as PyTorch's.
 */
cca_status_t cca_release_pool(int device, cca_mempool_id_t id);

/** The use count of id (PyTorch's getPoolUseCount). Returns CCA_OK, CCA_ERR_INVALID_ARGUMENT. */
cca_status_t cca_pool_use_count(int device, cca_mempool_id_t id, int *count);

/**
 * PyTorch's emptyCache(mempool_id) on every device: if id has been released
 * to 0, wait for its blocks' pending events and return its unused segments;
 * other pools are untouched. An id that is not freeable (or does not exist)
 * is a no-op, as in PyTorch. Returns CCA_OK, CCA_ERR_BACKEND, or an init error.
 */
cca_status_t cca_empty_cache_pool(cca_mempool_id_t id);

/**
 * PyTorch's checkPoolLiveAllocations: *matches is true when the blocks of id
 * allocated now are exactly the count pointers of ptrs. Returns CCA_OK,
 * CCA_ERR_INVALID_ARGUMENT (bad device, unknown id, matches NULL, ptrs NULL
 * with count > 0), CCA_ERR_OUT_OF_MEMORY.
 */
cca_status_t cca_pool_check_live_allocations(int device, cca_mempool_id_t id, void *const *ptrs,
                                             size_t count, bool *matches);

/** The state of a private pool's segments and blocks at one moment (opaque). */
typedef struct cca_pool_state cca_pool_state_t;

/**
 * Checkpoint the state of id (PyTorch's getCheckpointState): every segment
 * of the pool with its blocks' sizes, addresses, streams and whether they are
 * allocated. Frees set aside during a capture are completed first. Free the
 * state with cca_pool_state_free. Returns CCA_OK, CCA_ERR_INVALID_ARGUMENT
 * (bad device, unknown id, state NULL), CCA_ERR_BUSY (the pool was released
 * to 0, a route is active, or a block of it waits for stream events),
 * CCA_ERR_NOT_SUPPORTED (the pool holds expandable segments), CCA_ERR_OUT_OF_MEMORY.
 */
cca_status_t cca_pool_get_checkpoint(int device, cca_mempool_id_t id, cca_pool_state_t **state);
void cca_pool_state_free(cca_pool_state_t *state);

/** The pool a state belongs to, and how many segments it describes. */
cca_mempool_id_t cca_pool_state_id(const cca_pool_state_t *state);
size_t cca_pool_state_segments(const cca_pool_state_t *state);

/** What restoring a checkpoint changed (PyTorch's CheckpointDelta). */
typedef struct cca_checkpoint_delta {
    void **freed;            /**< pointers that were allocated and are no longer */
    size_t freed_count;
    void **allocated;        /**< pointers allocated in the checkpoint, allocated again now */
    size_t allocated_count;
} cca_checkpoint_delta_t;

/**
 * Return the pool to a checkpoint (PyTorch's setCheckpointPoolState, used
 * by cudagraph trees): every block of the pool allocated now is freed, then
 * the blocks allocated in the checkpoint are allocated again at their
 * addresses (the caller owns them, as if cca_malloc had returned them). Every
 * segment of the checkpoint must still belong to the pool with the same size:
 * that is checked first, and nothing changes if it fails. Free delta's lists
 * with cca_checkpoint_delta_free. Returns CCA_OK, CCA_ERR_INVALID_ARGUMENT
 * (bad device, NULL, a segment of the checkpoint no longer in the pool),
 * CCA_ERR_BUSY (as for cca_pool_get_checkpoint; also a block of the pool that
 * another process maps through IPC), CCA_ERR_OUT_OF_MEMORY.
 */
cca_status_t cca_pool_set_checkpoint(int device, const cca_pool_state_t *state,
                                     cca_checkpoint_delta_t *delta);
void cca_checkpoint_delta_free(cca_checkpoint_delta_t *delta);

/* ------------------------------------------------------------------------ */
/* Statistics                                                               */
/* ------------------------------------------------------------------------ */

/** One statistic: current value, peak, and accumulated increments/decrements. */
typedef struct cca_stat {
    int64_t current;
    int64_t peak;
    int64_t allocated;
    int64_t freed;
} cca_stat_t;

/** Pool breakdown of a statistic, as PyTorch's StatType. */
enum { CCA_STAT_ALL = 0, CCA_STAT_SMALL_POOL = 1, CCA_STAT_LARGE_POOL = 2, CCA_STAT_TYPES = 3 };

/** Per-device statistics (PyTorch's DeviceStats). */
typedef struct cca_device_stats {
    cca_stat_t allocation[CCA_STAT_TYPES];          /**< number of allocated blocks */
    cca_stat_t segment[CCA_STAT_TYPES];             /**< number of segments from the backend */
    cca_stat_t active[CCA_STAT_TYPES];              /**< number of active blocks */
    cca_stat_t inactive_split[CCA_STAT_TYPES];      /**< number of inactive split blocks */
    cca_stat_t allocated_bytes[CCA_STAT_TYPES];     /**< bytes in allocated blocks */
    cca_stat_t reserved_bytes[CCA_STAT_TYPES];      /**< bytes reserved from the backend */
    cca_stat_t active_bytes[CCA_STAT_TYPES];        /**< bytes in active blocks */
    cca_stat_t inactive_split_bytes[CCA_STAT_TYPES];/**< bytes in inactive split blocks */
    cca_stat_t requested_bytes[CCA_STAT_TYPES];     /**< bytes requested by callers */
    int64_t num_alloc_retries;   /**< backend malloc retries after freeing cache */
    int64_t num_ooms;            /**< out-of-memory failures */
    int64_t num_sync_all_streams;/**< synchronize_and_free_events calls */
    int64_t num_device_alloc;    /**< backend malloc calls */
    int64_t num_device_free;     /**< backend free calls */
    cca_stat_t oversize_allocations; /**< allocations >= max_split_size */
    cca_stat_t oversize_segments;    /**< segments >= max_split_size */
    int64_t max_split_size;      /**< bytes; the effective max_split_size */
} cca_device_stats_t;

/** Statistics of a device. */
cca_status_t cca_get_device_stats(int device, cca_device_stats_t *stats);

/** Reset accumulated (allocated/freed and counters) statistics of a device. */
cca_status_t cca_reset_accumulated_stats(int device);

/** Reset peak statistics of a device to their current values. */
cca_status_t cca_reset_peak_stats(int device);

/** One entry of the flat memory_stats list. */
typedef struct cca_stat_entry {
    const char *key; /**< PyTorch's key, e.g. "allocated_bytes.all.current" (static string) */
    int64_t value;
} cca_stat_entry_t;

/** Number of entries cca_memory_stats writes (PyTorch's 122 keys, sorted). */
#define CCA_MEMORY_STATS_COUNT 122

/**
 * The flat statistics of a device with exactly torch.cuda.memory_stats()'s
 * keys, sorted by key. out must hold CCA_MEMORY_STATS_COUNT entries.
 */
cca_status_t cca_memory_stats(int device, cca_stat_entry_t *out, size_t count);

/** Number of entries cca_memory_stats_extra writes. */
#define CCA_MEMORY_STATS_EXTRA_COUNT 10

/**
 * cca's own keys beside PyTorch's (not in torch.cuda.memory_stats()), sorted:
 * "cca.cached_free_bytes" (free memory the cache holds, all pools),
 * "cca.compact_aliased_bytes" (the part of the moved bytes a growth mapped
 * while its own stream's work on them was pending, see compact_memory),
 * "cca.compact_moved_bytes" and "cca.compact_moves" (bytes of free granules
 * re-mapped for a growth under compact_memory, and the growths that did it),
 * "cca.compact_pending_growths" (growths that mapped new memory because free
 * granules were left in place, their stream's work not yet known done by an
 * event; the growth path never waits for it), "cca.compact_plan_misses",
 * "cca.compact_planned_allocations" and "cca.compact_plans" (compact_memory's
 * planned placement of a loop that keeps moving granules: requests that did
 * not find their planned place, requests served at it, plans made),
 * "cca.compact_syncs" (times a
 * failed event call made the growth path synchronise the stream instead: 0
 * unless the backend fails), "cca.largest_free_bytes" (the largest free block: the biggest request the
 * cache could serve without a backend call). out must hold
 * CCA_MEMORY_STATS_EXTRA_COUNT entries.
 */
cca_status_t cca_memory_stats_extra(int device, cca_stat_entry_t *out, size_t count);

/**
 * The text of torch.cuda.memory_summary(device, abbreviated) for this
 * device's statistics, into a buffer cca allocates with malloc; the caller
 * frees it with free().
 */
cca_status_t cca_memory_summary(int device, bool abbreviated, char **text);

/* ------------------------------------------------------------------------ */
/* The pinned host caching allocator                                        */
/* ------------------------------------------------------------------------ */

/** Allocate size bytes of page-locked host memory. Size 0 gives NULL. */
cca_status_t cca_host_malloc(void **ptr, size_t size);

/** Free a pointer from cca_host_malloc (reused once its recorded events complete). */
cca_status_t cca_host_free(void *ptr);

/**
 * Record that the block holding ptr is used by work queued on stream. A use
 * while stream is being captured into a CUDA graph is a use by every replay:
 * the block is then kept when freed (never handed out again; given back at
 * cca_shutdown), as is a block freed while a stream it was used on is being
 * captured.
 */
cca_status_t cca_host_record_event(void *ptr, cca_stream_t stream);

/** Release every cached host block whose events have completed. */
cca_status_t cca_host_empty_cache(void);

/** A duration statistic in microseconds. */
typedef struct cca_duration_stat {
    int64_t total;
    int64_t max;
    int64_t min;
    int64_t count;
} cca_duration_stat_t;

/** Host allocator statistics, as PyTorch 2.11's HostStats. */
typedef struct cca_host_stats {
    cca_stat_t allocations;     /**< blocks held from the system (cached or in use) */
    cca_stat_t allocated_bytes; /**< bytes held from the system */
    cca_stat_t active_requests; /**< blocks in use by callers */
    cca_stat_t active_bytes;    /**< bytes in use by callers */
    int64_t num_host_alloc;     /**< system allocations (slow path) */
    int64_t num_host_free;      /**< system frees */
    cca_duration_stat_t host_alloc_time; /**< us per system allocation */
    cca_duration_stat_t host_free_time;  /**< us per system free */
} cca_host_stats_t;

cca_status_t cca_host_get_stats(cca_host_stats_t *stats);
cca_status_t cca_host_reset_accumulated_stats(void);
cca_status_t cca_host_reset_peak_stats(void);

/* ------------------------------------------------------------------------ */
/* GPU processes                                                            */
/* ------------------------------------------------------------------------ */

/**
 * The text of torch.cuda.list_gpu_processes(device): "GPU:<n>" then one line
 * per process using the device, "process <pid> uses <MB> MB GPU memory", or
 * "no processes are running". Uses NVML (libnvidia-ml.so.1, loaded at run
 * time); without it the text is "NVML not found, unable to list processes".
 * device is a CUDA ordinal, mapped to NVML's numbering through
 * CUDA_VISIBLE_DEVICES when that lists indices. Needs no initialisation.
 * *text is allocated with malloc; the caller frees it. Returns CCA_OK,
 * CCA_ERR_INVALID_ARGUMENT (text NULL, bad device), CCA_ERR_BACKEND (NVML
 * failed), CCA_ERR_OUT_OF_MEMORY. Thread-safe.
 */
cca_status_t cca_list_gpu_processes(int device, char **text);

#ifdef __cplusplus
}
#endif


/* ------------------------------------------------------------------------ */
/* Replaying PyTorch memory snapshots                                       */
/* ------------------------------------------------------------------------ */

#ifdef __cplusplus
extern "C" {
#endif

/** How to replay a trace. Zero-initialise, then set fields. */
typedef struct cca_replay_options {
    const char *settings;    /**< settings string; NULL: the trace's own settings */
    size_t cap;              /**< simulated device memory cap in bytes; 0: none */
    size_t total_memory;     /**< simulated device size; 0: the trace's (else 80 GiB) */
    bool trace_addresses;    /**< hand out the trace's segment addresses, compare every alloc */
    bool ignore_fraction;    /**< do not apply the trace's per-process memory fraction */
    int device;              /**< which device_traces entry to replay */
    const char *snapshot_path; /**< if set: dump a snapshot (with the replay's history) here at the end */
    const char *svg_path;    /**< if set: draw the end state and the replay's history here (SVG) */
    uint64_t event_lag;      /**< an event cca records on a trace's stream completes this many
                                  trace events later (a GPU running behind); 0: at once */
    bool sequential;         /**< read the whole file before replaying (no replay on a
                                  second thread while the file is read) */
    bool strict;             /**< stop at the first inconsistency of the input (CCA_ERR_FORMAT)
                                  instead of counting it */
    uint64_t first_event;    /**< replay from this event of the trace on, as if the recording
                                  had begun there (the state before it inferred) */
    uint64_t peaks_from_event; /**< reset the peak statistics before this event (0: from the start):
                                    peaks over the events from it on */
} cca_replay_options_t;

/** What a replay did, and what the trace says PyTorch did. */
typedef struct cca_replay_result {
    uint64_t events;             /**< trace events read */
    uint64_t allocs;             /**< alloc events replayed */
    uint64_t frees;              /**< frees replayed */
    uint64_t segment_allocs;     /**< backend allocations cca made */
    uint64_t segment_frees;      /**< backend frees cca made */
    uint64_t ooms;               /**< allocations that failed with out of memory */
    uint64_t pool_ops;           /**< private-pool operations applied (cca_meta.pool_events) */
    uint64_t address_mismatches; /**< allocs placed elsewhere than PyTorch (trace mode) */
    uint64_t unexpected_ooms;    /**< allocs PyTorch served that cca could not */
    int64_t peak_reserved_bytes;
    int64_t peak_allocated_bytes;
    int64_t peak_requested_bytes;
    int64_t peak_active_bytes;
    double seconds;              /**< replay time, without reading the file (overlapped:
                                      the replay thread's, its waits for the reader excluded) */
    double load_seconds;         /**< time to read and decode the file */
    double events_per_second;
    cca_stat_entry_t memory_stats[122]; /**< at the end of the replay */
    char *memory_summary;        /**< at the end (malloc'd) */
    char settings[1024];         /**< the settings string used */
    /* what the trace says PyTorch did (has_expected: the trace carried it) */
    bool has_expected;
    uint64_t expected_allocs, expected_segment_allocs, expected_segment_frees, expected_ooms;
    int64_t expected_peak_reserved_bytes;
    uint64_t stats_mismatches;   /**< memory_stats keys differing from the trace's final stats */
    char first_stats_mismatch[160]; /**< "key: cca X, trace Y" */
    bool summary_matches;        /**< summary equal to the trace's but for the title line */
    char first_address_mismatch[160];
    /* the second half of the trace's events: a steady loop makes no backend call there */
    uint64_t late_segment_allocs; /**< backend allocations (maps) in the second half */
    uint64_t late_segment_frees;  /**< backend frees (unmaps) in the second half */
    /* the last step of a trace that repeats: its last period of allocations (the shift at
     * which the last two thirds of the allocation sizes repeat best, 90% alike or more) */
    uint64_t step_allocations;    /**< allocations a step (the period); 0: no period found */
    uint64_t last_step_segment_allocs; /**< backend allocations (maps) in the last step */
    uint64_t last_step_segment_frees;  /**< backend frees (unmaps) in the last step */
    /* fragmentation at the end of the replay (cca_cache_fragmentation) */
    uint64_t cached_free_bytes;   /**< free memory the cache holds */
    uint64_t largest_free_bytes;  /**< the largest piece it could serve without a backend call */
    /* compact_memory over the whole replay (cca_memory_stats_extra) */
    uint64_t compact_moves;       /**< growths that re-mapped free granules */
    uint64_t compact_pending_growths; /**< growths that mapped new memory, granules not yet done */
    bool overlapped;              /**< replayed while the file was read, on a second thread */
    /* the device replayed, of the snapshot's device_traces */
    int device;                   /**< its index */
    size_t device_count;          /**< device_traces entries in the snapshot */
    /* the state before the first event, for a trace recorded after the allocator had begun
     * (history recorded late, or its ring wrapped): inferred from the snapshot's segments and
     * the events as PyTorch's memory viewer does, and the replay started from it */
    uint64_t inferred_segments;   /**< segments (expandable: mapped ranges) that existed before */
    uint64_t inferred_blocks;     /**< blocks live before the first event */
    uint64_t inferred_reserved_bytes;  /**< bytes of those segments */
    uint64_t inferred_requested_bytes; /**< bytes those blocks were asked for */
    bool recorded_part_only;      /**< a state was inferred: the peaks and the counts cover only
                                       the recorded part; expected_peak_reserved_bytes is PyTorch's
                                       over that part; only the .current statistics compare */
    /* input that contradicts itself: an allocation inside a live block, a free of a block never
     * seen, a size negative or of 1 EB or more, a NaN memory fraction (options.strict: an error) */
    uint64_t inconsistencies;
    char first_inconsistency[200]; /**< the earliest event's, named */
    uint64_t first_inconsistency_event; /**< its event (UINT64_MAX: not an event's) */
    uint64_t ambiguous_blocks;    /**< blocks live before the first event whose size nothing in the
                                       file tells: PyTorch may have left up to 1 MiB unsplit in
                                       each (0: the inferred state is the file's own) */
} cca_replay_result_t;

/**
 * Replay a PyTorch memory snapshot (pickle, optionally gzip) through cca on
 * a simulated device. Shuts down and re-initialises cca (the previous state is
 * lost, even when the file turns out unreadable) and leaves it shut down.
 * Unless options->sequential, the replay runs on a second thread while the
 * file is read, with the settings the options give (else PyTorch's default)
 * and no memory fraction or private-pool operation; if the trace's own
 * configuration, known at the end of the file, differs in a way that matters,
 * the trace is replayed again once read. Either way the result is the same.
 * A snapshot recorded after the allocator had begun replays from the state
 * before its first event, inferred from its segments (docs/replay-mid-run.md).
 * Returns CCA_OK, CCA_ERR_IO, CCA_ERR_FORMAT (not a snapshot, or malformed;
 * with options->strict, an inconsistency of the input), CCA_ERR_BAD_SETTINGS,
 * CCA_ERR_INVALID_ARGUMENT, CCA_ERR_OUT_OF_MEMORY (host memory, or a cap
 * smaller than the state before the first event).
 * An out-of-memory failure during the replay is counted, not returned.
 * With snapshot_path or svg_path set, the history is cleared and recorded
 * during the replay, written at its end, and left off afterwards; writing
 * adds CCA_ERR_IO.
 */
cca_status_t cca_replay_file(const char *path, const cca_replay_options_t *options,
                             cca_replay_result_t *result);

/** Free what a replay result holds. */
void cca_replay_result_free(cca_replay_result_t *result);

/** How many entries each ranking of cca_replay_explain_t keeps. */
#define CCA_EXPLAIN_TOP 8

/** One line of a ranking: what it is, its bytes, and how many things it counts. */
typedef struct cca_explain_entry {
    char name[160];          /**< a call site "file:line function", an annotation, a stream, a segment */
    uint64_t bytes;          /**< live bytes (segments: cached free bytes) */
    uint64_t count;          /**< live allocations (segments: free pieces) */
} cca_explain_entry_t;

/**
 * What a replay held at the peak of its reserved memory: of the moments (after
 * a trace event) at the highest reservation, the first with the most bytes
 * allocated.
 */
typedef struct cca_replay_explain {
    uint64_t peak_event;          /**< index of that event in the device's trace */
    uint64_t reserved_bytes;      /**< reserved then (the peak) */
    uint64_t live_bytes;          /**< in blocks the program held (allocated or pending free) */
    uint64_t live_requested_bytes; /**< what the program asked for in them */
    uint64_t live_allocations;
    uint64_t cached_free_bytes;   /**< reserved in no live block (fragmentation) */
    uint64_t largest_free_bytes;  /**< the largest free piece */
    uint64_t segments;            /**< segments then */
    uint64_t segments_with_free;  /**< of which hold a free piece */
    uint64_t frames_distinct, annotations_distinct, streams_distinct; /**< groups found */
    size_t frame_count, annotation_count, stream_count, segment_count; /**< entries filled below */
    cca_explain_entry_t frames[CCA_EXPLAIN_TOP];      /**< live bytes by allocation call site */
    cca_explain_entry_t annotations[CCA_EXPLAIN_TOP]; /**< by the innermost annotation open
                                                           at the allocation (record_function) */
    cca_explain_entry_t streams[CCA_EXPLAIN_TOP];     /**< by stream */
    cca_explain_entry_t free_segments[CCA_EXPLAIN_TOP]; /**< segments by cached free bytes */
} cca_replay_explain_t;

/**
 * Replay a trace as cca_replay_file does (never on a second thread) and
 * report in *explain what was live at the peak of reserved memory, ranked by
 * the allocations' call sites (their first frame outside torch), annotations
 * and streams, and where the cached free memory lay. Reads the file again for
 * the events' times and streams (and, where they carry frames, once more as a
 * tree). Same statuses as cca_replay_file;
 * *result is filled as there (free it with cca_replay_result_free) and holds
 * nothing on error.
 */
cca_status_t cca_replay_explain(const char *path, const cca_replay_options_t *options,
                                cca_replay_result_t *result, cca_replay_explain_t *explain);

/**
 * Replay every device of a snapshot (each device_traces entry, options->device
 * ignored), one result each: *results (malloc'd, *count of them) is freed with
 * cca_replay_results_free. A device's result says its index (result.device).
 * options->snapshot_path and svg_path are written for device 0 only. Returns
 * what cca_replay_file returns for the first device that fails (no results
 * then), CCA_ERR_INVALID_ARGUMENT (path, results or count NULL),
 * CCA_ERR_OUT_OF_MEMORY. Not thread-safe (cca is re-initialised per device).
 */
cca_status_t cca_replay_file_devices(const char *path, const cca_replay_options_t *options,
                                     cca_replay_result_t **results, size_t *count);

/** Free the results of cca_replay_file_devices. */
void cca_replay_results_free(cca_replay_result_t *results, size_t count);

#ifdef __cplusplus
}
#endif


/* ------------------------------------------------------------------------ */
/* Observability: allocation history, trace trackers, snapshots             */
/* ------------------------------------------------------------------------ */

#ifdef __cplusplus
extern "C" {
#endif

/** What a history entry records (PyTorch's TraceEntry::Action). Values are stable. */
typedef enum cca_trace_action {
    CCA_TRACE_ALLOC = 0,          /**< a block was handed to the program */
    CCA_TRACE_FREE_REQUESTED = 1, /**< the program freed it */
    CCA_TRACE_FREE_COMPLETED = 2, /**< its stream events completed: it is reusable */
    CCA_TRACE_SEGMENT_ALLOC = 3,  /**< memory from the backend (cudaMalloc) */
    CCA_TRACE_SEGMENT_FREE = 4,   /**< memory back to the backend (cudaFree) */
    CCA_TRACE_SEGMENT_MAP = 5,    /**< an expandable segment mapped pages */
    CCA_TRACE_SEGMENT_UNMAP = 6,  /**< an expandable segment unmapped pages */
    CCA_TRACE_SNAPSHOT = 7,       /**< a snapshot was taken (size: active bytes) */
    CCA_TRACE_OOM = 8,            /**< out of memory (addr: the device's free bytes) */
    CCA_TRACE_USER_DEFINED = 9,   /**< an annotation (cca_record_annotation) */
    CCA_TRACE_ACTION_COUNT = 10
} cca_trace_action_t;

/** Which entries carry the user context (PyTorch's RecordContext). */
typedef enum cca_record_context {
    CCA_RECORD_CONTEXT_NEVER = 0, /**< no context at all */
    CCA_RECORD_CONTEXT_STATE = 1, /**< context of live allocations only (snapshot blocks) */
    CCA_RECORD_CONTEXT_ALLOC = 2, /**< also on history entries, taken at allocation */
    CCA_RECORD_CONTEXT_ALL = 3,   /**< also taken again at free (free_requested entries) */
} cca_record_context_t;

/** One history entry. */
typedef struct cca_trace_entry {
    cca_trace_action_t action;
    int device;
    uint64_t addr;        /**< block/segment address; CCA_TRACE_OOM: the device's free bytes */
    size_t size;          /**< bytes (requested size for alloc/free entries) */
    cca_stream_t stream;
    int64_t time_us;      /**< wall clock, microseconds since the epoch */
    const char *context;  /**< the user context, or NULL; an annotation's name */
    const char *compile_context; /**< the device's compile context then, or NULL ("N/A") */
    const char *user_metadata;   /**< the device's user metadata then, or NULL ("") */
    cca_mempool_id_t pool;       /**< the private pool of the block or segment, (0, 0) for the
                                      default pools and entries of neither */
} cca_trace_entry_t;

/**
 * The user context: a callback returning a string (a stack, a tag), or NULL
 * for none. cca copies the string at once. It is called outside cca's locks,
 * at the start of cca_malloc (and of cca_free with CCA_RECORD_CONTEXT_ALL),
 * so it may take its own locks, but it must not allocate through cca.
 */
typedef const char *(*cca_context_fn)(void *arg);

/**
 * Called with a context string (as the context function returned it) when
 * cca drops its last copy: no history entry and no live block refers to it
 * any more. A caller whose strings name objects of its own (an id into a
 * table of stacks) frees them here. It may be called inside cca's locks: it
 * must be quick and must not call cca.
 */
typedef void (*cca_context_release_fn)(const char *context, void *arg);

/** Set (NULL: clear) the context release callback. Set it before recording starts. */
void cca_set_context_release(cca_context_release_fn fn, void *arg);

/**
 * Start or stop recording the allocation history into a ring of at most
 * max_entries entries (0 counts as 1; beyond it the oldest are overwritten).
 * max_entries is a bound, not a size: the ring grows as entries come, so
 * SIZE_MAX (PyTorch's default, sys.maxsize) keeps every entry. when says which
 * entries get the context of context_fn (required unless when is
 * CCA_RECORD_CONTEXT_NEVER). Stopping clears the history. Calling it again
 * while recording changes the settings and keeps the newest entries. Needs no
 * initialisation; the history survives cca_shutdown. Returns CCA_OK,
 * CCA_ERR_INVALID_ARGUMENT (when out of range, or context_fn NULL with a
 * level above NEVER), CCA_ERR_OUT_OF_MEMORY. Thread-safe.
 */
cca_status_t cca_record_history(bool enabled, cca_context_fn context_fn, void *context_arg,
                                size_t max_entries, cca_record_context_t when);

/** True while the history is recorded. */
bool cca_history_enabled(void);

/**
 * Record a user_defined entry named name (copied) on the calling thread's
 * current device (device 0 before initialisation), for history and
 * trackers, as PyTorch 2.11 records its annotations. Does nothing when
 * neither records. Returns CCA_OK, CCA_ERR_INVALID_ARGUMENT (name NULL),
 * CCA_ERR_OUT_OF_MEMORY, or the error of asking the current device.
 */
cca_status_t cca_record_annotation(const char *name);

/**
 * Record an annotation with fields, as PyTorch's recordAnnotation does (its
 * record_function scopes give {"name", NAME} and {"stage", "START" or "END"}):
 * count pairs keys[i] : values[i] (copied). Like cca_record_annotation, a
 * user_defined entry on the current device, for history and trackers, whose
 * context is the value of "name" ("" without one); written snapshots list it
 * in external_annotations only, not in device_traces, as PyTorch 2.11's do
 * (a dict: the fields, "device" and "time_us").
 * cca_record_annotation(name) is {"name": name, "stage": "START"}. Does
 * nothing when neither history nor a tracker records. Returns CCA_OK,
 * CCA_ERR_INVALID_ARGUMENT (keys or values NULL with count > 0, a NULL or
 * empty key, a NULL value), CCA_ERR_OUT_OF_MEMORY, or the error of asking the
 * current device.
 */
cca_status_t cca_record_annotation_fields(const char *const *keys, const char *const *values,
                                          size_t count);

/**
 * PyTorch's compile contexts (pushCompileContext / popCompileContext, which
 * torch.compile calls around its compiled frames): a stack per device. Each
 * history entry of a device records the top of that device's stack as its
 * compile_context (snapshots write "N/A" for none). Push and pop act on the
 * calling thread's current device and only while the history is recorded,
 * as PyTorch's; a pop of an empty stack does nothing. Returns CCA_OK,
 * CCA_ERR_INVALID_ARGUMENT (context NULL), CCA_ERR_OUT_OF_MEMORY, or the
 * error of asking the current device.
 */
cca_status_t cca_push_compile_context(const char *context);
cca_status_t cca_pop_compile_context(void);

/**
 * PyTorch's user metadata (setUserMetadata, torch.cuda.memory's
 * _set_memory_metadata): a string per device, the calling thread's current
 * device's, that each later history entry of that device records as its
 * user_metadata (snapshots write "" until it is set). Kept whether or not the
 * history is recorded. cca_get_user_metadata gives a malloc'd copy of the
 * current device's (free() it). Returns CCA_OK, CCA_ERR_INVALID_ARGUMENT
 * (NULL), CCA_ERR_OUT_OF_MEMORY, or the error of asking the current device.
 */
cca_status_t cca_set_user_metadata(const char *metadata);
cca_status_t cca_get_user_metadata(char **metadata);

/**
 * The value of an annotation's field key in a user_defined history entry (of
 * cca_history_get or a tracker), or NULL (no such field, not an annotation,
 * NULL arguments). The string lives as long as the entry.
 */
const char *cca_trace_entry_field(const cca_trace_entry_t *entry, const char *key);

/**
 * An annotation's fields in order: the i-th key and value of a user_defined
 * entry in *key and *value. False past the last field (or for NULL arguments
 * and other entries).
 */
bool cca_trace_entry_field_at(const cca_trace_entry_t *entry, size_t i, const char **key,
                              const char **value);

/**
 * The recorded history, oldest first. *entries is one malloc'd block holding
 * the entries and their context strings; free it with cca_history_free.
 * Returns CCA_OK, CCA_ERR_INVALID_ARGUMENT (NULL), CCA_ERR_OUT_OF_MEMORY.
 */
cca_status_t cca_history_get(cca_trace_entry_t **entries, size_t *count);
void cca_history_free(cca_trace_entry_t *entries);

/**
 * A trace tracker is called with every entry as it is recorded, whether or
 * not the history is recorded, inside cca's locks: it must be quick and must
 * not call cca. entry->context is valid during the call only.
 */
typedef void (*cca_trace_tracker_fn)(const cca_trace_entry_t *entry, void *arg);

/** Attach a tracker. Returns CCA_OK, CCA_ERR_INVALID_ARGUMENT, CCA_ERR_OUT_OF_MEMORY. */
cca_status_t cca_attach_trace_tracker(cca_trace_tracker_fn fn, void *arg);

/** Detach a tracker attached with the same (fn, arg). Returns CCA_OK, CCA_ERR_INVALID_ARGUMENT (not attached). */
cca_status_t cca_detach_trace_tracker(cca_trace_tracker_fn fn, void *arg);

/** PyTorch's name of an action ("alloc", "free_requested", ...); "unknown" if out of range. */
const char *cca_trace_action_name(cca_trace_action_t action);

/** State of a block in a snapshot. */
typedef enum cca_block_state {
    CCA_BLOCK_INACTIVE = 0,            /**< free, cached */
    CCA_BLOCK_ACTIVE_ALLOCATED = 1,    /**< held by the program */
    CCA_BLOCK_ACTIVE_PENDING_FREE = 2, /**< freed, waiting for stream events */
} cca_block_state_t;

/** PyTorch's name of a state ("inactive", "active_allocated", "active_pending_free"). */
const char *cca_block_state_name(cca_block_state_t state);

/** One block of a segment (PyTorch's BlockInfo). */
typedef struct cca_block_info {
    uint64_t address;
    size_t size;            /**< bytes */
    size_t requested_size;  /**< bytes the program asked for (last allocation) */
    cca_block_state_t state;
    const char *context;    /**< the allocation's user context (active blocks), or NULL */
} cca_block_info_t;

/** One segment (PyTorch's SegmentInfo). */
typedef struct cca_segment_info {
    int device;
    uint64_t address;
    size_t total_size;      /**< bytes */
    size_t allocated_size;  /**< bytes in allocated blocks */
    size_t active_size;     /**< bytes in active blocks (allocated or pending) */
    size_t requested_size;  /**< requested bytes of active blocks */
    cca_stream_t stream;
    bool is_large;          /**< large pool ("large"), else small ("small") */
    bool is_expandable;
    uint64_t owner_private_pool_id[2]; /**< (0, 0): the default pools */
    size_t block_count;
    cca_block_info_t *blocks; /**< in address order */
    const char *context;    /**< user context of the allocation that created the segment (the
                                 run at the segment's start of an expandable one), or NULL */
} cca_segment_info_t;

/** Every segment of every device, sorted by address. */
typedef struct cca_snapshot {
    size_t segment_count;
    cca_segment_info_t *segments;
} cca_snapshot_t;

/**
 * Take a consistent picture of every segment and block (each device is
 * walked under its lock and all its stream pool locks) and record a
 * snapshot history entry per device. Free it with cca_snapshot_free.
 * Returns CCA_OK, CCA_ERR_INVALID_ARGUMENT (out NULL), CCA_ERR_OUT_OF_MEMORY,
 * or an init error.
 */
cca_status_t cca_snapshot(cca_snapshot_t **out);
void cca_snapshot_free(cca_snapshot_t *snapshot);

/**
 * Write the allocator's state and history as PyTorch 2.11's snapshot pickle
 * (torch.cuda.memory._snapshot(): segments, device_traces,
 * allocator_settings, external_annotations), gzip-compressed when path ends
 * in ".gz", for torch.cuda._memory_viz and cca replay. Returns CCA_OK,
 * CCA_ERR_INVALID_ARGUMENT, CCA_ERR_IO, CCA_ERR_OUT_OF_MEMORY, or an init error.
 */
cca_status_t cca_dump_snapshot(const char *path);
/** The same content as JSON (indented). Same statuses. */
cca_status_t cca_dump_snapshot_json(const char *path);
/** A self-contained SVG: memory over time by allocation, and the segment map. Same statuses. */
cca_status_t cca_dump_snapshot_svg(const char *path);

/**
 * Read a snapshot pickle (PyTorch's or cca's, .gz or not) and render it as
 * JSON text (*text malloc'd; free it) or as an SVG file. Returns CCA_OK,
 * CCA_ERR_INVALID_ARGUMENT, CCA_ERR_IO, CCA_ERR_FORMAT (not a snapshot),
 * CCA_ERR_OUT_OF_MEMORY. Need no initialisation.
 */
cca_status_t cca_snapshot_file_to_json(const char *in_path, char **text);
cca_status_t cca_snapshot_file_to_svg(const char *in_path, const char *svg_path);

#ifdef __cplusplus
}
#endif

/* ------------------------------------------------------------------------ */
/* PyTorch pluggable allocator entry points                                 */
/* ------------------------------------------------------------------------ */

#ifdef __cplusplus
extern "C" {
#endif

/**
 * The allocation function torch.cuda.memory.CUDAPluggableAllocator expects:
 * `void *alloc(ssize_t size, int device, cudaStream_t stream)` (ptrdiff_t
 * has ssize_t's ABI). Returns NULL on failure, after writing cca's error
 * message (PyTorch's OOM text) to the output sink; PyTorch then raises.
 */
void *cca_torch_malloc(ptrdiff_t size, int device, cca_stream_t stream);

/** The matching `void free(void *ptr, ssize_t size, int device, cudaStream_t stream)`. */
void cca_torch_free(void *ptr, ptrdiff_t size, int device, cca_stream_t stream);

#ifdef __cplusplus
}
#endif

#endif /* CCA_H */
