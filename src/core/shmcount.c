/*
 * shmcount.c - reference counters in memory shared between processes, for
 * IPC: the process that shares a block keeps a slot per handle it made in
 * a file of its own (an anonymous memfd), and a process that opened the
 * handle releases it when it lets go. Other processes reach the file through
 * /proc/<pid>/fd/<fd> of the owner, so no name is left behind in /dev/shm.
 *
 * A slot stands for one handle's reference and holds a serial and a holder:
 * the owner stamps a fresh serial when it takes the slot and sets the holder
 * to that serial when the handle is made (shmcount_hold); a release swaps the
 * holder from the handle's serial to 0 in one compare-and-swap. A second
 * release of the handle, or a release naming a slot given back and taken
 * again (another serial), finds no match: it is refused and writes nothing,
 * so no release ever drops a reference that is not its own.
 * A handle names the file by the owner's pid and descriptor number, and a
 * handle can be forged: before touching a file of another process, the
 * opener checks that it is one of these (a sealed memfd of exactly this
 * size whose header the owner wrote), so a forged handle cannot make it
 * write into some other file the owner holds open.
 * Invariant: the owner's `used` bitmap marks exactly the slots it has taken.
 * Thread-safe: one lock for the owner's files, one for the opened ones.
 */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "shmcount.h"

typedef struct shm_slot {
    _Atomic uint64_t holder; /* the serial while the handle's reference is held, else 0 */
    _Atomic uint64_t serial; /* stamped when the slot is taken; 0 while it is free */
} shm_slot_t;

/* The head of a counter file, written once by its owner before any handle names it. */
typedef struct shm_header {
    char magic[8];
    int32_t pid;         /* the owner */
    uint32_t slots;      /* SHMCOUNT_SLOTS */
    uint32_t slot_bytes; /* sizeof(shm_slot_t) */
    unsigned char zero[44];
} shm_header_t;

_Static_assert(sizeof(shm_header_t) == 64, "the counter file's header is one cache line");

/* "2": slots of one reference each (a holder); "1" counted references per block */
static const char shm_magic[8] = {'c', 'c', 'a', 'r', 'e', 'f', 's', '2'};

#define SHM_FILE_BYTES (sizeof(shm_header_t) + SHMCOUNT_SLOTS * sizeof(shm_slot_t))
/* A counter file's seals: its size is fixed for good (its mappings can never fault). */
#define SHM_SEALS (F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL)

typedef struct shm_file {
    pid_t pid; /* the process that made it (a forked child inherits the list, not the file) */
    int fd;
    shm_header_t *map; /* the whole file: the header, then the slots */
    shm_slot_t *slots;
    uint64_t used[SHMCOUNT_SLOTS / 64]; /* bit: slot taken */
    size_t used_count;
    struct shm_file *next;
} shm_file_t;

/* A file of another process, mapped here. */
typedef struct shm_foreign {
    int32_t pid, fd;
    shm_header_t *map;
    shm_slot_t *slots;
    struct shm_foreign *next;
} shm_foreign_t;

static pthread_mutex_t own_lock = PTHREAD_MUTEX_INITIALIZER;
static shm_file_t *own_files;
static uint64_t next_serial;
static pthread_mutex_t foreign_lock = PTHREAD_MUTEX_INITIALIZER;
static shm_foreign_t *foreign_files;

