//! Checks on memory a caller lends to Rust (in the bindings: a Python buffer export) before any slice is formed
//! over it: element type, C-contiguity, writability, alignment, and overlap between two buffers. Pure: no pyo3
//! here; `buffer_bindings` feeds it what an export says. Sizes are checked by the code that knows them (the
//! kernels' shapes, the reader's extents).

use std::fmt;

/// An element type a caller's buffer may have to hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Elem {
    U8,
    F32,
    F16,
    /// bfloat16, which the buffer protocol has no format for: its bits, as 16-bit integers.
    Bf16,
}

impl Elem {
    pub fn size(self) -> usize {
        match self {
            Elem::U8 => 1,
            Elem::F32 => 4,
            Elem::F16 | Elem::Bf16 => 2,
        }
    }

    /// The numpy / torch name.
    pub fn name(self) -> &'static str {
        match self {
            Elem::U8 => "uint8",
            Elem::F32 => "float32",
            Elem::F16 => "float16",
            Elem::Bf16 => "bfloat16 (as int16 bits: tensor.view(torch.int16))",
        }
    }

    /// Whether a PEP 3118 (struct module) format string describes this element, in native byte order.
    pub fn matches(self, format: &[u8]) -> bool {
        let (order, code) = match format {
            [code] => (b'@', *code),
            [order, code] => (*order, *code),
            _ => return false,
        };
        let native = match order {
            b'@' | b'=' => true,
            b'<' => cfg!(target_endian = "little"),
            b'>' | b'!' => cfg!(target_endian = "big"),
            _ => false,
        };
        match self {
            Elem::U8 => code == b'B' && matches!(order, b'@' | b'=' | b'<' | b'>' | b'!'), // one byte: any order
            Elem::F32 => code == b'f' && native,
            Elem::F16 => code == b'e' && native,
            Elem::Bf16 => matches!(code, b'h' | b'H') && native,
        }
    }
}

/// A Rust element type a checked buffer can be viewed as.
pub trait Item: Copy {
    const ELEM: Elem;
}

impl Item for u8 {
    const ELEM: Elem = Elem::U8;
}

impl Item for f32 {
    const ELEM: Elem = Elem::F32;
}

/// What an export says about the memory it lends.
#[derive(Clone, Copy, Debug)]
pub struct Export<'a> {
    pub address: usize,
    pub len_bytes: usize,
    pub item_size: usize,
    /// PEP 3118 format of one item ("B" where the exporter gives none).
    pub format: &'a [u8],
    pub readonly: bool,
    pub c_contiguous: bool,
}

/// How an argument's memory will be used.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    Read,
    Write,
}

