//! SH64, the stripe hash of a frame's bulk section (s0). Defined so that it can be computed
//! 32 bytes at a time inside the SIMD coding loops, while those bytes are in registers: the
//! bulk of a frame is then checksummed without a second pass over memory.
//!
//! ```text
//! acc[l] = INIT[l]                                 l = 0..3, u64 lanes, wrapping arithmetic
//! for each 32-byte stripe s (index from 0; a final partial stripe is zero-padded):
//!     w[l] = u64 LE at bytes 8l..8l+8 of the stripe
//!     v    = w[l] ^ KEY[l] ^ (s * P2)
//!     acc[l] += (v & 0xffff_ffff) * (v >> 32) + w[l ^ 1]
//! h = len * P3
//! for l in 0..4: h = rotl((h ^ fmix(acc[l])) * P1, 27)
//! SH64 = fmix(h)          fmix = the MurmurHash3 64-bit finaliser
//! ```
//! The stripe index in the key makes the hash depend on stripe order.

pub const P1: u64 = 0x9E37_79B1_85EB_CA87;
pub const P2: u64 = 0xC2B2_AE3D_27D4_EB4F;
pub const P3: u64 = 0x1656_67B1_9E37_79F9;
pub const INIT: [u64; 4] = [P1, P2, P3, 0x27D4_EB2F_1656_67C5];
pub const KEY: [u64; 4] = [
    0xbe4b_a423_396c_feb8,
    0x1cad_21f7_2c81_017c,
    0xdb97_9083_e96d_d4de,
    0x1f67_b3b7_a4a4_4072,
];

fn fmix(mut x: u64) -> u64 {
    x ^= x >> 33;
    x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
    x ^= x >> 33;
    x = x.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    x ^ (x >> 33)
}

/// Streaming SH64 state: whole stripes in, then `finish` with the tail.
#[derive(Clone, Debug)]
pub struct StripeHash {
    pub acc: [u64; 4],
    pub stripes: u64,
}

impl Default for StripeHash {
    fn default() -> Self {
        StripeHash {
            acc: INIT,
            stripes: 0,
        }
    }
}

impl StripeHash {
    /// Absorb whole stripes; `data.len()` must be a multiple of 32.
    pub fn update(&mut self, data: &[u8]) {
        debug_assert!(data.len().is_multiple_of(32));
        for stripe in data.chunks_exact(32) {
            self.stripe(stripe);
        }
    }

    fn stripe(&mut self, stripe: &[u8]) {
        let mut w = [0u64; 4];
        for (l, c) in stripe.chunks_exact(8).enumerate() {
            w[l] = u64::from_le_bytes(c.try_into().unwrap());
        }
        let sk = self.stripes.wrapping_mul(P2);
        for l in 0..4 {
            let v = w[l] ^ KEY[l] ^ sk;
            self.acc[l] = self.acc[l]
                .wrapping_add((v & 0xffff_ffff).wrapping_mul(v >> 32))
                .wrapping_add(w[l ^ 1]);
        }
        self.stripes += 1;
    }

    /// Absorb the final `tail` (< 32 bytes) and return SH64 of all `len` bytes.
    pub fn finish(mut self, tail: &[u8], len: usize) -> u64 {
        debug_assert!(tail.len() < 32);
        if !tail.is_empty() {
            let mut pad = [0u8; 32];
            pad[..tail.len()].copy_from_slice(tail);
            self.stripe(&pad);
        }
        let mut h = (len as u64).wrapping_mul(P3);
        for a in self.acc {
            h = (h ^ fmix(a)).wrapping_mul(P1).rotate_left(27);
        }
        fmix(h)
    }
}

/// SH64 of `data` (portable reference).
pub fn sh64_plain(data: &[u8]) -> u64 {
    let whole = data.len() / 32 * 32;
    let mut h = StripeHash::default();
    h.update(&data[..whole]);
    h.finish(&data[whole..], data.len())
}

/// SH64 of `data`, with the AVX2 path where available.
pub fn sh64(data: &[u8]) -> u64 {
    super::simd::sh64(data).unwrap_or_else(|| sh64_plain(data))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sensitive_to_content_order_and_length() {
        let a: Vec<u8> = (0..100u8).collect();
        let mut b = a.clone();
        b.swap(0, 40); // swap bytes across stripes
        assert_ne!(sh64_plain(&a), sh64_plain(&b));
        let mut c = a.clone();
        c.push(0); // zero padding must not collide with a real zero byte
        assert_ne!(sh64_plain(&a), sh64_plain(&c));
        let mut d = a.clone();
        d[99] ^= 1;
        assert_ne!(sh64_plain(&a), sh64_plain(&d));
        assert_ne!(sh64_plain(&[]), sh64_plain(&[0]));
        // Swapping two whole stripes changes the hash.
        let mut e = a.clone();
        let (x, y) = e.split_at_mut(32);
        x.swap_with_slice(&mut y[..32]);
        assert_ne!(sh64_plain(&a), sh64_plain(&e));
    }

    #[test]
    fn simd_matches_plain() {
        for n in [0usize, 1, 31, 32, 33, 64, 100, 1000, 4097] {
            let d: Vec<u8> = (0..n).map(|i| (i * 31 + i / 7) as u8).collect();
            assert_eq!(sh64(&d), sh64_plain(&d), "n={n}");
        }
    }
}
