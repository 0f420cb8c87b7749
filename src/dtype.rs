//! Element types. The numbering is NCCL's `ncclDataType_t` (nccl.h), so the C ABI, the wire
//! format and the NCCL interposer all use one set of numbers.
#![forbid(unsafe_code)]

use std::fmt;

use crate::coded_enum::coded_enum;

coded_enum! {
    #[repr(u8)]
    /// An element type, numbered as `ncclDataType_t`.
    pub enum DType {
        I8 = 0,
        U8 = 1,
        I32 = 2,
        U32 = 3,
        I64 = 4,
        U64 = 5,
        F16 = 6,
        F32 = 7,
        F64 = 8,
        BF16 = 9,
        F8E4M3 = 10,
        F8E5M2 = 11,
    }
}

impl DType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::I8 | DType::U8 | DType::F8E4M3 | DType::F8E5M2 => 1,
            DType::F16 | DType::BF16 => 2,
            DType::I32 | DType::U32 | DType::F32 => 4,
            DType::I64 | DType::U64 | DType::F64 => 8,
        }
    }

    /// Whether the codec compresses this type (the others travel raw and exact).
    pub fn is_compressible(self) -> bool {
        matches!(self, DType::BF16 | DType::F16 | DType::F32)
    }

    /// The safetensors spelling ("BF16", "F32", ...).
    pub fn from_safetensors(s: &str) -> Option<DType> {
        Some(match s {
            "I8" => DType::I8,
            "U8" => DType::U8,
            "I32" => DType::I32,
            "U32" => DType::U32,
            "I64" => DType::I64,
            "U64" => DType::U64,
            "F16" => DType::F16,
            "F32" => DType::F32,
            "F64" => DType::F64,
            "BF16" => DType::BF16,
            "F8_E4M3" => DType::F8E4M3,
            "F8_E5M2" => DType::F8E5M2,
            _ => return None,
        })
    }

    /// Short lower-case name, as `ciera perf` prints it (nccl-tests style).
    pub fn name(self) -> &'static str {
        match self {
            DType::I8 => "int8",
            DType::U8 => "uint8",
            DType::I32 => "int32",
            DType::U32 => "uint32",
            DType::I64 => "int64",
            DType::U64 => "uint64",
            DType::F16 => "half",
            DType::F32 => "float",
            DType::F64 => "double",
            DType::BF16 => "bfloat16",
            DType::F8E4M3 => "f8e4m3",
            DType::F8E5M2 => "f8e5m2",
        }
    }

    /// Parse a name as `ciera perf -d` takes it (NCCL-tests names and safetensors names).
    pub fn parse(s: &str) -> Option<DType> {
        let l = s.to_ascii_lowercase();
        Some(match l.as_str() {
            "int8" | "i8" | "char" => DType::I8,
            "uint8" | "u8" => DType::U8,
            "int32" | "i32" | "int" => DType::I32,
            "uint32" | "u32" => DType::U32,
            "int64" | "i64" => DType::I64,
            "uint64" | "u64" => DType::U64,
            "half" | "f16" | "float16" | "fp16" => DType::F16,
            "float" | "f32" | "float32" | "fp32" => DType::F32,
            "double" | "f64" | "float64" => DType::F64,
            "bfloat16" | "bf16" => DType::BF16,
            "f8e4m3" | "f8_e4m3" => DType::F8E4M3,
            "f8e5m2" | "f8_e5m2" => DType::F8E5M2,
            _ => return None,
        })
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}
