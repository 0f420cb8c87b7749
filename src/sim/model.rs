//! Mixture-of-experts transformer models for the FSDP simulator: the shape of a model
//! ([`ModelSpec`]), four published presets, a `key = value` file format, the FSDP units a
//! per-block wrapping makes of it ([`Unit`]) and its forward FLOPs per token.
//!
//! Parameter counting (matches the published totals within about 1%):
//! - attention: q `d*heads*hd`, k and v `d*kv_heads*hd` each, o `heads*hd*d`; no biases (Qwen2's
//!   q/k/v biases, 4,608 per layer, and OLMoE's q/k norms are left out: they are tiny);
//! - one SwiGLU FFN or expert of hidden size `h`: `3*d*h` (gate, up, down);
//! - MoE layers: `experts` routed experts, `shared_experts` shared ones, and a router of
//!   `d*experts`; Qwen2-MoE's one-row shared-expert gate is left out;
//! - dense layers (the first `dense_layers`): one SwiGLU FFN of `dense_hidden`;
//! - norms: `2*d` per layer and `d` for the final one;
//! - embedding `vocab*d`, LM head `vocab*d` unless the embeddings are tied.
//!
//! "Active" parameters follow the published convention (OLMoE's 1.3B, Mixtral's 12.9B): the
//! parameters one token uses, with the embedding table and the LM head counted whole. The
//! embedding lookup is not a matmul, so [`ModelSpec::flops_per_token`] leaves it out.

use std::path::Path;

/// The shape of a (possibly mixture-of-experts) decoder-only transformer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelSpec {
    /// Display name, e.g. `OLMoE-1B-7B`.
    pub name: String,
    /// Transformer blocks.
    pub layers: usize,
    /// Hidden size.
    pub d_model: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads (grouped-query attention); equal to `heads` for multi-head attention.
    pub kv_heads: usize,
    /// Size of one attention head.
    pub head_dim: usize,
    /// Routed experts per MoE layer (0 for a dense model, where `dense_layers == layers`).
    pub experts: usize,
    /// SwiGLU hidden size of one routed expert.
    pub expert_hidden: usize,
    /// Routed experts each token uses.
    pub top_k: usize,
    /// Always-active (shared) experts per MoE layer, DeepSeek style; 0 if none.
    pub shared_experts: usize,
    /// SwiGLU hidden size of one shared expert.
    pub shared_hidden: usize,
    /// Leading layers with a dense FFN instead of a MoE (DeepSeek-MoE: 1).
    pub dense_layers: usize,
    /// SwiGLU hidden size of the dense layers' FFN.
    pub dense_hidden: usize,
    /// Vocabulary size.
    pub vocab: usize,
    /// Whether the LM head shares the embedding table.
    pub tied_embeddings: bool,
}

/// One FSDP unit: the parameters gathered together before use.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unit {
    /// `embed`, `layer.N` or `head`.
    pub name: String,
    /// Parameters the unit holds.
    pub params: u64,
    /// Parameters one token uses (see the module documentation for the embedding).
    pub active_params: u64,
}

/// Canonical preset names, in the order [`ModelSpec::preset_names`] lists them.
const PRESETS: &[&str] = &[
    "olmoe-1b-7b",
    "mixtral-8x7b",
    "deepseek-moe-16b",
    "qwen2-57b-a14b",
];

/// Keys a model file may set, besides `preset`.
const FIELDS: &[&str] = &[
    "name",
    "layers",
    "d_model",
    "heads",
    "kv_heads",
    "head_dim",
    "experts",
    "expert_hidden",
    "top_k",
    "shared_experts",
    "shared_hidden",
    "dense_layers",
    "dense_hidden",
    "vocab",
    "tied_embeddings",
];

/// Keys a model file without a preset must set; the others default (`name` to the file's stem,
/// `kv_heads` to `heads`, the shared and dense fields to 0, `tied_embeddings` to false).
const REQUIRED: &[&str] = &[
    "layers",
    "d_model",
    "heads",
    "head_dim",
    "experts",
    "expert_hidden",
    "top_k",
    "vocab",
];

