/* A C program using libciera.so through include/ciera.h, run by tests/capi_c.rs under
 * `ciera launch -n N`:
 *
 *   ciera_app env ITERS [OLMOE_DIR]        cieraCommInitFromEnv
 *   ciera_app id ID_FILE ITERS [OLMOE_DIR] rank 0: cieraGetUniqueId, written to ID_FILE;
 *                                          all: cieraCommInitRankConfig (rank from CIERA_RANK)
 *
 * It gathers drifting bf16 (and some fp32) data for ITERS iterations, in and out of place, with
 * odd and zero counts, checks every received byte, gathers the real bf16 weights of the
 * bundled OLMoE slice when OLMOE_DIR is given, checks the statistics, then checks the result
 * codes and cieraGetLastError messages of bad calls. Prints "ciera_app rank R: OK ..." and
 * exits 0, or says what differed and exits 1. */
#include <ciera.h>

#include <dirent.h>
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "bf16_data.h"

static int g_rank = -1;

#define FAIL(...)                                          \
    do {                                                   \
        fprintf(stderr, "ciera_app rank %d: ", g_rank);    \
        fprintf(stderr, __VA_ARGS__);                      \
        fprintf(stderr, "\n");                             \
        exit(1);                                           \
    } while (0)

#define CHECK_OK(call)                                                                     \
    do {                                                                                   \
        cieraResult_t r_ = (call);                                                         \
        if (r_ != cieraSuccess)                                                            \
            FAIL("%s failed: %d %s: %s", #call, (int)r_, cieraGetErrorString(r_),         \
                 cieraGetLastError(NULL));                                                 \
    } while (0)

