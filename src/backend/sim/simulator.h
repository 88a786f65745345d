/*
 * simulator.h - the simulated backend's state, shared by its files:
 * sim_faults.c (fault injection, shared errors), sim.c (address windows and
 * lists, capacity, memory records), sim_device.c (device operations, malloc,
 * free, mem_get_info), sim_events.c (event records, completion),
 * sim_streams.c (stream and event operations, capture status), sim_vmm.c
 * (virtual memory), sim_host.c (host memory, IPC), sim_multi.c (peer access,
 * IPC events, streams it makes, the stream-ordered memory pool), sim_create.c
 * (creation, destruction, the address list) and sim_control.c (test and
 * replay controls), lowest first: a file calls only files before it.
 * One mutex per backend guards all of it.
 */
#ifndef CCA_SIMULATOR_H
#define CCA_SIMULATOR_H

#include <pthread.h>
#include <stdatomic.h>

#include "internal.h"
#include "sim_containers.h"

#define SIM_MAX_DEVICES 16
#define SIM_CUDA_INVALID_VALUE 1              /* cudaErrorInvalidValue */
#define SIM_CUDA_OUT_OF_MEMORY 2              /* cudaErrorMemoryAllocation */
#define SIM_SMALL_ALIGN ((uint64_t)512)       /* blocks under SIM_LARGE_ALIGN */
#define SIM_LARGE_ALIGN ((uint64_t)2 << 20)
#define SIM_POOL_GRANULE ((uint64_t)2 << 20)  /* the stream-ordered pool grows by this */

/* ---- records -------------------------------------------------------------------- */

typedef struct sim_alloc {
    uint64_t addr;   /* device pointer */
    size_t size;     /* bytes requested */
    int device;
    uint64_t serial; /* distinguishes reuses of one address (IPC handles) */
    int fd;          /* ipc_shared mode: the shared memory file behind it, else -1 */
    bool async;      /* from malloc_async (freed by free_async) */
    uint64_t capture_id; /* malloc_async on a stream of this modelled capture (0: none) */
} sim_alloc_t;

/* The stream-ordered pool of a device (cudaMallocAsync), modelled by its accounting. */
typedef struct sim_pool {
    uint64_t reserved;      /* bytes, multiple of SIM_POOL_GRANULE, counted in device used */
    uint64_t reserved_high;
    uint64_t used;          /* bytes allocated from the pool */
    uint64_t used_high;
    uint64_t threshold;     /* release threshold (bytes kept at synchronisations) */
    uint64_t reuse[3];      /* the three reuse policies (0 or 1) */
    bool peer_access[SIM_MAX_DEVICES]; /* cudaMemPoolSetAccess */
} sim_pool_t;

typedef struct sim_resv {
    uint64_t addr;       /* base of the reservation */
    size_t size;         /* bytes */
    int device;
    sim_range_t *mapped; /* mappings (kind SIM_RANGE_MAPPING, data = sim_phys_t) */
    size_t mapping_count;
} sim_resv_t;

typedef struct sim_phys {
    uint64_t id;        /* the handle */
    int device;
    size_t size;        /* bytes of device memory it holds */
    uint64_t map_count; /* live mappings */
    bool released;      /* vmm_release called; freed with its last mapping */
    bool imported;      /* vmm_import: another process's memory, not counted in used */
    int fd;             /* ipc_shared mode (or imported): the memory file behind it, else -1 */
} sim_phys_t;

struct sim_stream;

typedef struct sim_event {
    int device;
    bool interprocess;         /* made by ipc_event_create */
    bool pending;              /* recorded, not completed (manual mode) */
    uint64_t due;              /* timed stream: the tick at which it completes */
    struct sim_stream *stream; /* stream it is pending on */
    struct sim_event *prev, *next; /* in its stream's pending list, record order */
} sim_event_t;

typedef struct sim_stream {
    sim_event_t *head, *tail; /* pending events, oldest first */
    bool manual;              /* timed mode: this stream's events stay manual */
} sim_stream_t;

typedef struct sim_host {
    void *ptr;
    size_t size;
    bool registered; /* host_register'ed (else host_alloc'ed) */
} sim_host_t;

typedef struct sim_fault {
    uint64_t countdown; /* calls until the failure; 0 = no fault armed */
    bool persistent;    /* keep failing once triggered */
    bool failing;       /* a persistent fault triggered */
    cca_status_t status;
} sim_fault_t;

