//! The host build of `cuda/codec.cu`: the CUDA kernels' block bodies compiled by the system C++
//! compiler and run on the CPU by `emulator.cpp`, block by block and phase by phase, in the
//! order the device path launches them. Tests diff what it writes against the Rust codec
//! (`tests/gpu_host.rs`), so the kernels' logic is checked byte for byte on machines without
//! a GPU. What this cannot check (blocks running concurrently, the device's memory model) is
//! for the device check (`bench/gpu_check.sh`).

use std::ffi::c_int;

/// One frame to encode, as the kernels read it (`EncJob` in codec.cu): addresses and sizes.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct EncJob {
    input: u64,
    cache: u64,
    frame: u64,
    scratch: u64,
    n: u64,
    offset: u64,
    version: u64,
    flags: u64,
    ctx: u64,
    dscratch: u64,
}

extern "C" {
    fn ciera_emu_plan_bytes() -> u64;
    fn ciera_emu_enc_scratch_bytes(n: u64, full: u32) -> u64;
    fn ciera_emu_enc_delta_scratch_bytes(n: u64) -> u64;
    fn ciera_emu_encode(dtype: u32, jobs: *const EncJob, njobs: u32) -> c_int;
    fn ciera_emu_xxh3(head56: *const u8, tail: *const u8, tail_len: u64) -> u64;
    fn ciera_emu_log2_q16(x: u64) -> u64;
    fn ciera_emu_sh64(data: *const u8, len: u64) -> u64;
}

/// One chunk of a slot to encode into an Exp or FILL frame.
pub struct EncChunk<'a> {
    /// The chunk's values (`n * size` bytes, little-endian).
    pub input: &'a [u8],
    /// The chunk's cache, updated as a device encoder updates it: `n` exponent bytes, or with
    /// `full` the `n` previous values.
    pub cache: &'a mut [u8],
    pub offset: u64,
    pub version: u64,
    /// A cold slot: the frame is a FILL.
    pub cold: bool,
    /// A full-value cache (Exp or Hybrid frames), else an exponent cache (Exp frames).
    pub full: bool,
    /// A full-value cache's frame choice, as the CPU's `FrameChoice`: 0 `Auto` (Exp or Hybrid;
    /// on a delta cache `NoDelta`), 1 `Exp`, 2 `Hybrid`; with `ctx` also 3 `Delta` and 4 `Auto`
    /// (the smallest of Exp, Hybrid and Delta).
    pub choice: u8,
    /// A delta cache (with `full`): the chunk's `n` context bytes, updated. A warm one sends
    /// what `choice` says (a Delta frame, or a FILL where that is longer, with 3).
    pub ctx: Option<&'a mut [u8]>,
}

/// Element size of the codec's float types by `ncclDataType_t` number, or None.
pub fn elem_size(dtype: u32) -> Option<usize> {
    match dtype {
        6 | 9 => Some(2),
        7 => Some(4),
        _ => None,
    }
}

