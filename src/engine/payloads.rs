//! Where a call's bytes live, kept apart from the schedule (what moves where) and the executor
//! (how it moves). The executor only asks a [`Payloads`] for "the bytes of unit u", "where the
//! incoming bytes of unit u go" and "can a peer read these bytes itself".
//!
//! - [`RawPayloads`]: the payload of a unit *is* its slice of the user's buffers. Own chunks are
//!   sent straight from the send buffer, received chunks land at their final place in the recv
//!   buffer and are forwarded from there: no staging copy.
//! - [`FramedPayloads`]: the hook for a codec. This rank's chunks are encoded, in order, by the
//!   engine's encoder worker into frames (their length is known only once made); received
//!   frames are kept here whole, forwarded unchanged (cut-through, as they arrive), and handed
//!   to the decoder, which writes the chunk into the recv buffer, once complete.
//!
//! Both hold host memory. A device implementation (frames and buffers in GPU memory, staged or
//! moved by a device link) is a third implementation of the same trait: the schedules, the
//! executor and the wire format stay as they are.

use std::ops::Range;
use std::sync::mpsc::Receiver;

use ciera_transport::copy::{copy_fast, copy_streaming};

use super::layout::Layout;
use crate::algo::Unit;
use crate::error::{Error, Result};
use crate::mem::{Location, PeerSpan};
use crate::DType;

/// What the executor needs from wherever the bytes live.
pub trait Payloads {
    /// Payload format code put in message headers (0 = raw).
    fn format(&self) -> u8;
    /// Where the payload bytes live; the host executor moves host memory only.
    fn location(&self) -> Location {
        Location::Host
    }
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
    /// The schedule is known: `sends_of(u)` is how many peers unit `u` goes to from here.
    /// Called once, before anything moves.
    fn start(&mut self, _sends_of: &dyn Fn(Unit) -> usize) {}
    /// One send of `unit` went out in full (a unit may go to several peers).
    fn sent(&mut self, _unit: Unit) {}
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
    /// Whether a same-host peer may read the payload bytes itself: only memory that stays at
    /// one address, unchanged, until the call returns (the user's buffers; not frames, whose
    /// vectors the engine reuses).
    fn peer_readable(&self) -> bool {
        false
    }
    /// Where a same-host peer can read bytes `[at, at + len)` of `unit` itself, if it may
    /// ([`Payloads::peer_readable`]), named as a reference segment will name it.
    fn peer_span(&self, _unit: Unit, _at: usize, _len: usize) -> Option<PeerSpan> {
        None
    }
    /// Whether some of the bytes this call sends lie in a shared buffer
    /// ([`crate::mem::SharedBuffer`]): those go by reference whatever the chooser says.
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
    fn peer_readable(&self) -> bool {
        // User buffers: the caller may not touch them until the call returns.
        true
    }
    fn peer_span(&self, unit: Unit, at: usize, len: usize) -> Option<PeerSpan> {
        Some(PeerSpan::of_host(&self.bytes(unit)[at..at + len]))
    }
    fn uses_shared_buffers(&self) -> bool {
        let shared = |b: &[u8]| PeerSpan::of_host(b).is_shared();
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

impl ChunkRef {
    pub fn new(layout: &Layout, dtype: DType, unit: Unit) -> ChunkRef {
        ChunkRef {
            src: unit.src as usize,
            chunk: unit.chunk as usize,
            elems: layout.chunk_elems(unit.chunk as usize),
            dtype,
        }
    }
}

/// The encoding half of a codec fused into the allgather pipeline (the hook for compression).
/// The engine runs it on its encoder worker thread, which encodes this rank's chunks in order
/// while the executor sends the frames already made (compress once, at the source).
pub trait FrameEncoder: Send {
    /// Encode `raw` (this rank's chunk `chunk.chunk`) into `out` (empty on entry). The frame
    /// may be any length; it travels in the message header.
    fn encode(&mut self, chunk: &ChunkRef, raw: &[u8], out: &mut Vec<u8>) -> Result<()>;
}

/// The decoding half: what the executor asks of a codec on the receiving side.
///
/// [`FrameCodec::decode`] is called for every other rank's chunk once its frame has arrived in
/// full. The same frame bytes are forwarded, unchanged, to the next rank of the schedule, so a
/// codec must make frames every receiver can decode (e.g. against state all ranks share).
pub trait FrameCodec {
    /// Nonzero code naming the frame format; goes in every message header, so ranks running
    /// different codecs (or one raw) fail with `CallMismatch`.
    fn format(&self) -> u8;
    /// Longest frame the codec can make for `raw_len` bytes; longer announced frames are
    /// refused before any memory is reserved for them.
    fn max_frame_len(&self, raw_len: usize) -> usize;
    /// Decode `frame` (chunk `chunk.chunk` of rank `chunk.src`) into `out`, which is exactly
    /// that chunk's bytes in the recv buffer.
    fn decode(&mut self, chunk: &ChunkRef, frame: &[u8], out: &mut [u8]) -> Result<()>;
}

/// A frame made by the encoder worker: chunk index and frame bytes (or why it failed).
pub type OwnFrame = (usize, Result<Vec<u8>>);

/// Codec allgather: frames live in engine-owned vectors; this rank's arrive from the encoder
/// worker. A frame is let go as soon as it is no longer needed (sent to every peer the
/// schedule sends it to, and, for another rank's, decoded), so a call holds only the frames in
/// flight, whatever the size of the tensor; a few buffers are kept for the next frames.
pub struct FramedPayloads<'a> {
    layout: Layout,
    dtype: DType,
    /// This rank's raw shard when out of place; None when it is already in `recv`.
    send: Option<&'a [u8]>,
    recv: &'a mut [u8],
    codec: &'a mut dyn FrameCodec,
    frames: &'a mut Vec<Vec<u8>>,
    own: Receiver<OwnFrame>,
    /// Own frames that came before the one asked for (an algorithm may send out of order).
    parked: Vec<Option<Result<Vec<u8>>>>,
    /// Per unit: sends still to go, and whether it still has to be decoded.
    sends_left: Vec<u32>,
    undecoded: Vec<bool>,
    /// Buffers of frames let go, for the next frames to arrive.
    spare: &'a mut Vec<Vec<u8>>,
    own_copy: OwnCopy,
}

/// Buffers a framed call keeps for the next frames (one chunk each), beyond those in flight.
const SPARE_FRAMES: usize = 8;

impl<'a> FramedPayloads<'a> {
    #[allow(clippy::too_many_arguments)] // the call's buffers, its codec and the engine's frame stores
    pub fn new(
        layout: Layout,
        dtype: DType,
        send: Option<&'a [u8]>,
        recv: &'a mut [u8],
        codec: &'a mut dyn FrameCodec,
        frames: &'a mut Vec<Vec<u8>>,
        spare: &'a mut Vec<Vec<u8>>,
        own: Receiver<OwnFrame>,
    ) -> FramedPayloads<'a> {
        let units = layout.nranks * layout.nchunks;
        frames.truncate(units);
        for f in frames.iter_mut() {
            let buf = std::mem::take(f);
            if spare.len() < SPARE_FRAMES && buf.capacity() > 0 {
                spare.push(buf);
            }
        }
        frames.resize_with(units, Vec::new);
        // Until `start`, nothing is let go.
        let sends_left = vec![u32::MAX; units];
        let undecoded = (0..units)
            .map(|i| i / layout.nchunks != layout.rank)
            .collect();
        FramedPayloads {
            sends_left,
            undecoded,
            spare,
            layout,
            dtype,
            send,
            recv,
            codec,
            frames,
            own,
            parked: (0..layout.nchunks).map(|_| None).collect(),
            own_copy: OwnCopy::default(),
        }
    }