typedef struct sim_device {
    size_t total;             /* bytes */
    size_t cap;               /* bytes; malloc fails beyond min(cap, total) */
    size_t used;              /* bytes held by malloc and vmm_create (sim_use) */
    size_t used_peak;         /* the most `used` ever was */
    uint64_t window_start;    /* address-only: this device's address window */
    uint64_t window_end;
    sim_range_t *free_ranges; /* free parts of the window */
    sim_map_t streams;        /* stream handle -> sim_stream_t (manual events) */
    sim_pool_t pool;          /* the stream-ordered pool */
    bool peer_enabled[SIM_MAX_DEVICES]; /* enable_peer_access(this, p) was called */
} sim_device_t;

/* Count size more bytes as held on dev (lock held). */
static inline void sim_use(sim_device_t *dev, size_t size)
{
    dev->used += size;
    if (dev->used > dev->used_peak)
        dev->used_peak = dev->used;
}

typedef struct sim_graph sim_graph_t; /* sim_capture.c */

typedef struct sim_ctx {
    cca_backend_t backend;  /* backend.ctx == this */
    pthread_mutex_t lock;   /* guards everything below */
    pthread_key_t current;  /* current device + 1 of the calling thread */
    uint64_t instance;      /* unique per backend created: keys the threads' device cache */
    int device_count;
    bool backed;
    bool manual_events;
    bool timed_events;      /* manual mode: streams not marked manual complete by ticks */
    uint64_t event_lag;     /* timed: ticks from a record to its completion (0: at once) */
    uint64_t clock;         /* timed: ticks so far (cca_sim_tick) */
    size_t granularity;     /* bytes */
    sim_device_t devices[SIM_MAX_DEVICES];
    sim_map_t allocs;       /* addr -> sim_alloc_t */
    sim_map_t phys;         /* handle -> sim_phys_t */
    sim_map_t events;       /* handle -> sim_event_t */
    sim_map_t host;         /* host pointer -> sim_host_t */
    sim_map_t ipc_opens;    /* pointer -> open count (as a pointer-sized integer) */
    sim_map_t capturing;    /* stream handle -> (void *)1 while capturing */
    sim_graph_t *graph;     /* captured graphs (sim_capture.c); NULL until used */
    sim_map_t created_streams; /* stream_create'd handles -> (void *)(device + 1) */
    sim_map_t ipc_maps;     /* another process's memory mapped here -> its size (as pointer) */
    uint64_t next_stream;   /* created stream handles */
    bool ipc_shared;        /* backed memory in shared memory files */
    bool no_peer_access;
    sim_range_t *live;      /* live allocations (address-only) and reservations */
    sim_range_t *spare;     /* cached nodes, linked through ->right */
    size_t spare_count;
    uint64_t *addr_list;    /* address list (replay) */
    size_t addr_count, addr_cap, addr_next;
    /* where the list grows from once it runs out (cca_sim_set_address_source), or NULL */
    cca_sim_address_source_fn addr_source;
    void *addr_source_ctx;
    uint64_t next_serial;   /* allocation serials and physical handles */
    uint32_t prio_state;    /* xorshift state for treap priorities */
    uint64_t ipc_id;        /* identity of this backend in IPC handles */
    uint64_t pending_events;
    uint64_t live_reservations, live_handles, live_host;
    uint64_t calls[CCA_OP_COUNT];
    sim_fault_t faults[CCA_OP_COUNT];
} sim_ctx_t;


/* ---- sim.c: address windows, memory (lock held) ---------------------------------- */

cca_status_t sim_bad_device(sim_ctx_t *c, cca_backend_op_t op, int device);
/* The error of a failed host allocation for bookkeeping (CCA_ERR_BACKEND). */
cca_status_t sim_host_oom(cca_backend_op_t op);
/* CCA_OK if size more bytes fit under the device's cap, else the OOM error. */
/* Bytes a device may hold: min(cap, total). */
size_t sim_device_limit(const sim_device_t *dev);
cca_status_t sim_check_capacity(sim_ctx_t *c, cca_backend_op_t op, int device, size_t size);
/* Make sure n tree nodes can be taken without allocating; false if out of memory. */
bool sim_spare_reserve(sim_ctx_t *c, size_t n);
/* A node from the spare list (NULL only if sim_spare_reserve was not called). */
sim_range_t *sim_spare_take(sim_ctx_t *c, uint64_t start, uint64_t len, int kind, void *data);
/* Give a tree node back to the spare list (or free it). */
void sim_spare_give(sim_ctx_t *c, sim_range_t *r);
/* Spares any single placement or release may need. */
size_t sim_spare_need(const sim_ctx_t *c);
/* Whether device was given access to the virtual memory mapping at addr (c locked). */
bool sim_vmm_access_of(sim_ctx_t *c, uint64_t addr, int device);
/*
 * Choose the address of a new live range of size bytes on device (address-only
 * mode) and insert its live node (kind, data); see sim.c. sim_spare_need()
 * spares must be reserved. Returns CCA_OK, CCA_ERR_BACKEND,
 * CCA_ERR_OUT_OF_MEMORY.
 */
