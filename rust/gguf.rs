//! GGUF headers (versions 2 and 3), parsed from the mapped file with every count, length and
//! offset checked before it is trusted: nothing is allocated or looped over beyond what the bytes
//! left in the file could hold, whatever the file claims, so a parse costs time and memory linear
//! in the file's size. Strings and numeric arrays are borrowed from the file, not copied.
//!
//! ```text
//! magic "GGUF" | version u32 | n_tensors u64 | n_kv u64
//! n_kv      × (key string | value type u32 | value)
//! n_tensors × (name string | n_dims u32 | ne[n_dims] u64 | ggml type u32 | offset u64)
//! padding to general.alignment | tensor data (tensor offsets are relative to its start)
//! ```
//! A string is a u64 byte length and that many UTF-8 bytes; an array is an element type u32, a
//! u64 count and the elements. Everything is little-endian. (Version 1 had u32 counts and lengths;
//! no current tool writes it.)

use std::collections::HashMap;
use std::fmt;
use std::ops::Range;
use std::path::{Path, PathBuf};

pub const MAGIC: &[u8; 4] = b"GGUF";
/// Alignment of the data section and of every tensor when the file has no `general.alignment`.
pub const DEFAULT_ALIGNMENT: u32 = 32;
pub const ALIGNMENT_KEY: &str = "general.alignment";
/// Arrays inside arrays deeper than this are rejected: real files use flat arrays, and the limit
/// bounds the parser's recursion.
pub const MAX_NESTING: usize = 4;
/// ggml tensors have 1 to 4 dimensions.
pub const MAX_DIMS: u32 = 4;

/// The fewest bytes of a metadata pair: an empty key's length, a value type and a 1-byte value.
const MIN_KV_SIZE: u64 = 8 + 4 + 1;
/// The fewest bytes of a tensor info: an empty name's length, n_dims, one dimension, type, offset.
const MIN_TENSOR_INFO_SIZE: u64 = 8 + 4 + 8 + 4 + 8;

/// A ggml tensor type: `block` elements are encoded in `type_size` bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GgmlType {
    pub code: u32,
    pub name: &'static str,
    pub block: u64,
    pub type_size: u64,
}

const fn ggml(code: u32, name: &'static str, block: u64, type_size: u64) -> GgmlType {
    GgmlType {
        code,
        name,
        block,
        type_size,
    }
}

/// Every type of gguf-py's `GGML_QUANT_SIZES` (tests/test_gguf_validation.py checks that the two
/// agree); codes 4, 5 and 31..=33 belong to types ggml removed.
pub const GGML_TYPES: [GgmlType; 34] = [
    ggml(0, "F32", 1, 4),
    ggml(1, "F16", 1, 2),
    ggml(2, "Q4_0", 32, 18),
    ggml(3, "Q4_1", 32, 20),
    ggml(6, "Q5_0", 32, 22),
    ggml(7, "Q5_1", 32, 24),
    ggml(8, "Q8_0", 32, 34),
    ggml(9, "Q8_1", 32, 40),
    ggml(10, "Q2_K", 256, 84),
    ggml(11, "Q3_K", 256, 110),
    ggml(12, "Q4_K", 256, 144),
    ggml(13, "Q5_K", 256, 176),
    ggml(14, "Q6_K", 256, 210),
    ggml(15, "Q8_K", 256, 292),
    ggml(16, "IQ2_XXS", 256, 66),
    ggml(17, "IQ2_XS", 256, 74),
    ggml(18, "IQ3_XXS", 256, 98),
    ggml(19, "IQ1_S", 256, 50),
    ggml(20, "IQ4_NL", 32, 18),
    ggml(21, "IQ3_S", 256, 110),
    ggml(22, "IQ2_S", 256, 82),
    ggml(23, "IQ4_XS", 256, 136),
    ggml(24, "I8", 1, 1),
    ggml(25, "I16", 1, 2),
    ggml(26, "I32", 1, 4),
    ggml(27, "I64", 1, 8),
    ggml(28, "F64", 1, 8),
    ggml(29, "IQ1_M", 256, 56),
    ggml(30, "BF16", 1, 2),
    ggml(34, "TQ1_0", 256, 54),
    ggml(35, "TQ2_0", 256, 66),
    ggml(39, "MXFP4", 32, 17),
    ggml(40, "NVFP4", 64, 36),
    ggml(41, "Q1_0", 128, 18),
];

pub fn ggml_type(code: u32) -> Option<GgmlType> {
    GGML_TYPES.iter().find(|t| t.code == code).copied()
}

/// A fixed-size metadata value type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scalar {
    U8,
    I8,
    U16,
    I16,
    U32,
    I32,
    F32,
    Bool,
    U64,
    I64,
    F64,
}

impl Scalar {
    pub fn size(self) -> usize {
        match self {
            Scalar::U8 | Scalar::I8 | Scalar::Bool => 1,
            Scalar::U16 | Scalar::I16 => 2,
            Scalar::U32 | Scalar::I32 | Scalar::F32 => 4,
            Scalar::U64 | Scalar::I64 | Scalar::F64 => 8,
        }
    }

