// CIERA codec kernels: Exp frames (exponent cache), Exp and Hybrid frames (full-value cache)
// and FILL frames for bf16, fp16 and fp32, written and read in the wire format of docs/WIRE.md
// byte for byte (checksums included), so a frame encoded here decodes on a CPU and the other
// way round; and Delta frames (delta cache), encoded as the CPU's FrameChoice::Delta does.
//
// One source, two builds:
// - NVRTC (src/gpu/nvrtc.rs) compiles it for the device: the `extern "C" __global__` wrappers
//   at the end of this file;
// - g++ compiles it for the host (cuda/host: host_prelude.h, then this file), where an emulator
//   runs the same block bodies block by block and thread by thread. The tests diff the frames
//   the emulator writes against the Rust codec (tests/gpu_host.rs).
//
// How a block body is written so both builds run it: a body is a `__host__ __device__`
// function of a block (`Blk`) whose work is a sequence of *phases*, `b.each([&](u32 t) {...})`
// (every thread t runs the lambda) and `b.one([&] {...})` (thread 0 only), separated by
// `b.sync()`. On the device a phase is the lambda run by each thread and `sync` is
// __syncthreads(); on the host `each` loops t = 0..nt and `sync` does nothing, which is the
// same program because no phase reads what another thread of the same phase writes. State that
// lives across phases is in the block's shared struct, indexed by thread. Code outside the
// phases runs on every device thread and must only compute block-uniform values. No warp
// intrinsics (ballot, shuffles) are used, so there is nothing the host build cannot execute;
// what it does not exercise is real concurrency between blocks (none of the kernels below
// shares data between blocks of one launch except through distinct per-tile slots).
//
// Encode (per batch of EncJob, one frame per job; launches in this order on one stream):
//   ciera_enc_delta_hist_<t>, ciera_enc_delta_model_<t>: a delta cache's pass one and, with
//                        DE_AUTO, its pick of frame (see "Encode of Delta frames")
//   ciera_enc_tile_<t>   grid (max tiles, jobs) x 256: values -> sign+mantissa (s0), mask words,
//                        exponent cache update, per-tile counts and SH64 partial sums
//   ciera_enc_plan       grid (1, jobs) x 256: tile offsets (scan), mask coding (plan), a
//                        segmented rANS mask (a thread per run of segments; rare), FILL
//                        decision, section offsets
//   ciera_enc_emit_<t>   grid (max tiles, jobs) x 256: mask bytes (Flat/Hier) and exceptions,
//                        or the raw values of a FILL
//   ciera_enc_finish_<t> grid (1, jobs) x 256: header, SH64, XXH3 (8 lanes), frame length
//   ciera_enc_delta_*_<t>: the other five, a delta cache's Delta frames (ibid.)
// Decode (per batch of DecJob): see the sections "Decode" and "Decode of Delta frames" below.
//
// Tiles are 4096 elements (64 mask words): the sign+mantissa of a tile starts on a 32-byte
// SH64 stripe for every type (4096, 5632, 12288 bytes), so tiles hash independently and the
// partial sums add up (SH64's accumulators are sums over stripes).

#if defined(__CUDACC__)
#define CIERA_DEVICE_BUILD 1
#endif

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long i64;

#define HD __host__ __device__ __forceinline__

// ---------------------------------------------------------------------------------------------
// Portable primitives

#if defined(CIERA_DEVICE_BUILD)
HD u32 pop64(u64 x) { return __popcll(x); }
HD u32 pop32(u32 x) { return __popc(x); }
HD u32 ctz64(u64 x) { return __ffsll((long long)x) - 1; }
HD u32 clz32(u32 x) { return __clz(x); }
HD u32 clz64(u64 x) { return __clzll((long long)x); }
HD u64 mulhi64(u64 a, u64 b) { return __umul64hi(a, b); }
struct Blk {
    u32 nt;
    template <class F> __device__ __forceinline__ void each(F f) { f((u32)threadIdx.x); }
    template <class F> __device__ __forceinline__ void one(F f) {
        if (threadIdx.x == 0) f();
    }
    __device__ __forceinline__ void sync() { __syncthreads(); }
};
#else
HD u32 pop64(u64 x) { return (u32)__builtin_popcountll(x); }
HD u32 pop32(u32 x) { return (u32)__builtin_popcount(x); }
HD u32 ctz64(u64 x) { return (u32)__builtin_ctzll(x); }
HD u32 clz32(u32 x) { return x ? (u32)__builtin_clz(x) : 32; }
HD u32 clz64(u64 x) { return x ? (u32)__builtin_clzll(x) : 64; }
HD u64 mulhi64(u64 a, u64 b) { return (u64)(((unsigned __int128)a * b) >> 64); }
struct Blk {
    u32 nt;
    template <class F> void each(F f) {
        for (u32 t = 0; t < nt; ++t) f(t);
    }
    template <class F> void one(F f) { f(); }
    void sync() {}
};
#endif

HD u64 rotl64(u64 x, u32 r) { return (x << r) | (x >> (64 - r)); }
// *p += v where several threads of a phase may add to the same counter (shared histograms).
HD void add_u32(u32* p, u32 v) {
#if defined(CIERA_DEVICE_BUILD)
    atomicAdd(p, v);
#else
    *p += v;
#endif
}
HD u64 min64(u64 a, u64 b) { return a < b ? a : b; }
HD u64 cdiv(u64 a, u64 b) { return (a + b - 1) / b; }

HD u64 rd64(const u8* p) {
    u64 v = 0;
    for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
    return v;
}
HD u32 rd32(const u8* p) { return (u32)p[0] | (u32)p[1] << 8 | (u32)p[2] << 16 | (u32)p[3] << 24; }
// A u64 from 8-aligned `p`.
HD u64 ld64a(const u8* p) {
#if defined(CIERA_DEVICE_BUILD)
    return *(const u64*)p;
#else
    u64 v;
    memcpy(&v, p, 8);
    return v;
#endif
}
// A u64 (little-endian) from any `p`, with aligned loads only: the two aligned words holding
// bytes p..p+7 (which lie in the buffer when its base is 8-aligned and its size a multiple of 8).
HD u64 ld64_any(const u8* p) {
    u32 k = (u32)((u64)p & 7);
    if (k == 0) return ld64a(p);
    const u8* a = p - k;
    return (ld64a(a) >> (8 * k)) | (ld64a(a + 8) << (64 - 8 * k));
}
HD void wr64(u8* p, u64 v) {
    for (int i = 0; i < 8; ++i) p[i] = (u8)(v >> (8 * i));
}
HD void wr32(u8* p, u32 v) {
    for (int i = 0; i < 4; ++i) p[i] = (u8)(v >> (8 * i));
}

constexpr u32 NT = 256;               // threads per block of the tile kernels
constexpr u32 TILE = 4096;            // elements per tile
constexpr u32 TILE_WORDS = TILE / 64; // mask words per tile
constexpr u32 GROUPS = TILE / 8;      // groups of 8 elements per tile (2 per thread)

// ---------------------------------------------------------------------------------------------
// Float layouts (src/codec/float.rs): the cached field `e` and the packed sign+mantissa.

struct Bf16 {
    static constexpr u32 BYTES = 2, SHIFT = 8, EMAX = 0xff, DT = 9;
    static HD u64 sm_len(u64 k) { return k; }
};
struct F16 {
    static constexpr u32 BYTES = 2, SHIFT = 10, EMAX = 0x1f, DT = 6;
    static HD u64 sm_len(u64 k) { return k + cdiv(3 * k, 8); }
};
struct F32 {
    static constexpr u32 BYTES = 4, SHIFT = 24, EMAX = 0xff, DT = 7;
    static HD u64 sm_len(u64 k) { return 3 * k; }
};

template <class L> HD u32 load_val(const u8* p, u64 i) {
    if (L::BYTES == 2) return *(const u16*)(p + 2 * i);
    return *(const u32*)(p + 4 * i);
}
template <class L> HD void store_val(u8* p, u64 i, u32 w) {
    if (L::BYTES == 2)
        *(u16*)(p + 2 * i) = (u16)w;
    else
        *(u32*)(p + 4 * i) = w;
}
template <class L> HD u32 exp_of(u32 w) { return (w >> L::SHIFT) & L::EMAX; }

HD void st64a(u8* p, u64 v) {
#if defined(CIERA_DEVICE_BUILD)
    *(u64*)p = v;
#else
    memcpy(p, &v, 8);
#endif
}
HD u64 ld64a(const u8* p);
// The 8 values i..i+7 (i a multiple of 8) into w: u64 loads where the address allows.
template <class L> HD void load8(const u8* in, u64 i, u32* w) {
    const u8* p = in + L::BYTES * i;
    if (((u64)p & 7) == 0) {
        for (u32 q = 0; q < L::BYTES; ++q) {
            u64 x = ld64a(p + 8 * q);
            for (u32 r = 0; r < 8 / L::BYTES; ++r)
                w[q * (8 / L::BYTES) + r] = (u32)(x >> (8 * L::BYTES * r)) & (L::BYTES == 2 ? 0xffffu : 0xffffffffu);
        }
    } else {
        for (u32 q = 0; q < 8; ++q) w[q] = load_val<L>(in, i + q);
    }
}
template <class L> HD void store8(u8* out, u64 i, const u32* w) {
    u8* p = out + L::BYTES * i;
    if (((u64)p & 7) == 0) {
        for (u32 q = 0; q < L::BYTES; ++q) {
            u64 x = 0;
            for (u32 r = 0; r < 8 / L::BYTES; ++r) x |= (u64)w[q * (8 / L::BYTES) + r] << (8 * L::BYTES * r);
            st64a(p + 8 * q, x);
        }
    } else {
        for (u32 q = 0; q < 8; ++q) store_val<L>(out, i + q, w[q]);
    }
}
template <class L> HD u32 sm_of(u32 w) { return w & ~(L::EMAX << L::SHIFT); }

// Pack the sm of r <= 8 values (a group that starts at a multiple of 8) at `out`.
template <class L> HD void pack_group(const u32* w, u32 r, u8* out) {
    if (L::DT == Bf16::DT) {
        for (u32 j = 0; j < r; ++j) out[j] = (u8)w[j];
    } else if (L::DT == F32::DT) {
        for (u32 j = 0; j < r; ++j) {
            out[3 * j] = (u8)w[j];
            out[3 * j + 1] = (u8)(w[j] >> 8);
            out[3 * j + 2] = (u8)(w[j] >> 16);
        }
    } else {
        u32 hi = 0;
        for (u32 j = 0; j < r; ++j) {
            out[j] = (u8)w[j];
            hi |= (((w[j] >> 15) << 2) | ((w[j] >> 8) & 3)) << (3 * j);
        }
        u32 hb = (3 * r + 7) / 8;
        for (u32 j = 0; j < hb; ++j) out[r + j] = (u8)(hi >> (8 * j));
    }
}

// Inverse of pack_group: sm words (cached field zero). False if padding bits are set.
template <class L> HD bool unpack_group(const u8* in, u32 r, u32* w) {
    if (L::DT == Bf16::DT) {
        for (u32 j = 0; j < r; ++j) w[j] = in[j];
    } else if (L::DT == F32::DT) {
        for (u32 j = 0; j < r; ++j)
            w[j] = (u32)in[3 * j] | (u32)in[3 * j + 1] << 8 | (u32)in[3 * j + 2] << 16;
    } else {
        u32 hb = (3 * r + 7) / 8, hi = 0;
        for (u32 j = 0; j < hb; ++j) hi |= (u32)in[r + j] << (8 * j);
        if ((hi >> (3 * r)) != 0) return false;
        for (u32 j = 0; j < r; ++j) {
            u32 t = (hi >> (3 * j)) & 7;
            w[j] = (u32)in[j] | ((t & 3) << 8) | ((t >> 2) << 15);
        }
    }
    return true;
}

// Bytes of a tile's packed sm (multiple of 32 for a whole tile).
template <class L> HD u64 tile_sm_bytes() { return L::sm_len(TILE); }
template <class L> struct SmTile {
    static constexpr u32 BYTES = L::BYTES == 4 ? 3 * TILE : (L::SHIFT == 10 ? TILE + 3 * TILE / 8 : TILE);
};

// ---------------------------------------------------------------------------------------------
// SH64 (docs/WIRE.md): a sum over 32-byte stripes, so any thread can add any u64 word's share.

constexpr u64 SH_P1 = 0x9E3779B185EBCA87ull, SH_P2 = 0xC2B2AE3D27D4EB4Full,
              SH_P3 = 0x165667B19E3779F9ull;
HD u64 sh_init(u32 l) {
    return l == 0 ? SH_P1 : l == 1 ? SH_P2 : l == 2 ? SH_P3 : 0x27D4EB2F165667C5ull;
}
HD u64 sh_key(u32 l) {
    return l == 0 ? 0xbe4ba423396cfeb8ull
         : l == 1 ? 0x1cad21f72c81017cull
         : l == 2 ? 0xdb979083e96dd4deull
                  : 0x1f67b3b7a4a44072ull;
}
// Add word `v`, the `wi`-th u64 of the section (stripe wi/4, lane wi%4), to partial sums `acc`.
HD void sh_word(u64* acc, u64 wi, u64 v) {
    u32 l = (u32)(wi & 3);
    u64 x = v ^ sh_key(l) ^ ((wi >> 2) * SH_P2);
    acc[l] += (x & 0xffffffffull) * (x >> 32);
    acc[l ^ 1] += v;
}
HD u64 fmix64(u64 x) {
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ull;
    return x ^ (x >> 33);
}
// SH64 of a section of `len` bytes from the partial sums of all its words.
HD u64 sh_finish(const u64* partial, u64 len) {
    u64 h = len * SH_P3;
    for (u32 l = 0; l < 4; ++l) h = rotl64((h ^ fmix64(sh_init(l) + partial[l])) * SH_P1, 27);
    return fmix64(h);
}

// ---------------------------------------------------------------------------------------------
// XXH3-64, seed 0 (the frame checksum): over the 56 header bytes followed by the tail sections,
// read through `Cat` without copying them together. Lengths here are always >= 56.

#if defined(CIERA_DEVICE_BUILD)
__constant__
#endif
static const u8 XXH_SECRET[192] = {
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c,
    0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f,
    0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21,
    0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26, 0x4c,
    0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e, 0xa3,
    0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8,
    0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d,
    0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, 0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64,
    0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb, 0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb,
    0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49, 0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e,
    0x2b, 0x16, 0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce,
    0x45, 0xcb, 0x3a, 0x8f, 0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e,
};

constexpr u64 XP32_1 = 0x9E3779B1ull, XP32_2 = 0x85EBCA77ull, XP32_3 = 0xC2B2AE3Dull;
constexpr u64 XP64_1 = 0x9E3779B185EBCA87ull, XP64_2 = 0xC2B2AE3D27D4EB4Full,
              XP64_3 = 0x165667B19E3779F9ull, XP64_4 = 0x85EBCA77C2B2AE63ull,
              XP64_5 = 0x27D4EB2F165667C5ull;

HD u64 xsec64(u32 off) { return rd64(XXH_SECRET + off); }

// The hashed bytes: 56 header bytes, then `tail`.
struct Cat {
    const u8* head; // 56 bytes
    const u8* tail;
    u64 len; // 56 + tail length
    HD u8 at(u64 p) const { return p < 56 ? head[p] : tail[p - 56]; }
    HD u64 r64(u64 p) const {
        if (p + 8 <= 56) return ld64_any(head + p);
        if (p >= 56) return ld64_any(tail + (p - 56));
        u64 v = 0;
        for (int i = 7; i >= 0; --i) v = (v << 8) | at(p + i);
        return v;
    }
};

HD u64 mul128_fold64(u64 a, u64 b) { return (a * b) ^ mulhi64(a, b); }
HD u64 xxh3_avalanche(u64 h) {
    h ^= h >> 37;
    h *= 0x165667919E3779F9ull;
    return h ^ (h >> 32);
}
HD u64 xxh_mix16(const Cat& c, u64 p, u32 s) {
    return mul128_fold64(c.r64(p) ^ xsec64(s), c.r64(p + 8) ^ xsec64(s + 8));
}
// Lengths 17..240 (one thread).
HD u64 xxh3_mid(const Cat& c) {
    u64 len = c.len, acc = len * XP64_1;
    if (len <= 128) {
        if (len > 32) {
            if (len > 64) {
                if (len > 96) {
                    acc += xxh_mix16(c, 48, 96);
                    acc += xxh_mix16(c, len - 64, 112);
                }
                acc += xxh_mix16(c, 32, 64);
                acc += xxh_mix16(c, len - 48, 80);
            }
            acc += xxh_mix16(c, 16, 32);
            acc += xxh_mix16(c, len - 32, 48);
        }
        acc += xxh_mix16(c, 0, 0);
        acc += xxh_mix16(c, len - 16, 16);
        return xxh3_avalanche(acc);
    }
    u32 rounds = (u32)(len / 16);
    for (u32 i = 0; i < 8; ++i) acc += xxh_mix16(c, 16 * i, 16 * i);
    acc = xxh3_avalanche(acc);
    for (u32 i = 8; i < rounds; ++i) acc += xxh_mix16(c, 16 * i, 16 * (i - 8) + 3);
    acc += xxh_mix16(c, len - 16, 136 - 17);
    return xxh3_avalanche(acc);
}
HD u64 xxh3_acc_init(u32 i) {
    const u64 v[8] = {XP32_3, XP64_1, XP64_2, XP64_3, XP64_4, XP32_2, XP64_5, XP32_1};
    return v[i];
}
// Lengths > 240: accumulator lane `i` (0..7) over the whole input. Lanes are independent
// until the merge, so eight threads each run one.
HD u64 xxh3_long_lane(const Cat& c, u32 i) {
    const u64 block_len = 64 * 16;
    u64 len = c.len, acc = xxh3_acc_init(i);
    u64 nb = (len - 1) / block_len;
    for (u64 b = 0; b < nb; ++b) {
        for (u32 s = 0; s < 16; ++s) {
            u64 p = b * block_len + 64 * s;
            u64 d = c.r64(p + 8 * i), e = c.r64(p + 8 * (i ^ 1));
            u64 k = d ^ xsec64(8 * s + 8 * i);
            acc += (k & 0xffffffffull) * (k >> 32) + e;
        }
        acc ^= acc >> 47;
        acc ^= xsec64(192 - 64 + 8 * i);
        acc *= XP32_1;
    }
    u64 stripes = ((len - 1) - block_len * nb) / 64;
    for (u64 s = 0; s < stripes; ++s) {
        u64 p = nb * block_len + 64 * s;
        u64 d = c.r64(p + 8 * i), e = c.r64(p + 8 * (i ^ 1));
        u64 k = d ^ xsec64((u32)(8 * s + 8 * i));
        acc += (k & 0xffffffffull) * (k >> 32) + e;
    }
    u64 p = len - 64;
    u64 d = c.r64(p + 8 * i), e = c.r64(p + 8 * (i ^ 1));
    u64 k = d ^ xsec64(192 - 64 - 7 + 8 * i);
    return acc + (k & 0xffffffffull) * (k >> 32) + e;
}
HD u64 xxh3_long_merge(const u64* acc, u64 len) {
    u64 r = len * XP64_1;
    for (u32 i = 0; i < 4; ++i)
        r += mul128_fold64(acc[2 * i] ^ xsec64(11 + 16 * i), acc[2 * i + 1] ^ xsec64(11 + 16 * i + 8));
    return xxh3_avalanche(r);
}
// Whole hash on one thread (tests, short inputs).
HD u64 xxh3_cat(const Cat& c) {
    if (c.len <= 240) return xxh3_mid(c);
    u64 acc[8];
    for (u32 i = 0; i < 8; ++i) acc[i] = xxh3_long_lane(c, i);
    return xxh3_long_merge(acc, c.len);
}

// ---------------------------------------------------------------------------------------------
// Fixed-point log2 (Q16), for the mask coder's size estimates: integer-only, so host and device
// decide alike (src/codec/rans.rs::log2_q16 is the same algorithm).

HD u64 log2_q16(u64 x) {
    // x >= 1: the integer part, then 16 fraction bits by squaring the mantissa (Q31, in [1, 2)).
    u32 k = 63 - clz64(x);
    u64 m = k >= 31 ? x >> (k - 31) : x << (31 - k);
    u64 frac = 0;
    for (u32 i = 0; i < 16; ++i) {
        m = (m * m) >> 31;
        if (m >= (1ull << 32)) {
            frac |= 1ull << (15 - i);
            m >>= 1;
        }
    }
    return ((u64)k << 16) | frac;
}

// ---------------------------------------------------------------------------------------------
// Coded masks (docs/WIRE.md "Coded masks"; src/codec/bitmask.rs): the choice of coding, the
// segmented rANS coder the encoders write (coding 4: segments of 4096 mask bytes, each with a
// state and a stream of its own, so a block codes and decodes them a thread per run of
// segments), and the two-state coder of format versions 1 and 2 (coding 3), decoded on one
// thread (its two states are one dependency chain each, however long the mask).

enum : u32 { MASK_ZERO = 0, MASK_FLAT = 1, MASK_HIER = 2, MASK_RANS = 3, MASK_RANS_SEG = 4 };
HD bool rans_coded(u64 coding) { return coding == MASK_RANS || coding == MASK_RANS_SEG; }
constexpr u32 PROB_SCALE = 4096;
constexpr u32 RANS_L = 1u << 23;
// Coding 4: mask bytes per segment, and the first format version whose frames may carry it.
constexpr u64 SEG_BYTES = 4096;
constexpr u32 SEG_VERSION = 3;
HD u64 seg_count(u64 nbytes) { return cdiv(nbytes, SEG_BYTES); }
// A mask takes rANS only where it saves 1/RANS_MIN_GAIN of the frame's values and exponents
// (chunk.rs RANS_MIN_GAIN).
constexpr u64 RANS_MIN_GAIN = 50;
// A Hybrid frame's value-change mask: 1/RANS_MIN_GAIN_VALUES (chunk.rs RANS_MIN_GAIN_VALUES).
constexpr u64 RANS_MIN_GAIN_VALUES = 25;

HD u32 rd16(const u8* p) { return (u32)p[0] | (u32)p[1] << 8; }

