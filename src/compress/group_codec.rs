//! The codec of one compressed call, as the engine sees it: [`OwnEncoder`] encodes this rank's
//! chunks against its own slot (on the engine's encoder worker), [`GroupCodec`] decodes every
//! other rank's frames into the output and into that source's slot.

use std::time::Instant;

use crate::codec::{frame, CacheSlot, FrameInfo};
use crate::engine::{ChunkRef, FrameCodec, FrameEncoder};
use crate::error::{Error, Result};

/// Frame format code in message headers for CIERA frames (docs/WIRE.md).
pub const FRAME_FORMAT: u8 = 1;

/// Encodes this rank's chunks against its own slot (the copy of what it sent last time, so
/// sender and receivers code against the same state).
pub struct OwnEncoder<'a> {
    pub slot: &'a mut CacheSlot,
    /// One per chunk, in order: committed to the slot once the call went well everywhere.
    pub infos: Vec<FrameInfo>,
    pub encode_ns: u64,
}

impl FrameEncoder for OwnEncoder<'_> {
    fn encode(&mut self, chunk: &ChunkRef, raw: &[u8], out: &mut Vec<u8>) -> Result<()> {
        let t = Instant::now();
        let info = self.slot.chunk(chunk.elems.clone()).encode(raw, out)?;
        self.encode_ns += t.elapsed().as_nanos() as u64;
        if info.count != chunk.elems.len() {
            return Err(Error::LengthMismatch {
                what: "encoded chunk elements",
                expected: chunk.elems.len(),
                found: info.count,
            });
        }
        self.infos.push(info);
        Ok(())
    }
}

/// Decodes the frames of the other ranks into their slots. A frame that does not decode is
/// not fatal to the call: it is recorded (`failures`), exchanged and repaired after the call
/// (see the module docs of `compress`); later frames of the same source are skipped.
pub struct GroupCodec<'a> {
    /// Slots of sources `0..me` and `me+1..n`.
    before: &'a mut [CacheSlot],
    after: &'a mut [CacheSlot],
    me: usize,
    /// Per source: what decoded, in order.
    pub infos: Vec<Vec<FrameInfo>>,
    pub failures: Vec<Option<Error>>,
    pub decode_ns: u64,
}

impl<'a> GroupCodec<'a> {
    pub fn new(
        before: &'a mut [CacheSlot],
        after: &'a mut [CacheSlot],
        me: usize,
    ) -> GroupCodec<'a> {
        let n = before.len() + after.len() + 1;
        GroupCodec {
            before,
            after,
            me,
            infos: vec![Vec::new(); n],
            failures: (0..n).map(|_| None).collect(),
            decode_ns: 0,
        }
    }

    /// Parse `bytes` as the frame of `chunk` of `src` and decode it into `out` and the slot.
    fn decode_frame(
        &mut self,
        src: usize,
        chunk: &ChunkRef,
        bytes: &[u8],
        out: &mut [u8],
    ) -> Result<FrameInfo> {
        let f = frame::parse(bytes)?;
        if f.offset != chunk.elems.start || f.count != chunk.elems.len() {
            return Err(Error::LengthMismatch {
                what: "frame element range start",
                expected: chunk.elems.start,
                found: f.offset,
            });
        }
        let info = self.slot(src).chunk(chunk.elems.clone()).decode(&f, out)?;
        Ok(info)
    }

    fn slot(&mut self, src: usize) -> &mut CacheSlot {
        if src < self.me {
            &mut self.before[src]
        } else {
            &mut self.after[src - self.me - 1]
        }
    }
}

impl FrameCodec for GroupCodec<'_> {
    fn format(&self) -> u8 {
        FRAME_FORMAT
    }

    fn max_frame_len(&self, raw_len: usize) -> usize {
        raw_len + frame::HEADER_LEN
    }

    fn decode(&mut self, chunk: &ChunkRef, bytes: &[u8], out: &mut [u8]) -> Result<()> {
        let src = chunk.src;
        if src >= self.failures.len() || src == self.me || self.failures[src].is_some() {
            return Ok(());
        }
        let t = Instant::now();
        let r = self.decode_frame(src, chunk, bytes, out);
        match r {
            Ok(info) => self.infos[src].push(info),
            Err(e) => self.failures[src] = Some(e),
        }
        self.decode_ns += t.elapsed().as_nanos() as u64;
        Ok(())
    }
}
