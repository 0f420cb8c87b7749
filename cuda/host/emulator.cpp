// The host emulator of cuda/codec.cu: every kernel's block body run block by block (and, inside
// a block, phase by phase, thread by thread: see "How a block body is written" in codec.cu), in
// the launch order the device path uses. Only for tests: the Rust side is cuda/host/lib.rs.
#include "../host_prelude.h"
#include "../codec.cu"

#include <memory>

template <class L> static void encode_batch(const EncJob* jobs, u32 nj) {
    u64 tiles = 0;
    for (u32 y = 0; y < nj; ++y) tiles = tiles > cdiv(jobs[y].n, TILE) ? tiles : cdiv(jobs[y].n, TILE);
    Blk b{NT};
    {
        auto sh = std::make_unique<EncTileShm<L>>();
        for (u32 y = 0; y < nj; ++y)
            for (u64 x = 0; x < tiles; ++x) enc_tile<L>(jobs[y], x, b, *sh);
    }
    {
        auto sh = std::make_unique<PlanShm>();
        for (u32 y = 0; y < nj; ++y) enc_plan<L>(jobs[y], b, *sh);
    }
    {
        auto sh = std::make_unique<EmitShm>();
        for (u32 y = 0; y < nj; ++y)
            for (u64 x = 0; x < tiles; ++x) enc_emit<L>(jobs[y], x, b, *sh);
    }
    {
        auto sh = std::make_unique<FinishShm>();
        for (u32 y = 0; y < nj; ++y) enc_finish<L>(jobs[y], b, *sh);
    }
}

extern "C" {

u64 ciera_emu_enc_scratch_bytes(u64 n) { return enc_scratch_bytes(n); }
u64 ciera_emu_plan_bytes() { return sizeof(Plan); }

// dtype: ncclDataType_t numbering (6 fp16, 7 fp32, 9 bf16). Returns 0, or -1 for another type.
int ciera_emu_encode(u32 dtype, const EncJob* jobs, u32 njobs) {
    switch (dtype) {
    case Bf16::DT: encode_batch<Bf16>(jobs, njobs); return 0;
    case F16::DT: encode_batch<F16>(jobs, njobs); return 0;
    case F32::DT: encode_batch<F32>(jobs, njobs); return 0;
    default: return -1;
    }
}

u64 ciera_emu_xxh3(const u8* head56, const u8* tail, u64 tail_len) {
    Cat c{head56, tail, 56 + tail_len};
    return xxh3_cat(c);
}

u64 ciera_emu_log2_q16(u64 x) { return log2_q16(x); }

u64 ciera_emu_sh64(const u8* data, u64 len) {
    u64 acc[4] = {0, 0, 0, 0};
    for (u64 w = 0; w < cdiv(len, 32) * 4; ++w) {
        u64 v = 0;
        for (u64 q = 0; q < 8 && 8 * w + q < len; ++q) v |= (u64)data[8 * w + q] << (8 * q);
        sh_word(acc, w, v);
    }
    return sh_finish(acc, len);
}
}

template <class L> static void decode_batch(const DecJob* jobs, u32 nj) {
    u64 tiles = 0;
    for (u32 y = 0; y < nj; ++y) tiles = tiles > cdiv(jobs[y].n, TILE) ? tiles : cdiv(jobs[y].n, TILE);
    Blk b{NT};
    auto ps = std::make_unique<ParseShm>();
    auto ms = std::make_unique<DecMaskShm>();
    auto ss = std::make_unique<DecScanShm>();
    auto fs = std::make_unique<FinishShm>();
    for (u32 y = 0; y < nj; ++y) dec_parse<L>(jobs[y], b, *ps);
    for (u32 y = 0; y < nj; ++y)
        for (u64 x = 0; x < tiles; ++x) dec_mask(jobs[y], x, b, *ms);
    for (u32 y = 0; y < nj; ++y) dec_rans(jobs[y], b);
    for (u32 y = 0; y < nj; ++y) dec_scan(jobs[y], 0, b, *ss);
    for (u32 y = 0; y < nj; ++y)
        for (u64 x = 0; x < tiles; ++x) dec_hier2(jobs[y], x, b, *ms);
    for (u32 y = 0; y < nj; ++y) dec_scan(jobs[y], 1, b, *ss);
    for (u32 y = 0; y < nj; ++y)
        for (u64 x = 0; x < tiles; ++x) dec_hier3(jobs[y], x, b, *ms);
    for (u32 y = 0; y < nj; ++y) dec_scan(jobs[y], 2, b, *ss);
    for (u32 y = 0; y < nj; ++y)
        for (u64 x = 0; x < tiles; ++x) dec_tile<L>(jobs[y], x, b, *ms);
    for (u32 y = 0; y < nj; ++y) dec_finish(jobs[y], b, *fs);
}

extern "C" {
u64 ciera_emu_dec_scratch_bytes(u64 n) { return dec_scratch_bytes(n); }

int ciera_emu_decode(u32 dtype, const DecJob* jobs, u32 njobs) {
    switch (dtype) {
    case Bf16::DT: decode_batch<Bf16>(jobs, njobs); return 0;
    case F16::DT: decode_batch<F16>(jobs, njobs); return 0;
    case F32::DT: decode_batch<F32>(jobs, njobs); return 0;
    default: return -1;
    }
}
}
