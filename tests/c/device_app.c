/* Device-memory Allgather of real trace steps, for tests/capi_device.rs (against the stand-in
 * libcuda.so.1 of tests/c/standin_cuda.c) and bench/gpu_check.sh (against the real driver on
 * a GPU). Run by `ciera launch -n N`, whose CIERA_RANK / CIERA_NRANKS it reads.
 *
 *   device_app ID_FILE DATA_DIR [KILL_AT]
 *
 * Built two ways: against libciera.so (cieraCommInitFromEnv, cieraAllGather[Keyed]; ID_FILE
 * unused), or with -DUSE_NCCL against libnccl.so.2 (rank 0 makes the NCCL id and hands it out
 * through ID_FILE; ncclAllGather, served by libciera_nccl.so under LD_PRELOAD).
 *
 * Every bf16 tensor of every step file of DATA_DIR (the bundled OLMoE slice) is gathered from
 * device memory, each rank contributing its shard, with nothing but the stream ordering the
 * work: poison recv, (every third call) a 20 ms host function, copy the shard in, allgather,
 * copy recv out, then one cuStreamSynchronize. If the allgather read its input before the
 * stream reached it, or the copy out ran before the allgather's result, the bytes checked
 * would be the previous call's, or the poison. Every byte is checked. In and out of place
 * alternate.
 *
 * KILL_AT: rank 1 dies (SIGKILL) just before call KILL_AT; the others must see the failure
 * as an async error whose message names rank 1, then destroy the communicator.
 *
 * DEVICE_APP_BENCH_MIB=64,256 (bench/gpu_check.sh): then, per size gathered, the bf16
 * attention tensor of each step file tiled to that size, a timed series of allgathers
 * (DEVICE_APP_BENCH_ITERS, 10; each from synchronized stream to synchronized stream, the
 * next step's shard copied in untimed), the last one checked, and a device-to-device copy of
 * the same bytes as the bound: "device_app bench rank R: SIZE MiB ... busbw ... copy ...".
 *
 * At the end, with the stand-in, every driver handle (device and pinned memory, IPC
 * mappings, streams, events) must have been released. Prints
 * "device_app rank R: OK ..." or what went wrong (exit 1). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "cuda_api.h"

static int g_rank = -1;

#define FAIL(...)                                        \
    do {                                                 \
        fprintf(stderr, "device_app rank %d: ", g_rank); \
        fprintf(stderr, __VA_ARGS__);                    \
        fprintf(stderr, "\n");                           \
        exit(1);                                         \
    } while (0)

#define CU_OK(call)                                                   \
    do {                                                              \
        CUresult r_ = (call);                                         \
        if (r_ != CUDA_SUCCESS) FAIL("%s failed: %d", #call, (int)r_); \
    } while (0)

#include "olmoe_data.h"

#ifdef USE_NCCL
#include "fake_nccl.h"
typedef ncclComm_t comm_t;
#define API "nccl"
#else
#include <ciera.h>
typedef cieraComm_t comm_t;
#define API "ciera"
#endif

static comm_t init_comm(const char* id_file, int rank, int nranks) {
    comm_t comm;
#ifdef USE_NCCL
    ncclUniqueId id;
    if (rank == 0) {
        if (ncclGetUniqueId(&id) != ncclSuccess) FAIL("ncclGetUniqueId failed");
        char tmp[4096];
        snprintf(tmp, sizeof tmp, "%s.tmp", id_file);
        FILE* f = fopen(tmp, "wb");
        if (!f || fwrite(&id, sizeof id, 1, f) != 1 || fclose(f) != 0 || rename(tmp, id_file) != 0)
            FAIL("writing %s", id_file);
    } else {
        int ok = 0;
        for (int tries = 0; tries < 6000 && !ok; tries++) {
            FILE* f = fopen(id_file, "rb");
            if (f) {
                ok = fread(&id, sizeof id, 1, f) == 1;
                fclose(f);
            }
            if (!ok) usleep(10000);
        }
        if (!ok) FAIL("no id in %s", id_file);
    }
    if (ncclCommInitRank(&comm, nranks, id, rank) != ncclSuccess) FAIL("ncclCommInitRank failed");
#else
    (void)id_file;
    (void)rank;
    (void)nranks;
    cieraResult_t r = cieraCommInitFromEnv(&comm, NULL);
    if (r != cieraSuccess) FAIL("cieraCommInitFromEnv: %d %s", (int)r, cieraGetLastError(NULL));
#endif
    return comm;
}

static void gather(comm_t comm, CUdeviceptr send, CUdeviceptr recv, size_t count, int tensor, int call, CUstream s) {
#ifdef USE_NCCL
    (void)tensor;
    (void)call;
    ncclResult_t r = ncclAllGather((const void*)(uintptr_t)send, (void*)(uintptr_t)recv, count, ncclBfloat16, comm, s);
    if (r != ncclSuccess) FAIL("ncclAllGather (call %d): %d", call, (int)r);
#else
    cieraResult_t r = call % 4 < 2
        ? cieraAllGatherKeyed((const void*)(uintptr_t)send, (void*)(uintptr_t)recv, count, cieraBfloat16, 7 + tensor, comm, s)
        : cieraAllGather((const void*)(uintptr_t)send, (void*)(uintptr_t)recv, count, cieraBfloat16, comm, s);
    if (r != cieraSuccess) FAIL("cieraAllGather (call %d): %d %s", call, (int)r, cieraGetLastError(NULL));
#endif
}

/* The communicator's async error (0 if none), its message in `msg`. */
static int async_error(comm_t comm, const char** msg) {
    *msg = "";
#ifdef USE_NCCL
    (void)comm;
    return 0;
#else
    cieraResult_t e = cieraSuccess;
    if (cieraCommGetAsyncError(comm, &e) != cieraSuccess) FAIL("cieraCommGetAsyncError failed");
    if (e != cieraSuccess) *msg = cieraGetLastError(NULL);
    return (int)e;
#endif
}