HD u32 nonzero_bytes(u64 w) {
    u64 t = w;
    t |= t >> 4;
    t |= t >> 2;
    t |= t >> 1;
    return pop64(t & 0x0101010101010101ull);
}
HD u32 nonzero_byte_map(u64 w) {
    u64 t = w;
    t |= t >> 4;
    t |= t >> 2;
    t |= t >> 1;
    t &= 0x0101010101010101ull;
    return (u32)((t * 0x0102040810204080ull) >> 56);
}

// Bytes of a mask of m bits with `ones` set, coded at the entropy of independent bits (floor):
// the filter before a histogram (bitmask::plan).
HD u64 iid_bytes(u64 ones, u64 m) {
    if (ones == 0 || ones >= m) return 0;
    u64 lm = log2_q16(m);
    u64 bits = ones * (lm - log2_q16(ones)) + (m - ones) * (lm - log2_q16(m - ones));
    return bits / (8ull << 16);
}

// chunk.rs hybrid_estimate: the bytes of a Hybrid frame of n values, k changed (sm_k bytes of
// sign+mantissa), ke of them in exponent.
HD u64 hybrid_estimate(u64 sm_k, u64 n, u64 k, u64 ke) {
    return sm_k + iid_bytes(k, n) + iid_bytes(ke, k) + ke + 300;
}

// One pass of from_histogram's rounding: `diff` (PROB_SCALE minus the sum) moved onto the
// `no` present symbols in `order` (descending frequency), keeping each at 1 or more. Returns
// what is left of it.
template <class O> HD i64 move_rounding(u32* freq, const O* order, u32 no, i64 diff) {
    for (u32 k = 0; k < no && diff != 0; ++k) {
        u32 s = order[k];
        if (diff > 0) {
            freq[s] += (u32)diff;
            diff = 0;
        } else if (freq[s] > 1) {
            i64 take = (i64)(freq[s] - 1) < -diff ? (i64)(freq[s] - 1) : -diff;
            freq[s] -= (u32)take;
            diff += take;
        }
    }
    return diff;
}
// rans::FreqTable::from_histogram: 12-bit frequencies, rounding error moved onto the largest.
// One thread; the kernels use freq_from_hist_blk, and the host build tests it against this.
HD void freq_from_hist(const u32* hist, u32* freq) {
    u64 total = 0;
    for (u32 s = 0; s < 256; ++s) total += hist[s];
    i64 sum = 0;
    for (u32 s = 0; s < 256; ++s) {
        freq[s] = 0;
        if (hist[s]) {
            u64 f = (u64)hist[s] * PROB_SCALE / total;
            freq[s] = f < 1 ? 1 : (u32)f;
            sum += freq[s];
        }
    }
    i64 diff = (i64)PROB_SCALE - sum;
    while (diff != 0) {
        u8 order[256];
        u32 no = 0;
        for (u32 s = 0; s < 256; ++s) {
            if (!freq[s]) continue;
            // stable insertion by descending frequency (ties keep ascending symbols)
            u32 j = no++;
            while (j > 0 && freq[order[j - 1]] < freq[s]) {
                order[j] = order[j - 1];
                --j;
            }
            order[j] = (u8)s;
        }
        diff = move_rounding(freq, order, no, diff);
    }
}
// freq_from_hist by the block, a symbol per thread in turn: the scaling; then, while the
// frequencies do not add up to PROB_SCALE, each present symbol's place in the order of
// descending frequency (ties: ascending symbol, the stable sort's order) counted by its own
// thread, and the rounding moved onto that order by thread 0 (at most 256 steps). Where one
// thread sorted by insertion (up to 256^2 / 2 steps a pass).
struct FreqShm {
    u32 order[256];
    u64 total;
    i64 diff;
    u32 present;
};
HD void freq_from_hist_blk(Blk& b, FreqShm& fs, const u32* hist, u32* freq) {
    b.one([&] {
        u64 total = 0;
        for (u32 s = 0; s < 256; ++s) total += hist[s];
        fs.total = total;
    });
    b.sync();
    b.each([&](u32 t) {
        for (u32 s = t; s < 256; s += NT) {
            u64 f = hist[s] ? (u64)hist[s] * PROB_SCALE / fs.total : 0;
            freq[s] = hist[s] ? (f < 1 ? 1 : (u32)f) : 0;
        }
    });
    b.sync();
    b.one([&] {
        i64 sum = 0;
        u32 present = 0;
        for (u32 s = 0; s < 256; ++s) {
            sum += freq[s];
            present += freq[s] != 0;
        }
        fs.diff = (i64)PROB_SCALE - sum;
        fs.present = present;
    });
    b.sync();
    while (fs.diff != 0) {
        b.each([&](u32 t) {
            for (u32 s = t; s < 256; s += NT) {
                if (!freq[s]) continue;
                u32 r = 0;
                for (u32 q = 0; q < 256; ++q)
                    r += freq[q] && (freq[q] > freq[s] || (freq[q] == freq[s] && q < s));
                fs.order[r] = s;
            }
        });
        b.sync();
        b.one([&] { fs.diff = move_rounding(freq, fs.order, fs.present, fs.diff); });
        b.sync();
    }
}
HD u32 table_bytes(const u32* freq) {
    u32 n = 0, v = 0;
    for (u32 s = 0; s < 256; ++s)
        if (freq[s]) {
            ++n;
            v += freq[s] - 1 < 128 ? 1 : 2;
        }
    return 1 + (n < 32 ? n : 32) + v;
}
// rans::FreqTable::estimate_bytes: table, payload and the two states of coding 3.
HD u64 payload_q16(const u32* hist, const u32* freq) {
    u64 bits = 0;
    for (u32 s = 0; s < 256; ++s)
        if (hist[s]) bits += (u64)hist[s] * ((12ull << 16) - log2_q16(freq[s]));
    return bits;
}
HD u64 rans_estimate(const u32* hist, const u32* freq) {
    return cdiv(payload_q16(hist, freq), 8ull << 16) + table_bytes(freq) + 8;
}
// Coding 4's estimate of nbytes mask bytes (without the coding byte): coding 3's, its two states
// (8 bytes) replaced by a state and a length per segment (6 bytes each).
HD u64 rans_seg_estimate(const u32* hist, const u32* freq, u64 nbytes) {
    return rans_estimate(hist, freq) - 8 + 6 * seg_count(nbytes);
}
HD u8 mask_byte(const u64* words, u64 i) { return (u8)(words[i / 8] >> (8 * (i % 8))); }

// bitmask::plan_gated samples a mask of at least SAMPLE_MIN_WORDS words before its histogram:
// every SAMPLE_STRIDE-th block of SAMPLE_BLOCK whole words.
constexpr u64 SAMPLE_BLOCK = 64, SAMPLE_STRIDE = 8, SAMPLE_MIN_WORDS = SAMPLE_BLOCK * SAMPLE_STRIDE * 8;
// bitmask::mask_histogram by the block into hist (shared counters): the ceil(m/8) mask bytes,
// or (sampled) the bytes of the whole words of the sampled blocks.
HD void mask_hist_blk(Blk& b, u32* hist, const u64* words, u64 m, bool sampled) {
    u64 nbytes = cdiv(m, 8), whole = nbytes / 8 * 8, blk = SAMPLE_BLOCK * 8;
    b.each([&](u32 t) {
        for (u32 q = t; q < 256; q += NT) hist[q] = 0;
    });
    b.sync();
    b.each([&](u32 t) {
        if (!sampled) {
            for (u64 i = t; i < nbytes; i += NT) add_u32(&hist[mask_byte(words, i)], 1);
            return;
        }
        // Sampled bytes in order: s's block is s / blk, the (s / blk * SAMPLE_STRIDE)-th.
        for (u64 s = t;; s += NT) {
            u64 i = s / blk * blk * SAMPLE_STRIDE + s % blk;
            if (i >= whole) break;
            add_u32(&hist[mask_byte(words, i)], 1);
        }
    });
    b.sync();
}
// plan_gated's verdict on a sample (its histogram and table): rANS cannot save `gain` over
// `bytes` for this mask of nbytes bytes, with an eighth of `gain` for the sample's error. The
// estimate is rans_seg::estimate_scaled's: the sample's Q16 bits a byte times nbytes, one table.
HD bool rans_hopeless(const u32* hist, const u32* freq, u64 nbytes, u64 gain, u64 bytes) {
    u64 seen = 0;
    for (u32 s = 0; s < 256; ++s) seen += hist[s];
    u64 payload = cdiv(payload_q16(hist, freq) / seen * nbytes, 8ull << 16);
    u64 est = 1 + payload + table_bytes(freq) + 6 * seg_count(nbytes);
    return est + gain - gain / 8 >= bytes;
}

// rans::FreqTable::write: nsym - 1, the symbols (or their presence bitmap), the frequencies - 1
// as LEB128 varints. Returns the bytes written (table_bytes).
HD u64 rans_table_write(const u32* freq, u8* out) {
    u32 n = 0;
    for (u32 s = 0; s < 256; ++s) n += freq[s] != 0;
    u64 o = 0;
    out[o++] = (u8)(n - 1);
    if (n < 32) {
        for (u32 s = 0; s < 256; ++s)
            if (freq[s]) out[o++] = (u8)s;
    } else {
        for (u32 j = 0; j < 32; ++j) out[o + j] = 0;
        for (u32 s = 0; s < 256; ++s)
            if (freq[s]) out[o + s / 8] |= (u8)(1u << (s % 8));
        o += 32;
    }
    for (u32 s = 0; s < 256; ++s)
        if (freq[s]) {
            u32 v = freq[s] - 1;
            while (v >= 128) {
                out[o++] = (u8)(v | 128);
                v >>= 7;
            }
            out[o++] = (u8)v;
        }
    return o;
}
// rans::FreqTable::read from in[*at..len): the frequencies, their cumulative sums, and the
// symbol of each of the 4096 slots; *at moves past the table. Returns 0, or why not (a code for
// DE_MASK's detail).
HD u32 rans_table_read(const u8* in, u64 len, u64* at, u32* freq, u32* cum, u8* sym) {
    u64 pos = *at;
    if (pos >= len) return 10;
    u32 ns = (u32)in[pos++] + 1;
    u8 present[256];
    for (u32 s = 0; s < 256; ++s) present[s] = 0;
    if (ns < 32) {
        if (pos + ns > len) return 11;
        i64 prev = -1;
        for (u32 k = 0; k < ns; ++k) {
            u32 s = in[pos++];
            if ((i64)s <= prev) return 12;
            prev = s;
            present[s] = 1;
        }
    } else {
        if (pos + 32 > len) return 11;
        u32 count = 0;
        for (u32 s = 0; s < 256; ++s) count += present[s] = (in[pos + s / 8] >> (s % 8)) & 1;
        pos += 32;
        if (count != ns) return 13;
    }
    u64 sum = 0;
    for (u32 s = 0; s < 256; ++s) {
        freq[s] = 0;
        if (!present[s]) continue;
        u32 val = 0;
        bool done = false;
        for (u32 sh = 0; sh <= 14; sh += 7) {
            if (pos >= len) return 14;
            u8 c = in[pos++];
            val |= (u32)(c & 0x7f) << sh;
            if (!(c & 0x80)) {
                done = true;
                break;
            }
        }
        if (!done) return 15;
        u64 fq = (u64)val + 1;
        if (fq > PROB_SCALE) return 16;
        freq[s] = (u32)fq;
        sum += fq;
    }
    if (sum != PROB_SCALE) return 17;
    u32 c = 0;
    for (u32 s = 0; s < 256; ++s) {
        cum[s] = c;
        for (u32 q = 0; q < freq[s]; ++q) sym[c + q] = (u8)s;
        c += freq[s];
    }
    *at = pos;
    return 0;
}

// Coding 4, one segment: mask bytes lo..hi coded backwards from state RANS_L, one rANS step each
// (rans.rs: 32-bit state, byte renormalisation); the renormalisation bytes are written backwards
// ending at `end`, so that they lie in decoding order at end - len .. end. Returns len (at most
// 2 a mask byte) and the final state in *x_out.
HD u32 seg_encode_one(const u64* words, u64 lo, u64 hi, const u32* freq, const u32* cum, u8* end,
                      u32* x_out) {
    u32 x = RANS_L;
    u8* p = end;
    for (u64 i = hi; i-- > lo;) {
        u32 s = mask_byte(words, i), f = freq[s];
        u32 x_max = ((RANS_L >> 12) << 8) * f;
        while (x >= x_max) {
            *--p = (u8)x;
            x >>= 8;
        }
        x = (x / f) * PROB_SCALE + x % f + cum[s];
    }
    *x_out = x;
    return (u32)(end - p);
}
// Coding 4, one segment: mask bytes lo..hi (lo a multiple of 8: the segment owns whole words)
// decoded from state x and exactly in[0..len) into words. Returns 0, or why not.
HD u32 seg_decode_one(const u8* in, u64 len, u32 x, u64 lo, u64 hi, const u32* freq,
                      const u32* cum, const u8* sym, u64* words) {
    if (x < RANS_L || (u64)x >= ((u64)RANS_L << 8)) return 19;
    u64 pos = 0, w = 0;
    for (u64 i = lo; i < hi; ++i) {
        u32 slot = x & (PROB_SCALE - 1), s = sym[slot];
        x = freq[s] * (x >> 12) + slot - cum[s];
        while (x < RANS_L) {
            if (pos >= len) return 20;
            x = (x << 8) | in[pos++];
        }
        w |= (u64)s << (8 * (i % 8));
        if (i % 8 == 7 || i + 1 == hi) {
            words[i / 8] = w;
            w = 0;
        }
    }
    if (pos != len) return 21;
    if (x != RANS_L) return 22;
    return 0;
}

// A mask coding and its size in bytes (with the coding byte), as bitmask::plan_gated chooses.
struct MaskChoice {
    u32 coding;
    u64 bytes;
};
// The checks every decoded mask of m bits passes (bitmask::check_words), given its set bits
// `c`: no bit at or past m, and a non-zero coding codes a non-zero mask. Returns 0, or why not.
HD u32 mask_verdict(const u64* words, u64 m, u32 coding, u64 c) {
    u64 W = cdiv(m, 64);
    if (m % 64 && W && (words[W - 1] >> (m % 64))) return 2;
    if (coding != MASK_ZERO && c == 0) return 5;
    return 0;
}
// mask_verdict with the set bits counted here (one thread). Returns 0 and the ones, or why not.
HD u32 mask_check(const u64* words, u64 m, u32 coding, u64* ones) {
    u64 c = 0;
    for (u64 w = 0; w < cdiv(m, 64); ++w) c += pop64(words[w]);
    u32 why = mask_verdict(words, m, coding, c);
    if (!why) *ones = c;
    return why;
}
// Decodes a mask of m bits from exactly in[0..len) into words (ceil(m/64), zeroed first), one
// thread: every coding but a non-empty coding 4 in a frame that may carry it (`seg_ok`), which is
// mask_read_blk's. Returns 0 and the ones, or why not (a code for DE_MASK's detail).
HD u32 rans_decode_seq(const u8* in, u64 len, u64 nbytes, u64* words);
HD u32 mask_read_one(const u8* in, u64 len, u64 m, bool seg_ok, u64* words, u64* ones) {
    u64 W = cdiv(m, 64), nbytes = cdiv(m, 8);
    for (u64 w = 0; w < W; ++w) words[w] = 0;
    if (len == 0) return 30;
    u32 coding = in[0];
    const u8* pay = in + 1;
    u64 pl = len - 1;
    if (coding == MASK_ZERO) {
        if (pl) return 31;
    } else if (coding == MASK_FLAT) {
        if (pl != nbytes) return 32;
        for (u64 i = 0; i < nbytes; ++i) words[i / 8] |= (u64)pay[i] << (8 * (i % 8));
    } else if (coding == MASK_HIER) {
        u64 l1 = cdiv(W, 8);
        if (pl < l1) return 33;
        u64 nzw = 0;
        for (u64 g = 0; g < l1; ++g) nzw += pop32(pay[g]);
        if (pl < l1 + nzw) return 33;
        u64 k = l1, l3 = l1 + nzw;
        for (u64 g = 0; g < W; ++g) {
            if (!((pay[g / 8] >> (g % 8)) & 1)) continue;
            u32 map = pay[k++];
            if (!map) return 6;
            for (u32 q = 0; q < 8; ++q)
                if ((map >> q) & 1) {
                    if (l3 >= pl) return 33;
                    u8 c = pay[l3++];
                    if (!c) return 7;
                    words[g] |= (u64)c << (8 * q);
                }
        }
        if (W % 8 && l1 > 0 && (pay[l1 - 1] >> (W % 8))) return 1;
        if (l3 != pl) return 4;
    } else if (coding == MASK_RANS) {
        if (nbytes == 0) return 34;
        u32 why = rans_decode_seq(pay, pl, nbytes, words);
        if (why) return why;
    } else if (coding == MASK_RANS_SEG) {
        return !seg_ok ? 36 : 34; // format version 1 or 2; or an empty mask
    } else {
        return 35;
    }
    return mask_check(words, m, coding, ones);
}

// Inclusive scan of x[k][0..NT) for k < K, in place (tmp: scratch of the same shape).
template <u32 K> HD void block_scan(Blk& b, u64 (*x)[NT], u64 (*tmp)[NT]) {
    for (u32 d = 1; d < NT; d *= 2) {
        b.each([&](u32 t) {
            for (u32 k = 0; k < K; ++k) tmp[k][t] = x[k][t] + (t >= d ? x[k][t - d] : 0);
        });
        b.sync();
        b.each([&](u32 t) {
            for (u32 k = 0; k < K; ++k) x[k][t] = tmp[k][t];
        });
        b.sync();
    }
}

// Coding 4 by a block: thread t takes segments seg_lo(t, S) .. seg_hi(t, S), a contiguous run,
// so that a scan of the runs' stream bytes gives each run its streams' offset.
HD u64 seg_lo(u32 t, u64 S) { return min64(S, t * cdiv(S, NT)); }
HD u64 seg_hi(u32 t, u64 S) { return min64(S, (t + 1) * cdiv(S, NT)); }
struct SegShm {
    u64 a[1][NT], own[1][NT], tmp[1][NT]; // per run: its streams' bytes, scanned
    u32 cum[256];
    u64 total; // the payload's bytes (table, states, lengths, streams)
};
// Codes the nbytes mask bytes of `words` (coding 4, table `freq`), a thread per run: segment j's
// stream goes to rev[2*lo .. 2*hi) (its end, in decoding order: a segment of hi - lo bytes emits
// at most 2 a byte, so rev holds 2 * nbytes), its final state and stream length to sl[j] and
// sl[S + j]. Then sh.total is the payload's length (seg_write writes it).
HD void seg_code(Blk& b, SegShm& sh, const u64* words, u64 nbytes, const u32* freq, u8* rev,
                 u32* sl) {
    u64 S = seg_count(nbytes);
    b.one([&] {
        u32 c = 0;
        for (u32 s = 0; s < 256; ++s) {
            sh.cum[s] = c;
            c += freq[s];
        }
    });
    b.sync();
    b.each([&](u32 t) {
        u64 run = 0;
        for (u64 j = seg_lo(t, S); j < seg_hi(t, S); ++j) {
            u64 lo = j * SEG_BYTES, hi = min64(lo + SEG_BYTES, nbytes);
            u32 x;
            u32 len = seg_encode_one(words, lo, hi, freq, sh.cum, rev + 2 * hi, &x);
            sl[j] = x;
            sl[S + j] = len;
            run += len;
        }
        sh.a[0][t] = sh.own[0][t] = run;
    });
    b.sync();
    block_scan<1>(b, sh.a, sh.tmp);
    b.one([&] { sh.total = table_bytes(freq) + 6 * S + sh.a[0][NT - 1]; });
    b.sync();
}
// Writes the payload seg_code measured (table, states, lengths, streams) at `out`.
HD void seg_write(Blk& b, SegShm& sh, u64 nbytes, const u32* freq, const u8* rev, const u32* sl,
                  u8* out) {
    u64 S = seg_count(nbytes), tb = sh.total - 6 * S - sh.a[0][NT - 1];
    b.one([&] { rans_table_write(freq, out); });
    b.each([&](u32 t) {
        u8* st = out + tb;
        u8* ln = st + 4 * S;
        u64 off = tb + 6 * S + sh.a[0][t] - sh.own[0][t];
        for (u64 j = seg_lo(t, S); j < seg_hi(t, S); ++j) {
            u32 len = sl[S + j];
            wr32(st + 4 * j, sl[j]);
            ln[2 * j] = (u8)len;
            ln[2 * j + 1] = (u8)(len >> 8);
            const u8* src = rev + 2 * min64((j + 1) * SEG_BYTES, nbytes) - len;
            for (u32 q = 0; q < len; ++q) out[off + q] = src[q];
            off += len;
        }
    });
    b.sync();
}

