/* A stand-in for the CUDA driver, built as libcuda.so.1 by tests/capi_device.rs: the entry
 * points of the device-memory Allgather (src/capi/device.rs, src/gpu/stream.rs) and of its
 * test programs, with CUDA's semantics on host memory, so the whole host side of the GPU path
 * runs in CI, multi-process, without a GPU. Nothing here is a GPU figure.
 *
 * - Device memory (cuMemAlloc) is a memfd mapping, so another process can map it: a legacy IPC
 *   handle (cuIpcGetMemHandle) holds the owner's pid and descriptor, and cuIpcOpenMemHandle
 *   opens /proc/<pid>/fd/<fd>. cuPointerGetAttribute says "device" for it and for IPC
 *   mappings, "host" for pinned memory, CUDA_ERROR_INVALID_VALUE for anything else.
 * - A stream is a thread running its operations in order (copies, host functions, event
 *   records, waits on events and on 32-bit values); stream 0 runs them in the caller at once.
 *   Copies check that their device side lies in device memory, as a GPU would fault.
 * - standin_cuda_counts() says how many of each kind of handle are live, for leak checks.
 * - STANDIN_CUDA_COPY_DELAY_US=N makes every stream copy sleep N microseconds first, so a
 *   caller that does not order its work after a copy sees the old bytes. */
#define _GNU_SOURCE
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef void (*CUhostFn)(void*);
typedef struct {
    char reserved[64];
} CUipcMemHandle;

enum {
    OK = 0,
    INVALID_VALUE = 1,
    OUT_OF_MEMORY = 2,
    INVALID_CONTEXT = 201,
    MAP_FAILED_ERR = 205,
    INVALID_HANDLE = 400,
    NOT_READY = 600,
};

/* ---- memory ---------------------------------------------------------------------------- */

enum { DEV = 0, IPC = 1, PINNED = 2, KINDS_MEM = 3 };

struct alloc {
    uintptr_t base;
    size_t len, map_len;
    int fd, kind;
    struct alloc* next;
};

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static struct alloc* g_allocs;
static long g_counts[5]; /* device, ipc, pinned, streams, events */

void standin_cuda_counts(long out[5]) {
    pthread_mutex_lock(&g_lock);
    memcpy(out, g_counts, sizeof g_counts);
    pthread_mutex_unlock(&g_lock);
}

static void count(int what, long d) {
    pthread_mutex_lock(&g_lock);
    g_counts[what] += d;
    pthread_mutex_unlock(&g_lock);
}

static void add_alloc(uintptr_t base, size_t len, size_t map_len, int fd, int kind) {
    struct alloc* a = calloc(1, sizeof *a);
    a->base = base;
    a->len = len;
    a->map_len = map_len;
    a->fd = fd;
    a->kind = kind;
    pthread_mutex_lock(&g_lock);
    a->next = g_allocs;
    g_allocs = a;
    g_counts[kind]++;
    pthread_mutex_unlock(&g_lock);
}

/* Removes and returns the allocation of `kind` starting at `base`, or NULL. */
static struct alloc* take_alloc(uintptr_t base, int kind) {
    pthread_mutex_lock(&g_lock);
    struct alloc** p = &g_allocs;
    while (*p && !((*p)->base == base && (*p)->kind == kind)) p = &(*p)->next;
    struct alloc* a = *p;
    if (a) {
        *p = a->next;
        g_counts[kind]--;
    }
    pthread_mutex_unlock(&g_lock);
    return a;
}

/* The kind of memory [p, p+n) lies in (one allocation), or -1. */
static int kind_of(uintptr_t p, size_t n) {
    int kind = -1;
    pthread_mutex_lock(&g_lock);
    for (struct alloc* a = g_allocs; a; a = a->next)
        if (p >= a->base && p - a->base <= a->len && n <= a->len - (p - a->base)) {
            kind = a->kind;
            break;
        }
    pthread_mutex_unlock(&g_lock);
    return kind;
}

