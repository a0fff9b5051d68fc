//! Encoded rows decoded to float32: what an embedding lookup needs (a few rows of the token table per step).
//!
//! Each element is `d[s] * q + m[s]` from the type's `Format` (the dense types: `Dense::get`), computed as
//! gguf-py's dequantizer computes it, so the two agree bit for bit: the scales are exact products of a float16 and
//! a small integer, then one multiply and (affine types) one add of the negated offset, with no fused multiply-add.

use super::blocks::{self, Dense, Format, GROUP, MAX_SUBS};
use super::matmul::{KernelError, QType};

/// raw: whole rows of `k` elements of type `qtype`, row after row -> out [rows, k] float32.
pub fn dequantize(raw: &[u8], qtype: QType, k: usize, out: &mut [f32]) -> Result<(), KernelError> {
    let (block, bytes) = qtype.block();
    if k == 0 || k % block != 0 {
        return Err(KernelError::Mismatch(format!(
            "k = {k} is not a positive multiple of the {qtype:?} block size {block}"
        )));
    }
    if qtype.interleaved_rows() {
        return Err(KernelError::Mismatch(format!(
            "{qtype:?}: rows interleaved for the products; restore them to {:?} rows first",
            qtype.plain()
        )));
    }
    let row_bytes = k / block * bytes;
    if raw.len() % row_bytes != 0 || out.len() != raw.len() / row_bytes * k {
        return Err(KernelError::Mismatch(format!(
            "raw has {} bytes and out {} floats: {qtype:?} rows of {k} take {row_bytes} bytes and give {k} floats \
             each",
            raw.len(),
            out.len()
        )));
    }
    let decode: fn(&[u8], &mut [f32]) = match qtype {
        QType::F32 => dense::<blocks::F32>,
        QType::F16 => dense::<blocks::F16>,
        QType::BF16 => dense::<blocks::BF16>,
        QType::Q4_0 => quantized::<blocks::Q4_0>,
        QType::Q4_1 => quantized::<blocks::Q4_1>,
        QType::Q4_1X8 | QType::Q4KX8 | QType::Q6KX8 => unreachable!("refused above"),
        QType::Q5_0 => quantized::<blocks::Q5_0>,
        QType::Q5_1 => quantized::<blocks::Q5_1>,
        QType::Q8_0 => quantized::<blocks::Q8_0>,
        QType::Q4K => quantized::<blocks::Q4K>,
        QType::Q5K => quantized::<blocks::Q5K>,
        QType::Q6K => quantized::<blocks::Q6K>,
        QType::TQ1_0 => quantized::<blocks::TQ1_0>,
        QType::TQ2_0 => quantized::<blocks::TQ2_0>,
    };
    decode(raw, out);
    Ok(())
}

/// Blocks of F, one after another, into out (F::BLOCK floats each).
fn quantized<F: Format>(raw: &[u8], out: &mut [f32]) {
    let (mut d, mut m) = ([0f32; MAX_SUBS], [0f32; MAX_SUBS]);
    let mut q = [0i32; GROUP];
    for (b, out) in raw
        .chunks_exact(F::BYTES)
        .zip(out.chunks_exact_mut(F::BLOCK))
    {
        F::scales(b, &mut d, &mut m);
        for (g, out) in out.chunks_exact_mut(GROUP).enumerate() {
            F::codes(b, g, &mut q);
            for (i, (w, &q)) in out.iter_mut().zip(&q).enumerate() {
                let s = (g * GROUP + i) / F::SUB;
                let scaled = d[s] * q as f32;
                *w = if F::AFFINE { scaled + m[s] } else { scaled };
            }
        }
    }
}

/// Dense elements, one after another.
fn dense<D: Dense>(raw: &[u8], out: &mut [f32]) {
    for (i, w) in out.iter_mut().enumerate() {
        *w = D::get(raw, i);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_q4_1_block_decodes_as_d_q_plus_m() {
        // d = 0.5, m = -1.0 (float16), codes 0..15 then 15..0.
        let mut b = vec![0x00, 0x38, 0x00, 0xBC];
        b.extend((0..16u8).map(|j| j | (15 - j) << 4));
        let mut out = [0f32; 32];
        dequantize(&b, QType::Q4_1, 32, &mut out).unwrap();
        let want: Vec<f32> = (0..32)
            .map(|i| 0.5 * (if i < 16 { i } else { 31 - i }) as f32 - 1.0)
            .collect();
        assert_eq!(out.to_vec(), want);
    }

    #[test]
    fn sizes_that_are_not_whole_rows_are_refused() {
        let mut out = [0f32; 32];
        assert!(dequantize(&[0u8; 19], QType::Q4_1, 32, &mut out).is_err());
        assert!(dequantize(&[0u8; 20], QType::Q4_1, 33, &mut out).is_err());
        assert!(dequantize(&[0u8; 20], QType::Q4_1, 32, &mut out[..31]).is_err());
    }
}