/* A bad call must return `want` and leave a last-error message containing `needle`. */
#define EXPECT_ERR(call, want, needle)                                                     \
    do {                                                                                   \
        cieraResult_t r_ = (call);                                                         \
        const char* m_ = cieraGetLastError(NULL);                                          \
        if (r_ != (want)) FAIL("%s returned %d, expected %d (%s)", #call, (int)r_, (int)(want), m_); \
        if (strstr(m_, (needle)) == NULL)                                                  \
            FAIL("%s: message \"%s\" does not mention \"%s\"", #call, m_, (needle));      \
        n_error_checks++;                                                                  \
    } while (0)

static int n_error_checks = 0;

static int env_int(const char* name) {
    const char* v = getenv(name);
    if (!v) FAIL("%s is not set (run under `ciera launch`)", name);
    return atoi(v);
}

static void write_id(const char* path, const cieraUniqueId* id) {
    char tmp[4096];
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    FILE* f = fopen(tmp, "wb");
    if (!f || fwrite(id, sizeof *id, 1, f) != 1 || fclose(f) != 0) FAIL("writing %s: %s", tmp, strerror(errno));
    if (rename(tmp, path) != 0) FAIL("renaming %s: %s", tmp, strerror(errno));
}

static void read_id(const char* path, cieraUniqueId* id) {
    for (int tries = 0; tries < 6000; tries++) {
        FILE* f = fopen(path, "rb");
        if (f) {
            size_t n = fread(id, sizeof *id, 1, f);
            fclose(f);
            if (n == 1) return;
        }
        usleep(10000);
    }
    FAIL("no unique id appeared in %s within 60 s", path);
}

#include "olmoe_data.h"

/* Gathers the real bf16 weights of every step file in `dir`, each rank contributing its shard
 * of the tensor, keyed by the tensor's name; checks the gathered tensor byte for byte. */
static int gather_olmoe(cieraComm_t comm, int rank, int nranks, const char* dir, uint64_t* calls, uint64_t* recv_bytes) {
    char* names[64];
    int nfiles = list_step_files(dir, names, 64);
    const char* tensors[2] = {"layers.1.attn.qkv.bf16", "layers.1.experts.w1.bf16"};
    for (int fi = 0; fi < nfiles; fi++) {
        char path[4096];
        snprintf(path, sizeof path, "%s/%s", dir, names[fi]);
        for (int ti = 0; ti < 2; ti++) {
            uint16_t* full = NULL;
            size_t n = load_bf16_tensor(path, tensors[ti], &full);
            size_t count = n / nranks;
            uint16_t* recv = malloc(count * nranks * 2 + 2);
            memset(recv, 0xEE, count * nranks * 2);
            CHECK_OK(cieraAllGatherKeyed(full + rank * count, recv, count, cieraBfloat16, 1000 + ti, comm, NULL));
            if (memcmp(recv, full, count * nranks * 2) != 0) FAIL("olmoe %s %s: gathered tensor differs", names[fi], tensors[ti]);
            *calls += 1;
            *recv_bytes += count * nranks * 2;
            free(recv);
            free(full);
        }
        free(names[fi]);
    }
    return nfiles;
}

int main(int argc, char** argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: ciera_app env ITERS [OLMOE_DIR] | ciera_app id ID_FILE ITERS [OLMOE_DIR]\n");
        return 2;
    }
    int by_id = strcmp(argv[1], "id") == 0;
    int iters = atoi(argv[by_id ? 3 : 2]);
    const char* olmoe = argc > (by_id ? 4 : 3) ? argv[by_id ? 4 : 3] : NULL;

    int version = 0;
    CHECK_OK(cieraGetVersion(&version));
    if (version != CIERA_VERSION_CODE) FAIL("library version %d, header %d", version, CIERA_VERSION_CODE);

    cieraComm_t comm = NULL;
    if (by_id) {
        int rank = env_int("CIERA_RANK"), nranks = env_int("CIERA_NRANKS");
        g_rank = rank;
        cieraUniqueId id;
        if (rank == 0) {
            CHECK_OK(cieraGetUniqueId(&id));
            write_id(argv[2], &id);
        } else {
            read_id(argv[2], &id);
        }
        /* Bad init arguments fail before anything is sent. */
        EXPECT_ERR(cieraCommInitRank(&comm, nranks, id, nranks), cieraInvalidArgument, "rank is");
        if (comm != NULL) FAIL("failed init left comm non-NULL");
        EXPECT_ERR(cieraCommInitRank(NULL, nranks, id, rank), cieraInvalidArgument, "comm (the output pointer) is NULL");
        cieraConfig_t bad = CIERA_CONFIG_INITIALIZER;
        bad.magic = 0;
        EXPECT_ERR(cieraCommInitRankConfig(&comm, nranks, id, rank, &bad), cieraInvalidArgument, "CIERA_CONFIG_INITIALIZER");
        cieraConfig_t bad2 = CIERA_CONFIG_INITIALIZER;
        bad2.compression = 9;
        EXPECT_ERR(cieraCommInitRankConfig(&comm, nranks, id, rank, &bad2), cieraInvalidArgument, "config.compression is 9");
        cieraUniqueId junk;
        memset(&junk, 'x', sizeof junk);
        EXPECT_ERR(cieraCommInitRank(&comm, nranks, junk, rank), cieraInvalidArgument, "commId");

        cieraConfig_t config = CIERA_CONFIG_INITIALIZER;
        config.timeoutMs = 60000;
        config.compression = cieraCompressionOn;
        config.cacheBudgetMB = 64;
        CHECK_OK(cieraCommInitRankConfig(&comm, nranks, id, rank, &config));
    } else {
        CHECK_OK(cieraCommInitFromEnv(&comm, NULL));
    }
    int rank = -1, nranks = -1;
    CHECK_OK(cieraCommUserRank(comm, &rank));
    CHECK_OK(cieraCommCount(comm, &nranks));
    g_rank = rank;
    if (getenv("CIERA_RANK") && rank != env_int("CIERA_RANK")) FAIL("rank %d, launcher says %d", rank, env_int("CIERA_RANK"));
    if (getenv("CIERA_NRANKS") && nranks != env_int("CIERA_NRANKS")) FAIL("size %d, launcher says %d", nranks, env_int("CIERA_NRANKS"));

    /* ---- drifting data, in and out of place ---- */
    static const size_t counts[] = {1, 7, 1000, 4097, 65539, 0, 333};
    const int ncounts = sizeof counts / sizeof counts[0];
    size_t max_count = 65539;
    /* CIERA_APP_SHARED=1: the buffers come from cieraMemAlloc (peers copy out of them). */
    const char* shared_env = getenv("CIERA_APP_SHARED");
    int shared = shared_env && strcmp(shared_env, "1") == 0;
    uint16_t *send = NULL, *recv = NULL;
    if (shared) {
        CHECK_OK(cieraMemAlloc((void**)&send, max_count * 4));
        CHECK_OK(cieraMemAlloc((void**)&recv, max_count * 4 * nranks));
    } else {
        send = malloc(max_count * 4);
        recv = malloc(max_count * 4 * nranks);
    }
    uint64_t calls = 0, in_place = 0, recv_bytes = 0;
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (int it = 0; it < iters; it++) {
        size_t count = counts[it % ncounts];
        int use_f32 = it % 5 == 4;      /* fp32: two bf16 patterns per element */
        size_t n16 = use_f32 ? 2 * count : count;
        int inplace = it % 2 == 1;
        memset(recv, 0xEE, n16 * 2 * nranks);
        uint16_t* mine = inplace ? recv + (size_t)rank * n16 : send;
        fill_bf16(mine, rank, n16, it);
        CHECK_OK(cieraAllGather(mine, recv, count, use_f32 ? cieraFloat32 : cieraBfloat16, comm, NULL));
        for (int r = 0; r < nranks; r++) {
            long bad = check_bf16(recv + (size_t)r * n16, r, n16, it);
            if (bad >= 0)
                FAIL("iteration %d (count %zu, %s, %s): element %ld of rank %d's block is %#06x, expected %#06x", it, count,
                     use_f32 ? "f32" : "bf16", inplace ? "in place" : "out of place", bad, r,
                     recv[(size_t)r * n16 + bad], bf16_value(r, bad, it));
        }
        calls++;
        in_place += inplace;
        recv_bytes += n16 * 2 * nranks;
    }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    int nfiles = 0;
    if (olmoe) nfiles = gather_olmoe(comm, rank, nranks, olmoe, &calls, &recv_bytes);

    /* ---- statistics ---- */
    cieraStats_t st = CIERA_STATS_INITIALIZER;
    CHECK_OK(cieraCommGetStats(comm, &st));
    if (st.calls != calls || st.inPlaceCalls != in_place || st.failedCalls != 0 || st.rawBytes != recv_bytes)
        FAIL("stats: calls %llu/%llu in place %llu/%llu failed %llu rawBytes %llu/%llu (got/expected)",
             (unsigned long long)st.calls, (unsigned long long)calls, (unsigned long long)st.inPlaceCalls,
             (unsigned long long)in_place, (unsigned long long)st.failedCalls, (unsigned long long)st.rawBytes,
             (unsigned long long)recv_bytes);
    /* With compression forced on, every call after a tensor's first is a delta against the
     * caches (whether "auto" compresses depends on timing, so only "on" is checked). */
    const char* expect = getenv("CIERA_APP_EXPECT_DELTAS");
    if (expect && strcmp(expect, "1") == 0 && (st.deltaCalls == 0 || st.fillCalls == 0))
        FAIL("stats: compression on, but %llu fill and %llu delta calls", (unsigned long long)st.fillCalls,
             (unsigned long long)st.deltaCalls);
    if (st.repairs != 0) FAIL("stats: %llu repairs", (unsigned long long)st.repairs);
    cieraResult_t async = cieraInternalError;
    CHECK_OK(cieraCommGetAsyncError(comm, &async));
    if (async != cieraSuccess) FAIL("async error %d on a healthy communicator", (int)async);

    /* ---- bad calls: the code and a message naming the argument; nothing is sent ---- */
    const size_t c = 4;
    EXPECT_ERR(cieraAllGather(send, recv, c, cieraBfloat16, NULL, NULL), cieraInvalidArgument, "comm is NULL");
    EXPECT_ERR(cieraAllGather(send, NULL, c, cieraBfloat16, comm, NULL), cieraInvalidArgument, "recvbuff is NULL");
    EXPECT_ERR(cieraAllGather(NULL, recv, c, cieraBfloat16, comm, NULL), cieraInvalidArgument, "sendbuff is NULL");
    EXPECT_ERR(cieraAllGather(send, recv, c, (cieraDataType_t)42, comm, NULL), cieraInvalidArgument, "datatype 42");
    EXPECT_ERR(cieraAllGather(send, recv, c, (cieraDataType_t)-1, comm, NULL), cieraInvalidArgument, "datatype -1");
    EXPECT_ERR(cieraAllGather(send, recv, SIZE_MAX / 2, cieraBfloat16, comm, NULL), cieraInvalidArgument, "overflows");
    EXPECT_ERR(cieraAllGather(send, recv, SIZE_MAX / 8, cieraBfloat16, comm, NULL), cieraInvalidArgument, "sendcount");
    /* Overlapping, but not at this rank's in-place position. */
    EXPECT_ERR(cieraAllGather((char*)recv + (size_t)rank * c * 2 + 2, recv, c, cieraBfloat16, comm, NULL),
               cieraInvalidArgument, "overlaps recvbuff");
    EXPECT_ERR(cieraAllGatherKeyed(send, NULL, c, cieraBfloat16, 7, comm, NULL), cieraInvalidArgument, "recvbuff is NULL");
    EXPECT_ERR(cieraAllGather(send, recv, c, cieraBfloat16, (cieraComm_t)(uintptr_t)0x1230, NULL), cieraInvalidUsage,
               "not a communicator");
    EXPECT_ERR(cieraCommCount(comm, NULL), cieraInvalidArgument, "count is NULL");
    EXPECT_ERR(cieraCommUserRank(comm, NULL), cieraInvalidArgument, "rank is NULL");
    EXPECT_ERR(cieraCommGetAsyncError(comm, NULL), cieraInvalidArgument, "asyncError is NULL");
    EXPECT_ERR(cieraGetVersion(NULL), cieraInvalidArgument, "version is NULL");
    EXPECT_ERR(cieraGetUniqueId(NULL), cieraInvalidArgument, "uniqueId is NULL");
    EXPECT_ERR(cieraCommInitFromEnv(NULL, NULL), cieraInvalidArgument, "comm (the output pointer) is NULL");
    EXPECT_ERR(cieraCommGetStats(comm, NULL), cieraInvalidArgument, "stats is NULL");
    cieraStats_t raw_stats;
    memset(&raw_stats, 0, sizeof raw_stats);
    EXPECT_ERR(cieraCommGetStats(comm, &raw_stats), cieraInvalidArgument, "CIERA_STATS_INITIALIZER");
    if (strlen(cieraGetErrorString(cieraInvalidUsage)) == 0 || strlen(cieraGetErrorString((cieraResult_t)99)) == 0)
        FAIL("empty error string");
    /* A failed argument check broke nothing: the communicator still gathers correctly. */
    fill_bf16(send, rank, c, 4242);
    CHECK_OK(cieraAllGather(send, recv, c, cieraBfloat16, comm, NULL));
    for (int r = 0; r < nranks; r++)
        if (check_bf16(recv + (size_t)r * c, r, c, 4242) >= 0) FAIL("gather after the bad calls differs");

    CHECK_OK(cieraCommDestroy(comm));
    EXPECT_ERR(cieraAllGather(send, recv, c, cieraBfloat16, comm, NULL), cieraInvalidUsage, "destroyed");
    EXPECT_ERR(cieraCommCount(comm, &nranks), cieraInvalidUsage, "destroyed");
    EXPECT_ERR(cieraCommDestroy(comm), cieraInvalidUsage, "destroyed");
    EXPECT_ERR(cieraCommAbort(comm), cieraInvalidUsage, "destroyed");
    CHECK_OK(cieraCommDestroy(NULL));

    double secs = (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
    printf("ciera_app rank %d: OK %d iterations (%.1f us/call), %d olmoe files, %llu calls (%llu raw, %llu fill, %llu delta), "
           "%llu bytes gathered, %llu on the wire, %d error checks\n",
           rank, iters, iters ? secs * 1e6 / iters : 0.0, nfiles, (unsigned long long)calls, (unsigned long long)st.rawCalls,
           (unsigned long long)st.fillCalls, (unsigned long long)st.deltaCalls, (unsigned long long)st.rawBytes,
           (unsigned long long)st.wireBytes, n_error_checks);
    /* ---- shared buffers: errors name the argument; a zero-size one is a real pointer ---- */
    EXPECT_ERR(cieraMemAlloc(NULL, 64), cieraInvalidArgument, "ptr is NULL");
    int on_stack = 0;
    EXPECT_ERR(cieraMemFree(&on_stack), cieraInvalidArgument, "not returned by cieraMemAlloc");
    void* empty = NULL;
    CHECK_OK(cieraMemAlloc(&empty, 0));
    if (!empty) FAIL("cieraMemAlloc of 0 bytes gave NULL");
    CHECK_OK(cieraMemFree(empty));
    EXPECT_ERR(cieraMemFree(empty), cieraInvalidArgument, "freed already");
    CHECK_OK(cieraMemFree(NULL));
    if (shared) {
        CHECK_OK(cieraMemFree(send));
        CHECK_OK(cieraMemFree(recv));
    } else {
        free(send);
        free(recv);
    }
    return 0;
}