static int is_device(CUdeviceptr p, size_t n) {
    int k = kind_of((uintptr_t)p, n);
    return k == DEV || k == IPC;
}

static size_t page_round(size_t n) {
    size_t pg = (size_t)sysconf(_SC_PAGESIZE);
    return n == 0 ? pg : (n + pg - 1) / pg * pg;
}

CUresult cuMemAlloc_v2(CUdeviceptr* dptr, size_t bytes) {
    if (!dptr || bytes == 0) return INVALID_VALUE;
    size_t len = page_round(bytes);
    int fd = memfd_create("standin-cuda", MFD_CLOEXEC);
    if (fd < 0) return OUT_OF_MEMORY;
    if (ftruncate(fd, (off_t)len) != 0) {
        close(fd);
        return OUT_OF_MEMORY;
    }
    void* p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
        close(fd);
        return OUT_OF_MEMORY;
    }
    add_alloc((uintptr_t)p, bytes, len, fd, DEV);
    *dptr = (CUdeviceptr)(uintptr_t)p;
    return OK;
}

CUresult cuMemFree_v2(CUdeviceptr dptr) {
    struct alloc* a = take_alloc((uintptr_t)dptr, DEV);
    if (!a) return INVALID_VALUE;
    munmap((void*)a->base, a->map_len);
    close(a->fd);
    free(a);
    return OK;
}

CUresult cuMemAllocHost_v2(void** pp, size_t bytes) {
    if (!pp) return INVALID_VALUE;
    size_t len = page_round(bytes);
    void* p = NULL;
    if (posix_memalign(&p, 4096, len) != 0) return OUT_OF_MEMORY;
    memset(p, 0, len);
    add_alloc((uintptr_t)p, bytes ? bytes : 1, len, -1, PINNED);
    *pp = p;
    return OK;
}

CUresult cuMemHostAlloc(void** pp, size_t bytes, unsigned int flags) {
    (void)flags;
    return cuMemAllocHost_v2(pp, bytes);
}

CUresult cuMemFreeHost(void* p) {
    struct alloc* a = take_alloc((uintptr_t)p, PINNED);
    if (!a) return INVALID_VALUE;
    free(p);
    free(a);
    return OK;
}

CUresult cuMemHostGetDevicePointer_v2(CUdeviceptr* d, void* p, unsigned int flags) {
    if (!d || flags != 0 || kind_of((uintptr_t)p, 1) != PINNED) return INVALID_VALUE;
    *d = (CUdeviceptr)(uintptr_t)p;
    return OK;
}

CUresult cuPointerGetAttribute(void* data, int attribute, CUdeviceptr ptr) {
    if (attribute != 2 /* CU_POINTER_ATTRIBUTE_MEMORY_TYPE */ || !data) return INVALID_VALUE;
    int k = kind_of((uintptr_t)ptr, 1);
    if (k < 0) return INVALID_VALUE; /* memory no context knows */
    *(unsigned int*)data = k == PINNED ? 1 /* HOST */ : 2 /* DEVICE */;
    return OK;
}

/* ---- legacy IPC ------------------------------------------------------------------------ */

struct handle {
    char magic[8];
    int64_t pid;
    int64_t fd;
    uint64_t len;
};

CUresult cuIpcGetMemHandle(CUipcMemHandle* h, CUdeviceptr dptr) {
    if (!h) return INVALID_VALUE;
    struct handle x;
    memset(&x, 0, sizeof x);
    pthread_mutex_lock(&g_lock);
    for (struct alloc* a = g_allocs; a; a = a->next)
        if (a->kind == DEV && a->base == (uintptr_t)dptr) {
            x.fd = a->fd;
            x.len = a->len;
        }
    pthread_mutex_unlock(&g_lock);
    if (x.len == 0) return INVALID_VALUE;
    memcpy(x.magic, "STANDIN", 8);
    x.pid = getpid();
    memset(h, 0, sizeof *h);
    memcpy(h->reserved, &x, sizeof x);
    return OK;
}

