/*
 * cca_backend.h - the contract between cca's allocator core and a device
 * backend, and the constructors of the backends cca ships.
 *
 * Policy (caching, rounding, splitting, statistics) lives in the core; a
 * backend only provides mechanism: raw device memory, memory info, events,
 * virtual memory, host memory and IPC. The core never calls a backend while
 * holding a lock that the backend could need, but it may call any operation
 * from several threads at once: every operation must be thread-safe.
 *
 * Common rules for every operation:
 *  - `ctx` is the backend's own `ctx` field;
 *  - out-parameters are written only on CCA_OK;
 *  - a failure returns a status and records the details with
 *    cca_backend_error() (message, raw code); CCA_ERR_OUT_OF_MEMORY is
 *    reserved for "the device has no memory left" (cudaErrorMemoryAllocation),
 *    so the core can run its out-of-memory sequence;
 *  - `device` is in [0, device_count); the core validates it before calling.
 */
#ifndef CCA_BACKEND_H
#define CCA_BACKEND_H

#include "cca.h"

#ifdef __cplusplus
extern "C" {
#endif

/** An event handle (cudaEvent_t for the CUDA backend). */
typedef void *cca_event_t;

/** A physical memory handle for virtual memory (CUmemGenericAllocationHandle). */
typedef uint64_t cca_phys_handle_t;

/** An IPC memory handle (cudaIpcMemHandle_t is 64 bytes). */
typedef struct cca_ipc_handle {
    unsigned char bytes[64];
} cca_ipc_handle_t;

/** Properties of one device. */
typedef struct cca_device_props {
    char name[256];       /**< device name */
    size_t total_memory;  /**< bytes */
} cca_device_props_t;

/** Backend operation identifiers, used for fault injection and counters. */
typedef enum cca_backend_op {
    CCA_OP_MALLOC = 0,
    CCA_OP_FREE,
    CCA_OP_MEM_GET_INFO,
    CCA_OP_STREAM_SYNCHRONIZE,
    CCA_OP_DEVICE_SYNCHRONIZE,
    CCA_OP_EVENT_CREATE,
    CCA_OP_EVENT_DESTROY,
    CCA_OP_EVENT_RECORD,
    CCA_OP_EVENT_QUERY,
    CCA_OP_EVENT_SYNCHRONIZE,
    CCA_OP_STREAM_CAPTURE_STATUS,
    CCA_OP_VMM_GRANULARITY,
    CCA_OP_VMM_RESERVE,
    CCA_OP_VMM_FREE,
    CCA_OP_VMM_CREATE,
    CCA_OP_VMM_RELEASE,
    CCA_OP_VMM_MAP,
    CCA_OP_VMM_UNMAP,
    CCA_OP_VMM_SET_ACCESS,
    CCA_OP_HOST_ALLOC,
    CCA_OP_HOST_FREE,
    CCA_OP_HOST_REGISTER,
    CCA_OP_HOST_UNREGISTER,
    CCA_OP_IPC_GET,
    CCA_OP_IPC_OPEN,
    CCA_OP_IPC_CLOSE,
    CCA_OP_CAN_ACCESS_PEER,
    CCA_OP_ENABLE_PEER_ACCESS,
    CCA_OP_MEMCPY_PEER,
    CCA_OP_STREAM_CREATE,
    CCA_OP_STREAM_DESTROY,
    CCA_OP_STREAM_WAIT_EVENT,
    CCA_OP_MALLOC_ASYNC,
    CCA_OP_FREE_ASYNC,
    CCA_OP_MEMPOOL_TRIM,
    CCA_OP_MEMPOOL_GET_ATTR,
    CCA_OP_MEMPOOL_SET_ATTR,
    CCA_OP_MEMPOOL_SET_ACCESS,
    CCA_OP_IPC_EVENT_CREATE,
    CCA_OP_IPC_EVENT_GET,
    CCA_OP_IPC_EVENT_OPEN,
    CCA_OP_STREAM_CAPTURE_INFO,
    CCA_OP_GRAPH_NODE_DEPENDENCIES,
    CCA_OP_VMM_EXPORT,
    CCA_OP_VMM_IMPORT,
    CCA_OP_COUNT
} cca_backend_op_t;

/** Name of a backend operation, e.g. "malloc". */
const char *cca_backend_op_name(cca_backend_op_t op);

/** Attributes of a device's stream-ordered memory pool (cudaMemPoolAttr). */
typedef enum cca_mempool_attr {
    CCA_MEMPOOL_RELEASE_THRESHOLD = 0,  /**< bytes kept reserved at synchronisation points */
    CCA_MEMPOOL_REUSE_FOLLOW_EVENT_DEPENDENCIES, /**< 0 or 1 */
    CCA_MEMPOOL_REUSE_ALLOW_OPPORTUNISTIC,       /**< 0 or 1 */
    CCA_MEMPOOL_REUSE_ALLOW_INTERNAL_DEPENDENCIES, /**< 0 or 1 */
    CCA_MEMPOOL_RESERVED_CURRENT,       /**< bytes reserved by the pool (read only) */
    CCA_MEMPOOL_RESERVED_HIGH,          /**< its high-water mark (set: 0 resets it) */
    CCA_MEMPOOL_USED_CURRENT,           /**< bytes allocated from the pool (read only) */
    CCA_MEMPOOL_USED_HIGH,              /**< its high-water mark (set: 0 resets it) */
    CCA_MEMPOOL_ATTR_COUNT
} cca_mempool_attr_t;

/** A node of a graph being captured (cudaGraphNode_t for the CUDA backend). */
typedef void *cca_graph_node_t;

/** Stream capture states (cudaStreamCaptureStatus). */
enum { CCA_CAPTURE_NONE = 0, CCA_CAPTURE_ACTIVE = 1, CCA_CAPTURE_INVALIDATED = 2 };

/**
 * A device backend: a table of operations. Every pointer must be set; an
 * operation a backend cannot do returns CCA_ERR_NOT_SUPPORTED.
 */
typedef struct cca_backend {
    const char *name; /**< short name, e.g. "cuda" or "sim" */
    void *ctx;        /**< the backend's state, passed to every operation */

    /** Number of devices (0 allowed). Returns CCA_OK or CCA_ERR_BACKEND. */
    cca_status_t (*device_count)(void *ctx, int *count);
    /** Properties of a device. Returns CCA_OK or CCA_ERR_BACKEND. */
    cca_status_t (*device_props)(void *ctx, int device, cca_device_props_t *props);
    /** Current device of the calling thread; set it. */
    cca_status_t (*get_device)(void *ctx, int *device);
    cca_status_t (*set_device)(void *ctx, int device);
    /** Free and total bytes of a device, as cudaMemGetInfo. */
    cca_status_t (*mem_get_info)(void *ctx, int device, size_t *free_bytes, size_t *total_bytes);

    /**
     * Allocate size (> 0) bytes of device memory, usable on any stream.
     * Returns CCA_OK, CCA_ERR_OUT_OF_MEMORY (nothing allocated, any sticky
     * error state cleared), CCA_ERR_BACKEND.
     */
    cca_status_t (*malloc)(void *ctx, int device, size_t size, void **ptr);
    /** Free memory from malloc (synchronizes the device, as cudaFree). */
    cca_status_t (*free)(void *ctx, int device, void *ptr);

    /** Wait for all work queued on stream; for the whole device. */
    cca_status_t (*stream_synchronize)(void *ctx, int device, cca_stream_t stream);
    cca_status_t (*device_synchronize)(void *ctx, int device);

    /** Create an event (timing disabled). */
    cca_status_t (*event_create)(void *ctx, int device, cca_event_t *event);
    cca_status_t (*event_destroy)(void *ctx, int device, cca_event_t event);
    /** Record the event on stream: it completes when the work queued so far is done. */
    cca_status_t (*event_record)(void *ctx, int device, cca_event_t event, cca_stream_t stream);
    /** CCA_OK if the event completed, CCA_ERR_NOT_READY if not, else an error. */
    cca_status_t (*event_query)(void *ctx, int device, cca_event_t event);
    /** Block until the event completed. */
    cca_status_t (*event_synchronize)(void *ctx, int device, cca_event_t event);
    /** Capture status of a stream (CCA_CAPTURE_*). */
    cca_status_t (*stream_capture_status)(void *ctx, int device, cca_stream_t stream, int *status);
    /**
     * Capture status of a stream, and while it is captured the capture's id
     * and the nodes work queued on it next would depend on (its terminal
     * nodes; cudaStreamGetCaptureInfo). *terminals stays valid until the
     * stream's next capture call; *count may be 0.
     */
    cca_status_t (*stream_capture_info)(void *ctx, int device, cca_stream_t stream, int *status,
                                        uint64_t *capture_id, const cca_graph_node_t **terminals,
                                        size_t *count);
    /**
     * The nodes a captured node depends on (cudaGraphNodeGetDependencies):
     * with deps NULL only *count; else up to *count of them, *count set to
     * the number written.
     */
    cca_status_t (*graph_node_dependencies)(void *ctx, int device, cca_graph_node_t node,
                                            cca_graph_node_t *deps, size_t *count);

    /** Virtual memory: allocation granularity of physical memory (bytes). */
    cca_status_t (*vmm_granularity)(void *ctx, int device, size_t *granularity);
    /** Reserve size bytes of address space (a multiple of the granularity). */
    cca_status_t (*vmm_reserve)(void *ctx, int device, size_t size, void **addr);
    cca_status_t (*vmm_free)(void *ctx, int device, void *addr, size_t size);
    /** Create size bytes of physical memory; CCA_ERR_OUT_OF_MEMORY when full. */
    cca_status_t (*vmm_create)(void *ctx, int device, size_t size, cca_phys_handle_t *handle);
    cca_status_t (*vmm_release)(void *ctx, int device, cca_phys_handle_t handle);
    /** Map physical memory at addr (inside a reservation); unmap a range. */
    cca_status_t (*vmm_map)(void *ctx, int device, void *addr, size_t size, cca_phys_handle_t handle);
    cca_status_t (*vmm_unmap)(void *ctx, int device, void *addr, size_t size);
    /** Give device (the owner, or a peer of the owner) read/write access to a mapped range. */
    cca_status_t (*vmm_set_access)(void *ctx, int device, void *addr, size_t size);
    /**
     * A POSIX file descriptor another process can import handle's physical
     * memory from (cuMemExportToShareableHandle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR).
     * The backend owns it: it stays open, the same for every call, until the
     * handle is released. CCA_ERR_NOT_SUPPORTED when the handle was not made
     * shareable (the driver or the backend's mode cannot).
     */
    cca_status_t (*vmm_export)(void *ctx, int device, cca_phys_handle_t handle, int *fd);
    /**
     * A physical handle for memory another process exported, from a file
     * descriptor of this process (cuMemImportFromShareableHandle); the caller
     * keeps and closes fd. Map it as any handle; release it with vmm_release.
     * CCA_ERR_INVALID_ARGUMENT when fd holds no exported memory.
     */
    cca_status_t (*vmm_import)(void *ctx, int device, int fd, cca_phys_handle_t *handle);

    /** Page-locked host memory (cudaHostAlloc); free it. */
    cca_status_t (*host_alloc)(void *ctx, size_t size, void **ptr);
    cca_status_t (*host_free)(void *ctx, void *ptr);
    /** Page-lock existing host memory; *device_ptr gets its device address. */
    cca_status_t (*host_register)(void *ctx, void *ptr, size_t size, void **device_ptr);
    cca_status_t (*host_unregister)(void *ctx, void *ptr);

    /** IPC: handle of a device allocation; open another process's; close it. */
    cca_status_t (*ipc_get_handle)(void *ctx, int device, void *ptr, cca_ipc_handle_t *handle);
    cca_status_t (*ipc_open)(void *ctx, int device, const cca_ipc_handle_t *handle, void **ptr);
    cca_status_t (*ipc_close)(void *ctx, int device, void *ptr);
    /** An event another process can wait for (cudaEventInterprocess; destroy with event_destroy). */
    cca_status_t (*ipc_event_create)(void *ctx, int device, cca_event_t *event);
    /** The IPC handle of such an event (cudaIpcGetEventHandle). */
    cca_status_t (*ipc_event_get_handle)(void *ctx, int device, cca_event_t event,
                                         cca_ipc_handle_t *handle);
    /** Open another process's event: an event here to wait for; event_destroy releases it. */
    cca_status_t (*ipc_event_open)(void *ctx, int device, const cca_ipc_handle_t *handle,
                                   cca_event_t *event);

    /** Peer access: *can_access = 1 if device can address peer's memory, else 0. */
    cca_status_t (*can_access_peer)(void *ctx, int device, int peer, int *can_access);
    /**
     * Let device access peer's memory (cudaDeviceEnablePeerAccess from device).
     * CCA_OK when it was already enabled; CCA_ERR_NOT_SUPPORTED when the pair cannot.
     */
    cca_status_t (*enable_peer_access)(void *ctx, int device, int peer);
    /** Copy size bytes of device memory, possibly between devices, in stream order. */
    cca_status_t (*memcpy_peer_async)(void *ctx, void *dst, int dst_device, const void *src,
                                      int src_device, size_t size, cca_stream_t stream);

    /** Streams: create a non-blocking stream on device; destroy one. */
    cca_status_t (*stream_create)(void *ctx, int device, cca_stream_t *stream);
    cca_status_t (*stream_destroy)(void *ctx, int device, cca_stream_t stream);
    /** Make later work on stream wait for event (cudaStreamWaitEvent). */
    cca_status_t (*stream_wait_event)(void *ctx, int device, cca_stream_t stream, cca_event_t event);

    /**
     * Stream-ordered allocation from the device's default memory pool
     * (cudaMallocAsync): size (> 0) bytes usable in stream order on stream.
     * Returns CCA_OK, CCA_ERR_OUT_OF_MEMORY (error state cleared), CCA_ERR_BACKEND.
     */
    cca_status_t (*malloc_async)(void *ctx, int device, size_t size, cca_stream_t stream, void **ptr);
    /** Free memory from malloc_async once the work queued on stream is done (cudaFreeAsync). */
    cca_status_t (*free_async)(void *ctx, int device, void *ptr, cca_stream_t stream);
    /** Release unused pool memory until at most keep_bytes stay reserved (cudaMemPoolTrimTo). */
    cca_status_t (*mempool_trim)(void *ctx, int device, size_t keep_bytes);
    /** Read or write an attribute of the device's default pool. */
    cca_status_t (*mempool_get_attr)(void *ctx, int device, cca_mempool_attr_t attr, uint64_t *value);
    cca_status_t (*mempool_set_attr)(void *ctx, int device, cca_mempool_attr_t attr, uint64_t value);
    /** Give peer read/write access to device's pool memory (cudaMemPoolSetAccess). */
    cca_status_t (*mempool_set_access)(void *ctx, int device, int peer);

    /** Release the backend's state (called once, at cca_shutdown). */
    void (*destroy)(void *ctx);
} cca_backend_t;

/**
 * Record a backend failure in the caller's last-error record and return
 * status. raw_code is the backend's own code (e.g. cudaError_t), 0 if none.
 */
cca_status_t cca_backend_error(cca_status_t status, long raw_code, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 3, 4)))
#endif
    ;

