//! Where a call's bytes live, kept apart from the schedule (what moves where) and the executor
//! (how it moves). The executor only asks a [`Payloads`] for "the bytes of unit u" and "where
//! the incoming bytes of unit u go".
//!
//! - [`RawPayloads`]: the payload of a unit *is* its slice of the user's buffers. Own chunks are
//!   sent straight from the send buffer, received chunks land at their final place in the recv
//!   buffer and are forwarded from there: no staging copy.
//! - [`FramedPayloads`]: the hook for a codec. This rank's chunks are encoded on demand into
//!   frames owned here (their length is known only once made); received frames are kept here
//!   whole, forwarded unchanged (cut-through, as they arrive), and handed to the decoder, which
//!   writes the chunk into the recv buffer, once complete.

use std::ops::Range;

use ciera_transport::copy::{copy_fast, copy_streaming};
use ciera_transport::shared_region_of;

use crate::algo::Unit;
use crate::error::{Error, Result};
use crate::DType;

/// Geometry of one call: elements per rank, chunking, element size.
#[derive(Clone, Copy, Debug)]
pub struct Layout {
    pub rank: usize,
    pub nranks: usize,
    pub count: usize,
    pub elem_size: usize,
    /// Elements per chunk (the last chunk of a block may be shorter; >= 1).
    pub chunk_elems: usize,
    pub nchunks: usize,
}

impl Layout {
    pub fn new(
        rank: usize,
        nranks: usize,
        count: usize,
        dtype: DType,
        chunk_bytes: usize,
    ) -> Layout {
        let elem_size = dtype.size();
        let chunk_elems = (chunk_bytes / elem_size).max(1);
        // A zero-count call still exchanges one empty chunk per block: the headers check that
        // every rank made the same call.
        let nchunks = count.div_ceil(chunk_elems).max(1);
        Layout {
            rank,
            nranks,
            count,
            elem_size,
            chunk_elems,
            nchunks,
        }
    }

    pub fn block_bytes(&self) -> usize {
        self.count * self.elem_size
    }

    /// Element range of chunk `chunk` within its block.
    pub fn chunk_elems(&self, chunk: usize) -> Range<usize> {
        let start = (chunk * self.chunk_elems).min(self.count);
        let end = ((chunk + 1) * self.chunk_elems).min(self.count);
        start..end
    }

    /// Byte range of chunk `chunk` of a block, relative to the block.
    pub fn chunk_range(&self, chunk: usize) -> Range<usize> {
        let e = self.chunk_elems(chunk);
        e.start * self.elem_size..e.end * self.elem_size
    }

    /// Byte range of `unit` in the recv buffer.
    pub fn recv_range(&self, unit: Unit) -> Range<usize> {
        let base = unit.src as usize * self.block_bytes();
        let r = self.chunk_range(unit.chunk as usize);
        base + r.start..base + r.end
    }

    pub fn unit_index(&self, unit: Unit) -> usize {
        unit.src as usize * self.nchunks + unit.chunk as usize
    }
}