static cca_status_t new_file(shm_file_t **out)
{
    cca_status_t st;
    const char *call;
    int e;
    shm_file_t *f = calloc(1, sizeof(*f));
    if (!f)
        return cca_raise(CCA_ERR_OUT_OF_MEMORY, "out of host memory for IPC reference counters");
    f->fd = memfd_create("cca-ipc-refcounts", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (f->fd < 0) {
        int e = errno;
        free(f);
        return cca_raise(CCA_ERR_BACKEND, "IPC reference counters: memfd_create failed: %s",
                         strerror(e));
    }
    if (ftruncate(f->fd, (off_t)SHM_FILE_BYTES) != 0) {
        int e = errno;
        st = cca_raise(CCA_ERR_OUT_OF_MEMORY, "IPC reference counters: ftruncate failed: %s",
                       strerror(e));
        goto out_close;
    }
    if (fcntl(f->fd, F_ADD_SEALS, SHM_SEALS) != 0) {
        e = errno;
        call = "sealing the file";
        goto out_errno;
    }
    void *m = mmap(NULL, SHM_FILE_BYTES, PROT_READ | PROT_WRITE, MAP_SHARED, f->fd, 0);
    if (m == MAP_FAILED) {
        e = errno;
        call = "mmap";
        goto out_errno;
    }
    f->map = m;
    f->slots = (shm_slot_t *)(f->map + 1);
    f->pid = getpid();
    f->map->pid = (int32_t)f->pid;
    f->map->slots = SHMCOUNT_SLOTS;
    f->map->slot_bytes = sizeof(shm_slot_t);
    memcpy(f->map->magic, shm_magic, sizeof(shm_magic));
    *out = f;
    return CCA_OK;

out_errno:
    st = cca_raise(e == ENOMEM ? CCA_ERR_OUT_OF_MEMORY : CCA_ERR_BACKEND,
                   "IPC reference counters: %s failed: %s", call, strerror(e));
out_close:
    close(f->fd);
    free(f);
    return st;
}

/* Whether f is this process's own file: a forked child's copy of the list names its parent's
 * files, whose slots count the parent's references; the child neither takes nor gives them. */
static bool own_file(const shm_file_t *f)
{
    return f->pid == getpid();
}

cca_status_t shmcount_take(shmcount_ref_t *ref)
{
    pthread_mutex_lock(&own_lock);
    cca_status_t st = CCA_OK;
    shm_file_t *f = own_files;
    while (f && (f->used_count == SHMCOUNT_SLOTS || !own_file(f)))
        f = f->next;
    if (!f) {
        st = new_file(&f);
        if (st != CCA_OK)
            goto out_unlock;
        f->next = own_files;
        own_files = f;
    }
    for (uint32_t w = 0; w < SHMCOUNT_SLOTS / 64; w++) {
        if (f->used[w] == UINT64_MAX)
            continue;
        uint32_t b = (uint32_t)__builtin_ctzll(~f->used[w]);
        uint32_t slot = w * 64 + b;
        f->used[w] |= (uint64_t)1 << b;
        f->used_count++;
        uint64_t serial = ++next_serial;
        atomic_store(&f->slots[slot].holder, 0);
        atomic_store(&f->slots[slot].serial, serial);
        ref->pid = (int32_t)getpid();
        ref->fd = f->fd;
        ref->slot = slot;
        ref->serial = serial;
        break;
    }
out_unlock:
    pthread_mutex_unlock(&own_lock);
    return st;
}

static shm_slot_t *own_slot_locked(const shmcount_ref_t *ref)
{
    for (shm_file_t *f = own_files; f; f = f->next)
        if (f->fd == ref->fd && ref->slot < SHMCOUNT_SLOTS && own_file(f) &&
            atomic_load(&f->slots[ref->slot].serial) == ref->serial)
            return &f->slots[ref->slot];
    return NULL;
}

void shmcount_hold(const shmcount_ref_t *ref)
{
    pthread_mutex_lock(&own_lock);
    shm_slot_t *s = own_slot_locked(ref);
    if (s)
        atomic_store(&s->holder, ref->serial);
    pthread_mutex_unlock(&own_lock);
}

bool shmcount_held(const shmcount_ref_t *ref)
{
    pthread_mutex_lock(&own_lock);
    shm_slot_t *s = own_slot_locked(ref);
    bool held = s && atomic_load(&s->holder) == ref->serial;
    pthread_mutex_unlock(&own_lock);
    return held;
}

/* The one release of the reference ref names, or a refusal that writes nothing. */
static cca_status_t slot_release(shm_slot_t *s, const shmcount_ref_t *ref)
{
    uint64_t expected = ref->serial;
    if (s && ref->serial && atomic_compare_exchange_strong(&s->holder, &expected, 0))
        return CCA_OK;
    return cca_raise(CCA_ERR_INVALID_ARGUMENT,
                     "cca_ipc_release_handle: the handle's reference was released already (by "
                     "a release or a close), or its block was freed: a handle is released once");
}

cca_status_t shmcount_drop(const shmcount_ref_t *ref)
{
    pthread_mutex_lock(&own_lock);
    cca_status_t st = slot_release(own_slot_locked(ref), ref);
    pthread_mutex_unlock(&own_lock);
    return st;
}

void shmcount_give_back(const shmcount_ref_t *ref)
{
    pthread_mutex_lock(&own_lock);
    for (shm_file_t *f = own_files; f; f = f->next) {
        if (f->fd != ref->fd || ref->slot >= SHMCOUNT_SLOTS || !own_file(f))
            continue;
        uint64_t bit = (uint64_t)1 << (ref->slot % 64);
        if ((f->used[ref->slot / 64] & bit) &&
            atomic_load(&f->slots[ref->slot].serial) == ref->serial) {
            atomic_store(&f->slots[ref->slot].serial, 0);
            f->used[ref->slot / 64] &= ~bit;
            f->used_count--;
        }
        break;
    }
    pthread_mutex_unlock(&own_lock);
}

/* A handle naming path of process pid as its counters, which is some other file. */
static cca_status_t refuse_foreign(int32_t pid, const char *path)
{
    return cca_raise(CCA_ERR_INVALID_ARGUMENT,
                     "the handle names %s of process %d as its reference counters, which is not "
                     "a cca counter file: a forged or corrupt handle",
                     path, (int)pid);
}

/*
 * Map the counter file a handle names (descriptor fd of process pid) after
 * checking that it is one: a sealed regular file of SHM_FILE_BYTES whose
 * header names that process. Nothing is written to it. Returns CCA_OK,
 * CCA_ERR_INVALID_ARGUMENT (some other file: a forged or corrupt handle),
 * CCA_ERR_BACKEND (it cannot be reached: the owner exited),
 * CCA_ERR_OUT_OF_MEMORY.
 */
static cca_status_t map_foreign(int32_t pid, int32_t fd, shm_header_t **out)
{
    char path[64];
    snprintf(path, sizeof(path), "/proc/%d/fd/%d", (int)pid, (int)fd);
    struct stat sb;
    int file = -1;
    /* The target's kind and size before it is opened: opening a device or a FIFO may act. */
    if (stat(path, &sb) == 0) {
        if (!S_ISREG(sb.st_mode) || sb.st_size != (off_t)SHM_FILE_BYTES)
            return refuse_foreign(pid, path);
        file = open(path, O_RDWR | O_CLOEXEC);
    }
    if (file < 0) {
        int e = errno;
        return cca_raise(CCA_ERR_BACKEND,
                         "cannot reach the reference counters of process %d (%s: %s); "
                         "it may have exited",
                         (int)pid, path, strerror(e));
    }
    cca_status_t st = CCA_OK;
    int seals = fcntl(file, F_GET_SEALS);
    /* Sealed against resizing (a memfd's seals): the mapping cannot fault past the file's end. */
    if (fstat(file, &sb) != 0 || !S_ISREG(sb.st_mode) || sb.st_size != (off_t)SHM_FILE_BYTES ||
        seals < 0 || (seals & SHM_SEALS) != SHM_SEALS) {
        st = refuse_foreign(pid, path);
        goto out_close;
    }
    void *m = mmap(NULL, SHM_FILE_BYTES, PROT_READ | PROT_WRITE, MAP_SHARED, file, 0);
    if (m == MAP_FAILED) {
        st = cca_raise(CCA_ERR_OUT_OF_MEMORY, "cannot map the reference counters of process %d",
                       (int)pid);
        goto out_close;
    }
    const shm_header_t *head = m;
    if (memcmp(head->magic, shm_magic, sizeof(shm_magic)) != 0 || head->pid != pid ||
        head->slots != SHMCOUNT_SLOTS || head->slot_bytes != sizeof(shm_slot_t)) {
        munmap(m, SHM_FILE_BYTES);
        st = refuse_foreign(pid, path);
        goto out_close;
    }
    *out = m;
out_close:
    close(file);
    return st;
}

/* What foreign_access does with another process's counter. */
typedef enum foreign_op {
    FOREIGN_CHECK,   /* check that the file is a counter file and the reference held */
    FOREIGN_RELEASE, /* release it (refused when released already or the slot was reused) */
} foreign_op_t;

static cca_status_t foreign_access(const shmcount_ref_t *ref, foreign_op_t op)
{
    if (ref->slot >= SHMCOUNT_SLOTS)
        return cca_raise(CCA_ERR_INVALID_ARGUMENT, "IPC reference counter slot %u is out of range",
                         ref->slot);
    pthread_mutex_lock(&foreign_lock);
    cca_status_t st = CCA_OK;
    shm_foreign_t *f = foreign_files;
    while (f && !(f->pid == ref->pid && f->fd == ref->fd))
        f = f->next;
    if (!f) {
        shm_header_t *m = NULL;
        st = map_foreign(ref->pid, ref->fd, &m);
        if (st != CCA_OK)
            goto out_unlock;
        f = calloc(1, sizeof(*f));
        if (!f) {
            munmap(m, SHM_FILE_BYTES);
            st = cca_raise(CCA_ERR_OUT_OF_MEMORY,
                           "out of host memory for the reference counters of process %d",
                           (int)ref->pid);
            goto out_unlock;
        }
        f->pid = ref->pid;
        f->fd = ref->fd;
        f->map = m;
        f->slots = (shm_slot_t *)(m + 1);
        f->next = foreign_files;
        foreign_files = f;
    }
    shm_slot_t *s = &f->slots[ref->slot];
    if (op == FOREIGN_RELEASE) {
        st = slot_release(s, ref);
    } else if (op == FOREIGN_CHECK && (!ref->serial || atomic_load(&s->holder) != ref->serial)) {
        st = cca_raise(CCA_ERR_INVALID_ARGUMENT,
                       "the block of process %d this handle names was freed (a stale handle, "
                       "or one opened and closed already)",
                       (int)ref->pid);
    }
out_unlock:
    pthread_mutex_unlock(&foreign_lock);
    return st;
}

cca_status_t shmcount_release_foreign(const shmcount_ref_t *ref)
{
    return foreign_access(ref, FOREIGN_RELEASE);
}

cca_status_t shmcount_check_foreign(const shmcount_ref_t *ref)
{
    return foreign_access(ref, FOREIGN_CHECK);
}

void shmcount_shutdown(void)
{
    pthread_mutex_lock(&foreign_lock);
    while (foreign_files) {
        shm_foreign_t *f = foreign_files;
        foreign_files = f->next;
        munmap(f->map, SHM_FILE_BYTES);
        free(f);
    }
    pthread_mutex_unlock(&foreign_lock);
    pthread_mutex_lock(&own_lock);
    shm_file_t **link = &own_files;
    while (*link) {
        shm_file_t *f = *link;
        if (f->used_count && own_file(f)) { /* slots still taken: keep the file */
            link = &f->next;
            continue;
        }
        *link = f->next;
        munmap(f->map, SHM_FILE_BYTES);
        close(f->fd);
        free(f);
    }
    pthread_mutex_unlock(&own_lock);
}
