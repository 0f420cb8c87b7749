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
    auto ts = std::make_unique<EncTileShm<L>>();
    auto ps = std::make_unique<PlanShm>();
    auto es = std::make_unique<EmitShm>();
    auto hs = std::make_unique<MaskShm>();
    auto fs = std::make_unique<FinishShm>();
    auto tiled = [&](auto body) {
        for (u32 y = 0; y < nj; ++y)
            for (u64 x = 0; x < tiles; ++x) body(jobs[y], x);
    };
    // A delta job's pass one and pick first: the kernels after them read what it picked.
    auto ds = std::make_unique<DEncShm>();
    tiled([&](const EncJob& j, u64 x) { enc_delta_hist<L>(j, x, b, *ds); });
    for (u32 y = 0; y < nj; ++y) enc_delta_model<L>(jobs[y], b, *ds);
    tiled([&](const EncJob& j, u64 x) { enc_tile<L>(j, x, b, *ts); });
    for (u32 y = 0; y < nj; ++y) enc_plan<L>(jobs[y], b, *ps);
    tiled([&](const EncJob& j, u64 x) { hyb_compact<L>(j, x, b, *es); });
    for (u32 y = 0; y < nj; ++y) hyb_masks<L>(jobs[y], b, *hs);
    tiled([&](const EncJob& j, u64 x) { enc_emit<L>(j, x, b, *es); });
    tiled([&](const EncJob& j, u64 x) { hyb_pack<L>(j, x, b, *ts); });
    for (u32 y = 0; y < nj; ++y) enc_finish<L>(jobs[y], b, *fs);
    tiled([&](const EncJob& j, u64 x) { enc_delta_groups<L>(j, x, b, *ds); });
    for (u32 y = 0; y < nj; ++y) enc_delta_lay<L>(jobs[y], b, *ds);
    tiled([&](const EncJob& j, u64 x) { enc_delta_pack<L>(j, x, b, *ds); });
    tiled([&](const EncJob& j, u64 x) { enc_delta_sum<L>(j, x, b, *ds); });
    for (u32 y = 0; y < nj; ++y) enc_delta_finish<L>(jobs[y], b, *ds);
}

extern "C" {

u64 ciera_emu_enc_scratch_bytes(u64 n, u32 full) { return enc_scratch_bytes(n, full != 0); }
u64 ciera_emu_enc_delta_scratch_bytes(u64 n) { return enc_delta_scratch_bytes(n); }
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
    auto ds = std::make_unique<DeltaShm>();
    auto rs = std::make_unique<SegDecShm>();
    for (u32 y = 0; y < nj; ++y) dec_parse<L>(jobs[y], b, *ps);
    for (u32 y = 0; y < nj; ++y) dec_delta_model<L>(jobs[y], b, *ps);
    for (u32 y = 0; y < nj; ++y)
        for (u64 x = 0; x < tiles; ++x) dec_delta<L>(jobs[y], x, b, *ds);
    for (u32 y = 0; y < nj; ++y)
        for (u64 x = 0; x < tiles; ++x) dec_mask(jobs[y], x, b, *ms);
    for (u32 y = 0; y < nj; ++y) dec_rans(jobs[y], b, *rs);
    for (u32 y = 0; y < nj; ++y) dec_scan(jobs[y], 0, b, *ss);
    for (u32 y = 0; y < nj; ++y)
        for (u64 x = 0; x < tiles; ++x) dec_hier2(jobs[y], x, b, *ms);
    for (u32 y = 0; y < nj; ++y) dec_scan(jobs[y], 1, b, *ss);
    for (u32 y = 0; y < nj; ++y)
        for (u64 x = 0; x < tiles; ++x) dec_hier3(jobs[y], x, b, *ms);
    for (u32 y = 0; y < nj; ++y) dec_scan(jobs[y], 2, b, *ss);
    for (u32 y = 0; y < nj; ++y) dec_hyb<L>(jobs[y], b, *rs);
    for (u32 y = 0; y < nj; ++y)
        for (u64 x = 0; x < tiles; ++x) dec_tile<L>(jobs[y], x, b, *ms);
    for (u32 y = 0; y < nj; ++y)
        for (u64 x = 0; x < tiles; ++x) dec_tile_hyb<L>(jobs[y], x, b, *ms);
    for (u32 y = 0; y < nj; ++y) dec_finish(jobs[y], b, *fs);
}