    /// One value from exactly `size()` little-endian bytes; a bool byte was checked to be 0 or 1.
    fn decode<'a>(self, b: &[u8]) -> Value<'a> {
        fn le<const N: usize>(b: &[u8]) -> [u8; N] {
            let mut out = [0; N];
            out.copy_from_slice(b);
            out
        }
        match self {
            Scalar::U8 => Value::U8(b[0]),
            Scalar::I8 => Value::I8(i8::from_le_bytes(le(b))),
            Scalar::U16 => Value::U16(u16::from_le_bytes(le(b))),
            Scalar::I16 => Value::I16(i16::from_le_bytes(le(b))),
            Scalar::U32 => Value::U32(u32::from_le_bytes(le(b))),
            Scalar::I32 => Value::I32(i32::from_le_bytes(le(b))),
            Scalar::F32 => Value::F32(f32::from_le_bytes(le(b))),
            Scalar::Bool => Value::Bool(b[0] != 0),
            Scalar::U64 => Value::U64(u64::from_le_bytes(le(b))),
            Scalar::I64 => Value::I64(i64::from_le_bytes(le(b))),
            Scalar::F64 => Value::F64(f64::from_le_bytes(le(b))),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ValueType {
    Scalar(Scalar),
    String,
    Array,
}

impl ValueType {
    fn from_code(code: u32) -> Option<Self> {
        Some(match code {
            0 => ValueType::Scalar(Scalar::U8),
            1 => ValueType::Scalar(Scalar::I8),
            2 => ValueType::Scalar(Scalar::U16),
            3 => ValueType::Scalar(Scalar::I16),
            4 => ValueType::Scalar(Scalar::U32),
            5 => ValueType::Scalar(Scalar::I32),
            6 => ValueType::Scalar(Scalar::F32),
            7 => ValueType::Scalar(Scalar::Bool),
            8 => ValueType::String,
            9 => ValueType::Array,
            10 => ValueType::Scalar(Scalar::U64),
            11 => ValueType::Scalar(Scalar::I64),
            12 => ValueType::Scalar(Scalar::F64),
            _ => return None,
        })
    }

    /// The fewest bytes one value takes: a string at least its u64 length, an array its u32
    /// element type and u64 count.
    fn min_size(self) -> u64 {
        match self {
            ValueType::Scalar(s) => s.size() as u64,
            ValueType::String => 8,
            ValueType::Array => 12,
        }
    }
}

/// A metadata value; strings borrow the file's bytes.
#[derive(Debug, Clone, PartialEq)]
pub enum Value<'a> {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    U64(u64),
    I64(i64),
    F64(f64),
    String(&'a str),
    Array(Array<'a>),
}

/// An array value, stored by element kind so a numeric array costs no memory beyond the file's.
#[derive(Debug, Clone, PartialEq)]
pub enum Array<'a> {
    Scalars(Scalars<'a>),
    Strings(Vec<&'a str>),
    Arrays(Vec<Array<'a>>),
}

/// Numbers or bools as their bytes in the file: a whole number of elements, bools 0 or 1.
#[derive(Debug, Clone, PartialEq)]
pub struct Scalars<'a> {
    ty: Scalar,
    raw: &'a [u8],
}

impl<'a> Scalars<'a> {
    pub fn ty(&self) -> Scalar {
        self.ty
    }

    pub fn iter(&self) -> impl ExactSizeIterator<Item = Value<'a>> + 'a {
        let (ty, raw) = (self.ty, self.raw);
        raw.chunks_exact(ty.size()).map(move |b| ty.decode(b))
    }
}

/// One tensor of the table, its extent checked against the file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo<'a> {
    pub name: &'a str,
    pub ggml_type: GgmlType,
    /// ggml's ne[] order: the innermost (contiguous) dimension first.
    pub dims: Vec<u64>,
    /// Absolute file offset of the first byte.
    pub offset: u64,
    pub nbytes: u64,
}

impl TensorInfo<'_> {
    fn bytes(&self) -> Range<u64> {
        // Cannot overflow: `parse` checked that the extent ends inside the file.
        self.offset..self.offset + self.nbytes
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct Header<'a> {
    pub version: u32,
    pub alignment: u64,
    /// Absolute offset of the data section: the end of the tensor infos, rounded up to `alignment`.
    pub data_offset: u64,
    /// In file order; keys are unique.
    pub metadata: Vec<(&'a str, Value<'a>)>,
    /// In file order; names are unique, extents aligned, inside the file and disjoint.
    pub tensors: Vec<TensorInfo<'a>>,
}

pub type Result<T, E = GgufError> = std::result::Result<T, E>;

/// What a faulty field belongs to, as messages name it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Site {
    /// The fixed header: magic, version and the two counts.
    Header,
    /// The key of the `n`-th metadata pair (from 0), before it is known.
    KeyOf(u64),
    /// The value of metadata key `key`; `element` indexes into (nested) arrays, empty for the value itself.
    Value {
        key: String,
        element: Vec<u64>,
    },
    /// The name of the `n`-th tensor info (from 0), before it is known.
    NameOf(u64),
    Tensor(String),
}

impl fmt::Display for Site {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Site::Header => write!(f, "the GGUF header"),
            Site::KeyOf(n) => write!(f, "the key of metadata pair #{n}"),
            Site::Value { key, element } => {
                write!(f, "metadata key {}", Quoted(key))?;
                element.iter().try_for_each(|i| write!(f, "[{i}]"))
            }
            Site::NameOf(n) => write!(f, "the name of tensor #{n}"),
            Site::Tensor(name) => write!(f, "tensor {}", Quoted(name)),
        }
    }
}

/// A name from the file in single quotes, control characters escaped: a message stays one line.
struct Quoted<'a>(&'a str);

impl fmt::Display for Quoted<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "'{}'", self.0.escape_debug())
    }
}