/// What the executor needs from wherever the bytes live.
pub trait Payloads {
    /// Payload format code put in message headers (0 = raw).
    fn format(&self) -> u8;
    /// Whether this rank's own units are ready without [`Payloads::produce`] (raw bytes).
    fn own_ready(&self) -> bool;
    /// Make this rank's payload for `chunk` (encode it); returns its length.
    fn produce(&mut self, chunk: usize) -> Result<usize>;
    /// Length of a unit's payload: own (after `produce`), or as announced by its header.
    fn len(&self, unit: Unit) -> usize;
    /// The payload bytes of `unit`, `[0, len)`; for a unit still arriving, only the prefix
    /// that has arrived is meaningful.
    fn bytes(&self, unit: Unit) -> &[u8];
    /// A header announced `len` payload bytes for `unit` from `peer`: check and make room.
    fn begin_recv(&mut self, peer: usize, unit: Unit, len: usize) -> Result<()>;
    /// Where the incoming bytes of `unit` go, `[0, len)`.
    fn dest(&mut self, unit: Unit) -> &mut [u8];
    /// All of `unit` has arrived.
    fn finish_recv(&mut self, unit: Unit) -> Result<()>;
    /// Do a slice of local work that needs no peer (copying this rank's own shard into the
    /// output), when the executor would otherwise wait. Returns whether it did any.
    fn background(&mut self) -> bool {
        false
    }
    /// Finish all local work; called once, after the last unit moved.
    fn finish(&mut self) {}
    /// Copy into the output with non-temporal stores (`ciera_transport::copy`): the call's
    /// output is bigger than the caches. Set before the call runs.
    fn set_streaming(&mut self, _on: bool) {}
    /// Whether `bytes(unit)` stays at one address, unchanged, until the call returns, so a
    /// same-host peer may copy it straight out of this process (single-copy shm path).
    fn stable_bytes(&self) -> bool {
        false
    }
    /// Whether some of the bytes this call sends lie in a shared buffer
    /// ([`crate::SharedBuffer`]): those go by reference whatever the chooser says.
    fn uses_shared_buffers(&self) -> bool {
        false
    }
}

/// Bytes of the own-shard copy done per idle turn: small enough not to delay the next poll
/// of the links much, big enough to be an efficient memcpy.
const OWN_COPY_SLICE: usize = 256 * 1024;

/// The copy of this rank's shard from `send` into its place in `recv`, done piecewise while
/// the executor waits for peers instead of before the first byte goes out.
#[derive(Clone, Copy, Debug, Default)]
struct OwnCopy {
    done: usize,
    /// Non-temporal stores (`ciera_transport::copy`): the output is bigger than the caches.
    streaming: bool,
}

impl OwnCopy {
    fn step(&mut self, layout: &Layout, send: Option<&[u8]>, recv: &mut [u8], all: bool) -> bool {
        let Some(send) = send else { return false };
        if self.done >= send.len() {
            return false;
        }
        let end = if all {
            send.len()
        } else {
            (self.done + OWN_COPY_SLICE).min(send.len())
        };
        let base = layout.rank * layout.block_bytes();
        let (dst, src) = (
            &mut recv[base + self.done..base + end],
            &send[self.done..end],
        );
        if self.streaming {
            copy_streaming(dst, src);
        } else {
            copy_fast(dst, src);
        }
        self.done = end;
        true
    }
}

/// Raw allgather: payloads are slices of the user's buffers.
pub struct RawPayloads<'a> {
    layout: Layout,
    /// This rank's shard when out of place; None when it is already in `recv`.
    send: Option<&'a [u8]>,
    recv: &'a mut [u8],
    own_copy: OwnCopy,
}

impl<'a> RawPayloads<'a> {
    /// With `send`, its bytes are copied into `recv` during the call (see `background`).
    pub fn new(layout: Layout, send: Option<&'a [u8]>, recv: &'a mut [u8]) -> RawPayloads<'a> {
        RawPayloads {
            layout,
            send,
            recv,
            own_copy: OwnCopy::default(),
        }
    }
}

