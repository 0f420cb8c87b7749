/* A stand-in for libnccl.so.2 for tests/capi_nccl.rs: the few NCCL calls the test app and the
 * interposer use, on host memory, between processes, through files (slow, simple, obviously
 * right). Built as libnccl.so.2.
 *
 * - ncclGetUniqueId makes a fresh folder under $FAKE_NCCL_DIR (or /tmp); the id holds its path.
 * - Collective number k of a communicator: rank r writes its contribution to
 *   <folder>/op<k>.r<r> (written to a temporary name, then renamed, so readers never see half
 *   a file); the ranks that need it wait for it (60 s at most) and read it.
 * - Every call is appended as one line to $FAKE_NCCL_LOG, if set:
 *   "pid=P rank=R FUNCTION key=value..." so the test can see which calls reached NCCL. */
#include "fake_nccl.h"

#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

struct ncclComm {
    char dir[120];
    int nranks;
    int rank;
    long seq;
};

static void log_call(const ncclComm_t comm, const char* fmt, ...) {
    const char* path = getenv("FAKE_NCCL_LOG");
    if (!path) return;
    char line[512];
    int n = snprintf(line, sizeof line, "pid=%d rank=%d ", (int)getpid(), comm ? comm->rank : -1);
    va_list ap;
    va_start(ap, fmt);
    n += vsnprintf(line + n, sizeof line - n - 1, fmt, ap);
    va_end(ap);
    line[n++] = '\n';
    int fd = open(path, O_WRONLY | O_CREAT | O_APPEND, 0644);
    if (fd >= 0) {
        /* One write per line with O_APPEND: lines from several processes never interleave. */
        if (write(fd, line, n) != n) perror("fake nccl: log");
        close(fd);
    }
}

static size_t type_size(ncclDataType_t t) {
    static const size_t sizes[] = {1, 1, 4, 4, 8, 8, 2, 4, 8, 2, 1, 1};
    return (t >= 0 && t < ncclNumTypes) ? sizes[t] : 0;
}

static ncclResult_t put(const ncclComm_t comm, long seq, const void* data, size_t bytes) {
    char path[256], tmp[260];
    snprintf(path, sizeof path, "%s/op%ld.r%d", comm->dir, seq, comm->rank);
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    FILE* f = fopen(tmp, "wb");
    if (!f) return ncclSystemError;
    if (bytes && fwrite(data, 1, bytes, f) != bytes) { fclose(f); return ncclSystemError; }
    if (fclose(f) != 0 || rename(tmp, path) != 0) return ncclSystemError;
    return ncclSuccess;
}

static ncclResult_t get(const ncclComm_t comm, long seq, int from, void* data, size_t bytes) {
    char path[256];
    snprintf(path, sizeof path, "%s/op%ld.r%d", comm->dir, seq, from);
    for (int tries = 0; tries < 300000; tries++) {
        FILE* f = fopen(path, "rb");
        if (f) {
            size_t n = bytes ? fread(data, 1, bytes, f) : 0;
            fclose(f);
            if (n != bytes) {
                fprintf(stderr, "fake nccl: %s has %zu bytes, expected %zu\n", path, n, bytes);
                return ncclInvalidUsage;
            }
            return ncclSuccess;
        }
        usleep(200);
    }
    fprintf(stderr, "fake nccl: rank %d waited 60 s for %s\n", comm->rank, path);
    return ncclSystemError;
}

ncclResult_t ncclGetUniqueId(ncclUniqueId* id) {
    log_call(NULL, "ncclGetUniqueId");
    if (!id) return ncclInvalidArgument;
    const char* base = getenv("FAKE_NCCL_DIR");
    memset(id, 0, sizeof *id);
    snprintf(id->internal, sizeof id->internal, "%s/fakenccl-XXXXXX", base ? base : "/tmp");
    if (!mkdtemp(id->internal)) return ncclSystemError;
    return ncclSuccess;
}

ncclResult_t ncclCommInitRank(ncclComm_t* comm, int nranks, ncclUniqueId id, int rank) {
    log_call(NULL, "ncclCommInitRank nranks=%d rank=%d", nranks, rank);
    if (!comm || nranks < 1 || rank < 0 || rank >= nranks) return ncclInvalidArgument;
    struct ncclComm* c = calloc(1, sizeof *c);
    memcpy(c->dir, id.internal, sizeof c->dir - 1);
    c->nranks = nranks;
    c->rank = rank;
    *comm = c;
    return ncclSuccess;
}

ncclResult_t ncclCommCount(const ncclComm_t comm, int* count) {
    log_call(comm, "ncclCommCount");
    if (!comm || !count) return ncclInvalidArgument;
    *count = comm->nranks;
    return ncclSuccess;
}

ncclResult_t ncclCommUserRank(const ncclComm_t comm, int* rank) {
    log_call(comm, "ncclCommUserRank");
    if (!comm || !rank) return ncclInvalidArgument;
    *rank = comm->rank;
    return ncclSuccess;
}

ncclResult_t ncclCommDestroy(ncclComm_t comm) {
    log_call(comm, "ncclCommDestroy");
    free(comm);
    return ncclSuccess;
}

const char* ncclGetErrorString(ncclResult_t r) {
    return r == ncclSuccess ? "no error" : "fake nccl error";
}

ncclResult_t ncclBroadcast(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype, int root,
                           ncclComm_t comm, cudaStream_t stream) {
    log_call(comm, "ncclBroadcast count=%zu datatype=%d root=%d", count, (int)datatype, root);
    size_t es = type_size(datatype);
    if (!comm || !es || root < 0 || root >= comm->nranks) return ncclInvalidArgument;
    long seq = ++comm->seq;
    size_t bytes = count * es;
    if (comm->rank == root) {
        if (sendbuff != recvbuff) memmove(recvbuff, sendbuff, bytes);
        return put(comm, seq, recvbuff, bytes);
    }
    return get(comm, seq, root, recvbuff, bytes);
}

/* Both exported names call this directly: a call from one exported function to another would
 * go through the PLT and could land in an interposer again. */
static ncclResult_t all_gather(const char* name, const void* sendbuff, void* recvbuff, size_t sendcount,
                               ncclDataType_t datatype, ncclComm_t comm) {
    log_call(comm, "%s count=%zu datatype=%d", name, sendcount, (int)datatype);
    size_t es = type_size(datatype);
    if (!comm || !es) return ncclInvalidArgument;
    long seq = ++comm->seq;
    size_t bytes = sendcount * es;
    ncclResult_t r = put(comm, seq, sendbuff, bytes);
    if (r != ncclSuccess) return r;
    for (int i = 0; i < comm->nranks; i++) {
        r = get(comm, seq, i, (char*)recvbuff + (size_t)i * bytes, bytes);
        if (r != ncclSuccess) return r;
    }
    return ncclSuccess;
}

ncclResult_t ncclAllGather(const void* sendbuff, void* recvbuff, size_t sendcount, ncclDataType_t datatype,
                           ncclComm_t comm, cudaStream_t stream) {
    return all_gather("ncclAllGather", sendbuff, recvbuff, sendcount, datatype, comm);
}

ncclResult_t pncclAllGather(const void* sendbuff, void* recvbuff, size_t sendcount, ncclDataType_t datatype,
                            ncclComm_t comm, cudaStream_t stream) {
    return all_gather("pncclAllGather", sendbuff, recvbuff, sendcount, datatype, comm);
}
