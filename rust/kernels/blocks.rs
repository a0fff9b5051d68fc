//! GGUF block formats: layouts, per-block scales and scalar code decoding.
//!
//! Every quantized type is described by a [`Format`]: a block of `BLOCK` elements is `BYTES` bytes holding
//! integer codes q and per-sub-block scales d (and, for affine types, offsets m), so that the weight is
//! `d[s] * q + m[s]` with s the sub-block of the element (`SUB` elements each). The kernels walk a block in
//! groups of 32 elements ([`GROUP`]) and compute `d[s] * Σ q·x + m[s] * Σ x`, with Σ x precomputed per group.
//!
//! The dense types (F32, F16, BF16) are [`Dense`]: one element per "block", converted to float32 exactly.

use super::halves::{bf16_value, f16_value};

/// Elements per group: the unit the kernels decode codes in (every block is a whole number of groups).
pub const GROUP: usize = 32;

/// Elements per activation scale for the K-quants' super-blocks of 256 (a span never crosses a weight block).
/// llama.cpp's Q8_K takes 256; 128 was measured as fast and half as lossy (Qwen2.5-Coder-1.5B Q4_K_M, decode
/// tok/s and perplexity over the float32 path, passes of 32 tokens: span 256 17.0, +0.77%; 128 17.2, +0.38%;
/// 32 15.2, +0.25%).
pub const K_SPAN: usize = 128;

/// Elements per activation scale for the ternary types: their whole block, as llama.cpp's Q8_K. A span's integer
/// sum then collects 8 groups before the float work, which is a sixth of a ternary kernel's instructions at 128.
pub const TERNARY_SPAN: usize = 256;
/// Most sub-blocks in any block (Q6_K: 16 sub-blocks of 16).
pub const MAX_SUBS: usize = 16;

/// A block-quantized GGUF type.
pub trait Format {
    /// Elements per block.
    const BLOCK: usize;
    /// Encoded bytes per block.
    const BYTES: usize;
    /// Elements sharing one scale: 32 (one per group) or 16 (two per group, Q6_K).
    const SUB: usize;
    /// Whether weights carry an offset m (`d * q + m`); otherwise m is zero and never read.
    const AFFINE: bool;
    /// Elements per activation scale in the integer kernels (8-bit activations): GROUP for the 32-element
    /// types, K_SPAN for the K-quants, TERNARY_SPAN for the ternary types. The integer kernels add a span's
    /// integer sums before any float work.
    const SPAN: usize;
    /// Scales d[s] and offsets m[s] of every sub-block of block `b` (m only if `AFFINE`).
    fn scales(b: &[u8], d: &mut [f32; MAX_SUBS], m: &mut [f32; MAX_SUBS]);
    /// Integer codes of group `g` of block `b`, already re-centred for the symmetric types.
    fn codes(b: &[u8], g: usize, q: &mut [i32; GROUP]);
}

/// A dense float type: element i of a row is `get(row, i)`.
pub trait Dense {
    const BYTES: usize;
    fn get(row: &[u8], i: usize) -> f32;
}

/// The little-endian IEEE half at byte `at` of `b`, exactly, as float32 (cheap enough to call per block: no
/// branch but the select for inf/nan).
#[inline(always)]
pub(crate) fn f16_at(b: &[u8], at: usize) -> f32 {
    f16_value(u16::from_le_bytes([b[at], b[at + 1]]))
}

/// Group g of a nibble-packed 16-byte field (Q4_0/Q4_1/Q5_0/Q5_1, one group per block):
/// element j < 16 is the low nibble of qs[j], element j >= 16 the high nibble of qs[j - 16].
fn legacy_nibble(qs: &[u8], j: usize) -> i32 {
    i32::from((qs[j % 16] >> (4 * (j / 16))) & 0x0F)
}

/// Q8_0 (34 B): d f16, qs 32 x int8.   x = d * q
pub struct Q8_0;
impl Format for Q8_0 {
    const BLOCK: usize = 32;
    const BYTES: usize = 34;
    const SUB: usize = 32;
    const AFFINE: bool = false;
    const SPAN: usize = GROUP;
    fn scales(b: &[u8], d: &mut [f32; MAX_SUBS], _m: &mut [f32; MAX_SUBS]) {
        d[0] = f16_at(b, 0);
    }
    fn codes(b: &[u8], _g: usize, q: &mut [i32; GROUP]) {
        for (j, q) in q.iter_mut().enumerate() {
            *q = i32::from(b[2 + j] as i8);
        }
    }
}