cca_status_t sim_place_range(sim_ctx_t *c, cca_backend_op_t op, int device, uint64_t size,
                             uint64_t align, int kind, void *data, uint64_t *addr);
/* Remove the live range at start and give its address space back. */
void sim_unplace_range(sim_ctx_t *c, uint64_t start);
/*
 * A new allocation record of size bytes on device with its address (backed,
 * shared or address-only), not counted in the device's used bytes. Returns
 * CCA_OK, CCA_ERR_OUT_OF_MEMORY, CCA_ERR_BACKEND.
 */
cca_status_t sim_alloc_locked(sim_ctx_t *c, cca_backend_op_t op, int device, size_t size,
                              sim_alloc_t **out);
/* Release the memory behind a record (not the record, not the map entry). */
void sim_alloc_memory_release(sim_ctx_t *c, sim_alloc_t *rec);
/* Give an allocation's memory and record back (not its used bytes). */
void sim_alloc_release_locked(sim_ctx_t *c, sim_alloc_t *rec);
/* Install the device and memory operations into the table. */
void sim_memory_install(cca_backend_t *b);

/* ---- sim_events.c (lock held) ------------------------------------------------------ */

/* Take a pending event off its stream's list (it stays live). */
void sim_event_unlink(sim_ctx_t *c, sim_event_t *e);
/* A new, completed event of device. CCA_OK or the host-memory error. */
cca_status_t sim_event_new_locked(sim_ctx_t *c, cca_backend_op_t op, int device, sim_event_t **out);
/* The live event of handle on device, or NULL after recording the error in *st. */
sim_event_t *sim_find_event(sim_ctx_t *c, cca_backend_op_t op, int device, cca_event_t event,
                            cca_status_t *st);
/* Complete the events of s recorded up to and including last (NULL: all). */
void sim_stream_complete_locked(sim_ctx_t *c, sim_stream_t *s, sim_event_t *last);
/* Complete every pending event of device. */
void sim_device_complete_locked(sim_ctx_t *c, int device);
/* The stream record of handle on device, made (not manual) if new; NULL: out of host memory. */
sim_stream_t *sim_stream_get_locked(sim_ctx_t *c, int device, cca_stream_t stream);
/* Install the event and stream synchronization operations into the table. */
void sim_events_install(cca_backend_t *b);

/* ---- sim_vmm.c, sim_host.c ----------------------------------------------------------- */

/* Install the virtual memory operations into the table. */
void sim_vmm_install(cca_backend_t *b);
/* Install the host memory and IPC operations into the table. */
void sim_host_install(cca_backend_t *b);

/* ---- sim_create.c ------------------------------------------------------------------ */

/* Release everything the backend holds, leaked allocations included. */
void sim_destroy(void *ctx);
/* Append count addresses to the list (lock held or not yet shared). Returns
 * CCA_OK, CCA_ERR_INVALID_ARGUMENT, CCA_ERR_OUT_OF_MEMORY. */
cca_status_t sim_append_addresses(sim_ctx_t *c, const uint64_t *addresses, size_t count);

/* ---- sim_control.c ------------------------------------------------------------------ */

/* Count a call of op and fire its injected fault, if due (lock held). */
cca_status_t sim_enter_locked(sim_ctx_t *c, cca_backend_op_t op);

/* ---- sim_capture.c ------------------------------------------------------------------- */

/*
 * The modelled capture stream is in, as a stream-ordered allocation or free
 * sees it (lock held): *capture_id gets its id (0: stream is not in one). With
 * add_node, the call becomes a node of the capture on stream (cudaMallocAsync
 * and cudaFreeAsync nodes). Returns false when out of host memory.
 */
bool sim_capture_node_locked(sim_ctx_t *c, cca_stream_t stream, bool add_node, uint64_t *capture_id);
/* Install stream_capture_info and graph_node_dependencies; free the graph state. */
void sim_capture_install(cca_backend_t *b);
void sim_capture_free(sim_ctx_t *c);

/* ---- sim_multi.c ------------------------------------------------------------------- */

/* Install the peer, stream and pool operations into the table. */
void sim_multi_install(cca_backend_t *b);
/* A synchronisation point of device: its pool gives back memory above its threshold. */
void sim_pool_sync_locked(sim_ctx_t *c, int device);

#endif /* CCA_SIMULATOR_H */
