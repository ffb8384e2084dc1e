//! Element types and how the codec splits each of them into a coded symbol and raw low bits.

use crate::error::{Error, Result};

/// Element type of a tensor, as stored in the container index (one byte).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum DType {
    /// Opaque bytes (file segments, quantized GGUF blocks).
    U8 = 0,
    BF16 = 1,
    F16 = 2,
    F32 = 3,
    F8E4M3 = 4,
    F8E5M2 = 5,
    F64 = 6,
    I8 = 7,
    I16 = 8,
    I32 = 9,
    I64 = 10,
    U16 = 11,
    U32 = 12,
    U64 = 13,
    Bool = 14,
}

pub const ALL_DTYPES: [DType; 15] = [
    DType::U8,
    DType::BF16,
    DType::F16,
    DType::F32,
    DType::F8E4M3,
    DType::F8E5M2,
    DType::F64,
    DType::I8,
    DType::I16,
    DType::I32,
    DType::I64,
    DType::U16,
    DType::U32,
    DType::U64,
    DType::Bool,
];

impl DType {
    pub fn from_code(code: u8) -> Result<DType> {
        ALL_DTYPES.get(code as usize).copied().ok_or_else(|| Error::Unsupported(format!("dtype code {code}")))
    }

    pub fn code(self) -> u8 {
        self as u8
    }

    pub fn size(self) -> usize {
        match self {
            DType::U8 | DType::I8 | DType::Bool | DType::F8E4M3 | DType::F8E5M2 => 1,
            DType::BF16 | DType::F16 | DType::I16 | DType::U16 => 2,
            DType::F32 | DType::I32 | DType::U32 => 4,
            DType::F64 | DType::I64 | DType::U64 => 8,
        }
    }

    /// Canonical lower-case name (the names numpy / torch / safetensors users know).
    pub fn name(self) -> &'static str {
        match self {
            DType::U8 => "uint8",
            DType::BF16 => "bfloat16",
            DType::F16 => "float16",
            DType::F32 => "float32",
            DType::F8E4M3 => "float8_e4m3fn",
            DType::F8E5M2 => "float8_e5m2",
            DType::F64 => "float64",
            DType::I8 => "int8",
            DType::I16 => "int16",
            DType::I32 => "int32",
            DType::I64 => "int64",
            DType::U16 => "uint16",
            DType::U32 => "uint32",
            DType::U64 => "uint64",
            DType::Bool => "bool",
        }
    }

    pub fn from_name(name: &str) -> Result<DType> {
        ALL_DTYPES
            .iter()
            .copied()
            .find(|d| d.name() == name)
            .ok_or_else(|| Error::InvalidArgument(format!("unknown dtype name {name:?}")))
    }

    /// How the dense profile codes this dtype: the unit the coder walks over, and how many of each
    /// unit's top bits form the entropy-coded symbol (the rest are stored raw).
    ///
    /// Floats are coded per element with sign and exponent as the symbol: on real bf16 KV and
    /// weights the mantissa is within 0.2 bits of uniform, so coding it buys almost nothing and
    /// costs decode speed. fp8 is coded whole (8-bit symbols). Every other dtype is coded as bytes.
    pub fn split(self) -> Split {
        match self {
            DType::BF16 => Split { unit_bits: 16, sym_bits: 9, grouped: true },
            DType::F16 => Split { unit_bits: 16, sym_bits: 6, grouped: true },
            DType::F32 => Split { unit_bits: 32, sym_bits: 9, grouped: true },
            DType::F8E4M3 | DType::F8E5M2 => Split { unit_bits: 8, sym_bits: 8, grouped: true },
            _ => Split { unit_bits: 8, sym_bits: 8, grouped: false },
        }
    }
}

/// The field split of one coded unit: `sym_bits` top bits are the symbol, the low
/// `unit_bits - sym_bits` bits are stored raw.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Split {
    pub unit_bits: u32,
    pub sym_bits: u32,
    /// Whether the encoder tries channel groups (floats: channels differ in magnitude).
    pub grouped: bool,
}

impl Split {
    pub fn raw_bits(self) -> u32 {
        self.unit_bits - self.sym_bits
    }
    pub fn unit_bytes(self) -> usize {
        (self.unit_bits / 8) as usize
    }
}
