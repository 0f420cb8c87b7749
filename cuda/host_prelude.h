// The host build of cuda/codec.cu: CUDA's keywords as plain C++, so that g++ compiles the
// kernels' logic (the `__host__ __device__` functions) into cuda/host's emulator. NVRTC never
// sees this file.
#pragma once

#include <cstdint>
#include <cstring>

#define __host__
#define __device__
#define __forceinline__ inline
#define __restrict__ __restrict
