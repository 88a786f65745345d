/*
 * shmcount.c - reference counters in memory shared between processes, for
 * IPC: the process that shares a block keeps a counter per shared block in
 * a file of its own (an anonymous memfd), and a process that opened the block
 * decrements it when it lets go. Other processes reach the file through
 * /proc/<pid>/fd/<fd> of the owner, so no name is left behind in /dev/shm.
 *
 * A slot holds a count and a serial: the owner stamps a fresh serial when it
 * takes the slot, and a decrement whose serial does not match (the slot was
 * given back and taken again) is ignored, so a stale release never lowers
 * another block's count.
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
#include <unistd.h>

#include "shmcount.h"

typedef struct shm_slot {
    _Atomic int64_t count;
    _Atomic uint64_t serial;
} shm_slot_t;

#define SHM_FILE_BYTES (SHMCOUNT_SLOTS * sizeof(shm_slot_t))

typedef struct shm_file {
    pid_t pid; /* the process that made it (a forked child inherits the list, not the file) */
    int fd;
    shm_slot_t *slots;
    uint64_t used[SHMCOUNT_SLOTS / 64]; /* bit: slot taken */
    size_t used_count;
    struct shm_file *next;
} shm_file_t;

/* A file of another process, mapped here. */
typedef struct shm_foreign {
    int32_t pid, fd;
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
    shm_file_t *f = calloc(1, sizeof(*f));
    if (!f)
        return cca_raise(CCA_ERR_OUT_OF_MEMORY, "out of host memory for IPC reference counters");
    f->fd = memfd_create("cca-ipc-refcounts", MFD_CLOEXEC);
    if (f->fd < 0) {
        int e = errno;
        free(f);
        return cca_raise(CCA_ERR_BACKEND, "IPC reference counters: memfd_create failed: %s",
                         strerror(e));
    }
    if (ftruncate(f->fd, (off_t)SHM_FILE_BYTES) != 0) {
        int e = errno;
        close(f->fd);
        free(f);
        return cca_raise(CCA_ERR_OUT_OF_MEMORY, "IPC reference counters: ftruncate failed: %s",
                         strerror(e));
    }
    void *m = mmap(NULL, SHM_FILE_BYTES, PROT_READ | PROT_WRITE, MAP_SHARED, f->fd, 0);
    if (m == MAP_FAILED) {
        int e = errno;
        close(f->fd);
        free(f);
        return cca_raise(CCA_ERR_OUT_OF_MEMORY, "IPC reference counters: mmap failed: %s",
                         strerror(e));
    }
    f->slots = m;
    f->pid = getpid();
    *out = f;
    return CCA_OK;
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
        atomic_store(&f->slots[slot].count, 0);
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

void shmcount_add(const shmcount_ref_t *ref, int64_t delta)
{
    pthread_mutex_lock(&own_lock);
    shm_slot_t *s = own_slot_locked(ref);
    if (s)
        atomic_fetch_add(&s->count, delta);
    pthread_mutex_unlock(&own_lock);
}

int64_t shmcount_read(const shmcount_ref_t *ref)
{
    pthread_mutex_lock(&own_lock);
    shm_slot_t *s = own_slot_locked(ref);
    int64_t v = s ? atomic_load(&s->count) : 0;
    pthread_mutex_unlock(&own_lock);
    return v;
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

/* Decrement (release) or check the counter of another process. */
static cca_status_t foreign_access(const shmcount_ref_t *ref, bool release)
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
        char path[64];
        snprintf(path, sizeof(path), "/proc/%d/fd/%d", (int)ref->pid, (int)ref->fd);
        int fd = open(path, O_RDWR | O_CLOEXEC);
        if (fd < 0) {
            int e = errno;
            st = cca_raise(CCA_ERR_BACKEND,
                           "cannot reach the reference counters of process %d (%s: %s); "
                           "it may have exited",
                           (int)ref->pid, path, strerror(e));
            goto out_unlock;
        }
        void *m = mmap(NULL, SHM_FILE_BYTES, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        close(fd);
        f = m == MAP_FAILED ? NULL : calloc(1, sizeof(*f));
        if (!f) {
            if (m != MAP_FAILED)
                munmap(m, SHM_FILE_BYTES);
            st = cca_raise(CCA_ERR_OUT_OF_MEMORY, "cannot map the reference counters of process %d",
                           (int)ref->pid);
            goto out_unlock;
        }
        f->pid = ref->pid;
        f->fd = ref->fd;
        f->slots = m;
        f->next = foreign_files;
        foreign_files = f;
    }
    shm_slot_t *s = &f->slots[ref->slot];
    if (release) {
        if (atomic_load(&s->serial) == ref->serial)
            atomic_fetch_sub(&s->count, 1);
    } else if (atomic_load(&s->serial) != ref->serial || atomic_load(&s->count) <= 0) {
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
    return foreign_access(ref, true);
}

cca_status_t shmcount_check_foreign(const shmcount_ref_t *ref)
{
    return foreign_access(ref, false);
}

void shmcount_shutdown(void)
{
    pthread_mutex_lock(&foreign_lock);
    while (foreign_files) {
        shm_foreign_t *f = foreign_files;
        foreign_files = f->next;
        munmap(f->slots, SHM_FILE_BYTES);
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
        munmap(f->slots, SHM_FILE_BYTES);
        close(f->fd);
        free(f);
    }
    pthread_mutex_unlock(&own_lock);
}