    /// Let the frame of unit index `i` go if nothing needs it any more.
    fn maybe_release(&mut self, i: usize) {
        if self.sends_left[i] == 0 && !self.undecoded[i] {
            let mut buf = std::mem::take(&mut self.frames[i]);
            if self.spare.len() < SPARE_FRAMES {
                buf.clear();
                self.spare.push(buf);
            }
        }
    }

    /// The frame of this rank's `chunk`, waiting for the worker if it is not made yet.
    fn own_frame(&mut self, chunk: usize) -> Result<Vec<u8>> {
        loop {
            if let Some(f) = self.parked[chunk].take() {
                return f;
            }
            let (c, f) = self.own.recv().map_err(|_| Error::Aborted {
                detail: format!("the encoder worker stopped before chunk {chunk}"),
            })?;
            if c == chunk {
                return f;
            }
            self.parked[c] = Some(f);
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
        let frame = self.own_frame(chunk)?;
        if frame.len() > u32::MAX as usize {
            return Err(Error::LengthMismatch {
                what: "encoded frame length (must fit in u32)",
                expected: u32::MAX as usize,
                found: frame.len(),
            });
        }
        let i = self.layout.unit_index(Unit::new(self.layout.rank, chunk));
        self.frames[i] = frame;
        Ok(self.frames[i].len())
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
            return Err(Error::PeerFailed {
                peer,
                detail: format!(
                    "corrupt stream from rank {peer}: it announced a {len}-byte frame for chunk \
                     {} of rank {} ({raw_len} raw bytes; the codec makes at most {max})",
                    unit.chunk, unit.src
                ),
            });
        }
        let i = self.layout.unit_index(unit);
        let mut buf = self.spare.pop().unwrap_or_default();
        buf.clear();
        buf.resize(len, 0);
        self.frames[i] = buf;
        Ok(())
    }

    fn dest(&mut self, unit: Unit) -> &mut [u8] {
        let i = self.layout.unit_index(unit);
        &mut self.frames[i]
    }

    fn finish_recv(&mut self, unit: Unit) -> Result<()> {
        let cref = ChunkRef::new(&self.layout, self.dtype, unit);
        let i = self.layout.unit_index(unit);
        let out = &mut self.recv[self.layout.recv_range(unit)];
        self.codec.decode(&cref, &self.frames[i], out)?;
        self.undecoded[i] = false;
        self.maybe_release(i);
        Ok(())
    }

    fn start(&mut self, sends_of: &dyn Fn(Unit) -> usize) {
        for (i, left) in self.sends_left.iter_mut().enumerate() {
            let unit = Unit::new(i / self.layout.nchunks, i % self.layout.nchunks);
            *left = sends_of(unit) as u32;
        }
    }

    fn sent(&mut self, unit: Unit) {
        let i = self.layout.unit_index(unit);
        self.sends_left[i] = self.sends_left[i].saturating_sub(1);
        self.maybe_release(i);
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