/* ------------------------------------------------------------------------ */
/* The simulated backend                                                    */
/* ------------------------------------------------------------------------ */

/** Configuration of a simulated backend. Zero-initialise, then set fields. */
typedef struct cca_sim_config {
    int devices;            /**< number of devices (0 -> 1) */
    size_t total_memory;    /**< bytes per device (0 -> 80 GiB) */
    size_t memory_cap;      /**< bytes; malloc fails beyond it (0 -> total_memory) */
    bool backed;            /**< real host memory behind device memory */
    bool manual_events;     /**< events complete only when the test completes them */
    size_t granularity;     /**< VMM granularity (0 -> 2 MiB) */
    const uint64_t *addresses; /**< if set: malloc/vmm_reserve hand these out in order */
    size_t address_count;   /**< entries in addresses (copied at creation) */
    bool ipc_shared;        /**< backed memory is shared memory another process can open
                                 through an IPC handle (implies backed) */
    bool no_peer_access;    /**< no device can access another's memory */
} cca_sim_config_t;

/** Create a simulated backend. Returns CCA_OK, CCA_ERR_INVALID_ARGUMENT, CCA_ERR_OUT_OF_MEMORY. */
cca_status_t cca_sim_create(const cca_sim_config_t *config, cca_backend_t **backend);

