//! The geometry of one call: the one place where a block is cut in chunks (the executor, the
//! payloads and the encoder worker all ask a [`Layout`]).

use std::ops::Range;

use crate::algo::Unit;
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