// A block's mask coder (Hybrid frames), bitmask::plan_gated and encode: thread t takes the
// words run_lo(t, W) .. run_hi(t, W), a contiguous run, so that scans of the runs' counts give
// the totals the plan weighs and each run's place in a Hier coding.
HD u64 run_lo(u32 t, u64 W) { return min64(W, t * cdiv(W, NT)); }
HD u64 run_hi(u32 t, u64 W) { return min64(W, (t + 1) * cdiv(W, NT)); }
struct MaskShm {
    u32 hist[256];
    u32 freq[256];
    MaskChoice c;
    u64 len;
    bool hist_needed;
    // Per run: set bits, non-zero words, non-zero bytes; `cnt` scanned, `own` as counted.
    u64 cnt[3][NT], own[3][NT], tmp[3][NT];
    SegShm seg;
    FreqShm fq;
};
// The plan of the mask of m bits (bitmask::plan_gated, with `rans`: rANS weighed with the
// margins try_gain and gain) into sh.c: the counts by runs and scanned, the histogram by the
// block (shared counters), the choice on one thread.
HD void mask_plan_blk(Blk& b, MaskShm& sh, const u64* words, u64 m, bool rans, u64 try_gain,
                      u64 gain) {
    u64 W = cdiv(m, 64), nbytes = cdiv(m, 8);
    b.each([&](u32 t) {
        u64 ones = 0, nzw = 0, nzb = 0;
        for (u64 w = run_lo(t, W); w < run_hi(t, W); ++w)
            if (words[w]) {
                ones += pop64(words[w]);
                ++nzw;
                nzb += nonzero_bytes(words[w]);
            }
        sh.cnt[0][t] = sh.own[0][t] = ones;
        sh.cnt[1][t] = sh.own[1][t] = nzw;
        sh.cnt[2][t] = sh.own[2][t] = nzb;
    });
    b.sync();
    block_scan<3>(b, sh.cnt, sh.tmp);
    b.one([&] {
        u64 ones = sh.cnt[0][NT - 1], nzw = sh.cnt[1][NT - 1], nzb = sh.cnt[2][NT - 1];
        sh.hist_needed = false;
        if (ones == 0) {
            sh.c = MaskChoice{MASK_ZERO, 1};
            return;
        }
        u64 flat = 1 + nbytes, hier = 1 + cdiv(W, 8) + nzw + nzb;
        sh.c = hier <= flat ? MaskChoice{MASK_HIER, hier} : MaskChoice{MASK_FLAT, flat};
        sh.hist_needed = rans && iid_bytes(ones, m) + try_gain < sh.c.bytes;
    });
    b.sync();
    if (!sh.hist_needed) return;
    if (W >= SAMPLE_MIN_WORDS) {
        mask_hist_blk(b, sh.hist, words, m, true);
        freq_from_hist_blk(b, sh.fq, sh.hist, sh.freq);
        b.one([&] { sh.hist_needed = !rans_hopeless(sh.hist, sh.freq, nbytes, gain, sh.c.bytes); });
        b.sync();
        if (!sh.hist_needed) return;
    }
    mask_hist_blk(b, sh.hist, words, m, false);
    freq_from_hist_blk(b, sh.fq, sh.hist, sh.freq);
    b.one([&] {
        // with the coding byte, as bitmask::plan
        u64 est = 1 + rans_seg_estimate(sh.hist, sh.freq, nbytes);
        if (est + gain < sh.c.bytes) sh.c = MaskChoice{MASK_RANS_SEG, est};
    });
    b.sync();
}
// Writes the Zero, Flat or Hier mask mask_plan_blk chose (its coding byte and payload) at `out`:
// Flat a byte per thread in turn; Hier's level 1 a byte per thread in turn, levels 2 and 3 by
// the runs, at the offsets the scans gave (bitmask::encode's order: words, then bytes, in order).
HD void mask_write_blk(Blk& b, MaskShm& sh, const u64* words, u64 m, u8* out) {
    u64 W = cdiv(m, 64), nbytes = cdiv(m, 8), l1 = cdiv(W, 8);
    u32 coding = sh.c.coding;
    b.one([&] { out[0] = (u8)coding; });
    if (coding == MASK_FLAT) {
        b.each([&](u32 t) {
            for (u64 i = t; i < nbytes; i += NT) out[1 + i] = mask_byte(words, i);
        });
    } else if (coding == MASK_HIER) {
        b.each([&](u32 t) {
            for (u64 g = t; g < l1; g += NT) {
                u8 v = 0;
                for (u64 q = 0; q < 8 && 8 * g + q < W; ++q)
                    if (words[8 * g + q]) v |= (u8)(1u << q);
                out[1 + g] = v;
            }
        });
        b.each([&](u32 t) {
            u64 o2 = 1 + l1 + sh.cnt[1][t] - sh.own[1][t];
            u64 o3 = 1 + l1 + sh.cnt[1][NT - 1] + sh.cnt[2][t] - sh.own[2][t];
            for (u64 w = run_lo(t, W); w < run_hi(t, W); ++w) {
                if (!words[w]) continue;
                out[o2++] = (u8)nonzero_byte_map(words[w]);
                for (u32 q = 0; q < 8; ++q)
                    if ((u8)(words[w] >> (8 * q))) out[o3++] = (u8)(words[w] >> (8 * q));
            }
        });
    }
    b.sync();
}
// The mask of m bits planned (mask_plan_blk) and coded at `out` by the block, coding 4 a thread
// per run of segments through `rev` (2 * ceil(m/8) bytes) and `sl` (2 * seg_count(ceil(m/8))
// u32). Then sh.len is its bytes, written only where they fit in `cap`.
HD void mask_code_blk(Blk& b, MaskShm& sh, const u64* words, u64 m, bool rans, u64 try_gain,
                      u64 gain, u8* rev, u32* sl, u8* out, u64 cap) {
    mask_plan_blk(b, sh, words, m, rans, try_gain, gain);
    if (sh.c.coding != MASK_RANS_SEG && sh.c.bytes <= cap) mask_write_blk(b, sh, words, m, out);
    if (sh.c.coding == MASK_RANS_SEG) {
        seg_code(b, sh.seg, words, cdiv(m, 8), sh.freq, rev, sl);
        if (1 + sh.seg.total <= cap) {
            b.one([&] { out[0] = MASK_RANS_SEG; });
            seg_write(b, sh.seg, cdiv(m, 8), sh.freq, rev, sl, out + 1);
        }
    }
    b.one([&] { sh.len = sh.c.coding == MASK_RANS_SEG ? 1 + sh.seg.total : sh.c.bytes; });
    b.sync();
}

// A block's mask decoder: coding 4's table (with each slot's symbol), per run of segments its
// streams' bytes (scanned into offsets), per thread the first failing segment's reason.
struct SegDecShm {
    u32 freq[256], cum[256];
    u8 sym[PROB_SCALE];
    u64 a[1][NT], own[1][NT], tmp[1][NT];
    // dec_hyb's offsets: per run, the exponent mask's and the changed mask's set bits.
    u64 cnt[2][NT], cown[2][NT], ctmp[2][NT];
    u32 terr[NT];
    u64 hdr, ones;
    u32 why, coding;
};
// Decodes the coding-4 payload in[0..len) of nbytes (>= 1) mask bytes into words
// (ceil(nbytes/8)), a thread per run of segments. Thread 0 reads the table and checks that the
// states and lengths are there; the lengths, summed per run and scanned, must add up to the
// bytes after them (so every stream lies in the payload); then each segment decodes from its
// own stream into its own words. sh.why: 0, or why not (the first failing segment's reason).
HD void seg_decode(Blk& b, SegDecShm& sh, const u8* in, u64 len, u64 nbytes, u64* words) {
    u64 S = seg_count(nbytes);
    b.one([&] {
        u64 pos = 0;
        u32 why = rans_table_read(in, len, &pos, sh.freq, sh.cum, sh.sym);
        if (!why && len - pos < 6 * S) why = 23;
        sh.hdr = pos;
        sh.why = why;
    });
    b.sync();
    if (sh.why) return;
    const u8* st = in + sh.hdr;
    const u8* ln = st + 4 * S;
    u64 streams = sh.hdr + 6 * S;
    b.each([&](u32 t) {
        u64 run = 0;
        for (u64 j = seg_lo(t, S); j < seg_hi(t, S); ++j) run += rd16(ln + 2 * j);
        sh.a[0][t] = sh.own[0][t] = run;
    });
    b.sync();
    block_scan<1>(b, sh.a, sh.tmp);
    b.one([&] {
        if (sh.a[0][NT - 1] != len - streams) sh.why = 24;
    });
    b.sync();
    if (sh.why) return;
    b.each([&](u32 t) {
        u64 off = streams + sh.a[0][t] - sh.own[0][t];
        u32 why = 0;
        for (u64 j = seg_lo(t, S); j < seg_hi(t, S) && !why; ++j) {
            u64 lo = j * SEG_BYTES, l = rd16(ln + 2 * j);
            why = seg_decode_one(in + off, l, rd32(st + 4 * j), lo, min64(lo + SEG_BYTES, nbytes),
                                 sh.freq, sh.cum, sh.sym, words);
            off += l;
        }
        sh.terr[t] = why;
    });
    b.sync();
    b.one([&] {
        for (u32 t = 0; t < NT && !sh.why; ++t) sh.why = sh.terr[t];
    });
    b.sync();
}
// mask_check by the block: the set bits counted a word per thread in turn, summed and judged
// (mask_verdict) on thread 0 into sh.why, or sh.ones.
HD void mask_check_blk(Blk& b, SegDecShm& sh, const u64* words, u64 m, u32 coding) {
    b.each([&](u32 t) {
        u64 c = 0;
        for (u64 w = t; w < cdiv(m, 64); w += NT) c += pop64(words[w]);
        sh.a[0][t] = c;
    });
    b.sync();
    b.one([&] {
        u64 c = 0;
        for (u32 t = 0; t < NT; ++t) c += sh.a[0][t];
        sh.why = mask_verdict(words, m, coding, c);
        if (!sh.why) sh.ones = c;
    });
    b.sync();
}
// A Hier payload pay[0..pl) of a mask of m (>= 1) bits into words (ceil(m/64)) by the block:
// thread t takes the words run_lo(t, W) .. run_hi(t, W); its level-1 bits, counted and scanned,
// place its level-2 bytes, whose bits, counted and scanned, place its level-3 bytes. The checks
// are mask_read_one's with its reasons and in its order: the lengths before any byte is read,
// then the first failing word (each run keeps its first; the first run's is reported), then
// stray level-1 bits, the bytes left over and mask_check's. sh.why: 0, or why not; sh.ones.
HD void hier_read_blk(Blk& b, SegDecShm& sh, const u8* pay, u64 pl, u64 m, u64* words) {
    u64 W = cdiv(m, 64), l1 = cdiv(W, 8);
    b.one([&] { sh.why = pl < l1 ? 33 : 0; });
    b.sync();
    if (sh.why) return;
    // Level 2: a byte per non-zero word, in word order.
    b.each([&](u32 t) {
        u64 c = 0;
        for (u64 g = run_lo(t, W); g < run_hi(t, W); ++g) c += (pay[g / 8] >> (g % 8)) & 1;
        sh.cnt[0][t] = sh.cown[0][t] = c;
    });
    b.sync();
    block_scan<1>(b, sh.cnt, sh.ctmp);
    b.one([&] {
        // mask_read_one counts every bit of level 1, those past W included (refused below, after
        // the words): level 3 starts after that many bytes.
        u64 stray = W % 8 ? pop32(pay[l1 - 1] >> (W % 8)) : 0;
        sh.hdr = l1 + sh.cnt[0][NT - 1] + stray;
        sh.why = pl < sh.hdr ? 33 : 0;
    });
    b.sync();
    if (sh.why) return;
    // Level 3: a byte per non-zero byte of the non-zero words, in order.
    b.each([&](u32 t) {
        u64 k = l1 + sh.cnt[0][t] - sh.cown[0][t], c = 0;
        for (u64 g = run_lo(t, W); g < run_hi(t, W); ++g)
            if ((pay[g / 8] >> (g % 8)) & 1) c += pop32(pay[k++]);
        sh.cnt[1][t] = sh.cown[1][t] = c;
    });
    b.sync();
    block_scan<1>(b, sh.cnt + 1, sh.ctmp);
    b.each([&](u32 t) {
        u64 k = l1 + sh.cnt[0][t] - sh.cown[0][t];
        u64 l3 = sh.hdr + sh.cnt[1][t] - sh.cown[1][t];
        u32 why = 0;
        for (u64 g = run_lo(t, W); g < run_hi(t, W) && !why; ++g) {
            u64 w = 0;
            if ((pay[g / 8] >> (g % 8)) & 1) {
                u32 map = pay[k++];
                if (!map) why = 6;
                for (u32 q = 0; q < 8 && !why; ++q) {
                    if (!((map >> q) & 1)) continue;
                    if (l3 >= pl) {
                        why = 33;
                    } else {
                        u8 c = pay[l3++];
                        if (!c) why = 7;
                        w |= (u64)c << (8 * q);
                    }
                }
            }
            words[g] = w;
        }
        sh.terr[t] = why;
    });
    b.sync();
    b.one([&] {
        for (u32 t = 0; t < NT && !sh.why; ++t) sh.why = sh.terr[t];
        if (sh.why) return;
        if (W % 8 && (pay[l1 - 1] >> (W % 8))) sh.why = 1;
        else if (sh.hdr + sh.cnt[1][NT - 1] != pl) sh.why = 4;
    });
    b.sync();
    if (sh.why) return;
    mask_check_blk(b, sh, words, m, MASK_HIER);
}
// Decodes a mask of m bits from exactly in[0..len) into words (ceil(m/64)) by the block, as
// bitmask::decode: Flat a word per thread in turn, Hier by runs of words (hier_read_blk),
// coding 4 only where the frame's format version may carry it (`seg_ok`), a thread per run of
// segments; Zero, coding 3 and what is refused at once on one thread (mask_read_one). sh.why:
// 0, or why not (mask_read_one's code for DE_MASK's detail); sh.ones: the set bits.
HD void mask_read_blk(Blk& b, SegDecShm& sh, const u8* in, u64 len, u64 m, bool seg_ok,
                      u64* words) {
    b.one([&] { sh.coding = len ? in[0] : 255; });
    b.sync();
    if (sh.coding == MASK_FLAT && m > 0) {
        // A word per thread in turn, the set bits summed per thread, then mask_read_one's
        // checks in its order (length, bits past m, a non-zero coding of a zero mask).
        u64 W = cdiv(m, 64), nbytes = cdiv(m, 8);
        b.one([&] { sh.why = len - 1 != nbytes ? 32 : 0; });
        b.sync();
        if (sh.why) return;
        b.each([&](u32 t) {
            for (u64 w = t; w < W; w += NT) {
                u64 x = 0;
                for (u64 q = 0; q < 8 && 8 * w + q < nbytes; ++q)
                    x |= (u64)in[1 + 8 * w + q] << (8 * q);
                words[w] = x;
            }
        });
        b.sync();
        mask_check_blk(b, sh, words, m, MASK_FLAT);
        return;
    }
    if (sh.coding == MASK_HIER && m > 0) {
        hier_read_blk(b, sh, in + 1, len - 1, m, words);
        return;
    }
    if (sh.coding != MASK_RANS_SEG || !seg_ok || m == 0) {
        b.one([&] { sh.why = mask_read_one(in, len, m, seg_ok, words, &sh.ones); });
        b.sync();
        return;
    }
    seg_decode(b, sh, in + 1, len - 1, cdiv(m, 8), words);
    if (sh.why) return;
    mask_check_blk(b, sh, words, m, MASK_RANS_SEG);
}

// ---------------------------------------------------------------------------------------------
// Encode: jobs, scratch, and the kernels' bodies.

// One frame to encode. Pointers are device addresses (host addresses in the emulator).
struct EncJob {
    u64 input;   // n values, element-aligned
    u64 cache;   // the slot's cache for the chunk, read, then set as any frame leaves it: n
                 // exponent bytes, or (flags bit 1) the n previous values
    u64 frame;   // 8-aligned, room for 64 + n * size bytes (the longest frame)
    u64 scratch; // 8-aligned, enc_scratch_bytes(n) bytes; contents on entry do not matter
    u64 n;       // elements, >= 1
    u64 offset;  // element offset of the chunk in its slot (header field)
    u64 version; // slot version (header field)
    u64 flags;   // bit 0: the slot is cold (send a FILL); bit 1: a full-value cache; bits 2-3:
                 // its frame choice (0 the smaller of Exp and Hybrid as the CPU estimates, 1 Exp,
                 // 2 Hybrid); bits 4-5, a delta cache's Delta frames (DE_NEVER: the frame of
                 // bits 2-3; DE_ALWAYS; DE_AUTO: the smallest of Exp, Hybrid and Delta as the
                 // CPU estimates them, see "Encode of Delta frames")
    u64 ctx;      // a delta cache (with bit 1): the n context bytes, read, then updated; else 0
    u64 dscratch; // with `ctx`: enc_delta_scratch_bytes(n), 8-aligned; else 0
};
HD bool job_cold(const EncJob& j) { return j.flags & 1; }
HD bool job_full(const EncJob& j) { return (j.flags >> 1) & 1; }
// A delta cache's job (`ctx` set) and Delta frames: never (a frame of bits 2-3, the contexts
// set to "no previous move", as the CPU's FrameChoice Exp, Hybrid and NoDelta), always (the
// CPU's FrameChoice::Delta) or the smallest frame (the CPU's FrameChoice::Auto).
constexpr u32 DE_NEVER = 0, DE_ALWAYS = 1, DE_AUTO = 2;
HD u32 job_delta_mode(const EncJob& j) { return j.ctx ? (u32)(j.flags >> 4) & 3 : DE_NEVER; }
// A warm delta job that may send a Delta frame: ciera_enc_delta_hist and _model run for it.
HD bool job_delta_scan(const EncJob& j) { return job_delta_mode(j) != DE_NEVER && !job_cold(j); }
// What ciera_enc_delta_model picked for such a job (0 Delta, 1 Exp, 2 Hybrid): DEncPlan.pick,
// the first word of its `dscratch`.
HD u64 de_pick(const EncJob& j) { return *(const u64*)j.dscratch; }
// A job sending a Delta frame (or a FILL where that would be longer than the values): the
// kernels of "Encode of Delta frames" code it, the others return at once.
HD bool job_delta_frame(const EncJob& j) {
    return job_delta_scan(j) && (job_delta_mode(j) == DE_ALWAYS || de_pick(j) == 0);
}
// The frame choice of a job the Exp/Hybrid kernels code: what DE_AUTO picked, else bits 2-3.
HD u32 job_choice(const EncJob& j) {
    return job_delta_mode(j) == DE_AUTO && !job_cold(j) ? (u32)de_pick(j) : (u32)(j.flags >> 2) & 3;
}

// Per job, in scratch: the plan (what enc_plan decided; the host reads `frame_len`, `mode`,
// `fill` and `ones` back), then per-tile counts and partial sums, then the mask words and the
// rANS buffer (segment streams, states and lengths).
struct Plan {
    u64 coding, s1_len, ones, nzw, nzb, fill, frame_len, mode;
    u64 l1_len, s1_off, s2_off, sm_len;
    u64 sm_acc[4];
    u64 k, s2_len, s3_len; // Hybrid: changed values; the exponent-mask and exponent sections
};
struct TileStat {
    u32 ones, nzw, nzb, k; // k: values changed (full-value cache)
    u64 acc[4];  // SH64 partial sums of the tile's sm
    u64 facc[4]; // SH64 partial sums of the tile's raw values (FILL)
};
struct TileOff {
    u64 ones, nzw, nzb, k;
};

HD u64 align8(u64 x) { return (x + 7) & ~7ull; }
struct EncView {
    Plan* plan;
    TileStat* stat;
    TileOff* off;
    u64* words; // the exponent mask (Exp frames)
    u8* rev;    // rANS: each segment's stream (2 bytes a mask byte), then states and lengths
    // full-value cache only:
    u64* cw;    // the changed mask (n bits)
    u64* xw;    // the Hybrid exponent mask (over the changed values)
    u32* cvals; // the changed values, in order
    u8* cflag;  // per changed value: its exponent changed
    u8* xs;     // the new exponents of those, in order
    u8* mbuf;   // the Hybrid masks, coded (then copied into the frame if it fits)
    HD EncView(u64 scratch, u64 n) {
        u8* s = (u8*)scratch;
        u64 T = cdiv(n, TILE), W = cdiv(n, 64), nb = cdiv(n, 8);
        plan = (Plan*)s;
        u64 o = align8(sizeof(Plan));
        stat = (TileStat*)(s + o);
        o += T * sizeof(TileStat);
        off = (TileOff*)(s + o);
        o += T * sizeof(TileOff);
        words = (u64*)(s + o);
        o += 8 * W;
        rev = s + o;
        o += align8(4 * nb + 1024);
        cw = (u64*)(s + o);
        o += 8 * W;
        xw = (u64*)(s + o);
        o += 8 * W;
        cvals = (u32*)(s + o);
        o += 4 * n;
        cflag = s + o;
        o += align8(n);
        xs = s + o;
        o += align8(n);
        mbuf = s + o;
    }
};
// Scratch bytes for a job of n elements (the host allocates this much): the exponent cache's,
// or (full) a full-value cache's.
HD u64 enc_scratch_bytes(u64 n, bool full) {
    u64 T = cdiv(n, TILE), W = cdiv(n, 64), nb = cdiv(n, 8);
    u64 exp = align8(sizeof(Plan)) + T * (sizeof(TileStat) + sizeof(TileOff)) + 8 * W +
              align8(4 * nb + 1024);
    return full ? exp + 16 * W + 4 * n + 2 * align8(n) + align8(2 * (2 * nb + 1100)) : exp;
}

template <class L> struct EncTileShm {
    u64 sm[SmTile<L>::BYTES / 8];
    u8 mb[GROUPS];
    u8 mc[GROUPS]; // full-value cache: which values changed
    u64 red[4][NT];
    u32 cnt[TILE_WORDS][4];
};

// Thread t's share of copying a tile's packed sm (sm_bytes, in shared memory) to s0, which is
// byte sm_base of the section (a multiple of 32), and of its SH64 partial sums (into red[.][t]).
HD void sm_out(u32 t, const u64* sm, u64 sm_bytes, u8* s0, u64 sm_base, u64 (*red)[NT]) {
    const u8* smb = (const u8*)sm;
    u64 acc[4] = {0, 0, 0, 0}, nw = cdiv(sm_bytes, 32) * 4;
    for (u64 w = t; w < nw; w += NT) {
        u64 val;
        if (8 * w + 8 <= sm_bytes) {
            val = sm[w];
            st64a(s0 + 8 * w, val);
        } else {
            val = 0;
            for (u64 q = 0; q < 8 && 8 * w + q < sm_bytes; ++q) {
                val |= (u64)smb[8 * w + q] << (8 * q);
                s0[8 * w + q] = smb[8 * w + q];
            }
        }
        sh_word(acc, sm_base / 8 + w, val);
    }
    for (u32 l = 0; l < 4; ++l) red[l][t] = acc[l];
}
// Sum red[l][0..NT) into red[l][0].
HD void block_reduce4(Blk& b, u64 (*red)[NT]) {
    for (u32 s = NT / 2; s > 0; s /= 2) {
        b.each([&](u32 t) {
            if (t < s)
                for (u32 l = 0; l < 4; ++l) red[l][t] += red[l][t + s];
        });
        b.sync();
    }
}