/**
 * Make the nth (1-based, counted from now) call of op on this simulated
 * backend fail with status; with persistent, that call and every later one
 * fail. nth == 0 removes the fault of op.
 */
cca_status_t cca_sim_inject_fault(cca_backend_t *backend, cca_backend_op_t op, uint64_t nth,
                                  bool persistent, cca_status_t status);

/** Remove every injected fault. */
void cca_sim_clear_faults(cca_backend_t *backend);

/**
 * Whether device was given access (vmm_set_access) to the virtual memory
 * mapping of a simulated backend at addr: false where addr is not mapped,
 * and again after the mapping is unmapped. Returns CCA_OK, or
 * CCA_ERR_INVALID_ARGUMENT (not a simulated backend, has NULL).
 */
cca_status_t cca_sim_vmm_has_access(cca_backend_t *backend, const void *addr, int device, bool *has);

/** Number of calls of op so far (successful or not). */
uint64_t cca_sim_call_count(cca_backend_t *backend, cca_backend_op_t op);

/** Live resources of a simulated backend, for leak checks. */
typedef struct cca_sim_usage {
    size_t device_bytes[16];   /**< bytes allocated per device (malloc + vmm_create) */
    uint64_t live_allocations; /**< malloc'd blocks not freed */
    uint64_t live_events;      /**< events created, not destroyed */
    uint64_t live_reservations;/**< vmm reservations not freed */
    uint64_t live_handles;     /**< vmm physical handles not released */
    uint64_t live_host;        /**< host allocations and registrations not undone */
    size_t device_peak_bytes[16]; /**< the most device_bytes each device ever held */
} cca_sim_usage_t;

