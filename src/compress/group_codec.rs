//! The codec of one compressed call, as the engine sees it: [`OwnEncoder`] encodes this rank's
//! chunks against its own lineage of the tensor (on the engine's encoder worker),
//! [`GroupCodec`] decodes every other rank's frames into the output and into the lineage each
//! frame names (found by source and version in the [`Store`], or started by a FILL).

use std::time::Instant;

use super::store::{Lineage, Store};
use crate::codec::{frame, CacheMode, CacheSlot, CodecError, FrameInfo, LevelBytes};
use crate::engine::{ChunkRef, FrameCodec, FrameEncoder};
use crate::error::{Error, Result};
use crate::DType;

/// Frame format code in message headers for CIERA frames: the format version of docs/WIRE.md
/// (2: with Delta frames). Ranks of builds that disagree fail the call as a mismatch naming the
/// two formats, rather than decoding frames the other cannot read.
pub const FRAME_FORMAT: u8 = crate::codec::frame::FORMAT_VERSION;

/// Encodes this rank's chunks against its own lineage (the copy of what it sent last time,
/// which every receiver holds too): deltas when warm, FILL frames when new.
pub struct OwnEncoder {
    pub lineage: Lineage,
    /// One per chunk, in order: committed to the slot once the call went well everywhere.
    pub infos: Vec<FrameInfo>,
    /// The encoder's estimates of each chunk's frame bytes at every frame level.
    pub levels: Vec<LevelBytes>,
    pub encode_ns: u64,
}

impl FrameEncoder for OwnEncoder {
    fn encode(&mut self, chunk: &ChunkRef, raw: &[u8], out: &mut Vec<u8>) -> Result<()> {
        let t = Instant::now();
        let (info, levels) = self
            .lineage
            .slot
            .chunk(chunk.elems.clone())
            .encode_estimated(raw, out)?;
        self.encode_ns += t.elapsed().as_nanos() as u64;
        if info.count != chunk.elems.len() {
            return Err(Error::LengthMismatch {
                what: "encoded chunk elements",
                expected: chunk.elems.len(),
                found: info.count,
            });
        }
        self.infos.push(info);
        self.levels.push(levels);
        Ok(())
    }
}

/// What a call decoded of one source: the lineage it decodes into and the frames so far.
pub struct Incoming {
    pub lineage: Lineage,
    /// The version its frames were coded against.
    pub version: u64,
    /// The source had no cache of its shard (a miss): its FILL frames started this lineage.
    pub missed: bool,
    pub infos: Vec<FrameInfo>,
}

/// Decodes the frames of the other ranks. A frame that does not decode is not fatal to the
/// call: it is recorded (`failures`), exchanged and repaired after the call (see the module
/// docs of `compress`); later frames of the same source are skipped.
pub struct GroupCodec<'a> {
    store: &'a mut Store,
    me: usize,
    count: usize,
    dtype: DType,
    /// The cache mode of lineages a FILL starts in this call (every rank computes the same).
    new_mode: CacheMode,
    clock: u64,
    /// Per source (None for this rank, and for sources nothing arrived from yet).
    pub incoming: Vec<Option<Incoming>>,
    pub failures: Vec<Option<Error>>,
    pub decode_ns: u64,
    /// Threads a chunk's Delta frame is decoded on (`CompressConfig::codec_threads`).
    pub codec_threads: usize,
}

impl<'a> GroupCodec<'a> {
    #[allow(clippy::too_many_arguments)] // the store and the call's shape
    pub fn new(
        store: &'a mut Store,
        me: usize,
        n: usize,
        count: usize,
        dtype: DType,
        new_mode: CacheMode,
        clock: u64,
    ) -> GroupCodec<'a> {
        GroupCodec {
            store,
            me,
            count,
            dtype,
            new_mode,
            clock,
            incoming: (0..n).map(|_| None).collect(),
            failures: (0..n).map(|_| None).collect(),
            decode_ns: 0,
            codec_threads: 1,
        }
    }

    /// Parse `bytes` as the frame of `chunk` of `src` and decode it into `out` and the lineage
    /// the frame names.
    fn decode_frame(
        &mut self,
        src: usize,
        chunk: &ChunkRef,
        bytes: &[u8],
        out: &mut [u8],
    ) -> Result<()> {
        let f = frame::parse(bytes)?;
        if f.offset != chunk.elems.start || f.count != chunk.elems.len() {
            return Err(Error::LengthMismatch {
                what: "frame element range start",
                expected: chunk.elems.start,
                found: f.offset,
            });
        }
        let fill = f.flags & frame::FLAG_FILL != 0;
        if self.incoming[src].is_none() {
            // The lineage the frame names, if this rank holds it; else a FILL starts one (the
            // source had no cache of its shard: a miss); else the frame cannot be decoded.
            let (mut lineage, missed) = match self.store.take(src, f.version) {
                Some(l) => (l, false),
                None if fill => (
                    Lineage {
                        slot: CacheSlot::with_version(
                            self.dtype,
                            self.new_mode,
                            self.count,
                            f.version,
                        ),
                        last_use: self.clock,
                    },
                    true,
                ),
                None => {
                    return Err(Error::Codec(CodecError::SlotState {
                        detail: format!(
                            "rank {src}'s frame was coded against its cache at version {:#x}, \
                             which this rank does not hold",
                            f.version
                        ),
                    }))
                }
            };
            lineage.slot.set_codec_threads(self.codec_threads);
            self.incoming[src] = Some(Incoming {
                lineage,
                version: f.version,
                missed,
                infos: Vec::new(),
            });
        }
        let inc = self.incoming[src].as_mut().expect("set above");
        if inc.version != f.version {
            return Err(Error::Codec(CodecError::VersionMismatch {
                slot_version: inc.version,
                frame_version: f.version,
            }));
        }
        let info = inc
            .lineage
            .slot
            .chunk(chunk.elems.clone())
            .decode(&f, out)?;
        inc.infos.push(info);
        Ok(())
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
        if let Err(e) = self.decode_frame(src, chunk, bytes, out) {
            self.failures[src] = Some(e);
        }
        self.decode_ns += t.elapsed().as_nanos() as u64;
        Ok(())
    }
}