/// Q4_0 (18 B): d f16, qs 16 B (nibbles as in `legacy_nibble`).   x = d * (q - 8)
pub struct Q4_0;
impl Format for Q4_0 {
    const BLOCK: usize = 32;
    const BYTES: usize = 18;
    const SUB: usize = 32;
    const AFFINE: bool = false;
    const SPAN: usize = GROUP;
    fn scales(b: &[u8], d: &mut [f32; MAX_SUBS], _m: &mut [f32; MAX_SUBS]) {
        d[0] = f16_at(b, 0);
    }
    fn codes(b: &[u8], _g: usize, q: &mut [i32; GROUP]) {
        for (j, q) in q.iter_mut().enumerate() {
            *q = legacy_nibble(&b[2..18], j) - 8;
        }
    }
}

/// Q4_1 (20 B): d f16, m f16, qs 16 B (nibbles as Q4_0).   x = d * q + m
pub struct Q4_1;
impl Format for Q4_1 {
    const BLOCK: usize = 32;
    const BYTES: usize = 20;
    const SUB: usize = 32;
    const AFFINE: bool = true;
    const SPAN: usize = GROUP;
    fn scales(b: &[u8], d: &mut [f32; MAX_SUBS], m: &mut [f32; MAX_SUBS]) {
        d[0] = f16_at(b, 0);
        m[0] = f16_at(b, 2);
    }
    fn codes(b: &[u8], _g: usize, q: &mut [i32; GROUP]) {
        for (j, q) in q.iter_mut().enumerate() {
            *q = legacy_nibble(&b[4..20], j);
        }
    }
}

/// Q5_0/Q5_1 code j: low 4 bits as Q4_0 from qs, bit 4 is bit j of the little-endian u32 qh.
fn q5_code(qh: &[u8], qs: &[u8], j: usize) -> i32 {
    let high = u32::from_le_bytes([qh[0], qh[1], qh[2], qh[3]]) >> j & 1;
    legacy_nibble(qs, j) | (high as i32) << 4
}

/// Q5_0 (22 B): d f16, qh 4 B, qs 16 B.   x = d * (q - 16)
pub struct Q5_0;
impl Format for Q5_0 {
    const BLOCK: usize = 32;
    const BYTES: usize = 22;
    const SUB: usize = 32;
    const AFFINE: bool = false;
    const SPAN: usize = GROUP;
    fn scales(b: &[u8], d: &mut [f32; MAX_SUBS], _m: &mut [f32; MAX_SUBS]) {
        d[0] = f16_at(b, 0);
    }
    fn codes(b: &[u8], _g: usize, q: &mut [i32; GROUP]) {
        for (j, q) in q.iter_mut().enumerate() {
            *q = q5_code(&b[2..6], &b[6..22], j) - 16;
        }
    }
}

/// Q5_1 (24 B): d f16, m f16, qh 4 B, qs 16 B.   x = d * q + m
pub struct Q5_1;
impl Format for Q5_1 {
    const BLOCK: usize = 32;
    const BYTES: usize = 24;
    const SUB: usize = 32;
    const AFFINE: bool = true;
    const SPAN: usize = GROUP;
    fn scales(b: &[u8], d: &mut [f32; MAX_SUBS], m: &mut [f32; MAX_SUBS]) {
        d[0] = f16_at(b, 0);
        m[0] = f16_at(b, 2);
    }
    fn codes(b: &[u8], _g: usize, q: &mut [i32; GROUP]) {
        for (j, q) in q.iter_mut().enumerate() {
            *q = q5_code(&b[4..8], &b[8..24], j);
        }
    }
}