cca_status_t cca_sim_usage(cca_backend_t *backend, cca_sim_usage_t *usage);

/** Manual events: complete every event recorded on stream so far (all streams if all). */
cca_status_t cca_sim_complete_stream(cca_backend_t *backend, int device, cca_stream_t stream, bool all);

/**
 * Manual mode: from now on, an event recorded on a stream not kept manual
 * completes lag ticks (cca_sim_tick) after its record, lag 0 at once: a GPU
 * that runs lag steps behind the host. Synchronisation still completes it
 * at once. CCA_ERR_INVALID_ARGUMENT without manual_events.
 */
cca_status_t cca_sim_time_events(cca_backend_t *backend, uint64_t lag);

/** Timed mode: the events of stream complete only by synchronisation or cca_sim_complete_stream. */
cca_status_t cca_sim_keep_manual(cca_backend_t *backend, int device, cca_stream_t stream);

/** Timed mode: advance the clock by ticks (events due by then complete when next asked). */
void cca_sim_tick(cca_backend_t *backend, uint64_t ticks);

/** Number of recorded, not yet completed events (manual mode). */
uint64_t cca_sim_pending_events(cca_backend_t *backend);

/** Set or change the memory cap of a device (bytes; 0 = total memory). */
cca_status_t cca_sim_set_cap(cca_backend_t *backend, int device, size_t cap);