impl ModelSpec {
    /// The preset called `name` (any case; `_` reads as `-`): `olmoe-1b-7b` (`olmoe`),
    /// `mixtral-8x7b` (`mixtral`), `deepseek-moe-16b` (`deepseek-moe`), `qwen2-57b-a14b`
    /// (`qwen2-moe`). The shapes are those of the public Hugging Face configs.
    pub fn preset(name: &str) -> Option<ModelSpec> {
        let key = name.trim().to_ascii_lowercase().replace('_', "-");
        let spec = match key.as_str() {
            "olmoe-1b-7b" | "olmoe" => ModelSpec {
                name: "OLMoE-1B-7B".into(),
                layers: 16,
                d_model: 2048,
                heads: 16,
                kv_heads: 16,
                head_dim: 128,
                experts: 64,
                expert_hidden: 1024,
                top_k: 8,
                shared_experts: 0,
                shared_hidden: 0,
                dense_layers: 0,
                dense_hidden: 0,
                vocab: 50304,
                tied_embeddings: false,
            },
            "mixtral-8x7b" | "mixtral" => ModelSpec {
                name: "Mixtral-8x7B".into(),
                layers: 32,
                d_model: 4096,
                heads: 32,
                kv_heads: 8,
                head_dim: 128,
                experts: 8,
                expert_hidden: 14336,
                top_k: 2,
                shared_experts: 0,
                shared_hidden: 0,
                dense_layers: 0,
                dense_hidden: 0,
                vocab: 32000,
                tied_embeddings: false,
            },
            "deepseek-moe-16b" | "deepseek-moe" => ModelSpec {
                name: "DeepSeek-MoE-16B".into(),
                layers: 28,
                d_model: 2048,
                heads: 16,
                kv_heads: 16,
                head_dim: 128,
                experts: 64,
                expert_hidden: 1408,
                top_k: 6,
                shared_experts: 2,
                shared_hidden: 1408,
                dense_layers: 1,
                dense_hidden: 10944,
                vocab: 102400,
                tied_embeddings: false,
            },
            "qwen2-57b-a14b" | "qwen2-moe" => ModelSpec {
                name: "Qwen2-57B-A14B".into(),
                layers: 28,
                d_model: 3584,
                heads: 28,
                kv_heads: 4,
                head_dim: 128,
                experts: 64,
                expert_hidden: 2560,
                top_k: 8,
                shared_experts: 1,
                shared_hidden: 20480,
                dense_layers: 0,
                dense_hidden: 0,
                vocab: 151936,
                tied_embeddings: false,
            },
            _ => return None,
        };
        Some(spec)
    }