/// Encode a batch of chunks of one type (`ncclDataType_t` number 6, 7 or 9) as the device does,
/// one frame per chunk.
///
/// # Panics
/// On another type, an empty chunk, or a chunk whose input and cache lengths disagree.
pub fn encode(dtype: u32, chunks: &mut [EncChunk<'_>]) -> Vec<Vec<u8>> {
    let size = elem_size(dtype).expect("a codec float type");
    let mut frames: Vec<Vec<u64>> = Vec::new();
    let mut scratch: Vec<Vec<u64>> = Vec::new();
    let mut dscratches: Vec<Vec<u64>> = Vec::new();
    let mut jobs = Vec::new();
    for c in chunks.iter_mut() {
        let n = c.input.len() / size;
        let per = if c.full { size } else { 1 };
        assert!(
            n >= 1 && c.input.len() == n * size && c.cache.len() == n * per,
            "chunk of {n} elements"
        );
        assert!(
            c.choice < 3 || (c.ctx.is_some() && c.choice < 5),
            "choice {}",
            c.choice
        );
        // EncJob flags bits 2-3 (the full-value choice) and 4-5 (DE_NEVER, DE_ALWAYS, DE_AUTO).
        let (choice, delta_mode) = match c.choice {
            3 => (0u64, 1u64),
            4 => (0, 2),
            ch => (ch as u64, 0),
        };
        assert!(
            c.ctx.as_ref().is_none_or(|x| c.full && x.len() == n),
            "contexts of a chunk of {n} elements"
        );
        let (ctx, dscratch) = match c.ctx.as_mut() {
            Some(x) => {
                let db = enc_delta_scratch_bytes(n);
                dscratches.push(vec![0u64; db.div_ceil(8)]);
                (
                    x.as_mut_ptr() as u64,
                    dscratches.last_mut().unwrap().as_mut_ptr() as u64,
                )
            }
            None => (0, 0),
        };
        frames.push(vec![0u64; (64 + n * size).div_ceil(8)]);
        let sb = enc_scratch_bytes(n, c.full);
        scratch.push(vec![0u64; sb.div_ceil(8)]);
        jobs.push(EncJob {
            input: c.input.as_ptr() as u64,
            cache: c.cache.as_mut_ptr() as u64,
            frame: frames.last_mut().unwrap().as_mut_ptr() as u64,
            scratch: scratch.last_mut().unwrap().as_mut_ptr() as u64,
            n: n as u64,
            offset: c.offset,
            version: c.version,
            flags: c.cold as u64 | (c.full as u64) << 1 | choice << 2 | delta_mode << 4,
            ctx,
            dscratch,
        });
    }
    // SAFETY: every job's addresses point to live buffers of the sizes the kernels need
    // (input n*size, cache n, frame 64+n*size, scratch enc_scratch_bytes(n); a delta job's ctx
    // n and dscratch enc_delta_scratch_bytes(n)), borrowed exclusively (cache, frame, scratch,
    // ctx, dscratch) for the call.
    let rc = unsafe { ciera_emu_encode(dtype, jobs.as_ptr(), jobs.len() as u32) };
    assert_eq!(rc, 0, "dtype {dtype}");
    frames
        .iter()
        .zip(&scratch)
        .map(|(f, s)| {
            // Plan.frame_len is the 7th u64 of the scratch (codec.cu, struct Plan).
            let len = s[6] as usize;
            f.iter().flat_map(|w| w.to_le_bytes()).take(len).collect()
        })
        .collect()
}

/// XXH3-64 (seed 0) of `head` (56 bytes) followed by `tail`, as the kernels compute the frame
/// checksum.
pub fn xxh3(head: &[u8; 56], tail: &[u8]) -> u64 {
    // SAFETY: head has 56 bytes, tail tail.len().
    unsafe { ciera_emu_xxh3(head.as_ptr(), tail.as_ptr(), tail.len() as u64) }
}

/// The kernels' fixed-point log2 (Q16).
pub fn log2_q16(x: u64) -> u64 {
    assert!(x >= 1);
    // SAFETY: a pure function.
    unsafe { ciera_emu_log2_q16(x) }
}

/// SH64 of `data` from per-word partial sums, as the tile kernels compute it.
pub fn sh64(data: &[u8]) -> u64 {
    // SAFETY: data has data.len() bytes.
    unsafe { ciera_emu_sh64(data.as_ptr(), data.len() as u64) }
}

/// One frame to decode, as the kernels read it (`DecJob` in codec.cu).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct DecJob {
    frame: u64,
    frame_len: u64,
    out: u64,
    cache: u64,
    scratch: u64,
    n: u64,
    offset: u64,
    version: u64,
    warm: u64,
    full: u64,
    ctx: u64,
    dscratch: u64,
}

extern "C" {
    fn ciera_emu_dec_scratch_bytes(n: u64) -> u64;
    fn ciera_emu_delta_scratch_bytes(n: u64) -> u64;
    fn ciera_emu_decode(dtype: u32, jobs: *const DecJob, njobs: u32) -> c_int;
}

/// One chunk of a slot to decode a frame into.
pub struct DecChunk<'a> {
    pub frame: &'a [u8],
    /// The chunk's values (`n * size` bytes), written.
    pub out: &'a mut [u8],
    /// The chunk's cache, updated: `n` exponent bytes, or with `full` the `n` previous values.
    pub cache: &'a mut [u8],
    pub offset: u64,
    pub version: u64,
    pub warm: bool,
    /// A full-value cache (takes Exp and Hybrid frames), else an exponent cache.
    pub full: bool,
    /// A delta cache (with `full`): the chunk's `n` context bytes, updated; it also takes
    /// Delta frames.
    pub ctx: Option<&'a mut [u8]>,
}

/// Why the kernels refused a frame: `DecPlan.err` and its two details (codec.cu, `DE_*`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Refused {
    pub code: u32,
    pub a: u64,
    pub b: u64,
}

