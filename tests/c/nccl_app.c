/* An NCCL application (nothing in it knows CIERA), for tests/capi_nccl.rs. Linked with -lnccl
 * against the stand-in libnccl.so.2 (tests/c/fake_nccl.c); run by `ciera launch -n N`, whose
 * CIERA_RANK / CIERA_NRANKS it reads only to know its rank, as it would read RANK from
 * torchrun.
 *
 *   nccl_app ID_FILE ITERS
 *
 * Rank 0 makes the NCCL unique id and hands it out through ID_FILE. Then ITERS AllGathers of
 * drifting bf16 data (every fourth fp32, in place every other), each received byte checked,
 * half through ncclAllGather and the last one through pncclAllGather. Prints
 * "nccl_app rank R: OK ..." or what differed (exit 1). */
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "bf16_data.h"
#include "fake_nccl.h"

static int g_rank = -1;

#define FAIL(...)                                       \
    do {                                                \
        fprintf(stderr, "nccl_app rank %d: ", g_rank);  \
        fprintf(stderr, __VA_ARGS__);                   \
        fprintf(stderr, "\n");                          \
        exit(1);                                        \
    } while (0)

#define NCCL_OK(call)                                                                       \
    do {                                                                                    \
        ncclResult_t r_ = (call);                                                           \
        if (r_ != ncclSuccess) FAIL("%s failed: %d (%s)", #call, (int)r_, ncclGetErrorString(r_)); \
    } while (0)

int main(int argc, char** argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: nccl_app ID_FILE ITERS\n");
        return 2;
    }
    const char* rs = getenv("CIERA_RANK");
    const char* ns = getenv("CIERA_NRANKS");
    if (!rs || !ns) FAIL("CIERA_RANK / CIERA_NRANKS not set (run under ciera launch)");
    int rank = atoi(rs), nranks = atoi(ns), iters = atoi(argv[2]);
    g_rank = rank;

    ncclUniqueId id;
    if (rank == 0) {
        NCCL_OK(ncclGetUniqueId(&id));
        char tmp[4096];
        snprintf(tmp, sizeof tmp, "%s.tmp", argv[1]);
        FILE* f = fopen(tmp, "wb");
        if (!f || fwrite(&id, sizeof id, 1, f) != 1 || fclose(f) != 0 || rename(tmp, argv[1]) != 0)
            FAIL("writing %s: %s", argv[1], strerror(errno));
    } else {
        int ok = 0;
        for (int tries = 0; tries < 6000 && !ok; tries++) {
            FILE* f = fopen(argv[1], "rb");
            if (f) {
                ok = fread(&id, sizeof id, 1, f) == 1;
                fclose(f);
            }
            if (!ok) usleep(10000);
        }
        if (!ok) FAIL("no id in %s", argv[1]);
    }
    ncclComm_t comm;
    NCCL_OK(ncclCommInitRank(&comm, nranks, id, rank));
    int n = -1, r = -1;
    NCCL_OK(ncclCommCount(comm, &n));
    NCCL_OK(ncclCommUserRank(comm, &r));
    if (n != nranks || r != rank) FAIL("ncclCommCount/UserRank say %d/%d, expected %d/%d", n, r, nranks, rank);

    static const size_t counts[] = {1, 513, 4096, 20001, 3};
    const size_t max_count = 20001;
    uint16_t* send = malloc(max_count * 4);
    uint16_t* recv = malloc(max_count * 4 * nranks);
    for (int it = 0; it < iters; it++) {
        size_t count = counts[it % 5];
        int f32 = it % 4 == 3;
        size_t n16 = f32 ? 2 * count : count;
        int inplace = it % 2 == 1;
        memset(recv, 0xEE, n16 * 2 * nranks);
        uint16_t* mine = inplace ? recv + (size_t)rank * n16 : send;
        fill_bf16(mine, rank, n16, it);
        ncclDataType_t t = f32 ? ncclFloat32 : ncclBfloat16;
        if (it == iters - 1)
            NCCL_OK(pncclAllGather(mine, recv, count, t, comm, NULL));
        else
            NCCL_OK(ncclAllGather(mine, recv, count, t, comm, NULL));
        for (int src = 0; src < nranks; src++) {
            long bad = check_bf16(recv + (size_t)src * n16, src, n16, it);
            if (bad >= 0)
                FAIL("iteration %d (count %zu): element %ld from rank %d is %#06x, expected %#06x", it, count, bad, src,
                     recv[(size_t)src * n16 + bad], bf16_value(src, bad, it));
        }
    }
    NCCL_OK(ncclCommDestroy(comm));
    printf("nccl_app rank %d: OK %d allgathers checked\n", rank, iters);
    free(send);
    free(recv);
    return 0;
}