CUresult cuIpcOpenMemHandle_v2(CUdeviceptr* dptr, CUipcMemHandle h, unsigned int flags) {
    (void)flags;
    struct handle x;
    memcpy(&x, h.reserved, sizeof x);
    if (!dptr || memcmp(x.magic, "STANDIN", 8) != 0) return INVALID_VALUE;
    if (x.pid == getpid()) return INVALID_CONTEXT; /* as CUDA: not in the exporting process */
    char path[64];
    snprintf(path, sizeof path, "/proc/%lld/fd/%lld", (long long)x.pid, (long long)x.fd);
    int fd = open(path, O_RDWR | O_CLOEXEC);
    if (fd < 0) return MAP_FAILED_ERR;
    size_t len = page_round(x.len);
    void* p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
        close(fd);
        return MAP_FAILED_ERR;
    }
    add_alloc((uintptr_t)p, x.len, len, fd, IPC);
    *dptr = (CUdeviceptr)(uintptr_t)p;
    return OK;
}

CUresult cuIpcCloseMemHandle(CUdeviceptr dptr) {
    struct alloc* a = take_alloc((uintptr_t)dptr, IPC);
    if (!a) return INVALID_VALUE;
    munmap((void*)a->base, a->map_len);
    close(a->fd);
    free(a);
    return OK;
}

/* ---- contexts ---------------------------------------------------------------------------- */

static __thread void* t_ctx;
static char g_primary;

CUresult cuInit(unsigned int flags) { return flags == 0 ? OK : INVALID_VALUE; }
CUresult cuDeviceGet(int* dev, int ordinal) {
    if (!dev || ordinal != 0) return INVALID_VALUE;
    *dev = 0;
    return OK;
}
CUresult cuDevicePrimaryCtxRetain(void** ctx, int dev) {
    if (!ctx || dev != 0) return INVALID_VALUE;
    *ctx = &g_primary;
    return OK;
}
CUresult cuCtxSetCurrent(void* ctx) {
    t_ctx = ctx;
    return OK;
}
CUresult cuCtxGetCurrent(void** ctx) {
    if (!ctx) return INVALID_VALUE;
    *ctx = t_ctx;
    return OK;
}

/* ---- events ------------------------------------------------------------------------------ */

struct event {
    pthread_mutex_t m;
    pthread_cond_t c;
    unsigned long long recorded, completed;
};

CUresult cuEventCreate(struct event** ev, unsigned int flags) {
    (void)flags;
    if (!ev) return INVALID_VALUE;
    struct event* e = calloc(1, sizeof *e);
    pthread_mutex_init(&e->m, NULL);
    pthread_cond_init(&e->c, NULL);
    *ev = e;
    count(4, 1);
    return OK;
}

CUresult cuEventDestroy_v2(struct event* e) {
    if (!e) return INVALID_HANDLE;
    pthread_mutex_destroy(&e->m);
    pthread_cond_destroy(&e->c);
    free(e);
    count(4, -1);
    return OK;
}

static void event_complete(struct event* e, unsigned long long target) {
    pthread_mutex_lock(&e->m);
    if (e->completed < target) e->completed = target;
    pthread_cond_broadcast(&e->c);
    pthread_mutex_unlock(&e->m);
}

static void event_wait(struct event* e, unsigned long long target) {
    pthread_mutex_lock(&e->m);
    while (e->completed < target) pthread_cond_wait(&e->c, &e->m);
    pthread_mutex_unlock(&e->m);
}

CUresult cuEventQuery(struct event* e) {
    if (!e) return INVALID_HANDLE;
    pthread_mutex_lock(&e->m);
    int done = e->completed >= e->recorded;
    pthread_mutex_unlock(&e->m);
    return done ? OK : NOT_READY;
}

CUresult cuEventSynchronize(struct event* e) {
    if (!e) return INVALID_HANDLE;
    pthread_mutex_lock(&e->m);
    unsigned long long target = e->recorded;
    pthread_mutex_unlock(&e->m);
    event_wait(e, target);
    return OK;
}