static void destroy(comm_t comm) {
#ifdef USE_NCCL
    if (ncclCommDestroy(comm) != ncclSuccess) FAIL("ncclCommDestroy failed");
#else
    if (cieraCommDestroy(comm) != cieraSuccess) FAIL("cieraCommDestroy: %s", cieraGetLastError(NULL));
#endif
}

static void sleep_us(void* arg) { usleep((useconds_t)(uintptr_t)arg); }

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* With the stand-in driver: every handle released (the real driver has no such count). */
static void check_handles(int require_none) {
    void (*counts)(long*) = (void (*)(long*))dlsym(RTLD_DEFAULT, "standin_cuda_counts");
    if (!counts) return;
    long c[5];
    counts(c);
    if (require_none && (c[0] || c[1] || c[2] || c[3] || c[4]))
        FAIL("live driver handles after destroying everything: %ld device, %ld ipc, %ld pinned, %ld streams, "
             "%ld events", c[0], c[1], c[2], c[3], c[4]);
}

/* Tiles `src` (n elements) over `out` (len elements), starting at element `from` of the tiling. */
static void tile(uint16_t* out, size_t len, const uint16_t* src, size_t n, size_t from) {
    for (size_t i = 0; i < len; i++) out[i] = src[(from + i) % n];
}