extern "C" {
u64 ciera_emu_dec_scratch_bytes(u64 n) { return dec_scratch_bytes(n); }
u64 ciera_emu_delta_scratch_bytes(u64 n) { return delta_scratch_bytes(n); }

int ciera_emu_decode(u32 dtype, const DecJob* jobs, u32 njobs) {
    switch (dtype) {
    case Bf16::DT: decode_batch<Bf16>(jobs, njobs); return 0;
    case F16::DT: decode_batch<F16>(jobs, njobs); return 0;
    case F32::DT: decode_batch<F32>(jobs, njobs); return 0;
    default: return -1;
    }
}
}

extern "C" {
// The Hybrid frames' mask coder: plan (with rANS when `rans`: tried where the entropy of
// independent bits saves more than `try_gain` bytes, taken where it saves more than `gain`) and
// write, by a block; returns the bytes written to out (room: `cap`, at least
// mask_max_bytes(m)).
u64 ciera_emu_mask_encode(const u64* words, u64 m, u32 rans, u64 try_gain, u64 gain, u8* out,
                          u64 cap) {
    Blk b{NT};
    auto sh = std::make_unique<MaskShm>();
    u64 nb = cdiv(m, 8);
    // The reversal buffer as the encoders lay it out: streams, then states and lengths.
    std::unique_ptr<u8[]> rev(new u8[align8(2 * nb) + 8 * seg_count(nb) + 8]);
    u32* sl = (u32*)(rev.get() + align8(2 * nb));
    mask_code_blk(b, *sh, words, m, rans != 0, try_gain, gain, rev.get(), sl, out, cap);
    return sh->len <= cap ? sh->len : 0;
}
// The most bytes a coded mask of m bits can take (coding 4 at 2 stream bytes a mask byte).
u64 ciera_emu_mask_max_bytes(u64 m) {
    u64 nb = cdiv(m, 8);
    return 1 + 1 + 32 + 2 * 256 + 6 * seg_count(nb) + 2 * nb;
}
// The rANS table of a histogram (256 counts, not all zero), by the block (`block` 1) or by the
// one-thread freq_from_hist it replaced, into freq[256].
void ciera_emu_freq_table(const u32* hist, u32 block, u32* freq) {
    if (!block) return freq_from_hist(hist, freq);
    Blk b{NT};
    auto fs = std::make_unique<FreqShm>();
    freq_from_hist_blk(b, *fs, hist, freq);
}
// Its plan alone: the coding (into *coding) and its estimated bytes.
u64 ciera_emu_mask_plan(const u64* words, u64 m, u32 rans, u64 try_gain, u64 gain, u32* coding) {
    Blk b{NT};
    auto sh = std::make_unique<MaskShm>();
    mask_plan_blk(b, *sh, words, m, rans != 0, try_gain, gain);
    *coding = sh->c.coding;
    return sh->c.bytes;
}
// Its decoder, by a block (or with `block` 0 the one-thread mask_read_one), for a frame of
// format `version`: 0 and the ones, or why not.
u32 ciera_emu_mask_decode(const u8* in, u64 len, u64 m, u32 version, u32 block, u64* words,
                          u64* ones) {
    if (!block) return mask_read_one(in, len, m, version >= SEG_VERSION, words, ones);
    Blk b{NT};
    auto sh = std::make_unique<SegDecShm>();
    mask_read_blk(b, *sh, in, len, m, version >= SEG_VERSION, words);
    if (sh->why == 0) *ones = sh->ones;
    return sh->why;
}
}