impl Payloads for RawPayloads<'_> {
    fn stable_bytes(&self) -> bool {
        // User buffers: the caller may not touch them until the call returns.
        true
    }
    fn uses_shared_buffers(&self) -> bool {
        let shared = |b: &[u8]| shared_region_of(b.as_ptr() as u64, b.len()).is_some();
        self.send.is_some_and(shared) || shared(self.recv)
    }
    fn format(&self) -> u8 {
        0
    }

    fn own_ready(&self) -> bool {
        true
    }

    fn produce(&mut self, chunk: usize) -> Result<usize> {
        Ok(self.layout.chunk_range(chunk).len())
    }

    fn len(&self, unit: Unit) -> usize {
        self.layout.chunk_range(unit.chunk as usize).len()
    }

    fn bytes(&self, unit: Unit) -> &[u8] {
        match self.send {
            Some(send) if unit.src as usize == self.layout.rank => {
                &send[self.layout.chunk_range(unit.chunk as usize)]
            }
            _ => &self.recv[self.layout.recv_range(unit)],
        }
    }

    fn begin_recv(&mut self, peer: usize, unit: Unit, len: usize) -> Result<()> {
        let expected = self.len(unit);
        if len != expected {
            return Err(Error::CallMismatch {
                detail: format!(
                    "rank {peer} sent {len} bytes for chunk {} of rank {}'s block; this rank \
                     (rank {}) expects {expected}",
                    unit.chunk, unit.src, self.layout.rank
                ),
            });
        }
        Ok(())
    }

    fn dest(&mut self, unit: Unit) -> &mut [u8] {
        let r = self.layout.recv_range(unit);
        &mut self.recv[r]
    }

    fn finish_recv(&mut self, _unit: Unit) -> Result<()> {
        Ok(())
    }

    fn background(&mut self) -> bool {
        self.own_copy
            .step(&self.layout, self.send, self.recv, false)
    }

    fn finish(&mut self) {
        self.own_copy.step(&self.layout, self.send, self.recv, true);
    }

    fn set_streaming(&mut self, on: bool) {
        self.own_copy.streaming = on;
    }
}

/// Which chunk a codec is asked to encode or decode.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChunkRef {
    /// The rank whose shard this chunk is part of.
    pub src: usize,
    /// Chunk index within that shard.
    pub chunk: usize,
    /// Its element range within the shard.
    pub elems: Range<usize>,
    pub dtype: DType,
}

/// A frame codec fused into the allgather pipeline (the hook for compression).
///
/// The executor calls [`FrameCodec::encode`] for each of this rank's chunks when it is about
/// to send it (the frame may be any length; the length travels in the message header), and
/// [`FrameCodec::decode`] for every other rank's chunk once its frame has arrived in full. The
/// same frame bytes are forwarded, unchanged, to the next rank of the schedule, so a codec
/// must make frames every receiver can decode (e.g. against state all ranks share).
pub trait FrameCodec {
    /// Nonzero code naming the frame format; goes in every message header, so ranks running
    /// different codecs (or one raw) fail with `CallMismatch`.
    fn format(&self) -> u8;
    /// Longest frame the codec can make for `raw_len` bytes; longer announced frames are
    /// refused before any memory is reserved for them.
    fn max_frame_len(&self, raw_len: usize) -> usize;
    /// Encode `raw` (this rank's chunk `chunk.chunk`) into `out` (empty on entry).
    fn encode(&mut self, chunk: &ChunkRef, raw: &[u8], out: &mut Vec<u8>) -> Result<()>;
    /// Decode `frame` (chunk `chunk.chunk` of rank `chunk.src`) into `out`, which is exactly
    /// that chunk's bytes in the recv buffer.
    fn decode(&mut self, chunk: &ChunkRef, frame: &[u8], out: &mut [u8]) -> Result<()>;
}

/// Codec allgather: frames live in executor-owned vectors (reused across calls).
pub struct FramedPayloads<'a> {
    layout: Layout,
    dtype: DType,
    /// This rank's raw shard when out of place; None when it is already in `recv`.
    send: Option<&'a [u8]>,
    recv: &'a mut [u8],
    codec: &'a mut dyn FrameCodec,
    frames: &'a mut Vec<Vec<u8>>,
    own_copy: OwnCopy,
}

impl<'a> FramedPayloads<'a> {
    pub fn new(
        layout: Layout,
        dtype: DType,
        send: Option<&'a [u8]>,
        recv: &'a mut [u8],
        codec: &'a mut dyn FrameCodec,
        frames: &'a mut Vec<Vec<u8>>,
    ) -> FramedPayloads<'a> {
        let units = layout.nranks * layout.nchunks;
        if frames.len() < units {
            frames.resize_with(units, Vec::new);
        }
        for f in frames.iter_mut() {
            f.clear();
        }
        FramedPayloads {
            layout,
            dtype,
            send,
            recv,
            codec,
            frames,
            own_copy: OwnCopy::default(),
        }
    }

    fn chunk_ref(&self, unit: Unit) -> ChunkRef {
        ChunkRef {
            src: unit.src as usize,
            chunk: unit.chunk as usize,
            elems: self.layout.chunk_elems(unit.chunk as usize),
            dtype: self.dtype,
        }
    }
}

