//! `CIERA_VERIFY=1`: every shard a call delivers is checked against a hash its sender computed
//! of what it sent, on every rank, for raw calls as for compressed ones; a shard that arrived
//! different is never left in the output. Raw data is otherwise not checksummed on the way
//! (like MPI): the frames of compressed calls carry checksums of their own.
//!
//! Agreement: a check needs every sender's hash (one small allgather), and the ranks must
//! agree on the outcome (a second one: a bitmap of the sources that failed anywhere), so that
//! every rank repairs, or fails, together.

use crate::codec::checksum;
use crate::engine::Engine;
use crate::error::{Error, Result};
use crate::DType;

/// Every rank's `mine` (the same number of words on every rank), in rank order.
pub(super) fn exchange_words(engine: &mut Engine, mine: &[u64]) -> Result<Vec<Vec<u64>>> {
    let words = mine.len();
    let bytes: Vec<u8> = mine.iter().flat_map(|w| w.to_le_bytes()).collect();
    let mut all = vec![0u8; engine.size() * words * 8];
    engine.all_gather(Some(&bytes), &mut all, words * 8, DType::U8)?;
    Ok(all
        .chunks(words * 8)
        .map(|r| {
            r.chunks(8)
                .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")))
                .collect()
        })
        .collect())
}

/// The hash of this rank's shard as it sends it: `send`, or its block of `recv` in place.
pub(super) fn own_hash(engine: &Engine, send: Option<&[u8]>, recv: &[u8], shard: usize) -> u64 {
    checksum::sh64(super::own_shard(engine, send, recv, shard))
}

/// The sources whose shard in `recv` does not hash to what they said (`hashes[src]`), with
/// what this rank found; this rank's own block is not checked.
pub(super) fn mismatches(
    me: usize,
    recv: &[u8],
    shard: usize,
    hashes: &[u64],
    skip: &[bool],
) -> Vec<(usize, String)> {
    (0..hashes.len())
        .filter(|&src| src != me && !skip[src])
        .filter_map(|src| {
            let got = checksum::sh64(&recv[src * shard..(src + 1) * shard]);
            (got != hashes[src]).then(|| {
                (
                    src,
                    format!(
                        "CIERA_VERIFY: rank {src}'s shard hashes to {got:#018x} here, rank {src} \
                         sent {:#018x}",
                        hashes[src]
                    ),
                )
            })
        })
        .collect()
}

/// Bitmap words of `bad` sources, for the agreement exchange.
pub(super) fn bitmap(nranks: usize, bad: impl Iterator<Item = usize>) -> Vec<u64> {
    let mut words = vec![0u64; nranks.div_ceil(64)];
    for src in bad {
        words[src / 64] |= 1 << (src % 64);
    }
    words
}

/// The sources set in any rank's bitmap (`rows[r][at..]`).
pub(super) fn union(rows: &[Vec<u64>], at: usize, nranks: usize) -> Vec<usize> {
    (0..nranks)
        .filter(|&src| rows.iter().any(|r| r[at + src / 64] >> (src % 64) & 1 == 1))
        .collect()
}

/// A raw allgather whose delivered shards are all checked; a call with a shard that arrived
/// different on any rank is redone once on every rank, and fails on every rank (naming the
/// sources) if it is wrong again. Returns whether it was redone.
pub(super) fn raw_all_gather(
    engine: &mut Engine,
    send: Option<&[u8]>,
    recv: &mut [u8],
    count: usize,
    dtype: DType,
) -> Result<bool> {
    let n = engine.size();
    let shard = count * dtype.size();
    let mine = own_hash(engine, send, recv, shard);
    for attempt in 0..2 {
        engine.all_gather(send, recv, count, dtype)?;
        if n == 1 {
            return Ok(false);
        }
        let hashes: Vec<u64> = exchange_words(engine, &[mine])?
            .iter()
            .map(|r| r[0])
            .collect();
        let found = mismatches(engine.rank(), recv, shard, &hashes, &vec![false; n]);
        for (_, why) in &found {
            tracing::error!("{why}");
        }
        let agreed = union(
            &exchange_words(engine, &bitmap(n, found.iter().map(|f| f.0)))?,
            0,
            n,
        );
        if agreed.is_empty() {
            return Ok(attempt > 0);
        }
        if attempt == 0 {
            tracing::error!(
                sources = ?agreed,
                "CIERA_VERIFY: shards arrived corrupted; redoing the call"
            );
            continue;
        }
        let here = found
            .iter()
            .map(|(_, w)| w.as_str())
            .collect::<Vec<_>>()
            .join("; ");
        return Err(Error::Corrupted {
            sources: agreed,
            detail: if here.is_empty() {
                "detected on another rank, twice".into()
            } else {
                format!("twice; here: {here}")
            },
        });
    }
    unreachable!("the loop returns on its second attempt")
}
