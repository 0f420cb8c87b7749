//! Copies for the data path: [`copy_fast`] for every large copy that stays in the caches (into
//! and out of the shm rings, the own shard of small calls), [`copy_streaming`] for large copies
//! into an output bigger than the caches.
//!
//! Why not `memcpy`: glibc's x86-64 `memcpy` moves large blocks with `rep movsb` on CPUs that
//! advertise fast string moves (ERMS/FSRM), and on some CPUs (the AMD EPYC of our dev VM) that
//! instruction runs an order of magnitude slower whenever the destination sits 1-31 bytes
//! past the source modulo 4096. A ring's read position moves by the header bytes of every
//! message, so some calls hit that window and others do not. [`copy_fast`] is a vector loop
//! with aligned stores, as fast at every offset (ARCHITECTURE.md, "Allgather algorithms", has the
//! figures).
//!
//! Streaming: a plain copy first reads each destination line into the cache (read for
//! ownership), then writes it back later: three memory transfers per line. Non-temporal stores
//! write whole lines straight to memory: two. Once the output is bigger than the caches that
//! is the difference (about 2x for 4-32 MiB copies on the dev VM). Below the caches' size a
//! plain copy is
//! better (the caller reads the output soon, from cache), so the communicator streams only for
//! calls whose output is large (`CIERA_STREAM_MIN_BYTES`).
//!
//! SSE2 is part of x86-64; AVX2 is used when the CPU has it (checked once). On other
//! architectures both functions are `copy_from_slice`.

/// Copies shorter than this are left to `ptr::copy_nonoverlapping` (glibc uses vector moves,
/// not `rep movsb`, below a few KiB).
const FAST_MIN: usize = 2048;

/// Copies `src` into `dst` (same length); see the module docs for why not `memcpy`.
pub fn copy_fast(dst: &mut [u8], src: &[u8]) {
    assert_eq!(dst.len(), src.len(), "copy_fast: lengths differ");
    // SAFETY: two distinct slices of equal length (a `&mut` cannot alias a `&`).
    unsafe { copy_fast_raw(dst.as_mut_ptr(), src.as_ptr(), src.len()) }
}

/// As [`copy_fast`], for raw pointers.
///
/// # Safety
/// `src` is valid for reads and `dst` for writes of `n` bytes, and the ranges do not overlap.
pub unsafe fn copy_fast_raw(dst: *mut u8, src: *const u8, n: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        if n >= FAST_MIN {
            if std::arch::is_x86_feature_detected!("avx2") {
                x86::copy_avx2(dst, src, n);
            } else {
                x86::copy_sse2(dst, src, n);
            }
            return;
        }
    }
    std::ptr::copy_nonoverlapping(src, dst, n);
}

/// Copies shorter than this are plain copies even when streaming is asked for.
const STREAM_MIN: usize = 4096;

/// Copies `src` into `dst` (same length) with non-temporal stores where that helps; the
/// stores are fenced before returning, so the bytes are visible to anyone who later sees a
/// Release store of this thread.
pub fn copy_streaming(dst: &mut [u8], src: &[u8]) {
    assert_eq!(dst.len(), src.len(), "copy_streaming: lengths differ");
    // SAFETY: two distinct slices of equal length (a `&mut` cannot alias a `&`).
    unsafe { copy_streaming_raw(dst.as_mut_ptr(), src.as_ptr(), src.len()) }
}

