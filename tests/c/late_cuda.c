/* libciera sees device memory even when the CUDA driver is loaded after the first
 * collectives (PyTorch loads it lazily): one rank, host gathers with no driver in the
 * process, then the fake driver (argv[1]) is dlopen'ed and a buffer it calls device memory,
 * gathered into host memory, must be refused as mixed (both buffers must be on the device,
 * or neither). Prints "late_cuda: OK" or what went wrong (exit 1). */
#include <ciera.h>
#include <dlfcn.h>
#include <stdio.h>
#include <string.h>

#define FAIL(...)                          \
    do {                                   \
        fprintf(stderr, "late_cuda: ");    \
        fprintf(stderr, __VA_ARGS__);      \
        fprintf(stderr, "\n");             \
        return 1;                          \
    } while (0)

int main(int argc, char** argv) {
    if (argc < 2) FAIL("usage: late_cuda /path/to/libcuda.so.1");
    cieraComm_t comm;
    if (cieraCommInitFromEnv(&comm, NULL) != cieraSuccess) FAIL("init: %s", cieraGetLastError(NULL));
    static unsigned char send[64], recv[64], device[64];
    for (int i = 0; i < 1000; i++) {
        memset(send, i & 0xFF, sizeof send);
        if (cieraAllGather(send, recv, sizeof send, cieraUint8, comm, NULL) != cieraSuccess)
            FAIL("host gather %d: %s", i, cieraGetLastError(comm));
        if (memcmp(send, recv, sizeof send) != 0) FAIL("host gather %d differs", i);
    }
    void* cuda = dlopen(argv[1], RTLD_NOW | RTLD_GLOBAL);
    if (!cuda) FAIL("dlopen %s: %s", argv[1], dlerror());
    void (*mark)(void*, size_t) = (void (*)(void*, size_t))dlsym(cuda, "fake_cuda_mark");
    if (!mark) FAIL("no fake_cuda_mark in %s", argv[1]);
    mark(device, sizeof device);
    cieraResult_t r = cieraAllGather(device, recv, sizeof device, cieraUint8, comm, NULL);
    if (r != cieraInvalidArgument || !strstr(cieraGetLastError(comm), "CUDA device"))
        FAIL("device buffer after the driver was loaded: result %d, \"%s\"", (int)r, cieraGetLastError(comm));
    if (cieraAllGather(send, recv, sizeof send, cieraUint8, comm, NULL) != cieraSuccess)
        FAIL("host gather after the driver was loaded: %s", cieraGetLastError(comm));
    cieraCommDestroy(comm);
    printf("late_cuda: OK\n");
    return 0;
}