    /// The canonical preset names (each also has a short alias, see [`ModelSpec::preset`]).
    pub fn preset_names() -> &'static [&'static str] {
        PRESETS
    }

    /// Reads a model file: `key = value` lines, `#` starts a comment, blank lines are skipped.
    /// Keys are the field names of [`ModelSpec`]; booleans are `true`/`false`; a value may be
    /// quoted. An optional `preset = NAME` line, before any other key, starts from that preset
    /// and the later lines override it. Without a preset the fields `layers`, `d_model`,
    /// `heads`, `head_dim`, `experts`, `expert_hidden`, `top_k` and `vocab` are required; `name`
    /// defaults to the file's stem, `kv_heads` to `heads`, the rest to 0 / false. Errors name
    /// the file, and the line and key where there is one; the result is [`validate`]d.
    ///
    /// [`validate`]: ModelSpec::validate
    pub fn from_file(path: &Path) -> Result<ModelSpec, String> {
        let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
        let stem = path
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| "custom".into());
        parse_config(&text, &stem).map_err(|e| format!("{}: {e}", path.display()))
    }

    /// [`ModelSpec::from_file`] on text already read; `name` defaults to `custom`.
    pub fn parse(text: &str) -> Result<ModelSpec, String> {
        parse_config(text, "custom")
    }

    /// Checks the shape is one the counting understands: positive sizes, `kv_heads` dividing
    /// `heads`, `dense_layers <= layers`, and for MoE layers `1 <= top_k <= experts`.
    pub fn validate(&self) -> Result<(), String> {
        for (field, value) in [
            ("layers", self.layers),
            ("d_model", self.d_model),
            ("heads", self.heads),
            ("kv_heads", self.kv_heads),
            ("head_dim", self.head_dim),
            ("vocab", self.vocab),
        ] {
            if value == 0 {
                return Err(format!("`{field}` must be positive"));
            }
        }
        if !self.heads.is_multiple_of(self.kv_heads) {
            return Err(format!(
                "`kv_heads` ({}) must divide `heads` ({})",
                self.kv_heads, self.heads
            ));
        }
        if self.dense_layers > self.layers {
            return Err(format!(
                "`dense_layers` ({}) exceeds `layers` ({})",
                self.dense_layers, self.layers
            ));
        }
        if self.dense_layers > 0 && self.dense_hidden == 0 {
            return Err("`dense_hidden` must be positive when `dense_layers` > 0".into());
        }
        if self.dense_layers < self.layers {
            if self.experts == 0 || self.expert_hidden == 0 {
                return Err("MoE layers need positive `experts` and `expert_hidden` \
                     (a dense model sets `dense_layers` = `layers`)"
                    .into());
            }
            if self.top_k == 0 || self.top_k > self.experts {
                return Err(format!(
                    "`top_k` ({}) must be between 1 and `experts` ({})",
                    self.top_k, self.experts
                ));
            }
            if self.shared_experts > 0 && self.shared_hidden == 0 {
                return Err("`shared_hidden` must be positive when `shared_experts` > 0".into());
            }
        }
        Ok(())
    }

    /// The FSDP units of a per-block wrapping: `embed` (the embedding table; its active count
    /// is the whole table, by the published convention, though the lookup costs no FLOPs),
    /// then `layer.0` .. `layer.{layers-1}` (attention, FFN or MoE with its router, two norms),
    /// then `head` (final norm and LM head; with tied embeddings only the norm, the table
    /// being held by `embed`).
    pub fn units(&self) -> Vec<Unit> {
        let mut units = Vec::with_capacity(self.layers + 2);
        let embed = self.embed_params();
        units.push(Unit {
            name: "embed".into(),
            params: embed,
            active_params: embed,
        });
        for i in 0..self.layers {
            let (params, active_params) = self.layer_params(i);
            units.push(Unit {
                name: format!("layer.{i}"),
                params,
                active_params,
            });
        }
        let head = self.head_params();
        units.push(Unit {
            name: "head".into(),
            params: head,
            active_params: head,
        });
        units
    }

    /// All parameters (the sum of [`ModelSpec::units`]' `params`).
    pub fn total_params(&self) -> u64 {
        self.units().iter().map(|u| u.params).sum()
    }

    /// Parameters one token uses (the sum of [`ModelSpec::units`]' `active_params`; includes
    /// the embedding table, as published figures do).
    pub fn active_params(&self) -> u64 {
        self.units().iter().map(|u| u.active_params).sum()
    }

    /// Forward FLOPs per token for sequences of `seq_len` tokens, the sum of
    /// [`ModelSpec::unit_flops_per_token`]: 2 per active matmul parameter (the embedding
    /// lookup excluded, the LM head matmul included even when tied) plus causal attention,
    /// `2*seq_len*heads*head_dim` per layer (QK^T and AV are `2*seq_len*heads*head_dim` each,
    /// halved for the causal mask). A training step costs about three times this.
    pub fn flops_per_token(&self, seq_len: usize) -> f64 {
        self.unit_flops_per_token(seq_len).iter().sum()
    }

    /// Forward FLOPs per token of each unit of [`ModelSpec::units`], in the same order:
    /// 0 for `embed`, `2*active_params + 2*seq_len*heads*head_dim` for each layer, and
    /// `2*(d_model + vocab*d_model)` for `head` (the LM head matmul, tied or not).
    pub fn unit_flops_per_token(&self, seq_len: usize) -> Vec<f64> {
        let attn = 2.0 * seq_len as f64 * (self.heads * self.head_dim) as f64;
        let mut flops = Vec::with_capacity(self.layers + 2);
        flops.push(0.0);
        for i in 0..self.layers {
            flops.push(2.0 * self.layer_params(i).1 as f64 + attn);
        }
        let d = self.d_model as u64;
        flops.push(2.0 * (d + self.vocab as u64 * d) as f64);
        flops
    }

    /// One line, e.g. `OLMoE-1B-7B: 16 layers, d_model 2048, 64 experts x 1024 (top-8),
    /// 6.92B params (1.28B active)`; shared experts and dense layers are mentioned when present.
    pub fn describe(&self) -> String {
        let mut s = format!(
            "{}: {} layers, d_model {}",
            self.name, self.layers, self.d_model
        );
        if self.dense_layers < self.layers {
            s += &format!(
                ", {} experts x {} (top-{})",
                self.experts, self.expert_hidden, self.top_k
            );
            if self.shared_experts > 0 {
                s += &format!(" + {} shared x {}", self.shared_experts, self.shared_hidden);
            }
        }
        if self.dense_layers > 0 {
            s += &format!(
                ", {} dense layer{} x {}",
                self.dense_layers,
                if self.dense_layers == 1 { "" } else { "s" },
                self.dense_hidden
            );
        }
        s += &format!(
            ", {} params ({} active)",
            format_count(self.total_params()),
            format_count(self.active_params())
        );
        s
    }

    /// Parameters of the embedding table.
    fn embed_params(&self) -> u64 {
        self.vocab as u64 * self.d_model as u64
    }

    /// Parameters of the `head` unit: the final norm, and the LM head unless tied.
    fn head_params(&self) -> u64 {
        let d = self.d_model as u64;
        if self.tied_embeddings {
            d
        } else {
            d + self.embed_params()
        }
    }

    /// `(params, active_params)` of transformer block `i`.
    fn layer_params(&self, i: usize) -> (u64, u64) {
        let d = self.d_model as u64;
        let q_width = (self.heads * self.head_dim) as u64;
        let kv_width = (self.kv_heads * self.head_dim) as u64;
        let attention = 2 * d * q_width + 2 * d * kv_width;
        let norms = 2 * d;
        let swiglu = |hidden: usize| 3 * d * hidden as u64;
        let (ffn, ffn_active) = if i < self.dense_layers {
            let f = swiglu(self.dense_hidden);
            (f, f)
        } else {
            let expert = swiglu(self.expert_hidden);
            let shared = self.shared_experts as u64 * swiglu(self.shared_hidden);
            let router = d * self.experts as u64;
            (
                self.experts as u64 * expert + shared + router,
                self.top_k as u64 * expert + shared + router,
            )
        };
        (attention + norms + ffn, attention + norms + ffn_active)
    }

    /// Sets field `key` (one of [`FIELDS`]) from its text.
    fn set_field(&mut self, key: &str, value: &str) -> Result<(), String> {
        let num = || -> Result<usize, String> {
            value
                .replace('_', "")
                .parse::<usize>()
                .map_err(|_| format!("`{key}` must be a non-negative integer, found `{value}`"))
        };
        match key {
            "name" => self.name = value.to_string(),
            "layers" => self.layers = num()?,
            "d_model" => self.d_model = num()?,
            "heads" => self.heads = num()?,
            "kv_heads" => self.kv_heads = num()?,
            "head_dim" => self.head_dim = num()?,
            "experts" => self.experts = num()?,
            "expert_hidden" => self.expert_hidden = num()?,
            "top_k" => self.top_k = num()?,
            "shared_experts" => self.shared_experts = num()?,
            "shared_hidden" => self.shared_hidden = num()?,
            "dense_layers" => self.dense_layers = num()?,
            "dense_hidden" => self.dense_hidden = num()?,
            "vocab" => self.vocab = num()?,
            "tied_embeddings" => {
                self.tied_embeddings = match value.to_ascii_lowercase().as_str() {
                    "true" => true,
                    "false" => false,
                    _ => {
                        return Err(format!(
                            "`tied_embeddings` must be true or false, found `{value}`"
                        ))
                    }
                }
            }
            _ => return Err(format!("unknown key `{key}`")),
        }
        Ok(())
    }
}