/* ---- streams ----------------------------------------------------------------------------- */

enum { OP_COPY, OP_SET, OP_HOST, OP_RECORD, OP_WAIT_EVENT, OP_WAIT_VALUE, OP_STOP };

struct op {
    int kind;
    void* dst;
    const void* src;
    size_t n;
    unsigned char byte;
    CUhostFn fn;
    void* arg;
    struct event* ev;
    unsigned long long target;
    volatile uint32_t* addr;
    uint32_t value;
    struct op* next;
};

struct stream {
    pthread_t th;
    pthread_mutex_t m;
    pthread_cond_t c;
    struct op *head, *tail;
    unsigned long long enqueued, done;
};

static long copy_delay_us(void) {
    static long d = -1;
    if (d < 0) {
        const char* s = getenv("STANDIN_CUDA_COPY_DELAY_US");
        d = s ? atol(s) : 0;
    }
    return d;
}

static void run_op(struct op* o) {
    switch (o->kind) {
    case OP_COPY:
        if (copy_delay_us() > 0) usleep((useconds_t)copy_delay_us());
        memmove(o->dst, o->src, o->n);
        break;
    case OP_SET: memset(o->dst, o->byte, o->n); break;
    case OP_HOST: o->fn(o->arg); break;
    case OP_RECORD: event_complete(o->ev, o->target); break;
    case OP_WAIT_EVENT: event_wait(o->ev, o->target); break;
    case OP_WAIT_VALUE:
        /* CU_STREAM_WAIT_VALUE_GEQ: (int32_t)(*addr - value) >= 0 */
        while ((int32_t)(__atomic_load_n(o->addr, __ATOMIC_ACQUIRE) - o->value) < 0) usleep(20);
        break;
    default: break;
    }
}

static void* stream_main(void* arg) {
    struct stream* s = arg;
    for (;;) {
        pthread_mutex_lock(&s->m);
        while (!s->head) pthread_cond_wait(&s->c, &s->m);
        struct op* o = s->head;
        pthread_mutex_unlock(&s->m);
        int stop = o->kind == OP_STOP;
        run_op(o);
        pthread_mutex_lock(&s->m);
        s->head = o->next;
        if (!s->head) s->tail = NULL;
        s->done++;
        pthread_cond_broadcast(&s->c);
        pthread_mutex_unlock(&s->m);
        free(o);
        if (stop) return NULL;
    }
}

static CUresult submit(struct stream* s, struct op o) {
    if (!s) {
        run_op(&o); /* stream 0: in the caller, now */
        return OK;
    }
    struct op* p = malloc(sizeof *p);
    *p = o;
    p->next = NULL;
    pthread_mutex_lock(&s->m);
    if (s->tail)
        s->tail->next = p;
    else
        s->head = p;
    s->tail = p;
    s->enqueued++;
    pthread_cond_broadcast(&s->c);
    pthread_mutex_unlock(&s->m);
    return OK;
}

CUresult cuStreamCreate(struct stream** out, unsigned int flags) {
    (void)flags;
    if (!out) return INVALID_VALUE;
    struct stream* s = calloc(1, sizeof *s);
    pthread_mutex_init(&s->m, NULL);
    pthread_cond_init(&s->c, NULL);
    if (pthread_create(&s->th, NULL, stream_main, s) != 0) {
        free(s);
        return OUT_OF_MEMORY;
    }
    *out = s;
    count(3, 1);
    return OK;
}

CUresult cuStreamSynchronize(struct stream* s) {
    if (!s) return OK;
    pthread_mutex_lock(&s->m);
    unsigned long long target = s->enqueued;
    while (s->done < target) pthread_cond_wait(&s->c, &s->m);
    pthread_mutex_unlock(&s->m);
    return OK;
}