/// Why a GGUF header was rejected: one line naming the file, the key or tensor, and the offset.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum GgufError {
    #[error("{}: not a GGUF file (magic {magic:?}, expected \"GGUF\")", path.display())]
    BadMagic { path: PathBuf, magic: String },

    #[error("{}: GGUF version {version} is not supported (ntio reads versions 2 and 3)",
            path.display())]
    UnsupportedVersion { path: PathBuf, version: u32 },

    #[error("{}: {site} at offset {offset} needs {needed} bytes, but the file ends at \
             {file_size} (truncated or corrupt GGUF header)", path.display())]
    Truncated {
        path: PathBuf,
        site: Site,
        offset: u64,
        needed: u64,
        file_size: u64,
    },

    /// A count the rest of the file cannot hold, rejected before anything is allocated for it.
    #[error("{}: {site} at offset {offset} claims {count} {items}, but the {left} bytes left \
             in the file hold at most {most} (truncated or corrupt GGUF header)", path.display())]
    CountTooLarge {
        path: PathBuf,
        site: Site,
        offset: u64,
        count: u64,
        items: &'static str,
        left: u64,
        most: u64,
    },

    #[error("{}: {site} at offset {offset} is not valid UTF-8", path.display())]
    InvalidUtf8 {
        path: PathBuf,
        site: Site,
        offset: u64,
    },

    #[error("{}: {site} at offset {offset} has unknown value type {code}", path.display())]
    UnknownValueType {
        path: PathBuf,
        site: Site,
        offset: u64,
        code: u32,
    },

    #[error("{}: {site} at offset {offset} is a bool stored as {byte} (must be 0 or 1)",
            path.display())]
    BadBool {
        path: PathBuf,
        site: Site,
        offset: u64,
        byte: u8,
    },

    #[error("{}: {site} at offset {offset} nests arrays deeper than {MAX_NESTING}", path.display())]
    TooDeep {
        path: PathBuf,
        site: Site,
        offset: u64,
    },

    #[error("{}: metadata key {} at offset {offset} appears twice (first at offset {first})",
            path.display(), Quoted(key))]
    DuplicateKey {
        path: PathBuf,
        key: String,
        offset: u64,
        first: u64,
    },

    #[error("{}: tensor {} at offset {offset} appears twice (first at offset {first})",
            path.display(), Quoted(name))]
    DuplicateTensor {
        path: PathBuf,
        name: String,
        offset: u64,
        first: u64,
    },

    #[error("{}: metadata key '{ALIGNMENT_KEY}' at offset {offset} must be a power of two \
             stored as u32, got {found}", path.display())]
    BadAlignment {
        path: PathBuf,
        offset: u64,
        found: String,
    },

    /// A tensor info inconsistent in itself or with the file; `problem` says how, with offsets.
    #[error("{}: tensor {} (info at offset {offset}) {problem}", path.display(), Quoted(name))]
    BadTensor {
        path: PathBuf,
        name: String,
        offset: u64,
        problem: String,
    },

    #[error("{}: tensors {} (bytes {first_bytes:?}) and {} (bytes {second_bytes:?}) overlap",
            path.display(), Quoted(first), Quoted(second))]
    Overlap {
        path: PathBuf,
        first: String,
        first_bytes: Range<u64>,
        second: String,
        second_bytes: Range<u64>,
    },
}

/// Parse and validate the header of the GGUF file `bytes` (the whole file, mapped); `path` is
/// only for messages.
pub fn parse<'a>(bytes: &'a [u8], path: &Path) -> Result<Header<'a>> {
    if bytes.get(..4) != Some(MAGIC.as_slice()) {
        return Err(GgufError::BadMagic {
            path: path.to_path_buf(),
            magic: String::from_utf8_lossy(&bytes[..bytes.len().min(4)]).into_owned(),
        });
    }
    let mut p = Parser {
        path,
        bytes,
        pos: MAGIC.len(),
    };
    let header = &|| Site::Header;
    let version = p.u32(header)?;
    if !(2..=3).contains(&version) {
        return Err(GgufError::UnsupportedVersion {
            path: path.to_path_buf(),
            version,
        });
    }
    let n_tensors_at = p.offset();
    let n_tensors = p.u64(header)?;
    let n_kv_at = p.offset();
    let n_kv = p.u64(header)?;
    let n_kv = p.count(n_kv, MIN_KV_SIZE, "metadata pairs", n_kv_at, header)?;
    let (metadata, alignment) = p.metadata(n_kv)?;
    let n_tensors = p.count(
        n_tensors,
        MIN_TENSOR_INFO_SIZE,
        "tensors",
        n_tensors_at,
        header,
    )?;
    let infos = p.tensor_infos(n_tensors)?;
    // Cannot overflow: a slice holds at most isize::MAX bytes and the alignment is below 2^32.
    let data_offset = p.offset().next_multiple_of(alignment);
    let tensors = place_tensors(infos, data_offset, alignment, bytes.len() as u64, path)?;
    Ok(Header {
        version,
        alignment,
        data_offset,
        metadata,
        tensors,
    })
}

/// The alignment `general.alignment` (at file offset `at`) sets: a power of two stored as u32.
fn alignment(value: &Value, at: u64, path: &Path) -> Result<u64> {
    let found = match value {
        Value::U32(a) if a.is_power_of_two() => return Ok((*a).into()),
        Value::U32(a) => a.to_string(),
        Value::String(_) => "a string".into(),
        Value::Array(_) => "an array".into(),
        other => format!("{other:?}"),
    };
    Err(GgufError::BadAlignment {
        path: path.to_path_buf(),
        offset: at,
        found,
    })
}

/// A tensor info as read, its offset still relative to the data section.
struct RawTensor<'a> {
    info: TensorInfo<'a>,
    /// Where its info starts in the header, for messages.
    at: u64,
}

/// Make each tensor's offset absolute, checking that its extent is aligned, inside the file and
/// disjoint from every other tensor's.
fn place_tensors<'a>(
    raw: Vec<RawTensor<'a>>,
    data_offset: u64,
    alignment: u64,
    file_size: u64,
    path: &Path,
) -> Result<Vec<TensorInfo<'a>>> {
    let mut tensors = Vec::with_capacity(raw.len());
    for RawTensor { mut info, at } in raw {
        let bad = |problem: String| GgufError::BadTensor {
            path: path.to_path_buf(),
            name: info.name.to_owned(),
            offset: at,
            problem,
        };
        let relative = info.offset;
        let Some(start) = data_offset.checked_add(relative) else {
            return Err(bad(format!(
                "has data offset {relative}, past the end of the file ({file_size} bytes, \
                 data section at {data_offset})"
            )));
        };
        if relative % alignment != 0 {
            return Err(bad(format!(
                "has data offset {relative} (absolute {start}), not a multiple of the \
                 alignment {alignment}"
            )));
        }
        match start.checked_add(info.nbytes) {
            Some(end) if end <= file_size => {}
            _ => {
                let end = u128::from(start) + u128::from(info.nbytes);
                return Err(bad(format!(
                    "needs bytes {start}..{end} but the file ends at {file_size} (truncated?)"
                )));
            }
        }
        info.offset = start;
        tensors.push(info);
    }
    // In offset order, a tensor that overlaps any earlier one overlaps the one just before it.
    let mut order: Vec<&TensorInfo> = tensors.iter().collect();
    order.sort_unstable_by_key(|t| t.offset);
    if let Some(pair) = order.windows(2).find(|w| w[1].offset < w[0].bytes().end) {
        return Err(GgufError::Overlap {
            path: path.to_path_buf(),
            first: pair[0].name.to_owned(),
            first_bytes: pair[0].bytes(),
            second: pair[1].name.to_owned(),
            second_bytes: pair[1].bytes(),
        });
    }
    Ok(tensors)
}