/* The timed series of DEVICE_APP_BENCH_MIB (see the top of the file). */
static void bench(comm_t comm, int rank, int nranks, const char* dir, char** names, int nfiles, CUstream s) {
    const char* sizes = getenv("DEVICE_APP_BENCH_MIB");
    if (!sizes || !*sizes) return;
    int iters = getenv("DEVICE_APP_BENCH_ITERS") ? atoi(getenv("DEVICE_APP_BENCH_ITERS")) : 10;
    if (iters < 1) iters = 1;
    uint16_t* steps[64];
    size_t step_n[64];
    for (int fi = 0; fi < nfiles; fi++) {
        char path[4096];
        snprintf(path, sizeof path, "%s/%s", dir, names[fi]);
        step_n[fi] = load_bf16_tensor(path, "layers.1.attn.qkv.bf16", &steps[fi]);
    }
    char list[256];
    snprintf(list, sizeof list, "%s", sizes);
    for (char* tok = strtok(list, ","); tok; tok = strtok(NULL, ",")) {
        size_t mib = (size_t)atol(tok);
        size_t count = (mib << 20) / 2 / (size_t)nranks, bytes = count * 2, total = bytes * (size_t)nranks;
        if (count == 0) continue;
        CUdeviceptr send, recv, copy;
        CU_OK(cuMemAlloc_v2(&send, bytes));
        CU_OK(cuMemAlloc_v2(&recv, total));
        CU_OK(cuMemAlloc_v2(&copy, total));
        uint16_t* full = malloc(total);
        uint16_t* got = malloc(total);
        double sum = 0;
        int timed = 0;
        for (int it = 0; it < iters + 2; it++) {
            int fi = it % nfiles;
            tile(full, count * (size_t)nranks, steps[fi], step_n[fi], 0);
            CU_OK(cuMemcpyHtoDAsync_v2(send, full + (size_t)rank * count, bytes, s));
            CU_OK(cuStreamSynchronize(s));
            double t0 = now_s();
            gather(comm, send, recv, count, 5, 0, s);
            CU_OK(cuStreamSynchronize(s));
            double t = now_s() - t0;
            if (it >= 2) {
                sum += t;
                timed++;
            }
            const char* msg;
            if (async_error(comm, &msg) != 0) FAIL("bench %zu MiB: async error: %s", mib, msg);
        }
        CU_OK(cuMemcpyDtoHAsync_v2(got, recv, total, s));
        CU_OK(cuStreamSynchronize(s));
        if (memcmp(got, full, total) != 0) FAIL("bench %zu MiB: the last gathered tensor differs", mib);
        double t_copy = 1e30;
        for (int k = 0; k < 3; k++) {
            double t0 = now_s();
            CU_OK(cuMemcpyDtoDAsync_v2(copy, recv, total, s));
            CU_OK(cuStreamSynchronize(s));
            double t = now_s() - t0;
            if (t < t_copy) t_copy = t;
        }
        double mean = sum / timed;
        double busbw = (double)total * (nranks - 1) / nranks / mean / 1e9;
        double copy_bw = (double)total / t_copy / 1e9;
        printf("device_app bench rank %d: %zu MiB gathered by %d ranks: %.3f ms per call (mean of %d), busbw %.2f GB/s; "
               "device copy of %zu MiB %.3f ms = %.2f GB/s; busbw/copy %.2f; exact\n",
               rank, mib, nranks, 1e3 * mean, timed, busbw, total >> 20, 1e3 * t_copy, copy_bw, busbw / copy_bw);
        fflush(stdout);
        free(full);
        free(got);
        CU_OK(cuMemFree_v2(send));
        CU_OK(cuMemFree_v2(recv));
        CU_OK(cuMemFree_v2(copy));
    }
    for (int fi = 0; fi < nfiles; fi++) free(steps[fi]);
}

