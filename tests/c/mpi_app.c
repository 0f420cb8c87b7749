/* An MPI program (nothing in it knows CIERA) for tests/capi_mpi.rs:
 *
 *   mpirun -np N mpi_app ITERS
 *
 * ITERS iterations of MPI_Allgather on MPI_COMM_WORLD: fp32 data (MPI_FLOAT) and bf16 bit
 * patterns (MPI_UINT16_T), drifting slowly, in and out of place, odd counts; then a double,
 * a derived type of floats (served: its signature is floats), a heterogeneous struct and an
 * MPI_Iallgather (both left to MPI), and gathers on a sub-communicator from MPI_Comm_split,
 * which is freed before MPI_Finalize. Every received element is checked. Prints
 * "mpi_app rank R: OK ..." or what differed (exit 1).
 * MPI_APP_ALLOC_MEM=1 takes the buffers from MPI_Alloc_mem instead of malloc.
 * MPI_APP_UNSERVED_ONLY=1 makes only calls the interposer leaves to MPI (the struct, the
 * MPI_Iallgather, a gather on MPI_COMM_SELF) and exits: its statistics must still show. */
#include <mpi.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bf16_data.h"

static int g_rank = -1;

#define FAIL(...)                                      \
    do {                                               \
        fprintf(stderr, "mpi_app rank %d: ", g_rank);  \
        fprintf(stderr, __VA_ARGS__);                  \
        fprintf(stderr, "\n");                         \
        MPI_Abort(MPI_COMM_WORLD, 1);                  \
    } while (0)

/* Calls CIERA leaves to MPI: a struct of a float and an int (two basic types), and a
 * nonblocking allgather. Returns the calls made. */
static int unserved_calls(MPI_Comm comm) {
    int rank, size;
    MPI_Comm_rank(comm, &rank);
    MPI_Comm_size(comm, &size);
    struct fi {
        float f;
        int i;
    } mine = {(float)rank * 0.5f, rank * 3}, all[64];
    int lens[2] = {1, 1};
    MPI_Aint disp[2] = {offsetof(struct fi, f), offsetof(struct fi, i)};
    MPI_Datatype kinds[2] = {MPI_FLOAT, MPI_INT}, fi_type;
    MPI_Type_create_struct(2, lens, disp, kinds, &fi_type);
    MPI_Type_commit(&fi_type);
    if (MPI_Allgather(&mine, 1, fi_type, all, 1, fi_type, comm) != MPI_SUCCESS) FAIL("struct allgather failed");
    for (int r = 0; r < size; r++)
        if (all[r].f != (float)r * 0.5f || all[r].i != r * 3) FAIL("struct from rank %d differs", r);
    MPI_Type_free(&fi_type);
    int v = rank + 7, vall[64];
    MPI_Request req;
    if (MPI_Iallgather(&v, 1, MPI_INT, vall, 1, MPI_INT, comm, &req) != MPI_SUCCESS) FAIL("MPI_Iallgather failed");
    MPI_Wait(&req, MPI_STATUS_IGNORE);
    for (int r = 0; r < size; r++)
        if (vall[r] != r + 7) FAIL("MPI_Iallgather: int from rank %d is %d", r, vall[r]);
    return 2;
}

static float f32_value(int rank, size_t i, int iter) {
    return sinf(0.011f * (float)i + 0.3f * (float)rank) * (1.0f + 0.0007f * (float)iter) + 0.00003f * (float)iter;
}

/* Gathers `count` fp32 and then `count` bf16 per rank on `comm`, checks both. Returns calls made. */
static int gather_both(MPI_Comm comm, int it, int count, int inplace, float* fsend, float* frecv, uint16_t* hsend,
                       uint16_t* hrecv) {
    int rank, size;
    MPI_Comm_rank(comm, &rank);
    MPI_Comm_size(comm, &size);
    memset(frecv, 0xEE, sizeof(float) * count * size);
    memset(hrecv, 0xEE, 2 * (size_t)count * size);
    float* fmine = inplace ? frecv + (size_t)rank * count : fsend;
    for (int i = 0; i < count; i++) fmine[i] = f32_value(rank, i, it);
    uint16_t* hmine = inplace ? hrecv + (size_t)rank * count : hsend;
    fill_bf16(hmine, rank, count, it);
    if (MPI_Allgather(inplace ? MPI_IN_PLACE : fsend, count, MPI_FLOAT, frecv, count, MPI_FLOAT, comm) != MPI_SUCCESS)
        FAIL("MPI_Allgather(float) failed");
    if (MPI_Allgather(inplace ? MPI_IN_PLACE : hsend, count, MPI_UINT16_T, hrecv, count, MPI_UINT16_T, comm) != MPI_SUCCESS)
        FAIL("MPI_Allgather(uint16) failed");
    for (int r = 0; r < size; r++) {
        for (int i = 0; i < count; i++) {
            float want = f32_value(r, i, it);
            if (memcmp(&frecv[(size_t)r * count + i], &want, 4) != 0)
                FAIL("iteration %d count %d: float %d of rank %d is %a, expected %a", it, count, i, r,
                     frecv[(size_t)r * count + i], want);
        }
        long bad = check_bf16(hrecv + (size_t)r * count, r, count, it);
        if (bad >= 0) FAIL("iteration %d count %d: bf16 %ld of rank %d differs", it, count, bad, r);
    }
    return 2;
}