/// A cursor over the file that never reads past its end.
struct Parser<'a, 'p> {
    path: &'p Path,
    bytes: &'a [u8],
    pos: usize,
}

/// Names the field being read, built only when an error needs it.
type SiteFn<'s> = &'s dyn Fn() -> Site;

fn value_site(key: &str, element: &[u64]) -> Site {
    Site::Value {
        key: key.to_owned(),
        element: element.to_vec(),
    }
}

impl<'a> Parser<'a, '_> {
    fn offset(&self) -> u64 {
        self.pos as u64
    }

    fn left(&self) -> u64 {
        (self.bytes.len() - self.pos) as u64
    }

    fn take(&mut self, n: u64, site: SiteFn) -> Result<&'a [u8]> {
        if n > self.left() {
            return Err(GgufError::Truncated {
                path: self.path.to_path_buf(),
                site: site(),
                offset: self.offset(),
                needed: n,
                file_size: self.bytes.len() as u64,
            });
        }
        let start = self.pos;
        self.pos += n as usize; // n ≤ the bytes left, so it fits
        Ok(&self.bytes[start..self.pos])
    }

    fn u32(&mut self, site: SiteFn) -> Result<u32> {
        let mut b = [0; 4];
        b.copy_from_slice(self.take(4, site)?);
        Ok(u32::from_le_bytes(b))
    }

    fn u64(&mut self, site: SiteFn) -> Result<u64> {
        let mut b = [0; 8];
        b.copy_from_slice(self.take(8, site)?);
        Ok(u64::from_le_bytes(b))
    }

    /// A u64 length (checked against the bytes left by `take`), then that many UTF-8 bytes.
    fn string(&mut self, site: SiteFn) -> Result<&'a str> {
        let len = self.u64(site)?;
        let start = self.offset();
        let raw = self.take(len, site)?;
        std::str::from_utf8(raw).map_err(|e| GgufError::InvalidUtf8 {
            path: self.path.to_path_buf(),
            site: site(),
            offset: start + e.valid_up_to() as u64,
        })
    }

    /// `count` items of at least `min_size` bytes each, as a usize, if the bytes left can hold
    /// them: checked before anything is allocated for them or looped over.
    fn count(
        &self,
        count: u64,
        min_size: u64,
        items: &'static str,
        offset: u64,
        site: SiteFn,
    ) -> Result<usize> {
        match count.checked_mul(min_size) {
            // count ≤ the bytes left, so it fits a usize
            Some(needed) if needed <= self.left() => Ok(count as usize),
            _ => Err(GgufError::CountTooLarge {
                path: self.path.to_path_buf(),
                site: site(),
                offset,
                count,
                items,
                left: self.left(),
                most: self.left() / min_size,
            }),
        }
    }

    fn value_type(&mut self, site: SiteFn) -> Result<ValueType> {
        let offset = self.offset();
        let code = self.u32(site)?;
        ValueType::from_code(code).ok_or_else(|| GgufError::UnknownValueType {
            path: self.path.to_path_buf(),
            site: site(),
            offset,
            code,
        })
    }

    /// The metadata pairs in file order, and the alignment they set.
    fn metadata(&mut self, n_kv: usize) -> Result<(Vec<(&'a str, Value<'a>)>, u64)> {
        let mut metadata = Vec::with_capacity(n_kv);
        let mut alignment_of = u64::from(DEFAULT_ALIGNMENT);
        let mut offsets: HashMap<&str, u64> = HashMap::with_capacity(n_kv);
        for n in 0..n_kv as u64 {
            let at = self.offset();
            let key = self.string(&|| Site::KeyOf(n))?;
            if let Some(first) = offsets.insert(key, at) {
                return Err(GgufError::DuplicateKey {
                    path: self.path.to_path_buf(),
                    key: key.to_owned(),
                    offset: at,
                    first,
                });
            }
            let ty = self.value_type(&|| value_site(key, &[]))?;
            let value = self.value(ty, key, &mut Vec::new())?;
            if key == ALIGNMENT_KEY {
                alignment_of = alignment(&value, at, self.path)?;
            }
            metadata.push((key, value));
        }
        Ok((metadata, alignment_of))
    }

    /// A value of type `ty` of metadata key `key`; `element` is its index path inside arrays.
    fn value(&mut self, ty: ValueType, key: &str, element: &mut Vec<u64>) -> Result<Value<'a>> {
        match ty {
            ValueType::Scalar(s) => {
                let offset = self.offset();
                let raw = self.take(s.size() as u64, &|| value_site(key, element))?;
                self.check_bools(s, raw, offset, key, element, false)?;
                Ok(s.decode(raw))
            }
            ValueType::String => Ok(Value::String(self.string(&|| value_site(key, element))?)),
            ValueType::Array => Ok(Value::Array(self.array(key, element)?)),
        }
    }

    fn array(&mut self, key: &str, element: &mut Vec<u64>) -> Result<Array<'a>> {
        let offset = self.offset();
        let elem = self.value_type(&|| value_site(key, element))?;
        let count = self.u64(&|| value_site(key, element))?;
        if elem == ValueType::Array && element.len() + 1 >= MAX_NESTING {
            return Err(GgufError::TooDeep {
                path: self.path.to_path_buf(),
                site: value_site(key, element),
                offset,
            });
        }
        let n = self.count(count, elem.min_size(), "elements", offset, &|| {
            value_site(key, element)
        })?;
        Ok(match elem {
            ValueType::Scalar(s) => {
                let start = self.offset();
                // `count` was checked against the bytes left: no overflow, and the take succeeds.
                let raw = self.take(count * s.size() as u64, &|| value_site(key, element))?;
                self.check_bools(s, raw, start, key, element, true)?;
                Array::Scalars(Scalars { ty: s, raw })
            }
            ValueType::String => {
                let mut items = Vec::with_capacity(n);
                for i in 0..count {
                    element.push(i);
                    items.push(self.string(&|| value_site(key, element))?);
                    element.pop();
                }
                Array::Strings(items)
            }
            ValueType::Array => {
                let mut items = Vec::with_capacity(n);
                for i in 0..count {
                    element.push(i);
                    items.push(self.array(key, element)?);
                    element.pop();
                }
                Array::Arrays(items)
            }
        })
    }

    /// Bools must be stored as 0 or 1; `raw` starts at file offset `offset` and is one value, or
    /// the elements of an array when `indexed`.
    fn check_bools(
        &self,
        s: Scalar,
        raw: &[u8],
        offset: u64,
        key: &str,
        element: &[u64],
        indexed: bool,
    ) -> Result<()> {
        if s != Scalar::Bool {
            return Ok(());
        }
        let Some(i) = raw.iter().position(|&b| b > 1) else {
            return Ok(());
        };
        let mut at = element.to_vec();
        if indexed {
            at.push(i as u64);
        }
        Err(GgufError::BadBool {
            path: self.path.to_path_buf(),
            site: value_site(key, &at),
            offset: offset + i as u64,
            byte: raw[i],
        })
    }

    /// The tensor infos in file order, each consistent in itself (dimensions, type, size); their
    /// offsets are still relative to the data section.
    fn tensor_infos(&mut self, n_tensors: usize) -> Result<Vec<RawTensor<'a>>> {
        let mut infos = Vec::with_capacity(n_tensors);
        let mut offsets: HashMap<&str, u64> = HashMap::with_capacity(n_tensors);
        for n in 0..n_tensors as u64 {
            let at = self.offset();
            let name = self.string(&|| Site::NameOf(n))?;
            if let Some(first) = offsets.insert(name, at) {
                return Err(GgufError::DuplicateTensor {
                    path: self.path.to_path_buf(),
                    name: name.to_owned(),
                    offset: at,
                    first,
                });
            }
            let site = &|| Site::Tensor(name.to_owned());
            let path = self.path;
            let bad = |problem: String| GgufError::BadTensor {
                path: path.to_path_buf(),
                name: name.to_owned(),
                offset: at,
                problem,
            };
            let n_dims = self.u32(site)?;
            if !(1..=MAX_DIMS).contains(&n_dims) {
                return Err(bad(format!(
                    "has {n_dims} dimensions (GGUF allows 1 to {MAX_DIMS})"
                )));
            }
            let dims = (0..n_dims)
                .map(|_| self.u64(site))
                .collect::<Result<Vec<u64>>>()?;
            if dims.contains(&0) {
                return Err(bad(format!("has a zero dimension (ne {dims:?})")));
            }
            let Some(n_elements) = dims.iter().try_fold(1u64, |n, &d| n.checked_mul(d)) else {
                return Err(bad(format!(
                    "has dimensions ne {dims:?}, whose product overflows 64 bits"
                )));
            };
            let code = self.u32(site)?;
            let Some(ty) = ggml_type(code) else {
                return Err(bad(format!("has unknown ggml type {code}")));
            };
            if dims[0] % ty.block != 0 {
                return Err(bad(format!(
                    "has rows of {} elements, not a multiple of the {} block ({})",
                    dims[0], ty.name, ty.block
                )));
            }
            let Some(nbytes) = (n_elements / ty.block).checked_mul(ty.type_size) else {
                return Err(bad(format!(
                    "has {n_elements} elements of {}, whose size overflows 64 bits",
                    ty.name
                )));
            };
            let offset = self.u64(site)?;
            infos.push(RawTensor {
                info: TensorInfo {
                    name,
                    ggml_type: ty,
                    dims,
                    offset,
                    nbytes,
                },
                at,
            });
        }
        Ok(infos)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Writes GGUF files field by field, valid or not.
    #[derive(Clone)]
    struct Gguf {
        version: u32,
        kv: Vec<u8>,
        n_kv: u64,
        infos: Vec<u8>,
        n_tensors: u64,
        /// Bytes after the header's padding to 32.
        data_len: usize,
    }

    fn string(out: &mut Vec<u8>, s: &[u8]) {
        out.extend((s.len() as u64).to_le_bytes());
        out.extend(s);
    }

    impl Gguf {
        fn new() -> Self {
            Self {
                version: 3,
                kv: Vec::new(),
                n_kv: 0,
                infos: Vec::new(),
                n_tensors: 0,
                data_len: 0,
            }
        }

        /// A pair with value type `code` and the value's encoded bytes.
        fn kv(mut self, key: &[u8], code: u32, value: &[u8]) -> Self {
            string(&mut self.kv, key);
            self.kv.extend(code.to_le_bytes());
            self.kv.extend(value);
            self.n_kv += 1;
            self
        }

        fn kv_u32(self, key: &str, v: u32) -> Self {
            self.kv(key.as_bytes(), 4, &v.to_le_bytes())
        }

        fn kv_str(self, key: &str, v: &[u8]) -> Self {
            let mut value = Vec::new();
            string(&mut value, v);
            self.kv(key.as_bytes(), 8, &value)
        }

        fn tensor(mut self, name: &[u8], dims: &[u64], code: u32, offset: u64) -> Self {
            string(&mut self.infos, name);
            self.infos.extend((dims.len() as u32).to_le_bytes());
            dims.iter().for_each(|d| self.infos.extend(d.to_le_bytes()));
            self.infos.extend(code.to_le_bytes());
            self.infos.extend(offset.to_le_bytes());
            self.n_tensors += 1;
            self
        }

        fn data(mut self, len: usize) -> Self {
            self.data_len = len;
            self
        }

        fn header_len(&self) -> usize {
            4 + 4 + 8 + 8 + self.kv.len() + self.infos.len()
        }

        fn build(&self) -> Vec<u8> {
            let mut out = MAGIC.to_vec();
            out.extend(self.version.to_le_bytes());
            out.extend(self.n_tensors.to_le_bytes());
            out.extend(self.n_kv.to_le_bytes());
            out.extend(&self.kv);
            out.extend(&self.infos);
            out.resize(out.len().next_multiple_of(32) + self.data_len, 0);
            out
        }
    }

    fn u32_array(values: &[u32]) -> Vec<u8> {
        let mut out = 4u32.to_le_bytes().to_vec();
        out.extend((values.len() as u64).to_le_bytes());
        values.iter().for_each(|v| out.extend(v.to_le_bytes()));
        out
    }

    fn string_array(values: &[&[u8]]) -> Vec<u8> {
        let mut out = 8u32.to_le_bytes().to_vec();
        out.extend((values.len() as u64).to_le_bytes());
        values.iter().for_each(|v| string(&mut out, v));
        out
    }

    /// A small model-like file: every value type, two F32 tensors and a Q8_0 one.
    fn model() -> Gguf {
        let mut nested = 9u32.to_le_bytes().to_vec();
        nested.extend(2u64.to_le_bytes());
        nested.extend(u32_array(&[1, 2]));
        nested.extend(u32_array(&[]));
        Gguf::new()
            .kv_str("general.architecture", b"llama")
            .kv_u32("llama.block_count", 2)
            .kv(b"u8", 0, &[200])
            .kv(b"i8", 1, &[0xff])
            .kv(b"u16", 2, &515u16.to_le_bytes())
            .kv(b"i16", 3, &(-2i16).to_le_bytes())
            .kv(b"i32", 5, &(-7i32).to_le_bytes())
            .kv(b"f32", 6, &1.5f32.to_le_bytes())
            .kv(b"bool", 7, &[1])
            .kv(b"u64", 10, &(1u64 << 40).to_le_bytes())
            .kv(b"i64", 11, &(-1i64).to_le_bytes())
            .kv(b"f64", 12, &0.25f64.to_le_bytes())
            .kv(
                b"tokenizer.ggml.tokens",
                9,
                &string_array(&[b"a", "é".as_bytes(), b""]),
            )
            .kv(b"tokenizer.ggml.token_type", 9, &u32_array(&[1, 3, 5]))
            .kv(b"nested", 9, &nested)
            .tensor(b"token_embd.weight", &[4, 3], 0, 0)
            .tensor(b"blk.0.attn_q.weight", &[32, 2], 8, 64)
            .tensor(b"output_norm.weight", &[4], 0, 160)
            .data(176)
    }

    fn err(file: &Gguf) -> GgufError {
        parse(&file.build(), Path::new("m.gguf")).unwrap_err()
    }

    fn message(file: &Gguf) -> String {
        let e = err(file).to_string();
        assert!(e.starts_with("m.gguf: ") && !e.contains('\n'), "{e}");
        e
    }

    #[test]
    fn parses_every_value_type_and_places_tensors() {
        let file = model().build();
        let h = parse(&file, Path::new("m.gguf")).unwrap();
        assert_eq!((h.version, h.alignment), (3, 32));
        assert_eq!(h.data_offset % 32, 0);
        assert_eq!(h.data_offset as usize + 176, file.len());
        let value = |key: &str| &h.metadata.iter().find(|(k, _)| *k == key).unwrap().1;
        assert_eq!(value("general.architecture"), &Value::String("llama"));
        assert_eq!(value("u8"), &Value::U8(200));
        assert_eq!(value("i8"), &Value::I8(-1));
        assert_eq!(value("u16"), &Value::U16(515));
        assert_eq!(value("i16"), &Value::I16(-2));
        assert_eq!(value("i32"), &Value::I32(-7));
        assert_eq!(value("f32"), &Value::F32(1.5));
        assert_eq!(value("bool"), &Value::Bool(true));
        assert_eq!(value("u64"), &Value::U64(1 << 40));
        assert_eq!(value("i64"), &Value::I64(-1));
        assert_eq!(value("f64"), &Value::F64(0.25));
        assert_eq!(
            value("tokenizer.ggml.tokens"),
            &Value::Array(Array::Strings(vec!["a", "é", ""]))
        );
        let Value::Array(Array::Scalars(types)) = value("tokenizer.ggml.token_type") else {
            panic!("token types are scalars");
        };
        assert_eq!(types.ty(), Scalar::U32);
        assert_eq!(
            types.iter().collect::<Vec<_>>(),
            [Value::U32(1), Value::U32(3), Value::U32(5)]
        );
        let Value::Array(Array::Arrays(nested)) = value("nested") else {
            panic!("nested is an array of arrays");
        };
        assert_eq!(nested.len(), 2);
        assert_eq!(h.metadata.len(), 15);
        let names: Vec<_> = h.tensors.iter().map(|t| t.name).collect();
        assert_eq!(
            names,
            [
                "token_embd.weight",
                "blk.0.attn_q.weight",
                "output_norm.weight"
            ]
        );
        let q = &h.tensors[1];
        assert_eq!(
            (q.ggml_type.name, q.dims.as_slice()),
            ("Q8_0", [32u64, 2].as_slice())
        );
        assert_eq!((q.offset, q.nbytes), (h.data_offset + 64, 2 * 34));
        assert_eq!(h.tensors[0].nbytes, 48);
    }

    #[test]
    fn version_2_parses_and_others_are_rejected() {
        let mut file = model();
        file.version = 2;
        assert_eq!(
            parse(&file.build(), Path::new("m.gguf")).unwrap().version,
            2
        );
        file.version = 1;
        assert_eq!(
            message(&file),
            "m.gguf: GGUF version 1 is not supported (ntio reads versions 2 and 3)"
        );
        let mut bytes = model().build();
        bytes[0] = b'X';
        let e = parse(&bytes, Path::new("m.gguf")).unwrap_err().to_string();
        assert_eq!(
            e,
            "m.gguf: not a GGUF file (magic \"XGUF\", expected \"GGUF\")"
        );
        assert!(matches!(
            parse(b"GG", Path::new("m")),
            Err(GgufError::BadMagic { .. })
        ));
    }

    #[test]
    fn every_truncation_of_the_header_is_an_error() {
        let file = model();
        let bytes = file.build();
        for len in 0..bytes.len() {
            let e = parse(&bytes[..len], Path::new("m.gguf")).unwrap_err();
            if len < file.header_len() {
                assert!(
                    matches!(
                        e,
                        GgufError::Truncated { .. }
                            | GgufError::BadMagic { .. }
                            | GgufError::CountTooLarge { .. }
                    ),
                    "{len}: {e}"
                );
            } else {
                // The header is whole; the data section is cut.
                assert!(e.to_string().contains("(truncated?)"), "{len}: {e}");
            }
        }
    }

    #[test]
    fn counts_beyond_the_file_are_rejected_before_allocating() {
        let mut array = 4u32.to_le_bytes().to_vec();
        array.extend((1u64 << 40).to_le_bytes());
        let file = Gguf::new()
            .kv(b"tokenizer.ggml.token_type", 9, &array)
            .data(64);
        let e = message(&file);
        assert!(e.starts_with("m.gguf: metadata key 'tokenizer.ggml.token_type' at offset 61 claims 1099511627776 elements, but the"), "{e}");
        // A count whose byte size overflows 64 bits.
        let mut array = 8u32.to_le_bytes().to_vec();
        array.extend(u64::MAX.to_le_bytes());
        assert!(matches!(
            err(&Gguf::new().kv(b"k", 9, &array)),
            GgufError::CountTooLarge { .. }
        ));
        let mut huge = model().build();
        huge[16..24].copy_from_slice(&u64::MAX.to_le_bytes()); // n_kv
        let e = parse(&huge, Path::new("m.gguf")).unwrap_err().to_string();
        assert!(
            e.contains("the GGUF header at offset 16 claims 18446744073709551615 metadata pairs"),
            "{e}"
        );
        huge[16..24].copy_from_slice(&15u64.to_le_bytes());
        huge[8..16].copy_from_slice(&(1u64 << 60).to_le_bytes()); // n_tensors
        let e = parse(&huge, Path::new("m.gguf")).unwrap_err().to_string();
        assert!(
            e.contains("the GGUF header at offset 8 claims 1152921504606846976 tensors"),
            "{e}"
        );
        let mut long = Vec::new();
        long.extend((1u64 << 40).to_le_bytes());
        let e = message(&Gguf::new().kv(b"name", 8, &long));
        assert!(
            e.contains("metadata key 'name' at offset 48 needs 1099511627776 bytes"),
            "{e}"
        );
    }

    #[test]
    fn duplicates_are_named() {
        let file = Gguf::new().kv_u32("a", 1).kv_u32("a", 2);
        assert_eq!(
            message(&file),
            "m.gguf: metadata key 'a' at offset 41 appears twice (first at offset 24)"
        );
        let file = Gguf::new()
            .tensor(b"t", &[4], 0, 0)
            .tensor(b"t", &[4], 0, 32)
            .data(64);
        assert_eq!(
            message(&file),
            "m.gguf: tensor 't' at offset 57 appears twice (first at offset 24)"
        );
    }

    #[test]
    fn invalid_utf8_is_named_with_its_offset() {
        let e = message(&Gguf::new().kv(b"ke\xffy", 4, &[0; 4]));
        assert_eq!(
            e,
            "m.gguf: the key of metadata pair #0 at offset 34 is not valid UTF-8"
        );
        let e = message(&Gguf::new().kv_str("general.name", b"ok\xc3("));
        assert_eq!(
            e,
            "m.gguf: metadata key 'general.name' at offset 58 is not valid UTF-8"
        );
        let tokens = string_array(&[b"a", b"b\xfe"]);
        let e = message(&Gguf::new().kv(b"tokenizer.ggml.tokens", 9, &tokens));
        assert_eq!(
            e,
            "m.gguf: metadata key 'tokenizer.ggml.tokens'[1] at offset 87 is not valid UTF-8"
        );
        let e = message(&Gguf::new().tensor(b"blk.\x80", &[4], 0, 0).data(16));
        assert_eq!(
            e,
            "m.gguf: the name of tensor #0 at offset 36 is not valid UTF-8"
        );
    }

    #[test]
    fn bad_value_types_and_bools_are_named() {
        let e = message(&Gguf::new().kv(b"k", 13, &[0; 8]));
        assert_eq!(
            e,
            "m.gguf: metadata key 'k' at offset 33 has unknown value type 13"
        );
        let mut array = 77u32.to_le_bytes().to_vec();
        array.extend(0u64.to_le_bytes());
        let e = message(&Gguf::new().kv(b"k", 9, &array));
        assert_eq!(
            e,
            "m.gguf: metadata key 'k' at offset 37 has unknown value type 77"
        );
        let e = message(&Gguf::new().kv(b"flag", 7, &[2]));
        assert_eq!(
            e,
            "m.gguf: metadata key 'flag' at offset 40 is a bool stored as 2 (must be 0 or 1)"
        );
        let mut bools = 7u32.to_le_bytes().to_vec();
        bools.extend(3u64.to_le_bytes());
        bools.extend([0, 1, 9]);
        let e = message(&Gguf::new().kv(b"flags", 9, &bools));
        assert_eq!(
            e,
            "m.gguf: metadata key 'flags'[2] at offset 55 is a bool stored as 9 (must be 0 or 1)"
        );
    }

    #[test]
    fn nesting_is_limited() {
        let mut value = u32_array(&[1]);
        for _ in 0..MAX_NESTING {
            let mut outer = 9u32.to_le_bytes().to_vec();
            outer.extend(1u64.to_le_bytes());
            outer.extend(value);
            value = outer;
        }
        let e = message(&Gguf::new().kv(b"deep", 9, &value));
        assert!(e.contains("nests arrays deeper than 4"), "{e}");
    }

    #[test]
    fn alignment_is_a_u32_power_of_two() {
        let h = Gguf::new()
            .kv_u32(ALIGNMENT_KEY, 64)
            .tensor(b"t", &[4], 0, 64)
            .data(200)
            .build();
        let h = parse(&h, Path::new("m.gguf")).unwrap();
        assert_eq!(
            (h.alignment, h.data_offset % 64, h.tensors[0].offset),
            (64, 0, h.data_offset + 64)
        );
        let e = message(&Gguf::new().kv_u32(ALIGNMENT_KEY, 48));
        assert_eq!(e, "m.gguf: metadata key 'general.alignment' at offset 24 must be a power of two stored as u32, got 48");
        let e = message(&Gguf::new().kv(ALIGNMENT_KEY.as_bytes(), 10, &32u64.to_le_bytes()));
        assert!(e.ends_with("got U64(32)"), "{e}");
        assert!(message(&Gguf::new().kv_u32(ALIGNMENT_KEY, 0)).ends_with("got 0"));
    }

    #[test]
    fn inconsistent_tensor_infos_are_named() {
        let one =
            |dims: &[u64], code: u32| message(&Gguf::new().tensor(b"w", dims, code, 0).data(4096));
        assert_eq!(
            one(&[1, 1, 1, 1, 1], 0),
            "m.gguf: tensor 'w' (info at offset 24) has 5 dimensions (GGUF allows 1 to 4)"
        );
        assert!(one(&[], 0).contains("has 0 dimensions"));
        assert!(one(&[4, 0], 0).ends_with("has a zero dimension (ne [4, 0])"));
        assert!(one(&[1 << 32, 1 << 32], 0).ends_with("whose product overflows 64 bits"));
        assert!(one(&[1 << 62, 4], 24).ends_with("whose product overflows 64 bits"));
        assert!(one(&[1 << 61], 27)
            .ends_with("has 2305843009213693952 elements of I64, whose size overflows 64 bits"));
        assert!(one(&[32], 36).ends_with("has unknown ggml type 36"));
        assert!(one(&[48, 2], 8)
            .ends_with("has rows of 48 elements, not a multiple of the Q8_0 block (32)"));
    }

    #[test]
    fn tensor_extents_are_aligned_inside_the_file_and_disjoint() {
        let place = |offset: u64| {
            message(
                &Gguf::new()
                    .tensor(b"blk.0.attn_q.weight", &[8], 0, offset)
                    .data(64),
            )
        };
        assert_eq!(
            place(u64::MAX),
            "m.gguf: tensor 'blk.0.attn_q.weight' (info at offset 24) has data offset 18446744073709551615, \
             past the end of the file (160 bytes, data section at 96)"
        );
        assert!(place(u64::MAX - 31).contains("past the end of the file"));
        assert_eq!(
            place(1),
            "m.gguf: tensor 'blk.0.attn_q.weight' (info at offset 24) has data offset 1 (absolute 97), \
             not a multiple of the alignment 32"
        );
        assert_eq!(
            place(64),
            "m.gguf: tensor 'blk.0.attn_q.weight' (info at offset 24) needs bytes 160..192 but the file \
             ends at 160 (truncated?)"
        );
        let big = message(&Gguf::new().tensor(b"t", &[1 << 40, 1 << 20], 0, 0).data(64));
        assert!(
            big.ends_with(
                "needs bytes 96..4611686018427388000 but the file ends at 160 (truncated?)"
            ),
            "{big}"
        );
        let overlap = Gguf::new()
            .tensor(b"a", &[16], 0, 0)
            .tensor(b"b", &[8], 0, 64)
            .tensor(b"c", &[8], 0, 32)
            .data(128);
        assert_eq!(
            message(&overlap),
            "m.gguf: tensors 'a' (bytes 128..192) and 'c' (bytes 160..192) overlap"
        );
        let touching = Gguf::new()
            .tensor(b"a", &[8], 0, 0)
            .tensor(b"b", &[8], 0, 32)
            .data(64);
        assert!(parse(&touching.build(), Path::new("m.gguf")).is_ok());
    }

    #[test]
    fn names_with_control_characters_stay_on_one_line() {
        let e = message(&Gguf::new().kv_u32("a\nb", 1).kv_u32("a\nb", 2));
        assert!(e.contains("metadata key 'a\\nb'"), "{e}");
    }

    mod properties {
        use super::*;
        use proptest::prelude::*;
        use std::time::{Duration, Instant};

        /// A parse that returns at all returns quickly, and what it accepts is consistent.
        fn check(bytes: &[u8]) -> std::result::Result<(), TestCaseError> {
            let start = Instant::now();
            let parsed = parse(bytes, Path::new("p.gguf"));
            prop_assert!(start.elapsed() < Duration::from_secs(1));
            match parsed {
                Ok(h) => {
                    prop_assert!(h.alignment.is_power_of_two() && h.data_offset % h.alignment == 0);
                    for t in &h.tensors {
                        prop_assert!(
                            t.offset >= h.data_offset
                                && (t.offset - h.data_offset) % h.alignment == 0
                        );
                        prop_assert!(t.offset + t.nbytes <= bytes.len() as u64);
                    }
                }
                Err(e) => {
                    let m = e.to_string();
                    prop_assert!(m.starts_with("p.gguf: ") && !m.contains('\n'), "{}", m);
                }
            }
            Ok(())
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(2000))]

            #[test]
            fn arbitrary_bytes_never_panic(tail in proptest::collection::vec(any::<u8>(), 0..256), version in 0u32..5) {
                check(&tail)?;
                let mut file = MAGIC.to_vec();
                file.extend(version.to_le_bytes());
                file.extend(tail);
                check(&file)?;
            }

            /// Overwrite bytes, or 8-byte words (counts, lengths, offsets) with small, large and
            /// boundary values, then maybe cut the file.
            #[test]
            fn mutated_headers_never_panic(
                edits in proptest::collection::vec((any::<usize>(), any::<u64>(), 0u8..4), 1..6),
                cut in any::<usize>(),
            ) {
                let mut bytes = model().build();
                let len = bytes.len();
                for (at, value, kind) in edits {
                    let at = at % len;
                    let word = match kind {
                        0 => { bytes[at] = value as u8; continue; }
                        1 => value,
                        2 => value % 64,
                        _ => u64::MAX - value % 64,
                    };
                    let end = (at + 8).min(len);
                    bytes[at..end].copy_from_slice(&word.to_le_bytes()[..end - at]);
                }
                if cut % 3 == 0 {
                    bytes.truncate(cut % (len + 1));
                }
                check(&bytes)?;
            }
        }
    }
}