/** Append addresses to the list malloc/vmm_reserve take from (replay). */
cca_status_t cca_sim_push_addresses(cca_backend_t *backend, const uint64_t *addresses, size_t count);

/**
 * Where the address list grows from (a replay reading its trace while it
 * runs): when the list runs out, malloc and vmm_reserve call source, which
 * writes up to cap more entries to out, sets *got, and may wait for them; it
 * returns false once no entry will ever come (the address rule applies from
 * then on; a call that gives no entry counts as that too). It is called with the backend's lock held and must not call the
 * backend. NULL removes it. Returns CCA_OK, CCA_ERR_INVALID_ARGUMENT (not a
 * simulated backend, or a backed one).
 */
typedef bool (*cca_sim_address_source_fn)(void *ctx, uint64_t *out, size_t cap, size_t *got);
cca_status_t cca_sim_set_address_source(cca_backend_t *backend, cca_sim_address_source_fn source,
                                        void *ctx);

/**
 * Simulate stream capture: while capturing is true, stream_capture_status
 * reports CCA_CAPTURE_ACTIVE for stream (on every device). Returns CCA_OK,
 * CCA_ERR_INVALID_ARGUMENT (not a simulated backend), CCA_ERR_OUT_OF_MEMORY.
 */
cca_status_t cca_sim_set_capturing(cca_backend_t *backend, cca_stream_t stream, bool capturing);