impl Payloads for FramedPayloads<'_> {
    fn format(&self) -> u8 {
        self.codec.format()
    }

    fn own_ready(&self) -> bool {
        false
    }

    fn produce(&mut self, chunk: usize) -> Result<usize> {
        let unit = Unit::new(self.layout.rank, chunk);
        let cref = self.chunk_ref(unit);
        let range = self.layout.chunk_range(chunk);
        let raw = match self.send {
            Some(send) => &send[range],
            None => &self.recv[self.layout.recv_range(unit)],
        };
        let i = self.layout.unit_index(unit);
        let out = &mut self.frames[i];
        out.clear();
        self.codec.encode(&cref, raw, out)?;
        if out.len() > u32::MAX as usize {
            return Err(Error::LengthMismatch {
                what: "encoded frame length (must fit in u32)",
                expected: u32::MAX as usize,
                found: out.len(),
            });
        }
        Ok(out.len())
    }

    fn len(&self, unit: Unit) -> usize {
        self.frames[self.layout.unit_index(unit)].len()
    }

    fn bytes(&self, unit: Unit) -> &[u8] {
        &self.frames[self.layout.unit_index(unit)]
    }

    fn begin_recv(&mut self, peer: usize, unit: Unit, len: usize) -> Result<()> {
        let raw_len = self.layout.chunk_range(unit.chunk as usize).len();
        let max = self.codec.max_frame_len(raw_len);
        if len > max {
            return Err(Error::corrupt(
                "frame length",
                format!(
                    "rank {peer} announced a {len}-byte frame for chunk {} of rank {} \
                     ({raw_len} raw bytes; the codec makes at most {max})",
                    unit.chunk, unit.src
                ),
            ));
        }
        let i = self.layout.unit_index(unit);
        self.frames[i].resize(len, 0);
        Ok(())
    }

    fn dest(&mut self, unit: Unit) -> &mut [u8] {
        let i = self.layout.unit_index(unit);
        &mut self.frames[i]
    }

    fn finish_recv(&mut self, unit: Unit) -> Result<()> {
        let cref = self.chunk_ref(unit);
        let i = self.layout.unit_index(unit);
        let out = &mut self.recv[self.layout.recv_range(unit)];
        self.codec.decode(&cref, &self.frames[i], out)
    }

    fn background(&mut self) -> bool {
        self.own_copy
            .step(&self.layout, self.send, self.recv, false)
    }

    fn finish(&mut self) {
        self.own_copy.step(&self.layout, self.send, self.recv, true);
    }

    fn set_streaming(&mut self, on: bool) {
        self.own_copy.streaming = on;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_cuts_blocks_in_element_aligned_chunks() {
        let l = Layout::new(1, 3, 10, DType::F32, 16); // 4 elements per chunk
        assert_eq!(l.nchunks, 3);
        assert_eq!(l.chunk_range(0), 0..16);
        assert_eq!(l.chunk_range(2), 32..40);
        assert_eq!(l.recv_range(Unit::new(2, 1)), 80 + 16..80 + 32);
        let empty = Layout::new(0, 2, 0, DType::BF16, 1 << 20);
        assert_eq!(empty.nchunks, 1);
        assert_eq!(empty.chunk_range(0), 0..0);
        // A chunk size below one element still makes progress.
        let tiny = Layout::new(0, 2, 3, DType::F64, 1);
        assert_eq!((tiny.chunk_elems, tiny.nchunks), (1, 3));
    }
}