CUresult cuStreamDestroy_v2(struct stream* s) {
    if (!s) return INVALID_HANDLE;
    struct op o = {.kind = OP_STOP};
    submit(s, o);
    pthread_join(s->th, NULL);
    pthread_mutex_destroy(&s->m);
    pthread_cond_destroy(&s->c);
    free(s);
    count(3, -1);
    return OK;
}

CUresult cuEventRecord(struct event* e, struct stream* s) {
    if (!e) return INVALID_HANDLE;
    pthread_mutex_lock(&e->m);
    unsigned long long target = ++e->recorded;
    pthread_mutex_unlock(&e->m);
    struct op o = {.kind = OP_RECORD, .ev = e, .target = target};
    return submit(s, o);
}

CUresult cuStreamWaitEvent(struct stream* s, struct event* e, unsigned int flags) {
    if (!e || flags != 0) return INVALID_VALUE;
    pthread_mutex_lock(&e->m);
    unsigned long long target = e->recorded;
    pthread_mutex_unlock(&e->m);
    struct op o = {.kind = OP_WAIT_EVENT, .ev = e, .target = target};
    return submit(s, o);
}

CUresult cuStreamWaitValue32_v2(struct stream* s, CUdeviceptr addr, uint32_t value, unsigned int flags) {
    if (flags != 0 /* CU_STREAM_WAIT_VALUE_GEQ */ || kind_of((uintptr_t)addr, 4) < 0) return INVALID_VALUE;
    struct op o = {.kind = OP_WAIT_VALUE, .addr = (volatile uint32_t*)(uintptr_t)addr, .value = value};
    return submit(s, o);
}

CUresult cuLaunchHostFunc(struct stream* s, CUhostFn fn, void* arg) {
    if (!fn) return INVALID_VALUE;
    struct op o = {.kind = OP_HOST, .fn = fn, .arg = arg};
    return submit(s, o);
}

static CUresult copy(struct stream* s, void* dst, const void* src, size_t n) {
    if (n == 0) return OK;
    struct op o = {.kind = OP_COPY, .dst = dst, .src = src, .n = n};
    return submit(s, o);
}

CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void* src, size_t n, struct stream* s) {
    if (n && (!src || !is_device(dst, n))) return INVALID_VALUE;
    return copy(s, (void*)(uintptr_t)dst, src, n);
}

CUresult cuMemcpyDtoHAsync_v2(void* dst, CUdeviceptr src, size_t n, struct stream* s) {
    if (n && (!dst || !is_device(src, n))) return INVALID_VALUE;
    return copy(s, dst, (const void*)(uintptr_t)src, n);
}

CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dst, CUdeviceptr src, size_t n, struct stream* s) {
    if (n && (!is_device(dst, n) || !is_device(src, n))) return INVALID_VALUE;
    return copy(s, (void*)(uintptr_t)dst, (const void*)(uintptr_t)src, n);
}

CUresult cuMemsetD8Async(CUdeviceptr dst, unsigned char value, size_t n, struct stream* s) {
    if (n && !is_device(dst, n)) return INVALID_VALUE;
    struct op o = {.kind = OP_SET, .dst = (void*)(uintptr_t)dst, .n = n, .byte = value};
    return submit(s, o);
}

CUresult cuGetErrorName(CUresult e, const char** name) {
    if (!name) return INVALID_VALUE;
    switch (e) {
    case OK: *name = "CUDA_SUCCESS"; break;
    case INVALID_VALUE: *name = "CUDA_ERROR_INVALID_VALUE"; break;
    case OUT_OF_MEMORY: *name = "CUDA_ERROR_OUT_OF_MEMORY"; break;
    case INVALID_CONTEXT: *name = "CUDA_ERROR_INVALID_CONTEXT"; break;
    case MAP_FAILED_ERR: *name = "CUDA_ERROR_MAP_FAILED"; break;
    case INVALID_HANDLE: *name = "CUDA_ERROR_INVALID_HANDLE"; break;
    case NOT_READY: *name = "CUDA_ERROR_NOT_READY"; break;
    default: return INVALID_VALUE;
    }
    return OK;
}