// The sums over T tiles of their four SH64 partial sums (`acc_of(i, l)`), into red[l][0].
template <class F> HD void sum_tiles(Blk& b, u64 T, u64 (*red)[NT], F acc_of) {
    u64 seg = cdiv(T, NT);
    b.each([&](u32 t) {
        u64 acc[4] = {0, 0, 0, 0};
        for (u64 i = t * seg; i < T && i < (t + 1) * seg; ++i)
            for (u32 l = 0; l < 4; ++l) acc[l] += acc_of(i, l);
        for (u32 l = 0; l < 4; ++l) red[l][t] = acc[l];
    });
    b.sync();
    block_reduce4(b, red);
}

// enc_tile: one block per tile of 4096 elements, 256 threads, 2 groups of 8 elements each.
// Reads n*size + n bytes (values, cache), writes sm_len(n) + n/8 bytes (s0, words) and the
// cache bytes of groups of 8 with a changed field (about 15% of n at 2% exceptions).
// A full-value cache reads and writes n*size cache bytes instead, and also writes the changed
// mask; its s0 is the Exp frame's (overwritten if the plan picks Hybrid).
template <class L> HD void enc_tile(const EncJob& j, u64 tile, Blk& b, EncTileShm<L>& sh) {
    if (job_delta_frame(j)) return; // a warm delta cache's Delta frame (below)
    u64 n = j.n;
    if (tile * TILE >= n) return;
    u64 base = tile * TILE, tn = min64(TILE, n - base);
    const u8* in = (const u8*)j.input;
    u8* cache = (u8*)j.cache;
    u8* smb = (u8*)sh.sm;
    EncView v(j.scratch, n);
    b.each([&](u32 t) {
        for (u32 k = 0; k < 2; ++k) {
            u32 g = t + k * NT;
            u64 first = 8ull * g;
            u32 mbits = 0;
            u32 cbits = 0;
            if (first < tn && job_full(j)) {
                u32 r = (u32)min64(8, tn - first), w[8];
                u64 i0 = base + first;
                for (u32 q = 0; q < r; ++q) {
                    w[q] = load_val<L>(in, i0 + q);
                    u32 old = load_val<L>(cache, i0 + q);
                    mbits |= (u32)(exp_of<L>(w[q]) != exp_of<L>(old)) << q;
                    cbits |= (u32)(w[q] != old) << q;
                    store_val<L>(cache, i0 + q, w[q]);
                }
                pack_group<L>(w, r, smb + L::sm_len(first));
            } else if (first < tn) {
                u32 r = (u32)min64(8, tn - first), w[8];
                u64 i0 = base + first;
                if (r == 8 && ((u64)(cache + i0) & 7) == 0) {
                    load8<L>(in, i0, w);
                    u64 old = ld64a(cache + i0), nu = 0;
                    for (u32 q = 0; q < 8; ++q) {
                        u32 e = exp_of<L>(w[q]);
                        mbits |= (u32)(e != ((old >> (8 * q)) & 0xff)) << q;
                        nu |= (u64)e << (8 * q);
                    }
                    if (mbits) st64a(cache + i0, nu); // unchanged fields: nothing to write
                } else {
                    for (u32 q = 0; q < r; ++q) {
                        u64 i = i0 + q;
                        w[q] = load_val<L>(in, i);
                        u32 e = exp_of<L>(w[q]);
                        mbits |= (u32)(e != cache[i]) << q;
                        cache[i] = (u8)e;
                    }
                }
                pack_group<L>(w, r, smb + L::sm_len(first));
            }
            sh.mb[g] = (u8)mbits;
            sh.mc[g] = (u8)cbits;
        }
    });
    b.sync();
    u64 sm_bytes = L::sm_len(tn), sm_base = L::sm_len(base);
    u8* s0 = (u8*)j.frame + 64 + sm_base;
    b.each([&](u32 t) {
        sm_out(t, sh.sm, sm_bytes, s0, sm_base, sh.red);
        if (t < TILE_WORDS) {
            u64 wi = tile * TILE_WORDS + t, word = 0;
            if (64ull * t < tn) {
                for (u32 q = 0; q < 8; ++q) word |= (u64)sh.mb[8 * t + q] << (8 * q);
                v.words[wi] = word;
            }
            sh.cnt[t][0] = pop64(word);
            sh.cnt[t][1] = word != 0;
            sh.cnt[t][2] = nonzero_bytes(word);
            sh.cnt[t][3] = 0;
            if (job_full(j) && 64ull * t < tn) {
                u64 c = 0;
                for (u32 q = 0; q < 8; ++q) c |= (u64)sh.mc[8 * t + q] << (8 * q);
                v.cw[wi] = c;
                sh.cnt[t][3] = pop64(c);
            }
        }
    });
    b.sync();
    block_reduce4(b, sh.red);
    b.one([&] {
        TileStat& st = v.stat[tile];
        st.ones = st.nzw = st.nzb = st.k = 0;
        for (u32 w = 0; w < TILE_WORDS; ++w) {
            st.ones += sh.cnt[w][0];
            st.nzw += sh.cnt[w][1];
            st.nzb += sh.cnt[w][2];
            st.k += sh.cnt[w][3];
        }
        for (u32 l = 0; l < 4; ++l) st.acc[l] = sh.red[l][0];
    });
}

struct PlanShm {
    u64 a[4][NT], own[4][NT], tmp[4][NT];
    u64 acc[4][NT];
    u32 hist[256];
    u32 freq[256];
    u32 need_hist, take, fits;
    SegShm seg;
    FreqShm fq;
};

// enc_plan: one block per job. Scans the tile counts into tile offsets, sums the SH64 partials,
// chooses the mask coding as bitmask::plan does (with the same integer estimates), codes a
// segmented rANS mask (a thread per run of segments) when that wins, and decides FILL.
template <class L> HD void enc_plan(const EncJob& j, Blk& b, PlanShm& sh) {
    if (job_delta_frame(j)) return; // a warm delta cache's Delta frame (below)
    u64 n = j.n, T = cdiv(n, TILE), seg = cdiv(T, NT);
    EncView v(j.scratch, n);
    b.each([&](u32 t) {
        u64 c[4] = {0, 0, 0, 0}, acc[4] = {0, 0, 0, 0};
        for (u64 i = t * seg; i < T && i < (t + 1) * seg; ++i) {
            c[0] += v.stat[i].ones;
            c[1] += v.stat[i].nzw;
            c[2] += v.stat[i].nzb;
            c[3] += job_full(j) ? v.stat[i].k : 0;
            for (u32 l = 0; l < 4; ++l) acc[l] += v.stat[i].acc[l];
        }
        for (u32 k = 0; k < 4; ++k) sh.a[k][t] = sh.own[k][t] = c[k];
        for (u32 l = 0; l < 4; ++l) sh.acc[l][t] = acc[l];
    });
    b.sync();
    block_scan<4>(b, sh.a, sh.tmp);
    block_reduce4(b, sh.acc);
    b.each([&](u32 t) {
        u64 run[4];
        for (u32 k = 0; k < 4; ++k) run[k] = sh.a[k][t] - sh.own[k][t];
        for (u64 i = t * seg; i < T && i < (t + 1) * seg; ++i) {
            v.off[i].ones = run[0];
            v.off[i].nzw = run[1];
            v.off[i].nzb = run[2];
            v.off[i].k = run[3];
            run[0] += v.stat[i].ones;
            run[1] += v.stat[i].nzw;
            run[2] += v.stat[i].nzb;
            run[3] += job_full(j) ? v.stat[i].k : 0;
        }
    });
    b.one([&] {
        Plan& p = *v.plan;
        p.ones = sh.a[0][NT - 1];
        p.nzw = sh.a[1][NT - 1];
        p.nzb = sh.a[2][NT - 1];
        for (u32 l = 0; l < 4; ++l) p.sm_acc[l] = sh.acc[l][0];
        u64 W = cdiv(n, 64), nbytes = cdiv(n, 8);
        p.l1_len = cdiv(W, 8);
        p.sm_len = L::sm_len(n);
        p.s1_off = 64 + p.sm_len;
        u64 bytes;
        if (p.ones == 0) {
            p.coding = MASK_ZERO;
            bytes = 1;
        } else {
            u64 flat = 1 + nbytes, hier = 1 + p.l1_len + p.nzw + p.nzb;
            p.coding = hier <= flat ? MASK_HIER : MASK_FLAT;
            bytes = hier <= flat ? hier : flat;
        }
        p.s1_len = bytes;
        p.k = sh.a[3][NT - 1];
        p.mode = 1;
        if (job_full(j) && !job_cold(j)) {
            // Exp or Hybrid, as the CPU chooses for a full-value slot (chunk.rs): Hybrid where
            // its estimate is under 4/5 of the Exp frame's bytes (rANS aside).
            u64 exp_bytes = p.sm_len + bytes + p.ones;
            u32 ch = job_choice(j);
            if (ch == 2 || (ch == 0 && hybrid_estimate(L::sm_len(p.k), n, p.k, p.ones) * 5 < exp_bytes * 4))
                p.mode = 2;
        }
        u64 budget = (p.sm_len + p.ones) / RANS_MIN_GAIN;
        sh.need_hist = !job_cold(j) && p.mode == 1 && p.ones != 0 && iid_bytes(p.ones, n) + budget < bytes;
    });
    b.sync();
    if (sh.need_hist && cdiv(n, 64) >= SAMPLE_MIN_WORDS) {
        mask_hist_blk(b, sh.hist, v.words, n, true);
        freq_from_hist_blk(b, sh.fq, sh.hist, sh.freq);
        b.one([&] {
            const Plan& p = *v.plan;
            u64 budget = (p.sm_len + p.ones) / RANS_MIN_GAIN;
            sh.need_hist = !rans_hopeless(sh.hist, sh.freq, cdiv(n, 8), budget, p.s1_len);
        });
        b.sync();
    }
    if (sh.need_hist) {
        u64 nbytes = cdiv(n, 8);
        mask_hist_blk(b, sh.hist, v.words, n, false);
        freq_from_hist_blk(b, sh.fq, sh.hist, sh.freq);
        b.one([&] {
            const Plan& p = *v.plan;
            u64 est = 1 + rans_seg_estimate(sh.hist, sh.freq, nbytes);
            sh.take = est + (p.sm_len + p.ones) / RANS_MIN_GAIN < p.s1_len;
        });
        b.sync();
        if (sh.take) {
            // Segments a thread per run: their streams and states in the reversal buffer
            // (2 * nbytes, then 2 u32 a segment), then into the frame if the frame fits.
            u32* sl = (u32*)(v.rev + align8(2 * nbytes));
            seg_code(b, sh.seg, v.words, nbytes, sh.freq, v.rev, sl);
            b.one([&] {
                Plan& p = *v.plan;
                p.coding = MASK_RANS_SEG;
                p.s1_len = 1 + sh.seg.total;
                sh.fits = p.s1_off + p.s1_len + p.ones <= 64 + n * L::BYTES;
            });
            b.sync();
            if (sh.fits)
                seg_write(b, sh.seg, nbytes, sh.freq, v.rev, sl, (u8*)j.frame + v.plan->s1_off + 1);
        }
    }
    b.one([&] {
        Plan& p = *v.plan;
        if (p.mode == 2) return; // hyb_masks lays the Hybrid frame out
        p.s2_off = p.s1_off + p.s1_len;
        p.frame_len = p.s2_off + p.ones;
        p.fill = job_cold(j) || p.frame_len > 64 + n * L::BYTES;
        if (p.fill) {
            p.frame_len = 64 + n * L::BYTES;
            p.mode = 0;
        } else {
            p.mode = 1;
            ((u8*)j.frame)[p.s1_off] = (u8)p.coding;
        }
    });
}

struct EmitShm {
    u32 pre[TILE_WORDS][3];
    u64 red[4][NT];
};

// enc_emit: one block per tile. A FILL copies the tile's values into s0 (and sums their SH64);
// otherwise the tile's mask bytes (Flat: its 512 bytes; Hier: its L1 bytes, and its L2 and L3
// bytes at the scanned offsets) and its exceptions (the new cached fields, read back from the
// updated cache) are written. Reads n/8 bytes of words plus the cache bytes of exceptions.
template <class L> HD void enc_emit(const EncJob& j, u64 tile, Blk& b, EmitShm& sh) {
    if (job_delta_frame(j)) return; // a warm delta cache's Delta frame (below)
    u64 n = j.n;
    if (tile * TILE >= n) return;
    EncView v(j.scratch, n);
    const Plan& p = *v.plan;
    u64 base = tile * TILE, tn = min64(TILE, n - base);
    u8* f = (u8*)j.frame;
    if (p.fill) {
        u64 bytes = tn * L::BYTES, nw = cdiv(bytes, 32) * 4, rb = base * L::BYTES;
        const u8* in = (const u8*)j.input + rb;
        u8* s0 = f + 64 + rb;
        b.each([&](u32 t) {
            u64 acc[4] = {0, 0, 0, 0};
            for (u64 w = t; w < nw; w += NT) {
                u64 val = 0;
                for (u64 q = 0; q < 8 && 8 * w + q < bytes; ++q) {
                    val |= (u64)in[8 * w + q] << (8 * q);
                    s0[8 * w + q] = in[8 * w + q];
                }
                sh_word(acc, rb / 8 + w, val);
            }
            for (u32 l = 0; l < 4; ++l) sh.red[l][t] = acc[l];
        });
        b.sync();
        block_reduce4(b, sh.red);
        b.one([&] {
            for (u32 l = 0; l < 4; ++l) v.stat[tile].facc[l] = sh.red[l][0];
        });
        return;
    }
    if (p.mode == 2 || p.coding == MASK_ZERO) return;
    u64 W = cdiv(n, 64), nbytes = cdiv(n, 8);
    b.each([&](u32 t) {
        if (t < TILE_WORDS) {
            u64 wi = tile * TILE_WORDS + t, w = wi < W ? v.words[wi] : 0;
            sh.pre[t][0] = pop64(w);
            sh.pre[t][1] = w != 0;
            sh.pre[t][2] = nonzero_bytes(w);
        }
    });
    b.sync();
    b.one([&] {
        u32 run[3] = {0, 0, 0};
        for (u32 w = 0; w < TILE_WORDS; ++w)
            for (u32 k = 0; k < 3; ++k) {
                u32 c = sh.pre[w][k];
                sh.pre[w][k] = run[k];
                run[k] += c;
            }
    });
    b.sync();
    const TileOff& o = v.off[tile];
    u8* s1 = f + p.s1_off + 1;
    u8* s2 = f + p.s2_off;
    const u8* cache = (const u8*)j.cache;
    b.each([&](u32 t) {
        if (t >= TILE_WORDS) return;
        u64 wi = tile * TILE_WORDS + t;
        if (wi >= W) return;
        u64 w = v.words[wi];
        u64 e = o.ones + sh.pre[t][0];
        for (u64 m = w; m; m &= m - 1) {
            u64 i = 64 * wi + ctz64(m);
            s2[e++] = job_full(j) ? (u8)exp_of<L>(load_val<L>(cache, i)) : cache[i];
        }
        if (p.coding == MASK_FLAT) {
            for (u32 q = 0; q < 8 && 8 * wi + q < nbytes; ++q) s1[8 * wi + q] = (u8)(w >> (8 * q));
        } else if (p.coding == MASK_HIER) {
            if (t % 8 == 0) {
                u32 l1 = 0;
                for (u32 q = 0; q < 8 && wi + q < W; ++q) l1 |= (u32)(v.words[wi + q] != 0) << q;
                s1[wi / 8] = (u8)l1;
            }
            if (w) {
                s1[p.l1_len + o.nzw + sh.pre[t][1]] = (u8)nonzero_byte_map(w);
                u8* l3 = s1 + p.l1_len + p.nzw + o.nzb + sh.pre[t][2];
                for (u32 q = 0; q < 8; ++q)
                    if ((u8)(w >> (8 * q))) *l3++ = (u8)(w >> (8 * q));
            }
        }
    });
}

// hyb_compact (Hybrid only): one block per tile. The tile's changed values in order (at the
// tile's offset among all changed values), whether each changed exponent, and the new
// exponents of those (at the tile's exception offset). Reads n/4 bytes of masks plus the
// changed values; writes 4k + k + ke bytes of scratch.
template <class L> HD void hyb_compact(const EncJob& j, u64 tile, Blk& b, EmitShm& sh) {
    if (job_delta_frame(j)) return; // a warm delta cache's Delta frame (below)
    u64 n = j.n;
    if (tile * TILE >= n) return;
    EncView v(j.scratch, n);
    if (v.plan->mode != 2) return;
    u64 W = cdiv(n, 64);
    const u8* in = (const u8*)j.input;
    b.each([&](u32 t) {
        if (t >= TILE_WORDS) return;
        u64 wi = tile * TILE_WORDS + t;
        sh.pre[t][0] = wi < W ? pop64(v.cw[wi]) : 0;
        sh.pre[t][1] = wi < W ? pop64(v.words[wi]) : 0;
    });
    b.sync();
    b.one([&] {
        u32 run[2] = {0, 0};
        for (u32 w = 0; w < TILE_WORDS; ++w)
            for (u32 k = 0; k < 2; ++k) {
                u32 c = sh.pre[w][k];
                sh.pre[w][k] = run[k];
                run[k] += c;
            }
    });
    b.sync();
    const TileOff& o = v.off[tile];
    b.each([&](u32 t) {
        if (t >= TILE_WORDS) return;
        u64 wi = tile * TILE_WORDS + t;
        if (wi >= W) return;
        u64 c = v.cw[wi], e = v.words[wi], r = o.k + sh.pre[t][0], x = o.ones + sh.pre[t][1];
        for (u64 m = c; m; m &= m - 1) {
            u32 q = ctz64(m);
            u32 w = load_val<L>(in, 64 * wi + q);
            u8 f = (u8)((e >> q) & 1);
            v.cvals[r] = w;
            v.cflag[r++] = f;
            if (f) v.xs[x++] = (u8)exp_of<L>(w);
        }
    });
}

// hyb_masks (Hybrid only): one block per job. The exponent mask over the changed values, then
// both masks planned as the CPU does (bitmask::plan_gated, on one thread) and coded by the block
// (a coding 4 mask a thread per run of segments), the frame laid out, or a FILL where it would be
// longer than the values.
template <class L> HD void hyb_masks(const EncJob& j, Blk& b, MaskShm& sh) {
    if (job_delta_frame(j)) return; // a warm delta cache's Delta frame (below)
    u64 n = j.n;
    EncView v(j.scratch, n);
    Plan& p = *v.plan;
    if (p.mode != 2) return;
    u64 k = p.k, ke = p.ones, XW = cdiv(k, 64);
    b.each([&](u32 t) {
        for (u64 w = t; w < XW; w += NT) {
            u64 x = 0;
            for (u64 q = 0; q < 64 && 64 * w + q < k; ++q) x |= (u64)v.cflag[64 * w + q] << q;
            v.xw[w] = x;
        }
    });
    b.sync();
    // Both masks (k <= n bits) code their segments through the reversal buffer: streams in its
    // first 2 * ceil(n/8) bytes, states and lengths after them. mbuf holds both coded masks: a
    // coding 4 mask is chosen only where its estimate is under 1 + ceil(m/8) bytes, and its
    // streams exceed the estimate by under a byte a segment, so they fit; a FILL, should they not.
    u64 nb = cdiv(n, 8), cap = align8(2 * (2 * nb + 1100));
    u64 budget = (L::sm_len(k) + ke) / RANS_MIN_GAIN;
    u32* sl = (u32*)(v.rev + align8(2 * nb));
    mask_code_blk(b, sh, v.cw, n, true, 0, (L::sm_len(k) + ke) / RANS_MIN_GAIN_VALUES, v.rev, sl,
                  v.mbuf, cap);
    u64 l1 = sh.len;
    mask_code_blk(b, sh, v.xw, k, true, 0, budget, v.rev, sl, v.mbuf + min64(l1, cap),
                  l1 < cap ? cap - l1 : 0);
    b.one([&] {
        p.sm_len = L::sm_len(k);
        p.s1_off = 64 + p.sm_len;
        p.s1_len = l1;
        p.s2_len = sh.len;
        p.s3_len = ke;
        p.s2_off = p.s1_off + p.s1_len;
        p.frame_len = p.s2_off + p.s2_len + ke;
        p.fill = p.frame_len > 64 + n * L::BYTES || p.s1_len + p.s2_len > cap;
        if (p.fill) {
            p.frame_len = 64 + n * L::BYTES;
            p.mode = 0;
        }
    });
    b.sync();
    if (p.fill) return;
    u8* f = (u8*)j.frame;
    u64 masks = p.s1_len + p.s2_len;
    b.each([&](u32 t) {
        for (u64 q = t; q < masks + ke; q += NT)
            f[p.s1_off + q] = q < masks ? v.mbuf[q] : v.xs[q - masks];
    });
}

// hyb_pack (Hybrid only): one block per 4096 changed values: their packed sm into s0 and its
// SH64 partial sums. Reads 4k, writes sm_len(k) bytes.
template <class L> HD void hyb_pack(const EncJob& j, u64 tile, Blk& b, EncTileShm<L>& sh) {
    if (job_delta_frame(j)) return; // a warm delta cache's Delta frame (below)
    u64 n = j.n;
    EncView v(j.scratch, n);
    const Plan& p = *v.plan;
    if (p.mode != 2 || p.fill || tile * TILE >= p.k) return;
    u64 base = tile * TILE, tn = min64(TILE, p.k - base);
    u8* smb = (u8*)sh.sm;
    b.each([&](u32 t) {
        for (u32 k = 0; k < 2; ++k) {
            u64 first = 8ull * (t + k * NT);
            if (first >= tn) continue;
            u32 r = (u32)min64(8, tn - first), w[8];
            for (u32 q = 0; q < r; ++q) w[q] = v.cvals[base + first + q];
            pack_group<L>(w, r, smb + L::sm_len(first));
        }
    });
    b.sync();
    u64 sm_base = L::sm_len(base);
    b.each([&](u32 t) { sm_out(t, sh.sm, L::sm_len(tn), (u8*)j.frame + 64 + sm_base, sm_base, sh.red); });
    b.sync();
    block_reduce4(b, sh.red);
    b.one([&] {
        for (u32 l = 0; l < 4; ++l) v.stat[tile].acc[l] = sh.red[l][0];
    });
}

