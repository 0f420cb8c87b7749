/* Legal MPI_Allgather calls whose ranks use different datatypes for the same type signature
 * (tests/capi_mpi.rs runs it under libciera_mpi.so):
 *
 *   mpirun -np N mpi_mixed COUNT ITERS
 *
 * Per iteration, three gathers on MPI_COMM_WORLD, every element checked:
 *  1. ints: even ranks send and receive COUNT x MPI_INT, odd ranks 1 x contiguous(COUNT, MPI_INT)
 *     (the same signature, so this is legal MPI);
 *  2. floats, drifting slowly (so compressed calls send deltas): even ranks COUNT x MPI_FLOAT,
 *     odd ranks send 1 x contiguous(COUNT, MPI_FLOAT) and receive into a strided layout
 *     (a vector of COUNT floats with stride 2, resized so that blocks follow each other): the
 *     gaps must stay untouched;
 *  3. in place, ints: odd ranks describe their receive buffer with the strided type.
 * Prints "mpi_mixed rank R: OK ..." or what differed (exit 1 via MPI_Abort). */
#include <mpi.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int g_rank = -1;

#define FAIL(...)                                       \
    do {                                                \
        fprintf(stderr, "mpi_mixed rank %d: ", g_rank); \
        fprintf(stderr, __VA_ARGS__);                   \
        fprintf(stderr, "\n");                          \
        MPI_Abort(MPI_COMM_WORLD, 1);                   \
    } while (0)

static int int_value(int rank, int i, int it) { return rank * 1000003 + i * 7 + it; }

static float float_value(int rank, int i, int it) {
    return sinf(0.013f * (float)i + 0.5f * (float)rank) * (1.0f + 0.0005f * (float)it);
}

static const unsigned CANARY = 0xC0FFEE11u;

int main(int argc, char** argv) {
    MPI_Init(&argc, &argv);
    int rank, size;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    g_rank = rank;
    int count = argc > 1 ? atoi(argv[1]) : 16;
    int iters = argc > 2 ? atoi(argv[2]) : 3;
    int odd = rank % 2 == 1;

    MPI_Datatype ints, floats, strided_f, strided_i, tmp;
    MPI_Type_contiguous(count, MPI_INT, &ints);
    MPI_Type_commit(&ints);
    MPI_Type_contiguous(count, MPI_FLOAT, &floats);
    MPI_Type_commit(&floats);
    /* COUNT elements, every second slot; one block spans 2*COUNT slots. */
    MPI_Type_vector(count, 1, 2, MPI_FLOAT, &tmp);
    MPI_Type_create_resized(tmp, 0, (MPI_Aint)(2 * (size_t)count * sizeof(float)), &strided_f);
    MPI_Type_commit(&strided_f);
    MPI_Type_free(&tmp);
    MPI_Type_vector(count, 1, 2, MPI_INT, &tmp);
    MPI_Type_create_resized(tmp, 0, (MPI_Aint)(2 * (size_t)count * sizeof(int)), &strided_i);
    MPI_Type_commit(&strided_i);
    MPI_Type_free(&tmp);

    size_t n = (size_t)count;
    int* isend = malloc(sizeof(int) * n);
    int* irecv = malloc(sizeof(int) * n * size);
    float* fsend = malloc(sizeof(float) * n);
    /* Room for the strided layout (twice the elements) on every rank. */
    float* frecv = malloc(sizeof(float) * 2 * n * size);
    unsigned* irecv2 = malloc(sizeof(unsigned) * 2 * n * size);
    if (!isend || !irecv || !fsend || !frecv || !irecv2) FAIL("out of memory");
    int calls = 0;
    for (int it = 0; it < iters; it++) {
        /* 1. ints, contiguous derived type on odd ranks. */
        for (size_t i = 0; i < n; i++) isend[i] = int_value(rank, (int)i, it);
        memset(irecv, 0xEE, sizeof(int) * n * size);
        int rc = odd ? MPI_Allgather(isend, 1, ints, irecv, 1, ints, MPI_COMM_WORLD)
                     : MPI_Allgather(isend, count, MPI_INT, irecv, count, MPI_INT, MPI_COMM_WORLD);
        if (rc != MPI_SUCCESS) FAIL("MPI_Allgather(int) returned %d", rc);
        calls++;
        for (int r = 0; r < size; r++)
            for (size_t i = 0; i < n; i++)
                if (irecv[r * n + i] != int_value(r, (int)i, it))
                    FAIL("iteration %d: int %zu of rank %d is %d, expected %d", it, i, r, irecv[r * n + i],
                         int_value(r, (int)i, it));

        /* 2. floats: odd ranks send a contiguous derived type and receive strided. */
        for (size_t i = 0; i < n; i++) fsend[i] = float_value(rank, (int)i, it);
        for (size_t i = 0; i < 2 * n * size; i++) memcpy(&frecv[i], &CANARY, 4);
        rc = odd ? MPI_Allgather(fsend, 1, floats, frecv, 1, strided_f, MPI_COMM_WORLD)
                 : MPI_Allgather(fsend, count, MPI_FLOAT, frecv, count, MPI_FLOAT, MPI_COMM_WORLD);
        if (rc != MPI_SUCCESS) FAIL("MPI_Allgather(float) returned %d", rc);
        calls++;
        for (int r = 0; r < size; r++)
            for (size_t i = 0; i < n; i++) {
                float want = float_value(r, (int)i, it);
                size_t at = odd ? (size_t)r * 2 * n + 2 * i : (size_t)r * n + i;
                if (memcmp(&frecv[at], &want, 4) != 0)
                    FAIL("iteration %d: float %zu of rank %d is %a, expected %a", it, i, r, frecv[at], want);
                if (odd && memcmp(&frecv[at + 1], &CANARY, 4) != 0)
                    FAIL("iteration %d: the gap after float %zu of rank %d was written", it, i, r);
            }

        /* 3. in place: odd ranks' receive buffer is strided. */
        for (size_t i = 0; i < 2 * n * size; i++) irecv2[i] = CANARY;
        for (size_t i = 0; i < n; i++) {
            size_t at = odd ? (size_t)rank * 2 * n + 2 * i : (size_t)rank * n + i;
            irecv2[at] = (unsigned)int_value(rank, (int)i, it + 100);
        }
        rc = odd ? MPI_Allgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, irecv2, 1, strided_i, MPI_COMM_WORLD)
                 : MPI_Allgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, irecv2, count, MPI_INT, MPI_COMM_WORLD);
        if (rc != MPI_SUCCESS) FAIL("MPI_Allgather(in place) returned %d", rc);
        calls++;
        for (int r = 0; r < size; r++)
            for (size_t i = 0; i < n; i++) {
                size_t at = odd ? (size_t)r * 2 * n + 2 * i : (size_t)r * n + i;
                if (irecv2[at] != (unsigned)int_value(r, (int)i, it + 100))
                    FAIL("iteration %d: in-place int %zu of rank %d is %u", it, i, r, irecv2[at]);
                if (odd && irecv2[at + 1] != CANARY)
                    FAIL("iteration %d: the in-place gap after int %zu of rank %d was written", it, i, r);
            }
    }
    printf("mpi_mixed rank %d: OK %d allgathers of %d elements\n", rank, calls, count);
    MPI_Type_free(&ints);
    MPI_Type_free(&floats);
    MPI_Type_free(&strided_f);
    MPI_Type_free(&strided_i);
    free(isend);
    free(irecv);
    free(fsend);
    free(frecv);
    free(irecv2);
    MPI_Finalize();
    return 0;
}