/// A buffer that cannot be used for an argument. `name` is the argument's name.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BufferError {
    #[error("{name} must hold {expected} elements, got buffer format {format:?} ({item_size}-byte items)")]
    WrongType {
        name: &'static str,
        expected: &'static str,
        format: String,
        item_size: usize,
    },
    #[error("{name} must be C-contiguous (a strided or transposed view is not)")]
    NotContiguous { name: &'static str },
    #[error("{name} is read-only; it must be writable")]
    ReadOnly { name: &'static str },
    #[error("{name} must be {align}-byte aligned, its memory starts at {address:#x}")]
    Misaligned {
        name: &'static str,
        align: usize,
        address: usize,
    },
    #[error("{name} overlaps {other}: they must not share memory")]
    Overlap {
        name: &'static str,
        other: &'static str,
    },
}

/// Whether `export` can be used as argument `name`: holding `elem` (None: any type, used as bytes), laid out
/// C-contiguously, writable for `Access::Write`, aligned for `elem`. Returns its length in elements (in bytes
/// for `elem` None).
pub fn check(
    name: &'static str,
    export: &Export,
    elem: Option<Elem>,
    access: Access,
) -> Result<usize, BufferError> {
    if let Some(elem) = elem {
        if export.item_size != elem.size() || !elem.matches(export.format) {
            return Err(BufferError::WrongType {
                name,
                expected: elem.name(),
                format: Printable(export.format).to_string(),
                item_size: export.item_size,
            });
        }
    }
    if !export.c_contiguous {
        return Err(BufferError::NotContiguous { name });
    }
    if access == Access::Write && export.readonly {
        return Err(BufferError::ReadOnly { name });
    }
    let size = elem.map_or(1, Elem::size);
    if export.len_bytes > 0 && !export.address.is_multiple_of(size) {
        return Err(BufferError::Misaligned {
            name,
            align: size,
            address: export.address,
        });
    }
    Ok(export.len_bytes / size)
}

/// Refuses byte ranges `(address, len)` `a` (argument `name`) and `b` (argument `other`) that share a byte.
pub fn disjoint(
    (name, a): (&'static str, (usize, usize)),
    (other, b): (&'static str, (usize, usize)),
) -> Result<(), BufferError> {
    let (a_end, b_end) = (a.0.saturating_add(a.1), b.0.saturating_add(b.1));
    if a.1 > 0 && b.1 > 0 && a.0 < b_end && b.0 < a_end {
        return Err(BufferError::Overlap { name, other });
    }
    Ok(())
}

/// A format string for a message (the exporter's bytes, not trusted to be UTF-8).
struct Printable<'a>(&'a [u8]);

impl fmt::Display for Printable<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&String::from_utf8_lossy(self.0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn export(format: &'static [u8], item_size: usize) -> Export<'static> {
        Export {
            address: 4096,
            len_bytes: 64,
            item_size,
            format,
            readonly: false,
            c_contiguous: true,
        }
    }

    #[test]
    fn formats_in_native_order_match_and_others_do_not() {
        for format in [&b"f"[..], b"@f", b"=f", b"<f"] {
            assert!(Elem::F32.matches(format), "{format:?}");
        }
        for format in [&b">f"[..], b"!f", b"d", b"i", b"I", b"e", b"ff", b"", b"Zf"] {
            assert!(!Elem::F32.matches(format), "{format:?}");
        }
        for format in [&b"B"[..], b"<B", b">B", b"=B"] {
            assert!(Elem::U8.matches(format), "{format:?}");
        }
        for format in [&b"b"[..], b"c", b"?", b"f", b"BB"] {
            assert!(!Elem::U8.matches(format), "{format:?}");
        }
        for format in [&b"e"[..], b"<e", b"=e"] {
            assert!(Elem::F16.matches(format), "{format:?}");
        }
        for format in [&b"h"[..], b"H", b"<h", b"@H"] {
            assert!(Elem::Bf16.matches(format), "{format:?}");
        }
        for format in [&b">e"[..], b"h", b"f", b"ee"] {
            assert!(!Elem::F16.matches(format), "{format:?}");
        }
        for format in [&b">h"[..], b"e", b"i", b"B"] {
            assert!(!Elem::Bf16.matches(format), "{format:?}");
        }
    }

    #[test]
    fn wrong_type_names_the_argument_and_the_format() {
        let err = check("x", &export(b"d", 8), Some(Elem::F32), Access::Read).unwrap_err();
        assert_eq!(
            err.to_string(),
            r#"x must hold float32 elements, got buffer format "d" (8-byte items)"#
        );
        // A 4-byte item whose format is not float (int32) is refused too.
        assert!(check("x", &export(b"i", 4), Some(Elem::F32), Access::Read).is_err());
        // Any element type is fine as bytes.
        assert_eq!(check("dest", &export(b"d", 8), None, Access::Write), Ok(64));
    }

    #[test]
    fn layout_writability_and_alignment() {
        let strided = Export {
            c_contiguous: false,
            ..export(b"f", 4)
        };
        assert_eq!(
            check("x", &strided, Some(Elem::F32), Access::Read),
            Err(BufferError::NotContiguous { name: "x" })
        );
        let readonly = Export {
            readonly: true,
            ..export(b"f", 4)
        };
        assert_eq!(check("x", &readonly, Some(Elem::F32), Access::Read), Ok(16));
        assert_eq!(
            check("out", &readonly, Some(Elem::F32), Access::Write),
            Err(BufferError::ReadOnly { name: "out" })
        );
        let odd = Export {
            address: 4097,
            ..export(b"f", 4)
        };
        assert!(matches!(
            check("x", &odd, Some(Elem::F32), Access::Read),
            Err(BufferError::Misaligned { align: 4, .. })
        ));
        let empty = Export {
            address: 1,
            len_bytes: 0,
            ..export(b"f", 4)
        };
        assert_eq!(check("x", &empty, Some(Elem::F32), Access::Read), Ok(0));
    }

    #[test]
    fn overlap_is_any_shared_byte() {
        let ok = |a, b| disjoint(("out", a), ("x", b)).is_ok();
        assert!(ok((100, 10), (110, 10)) && ok((110, 10), (100, 10))); // adjacent
        assert!(!ok((100, 10), (109, 1)) && !ok((109, 1), (100, 10))); // last byte
        assert!(!ok((100, 10), (90, 100))); // contained
        assert!(ok((100, 0), (100, 10)) && ok((100, 10), (105, 0))); // empty ranges share nothing
        assert_eq!(
            disjoint(("out", (0, 8)), ("raw", (4, 8)))
                .unwrap_err()
                .to_string(),
            "out overlaps raw: they must not share memory"
        );
    }
}