int main(int argc, char** argv) {
    MPI_Init(&argc, &argv);
    int rank, size;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    g_rank = rank;
    int iters = argc > 1 ? atoi(argv[1]) : 50;
    const char* uo = getenv("MPI_APP_UNSERVED_ONLY");
    if (uo && strcmp(uo, "1") == 0) {
        int calls = unserved_calls(MPI_COMM_WORLD);
        int self_one = rank, self_all = -1;
        MPI_Allgather(&self_one, 1, MPI_INT, &self_all, 1, MPI_INT, MPI_COMM_SELF);
        if (self_all != rank) FAIL("MPI_COMM_SELF gather gave %d", self_all);
        printf("mpi_app rank %d: OK %d unserved calls\n", rank, calls + 1);
        fflush(stdout);
        MPI_Finalize();
        return 0;
    }
    const int max_count = 30011;
    /* MPI_APP_ALLOC_MEM=1: the buffers come from MPI_Alloc_mem (the interposer's shared buffers). */
    const char* am = getenv("MPI_APP_ALLOC_MEM");
    int alloc_mem = am && strcmp(am, "1") == 0;
    float *fsend, *frecv;
    uint16_t *hsend, *hrecv;
    if (alloc_mem) {
        if (MPI_Alloc_mem(sizeof(float) * max_count, MPI_INFO_NULL, &fsend) != MPI_SUCCESS ||
            MPI_Alloc_mem(sizeof(float) * max_count * size, MPI_INFO_NULL, &frecv) != MPI_SUCCESS ||
            MPI_Alloc_mem(2 * (MPI_Aint)max_count, MPI_INFO_NULL, &hsend) != MPI_SUCCESS ||
            MPI_Alloc_mem(2 * (MPI_Aint)max_count * size, MPI_INFO_NULL, &hrecv) != MPI_SUCCESS)
            FAIL("MPI_Alloc_mem failed");
    } else {
        fsend = malloc(sizeof(float) * max_count);
        frecv = malloc(sizeof(float) * max_count * size);
        hsend = malloc(2 * (size_t)max_count);
        hrecv = malloc(2 * (size_t)max_count * size);
    }
    static const int counts[] = {1, 17, 1000, 30011, 0, 4096};
    int world_calls = 0;
    double t0 = MPI_Wtime();
    for (int it = 0; it < iters; it++)
        world_calls += gather_both(MPI_COMM_WORLD, it, counts[it % 6], it % 2, fsend, frecv, hsend, hrecv);
    double t1 = MPI_Wtime();

    /* A double (served raw); a derived type of floats and differing (but matching in
     * signature) send and recv types, both served; then calls left to MPI. */
    double d = rank + 0.25, dall[64];
    MPI_Allgather(&d, 1, MPI_DOUBLE, dall, 1, MPI_DOUBLE, MPI_COMM_WORLD);
    world_calls++;
    for (int r = 0; r < size; r++)
        if (dall[r] != r + 0.25) FAIL("double from rank %d is %f", r, dall[r]);
    MPI_Datatype pair;
    MPI_Type_contiguous(2, MPI_FLOAT, &pair);
    MPI_Type_commit(&pair);
    float p2[2] = {(float)rank, -(float)rank}, pall[128];
    MPI_Allgather(p2, 1, pair, pall, 1, pair, MPI_COMM_WORLD);
    MPI_Allgather(p2, 2, MPI_FLOAT, pall, 1, pair, MPI_COMM_WORLD);
    for (int r = 0; r < size; r++)
        if (pall[2 * r] != (float)r || pall[2 * r + 1] != -(float)r) FAIL("pair from rank %d differs", r);
    MPI_Type_free(&pair);
    world_calls += 2;
    int unserved = unserved_calls(MPI_COMM_WORLD);

    /* A sub-communicator of the even and the odd ranks, freed before MPI_Finalize. */
    MPI_Comm half;
    MPI_Comm_split(MPI_COMM_WORLD, rank % 2, rank, &half);
    int half_calls = 0;
    for (int it = 0; it < 5; it++) half_calls += gather_both(half, 1000 + it, 777, it % 2, fsend, frecv, hsend, hrecv);
    MPI_Comm_free(&half);

    printf("mpi_app rank %d: OK %d world allgathers, %d left to MPI, %d on the split communicator, %.1f us per "
           "allgather\n",
           rank, world_calls, unserved, half_calls, iters ? (t1 - t0) * 1e6 / (2.0 * iters) : 0.0);
    fflush(stdout);
    if (alloc_mem) {
        if (MPI_Free_mem(fsend) != MPI_SUCCESS || MPI_Free_mem(frecv) != MPI_SUCCESS || MPI_Free_mem(hsend) != MPI_SUCCESS ||
            MPI_Free_mem(hrecv) != MPI_SUCCESS)
            FAIL("MPI_Free_mem failed");
    } else {
        free(fsend);
        free(frecv);
        free(hsend);
        free(hrecv);
    }
    MPI_Finalize();
    return 0;
}