/// A parameter count for people: `6.92B`, `131.07M`, `2.05K`, `512`.
pub fn format_count(n: u64) -> String {
    let f = n as f64;
    if f >= 1e9 {
        format!("{:.2}B", f / 1e9)
    } else if f >= 1e6 {
        format!("{:.2}M", f / 1e6)
    } else if f >= 1e3 {
        format!("{:.2}K", f / 1e3)
    } else {
        n.to_string()
    }
}

/// The parser behind [`ModelSpec::from_file`]; `default_name` names a model without `name`.
fn parse_config(text: &str, default_name: &str) -> Result<ModelSpec, String> {
    let mut base: Option<ModelSpec> = None;
    // (field, value, line number), in file order.
    let mut sets: Vec<(&'static str, String, usize)> = Vec::new();
    for (idx, raw) in text.lines().enumerate() {
        let line_no = idx + 1;
        let line = raw.split('#').next().unwrap_or("").trim();
        if line.is_empty() {
            continue;
        }
        let Some((key, value)) = line.split_once('=') else {
            return Err(format!(
                "line {line_no}: expected `key = value`, found `{line}`"
            ));
        };
        let key = key.trim();
        let value = unquote(value.trim());
        if key == "preset" {
            if base.is_some() || !sets.is_empty() {
                return Err(format!(
                    "line {line_no}: `preset` must come once, before any other key"
                ));
            }
            let spec = ModelSpec::preset(value).ok_or_else(|| {
                format!(
                    "line {line_no}: unknown preset `{value}` (known: {})",
                    PRESETS.join(", ")
                )
            })?;
            base = Some(spec);
            continue;
        }
        let Some(&field) = FIELDS.iter().find(|f| **f == key) else {
            return Err(format!(
                "line {line_no}: unknown key `{key}` (known: preset, {})",
                FIELDS.join(", ")
            ));
        };
        if let Some((_, _, first)) = sets.iter().find(|(f, _, _)| *f == field) {
            return Err(format!(
                "line {line_no}: key `{field}` already set on line {first}"
            ));
        }
        sets.push((field, value.to_string(), line_no));
    }
    let has = |field: &str| sets.iter().any(|(f, _, _)| *f == field);
    let from_preset = base.is_some();
    let mut spec = match base {
        Some(spec) => spec,
        None => {
            if let Some(missing) = REQUIRED.iter().find(|f| !has(f)) {
                return Err(format!(
                    "missing required field `{missing}` (or start from `preset = NAME`)"
                ));
            }
            ModelSpec {
                name: default_name.to_string(),
                layers: 0,
                d_model: 0,
                heads: 0,
                kv_heads: 0,
                head_dim: 0,
                experts: 0,
                expert_hidden: 0,
                top_k: 0,
                shared_experts: 0,
                shared_hidden: 0,
                dense_layers: 0,
                dense_hidden: 0,
                vocab: 0,
                tied_embeddings: false,
            }
        }
    };
    for (field, value, line_no) in &sets {
        spec.set_field(field, value)
            .map_err(|e| format!("line {line_no}: {e}"))?;
    }
    if !from_preset && !has("kv_heads") {
        spec.kv_heads = spec.heads;
    }
    spec.validate()?;
    Ok(spec)
}

/// `value` without one pair of surrounding double or single quotes.
fn unquote(value: &str) -> &str {
    for q in ['"', '\''] {
        if let Some(inner) = value.strip_prefix(q).and_then(|v| v.strip_suffix(q)) {
            return inner;
        }
    }
    value
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    /// Asserts `value` lies within 3% of `expected`.
    fn within_3pct(what: &str, value: u64, expected: f64) {
        let v = value as f64;
        assert!(
            (v - expected).abs() <= 0.03 * expected,
            "{what}: {v} is not within 3% of {expected}"
        );
    }

    #[test]
    fn presets_match_public_totals() {
        for (name, total, active) in [
            ("olmoe-1b-7b", 6.9e9, 1.3e9),
            ("mixtral-8x7b", 46.7e9, 12.9e9),
            ("deepseek-moe-16b", 16.4e9, 2.8e9),
            ("qwen2-57b-a14b", 57.4e9, 14.2e9),
        ] {
            let spec = ModelSpec::preset(name).unwrap();
            spec.validate().unwrap();
            within_3pct(&format!("{name} total"), spec.total_params(), total);
            within_3pct(&format!("{name} active"), spec.active_params(), active);
        }
    }

    #[test]
    fn exact_counts() {
        // Worked by hand from the formulas in the module documentation.
        let olmoe = ModelSpec::preset("olmoe").unwrap();
        let layer = 4 * 2048 * 2048 + 2 * 2048 + 64 * 3 * 2048 * 1024 + 2048 * 64;
        let layer_active = 4 * 2048 * 2048 + 2 * 2048 + 8 * 3 * 2048 * 1024 + 2048 * 64;
        let embed = 50304 * 2048;
        assert_eq!(olmoe.total_params(), 16 * layer + 2 * embed + 2048);
        assert_eq!(olmoe.active_params(), 16 * layer_active + 2 * embed + 2048);
        assert_eq!(olmoe.total_params(), 6_919_096_320);

        let mixtral = ModelSpec::preset("mixtral").unwrap();
        let attn = 2 * 4096 * 4096 + 2 * 4096 * 1024;
        let layer = attn + 2 * 4096 + 8 * 3 * 4096 * 14336 + 4096 * 8;
        assert_eq!(mixtral.total_params(), 32 * layer + 2 * 32000 * 4096 + 4096);

        let ds = ModelSpec::preset("deepseek-moe").unwrap();
        let units = ds.units();
        let attn = 4 * 2048 * 2048;
        assert_eq!(units[1].params, attn + 2 * 2048 + 3 * 2048 * 10944);
        assert_eq!(units[1].active_params, units[1].params);
        let expert = 3 * 2048 * 1408;
        assert_eq!(units[2].params, attn + 2 * 2048 + 66 * expert + 2048 * 64);
        assert_eq!(
            units[2].active_params,
            attn + 2 * 2048 + 8 * expert + 2048 * 64
        );

        let qwen = ModelSpec::preset("QWEN2-MOE").unwrap();
        let d = 3584;
        let layer_active =
            2 * d * d + 2 * d * 512 + 2 * d + 8 * 3 * d * 2560 + 3 * d * 20480 + d * 64;
        assert_eq!(qwen.units()[5].active_params, layer_active);
    }

    #[test]
    fn preset_lookup() {
        assert_eq!(
            ModelSpec::preset_names(),
            &[
                "olmoe-1b-7b",
                "mixtral-8x7b",
                "deepseek-moe-16b",
                "qwen2-57b-a14b"
            ]
        );
        for name in ModelSpec::preset_names() {
            let spec = ModelSpec::preset(name).unwrap();
            assert_eq!(ModelSpec::preset(&name.to_ascii_uppercase()), Some(spec));
        }
        for (alias, canonical) in [
            ("olmoe", "olmoe-1b-7b"),
            ("Mixtral", "mixtral-8x7b"),
            ("deepseek-moe", "deepseek-moe-16b"),
            ("qwen2_moe", "qwen2-57b-a14b"),
        ] {
            assert_eq!(ModelSpec::preset(alias), ModelSpec::preset(canonical));
        }
        assert_eq!(ModelSpec::preset("gpt-5"), None);
    }

    #[test]
    fn units_layout() {
        let spec = ModelSpec::preset("mixtral").unwrap();
        let units = spec.units();
        assert_eq!(units.len(), 34);
        assert_eq!(units[0].name, "embed");
        assert_eq!(units[0].params, 32000 * 4096);
        assert_eq!(units[1].name, "layer.0");
        assert_eq!(units[32].name, "layer.31");
        assert_eq!(units[33].name, "head");
        assert_eq!(units[33].params, 32000 * 4096 + 4096);

        let mut tied = spec.clone();
        tied.tied_embeddings = true;
        assert_eq!(tied.units()[33].params, 4096);
        assert_eq!(tied.total_params(), spec.total_params() - 32000 * 4096);
        // The LM head matmul costs the same, tied or not.
        assert_eq!(tied.flops_per_token(4096), spec.flops_per_token(4096));
    }

    #[test]
    fn flops() {
        let spec = ModelSpec::preset("olmoe").unwrap();
        let per_unit = spec.unit_flops_per_token(4096);
        assert_eq!(per_unit.len(), spec.units().len());
        assert_eq!(per_unit[0], 0.0);
        let layer_active = spec.units()[1].active_params as f64;
        assert_eq!(
            per_unit[1],
            2.0 * layer_active + 2.0 * 4096.0 * 16.0 * 128.0
        );
        let matmul = (spec.active_params() - 50304 * 2048) as f64;
        let expected = 2.0 * matmul + 16.0 * 2.0 * 4096.0 * 16.0 * 128.0;
        assert_eq!(spec.flops_per_token(4096), expected);
        assert!(spec.flops_per_token(8192) > spec.flops_per_token(4096));
    }

    #[test]
    fn describe_line() {
        assert_eq!(
            ModelSpec::preset("olmoe").unwrap().describe(),
            "OLMoE-1B-7B: 16 layers, d_model 2048, 64 experts x 1024 (top-8), \
             6.92B params (1.28B active)"
        );
        let ds = ModelSpec::preset("deepseek-moe").unwrap().describe();
        assert!(
            ds.starts_with(
                "DeepSeek-MoE-16B: 28 layers, d_model 2048, 64 experts x 1408 (top-6) \
                 + 2 shared x 1408, 1 dense layer x 10944, 16.38B params"
            ),
            "{ds}"
        );
        assert_eq!(format_count(512), "512");
        assert_eq!(format_count(131_072_000), "131.07M");
    }

    /// A temporary model file, removed on drop.
    struct TempFile(PathBuf);

    impl TempFile {
        fn new(tag: &str, text: &str) -> TempFile {
            let path = std::env::temp_dir().join(format!(
                "ciera-sim-model-{}-{tag}.model",
                std::process::id()
            ));
            std::fs::write(&path, text).unwrap();
            TempFile(path)
        }
    }

    impl Drop for TempFile {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }

    #[test]
    fn file_with_preset_and_override() {
        let f = TempFile::new(
            "override",
            "# a smaller Mixtral\npreset = Mixtral\n\nlayers = 4   # fewer blocks\n\
             name = \"Mini Mixtral\"\ntied_embeddings = true\n",
        );
        let spec = ModelSpec::from_file(&f.0).unwrap();
        let mut expected = ModelSpec::preset("mixtral-8x7b").unwrap();
        expected.layers = 4;
        expected.name = "Mini Mixtral".into();
        expected.tied_embeddings = true;
        assert_eq!(spec, expected);
    }

    #[test]
    fn file_without_preset() {
        let f = TempFile::new(
            "full",
            "layers = 2\nd_model = 64\nheads = 4\nhead_dim = 16\nexperts = 4\n\
             expert_hidden = 128\ntop_k = 2\nvocab = 1_000\n",
        );
        let spec = ModelSpec::from_file(&f.0).unwrap();
        assert_eq!(
            spec.name,
            format!("ciera-sim-model-{}-full", std::process::id())
        );
        assert_eq!(spec.kv_heads, 4);
        assert_eq!(spec.vocab, 1000);
        assert_eq!(spec.shared_experts, 0);
        assert!(!spec.tied_embeddings);
        // 2 * (attention + norms + experts + router) + embed + head.
        let layer = 4 * 64 * 64 + 2 * 64 + 4 * 3 * 64 * 128 + 64 * 4;
        assert_eq!(spec.total_params(), 2 * layer + 2 * 64_000 + 64);
    }

    #[test]
    fn file_unknown_key() {
        let f = TempFile::new("unknown", "preset = olmoe\n# comment\nlayerz = 3\n");
        let err = ModelSpec::from_file(&f.0).unwrap_err();
        assert!(err.contains("line 3: unknown key `layerz`"), "{err}");
        assert!(err.starts_with(&f.0.display().to_string()), "{err}");
    }

    #[test]
    fn file_missing_field() {
        let f = TempFile::new(
            "missing",
            "layers = 2\nd_model = 64\nheads = 4\nhead_dim = 16\nexperts = 4\ntop_k = 2\n\
             vocab = 1000\n",
        );
        let err = ModelSpec::from_file(&f.0).unwrap_err();
        assert!(
            err.contains("missing required field `expert_hidden`"),
            "{err}"
        );
    }

    #[test]
    fn parse_errors() {
        let err = ModelSpec::parse("layers = 2\npreset = olmoe\n").unwrap_err();
        assert_eq!(err, "line 2: `preset` must come once, before any other key");
        let err = ModelSpec::parse("preset = olmoe\nlayers = many\n").unwrap_err();
        assert_eq!(
            err,
            "line 2: `layers` must be a non-negative integer, found `many`"
        );
        let err = ModelSpec::parse("preset = olmoe\ntop_k = 65\n").unwrap_err();
        assert_eq!(err, "`top_k` (65) must be between 1 and `experts` (64)");
        let err = ModelSpec::parse("preset = olmoe\nlayers = 2\nlayers = 3\n").unwrap_err();
        assert_eq!(err, "line 3: key `layers` already set on line 2");
        let err = ModelSpec::parse("preset = olmoe\njust words\n").unwrap_err();
        assert_eq!(err, "line 2: expected `key = value`, found `just words`");
        let err = ModelSpec::parse("preset = gpt\n").unwrap_err();
        assert!(err.starts_with("line 1: unknown preset `gpt`"), "{err}");
        let err = ModelSpec::parse("preset = olmoe\ntied_embeddings = yes\n").unwrap_err();
        assert_eq!(
            err,
            "line 2: `tied_embeddings` must be true or false, found `yes`"
        );
    }

    #[test]
    fn dense_model() {
        let spec = ModelSpec::parse(
            "layers = 2\nd_model = 64\nheads = 4\nhead_dim = 16\nexperts = 0\n\
             expert_hidden = 0\ntop_k = 0\nvocab = 100\ndense_layers = 2\ndense_hidden = 256\n\
             tied_embeddings = true\n",
        )
        .unwrap();
        let layer = 4 * 64 * 64 + 2 * 64 + 3 * 64 * 256;
        assert_eq!(spec.total_params(), 2 * layer + 100 * 64 + 64);
        assert_eq!(spec.active_params(), spec.total_params());
        assert_eq!(
            spec.describe(),
            "custom: 2 layers, d_model 64, 2 dense layers x 256, 137.79K params (137.79K active)"
        );
    }
}