/// As [`copy_streaming`], for raw pointers.
///
/// # Safety
/// `src` is valid for reads and `dst` for writes of `n` bytes, and the ranges do not overlap.
pub unsafe fn copy_streaming_raw(dst: *mut u8, src: *const u8, n: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        if n >= STREAM_MIN {
            x86::stream(dst, src, n);
            return;
        }
    }
    std::ptr::copy_nonoverlapping(src, dst, n);
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::{
        __m128i, __m256i, _mm256_loadu_si256, _mm256_store_si256, _mm_loadu_si128, _mm_sfence,
        _mm_store_si128, _mm_stream_si128,
    };

    const LINE: usize = 64;

    /// Plain copy up to the first 64-byte-aligned destination address, then returns the
    /// (dst, src, lines, done) of the aligned middle part.
    ///
    /// # Safety
    /// As `copy_fast_raw`.
    unsafe fn split(dst: *mut u8, src: *const u8, n: usize) -> (*mut u8, *const u8, usize, usize) {
        let head = dst.align_offset(LINE).min(n);
        std::ptr::copy_nonoverlapping(src, dst, head);
        let lines = (n - head) / LINE;
        (dst.add(head), src.add(head), lines, head + lines * LINE)
    }

    /// Unaligned 32-byte loads, aligned stores, two lines per turn.
    ///
    /// # Safety
    /// As `copy_fast_raw`, on a CPU with AVX2.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn copy_avx2(dst: *mut u8, src: *const u8, n: usize) {
        let (mut d, mut s, lines, done) = split(dst, src, n);
        for _ in 0..lines {
            let a = _mm256_loadu_si256(s as *const __m256i);
            let b = _mm256_loadu_si256(s.add(32) as *const __m256i);
            _mm256_store_si256(d as *mut __m256i, a);
            _mm256_store_si256(d.add(32) as *mut __m256i, b);
            d = d.add(LINE);
            s = s.add(LINE);
        }
        std::ptr::copy_nonoverlapping(src.add(done), dst.add(done), n - done);
    }

    /// As `copy_avx2` with 16-byte vectors (every x86-64 CPU).
    ///
    /// # Safety
    /// As `copy_fast_raw`.
    pub(super) unsafe fn copy_sse2(dst: *mut u8, src: *const u8, n: usize) {
        copy_lines_sse2::<false>(dst, src, n);
    }

    /// Plain copy up to the first 64-byte-aligned destination address, whole lines with
    /// non-temporal stores (unaligned loads), plain copy of the tail, then SFENCE.
    ///
    /// # Safety
    /// As `copy_streaming_raw`.
    pub(super) unsafe fn stream(dst: *mut u8, src: *const u8, n: usize) {
        copy_lines_sse2::<true>(dst, src, n);
        // Non-temporal stores are weakly ordered: make them visible before any later store
        // (the ring's tail, the caller's completion) that tells someone the bytes are there.
        _mm_sfence();
    }

    /// One aligned 16-byte store, non-temporal if `STREAM`.
    #[inline(always)]
    unsafe fn put<const STREAM: bool>(at: *mut u8, v: __m128i) {
        if STREAM {
            _mm_stream_si128(at as *mut __m128i, v);
        } else {
            _mm_store_si128(at as *mut __m128i, v);
        }
    }

    /// Whole destination-aligned lines in 16-byte vectors, with non-temporal (`STREAM`) or
    /// plain aligned stores; the unaligned head and tail plainly.
    ///
    /// # Safety
    /// As `copy_fast_raw`.
    #[inline(always)]
    unsafe fn copy_lines_sse2<const STREAM: bool>(dst: *mut u8, src: *const u8, n: usize) {
        let (mut d, mut s, lines, done) = split(dst, src, n);
        for _ in 0..lines {
            let a = _mm_loadu_si128(s as *const __m128i);
            let b = _mm_loadu_si128(s.add(16) as *const __m128i);
            let c = _mm_loadu_si128(s.add(32) as *const __m128i);
            let e = _mm_loadu_si128(s.add(48) as *const __m128i);
            put::<STREAM>(d, a);
            put::<STREAM>(d.add(16), b);
            put::<STREAM>(d.add(32), c);
            put::<STREAM>(d.add(48), e);
            d = d.add(LINE);
            s = s.add(LINE);
        }
        std::ptr::copy_nonoverlapping(src.add(done), dst.add(done), n - done);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    type Copy = fn(&mut [u8], &[u8]);

    fn sse2_only(dst: &mut [u8], src: &[u8]) {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: equal-length distinct slices.
        unsafe {
            x86::copy_sse2(dst.as_mut_ptr(), src.as_ptr(), src.len())
        }
        #[cfg(not(target_arch = "x86_64"))]
        dst.copy_from_slice(src)
    }

    /// Every offset pair in a line and lengths around the thresholds: exact bytes, and nothing
    /// outside the destination range touched; for each copy function (the SSE2 fallback too,
    /// which `copy_fast` skips on an AVX2 machine).
    #[test]
    fn copies_are_exact_at_every_alignment() {
        let fns: [(&str, Copy); 3] = [
            ("copy_streaming", copy_streaming),
            ("copy_fast", copy_fast),
            ("sse2", sse2_only),
        ];
        for (name, f) in fns {
            check_copy(name, f);
        }
    }

    fn check_copy(name: &str, copy: Copy) {
        let src: Vec<u8> = (0..70_000u32)
            .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
            .collect();
        for len in [
            0,
            1,
            63,
            64,
            2047,
            2048,
            2049,
            4095,
            4096,
            4097,
            5000,
            65_536 + 17,
        ] {
            for s_off in [0, 1, 15, 63] {
                for d_off in [0, 3, 16, 33] {
                    let mut dst = vec![0xA5u8; len + d_off + 64];
                    copy(&mut dst[d_off..d_off + len], &src[s_off..s_off + len]);
                    let ctx = format!("{name}: len {len} src+{s_off} dst+{d_off}");
                    assert_eq!(&dst[d_off..d_off + len], &src[s_off..s_off + len], "{ctx}");
                    assert!(
                        dst[..d_off].iter().all(|&b| b == 0xA5),
                        "{ctx}: bytes before"
                    );
                    assert!(
                        dst[d_off + len..].iter().all(|&b| b == 0xA5),
                        "{ctx}: bytes after"
                    );
                }
            }
        }
    }

    #[test]
    #[should_panic(expected = "lengths differ")]
    fn lengths_must_match() {
        copy_streaming(&mut [0u8; 8], &[0u8; 9]);
    }

    #[test]
    #[should_panic(expected = "lengths differ")]
    fn fast_lengths_must_match() {
        copy_fast(&mut [0u8; 8], &[0u8; 9]);
    }
}