struct FinishShm {
    u8 hdr[64];
    u64 lane[8];
    u64 red[4][NT];
};

// The format version the encoders write (docs/WIRE.md; decoders read 1 to this one).
constexpr u32 FORMAT_VERSION = 3;
HD void write_header(u8* h, u32 dt, u32 mode, u32 flags, u64 n, u64 offset, u64 version,
                     const u64* sec) {
    h[0] = 'C';
    h[1] = 'I';
    h[2] = 'R';
    h[3] = 'F';
    h[4] = FORMAT_VERSION;
    h[5] = (u8)dt;
    h[6] = (u8)mode;
    h[7] = (u8)flags;
    wr64(h + 8, n);
    wr64(h + 16, offset);
    wr64(h + 24, version);
    for (u32 k = 0; k < 4; ++k) wr32(h + 32 + 4 * k, (u32)sec[k]);
}

// The frame checksum over hdr[0..56] and `tail`: eight lanes of threads 0..7 for long inputs.
// The result is in lane[0] after the call (after a sync).
HD void block_xxh3(Blk& b, const u8* hdr, const u8* tail, u64 tail_len, u64* lane) {
    Cat c{hdr, tail, 56 + tail_len};
    if (c.len <= 240) {
        b.one([&] { lane[0] = xxh3_mid(c); });
        b.sync();
        return;
    }
    b.each([&](u32 t) {
        if (t < 8) lane[t] = xxh3_long_lane(c, t);
    });
    b.sync();
    b.one([&] { lane[0] = xxh3_long_merge(lane, c.len); });
    b.sync();
}

// enc_finish: one block per job. The header, SH64 of s0 and the frame checksum.
template <class L> HD void enc_finish(const EncJob& j, Blk& b, FinishShm& sh) {
    if (job_delta_frame(j)) return; // a warm delta cache's Delta frame (below)
    u64 n = j.n;
    EncView v(j.scratch, n);
    Plan& p = *v.plan;
    u8* f = (u8*)j.frame;
    // SH64 of s0 from the tiles' partial sums: a FILL's raw values, or a Hybrid frame's packed
    // changed values (enc_plan summed an Exp frame's).
    u64 T = p.fill ? cdiv(n, TILE) : p.mode == 2 ? cdiv(p.k, TILE) : 0;
    if (T)
        sum_tiles(b, T, sh.red,
                  [&](u64 i, u32 l) { return p.fill ? v.stat[i].facc[l] : v.stat[i].acc[l]; });
    b.one([&] {
        u64 sec[4] = {p.sm_len, p.s1_len, p.ones, 0};
        u64 part[4];
        for (u32 l = 0; l < 4; ++l) part[l] = p.mode == 1 ? p.sm_acc[l] : T ? sh.red[l][0] : 0;
        if (p.fill) {
            sec[0] = n * L::BYTES;
            sec[1] = sec[2] = 0;
        } else if (p.mode == 2) {
            sec[2] = p.s2_len;
            sec[3] = p.s3_len;
        }
        write_header(sh.hdr, L::DT, (u32)p.mode, p.fill ? 1 : 0, n, j.offset, j.version, sec);
        wr64(sh.hdr + 48, sh_finish(part, sec[0]));
    });
    b.sync();
    u64 s0 = p.fill ? n * L::BYTES : p.sm_len;
    block_xxh3(b, sh.hdr, f + 64 + s0, p.frame_len - 64 - s0, sh.lane);
    b.one([&] {
        wr64(sh.hdr + 56, sh.lane[0]);
        for (u32 q = 0; q < 64; ++q) f[q] = sh.hdr[q];
    });
}

// ---------------------------------------------------------------------------------------------
// Decode (exponent cache): Exp and FILL frames into values and the updated cache. Launches per
// batch of DecJob, in this order on one stream (each returns at once once a job has an error):
//   ciera_dec_parse_<t>   grid (1, jobs) x 256: header checks, frame checksum (XXH3, 8 lanes)
//   ciera_dec_delta_model_<t>, ciera_dec_delta_<t>: Delta frames (see that section)
//   ciera_dec_mask_<t>    grid (tiles, jobs): Flat/Zero mask words, or Hier level-1 counts
//   ciera_dec_rans        grid (1, jobs): a rANS-coded mask (rare): coding 4 a thread per run
//                         of segments, coding 3 (format versions 1 and 2) on one thread
//   ciera_dec_scan (0)    grid (1, jobs): Hier level-1 counts -> offsets
//   ciera_dec_hier2       grid (tiles, jobs): Hier level-2 bytes -> counts
//   ciera_dec_scan (1)    level-2 counts -> offsets
//   ciera_dec_hier3       grid (tiles, jobs): Hier level-3 bytes -> mask words, ones
//   ciera_dec_scan (2)    ones -> exception offsets; count checks
//   ciera_dec_tile_<t>    grid (tiles, jobs): values, cache update, exception checks, SH64 sums
//   ciera_dec_finish      grid (1, jobs): SH64 of s0 against the header
// The host reads DecPlan.err (and a, b) after the stream: non-zero means the frame is refused
// and, as on the CPU, the slot must be poisoned (the cache may be partly updated).

struct DecJob {
    u64 frame;     // 8-aligned, the received bytes (frame_len of them, a frame at their start)
    u64 frame_len;
    u64 out;       // n values
    u64 cache;     // n exponent bytes (or n values: `full`), read, then updated
    u64 scratch;   // dec_scratch_bytes(n), 8-aligned
    u64 n;         // the chunk's elements (>= 1)
    u64 offset;    // the chunk's element offset (must match the frame's)
    u64 version;   // the slot's version (an Exp frame must carry it)
    u64 warm;      // non-zero: the slot is warm (Exp and Hybrid frames need it)
    u64 full;      // non-zero: `cache` holds the n previous values (a full-value cache), which
                   // also takes Hybrid frames
    u64 ctx;       // a delta cache (with `full`): the n context bytes, read, then updated; else 0
    u64 dscratch;  // with `ctx`: delta_scratch_bytes(n), 8-aligned (the Delta model); else 0
};

enum : u32 {
    DE_OK = 0,
    DE_HEADER = 1,     // bad magic, version, type, mode, flags, or section lengths
    DE_CHECKSUM = 2,   // the frame checksum (XXH3 of header and s1..s3)
    DE_S0 = 3,         // SH64 of s0
    DE_VERSION = 4,    // a = slot version, b = frame version
    DE_SLOT = 5,       // cold slot, or a frame needing a value cache (hybrid, delta)
    DE_LENGTH = 6,     // element count or offset differ from the chunk's (a = expected, b = found)
    DE_MASK = 7,       // the coded mask is malformed
    DE_EXCEPTION = 8,  // exception count, or an exception that repeats / exceeds (a = element)
    DE_PADDING = 9,    // non-zero padding bits in s0 (a = element)
    DE_DTYPE = 10,     // a = expected type, b = found
    DE_DELTA = 11,     // a Delta frame's model (a = 1, b = context, or 17: the group lengths'
                       // size) or lane streams (a = 2, b = group) are malformed
};

struct DecPlan {
    u32 err, pad0;
    u64 a, b;
    u64 mode, fill, coding, s0_len, s1_off, s1_len, s2_off, s2_len, l1_len, nzw, nzb, ones;
    u64 s0_hash, frame_len;
    u64 k, s3_off, s3_len; // Hybrid: changed values, the exponent section
};
struct DecTile {
    u32 c[3], pad; // Hier nonzero words, Hier level-3 bytes, ones
    u64 acc[4];    // SH64 partial sums of the tile's s0 bytes
};
struct DecOff {
    u64 c[3], pad;
};
struct DecView {
    DecPlan* plan;
    DecTile* stat;
    DecOff* off;
    u64* words; // the Exp mask, or the Hybrid changed mask
    u64* xw;    // Hybrid: the exponent mask over the changed values
    u32* xp;    // Hybrid: set bits of xw before each word
    HD DecView(u64 scratch, u64 n) {
        u8* s = (u8*)scratch;
        u64 T = cdiv(n, TILE);
        plan = (DecPlan*)s;
        u64 o = align8(sizeof(DecPlan));
        stat = (DecTile*)(s + o);
        o += T * sizeof(DecTile);
        off = (DecOff*)(s + o);
        o += T * sizeof(DecOff);
        words = (u64*)(s + o);
        o += 8 * cdiv(n, 64);
        xw = (u64*)(s + o);
        o += 8 * cdiv(n, 64);
        xp = (u32*)(s + o);
    }
};
HD u64 dec_scratch_bytes(u64 n) {
    return align8(sizeof(DecPlan)) + cdiv(n, TILE) * (sizeof(DecTile) + sizeof(DecOff)) +
           16 * cdiv(n, 64) + align8(4 * cdiv(n, 64));
}
HD void set_err(DecPlan* p, u32 code, u64 a, u64 b) {
#if defined(CIERA_DEVICE_BUILD)
    if (atomicCAS(&p->err, 0u, code) == 0u) {
        p->a = a;
        p->b = b;
    }
#else
    if (p->err == 0) {
        p->err = code;
        p->a = a;
        p->b = b;
    }
#endif
}

struct ParseShm {
    u64 lane[8];
    u32 ok;
};

// dec_parse: the header's fields against the chunk, then the frame checksum.
template <class L> HD void dec_parse(const DecJob& j, Blk& b, ParseShm& sh) {
    DecView v(j.scratch, j.n);
    const u8* f = (const u8*)j.frame;
    b.one([&] {
        DecPlan& p = *v.plan;
        p.err = 0;
        p.a = p.b = 0;
        sh.ok = 0;
        u64 len = j.frame_len, n = j.n;
        if (len < 64 || f[0] != 'C' || f[1] != 'I' || f[2] != 'R' || f[3] != 'F' ||
            f[4] < 1 || f[4] > FORMAT_VERSION) {
            set_err(&p, DE_HEADER, 0, 0);
            return;
        }
        u32 dt = f[5], mode = f[6], flags = f[7];
        u64 sec[4], total = 64;
        for (u32 k = 0; k < 4; ++k) total += sec[k] = rd32(f + 32 + 4 * k);
        if (dt > 11 || mode > 3 || (mode == 3 && f[4] == 1) || (flags & ~1u) ||
            ((flags & 1) && mode != 0) || total > len) {
            set_err(&p, DE_HEADER, total, len);
            return;
        }
        if (dt != L::DT) {
            set_err(&p, DE_DTYPE, L::DT, dt);
            return;
        }
        if (rd64(f + 8) != n) {
            set_err(&p, DE_LENGTH, n, rd64(f + 8));
            return;
        }
        if (rd64(f + 16) != j.offset) {
            set_err(&p, DE_LENGTH, j.offset, rd64(f + 16));
            return;
        }
        p.mode = mode;
        p.fill = flags & 1;
        p.frame_len = total; // frames are self-delimiting: bytes past them are not this frame's
        p.s0_len = sec[0];
        p.s1_off = 64 + sec[0];
        p.s1_len = sec[1];
        p.s2_off = p.s1_off + sec[1];
        p.s2_len = sec[2];
        p.s0_hash = rd64(f + 48);
        p.l1_len = cdiv(cdiv(n, 64), 8);
        p.coding = MASK_ZERO;
        if (mode == 0) {
            if (!p.fill || sec[0] != n * L::BYTES || sec[1] || sec[2] || sec[3]) {
                set_err(&p, DE_HEADER, sec[0], n * L::BYTES);
                return;
            }
        } else if ((mode == 3 && !(j.full && j.ctx && j.dscratch)) || (mode == 2 && !j.full)) {
            set_err(&p, DE_SLOT, mode, 0); // the slot's cache cannot take this frame
            return;
        } else if (!j.warm) {
            set_err(&p, DE_SLOT, 1, 0);
            return;
        } else if (rd64(f + 24) != j.version) {
            set_err(&p, DE_VERSION, j.version, rd64(f + 24));
            return;
        } else if (mode == 3) {
            if (sec[2] || sec[3]) {
                set_err(&p, DE_HEADER, sec[2], sec[3]);
                return;
            }
        } else if (mode == 2) {
            p.s3_off = p.s2_off + sec[2];
            p.s3_len = sec[3];
        } else {
            if (sec[0] != L::sm_len(n) || sec[3] != 0) {
                set_err(&p, DE_LENGTH, L::sm_len(n), sec[0]);
                return;
            }
            if (sec[1] == 0 || f[p.s1_off] > MASK_RANS_SEG) {
                set_err(&p, DE_MASK, 0, 0);
                return;
            }
            if (f[p.s1_off] == MASK_RANS_SEG && f[4] < SEG_VERSION) {
                set_err(&p, DE_MASK, 0, 36); // coding 4 in a frame of format version 1 or 2
                return;
            }
            p.coding = f[p.s1_off];
            u64 pl = sec[1] - 1;
            if ((p.coding == MASK_ZERO && pl != 0) || (p.coding == MASK_FLAT && pl != cdiv(n, 8)) ||
                (p.coding == MASK_HIER && pl < p.l1_len)) {
                set_err(&p, DE_MASK, pl, 0);
                return;
            }
        }
        sh.ok = 1;
    });
    b.sync();
    if (!sh.ok) return;
    const DecPlan& p = *v.plan;
    block_xxh3(b, f, f + p.s1_off, p.frame_len - p.s1_off, sh.lane);
    b.one([&] {
        if (sh.lane[0] != rd64(f + 56)) set_err(v.plan, DE_CHECKSUM, rd64(f + 56), sh.lane[0]);
    });
}

struct DecMaskShm {
    u32 cnt[TILE_WORDS];
    u32 pre[TILE_WORDS];
    u64 red[4][NT];
    u32 go;
};

// Whether a job's frame is not refused, read once for the whole block (into `go`, shared):
// the blocks of one launch refuse frames (set_err) while others start, and on a device a
// barrier that only some of a block's threads reach is undefined behaviour (a hang). A tile
// kernel that can be refused by another block of its launch asks this, after its block-uniform
// returns, before its first phase.
HD bool block_go(Blk& b, const DecPlan& p, u32& go) {
    b.one([&] { go = p.err == 0; });
    b.sync();
    return go != 0;
}

// Sum of sh.cnt[0..64) by thread 0 into *dst; exclusive prefix into sh.pre.
HD void tile_prefix(DecMaskShm& sh, u32* dst) {
    u32 run = 0;
    for (u32 w = 0; w < TILE_WORDS; ++w) {
        sh.pre[w] = run;
        run += sh.cnt[w];
    }
    if (dst) *dst = run;
}

// dec_mask: Flat and Zero masks to words (and ones), Hier level-1 counts.
HD void dec_mask(const DecJob& j, u64 tile, Blk& b, DecMaskShm& sh) {
    u64 n = j.n;
    if (tile * TILE >= n) return;
    DecView v(j.scratch, n);
    const DecPlan& p = *v.plan;
    if (p.fill || p.mode != 1 || rans_coded(p.coding) || !block_go(b, p, sh.go)) return;
    const u8* pay = (const u8*)j.frame + p.s1_off + 1;
    u64 W = cdiv(n, 64), nbytes = cdiv(n, 8);
    b.each([&](u32 t) {
        if (t >= TILE_WORDS) return;
        u64 wi = tile * TILE_WORDS + t, w = 0;
        sh.cnt[t] = 0;
        if (wi >= W) return;
        if (p.coding == MASK_HIER) {
            if (t % 8 == 0 && wi / 8 < p.l1_len) {
                u32 l1 = pay[wi / 8];
                if (wi / 8 == p.l1_len - 1 && W % 8 && (l1 >> (W % 8)))
                    set_err(v.plan, DE_MASK, wi, 1);
                sh.cnt[t] = pop32(l1);
            }
            return;
        }
        if (p.coding == MASK_FLAT)
            for (u32 q = 0; q < 8 && 8 * wi + q < nbytes; ++q) w |= (u64)pay[8 * wi + q] << (8 * q);
        if (wi == W - 1 && n % 64 && (w >> (n % 64))) set_err(v.plan, DE_MASK, wi, 2);
        v.words[wi] = w;
        sh.cnt[t] = pop64(w);
    });
    b.sync();
    b.one([&] {
        u32 sum = 0;
        for (u32 w = 0; w < TILE_WORDS; ++w) sum += sh.cnt[w];
        DecTile& st = v.stat[tile];
        st.c[0] = st.c[1] = st.c[2] = 0;
        st.c[p.coding == MASK_HIER ? 0 : 2] = sum;
    });
}

// rans::decode of a coding 3 payload (two states) of `nbytes` mask bytes from exactly
// in[0..len) into words (ceil(nbytes/8) of them, zeroed first), on one thread. Returns 0, or why
// not (a code for DE_MASK's detail).
HD u32 rans_decode_seq(const u8* in, u64 len, u64 nbytes, u64* words) {
    u64 pos = 0;
    u32 freq[256], cum[256];
    u8 slot_sym[PROB_SCALE];
    u32 why = rans_table_read(in, len, &pos, freq, cum, slot_sym);
    if (why) return why;
    if (pos + 8 > len) return 18;
    u32 x[2] = {rd32(in + pos), rd32(in + pos + 4)};
    pos += 8;
    for (u32 k = 0; k < 2; ++k)
        if (x[k] < RANS_L || (u64)x[k] >= ((u64)RANS_L << 8)) return 19;
    for (u64 wi = 0; wi < cdiv(nbytes, 8); ++wi) words[wi] = 0;
    for (u64 i = 0; i < nbytes; ++i) {
        u32& st = x[i & 1];
        u32 slot = st & (PROB_SCALE - 1), s = slot_sym[slot];
        u32 nx = freq[s] * (st >> 12) + slot - cum[s];
        while (nx < RANS_L) {
            if (pos >= len) return 20;
            nx = (nx << 8) | in[pos++];
        }
        st = nx;
        words[i / 8] |= (u64)s << (8 * (i % 8));
    }
    if (pos != len) return 21;
    if (x[0] != RANS_L || x[1] != RANS_L) return 22;
    return 0;
}

// dec_rans: a rANS-coded Exp mask, with per-tile ones: coding 4 a thread per run of segments
// (dec_parse refused it in a version 1 or 2 frame), coding 3 on one thread.
HD void dec_rans(const DecJob& j, Blk& b, SegDecShm& sh) {
    DecView v(j.scratch, j.n);
    DecPlan& p = *v.plan;
    if (p.err || p.fill || p.mode != 1 || !rans_coded(p.coding)) return;
    u64 n = j.n, W = cdiv(n, 64), T = cdiv(n, TILE);
    const u8* in = (const u8*)j.frame + p.s1_off + 1;
    if (p.coding == MASK_RANS) {
        b.one([&] { sh.why = rans_decode_seq(in, p.s1_len - 1, cdiv(n, 8), v.words); });
        b.sync();
    } else {
        seg_decode(b, sh, in, p.s1_len - 1, cdiv(n, 8), v.words);
    }
    b.one([&] {
        if (!sh.why && n % 64 && (v.words[W - 1] >> (n % 64))) sh.why = 2;
        if (sh.why) set_err(&p, DE_MASK, sh.why, 0);
    });
    b.sync();
    if (sh.why) return;
    b.each([&](u32 t) {
        for (u64 tile = t; tile < T; tile += NT) {
            u32 ones = 0;
            for (u64 wi = tile * TILE_WORDS; wi < W && wi < (tile + 1) * TILE_WORDS; ++wi)
                ones += pop64(v.words[wi]);
            v.stat[tile].c[0] = v.stat[tile].c[1] = 0;
            v.stat[tile].c[2] = ones;
        }
    });
}

struct DecScanShm {
    u64 a[1][NT], own[1][NT], tmp[1][NT];
};

// dec_scan: per-tile counts `which` -> offsets and the total, with the checks that need it.
HD void dec_scan(const DecJob& j, u32 which, Blk& b, DecScanShm& sh) {
    u64 n = j.n, T = cdiv(n, TILE), seg = cdiv(T, NT);
    DecView v(j.scratch, n);
    DecPlan& p = *v.plan;
    if (p.err || p.fill || p.mode != 1) return;
    if (which < 2 && p.coding != MASK_HIER) return;
    b.each([&](u32 t) {
        u64 c = 0;
        for (u64 i = t * seg; i < T && i < (t + 1) * seg; ++i) c += v.stat[i].c[which];
        sh.a[0][t] = sh.own[0][t] = c;
    });
    b.sync();
    block_scan<1>(b, sh.a, sh.tmp);
    b.each([&](u32 t) {
        u64 run = sh.a[0][t] - sh.own[0][t];
        for (u64 i = t * seg; i < T && i < (t + 1) * seg; ++i) {
            v.off[i].c[which] = run;
            run += v.stat[i].c[which];
        }
    });
    b.one([&] {
        u64 total = sh.a[0][NT - 1], pl = p.s1_len - 1;
        if (which == 0) {
            p.nzw = total;
            if (pl < p.l1_len + total) set_err(&p, DE_MASK, pl, 3);
        } else if (which == 1) {
            p.nzb = total;
            if (pl != p.l1_len + p.nzw + total) set_err(&p, DE_MASK, pl, 4);
        } else {
            p.ones = total;
            if (p.coding != MASK_ZERO && total == 0) set_err(&p, DE_MASK, 0, 5);
            else if (p.s2_len != total) set_err(&p, DE_EXCEPTION, p.s2_len, total);
        }
    });
}

// dec_hier2: each nonzero word's level-2 byte (which of its bytes are nonzero), kept in the
// word's slot until dec_hier3; per tile the number of level-3 bytes.
HD void dec_hier2(const DecJob& j, u64 tile, Blk& b, DecMaskShm& sh) {
    u64 n = j.n;
    if (tile * TILE >= n) return;
    DecView v(j.scratch, n);
    const DecPlan& p = *v.plan;
    if (p.fill || p.mode != 1 || p.coding != MASK_HIER || !block_go(b, p, sh.go)) return;
    const u8* pay = (const u8*)j.frame + p.s1_off + 1;
    u64 W = cdiv(n, 64);
    b.each([&](u32 t) {
        if (t >= TILE_WORDS) return;
        u64 wi = tile * TILE_WORDS + t;
        sh.cnt[t] = wi < W ? (pay[wi / 8] >> (wi % 8)) & 1 : 0;
    });
    b.sync();
    b.one([&] { tile_prefix(sh, nullptr); });
    b.sync();
    const DecOff& o = v.off[tile];
    b.each([&](u32 t) {
        if (t >= TILE_WORDS) return;
        u64 wi = tile * TILE_WORDS + t;
        u32 map = 0;
        if (sh.cnt[t]) {
            map = pay[p.l1_len + o.c[0] + sh.pre[t]];
            if (!map) set_err(v.plan, DE_MASK, wi, 6);
        }
        if (wi < W) v.words[wi] = map;
        sh.cnt[t] = pop32(map);
    });
    b.sync();
    b.one([&] {
        u32 sum = 0;
        for (u32 w = 0; w < TILE_WORDS; ++w) sum += sh.cnt[w];
        v.stat[tile].c[1] = sum;
    });
}

