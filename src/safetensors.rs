//! A small reader for safetensors files (8-byte LE header length, JSON header, raw data).
//! Only what `ciera analyze` and the trace replays need: names, dtypes, shapes and bytes.
#![forbid(unsafe_code)]

use std::collections::BTreeMap;
use std::path::Path;

use crate::error::{Error, Result};
use crate::DType;

#[derive(Clone, Debug)]
pub struct TensorInfo {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<usize>,
    /// Byte range within the data section.
    pub start: usize,
    pub end: usize,
}

impl TensorInfo {
    pub fn elements(&self) -> usize {
        self.shape.iter().product()
    }
}

/// A whole safetensors file in memory.
pub struct SafeTensors {
    pub path: String,
    pub metadata: BTreeMap<String, String>,
    /// Tensors in file order.
    pub tensors: Vec<TensorInfo>,
    data: Vec<u8>,
    data_start: usize,
}

impl SafeTensors {
    pub fn open(path: &Path) -> Result<SafeTensors> {
        let p = path.display().to_string();
        let bytes = std::fs::read(path).map_err(|e| Error::Io {
            what: format!("reading {p}"),
            source: e,
        })?;
        SafeTensors::parse(p, bytes)
    }

    pub fn parse(path: String, bytes: Vec<u8>) -> Result<SafeTensors> {
        let fmt = |detail: String| Error::Format {
            path: path.clone(),
            detail,
        };
        if bytes.len() < 8 {
            return Err(fmt(format!(
                "not a safetensors file: {} bytes, too short for a header",
                bytes.len()
            )));
        }
        let hlen = u64::from_le_bytes(bytes[..8].try_into().unwrap());
        if hlen > (bytes.len() - 8) as u64 || hlen > 100 << 20 {
            return Err(fmt(format!(
                "not a safetensors file: header length {hlen} does not fit in {} bytes",
                bytes.len()
            )));
        }
        let data_start = 8 + hlen as usize;
        let header: serde_json::Value = serde_json::from_slice(&bytes[8..data_start])
            .map_err(|e| fmt(format!("not a safetensors file: header is not JSON ({e})")))?;
        let obj = header
            .as_object()
            .ok_or_else(|| fmt("header is not a JSON object".into()))?;
        let data_len = bytes.len() - data_start;
        let mut tensors = Vec::new();
        let mut metadata = BTreeMap::new();
        for (name, v) in obj {
            if name == "__metadata__" {
                if let Some(m) = v.as_object() {
                    for (k, v) in m {
                        metadata.insert(k.clone(), v.as_str().unwrap_or_default().to_string());
                    }
                }
                continue;
            }
            let bad = |what: &str| fmt(format!("tensor '{name}': {what}"));
            let dt = v
                .get("dtype")
                .and_then(|d| d.as_str())
                .ok_or_else(|| bad("missing dtype"))?;
            let dtype = DType::from_safetensors(dt)
                .ok_or_else(|| bad(&format!("unsupported dtype {dt}")))?;
            let shape: Vec<usize> = v
                .get("shape")
                .and_then(|s| s.as_array())
                .ok_or_else(|| bad("missing shape"))?
                .iter()
                .map(|d| d.as_u64().map(|d| d as usize))
                .collect::<Option<_>>()
                .ok_or_else(|| bad("shape is not a list of integers"))?;
            let offs = v
                .get("data_offsets")
                .and_then(|s| s.as_array())
                .ok_or_else(|| bad("missing data_offsets"))?;
            let (start, end) = match (
                offs.first().and_then(|x| x.as_u64()),
                offs.get(1).and_then(|x| x.as_u64()),
            ) {
                (Some(a), Some(b)) if offs.len() == 2 => (a as usize, b as usize),
                _ => return Err(bad("data_offsets is not [start, end]")),
            };
            let want = shape
                .iter()
                .try_fold(dtype.size(), |a, &d| a.checked_mul(d));
            if start > end || end > data_len || want != Some(end - start) {
                return Err(bad(&format!(
                    "data_offsets [{start}, {end}] do not match shape {shape:?} of {dt} in {data_len} data bytes"
                )));
            }
            tensors.push(TensorInfo {
                name: name.clone(),
                dtype,
                shape,
                start,
                end,
            });
        }
        tensors.sort_by_key(|t| t.start);
        Ok(SafeTensors {
            path,
            metadata,
            tensors,
            data: bytes,
            data_start,
        })
    }

    pub fn get(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }

    pub fn bytes(&self, t: &TensorInfo) -> &[u8] {
        &self.data[self.data_start + t.start..self.data_start + t.end]
    }
}