/**
 * Simulate a captured graph (for graph_capture_record_stream_reuse): begin a
 * capture on stream (a new capture id, no node yet; it also counts as
 * capturing for stream_capture_status); queue work on a capturing stream (a
 * node depending on the stream's terminal nodes becomes its only terminal);
 * join dst to src's capture (as an event recorded on src and waited for on
 * dst: dst's terminals gain src's); end the capture of stream (every stream
 * of that capture stops capturing). Returns CCA_OK, CCA_ERR_INVALID_ARGUMENT
 * (not a simulated backend; work, join or end on a stream not capturing;
 * begin on one that is), CCA_ERR_OUT_OF_MEMORY.
 */
cca_status_t cca_sim_capture_begin(cca_backend_t *backend, cca_stream_t stream);
cca_status_t cca_sim_capture_work(cca_backend_t *backend, cca_stream_t stream);
cca_status_t cca_sim_capture_join(cca_backend_t *backend, cca_stream_t dst, cca_stream_t src);
cca_status_t cca_sim_capture_end(cca_backend_t *backend, cca_stream_t stream);

/**
 * Nodes of the simulated captured graphs so far (work, and malloc_async /
 * free_async on a capturing stream, which become nodes of its capture as
 * cudaMallocAsync / cudaFreeAsync do; free_async there of an allocation the
 * capture did not make fails, as in CUDA). 0 for another backend.
 */
size_t cca_sim_capture_nodes(cca_backend_t *backend);

/** The backend cca is running on (NULL before initialisation). */
cca_backend_t *cca_current_backend(void);

/* ------------------------------------------------------------------------ */
/* The CUDA backend                                                         */
/* ------------------------------------------------------------------------ */

/**
 * Create the CUDA backend. Returns CCA_OK, CCA_ERR_NO_DEVICE (no GPU or no
 * driver; the message says so and names CCA_BACKEND=sim), CCA_ERR_NOT_SUPPORTED
 * (cca built without CUDA), CCA_ERR_BACKEND.
 */
cca_status_t cca_cuda_create(cca_backend_t **backend);

#ifdef __cplusplus
}
#endif

#endif /* CCA_BACKEND_H */