// dec_hier3: the level-3 bytes into mask words; per tile the ones.
HD void dec_hier3(const DecJob& j, u64 tile, Blk& b, DecMaskShm& sh) {
    u64 n = j.n;
    if (tile * TILE >= n) return;
    DecView v(j.scratch, n);
    const DecPlan& p = *v.plan;
    if (p.fill || p.mode != 1 || p.coding != MASK_HIER || !block_go(b, p, sh.go)) return;
    const u8* l3 = (const u8*)j.frame + p.s1_off + 1 + p.l1_len + p.nzw;
    u64 W = cdiv(n, 64);
    b.each([&](u32 t) {
        if (t >= TILE_WORDS) return;
        u64 wi = tile * TILE_WORDS + t;
        sh.cnt[t] = wi < W ? pop32((u32)v.words[wi]) : 0;
    });
    b.sync();
    b.one([&] { tile_prefix(sh, nullptr); });
    b.sync();
    const DecOff& o = v.off[tile];
    b.each([&](u32 t) {
        if (t >= TILE_WORDS) return;
        u64 wi = tile * TILE_WORDS + t;
        if (wi >= W) return;
        u32 map = (u32)v.words[wi];
        const u8* src = l3 + o.c[1] + sh.pre[t];
        u64 w = 0;
        for (u32 q = 0; q < 8; ++q)
            if ((map >> q) & 1) {
                u8 c = *src++;
                if (!c) set_err(v.plan, DE_MASK, wi, 7);
                w |= (u64)c << (8 * q);
            }
        if (wi == W - 1 && n % 64 && (w >> (n % 64))) set_err(v.plan, DE_MASK, wi, 2);
        v.words[wi] = w;
        sh.cnt[t] = pop64(w);
    });
    b.sync();
    b.one([&] {
        u32 sum = 0;
        for (u32 w = 0; w < TILE_WORDS; ++w) sum += sh.cnt[w];
        v.stat[tile].c[2] = sum;
    });
}

// dec_hyb (Hybrid only): one block per job: both masks (bitmask::decode by mask_read_blk), the
// section lengths they imply, the exponent mask's word prefixes and each tile's offset among
// the changed values (counted by runs and scanned).
template <class L> HD void dec_hyb(const DecJob& j, Blk& b, SegDecShm& sh) {
    u64 n = j.n;
    DecView v(j.scratch, n);
    DecPlan& p = *v.plan;
    if (p.err || p.mode != 2) return;
    const u8* f = (const u8*)j.frame;
    bool seg_ok = f[4] >= SEG_VERSION;
    mask_read_blk(b, sh, f + p.s1_off, p.s1_len, n, seg_ok, v.words);
    b.one([&] {
        if (sh.why) set_err(&p, DE_MASK, sh.why, 1);
    });
    b.sync();
    // Every thread reads sh.why and sh.ones (the changed values, k <= n: the exponent mask's
    // bits) here, after the barrier; mask_read_blk writes them again only after one of its own.
    u64 k = sh.ones;
    if (sh.why) return;
    mask_read_blk(b, sh, f + p.s2_off, p.s2_len, k, seg_ok, v.xw);
    b.one([&] {
        if (sh.why) return set_err(&p, DE_MASK, sh.why, 2);
        if (p.s0_len != L::sm_len(k)) return set_err(&p, DE_LENGTH, L::sm_len(k), p.s0_len);
        p.k = k;
        if (p.s3_len != sh.ones) set_err(&p, DE_EXCEPTION, p.s3_len, sh.ones);
    });
    b.sync();
    if (p.err) return;
    // The exponent mask's set bits before each of its words (xp), and the changed values before
    // each tile (off[t].c[2]): counts by runs, scanned, then each run written from its start.
    u64 KW = cdiv(k, 64), W = cdiv(n, 64), T = cdiv(n, TILE);
    auto tile_ones = [&](u64 t) {
        u64 c = 0;
        for (u64 w = t * TILE_WORDS; w < W && w < (t + 1) * TILE_WORDS; ++w) c += pop64(v.words[w]);
        return c;
    };
    b.each([&](u32 t) {
        u64 c = 0, d = 0;
        for (u64 w = run_lo(t, KW); w < run_hi(t, KW); ++w) c += pop64(v.xw[w]);
        for (u64 q = run_lo(t, T); q < run_hi(t, T); ++q) d += tile_ones(q);
        sh.cnt[0][t] = sh.cown[0][t] = c;
        sh.cnt[1][t] = sh.cown[1][t] = d;
    });
    b.sync();
    block_scan<2>(b, sh.cnt, sh.ctmp);
    b.each([&](u32 t) {
        u64 run = sh.cnt[0][t] - sh.cown[0][t];
        for (u64 w = run_lo(t, KW); w < run_hi(t, KW); ++w) {
            v.xp[w] = (u32)run;
            run += pop64(v.xw[w]);
        }
        run = sh.cnt[1][t] - sh.cown[1][t];
        for (u64 q = run_lo(t, T); q < run_hi(t, T); ++q) {
            v.off[q].c[2] = run;
            run += tile_ones(q);
        }
    });
    b.sync();
}

// dec_tile: one block per tile of 4096 elements, 2 groups of 8 per thread. Exp: value =
// sm | e << shift with e the exception (checked: <= the field's maximum, not the cached one)
// or the cached field; the cache takes e. FILL: the values, and the cache their fields. Both
// sum SH64 over the tile's s0 bytes. Reads sm_len + n + n/8 (+ exceptions) bytes, writes
// n*size + n (Exp); FILL reads and writes n*size + n.
// sh.pre[w]: the set bits of the tile's mask words before word w (W words in all).
HD void word_prefix(Blk& b, DecMaskShm& sh, const u64* words, u64 tile, u64 W) {
    b.each([&](u32 t) {
        if (t >= TILE_WORDS) return;
        u64 wi = tile * TILE_WORDS + t;
        sh.cnt[t] = wi < W ? pop64(words[wi]) : 0;
    });
    b.sync();
    b.one([&] { tile_prefix(sh, nullptr); });
    b.sync();
}

// Thread t's share of the SH64 partial sums of s0[0..bytes), byte `at` of the section (a
// multiple of 32; s0 8-aligned: the frame's base + 64 + at), into red[.][t].
HD void s0_share(u32 t, const u8* s0, u64 bytes, u64 at, u64 (*red)[NT]) {
    u64 acc[4] = {0, 0, 0, 0}, nw = cdiv(bytes, 32) * 4;
    for (u64 wd = t; wd < nw; wd += NT) {
        u64 val = 0;
        if (8 * wd + 8 <= bytes)
            val = ld64a(s0 + 8 * wd);
        else
            for (u64 q = 0; q < 8 && 8 * wd + q < bytes; ++q) val |= (u64)s0[8 * wd + q] << (8 * q);
        sh_word(acc, at / 8 + wd, val);
    }
    for (u32 l = 0; l < 4; ++l) red[l][t] = acc[l];
}

// Tile `tile` of T's SH64 partial sums of s0 (`len` bytes at 8-aligned `s0`), where s0 is not
// laid out by tiles (Delta frames): the tile-th of T equal runs of whole 32-byte stripes, its
// four sums into out[0..4].
HD void s0_tile_sums(Blk& b, const u8* s0, u64 len, u64 tile, u64 T, u64 (*red)[NT], u64* out) {
    u64 S = cdiv(cdiv(len, 32), T) * 32, at = min64(tile * S, len), bytes = min64(S, len - at);
    b.each([&](u32 t) { s0_share(t, s0 + at, bytes, at, red); });
    b.sync();
    block_reduce4(b, red);
    b.one([&] {
        for (u32 l = 0; l < 4; ++l) out[l] = red[l][0];
    });
}

template <class L> HD void dec_tile(const DecJob& j, u64 tile, Blk& b, DecMaskShm& sh) {
    u64 n = j.n;
    if (tile * TILE >= n) return;
    DecView v(j.scratch, n);
    const DecPlan& p = *v.plan;
    if (!(p.fill || p.mode == 1) || !block_go(b, p, sh.go)) return;
    u64 base = tile * TILE, tn = min64(TILE, n - base);
    const u8* f = (const u8*)j.frame;
    u8* out = (u8*)j.out;
    u8* cache = (u8*)j.cache;
    u64 W = cdiv(n, 64);
    // This block's part of s0 (SH64): the tile's raw values (FILL) or sm (Exp).
    u64 s0_tile = p.fill ? base * L::BYTES : L::sm_len(base);
    u64 s0_bytes = p.fill ? tn * L::BYTES : L::sm_len(tn);
    const u8* s0 = f + 64 + s0_tile;
    if (!p.fill) word_prefix(b, sh, v.words, tile, W);
    const DecOff& o = v.off[tile];
    b.each([&](u32 t) {
        for (u32 k = 0; k < 2; ++k) {
            u32 g = t + k * NT;
            u64 first = 8ull * g;
            if (first >= tn) continue;
            u32 r = (u32)min64(8, tn - first);
            if (p.fill) {
                for (u32 q = 0; q < r; ++q) {
                    u64 i = base + first + q;
                    u32 w = load_val<L>(f + 64, i);
                    store_val<L>(out, i, w);
                    if (j.full)
                        store_val<L>(cache, i, w);
                    else
                        cache[i] = (u8)exp_of<L>(w);
                }
                continue;
            }
            u32 w[8];
            if (!unpack_group<L>(s0 + L::sm_len(first), r, w)) {
                set_err(v.plan, DE_PADDING, base + first, 0);
                continue;
            }
            u32 wl = g / 8, sh8 = 8 * (g % 8);
            u64 i0 = base + first;
            u64 word = v.words[tile * TILE_WORDS + wl];
            u64 e_at = o.c[2] + sh.pre[wl] + pop64(word & ((1ull << sh8) - 1));
            u32 bits = (u32)(word >> sh8) & 0xff;
            if (j.full) {
                // Exp against a full-value cache: the cached field is the previous value's.
                for (u32 q = 0; q < r; ++q) {
                    u64 i = i0 + q;
                    u32 e = exp_of<L>(load_val<L>(cache, i));
                    if ((bits >> q) & 1) {
                        u32 x = f[p.s2_off + e_at++];
                        if (x > L::EMAX || x == e) set_err(v.plan, DE_EXCEPTION, i, x);
                        e = x;
                    }
                    store_val<L>(out, i, w[q] | (e << L::SHIFT));
                    store_val<L>(cache, i, w[q] | (e << L::SHIFT));
                }
            } else if (r == 8 && ((u64)(cache + i0) & 7) == 0) {
                u64 c = ld64a(cache + i0), nu = c;
                for (u32 m = bits; m; m &= m - 1) {
                    u32 q = ctz64(m);
                    u32 e = (u32)(c >> (8 * q)) & 0xff, x = f[p.s2_off + e_at++];
                    if (x > L::EMAX || x == e) set_err(v.plan, DE_EXCEPTION, i0 + q, x);
                    nu = (nu & ~(0xffull << (8 * q))) | ((u64)x << (8 * q));
                }
                if (bits) st64a(cache + i0, nu);
                for (u32 q = 0; q < 8; ++q) w[q] |= ((u32)(nu >> (8 * q)) & 0xff) << L::SHIFT;
                store8<L>(out, i0, w);
            } else {
                for (u32 q = 0; q < r; ++q) {
                    u64 i = i0 + q;
                    u32 e = cache[i];
                    if ((bits >> q) & 1) {
                        u32 x = f[p.s2_off + e_at++];
                        if (x > L::EMAX || x == e) set_err(v.plan, DE_EXCEPTION, i, x);
                        e = x;
                        cache[i] = (u8)e;
                    }
                    store_val<L>(out, i, w[q] | (e << L::SHIFT));
                }
            }
        }
        s0_share(t, s0, s0_bytes, s0_tile, sh.red);
    });
    b.sync();
    block_reduce4(b, sh.red);
    b.one([&] {
        for (u32 l = 0; l < 4; ++l) v.stat[tile].acc[l] = sh.red[l][0];
    });
}

// dec_tile_hyb (Hybrid only): one block per tile of 4096 elements. Changed values take their
// sm from their place among the changed ones, their field from s3 where the exponent mask says
// so, else the cached one; the others are the cached values. The block also sums SH64 over
// the sm of changed values tile*4096.. (none past the k-th). Reads n*size + n/8 + about 4k/8
// bytes, writes n*size + k*size.
template <class L> HD void dec_tile_hyb(const DecJob& j, u64 tile, Blk& b, DecMaskShm& sh) {
    u64 n = j.n;
    if (tile * TILE >= n) return;
    DecView v(j.scratch, n);
    const DecPlan& p = *v.plan;
    if (p.mode != 2 || p.fill || !block_go(b, p, sh.go)) return;
    u64 base = tile * TILE, tn = min64(TILE, n - base);
    const u8* f = (const u8*)j.frame;
    u8* out = (u8*)j.out;
    u8* cache = (u8*)j.cache;
    u64 W = cdiv(n, 64);
    u64 hb = base < p.k ? min64(TILE, p.k - base) : 0;
    const u8* sm_all = f + 64;
    word_prefix(b, sh, v.words, tile, W);
    const DecOff& o = v.off[tile];
    b.each([&](u32 t) {
        for (u32 k = 0; k < 2; ++k) {
            u32 g = t + k * NT;
            u64 first = 8ull * g;
            if (first >= tn) continue;
            u32 r = (u32)min64(8, tn - first);
            u32 wl = g / 8, sh8 = 8 * (g % 8);
            u64 i0 = base + first;
            u64 word = v.words[tile * TILE_WORDS + wl];
            u64 rk = o.c[2] + sh.pre[wl] + pop64(word & ((1ull << sh8) - 1));
            u32 bits = (u32)(word >> sh8) & 0xff;
            for (u32 q = 0; q < r; ++q) {
                u64 i = i0 + q;
                u32 prev = load_val<L>(cache, i), w = prev;
                if ((bits >> q) & 1) {
                    u64 gr = rk / 8;
                    u32 sm[8], gn = (u32)min64(8, p.k - 8 * gr);
                    if (!unpack_group<L>(sm_all + L::sm_len(8 * gr), gn, sm)) {
                        set_err(v.plan, DE_PADDING, i, 0);
                        break;
                    }
                    u64 xwd = v.xw[rk / 64], below = xwd & ((1ull << (rk % 64)) - 1);
                    u32 e = exp_of<L>(prev);
                    if ((xwd >> (rk % 64)) & 1) {
                        u32 x = f[p.s3_off + v.xp[rk / 64] + pop64(below)];
                        if (x > L::EMAX || x == e) set_err(v.plan, DE_EXCEPTION, i, x);
                        e = x;
                    }
                    w = sm[rk % 8] | (e << L::SHIFT);
                    if (w == prev) set_err(v.plan, DE_EXCEPTION, i, 256);
                    store_val<L>(cache, i, w);
                    ++rk;
                }
                store_val<L>(out, i, w);
            }
        }
        s0_share(t, sm_all + L::sm_len(base), L::sm_len(hb), L::sm_len(base), sh.red);
    });
    b.sync();
    block_reduce4(b, sh.red);
    b.one([&] {
        for (u32 l = 0; l < 4; ++l) v.stat[tile].acc[l] = sh.red[l][0];
    });
}

// dec_finish: SH64 of s0 from the tiles' sums, against the header's.
HD void dec_finish(const DecJob& j, Blk& b, FinishShm& sh) {
    u64 n = j.n, T = cdiv(n, TILE);
    DecView v(j.scratch, n);
    DecPlan& p = *v.plan;
    if (p.err) return;
    sum_tiles(b, T, sh.red, [&](u64 i, u32 l) { return v.stat[i].acc[l]; });
    b.one([&] {
        u64 part[4] = {sh.red[0][0], sh.red[1][0], sh.red[2][0], sh.red[3][0]};
        u64 h = sh_finish(part, p.s0_len);
        if (h != p.s0_hash) set_err(&p, DE_S0, p.s0_hash, h);
    });
}

// ---------------------------------------------------------------------------------------------
// Decode of Delta frames (mode 3, docs/WIRE.md "Delta") against a delta cache: the previous
// values in `cache` (as a full-value cache, `full` set) and a context byte per element in
// `DecJob.ctx`; the frame's model goes to `DecJob.dscratch` (delta_scratch_bytes(n)). Two
// launches between ciera_dec_parse_<t> and ciera_dec_finish (every other decode kernel returns
// at once on a Delta frame):
//   ciera_dec_delta_model_<t>  grid (1, jobs): the model (s1) parsed and checked on one thread
//                              (lanes, group, the 17 token tables, the group lengths against
//                              s0, every 64th group's start kept), then every thread fills the
//                              decoder lookup: per context 4096 entries, as the CPU's
//   ciera_dec_delta_<t>        grid (tiles, jobs): four groups at a time per block (64 threads
//                              each, a thread per lane), block x taking groups 4x, 4(x + tiles),
//                              4(x + 2 tiles), ...; SH64 partial sums of its share of s0. An
//                              Exp, Hybrid or FILL frame into a delta cache sets the tile's
//                              context bytes to 8 (no previous move), as the CPU does.
// A row of a group is four phases (fp32: six): the lanes' token steps, their refill, the extra
// steps (with the values, the cache and the contexts written), their refill. A refill gives
// the lanes below 2^15 the next words of the group's stream in lane order: each lane counts
// the lanes before it that need one (on a warp that is a ballot and a popcount; here it is
// counted through shared memory, so that the host build runs the same code), and lane 0
// advances the group's position into the other of two slots (no phase reads what it writes).
// Checks as on the CPU: a table for every context met, every lane state in [2^15, 2^31) at
// the start and 2^15 at the end, every word of each group's stream consumed exactly.

constexpr u32 D_CTX = 17;             // contexts: the previous move clipped to -8..8
constexpr u32 D_MAXTOK = 86;          // tokens of fp32 (16-bit types: 54)
constexpr u32 D_LANES = 64;           // most lanes a frame may declare: threads per group
constexpr u32 D_GPB = NT / D_LANES;   // groups per block
constexpr u32 D_RANS_L = 1u << 15;    // lower bound of a lane state
constexpr u32 D_CTX_NONE = 8;         // the context byte of "no previous move"
// Tables use the masks' PROB_SCALE (4096), as delta.rs asserts of PROB_BITS on the CPU.

// A W-bit type's Delta arithmetic: its width, sign bit, value mask and token count.
template <class L> struct DBits {
    static constexpr u32 W = 8 * L::BYTES, SIGN = 1u << (W - 1);
    static constexpr u32 MASK = W == 32 ? ~0u : (1u << W) - 1;
    static constexpr u32 NTOK = 32 + 2 * (W - 5);
};

struct DeltaPlan {
    u64 lanes, group, groups, lens_off; // lens_off: the group lengths' offset in the frame
    u32 m[D_CTX];                       // tokens described per context (0: no table)
    u16 cum[D_CTX][D_MAXTOK], freq[D_CTX][D_MAXTOK];
};
struct DeltaView {
    DeltaPlan* plan;
    u32* table; // per context PROB_SCALE entries: token | (slot - cum) << 7 | freq << 19; 0: none
    u64* start; // start[g / 64]: byte of group g in s0, for g a multiple of 64
    HD DeltaView(u64 scratch) {
        u8* s = (u8*)scratch;
        plan = (DeltaPlan*)s;
        u64 o = align8(sizeof(DeltaPlan));
        table = (u32*)(s + o);
        o += 4ull * D_CTX * PROB_SCALE;
        start = (u64*)(s + o);
    }
};
// Scratch of a delta decode job of n elements (a frame has at most n groups).
HD u64 delta_scratch_bytes(u64 n) {
    return align8(sizeof(DeltaPlan)) + 4ull * D_CTX * PROB_SCALE + 8 * cdiv(n, 64);
}

// dec_delta_model: one block per job.
template <class L> HD void dec_delta_model(const DecJob& j, Blk& b, ParseShm& sh) {
    DecView v(j.scratch, j.n);
    DecPlan& p = *v.plan;
    if (p.err || p.mode != 3) return; // written by ciera_dec_parse: the same for every thread
    DeltaView d(j.dscratch);
    const u8* f = (const u8*)j.frame;
    b.one([&] {
        sh.ok = 0;
        DeltaPlan& dp = *d.plan;
        const u8* s1 = f + p.s1_off;
        u64 len = p.s1_len, n = j.n, ntok = DBits<L>::NTOK;
        if (len < 5) return set_err(&p, DE_DELTA, 1, 0);
        u64 lanes = s1[0], group = rd32(s1 + 1);
        if (lanes == 0 || lanes > D_LANES || group == 0 || group > (1ull << 24))
            return set_err(&p, DE_DELTA, 1, 0);
        u64 pos = 5;
        for (u32 c = 0; c < D_CTX; ++c) {
            if (pos >= len) return set_err(&p, DE_DELTA, 1, c);
            u32 m = s1[pos++];
            dp.m[c] = m;
            if (m == 0) continue;
            if (m > ntok) return set_err(&p, DE_DELTA, 1, c);
            u32 cum = 0;
            for (u32 t = 0; t < m; ++t) {
                // A LEB128 varint of at most 3 bytes (`rans::read_varint`).
                u32 fr = 0, more = 1;
                for (u32 sh7 = 0; sh7 < 21 && more; sh7 += 7) {
                    if (pos >= len) return set_err(&p, DE_DELTA, 1, c);
                    u32 by = s1[pos++];
                    fr |= (by & 0x7f) << sh7;
                    more = by >> 7;
                }
                if (more || fr > PROB_SCALE - cum) return set_err(&p, DE_DELTA, 1, c);
                dp.cum[c][t] = (u16)cum;
                dp.freq[c][t] = (u16)fr;
                cum += fr;
            }
            if (cum != PROB_SCALE) return set_err(&p, DE_DELTA, 1, c);
        }
        u64 groups = cdiv(n, group);
        if (len - pos != 4 * groups) return set_err(&p, DE_DELTA, 1, D_CTX);
        u64 o = 0;
        for (u64 g = 0; g < groups; ++g) {
            if (g % 64 == 0) d.start[g / 64] = o;
            u64 gl = rd32(s1 + pos + 4 * g);
            if (gl < 4 * lanes || ((gl - 4 * lanes) & 1) || gl > p.s0_len - o)
                return set_err(&p, DE_DELTA, 2, g);
            o += gl;
        }
        if (o != p.s0_len) return set_err(&p, DE_DELTA, 2, groups);
        dp.lanes = lanes;
        dp.group = group;
        dp.groups = groups;
        dp.lens_off = p.s1_off + pos;
        sh.ok = 1;
    });
    b.sync();
    if (!sh.ok) return;
    const DeltaPlan& dp = *d.plan;
    b.each([&](u32 t) {
        for (u32 c = 0; c < D_CTX; ++c) {
            u32 m = dp.m[c];
            for (u32 s = t; s < PROB_SCALE; s += NT) {
                u32 e = 0;
                for (u32 k = 0; k < m; ++k) {
                    u32 cu = dp.cum[c][k], fr = dp.freq[c][k];
                    if (s >= cu && s < cu + fr) {
                        e = k | (s - cu) << 7 | fr << 19;
                        break;
                    }
                }
                d.table[c * PROB_SCALE + s] = e;
            }
        }
    });
}