int main(int argc, char** argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: device_app ID_FILE DATA_DIR [KILL_AT]\n");
        return 2;
    }
    const char* rs = getenv("CIERA_RANK");
    const char* ns = getenv("CIERA_NRANKS");
    if (!rs || !ns) FAIL("CIERA_RANK / CIERA_NRANKS not set (run under ciera launch)");
    int rank = atoi(rs), nranks = atoi(ns);
    int kill_at = argc > 3 ? atoi(argv[3]) : -1;
    g_rank = rank;

    CUdevice dev;
    CUcontext ctx;
    CU_OK(cuInit(0));
    CU_OK(cuDeviceGet(&dev, 0));
    CU_OK(cuDevicePrimaryCtxRetain(&ctx, dev));
    CU_OK(cuCtxSetCurrent(ctx));
    comm_t comm = init_comm(argv[1], rank, nranks);

    char* names[64];
    int nfiles = list_step_files(argv[2], names, 64);
    if (nfiles == 0) FAIL("no step files in %s", argv[2]);
    const char* tensors[2] = {"layers.1.attn.qkv.bf16", "layers.1.experts.w1.bf16"};
    CUdeviceptr sendb[2] = {0, 0}, recvb[2] = {0, 0};
    uint16_t* host = NULL;
    size_t host_len = 0;
    CUstream s;
    CU_OK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));

    int call = 0;
    size_t bytes_total = 0;
    double t_gather = 0;
    for (int fi = 0; fi < nfiles; fi++) {
        char path[4096];
        snprintf(path, sizeof path, "%s/%s", argv[2], names[fi]);
        for (int ti = 0; ti < 2; ti++, call++) {
            uint16_t* full = NULL;
            size_t n = load_bf16_tensor(path, tensors[ti], &full);
            size_t count = n / (size_t)nranks, bytes = count * 2;
            if (count == 0) FAIL("%s has %zu elements, fewer than the ranks", tensors[ti], n);
            if (!recvb[ti]) {
                CU_OK(cuMemAlloc_v2(&sendb[ti], bytes));
                CU_OK(cuMemAlloc_v2(&recvb[ti], bytes * nranks));
            }
            if (host_len < bytes * nranks) {
                free(host);
                host_len = bytes * nranks;
                host = malloc(host_len);
            }
            if (call == kill_at && rank == 1) {
                fprintf(stderr, "device_app rank 1: dying before call %d\n", call);
                fflush(stderr);
                kill(getpid(), SIGKILL);
            }
            int in_place = call % 2 == 1;
            CUdeviceptr recv = recvb[ti], send = in_place ? recv + (CUdeviceptr)rank * bytes : sendb[ti];
            memset(host, 0x55, bytes * nranks);
            CU_OK(cuMemsetD8Async(recv, 0xEE, bytes * nranks, s));
            if (call % 3 == 0) CU_OK(cuLaunchHostFunc(s, sleep_us, (void*)(uintptr_t)20000));
            CU_OK(cuMemcpyHtoDAsync_v2(send, full + (size_t)rank * count, bytes, s));
            double t0 = now_s();
            gather(comm, send, recv, count, ti, call, s);
            t_gather += now_s() - t0;
            CU_OK(cuMemcpyDtoHAsync_v2(host, recv, bytes * nranks, s));
            CU_OK(cuStreamSynchronize(s));
            const char* msg;
            int e = async_error(comm, &msg);
            if (e != 0) {
                if (kill_at >= 0 && call >= kill_at) {
                    printf("device_app rank %d: failure reported at call %d: code %d: %s\n", rank, call, e, msg);
                    fflush(stdout);
                    destroy(comm);
                    free(full);
                    goto done;
                }
                FAIL("call %d (%s of %s): async error %d: %s", call, tensors[ti], names[fi], e, msg);
            }
            if (memcmp(host, full, bytes * nranks) != 0) {
                size_t i = 0;
                while (host[i] == full[i]) i++;
                FAIL("call %d (%s of %s, %s): element %zu (rank %zu's block) is %#06x, expected %#06x", call,
                     tensors[ti], names[fi], in_place ? "in place" : "out of place", i, i / count, host[i], full[i]);
            }
            bytes_total += bytes * nranks;
            free(full);
        }
    }
    if (kill_at >= 0) FAIL("rank 1 was killed before call %d, but no failure was reported", kill_at);
#ifndef USE_NCCL
    {
        cieraStats_t st = CIERA_STATS_INITIALIZER;
        if (cieraCommGetStats(comm, &st) != cieraSuccess) FAIL("cieraCommGetStats: %s", cieraGetLastError(NULL));
        if (st.calls != (uint64_t)call || st.failedCalls != 0)
            FAIL("stats: %llu calls (%llu failed), expected %d", (unsigned long long)st.calls,
                 (unsigned long long)st.failedCalls, call);
        printf("device_app rank %d: stats: %llu raw, %llu fill, %llu delta calls, wire %llu of %llu bytes\n", rank,
               (unsigned long long)st.rawCalls, (unsigned long long)st.fillCalls, (unsigned long long)st.deltaCalls,
               (unsigned long long)st.wireBytes, (unsigned long long)st.rawBytes);
    }
#endif
    bench(comm, rank, nranks, argv[2], names, nfiles, s);
    destroy(comm);
    printf("device_app rank %d: OK " API " %d calls of %d step files, %zu bytes gathered and checked, "
           "%.1f us per call to enqueue\n",
           rank, call, nfiles, bytes_total, 1e6 * t_gather / call);
done:
    CU_OK(cuStreamDestroy_v2(s));
    for (int ti = 0; ti < 2; ti++)
        if (recvb[ti]) {
            CU_OK(cuMemFree_v2(sendb[ti]));
            CU_OK(cuMemFree_v2(recvb[ti]));
        }
    free(host);
    for (int fi = 0; fi < nfiles; fi++) free(names[fi]);
    /* The interposer's CIERA twin of an NCCL communicator lives until the process ends (it
     * does not see ncclCommDestroy), so only the C ABI's handles must all be gone. */
#ifdef USE_NCCL
    check_handles(0);
#else
    check_handles(1);
#endif
    return 0;
}
