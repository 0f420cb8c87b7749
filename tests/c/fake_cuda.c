/* A stand-in for the CUDA driver (built as libcuda.so.1 by tests/capi_c.rs): just the entry
 * points libciera looks up. cuPointerGetAttribute says "device memory" for the one range
 * marked with fake_cuda_mark, and "not CUDA memory" (CUDA_ERROR_INVALID_VALUE) for the rest. */
#include <stddef.h>
#include <stdint.h>

static uintptr_t g_lo, g_hi;

void fake_cuda_mark(void* p, size_t len) {
    g_lo = (uintptr_t)p;
    g_hi = g_lo + len;
}

int cuPointerGetAttribute(void* data, int attribute, unsigned long long ptr) {
    if (attribute != 2 /* CU_POINTER_ATTRIBUTE_MEMORY_TYPE */) return 1;
    if (ptr >= g_lo && ptr < g_hi) {
        *(unsigned int*)data = 2; /* CU_MEMORYTYPE_DEVICE */
        return 0;
    }
    return 1; /* CUDA_ERROR_INVALID_VALUE: memory no context knows */
}

int cuStreamSynchronize(void* stream) { return 0; }