struct DeltaShm {
    u32 x[NT], z[NT], eb[NT], need[NT];
    u64 pos[D_GPB][2], end[D_GPB];
    u64 red[4][NT];
    u32 go;
};

// The ordered key of a W-bit value and its inverse (`delta::key`, `delta::unkey`).
HD u32 d_key(u32 u, u32 sign, u32 mk) { return u ^ (sign | ((u & sign) ? (mk ^ sign) : 0)); }
HD u32 d_unkey(u32 k, u32 sign, u32 mk) { return (k & sign) ? (k & ~sign) : (~k & mk); }
// The context byte a W-bit move leaves (`delta::context_of`): the move clipped to -8..8, + 8.
template <class L> HD u8 de_context(u32 d) {
    const u32 W = DBits<L>::W;
    int s = (int)(d << (32 - W)) >> (32 - W);
    s = s < -8 ? -8 : s > 8 ? 8 : s;
    return (u8)(s + 8);
}

// Tile `tile`'s context bytes (of n) set to "no previous move": after a FILL, an Exp or a
// Hybrid frame, as the CPU does.
HD void ctx_none(Blk& b, u8* ctx, u64 n, u64 tile) {
    u64 base = tile * TILE, tn = min64(TILE, n - base);
    b.each([&](u32 t) {
        for (u64 q = t; q < tn; q += NT) ctx[base + q] = D_CTX_NONE;
    });
}

// Flags set among the lanes [from, to) of a group (`need`: the group's first lane's flag).
HD u32 d_count(const u32* need, u32 from, u32 to) {
    u32 c = 0;
    for (u32 k = from; k < to; ++k) c += need[k];
    return c;
}

// The groups a block codes at a time (encoder and decoder): D_GPB groups from g0 of a frame of
// `groups` groups of `group` elements (n in all), `lanes` lanes each, a thread per lane.
struct DBlockGroups {
    u64 g0, groups, group, n, lanes;
    // The most rows among them (the block runs this many; block-uniform).
    HD u64 rows() const {
        u64 rows = 0;
        for (u32 s = 0; s < D_GPB; ++s) {
            u64 g = g0 + s;
            if (g < groups) {
                u64 r = cdiv(min64(group, n - g * group), lanes);
                rows = r > rows ? r : rows;
            }
        }
        return rows;
    }
    // Thread t's element in row r, if any: lane t % 64 of group g0 + t / 64.
    HD bool elem(u32 t, u64 r, u64* i) const {
        u64 g = g0 + t / D_LANES, l = t % D_LANES;
        if (g >= groups || l >= lanes) return false;
        u64 jg = r * lanes + l;
        if (jg >= min64(group, n - g * group)) return false;
        *i = g * group + jg;
        return true;
    }
};

// dec_delta: one block per tile of the job (see above).
template <class L> HD void dec_delta(const DecJob& j, u64 tile, Blk& b, DeltaShm& sh) {
    u64 n = j.n, T = cdiv(n, TILE);
    if (tile >= T) return;
    DecView v(j.scratch, n);
    const DecPlan& p = *v.plan;
    if (!block_go(b, p, sh.go)) return;
    u8* ctx = (u8*)j.ctx;
    if (p.mode != 3) {
        if (ctx) ctx_none(b, ctx, n, tile);
        return;
    }
    DeltaView d(j.dscratch);
    const DeltaPlan& dp = *d.plan;
    const u8* s0 = (const u8*)j.frame + 64;
    u8* out = (u8*)j.out;
    u8* cache = (u8*)j.cache;
    const u8* lens = (const u8*)j.frame + dp.lens_off;
    const u64 lanes = dp.lanes, group = dp.group, G = dp.groups;
    const u32 W = DBits<L>::W, sign = DBits<L>::SIGN, mk = DBits<L>::MASK;
    s0_tile_sums(b, s0, p.s0_len, tile, T, sh.red, v.stat[tile].acc);
    b.sync();
    for (u64 g0 = D_GPB * tile; g0 < G; g0 += D_GPB * T) {
        const DBlockGroups bg{g0, G, group, n, lanes};
        const u64 rows = bg.rows();
        // The group's start: every 64th kept by the model, the lengths after it summed.
        b.each([&](u32 t) {
            u32 s = t / D_LANES, l = t % D_LANES;
            u64 g = g0 + s;
            sh.need[t] = 0;
            if (g >= G) return;
            u64 start = d.start[g / 64];
            for (u64 h = g / 64 * 64; h < g; ++h) start += rd32(lens + 4 * h);
            if (l == 0) {
                sh.pos[s][0] = start + 4 * lanes;
                sh.end[s] = start + rd32(lens + 4 * g);
            }
            if (l < lanes) {
                u32 x = rd32(s0 + start + 4 * l);
                if (x < D_RANS_L || x >= (D_RANS_L << 16)) set_err(v.plan, DE_DELTA, 2, g);
                sh.x[t] = x;
            }
        });
        b.sync();
        u32 par = 0;
        auto refill = [&]() {
            b.each([&](u32 t) {
                u32 s = t / D_LANES, l = t % D_LANES;
                if (g0 + s >= G) return;
                const u32* need = sh.need + s * D_LANES;
                u64 p0 = sh.pos[s][par];
                if (need[l]) {
                    u64 a = p0 + 2 * d_count(need, 0, l); // lane order
                    u32 w = a + 2 <= sh.end[s] ? (u32)s0[a] | (u32)s0[a + 1] << 8 : 0;
                    sh.x[t] = sh.x[t] << 16 | w;
                }
                if (l == 0) sh.pos[s][par ^ 1] = p0 + 2 * d_count(need, 0, D_LANES);
            });
            b.sync();
            par ^= 1;
        };
        // The value of element i from its move (zigzag z): out, cache and context.
        auto put = [&](u64 i, u32 z) {
            u32 dm = ((z >> 1) ^ (0u - (z & 1))) & mk;
            u32 nu = d_unkey((d_key(load_val<L>(cache, i), sign, mk) + dm) & mk, sign, mk);
            store_val<L>(out, i, nu);
            store_val<L>(cache, i, nu);
            ctx[i] = de_context<L>(dm);
        };
        for (u64 r = 0; r < rows; ++r) {
            b.each([&](u32 t) {
                u64 i;
                sh.need[t] = 0;
                if (!bg.elem(t, r, &i)) return;
                u32 c = ctx[i] < D_CTX ? ctx[i] : D_CTX - 1, x = sh.x[t];
                u32 e = d.table[c * PROB_SCALE + (x & (PROB_SCALE - 1))];
                if (e == 0) set_err(v.plan, DE_DELTA, 1, c);
                x = (e >> 19) * (x >> 12) + ((e >> 7) & 0xfff);
                u32 tk = e & 0x7f;
                if (tk < 32) {
                    sh.z[t] = tk;
                    sh.eb[t] = 0;
                } else {
                    u32 bl = (tk - 32) / 2 + 5;
                    sh.z[t] = (2 | (tk & 1)) << (bl - 1);
                    sh.eb[t] = bl - 1;
                }
                sh.x[t] = x;
                sh.need[t] = x < D_RANS_L;
            });
            b.sync();
            refill();
            b.each([&](u32 t) {
                u64 i;
                sh.need[t] = 0;
                if (!bg.elem(t, r, &i)) return;
                u32 eb = sh.eb[t], lo = eb < 15 ? eb : 15, x = sh.x[t];
                sh.z[t] |= x & ((1u << lo) - 1);
                x >>= lo;
                sh.x[t] = x;
                sh.need[t] = x < D_RANS_L;
                if (W == 16) put(i, sh.z[t]);
            });
            b.sync();
            refill();
            if (W == 32) {
                b.each([&](u32 t) {
                    u64 i;
                    sh.need[t] = 0;
                    if (!bg.elem(t, r, &i)) return;
                    u32 eb = sh.eb[t], hi = eb > 15 ? eb - 15 : 0, x = sh.x[t];
                    sh.z[t] |= (x & ((1u << hi) - 1)) << 15;
                    x >>= hi;
                    sh.x[t] = x;
                    sh.need[t] = x < D_RANS_L;
                    put(i, sh.z[t]);
                });
                b.sync();
                refill();
            }
        }
        b.each([&](u32 t) {
            u32 s = t / D_LANES, l = t % D_LANES;
            u64 g = g0 + s;
            if (g >= G) return;
            if (l < lanes && sh.x[t] != D_RANS_L) set_err(v.plan, DE_DELTA, 2, g);
            if (l == 0 && sh.pos[s][par] != sh.end[s]) set_err(v.plan, DE_DELTA, 2, g);
        });
        b.sync();
    }
}

// ---------------------------------------------------------------------------------------------
// Encode of Delta frames (mode 3) against a delta cache: `EncJob.ctx` set (with a full-value
// cache: `cache` holds the previous values), its Delta model and group streams in
// `EncJob.dscratch` (enc_delta_scratch_bytes(n)). A warm delta job sends a Delta frame (or a
// FILL where that would be longer than the values) with DE_ALWAYS (the CPU's
// FrameChoice::Delta), and with DE_AUTO where ciera_enc_delta_model picks it; else, and with
// DE_NEVER, the kernels above code it (Exp, Hybrid or FILL) and its contexts are set to 8 here,
// as a cold job's. The kernels above return at once on a job sending a Delta frame; these
// (after the first two) on any other. ciera_enc_delta_hist and _model run first, before the
// kernels above (the Exp/Hybrid frame of a DE_AUTO job is their pick); the others after
// ciera_enc_finish_<t>:
//   ciera_enc_delta_hist_<t>   grid (tiles, jobs): per tile the (context, token) counts of its
//                              moves and their extra bits (in a sampled chunk only every eighth
//                              tile's), and its changed values and changed fields
//   ciera_enc_delta_model_<t>  grid (1, jobs): the counts summed, one table per context scaled to
//                              4096 (a thread per context, as `delta::normalize`; in a sampled
//                              chunk every token of every context at least 1), the model's
//                              bytes (s1 before the group lengths) and the encoder's table; with
//                              DE_AUTO the pick: the smallest of the Delta, Exp and Hybrid
//                              frames as the CPU estimates them (`de_pick_frame`)
//   ciera_enc_delta_groups_<t> grid (tiles, jobs): groups of 32768 elements coded backwards, four
//                              per block (a thread per lane), into per-group word buffers; the
//                              cache takes the new values and the contexts the moves leave
//   ciera_enc_delta_lay_<t>    grid (1, jobs): group offsets, the frame's length, FILL or not,
//                              s1 written
//   ciera_enc_delta_pack_<t>   grid (tiles, jobs): each group's lane states and words into s0;
//                              a FILL's values into s0 and its contexts set to 8; the contexts
//                              of any other delta job (cold, or an Exp or Hybrid frame) set to 8
//   ciera_enc_delta_sum_<t>    grid (tiles, jobs): SH64 partial sums of s0
//   ciera_enc_delta_finish_<t> grid (1, jobs): header, SH64, XXH3
// A coding step of a row gives the lanes whose state must shed a word (x at or over its
// limit) the next places of the group's words in descending lane order (the encoder's order,
// reversed when packed): each counts the emitting lanes above it, through shared memory.

constexpr u32 DE_GROUP = 32768; // elements per group the encoder uses
constexpr u32 DE_LANES = 32;    // most lanes the encoder uses
constexpr u64 DE_WORDS = 3ull * DE_GROUP + 16; // a group's word buffer (at most 3 per element)
// `delta::SAMPLE_TILE`: a chunk of at least DE_SAMPLE_MIN elements is sampled: its (context,
// token) pairs are counted in every DE_SAMPLE_EVERY-th tile of TILE elements only (tiles 0, 8,
// ...), and the tables give every token of every context a frequency of at least 1.
constexpr u64 DE_SAMPLE_EVERY = 8;
constexpr u64 DE_SAMPLE_MIN = 32ull * TILE;
HD bool de_counted(u64 n, u64 tile) { return n < DE_SAMPLE_MIN || tile % DE_SAMPLE_EVERY == 0; }

// Counts per tile of ciera_enc_delta_hist: changed values, changed fields, extra bits.
constexpr u32 DE_CNT = 3;

HD u32 de_lanes(u64 n) { return (u32)(n / 512 < 1 ? 1 : n / 512 > DE_LANES ? DE_LANES : n / 512); }

struct DEncPlan {
    u64 pick; // first (de_pick): 0 Delta, 1 Exp, 2 Hybrid
    u64 lanes, groups, model_len, s0_len, s1_len, fill, changed, exp_changed;
};
struct DEncView {
    DEncPlan* plan;
    u32* tile_hist;   // per tile D_CTX * D_MAXTOK counts
    u64* tile_cnt;    // per tile: changed values, changed fields, extra bits (counted moves)
    u32* table;       // per (context, token): cum | freq << 16
    u8* model;        // s1 before the group lengths (at most 5 + 17 * (1 + 86 * 3) bytes)
    u64* glen;        // per group: its bytes in s0 (states and words)
    u64* goff;        // per group: its offset in s0
    u32* states;      // per group DE_LANES final lane states
    u64* sums;        // per tile: SH64 partial sums of s0 (4 each)
    u16* words;       // per group DE_WORDS words, in coding order
    HD DEncView(u64 scratch, u64 n) {
        u8* s = (u8*)scratch;
        u64 T = cdiv(n, TILE), G = cdiv(n, DE_GROUP);
        plan = (DEncPlan*)s;
        u64 o = align8(sizeof(DEncPlan));
        tile_hist = (u32*)(s + o);
        o += align8(4ull * T * D_CTX * D_MAXTOK);
        tile_cnt = (u64*)(s + o);
        o += 8 * DE_CNT * T;
        table = (u32*)(s + o);
        o += align8(4ull * D_CTX * D_MAXTOK);
        model = s + o;
        o += align8(5 + D_CTX * (1 + 3 * D_MAXTOK));
        glen = (u64*)(s + o);
        o += 8 * G;
        goff = (u64*)(s + o);
        o += 8 * G;
        states = (u32*)(s + o);
        o += 4ull * DE_LANES * G;
        sums = (u64*)(s + o);
        o += 32 * T;
        words = (u16*)(s + o);
    }
};
HD u64 enc_delta_scratch_bytes(u64 n) {
    u64 T = cdiv(n, TILE), G = cdiv(n, DE_GROUP);
    return align8(sizeof(DEncPlan)) + align8(4ull * T * D_CTX * D_MAXTOK) + 8 * DE_CNT * T +
           align8(4ull * D_CTX * D_MAXTOK) + align8(5 + D_CTX * (1 + 3 * D_MAXTOK)) + 16 * G +
           4ull * DE_LANES * G + 32 * T + 2 * G * DE_WORDS;
}

// A move's zigzag value, token and extra bit count (`delta::token_of`).
template <class L> HD void de_token(u32 a, u32 bnew, u32* z, u32* tk, u32* eb, u32* dm) {
    const u32 W = DBits<L>::W, sign = DBits<L>::SIGN, mk = DBits<L>::MASK;
    u32 d = (d_key(bnew, sign, mk) - d_key(a, sign, mk)) & mk;
    int s = (int)(d << (32 - W)) >> (32 - W);
    u32 zz = ((u32)s << 1 ^ (u32)(s >> 31)) & mk;
    *dm = d;
    *z = zz;
    if (zz < 32) {
        *tk = zz;
        *eb = 0;
    } else {
        u32 bl = 31 - clz32(zz);
        *tk = 32 + (bl - 5) * 2 + ((zz >> (bl - 1)) & 1);
        *eb = bl - 1;
    }
}

struct DEncShm {
    u32 hist[D_CTX * D_MAXTOK];
    u64 cnt[DE_CNT][NT];
    u32 freq[D_CTX][D_MAXTOK];
    u32 m[D_CTX]; // per context: one past its highest token (0: none)
    u64 cbits[D_CTX], ctab[D_CTX]; // DE_AUTO: per context its estimate (de_context_cost)
    u64 ccnt[DE_CNT + 1];          // DE_AUTO: the counted tiles' counts, then their elements
    u32 x[NT], z[NT], eb[NT], sym[NT], need[2][NT];
    u64 pos[D_GPB][2];
    u64 red[4][NT];
    u8 hdr[64];
    u64 lane[8];
    u32 fill;
};

template <class L> HD void enc_delta_hist(const EncJob& j, u64 tile, Blk& b, DEncShm& sh) {
    u64 n = j.n;
    if (!job_delta_scan(j) || tile * TILE >= n) return;
    DEncView d(j.dscratch, n);
    const u32 ntok = DBits<L>::NTOK;
    const u8* in = (const u8*)j.input;
    const u8* cache = (const u8*)j.cache;
    const u8* ctx = (const u8*)j.ctx;
    u64 base = tile * TILE, tn = min64(TILE, n - base);
    const bool counted = de_counted(n, tile);
    b.each([&](u32 t) {
        for (u32 k = t; k < D_CTX * D_MAXTOK; k += NT) sh.hist[k] = 0;
    });
    b.sync();
    b.each([&](u32 t) {
        u64 ch = 0, ech = 0, xb = 0;
        for (u64 q = t; q < tn; q += NT) {
            u64 i = base + q;
            u32 a = load_val<L>(cache, i), nu = load_val<L>(in, i);
            if (counted) {
                u32 z, tk, eb, dm;
                de_token<L>(a, nu, &z, &tk, &eb, &dm);
                u32 c = ctx[i] < D_CTX ? ctx[i] : D_CTX - 1;
                add_u32(&sh.hist[c * ntok + tk], 1);
                xb += eb;
            }
            ch += a != nu;
            ech += exp_of<L>(a) != exp_of<L>(nu);
        }
        sh.cnt[0][t] = ch;
        sh.cnt[1][t] = ech;
        sh.cnt[2][t] = xb;
    });
    b.sync();
    b.each([&](u32 t) {
        for (u32 k = t; k < D_CTX * D_MAXTOK; k += NT)
            d.tile_hist[tile * D_CTX * D_MAXTOK + k] = sh.hist[k];
        if (t < DE_CNT) {
            u64 s = 0;
            for (u32 q = 0; q < NT; ++q) s += sh.cnt[t][q];
            d.tile_cnt[DE_CNT * tile + t] = s;
        }
    });
}

// `delta::normalize`: a histogram of m tokens scaled to frequencies summing to 4096, every
// present token at least 1 (present: counted, or every token with `all`: a sampled chunk), the
// rounding error spread over the largest (ties: lower token).
HD void de_normalize(const u32* hist, u32 m, bool all, u32* freq) {
    u64 total = 0;
    for (u32 t = 0; t < m; ++t) total += hist[t];
    i64 sum = 0;
    u8 order[D_MAXTOK];
    u32 no = 0;
    for (u32 t = 0; t < m; ++t) {
        bool present = hist[t] || all;
        u64 f = hist[t] ? ((u64)hist[t] * PROB_SCALE + total / 2) / total : 1;
        freq[t] = present ? (u32)(f < 1 ? 1 : f) : 0;
        sum += freq[t];
        if (present) {
            // Insertion, stable: after every token of a larger or equal frequency.
            u32 at = no++;
            while (at > 0 && freq[order[at - 1]] < freq[t]) {
                order[at] = order[at - 1];
                --at;
            }
            order[at] = (u8)t;
        }
    }
    i64 diff = (i64)PROB_SCALE - sum;
    while (diff != 0) {
        for (u32 k = 0; k < no && diff != 0; ++k) {
            u32 t = order[k];
            if (diff > 0) {
                freq[t] += 1;
                diff -= 1;
            } else if (freq[t] > 1) {
                freq[t] -= 1;
                diff += 1;
            }
        }
    }
}

// A context's share of `delta::estimate`: its table bytes (its m byte, a byte per token
// described, one more per frequent token) into `table`, the entropy of its `ntok` token counts
// `h` (Q16 bits) into `bits`; `m` tokens described.
HD void de_context_cost(const u32* h, u32 ntok, u32 m, u64* bits, u64* table) {
    u64 total = 0, b = 0, tb = 1 + m;
    for (u32 t = 0; t < ntok; ++t) total += h[t];
    if (total) {
        u64 lt = log2_q16(total);
        for (u32 t = 0; t < ntok; ++t) {
            if (!h[t]) continue;
            tb += (u64)h[t] * 32 > total;
            u64 l = log2_q16(h[t]);
            b += (u64)h[t] * (lt > l ? lt - l : 0);
        }
    }
    *bits = b;
    *table = tb;
}