/// Decode a batch of frames of one type as the device does.
///
/// # Panics
/// On another type, an empty chunk, or lengths that disagree.
pub fn decode(dtype: u32, chunks: &mut [DecChunk<'_>]) -> Vec<Result<(), Refused>> {
    let size = elem_size(dtype).expect("a codec float type");
    let mut frames: Vec<Vec<u64>> = Vec::new();
    let mut scratch: Vec<Vec<u64>> = Vec::new();
    // Delta scratch, one per delta job (a Vec of Vecs: pushing moves no inner buffer).
    let mut dscratches: Vec<Vec<u64>> = Vec::new();
    let mut jobs = Vec::new();
    for c in chunks.iter_mut() {
        let n = c.out.len() / size;
        let per = if c.full { size } else { 1 };
        assert!(
            n >= 1 && c.out.len() == n * size && c.cache.len() == n * per,
            "chunk of {n} elements"
        );
        assert!(
            c.ctx.as_ref().is_none_or(|x| c.full && x.len() == n),
            "contexts of a chunk of {n} elements"
        );
        // An 8-aligned copy of the frame, as a device receive buffer is.
        let mut f = vec![0u64; c.frame.len().div_ceil(8)];
        for (w, b) in f.iter_mut().zip(c.frame.chunks(8)) {
            let mut x = [0u8; 8];
            x[..b.len()].copy_from_slice(b);
            *w = u64::from_le_bytes(x);
        }
        frames.push(f);
        // SAFETY: a pure function of n.
        let sb = unsafe { ciera_emu_dec_scratch_bytes(n as u64) } as usize;
        scratch.push(vec![0u64; sb.div_ceil(8)]);
        let (ctx, dscratch) = match c.ctx.as_mut() {
            Some(x) => {
                // SAFETY: a pure function of n.
                let db = unsafe { ciera_emu_delta_scratch_bytes(n as u64) } as usize;
                dscratches.push(vec![0u64; db.div_ceil(8)]);
                (
                    x.as_mut_ptr() as u64,
                    dscratches.last_mut().unwrap().as_mut_ptr() as u64,
                )
            }
            None => (0, 0),
        };
        jobs.push(DecJob {
            frame: frames.last().unwrap().as_ptr() as u64,
            frame_len: c.frame.len() as u64,
            out: c.out.as_mut_ptr() as u64,
            cache: c.cache.as_mut_ptr() as u64,
            scratch: scratch.last_mut().unwrap().as_mut_ptr() as u64,
            n: n as u64,
            offset: c.offset,
            version: c.version,
            warm: c.warm as u64,
            full: c.full as u64,
            ctx,
            dscratch,
        });
    }
    // SAFETY: every job's addresses point to live buffers of the sizes the kernels need
    // (frame frame_len, out n*size, cache n, scratch dec_scratch_bytes(n); a delta job's ctx
    // n and dscratch delta_scratch_bytes(n)), the written ones borrowed exclusively for the
    // call.
    let rc = unsafe { ciera_emu_decode(dtype, jobs.as_ptr(), jobs.len() as u32) };
    assert_eq!(rc, 0, "dtype {dtype}");
    scratch
        .iter()
        .map(|s| {
            let code = s[0] as u32; // DecPlan { u32 err, u32 pad0, u64 a, u64 b, .. }
            if code == 0 {
                Ok(())
            } else {
                Err(Refused {
                    code,
                    a: s[1],
                    b: s[2],
                })
            }
        })
        .collect()
}

/// `sizeof(Plan)` in the host build (the launcher reads plans at this stride).
pub fn plan_bytes() -> usize {
    // SAFETY: a constant of the linked host build.
    unsafe { ciera_emu_plan_bytes() as usize }
}

/// Scratch bytes the kernels need for an encode job of `n` elements (`enc_scratch_bytes`), with
/// an exponent cache or a full-value one.
pub fn enc_scratch_bytes(n: usize, full: bool) -> usize {
    // SAFETY: a pure function of its arguments.
    unsafe { ciera_emu_enc_scratch_bytes(n as u64, full as u32) as usize }
}

/// Scratch bytes the kernels need for the Delta frame of an encode job of `n` elements into a
/// delta cache (`enc_delta_scratch_bytes`).
pub fn enc_delta_scratch_bytes(n: usize) -> usize {
    // SAFETY: a pure function of n.
    unsafe { ciera_emu_enc_delta_scratch_bytes(n as u64) as usize }
}

/// Scratch bytes the kernels need for a decode job of `n` elements (`dec_scratch_bytes`).
pub fn dec_scratch_bytes(n: usize) -> usize {
    // SAFETY: a pure function of n.
    unsafe { ciera_emu_dec_scratch_bytes(n as u64) as usize }
}

/// Scratch bytes the kernels need for the Delta model of a decode job of `n` elements into a
/// delta cache (`delta_scratch_bytes`).
pub fn delta_scratch_bytes(n: usize) -> usize {
    // SAFETY: a pure function of n.
    unsafe { ciera_emu_delta_scratch_bytes(n as u64) as usize }
}

extern "C" {
    fn ciera_emu_mask_encode(
        words: *const u64,
        m: u64,
        rans: u32,
        try_gain: u64,
        gain: u64,
        out: *mut u8,
        cap: u64,
    ) -> u64;
    fn ciera_emu_mask_max_bytes(m: u64) -> u64;
    fn ciera_emu_freq_table(hist: *const u32, block: u32, freq: *mut u32);
    fn ciera_emu_mask_plan(
        words: *const u64,
        m: u64,
        rans: u32,
        try_gain: u64,
        gain: u64,
        coding: *mut u32,
    ) -> u64;
    fn ciera_emu_mask_decode(
        input: *const u8,
        len: u64,
        m: u64,
        version: u32,
        block: u32,
        words: *mut u64,
        ones: *mut u64,
    ) -> u32;
}

/// The kernels' mask coder (Hybrid frames; a block, coding 4 a thread per run of segments):
/// the coding `bitmask::plan_gated` would pick (rANS considered when `rans` is
/// Some((try_gain, min_gain))), written out.
pub fn mask_encode(words: &[u64], m: usize, rans: Option<(usize, usize)>) -> Vec<u8> {
    assert_eq!(words.len(), m.div_ceil(64));
    // SAFETY: a pure function of m.
    let cap = unsafe { ciera_emu_mask_max_bytes(m as u64) };
    let mut out = vec![0u8; cap as usize];
    // SAFETY: words holds ceil(m/64) words; out has `cap` bytes, the most a mask of m bits takes.
    let len = unsafe {
        ciera_emu_mask_encode(
            words.as_ptr(),
            m as u64,
            rans.is_some() as u32,
            rans.map_or(0, |r| r.0) as u64,
            rans.map_or(0, |r| r.1) as u64,
            out.as_mut_ptr(),
            cap,
        )
    };
    assert!(len >= 1, "a coded mask of {m} bits over {cap} bytes");
    out.truncate(len as usize);
    out
}

/// The kernels' mask plan: (coding byte, estimated bytes), as `bitmask::plan_gated` reports
/// them.
pub fn mask_plan(words: &[u64], m: usize, rans: Option<(usize, usize)>) -> (u8, usize) {
    assert_eq!(words.len(), m.div_ceil(64));
    let mut coding = 0u32;
    // SAFETY: words holds ceil(m/64) words; coding is writable.
    let bytes = unsafe {
        ciera_emu_mask_plan(
            words.as_ptr(),
            m as u64,
            rans.is_some() as u32,
            rans.map_or(0, |r| r.0) as u64,
            rans.map_or(0, |r| r.1) as u64,
            &mut coding,
        )
    };
    (coding as u8, bytes as usize)
}

/// The kernels' rANS table of a byte histogram (counts not all zero): by the block
/// (`freq_from_hist_blk`) or, with `block` false, by the one-thread `freq_from_hist`.
pub fn freq_table(hist: &[u32; 256], block: bool) -> [u32; 256] {
    assert!(hist.iter().any(|&c| c != 0));
    let mut freq = [0u32; 256];
    // SAFETY: both arrays hold 256 entries.
    unsafe { ciera_emu_freq_table(hist.as_ptr(), block as u32, freq.as_mut_ptr()) };
    freq
}

/// The kernels' mask decoder (Hybrid frames; a block: Flat a word per thread in turn, Hier by
/// runs of words, coding 4 a thread per run of segments) for a frame of format `version`
/// (coding 4 is refused below version 3): the words and their ones, or the reason code.
pub fn mask_decode(input: &[u8], m: usize, version: u8) -> Result<(Vec<u64>, u64), u32> {
    mask_decode_on(input, m, version, true)
}

/// The kernels' one-thread mask reader (`mask_read_one`, the reference the block's readers
/// follow): as [`mask_decode`], same words or same reason code.
pub fn mask_decode_one_thread(input: &[u8], m: usize, version: u8) -> Result<(Vec<u64>, u64), u32> {
    mask_decode_on(input, m, version, false)
}

fn mask_decode_on(
    input: &[u8],
    m: usize,
    version: u8,
    block: bool,
) -> Result<(Vec<u64>, u64), u32> {
    let mut words = vec![0u64; m.div_ceil(64)];
    let mut ones = 0u64;
    // SAFETY: input has input.len() bytes; words ceil(m/64).
    let why = unsafe {
        ciera_emu_mask_decode(
            input.as_ptr(),
            input.len() as u64,
            m as u64,
            version as u32,
            block as u32,
            words.as_mut_ptr(),
            &mut ones,
        )
    };
    if why == 0 {
        Ok((words, ones))
    } else {
        Err(why)
    }
}