/// Q4_K/Q5_K scales: d f16 at 0, dmin f16 at 2, 12 bytes at 4 holding 8 pairs of 6-bit (sc, mn):
/// bytes 0-3: sc[0..4] (low 6 bits), bytes 4-7: mn[0..4]; their top 2 bits are bits 4-5 of sc[4..8] / mn[4..8],
/// whose low 4 bits are the low / high nibbles of bytes 8-11.   d[s] = d * sc[s], m[s] = -(dmin * mn[s])
/// (both products exact: 11-bit x 6-bit mantissas).
fn k_scales(b: &[u8], d: &mut [f32; MAX_SUBS], m: &mut [f32; MAX_SUBS]) {
    let (dd, dmin, s) = (f16_at(b, 0), f16_at(b, 2), &b[4..16]);
    for j in 0..8 {
        let (sc, mn) = if j < 4 {
            (s[j] & 63, s[j + 4] & 63)
        } else {
            (
                (s[j + 4] & 0x0F) | (s[j - 4] >> 6) << 4,
                (s[j + 4] >> 4) | (s[j] >> 6) << 4,
            )
        };
        d[j] = dd * f32::from(sc);
        m[j] = -(dmin * f32::from(mn));
    }
}

/// Q4_K/Q5_K low 4 bits of group g (sub-block g), from the 128-byte qs: the 32 bytes qs[32(g/2)..] hold
/// sub-block 2i in their low nibbles and 2i+1 in their high nibbles.
fn k_nibble(qs: &[u8], g: usize, j: usize) -> i32 {
    i32::from((qs[32 * (g / 2) + j] >> (4 * (g % 2))) & 0x0F)
}

/// Q4_K (144 B): d, dmin, scales 12 B (`k_scales`), qs 128 B (`k_nibble`); 8 sub-blocks of 32.
pub struct Q4K;
impl Format for Q4K {
    const BLOCK: usize = 256;
    const BYTES: usize = 144;
    const SUB: usize = 32;
    const AFFINE: bool = true;
    const SPAN: usize = K_SPAN;
    fn scales(b: &[u8], d: &mut [f32; MAX_SUBS], m: &mut [f32; MAX_SUBS]) {
        k_scales(b, d, m);
    }
    fn codes(b: &[u8], g: usize, q: &mut [i32; GROUP]) {
        for (j, q) in q.iter_mut().enumerate() {
            *q = k_nibble(&b[16..144], g, j);
        }
    }
}

/// Q5_K (176 B): d, dmin, scales 12 B (as Q4_K), qh 32 B, qs 128 B (as Q4_K);
/// bit 4 of element j of sub-block s is bit s of qh[j].
pub struct Q5K;
impl Format for Q5K {
    const BLOCK: usize = 256;
    const BYTES: usize = 176;
    const SUB: usize = 32;
    const AFFINE: bool = true;
    const SPAN: usize = K_SPAN;
    fn scales(b: &[u8], d: &mut [f32; MAX_SUBS], m: &mut [f32; MAX_SUBS]) {
        k_scales(b, d, m);
    }
    fn codes(b: &[u8], g: usize, q: &mut [i32; GROUP]) {
        for (j, q) in q.iter_mut().enumerate() {
            *q = k_nibble(&b[48..176], g, j) | i32::from((b[16 + j] >> g) & 1) << 4;
        }
    }
}

/// Q6_K (210 B): ql 128 B, qh 64 B, scales 16 x int8, d f16 at 208; 16 sub-blocks of 16.
/// Group g = 4h + t (half h of 128 elements): low 4 bits of element j are nibble t/2 of ql[64h + 32(t%2) + j],
/// bits 4-5 are (qh[32h + j] >> 2t) & 3.   x = (d * scales[s]) * (q - 32)
pub struct Q6K;
impl Format for Q6K {
    const BLOCK: usize = 256;
    const BYTES: usize = 210;
    const SUB: usize = 16;
    const AFFINE: bool = false;
    const SPAN: usize = K_SPAN;
    fn scales(b: &[u8], d: &mut [f32; MAX_SUBS], _m: &mut [f32; MAX_SUBS]) {
        let dd = f16_at(b, 208);
        for (s, d) in d.iter_mut().enumerate() {
            *d = dd * f32::from(b[192 + s] as i8);
        }
    }
    fn codes(b: &[u8], g: usize, q: &mut [i32; GROUP]) {
        let (h, t) = (g / 4, g % 4);
        for (j, q) in q.iter_mut().enumerate() {
            let low = (b[64 * h + 32 * (t % 2) + j] >> (4 * (t / 2))) & 0x0F;
            let high = (b[128 + 32 * h + j] >> (2 * t)) & 3;
            *q = i32::from(low | high << 4) - 32;
        }
    }
}