// The frame a delta cache's FrameChoice::Auto sends, as the CPU picks it (chunk.rs,
// `encode_delta_with`): 0 Delta, 1 Exp, 2 Hybrid, the smallest of their estimated bytes (Delta
// on a tie with either, Hybrid only where smaller than Exp), from pass one's counts: the
// contexts' entropy (`bits`, Q16) and table bytes (`table`, see de_context_cost), and the
// counted elements' changed values, changed fields and extra bits; a sampled chunk's scaled to
// the chunk as `delta::scan` does. The Delta frame's bytes are `delta::estimate`'s, the Exp
// frame's its sign+mantissa, its mask at the entropy of independent bits and its exponents,
// the Hybrid frame's `hybrid_estimate`; all in integers, as on the CPU.
template <class L>
HD u64 de_pick_frame(u64 bits, u64 table, u64 n, u64 counted, u64 changed, u64 exp_changed,
                     u64 extra_bits) {
    bits += extra_bits << 16;
    table += 2;
    // n < 2^32 (the host's check), so none of these products overflows.
    if (counted > 0 && counted < n) bits = bits / counted * n + bits % counted * n / counted;
    u64 d_est = (bits >> 19) + table + 5 + cdiv(n, DE_GROUP) * (4ull * de_lanes(n) + 4);
    auto scale = [&](u64 k) {
        return counted == n || counted == 0
                   ? k
                   : k / counted * n + (k % counted * n + counted / 2) / counted;
    };
    u64 k = scale(changed), ke = scale(exp_changed);
    u64 exp_est = L::sm_len(n) + iid_bytes(ke, n) + ke;
    u64 hyb_est = hybrid_estimate(L::sm_len(k), n, k, ke);
    if (d_est <= (exp_est < hyb_est ? exp_est : hyb_est)) return 0;
    return hyb_est < exp_est ? 2 : 1;
}

template <class L> HD void enc_delta_model(const EncJob& j, Blk& b, DEncShm& sh) {
    u64 n = j.n;
    if (!job_delta_scan(j)) return;
    DEncView d(j.dscratch, n);
    const u32 ntok = DBits<L>::NTOK;
    u64 T = cdiv(n, TILE);
    b.each([&](u32 t) {
        for (u32 k = t; k < D_CTX * ntok; k += NT) {
            u32 s = 0;
            for (u64 x = 0; x < T; ++x) s += d.tile_hist[x * D_CTX * D_MAXTOK + k];
            sh.hist[k] = s;
        }
        if (t < 2) {
            u64 s = 0;
            for (u64 x = 0; x < T; ++x) s += d.tile_cnt[DE_CNT * x + t];
            if (t == 0) d.plan->changed = s;
            else d.plan->exp_changed = s;
        } else if (t < 3 + DE_CNT && job_delta_mode(j) == DE_AUTO) {
            // The counted tiles' counts (all of an unsampled chunk's), then their elements.
            u64 s = 0;
            for (u64 x = 0; x < T; ++x)
                if (de_counted(n, x))
                    s += t < 2 + DE_CNT ? d.tile_cnt[DE_CNT * x + t - 2] : min64(TILE, n - x * TILE);
            sh.ccnt[t - 2] = s;
        }
    });
    b.sync();
    b.each([&](u32 c) {
        if (c >= D_CTX) return;
        const u32* h = sh.hist + c * ntok;
        // A sampled chunk's tables hold every token (the uncounted tiles may have any).
        const bool all = n >= DE_SAMPLE_MIN;
        u32 m = 0;
        for (u32 t = 0; t < ntok; ++t)
            if (h[t]) m = t + 1;
        if (all) m = ntok;
        sh.m[c] = m;
        for (u32 t = 0; t < D_MAXTOK; ++t) sh.freq[c][t] = 0;
        if (m) de_normalize(h, m, all, sh.freq[c]);
        u32 cum = 0;
        for (u32 t = 0; t < ntok; ++t) {
            d.table[c * ntok + t] = cum | sh.freq[c][t] << 16;
            cum += sh.freq[c][t];
        }
        if (job_delta_mode(j) == DE_AUTO) de_context_cost(h, ntok, m, &sh.cbits[c], &sh.ctab[c]);
    });
    b.sync();
    b.one([&] {
        DEncPlan& p = *d.plan;
        u8* o = d.model;
        u64 k = 0;
        u32 lanes = de_lanes(n);
        o[k++] = (u8)lanes;
        wr32(o + k, DE_GROUP);
        k += 4;
        for (u32 c = 0; c < D_CTX; ++c) {
            u32 m = sh.m[c];
            o[k++] = (u8)m;
            for (u32 t = 0; t < m; ++t) {
                u32 v = sh.freq[c][t];
                while (v >= 0x80) {
                    o[k++] = (u8)(v | 0x80);
                    v >>= 7;
                }
                o[k++] = (u8)v;
            }
        }
        p.lanes = lanes;
        p.groups = cdiv(n, DE_GROUP);
        p.model_len = k;
        p.pick = 0;
        if (job_delta_mode(j) == DE_AUTO) {
            u64 bits = 0, table = 0;
            for (u32 c = 0; c < D_CTX; ++c) {
                bits += sh.cbits[c];
                table += sh.ctab[c];
            }
            p.pick = de_pick_frame<L>(bits, table, n, sh.ccnt[DE_CNT], sh.ccnt[0], sh.ccnt[1],
                                      sh.ccnt[2]);
        }
    });
}

template <class L> HD void enc_delta_groups(const EncJob& j, u64 tile, Blk& b, DEncShm& sh) {
    u64 n = j.n, T = cdiv(n, TILE);
    if (!job_delta_frame(j) || tile >= T) return;
    DEncView d(j.dscratch, n);
    const DEncPlan& p = *d.plan;
    const u32 W = DBits<L>::W, ntok = DBits<L>::NTOK;
    const u8* in = (const u8*)j.input;
    u8* cache = (u8*)j.cache;
    u8* ctx = (u8*)j.ctx;
    const u64 lanes = p.lanes, G = p.groups;
    for (u64 g0 = D_GPB * tile; g0 < G; g0 += D_GPB * T) {
        const DBlockGroups bg{g0, G, DE_GROUP, n, lanes};
        const u64 rows = bg.rows();
        b.each([&](u32 t) {
            sh.x[t] = D_RANS_L;
            if (t % D_LANES == 0) sh.pos[t / D_LANES][0] = 0;
        });
        b.sync();
        u32 par = 0, cur = 0;
        // One coding step: the lanes flagged in need[cur] shed a word (descending lane order),
        // then `step` codes into each active lane's state and says whether the next step
        // sheds (into need[cur ^ 1]).
        auto emit_then = [&](u64 r, auto step) {
            b.each([&](u32 t) {
                u32 s = t / D_LANES, l = t % D_LANES;
                if (g0 + s >= G) return;
                const u32* need = sh.need[cur] + s * D_LANES;
                u64 p0 = sh.pos[s][par];
                u32 x = sh.x[t];
                if (need[l]) {
                    // Descending lane order: after the emitting lanes above this one.
                    d.words[(g0 + s) * DE_WORDS + p0 + d_count(need, l + 1, D_LANES)] = (u16)x;
                    x >>= 16;
                }
                if (l == 0) sh.pos[s][par ^ 1] = p0 + d_count(need, 0, D_LANES);
                u64 i;
                sh.need[cur ^ 1][t] = 0;
                if (bg.elem(t, r, &i)) step(t, x);
                else sh.x[t] = x;
            });
            b.sync();
            par ^= 1;
            cur ^= 1;
        };
        auto bits_limit = [](u32 bits) { return (D_RANS_L << 16) >> bits; };
        for (u64 r = rows; r-- > 0;) {
            // The row's moves; the cache takes the new values and the contexts they leave.
            b.each([&](u32 t) {
                u64 i;
                sh.need[cur][t] = 0;
                if (!bg.elem(t, r, &i)) return;
                u32 a = load_val<L>(cache, i), nu = load_val<L>(in, i), z, tk, eb, dm;
                de_token<L>(a, nu, &z, &tk, &eb, &dm);
                u32 c = ctx[i] < D_CTX ? ctx[i] : D_CTX - 1;
                sh.z[t] = z;
                sh.eb[t] = eb;
                sh.sym[t] = c * ntok + tk;
                ctx[i] = de_context<L>(dm);
                store_val<L>(cache, i, nu);
                u32 first = W == 32 ? (eb > 15 ? eb - 15 : 0) : (eb < 15 ? eb : 15);
                sh.need[cur][t] = sh.x[t] >= bits_limit(first);
            });
            b.sync();
            if (W == 32) {
                // The high extra bits, then the low ones.
                emit_then(r, [&](u32 t, u32 x) {
                    u32 eb = sh.eb[t], hi = eb > 15 ? eb - 15 : 0, lo = eb < 15 ? eb : 15;
                    x = (x << hi) | ((sh.z[t] >> 15) & ((1u << hi) - 1));
                    sh.x[t] = x;
                    sh.need[cur ^ 1][t] = x >= bits_limit(lo);
                });
            }
            emit_then(r, [&](u32 t, u32 x) {
                u32 eb = sh.eb[t], lo = eb < 15 ? eb : 15;
                x = (x << lo) | (sh.z[t] & ((1u << lo) - 1));
                sh.x[t] = x;
                u32 f = d.table[sh.sym[t]] >> 16;
                sh.need[cur ^ 1][t] = x >= (f << 19);
            });
            emit_then(r, [&](u32 t, u32 x) {
                u32 e = d.table[sh.sym[t]], f = e >> 16, c = e & 0xffff;
                sh.x[t] = (x / f) * PROB_SCALE + x % f + c;
            });
        }
        b.each([&](u32 t) {
            u32 s = t / D_LANES, l = t % D_LANES;
            u64 g = g0 + s;
            if (g >= G) return;
            if (l < DE_LANES) d.states[g * DE_LANES + l] = sh.x[t];
            if (l == 0) d.glen[g] = 4 * lanes + 2 * sh.pos[s][par];
        });
        b.sync();
    }
}

template <class L> HD void enc_delta_lay(const EncJob& j, Blk& b, DEncShm& sh) {
    u64 n = j.n;
    if (!job_delta_frame(j)) return;
    DEncView d(j.dscratch, n);
    EncView v(j.scratch, n);
    b.one([&] {
        DEncPlan& p = *d.plan;
        u64 o = 0;
        for (u64 g = 0; g < p.groups; ++g) {
            d.goff[g] = o;
            o += d.glen[g];
        }
        p.s0_len = o;
        p.s1_len = p.model_len + 4 * p.groups;
        // A delta larger than the values: a FILL (as the CPU decides).
        p.fill = o + p.s1_len > n * L::BYTES;
        Plan& q = *v.plan;
        q.fill = p.fill;
        q.mode = p.fill ? 0 : 3;
        q.frame_len = p.fill ? 64 + n * L::BYTES : 64 + o + p.s1_len;
        q.ones = p.fill ? 0 : p.exp_changed; // read back as the frame's exp_changes
        q.k = p.fill ? 0 : p.changed;        // and value_changes
        sh.fill = p.fill;
    });
    b.sync();
    if (sh.fill) return;
    const DEncPlan& p = *d.plan;
    u8* s1 = (u8*)j.frame + 64 + p.s0_len;
    b.each([&](u32 t) {
        for (u64 k = t; k < p.model_len; k += NT) s1[k] = d.model[k];
        for (u64 g = t; g < p.groups; g += NT) wr32(s1 + p.model_len + 4 * g, (u32)d.glen[g]);
    });
}

template <class L> HD void enc_delta_pack(const EncJob& j, u64 tile, Blk& b, DEncShm& sh) {
    u64 n = j.n, T = cdiv(n, TILE);
    if (!j.ctx || tile >= T) return;
    u8* ctx = (u8*)j.ctx;
    // A FILL of a cold slot, or an Exp or Hybrid frame (or their FILL): no previous moves.
    if (!job_delta_frame(j)) return ctx_none(b, ctx, n, tile);
    u64 base = tile * TILE, tn = min64(TILE, n - base);
    DEncView d(j.dscratch, n);
    const DEncPlan& p = *d.plan;
    u8* s0 = (u8*)j.frame + 64;
    if (p.fill) {
        const u8* in = (const u8*)j.input;
        b.each([&](u32 t) {
            for (u64 q = t; q < tn; q += NT) {
                u64 i = base + q;
                store_val<L>(s0, i, load_val<L>(in, i));
                ctx[i] = D_CTX_NONE;
            }
        });
        return;
    }
    for (u64 g = tile; g < p.groups; g += T) {
        u8* o = s0 + d.goff[g];
        u64 nw = (d.glen[g] - 4 * p.lanes) / 2;
        const u16* w = d.words + g * DE_WORDS;
        b.each([&](u32 t) {
            if (t < p.lanes) wr32(o + 4 * t, d.states[g * DE_LANES + t]);
            for (u64 q = t; q < nw; q += NT) {
                u16 x = w[nw - 1 - q];
                o[4 * p.lanes + 2 * q] = (u8)x;
                o[4 * p.lanes + 2 * q + 1] = (u8)(x >> 8);
            }
        });
    }
}

template <class L> HD void enc_delta_sum(const EncJob& j, u64 tile, Blk& b, DEncShm& sh) {
    u64 n = j.n, T = cdiv(n, TILE);
    if (!job_delta_frame(j) || tile >= T) return;
    DEncView d(j.dscratch, n);
    const DEncPlan& p = *d.plan;
    u64 len = p.fill ? n * L::BYTES : p.s0_len;
    s0_tile_sums(b, (const u8*)j.frame + 64, len, tile, T, sh.red, d.sums + 4 * tile);
}

template <class L> HD void enc_delta_finish(const EncJob& j, Blk& b, DEncShm& sh) {
    u64 n = j.n, T = cdiv(n, TILE);
    if (!job_delta_frame(j)) return;
    DEncView d(j.dscratch, n);
    const DEncPlan& p = *d.plan;
    u8* f = (u8*)j.frame;
    sum_tiles(b, T, sh.red, [&](u64 i, u32 l) { return d.sums[4 * i + l]; });
    u64 s0 = p.fill ? n * L::BYTES : p.s0_len;
    b.one([&] {
        u64 sec[4] = {s0, p.fill ? 0 : p.s1_len, 0, 0};
        u64 part[4] = {sh.red[0][0], sh.red[1][0], sh.red[2][0], sh.red[3][0]};
        write_header(sh.hdr, L::DT, p.fill ? 0 : 3, p.fill ? 1 : 0, n, j.offset, j.version, sec);
        wr64(sh.hdr + 48, sh_finish(part, s0));
    });
    b.sync();
    block_xxh3(b, sh.hdr, f + 64 + s0, p.fill ? 0 : p.s1_len, sh.lane);
    b.one([&] {
        wr64(sh.hdr + 56, sh.lane[0]);
        for (u32 q = 0; q < 64; ++q) f[q] = sh.hdr[q];
    });
}

// ---------------------------------------------------------------------------------------------
// Device entry points. Grids: x = tile (or 1), y = job; every block of a job's kernel returns at
// once if its tile is past the job's end.

#if defined(CIERA_DEVICE_BUILD)
#define CIERA_TYPES(X) X(bf16, Bf16) X(f16, F16) X(f32, F32)

#define CIERA_ENC(name, L)                                                                      \
    extern "C" __global__ void __launch_bounds__(NT) ciera_enc_tile_##name(const EncJob* jobs) { \
        __shared__ EncTileShm<L> sh;                                                            \
        Blk b{NT};                                                                              \
        enc_tile<L>(jobs[blockIdx.y], blockIdx.x, b, sh);                                       \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(NT) ciera_enc_plan_##name(const EncJob* jobs) { \
        __shared__ PlanShm sh;                                                                  \
        Blk b{NT};                                                                              \
        enc_plan<L>(jobs[blockIdx.y], b, sh);                                                   \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(NT) ciera_enc_emit_##name(const EncJob* jobs) { \
        __shared__ EmitShm sh;                                                                  \
        Blk b{NT};                                                                              \
        enc_emit<L>(jobs[blockIdx.y], blockIdx.x, b, sh);                                       \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(NT) ciera_hyb_compact_##name(const EncJob* jobs) { \
        __shared__ EmitShm sh;                                                                  \
        Blk b{NT};                                                                              \
        hyb_compact<L>(jobs[blockIdx.y], blockIdx.x, b, sh);                                    \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(NT) ciera_hyb_masks_##name(const EncJob* jobs) { \
        __shared__ MaskShm sh;                                                                  \
        Blk b{NT};                                                                              \
        hyb_masks<L>(jobs[blockIdx.y], b, sh);                                                  \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(NT) ciera_hyb_pack_##name(const EncJob* jobs) { \
        __shared__ EncTileShm<L> sh;                                                            \
        Blk b{NT};                                                                              \
        hyb_pack<L>(jobs[blockIdx.y], blockIdx.x, b, sh);                                       \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(NT) ciera_enc_finish_##name(const EncJob* jobs) { \
        __shared__ FinishShm sh;                                                                \
        Blk b{NT};                                                                              \
        enc_finish<L>(jobs[blockIdx.y], b, sh);                                                 \
    }
#define CIERA_ENC_DELTA(name, L)                                                                \
    extern "C" __global__ void __launch_bounds__(NT) ciera_enc_delta_hist_##name(const EncJob* jobs) { \
        __shared__ DEncShm sh;                                                                  \
        Blk b{NT};                                                                              \
        enc_delta_hist<L>(jobs[blockIdx.y], blockIdx.x, b, sh);                                   \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(NT) ciera_enc_delta_groups_##name(const EncJob* jobs) { \
        __shared__ DEncShm sh;                                                                  \
        Blk b{NT};                                                                              \
        enc_delta_groups<L>(jobs[blockIdx.y], blockIdx.x, b, sh);                                   \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(NT) ciera_enc_delta_pack_##name(const EncJob* jobs) { \
        __shared__ DEncShm sh;                                                                  \
        Blk b{NT};                                                                              \
        enc_delta_pack<L>(jobs[blockIdx.y], blockIdx.x, b, sh);                                   \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(NT) ciera_enc_delta_sum_##name(const EncJob* jobs) { \
        __shared__ DEncShm sh;                                                                  \
        Blk b{NT};                                                                              \
        enc_delta_sum<L>(jobs[blockIdx.y], blockIdx.x, b, sh);                                   \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(NT) ciera_enc_delta_model_##name(const EncJob* jobs) { \
        __shared__ DEncShm sh;                                                                  \
        Blk b{NT};                                                                              \
        enc_delta_model<L>(jobs[blockIdx.y], b, sh);                                               \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(NT) ciera_enc_delta_lay_##name(const EncJob* jobs) { \
        __shared__ DEncShm sh;                                                                  \
        Blk b{NT};                                                                              \
        enc_delta_lay<L>(jobs[blockIdx.y], b, sh);                                               \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(NT) ciera_enc_delta_finish_##name(const EncJob* jobs) { \
        __shared__ DEncShm sh;                                                                  \
        Blk b{NT};                                                                              \
        enc_delta_finish<L>(jobs[blockIdx.y], b, sh);                                               \
    }
CIERA_TYPES(CIERA_ENC)
CIERA_TYPES(CIERA_ENC_DELTA)
#define CIERA_DEC(name, L)                                                                      \
    extern "C" __global__ void __launch_bounds__(NT) ciera_dec_parse_##name(const DecJob* jobs) { \
        __shared__ ParseShm sh;                                                                 \
        Blk b{NT};                                                                              \
        dec_parse<L>(jobs[blockIdx.y], b, sh);                                                  \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(NT) ciera_dec_hyb_##name(const DecJob* jobs) { \
        __shared__ SegDecShm sh;                                                                \
        Blk b{NT};                                                                              \
        dec_hyb<L>(jobs[blockIdx.y], b, sh);                                                    \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(NT) ciera_dec_tile_hyb_##name(const DecJob* jobs) { \
        __shared__ DecMaskShm sh;                                                               \
        Blk b{NT};                                                                              \
        dec_tile_hyb<L>(jobs[blockIdx.y], blockIdx.x, b, sh);                                   \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(NT) ciera_dec_tile_##name(const DecJob* jobs) { \
        __shared__ DecMaskShm sh;                                                               \
        Blk b{NT};                                                                              \
        dec_tile<L>(jobs[blockIdx.y], blockIdx.x, b, sh);                                       \
    } \
    extern "C" __global__ void __launch_bounds__(NT) ciera_dec_delta_model_##name(const DecJob* jobs) { \
        __shared__ ParseShm sh;                                                                 \
        Blk b{NT};                                                                              \
        dec_delta_model<L>(jobs[blockIdx.y], b, sh);                                            \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(NT) ciera_dec_delta_##name(const DecJob* jobs) { \
        __shared__ DeltaShm sh;                                                                 \
        Blk b{NT};                                                                              \
        dec_delta<L>(jobs[blockIdx.y], blockIdx.x, b, sh);                                      \
    }
CIERA_TYPES(CIERA_DEC)

extern "C" __global__ void __launch_bounds__(NT) ciera_dec_mask(const DecJob* jobs) {
    __shared__ DecMaskShm sh;
    Blk b{NT};
    dec_mask(jobs[blockIdx.y], blockIdx.x, b, sh);
}
extern "C" __global__ void __launch_bounds__(NT) ciera_dec_rans(const DecJob* jobs) {
    __shared__ SegDecShm sh;
    Blk b{NT};
    dec_rans(jobs[blockIdx.y], b, sh);
}
extern "C" __global__ void __launch_bounds__(NT) ciera_dec_scan(const DecJob* jobs, u32 which) {
    __shared__ DecScanShm sh;
    Blk b{NT};
    dec_scan(jobs[blockIdx.y], which, b, sh);
}
extern "C" __global__ void __launch_bounds__(NT) ciera_dec_hier2(const DecJob* jobs) {
    __shared__ DecMaskShm sh;
    Blk b{NT};
    dec_hier2(jobs[blockIdx.y], blockIdx.x, b, sh);
}
extern "C" __global__ void __launch_bounds__(NT) ciera_dec_hier3(const DecJob* jobs) {
    __shared__ DecMaskShm sh;
    Blk b{NT};
    dec_hier3(jobs[blockIdx.y], blockIdx.x, b, sh);
}
extern "C" __global__ void __launch_bounds__(NT) ciera_dec_finish(const DecJob* jobs) {
    __shared__ FinishShm sh;
    Blk b{NT};
    dec_finish(jobs[blockIdx.y], b, sh);
}
#endif
