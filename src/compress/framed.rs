//! One compressed call: encode at the source, forward, decode into every source's slot, then
//! the status exchange that makes every later decision a function of agreed values, and the
//! repair of a call whose frames did not decode (or verify) somewhere.

use std::time::{Duration, Instant};

use super::group_codec::{GroupCodec, OwnEncoder};
use super::stats::{CallKind, CallReport, SlotKey};
use super::{verify, CompressMode, Compressor, GroupState, STATUS_FIXED_WORDS};
use crate::codec::{FrameInfo, Mode};
use crate::engine::Engine;
use crate::error::Result;
use crate::DType;

impl Compressor {
    #[allow(clippy::too_many_arguments)]
    pub(super) fn framed(
        &mut self,
        engine: &mut Engine,
        key: SlotKey,
        mode: CompressMode,
        send: Option<&[u8]>,
        recv: &mut [u8],
        count: usize,
        dtype: DType,
    ) -> Result<CallReport> {
        let n = engine.size();
        let me = engine.rank();
        let shard_bytes = count * dtype.size();
        let verify = self.config.verify;
        let own_hash = if verify {
            verify::own_hash(engine, send, recv, shard_bytes)
        } else {
            0
        };
        let g = self.groups.get_mut(&key).expect("group exists");
        let filling = g.state == GroupState::Cold;
        if filling {
            for s in g.slots.iter_mut() {
                s.poison();
            }
        }
        let t0 = Instant::now();
        // Compress once, at the source: the engine's encoder worker encodes this rank's chunks
        // against its own slot while the executor sends the frames already made and decodes
        // what arrives into the other slots.
        let (before, rest) = g.slots.split_at_mut(me);
        let (own_slot, after) = rest.split_first_mut().expect("own slot");
        let mut encoder = OwnEncoder {
            slot: own_slot,
            infos: Vec::new(),
            encode_ns: 0,
        };
        let mut codec = GroupCodec::new(before, after, me);
        let r = engine.all_gather_framed(send, recv, count, dtype, &mut encoder, &mut codec);
        let elapsed = t0.elapsed();
        let (own_infos, encode_ns) = (encoder.infos, encoder.encode_ns);
        let GroupCodec {
            mut infos,
            failures,
            decode_ns,
            ..
        } = codec;
        infos[me] = own_infos;
        if let Err(e) = r {
            // The transfer failed (a peer died, an abort): caches are half-updated everywhere.
            for s in g.slots.iter_mut() {
                s.poison();
            }
            g.state = GroupState::Cold;
            return Err(e);
        }
        // Commit every source's slot, or note why it cannot be.
        let mut failed: Vec<Option<String>> = failures
            .into_iter()
            .map(|f| f.map(|e| e.to_string()))
            .collect();
        for (src, slot) in g.slots.iter_mut().enumerate() {
            if failed[src].is_none() {
                if let Err(e) = slot.commit(&infos[src]) {
                    failed[src] = Some(e.to_string());
                }
            }
        }
        // Status exchange: [call ns, encode ns, decode ns, shard hash, failure bitmap words].
        let words = STATUS_FIXED_WORDS + n.div_ceil(64);
        let mut mine = vec![0u64; words];
        mine[0] = elapsed.as_nanos() as u64;
        mine[1] = encode_ns;
        mine[2] = decode_ns;
        mine[3] = own_hash;
        mine[4] = g.pending_raw.take().map_or(0, |d| d.as_nanos() as u64);
        if verify {
            // Hashes must be known before this rank can report a mismatch, so verification
            // takes a first exchange of the hashes alone when it is on.
            let hashes: Vec<u64> = verify::exchange_words(engine, &mine)?
                .iter()
                .map(|r| r[3])
                .collect();
            let skip: Vec<bool> = failed.iter().map(Option::is_some).collect();
            for (src, why) in verify::mismatches(me, recv, shard_bytes, &hashes, &skip) {
                failed[src] = Some(why);
            }
        }
        for (src, f) in failed.iter().enumerate() {
            if f.is_some() {
                mine[STATUS_FIXED_WORDS + src / 64] |= 1 << (src % 64);
            }
        }
        let t_status = Instant::now();
        let status = verify::exchange_words(engine, &mine)?;
        let status_time = t_status.elapsed();
        let slowest = Duration::from_nanos(status.iter().map(|s| s[0]).max().unwrap_or(0));
        let probe = status.iter().map(|s| s[4]).max().unwrap_or(0);
        if probe > 0 && status.iter().all(|s| s[4] > 0) {
            g.raw_time = Some(Duration::from_nanos(probe));
        }
        let mut bad: Vec<usize> = Vec::new();
        for src in 0..n {
            if status
                .iter()
                .any(|s| s[STATUS_FIXED_WORDS + src / 64] >> (src % 64) & 1 == 1)
            {
                bad.push(src);
            }
        }
        // Account.
        let wire: u64 = infos_wire(&infos);
        let raw = (n * shard_bytes) as u64;
        self.stats.raw_bytes += raw;
        self.stats.wire_bytes += wire;
        self.stats.encode_ns += encode_ns;
        self.stats.decode_ns += decode_ns;
        self.stats.transfer_ns += (elapsed.as_nanos() as u64).saturating_sub(encode_ns + decode_ns);
        g.stats.framed_raw_bytes += raw;
        g.stats.framed_wire_bytes += wire;
        g.stats.frames += infos.iter().map(|v| v.len() as u64).sum::<u64>();
        g.stats.hits += infos
            .iter()
            .flatten()
            .filter(|i| i.mode != Mode::Raw)
            .count() as u64;
        if filling {
            self.stats.fill_calls += 1;
            g.stats.fill_calls += 1;
        } else {
            self.stats.delta_calls += 1;
            g.stats.delta_calls += 1;
            g.stats.last_ratio = raw as f64 / wire.max(1) as f64;
        }
        let report = |repaired| CallReport {
            kind: if filling {
                CallKind::Fill
            } else {
                CallKind::Delta
            },
            repaired,
            raw_bytes: raw,
            wire_bytes: wire,
        };
        tracing::info!(
            slot = key.id,
            count = key.count,
            dtype = %key.dtype,
            fill = filling,
            ratio = raw as f64 / wire.max(1) as f64,
            wire_bytes = wire,
            encode_ms = encode_ns as f64 / 1e6,
            decode_ms = decode_ns as f64 / 1e6,
            call_ms = elapsed.as_secs_f64() * 1e3,
            status_ms = status_time.as_secs_f64() * 1e3,
            slowest_ms = slowest.as_secs_f64() * 1e3,
            "compressed allgather"
        );
        if !bad.is_empty() {
            for &src in &bad {
                g.slots[src].poison();
                let why = failed[src]
                    .clone()
                    .unwrap_or_else(|| "failed on another rank".into());
                tracing::error!(
                    source_rank = src,
                    slot = key.id,
                    count = key.count,
                    dtype = %key.dtype,
                    "cache slot of rank {src} failed to decode ({why}); repairing this call raw, next call refills the cache"
                );
            }
            g.stats.repairs += 1;
            self.stats.repairs += 1;
            g.state = GroupState::Cold;
            // Redo raw: the own shard is intact (send buffer, or recv's own block, which no
            // decoder writes), so the result is exact on every rank (and checked again when
            // verifying: a detected corruption never leaves wrong bytes behind).
            self.all_gather_uncompressed(engine, send, recv, count, dtype)?;
            return Ok(report(true));
        }
        // Decide what the next call on this group does, from agreed values only.
        if filling {
            g.slow_streak = 0;
            g.state = GroupState::Warm;
        } else if mode == CompressMode::Auto {
            if let Some(base) = g.raw_time {
                if slowest.as_secs_f64() > 0.95 * base.as_secs_f64() {
                    g.slow_streak += 1;
                } else {
                    g.slow_streak = 0;
                }
                // Two slow deltas in a row: the first after a FILL pays for cold buffers, and
                // one slow call on a shared machine is noise.
                if g.slow_streak >= 2 {
                    g.slow_streak = 0;
                    let until = g.stats.calls + g.backoff;
                    tracing::info!(
                        slot = key.id,
                        delta_ms = slowest.as_secs_f64() * 1e3,
                        raw_ms = base.as_secs_f64() * 1e3,
                        "compression does not pay on this link for this tensor: raw for {} calls",
                        g.backoff
                    );
                    g.state = GroupState::RawFor {
                        until,
                        backoff: (g.backoff * 2).min(1 << 16),
                    };
                }
            }
        }
        Ok(report(false))
    }
}

fn infos_wire(infos: &[Vec<FrameInfo>]) -> u64 {
    infos.iter().flatten().map(|i| i.frame_bytes as u64).sum()
}