/// TQ2_0 (66 B): qs 64 B, d f16 at 64; ternary codes in 2 bits. Group g = 4h + l (half h of 128 elements):
/// element j is bits 2l..2l+2 of qs[32h + j].   x = d * (q - 1), q in 0..=2 (a stray 3 decodes as +2, as ggml's)
pub struct TQ2_0;
impl Format for TQ2_0 {
    const BLOCK: usize = 256;
    const BYTES: usize = 66;
    const SUB: usize = 32;
    const AFFINE: bool = false;
    const SPAN: usize = TERNARY_SPAN;
    fn scales(b: &[u8], d: &mut [f32; MAX_SUBS], _m: &mut [f32; MAX_SUBS]) {
        d[..8].fill(f16_at(b, 64));
    }
    fn codes(b: &[u8], g: usize, q: &mut [i32; GROUP]) {
        let (h, l) = (g / 4, g % 4);
        for (j, q) in q.iter_mut().enumerate() {
            *q = i32::from((b[32 * h + j] >> (2 * l)) & 3) - 1;
        }
    }
}

/// Powers of three: a TQ1_0 byte holds trit n as the top "digit" of (byte · 3ⁿ mod 256) · 3 / 256.
pub const POW3: [u8; 5] = [1, 3, 9, 27, 81];

/// Trit n (0..=2) of a TQ1_0 byte: ggml packs 5 (or 4) trits t as ceil(Σ tₙ 3^(4-n) · 256 / 243), so that
/// multiplying by 3ⁿ (mod 256) brings trit n to the top, and · 3 >> 8 reads it.
pub fn tq1_trit(byte: u8, n: usize) -> i32 {
    (i32::from(byte.wrapping_mul(POW3[n])) * 3) >> 8
}

/// Where TQ1_0 element `e` lives: (byte offset in the block, trit n). qs[0..32] hold elements 32n + j (n < 5),
/// qs[32..48] elements 160 + 16n + j, qh (bytes 48..52) elements 240 + 4n + j (n < 4).
pub fn tq1_place(e: usize) -> (usize, usize) {
    match e {
        0..160 => (e % 32, e / 32),
        160..240 => (32 + (e - 160) % 16, (e - 160) / 16),
        _ => (48 + (e - 240) % 4, (e - 240) / 4),
    }
}

/// TQ1_0 (54 B): qs 48 B (5 trits a byte), qh 4 B (4 trits a byte), d f16 at 52; element order as
/// `tq1_place`.   x = d * (q - 1)
pub struct TQ1_0;
impl Format for TQ1_0 {
    const BLOCK: usize = 256;
    const BYTES: usize = 54;
    const SUB: usize = 32;
    const AFFINE: bool = false;
    const SPAN: usize = TERNARY_SPAN;
    fn scales(b: &[u8], d: &mut [f32; MAX_SUBS], _m: &mut [f32; MAX_SUBS]) {
        d[..8].fill(f16_at(b, 52));
    }
    fn codes(b: &[u8], g: usize, q: &mut [i32; GROUP]) {
        for (j, q) in q.iter_mut().enumerate() {
            let (at, n) = tq1_place(GROUP * g + j);
            *q = tq1_trit(b[at], n) - 1;
        }
    }
}

/// F32: little-endian float32.
pub struct F32;
impl Dense for F32 {
    const BYTES: usize = 4;
    fn get(row: &[u8], i: usize) -> f32 {
        f32::from_le_bytes([row[4 * i], row[4 * i + 1], row[4 * i + 2], row[4 * i + 3]])
    }
}

/// F16: IEEE half precision.
pub struct F16;
impl Dense for F16 {
    const BYTES: usize = 2;
    fn get(row: &[u8], i: usize) -> f32 {
        f16_at(row, 2 * i)
    }
}

/// BF16: the top 16 bits of a float32.
pub struct BF16;
impl Dense for BF16 {
    const BYTES: usize = 2;
    fn get(row: &[u8], i: usize) -> f32 {
        bf16_value(u16::from_le_bytes([row[2 * i], row[2 * i + 1]]))
    }
}
