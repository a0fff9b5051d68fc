//! Activations quantized to 8 bits per span of elements, as llama.cpp quantizes them for its integer dot products:
//! - `Q8Rows::q8_0`: spans of 32, exactly llama.cpp's (and gguf-py's) Q8_0 blocks: d = max|x| / 127 rounded to
//!   float16, codes q = round(x / d') with d' the float32 d before rounding (ties away from zero);
//! - `Q8Rows::q8_k`: longer spans (`blocks::K_SPAN`: 128 for the K-quants, llama.cpp's Q8_K takes 256;
//!   `blocks::TERNARY_SPAN`: 256 for the ternary types) with a float32 d = max|x| / 127: a span's integer sums
//!   over several 32-element groups add up before any float work.
//! Either way x ≈ x̂ = d·q. The integer kernels multiply weight codes with these codes and scale each span's
//! integer sum once. Affine weight types (d·q + m) take Σx̂ = d·Σq per 32 elements, as llama.cpp's Q8_1 and
//! Q8_K's bsums, so every product is exactly W · x̂.

use super::blocks::GROUP;

/// x [t, k] as 8-bit codes with one scale per span.
pub struct Q8Rows {
    /// [t, k] codes in -127..=127, row-major.
    pub codes: Vec<i8>,
    /// [t, k / span] scales.
    pub scales: Vec<f32>,
    /// [t, k / GROUP] Σx̂ = scale · Σcodes of each 32 elements (what affine weights' offsets multiply).
    pub sums: Vec<f32>,
    /// [t, k / GROUP] Σcodes of each 32 elements: what the AVX2 group kernels take off a signed type's products
    /// when they multiply its codes offset by 128, and what Q4_K's offsets multiply in its AVX2 kernels (exact
    /// integers, so that plain and interleaved rows agree bit for bit: `SuperBlock::SPAN_TOTALS`).
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    pub code_sums: Vec<i32>,
    /// [t, k / 64] (spans longer than 32 only, else empty) the Σcodes of groups 2p and 2p + 1 in the low and high
    /// 16 bits of word p (|Σ| <= 32 · 127 < 2^15): one `madd` multiplies both by a weight row's two 16-bit
    /// offset multipliers (Q4_K's interleaved kernels).
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    pub code_sum_pairs: Vec<i32>,
    /// [t, k / (span / 8)] Σcodes of each eighth of a span (spans longer than 32 only, else empty): per span, the
    /// integer Σx the K-quant and ternary kernels take off their codes' sums, as one vector of 8 lanes (read by
    /// the AVX2 kernels only).
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    pub lane_sums: Vec<i32>,
    /// [t, k / 8] -32 · Σcodes of each run of 8 codes (`add_neg32_eight_sums`, else empty): where Q6_K's lane
    /// kernels with VNNI's products start the sum of each half of a sub-block of 16, whose weight codes are stored
    /// as q + 32 (`q6k_lanes`).
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    pub neg32_eight_sums: Vec<i32>,
    /// The codes by token (`add_token_columns`, else empty), as AMX tiles of activations take them: in tiles of
    /// up to COLUMN_TOKENS rows (tile t0.. at t0 · k / 4), each [k / 4, COLUMN_TOKENS] words of 4 codes, word w
    /// of the tile's rows side by side in one 64-byte row. A tile of n rows holds `column_fold(n)` = f runs of
    /// 16 / f columns: word w of row t in column (w % 4f) / 4 · 16 / f + t, zero elsewhere, so that a product over
    /// these words finds the sums of each run of 16 codes of a row apart (`avx2::tiles`: Q6_K's sub-blocks each
    /// have a scale). Unused columns are zero.
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    pub columns: Vec<i32>,
    /// The scales by token: tile t0.. of n rows at t0 · spans, as [spans, n].
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    pub column_scales: Vec<f32>,
    /// The codes by pair of 32-element groups (`add_group_pairs`, else empty), as AMX tiles of activations take
    /// them for Q4_K: in chunks of up to PAIR_TOKENS rows, chunk c (rows 8c.., n of them) and pair h (groups 2h and
    /// 2h + 1) one block-diagonal tile [PAIR_TILE_ROWS, 64] at (c · k / 64 + h) · PAIR_TILE_BYTES: row r < n
    /// holds row 8c + r's codes of group 2h in bytes 0-31, row n + r its codes of group 2h + 1 in bytes 32-63,
    /// zeros elsewhere. A product with two groups' weight codes so finds each (row, group) sum apart.
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    pub pairs: Vec<i8>,
    span: usize,
    k: usize,
}

/// Activation rows per tile of `Q8Rows::columns`: the rows of an AMX tile.
pub const COLUMN_TOKENS: usize = 16;

/// Activation rows per chunk of `Q8Rows::pairs`: each tile holds two groups of each.
pub const PAIR_TOKENS: usize = 8;
/// Rows of a tile of `Q8Rows::pairs`, and bytes.
pub const PAIR_TILE_ROWS: usize = 2 * PAIR_TOKENS;
pub const PAIR_TILE_BYTES: usize = PAIR_TILE_ROWS * 2 * GROUP;

/// Runs of 16 codes side by side in a tile of `Q8Rows::columns` of n rows: 2 up to 8 rows (two runs of 8
/// columns), else 1.
pub fn column_fold(n: usize) -> usize {
    if n <= COLUMN_TOKENS / 2 {
        2
    } else {
        1
    }
}

impl Q8Rows {
    /// x [t, k] in spans of `span` (k a multiple of it): `q8_0` for spans of 32, else `q8_k`.
    pub fn in_spans(x: &[f32], k: usize, span: usize) -> Q8Rows {
        if span == GROUP {
            Q8Rows::q8_0(x, k)
        } else {
            Q8Rows::q8_k(x, k, span)
        }
    }

    /// llama.cpp's Q8_0 of x [t, k] (k a multiple of 32).
    pub fn q8_0(x: &[f32], k: usize) -> Q8Rows {
        Q8Rows::quantize(x, k, GROUP, true)
    }

    /// Spans of `span` elements with float32 scales, for the K-quants and ternary types (k a multiple of span).
    pub fn q8_k(x: &[f32], k: usize, span: usize) -> Q8Rows {
        Q8Rows::quantize(x, k, span, false)
    }

    /// x in spans of `span`, scales rounded to float16 if `f16_scales`. The activations of every product are
    /// quantized on the calling thread before the kernel threads start, so this is on the critical path: with
    /// AVX-512 (or AVX2) the whole loop (codes, scales, sums) is compiled for it, the same bits as without.
    fn quantize(x: &[f32], k: usize, span: usize, f16_scales: bool) -> Q8Rows {
        // Whole spans of whole groups (the AVX2 encoder reads 32 elements at a time); longer spans in eighths of
        // whole runs of 16 codes, whose sums `quantize_with` adds up.
        assert!(span % GROUP == 0 && k % span == 0 && x.len() % k == 0);
        assert!(span == GROUP || span % 128 == 0);
        #[cfg(target_arch = "x86_64")]
        {
            if avx512_quantizer() {
                // SAFETY: the CPU has AVX-512 F/BW/VL and F16C.
                return unsafe { quantize_avx512(x, k, span, f16_scales) };
            }
            if is_x86_feature_detected!("avx2") {
                // SAFETY: the CPU has AVX2.
                return unsafe { quantize_avx2(x, k, span, f16_scales) };
            }
        }
        quantize_with(
            x,
            k,
            span,
            |q, d| encode_spans(x, f16_scales, q, d, encode),
            sixteen_sums,
        )
    }

    /// Fills `columns` and `column_scales` (the AMX kernels' layout of the codes).
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    pub fn add_token_columns(&mut self) {
        let (k, spans) = (self.k, self.k / self.span);
        let (t, words) = (self.codes.len() / k, k / 4);
        self.columns = vec![0; t.next_multiple_of(COLUMN_TOKENS) * words];
        self.column_scales = vec![0.0; t * spans];
        for t0 in (0..t).step_by(COLUMN_TOKENS) {
            let n = (t - t0).min(COLUMN_TOKENS);
            let fold = column_fold(n);
            let columns = &mut self.columns[t0 * words..][..COLUMN_TOKENS * words];
            let scales = &mut self.column_scales[t0 * spans..][..n * spans];
            for r in 0..n {
                let row = &self.codes[(t0 + r) * k..][..k];
                for (w, code) in row.chunks_exact(4).enumerate() {
                    let column = (w % (4 * fold)) / 4 * (COLUMN_TOKENS / fold) + r;
                    columns[w * COLUMN_TOKENS + column] =
                        i32::from_le_bytes([code[0], code[1], code[2], code[3]].map(|c| c as u8));
                }
                for (si, &scale) in self.scales[(t0 + r) * spans..][..spans].iter().enumerate() {
                    scales[si * n + r] = scale;
                }
            }
        }
    }

    /// Fills `neg32_eight_sums` (Q6_K's lane kernels with VNNI's products).
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    pub fn add_neg32_eight_sums(&mut self) {
        let mut sums = vec![0; self.codes.len() / 8];
        #[cfg(target_arch = "x86_64")]
        if is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU has AVX2.
            unsafe { neg32_eight_sums_avx2(&self.codes, &mut sums) };
            self.neg32_eight_sums = sums;
            return;
        }
        neg32_eight_sums(&self.codes, &mut sums);
        self.neg32_eight_sums = sums;
    }

    /// Fills `pairs` (Q4_K's AMX kernel's layout of the codes).
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    pub fn add_group_pairs(&mut self) {
        let k = self.k;
        let (t, pairs) = (self.codes.len() / k, k / (2 * GROUP));
        self.pairs = vec![0; t.div_ceil(PAIR_TOKENS) * pairs * PAIR_TILE_BYTES];
        for (c, chunk) in self.codes.chunks(PAIR_TOKENS * k).enumerate() {
            let n = chunk.len() / k;
            let tiles = self.pairs[c * pairs * PAIR_TILE_BYTES..].chunks_exact_mut(PAIR_TILE_BYTES);
            for (h, tile) in tiles.take(pairs).enumerate() {
                for (r, row) in chunk.chunks_exact(k).enumerate() {
                    let (even, odd) = row[2 * GROUP * h..][..2 * GROUP].split_at(GROUP);
                    tile[2 * GROUP * r..][..GROUP].copy_from_slice(even);
                    tile[2 * GROUP * (n + r) + GROUP..][..GROUP].copy_from_slice(odd);
                }
            }
        }
    }

    /// Elements per scale.
    pub fn span(&self) -> usize {
        self.span
    }

    /// Codes of group `gi` (32 elements) of activation row `ti`.
    pub fn group(&self, ti: usize, gi: usize) -> &[i8] {
        &self.codes[ti * self.k + gi * GROUP..][..GROUP]
    }

    /// Scale of the span holding group `gi` of activation row `ti`.
    pub fn scale(&self, ti: usize, gi: usize) -> f32 {
        self.scales[ti * (self.k / self.span) + gi * GROUP / self.span]
    }

    /// Σx̂ of group `gi` of activation row `ti`.
    pub fn sum(&self, ti: usize, gi: usize) -> f32 {
        self.sums[ti * (self.k / GROUP) + gi]
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn quantize_avx2(x: &[f32], k: usize, span: usize, f16_scales: bool) -> Q8Rows {
    // SAFETY: this function runs with AVX2.
    quantize_with(
        x,
        k,
        span,
        |q, d| encode_spans(x, f16_scales, q, d, |x, q| unsafe { encode_avx2(x, q) }),
        sixteen_sums,
    )
}

/// Whether `quantize_avx512` runs here.
#[cfg(target_arch = "x86_64")]
fn avx512_quantizer() -> bool {
    super::avx512::available() && is_x86_feature_detected!("f16c")
}

/// `Q8Rows::quantize` in AVX-512: sixteen elements a vector, float16 scales by F16C, the sums of codes by
/// `vpsadbw`; the same bits as the portable build. 2.0-2.6x faster than AVX2's (0.29 against 0.76 ns an element
/// at T = 8, k = 576, Sapphire Rapids VM): in a SmolLM2 pass over 8 rows, AVX2's took ~0.9 ms of ~14, while the
/// second kernel thread waited.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,f16c")]
fn quantize_avx512(x: &[f32], k: usize, span: usize, f16_scales: bool) -> Q8Rows {
    // SAFETY (both): this function runs with AVX-512 F/BW/VL and F16C.
    quantize_with(
        x,
        k,
        span,
        |q, d| unsafe { encode_avx512(x, f16_scales, q, d) },
        |codes, sums| unsafe { sixteen_sums_avx512(codes, sums) },
    )
}

/// The codes and scale of every span (as many as `scales`), span by span with `encode` (which returns d).
#[inline(always)]
fn encode_spans(
    x: &[f32],
    f16_scales: bool,
    codes: &mut [i8],
    scales: &mut [f32],
    encode: impl Fn(&[f32], &mut [i8]) -> f32,
) {
    let span = x.len() / scales.len();
    for ((x, q), scale) in x
        .chunks_exact(span)
        .zip(codes.chunks_exact_mut(span))
        .zip(scales)
    {
        let d = encode(x, q);
        *scale = if f16_scales { round_to_f16(d) } else { d };
    }
}

/// `Q8Rows::quantize` with `encode` for the codes and scales of every span, and `sixteens` for the sums of every
/// run of 16 codes, from which the sums per group and per eighth of a span follow.
#[inline(always)]
fn quantize_with(
    x: &[f32],
    k: usize,
    span: usize,
    encode: impl FnOnce(&mut [i8], &mut [f32]),
    sixteens: impl Fn(&[i8], &mut [i32]),
) -> Q8Rows {
    let mut codes = vec![0i8; x.len()];
    let mut scales = vec![0f32; x.len() / span];
    encode(&mut codes, &mut scales);
    let mut by_16 = vec![0i32; x.len() / 16];
    sixteens(&codes, &mut by_16);
    let code_sums: Vec<i32> = by_16
        .chunks_exact(GROUP / 16)
        .map(|s| s[0] + s[1])
        .collect();
    let mut sums = vec![0f32; code_sums.len()];
    let span_sums = sums
        .chunks_exact_mut(span / GROUP)
        .zip(code_sums.chunks_exact(span / GROUP));
    for ((sums, code_sums), &d) in span_sums.zip(&scales) {
        for (sum, &c) in sums.iter_mut().zip(code_sums) {
            *sum = d * c as f32;
        }
    }
    // Only the kernels of longer spans read Σcodes per eighth of a span, or per pair of groups.
    let (lane_sums, code_sum_pairs) = if span == GROUP {
        (Vec::new(), Vec::new())
    } else {
        (
            by_16
                .chunks_exact(span / 8 / 16)
                .map(|s| s.iter().sum())
                .collect::<Vec<i32>>(),
            code_sums
                .chunks_exact(2)
                .map(|p| (p[0] & 0xFFFF) | (p[1] << 16))
                .collect(),
        )
    };
    Q8Rows {
        codes,
        scales,
        sums,
        code_sums,
        code_sum_pairs,
        lane_sums,
        neg32_eight_sums: Vec::new(),
        columns: Vec::new(),
        column_scales: Vec::new(),
        pairs: Vec::new(),
        span,
        k,
    }
}

/// Σcodes of each run of 16 codes (codes.len() a multiple of 16).
fn sixteen_sums(codes: &[i8], sums: &mut [i32]) {
    for (s, run) in sums.iter_mut().zip(codes.chunks_exact(16)) {
        *s = code_sum(run);
    }
}

/// Σ of 8-bit codes.
#[inline(always)]
fn code_sum(codes: &[i8]) -> i32 {
    codes.iter().map(|&c| i32::from(c)).sum()
}

/// -32 · Σcodes of each run of 8 codes (codes.len() a multiple of 8).
fn neg32_eight_sums(codes: &[i8], sums: &mut [i32]) {
    for (s, run) in sums.iter_mut().zip(codes.chunks_exact(8)) {
        *s = -32 * code_sum(run);
    }
}

/// `neg32_eight_sums` in AVX2: 32 codes a vector, offset by 128 to bytes that `vpsadbw` adds up by eight, then
/// -32 · (Σ - 8 · 128) = (1024 - Σ) << 5.
///
/// # Safety
/// The CPU must have AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn neg32_eight_sums_avx2(codes: &[i8], sums: &mut [i32]) {
    use std::arch::x86_64::*;
    let whole = codes.len() / 32 * 32;
    let offset = _mm256_set1_epi8(i8::MIN);
    // Dwords 0, 2, 4 and 6: the low halves of the four qword sums.
    let low_dwords = _mm256_setr_epi32(0, 2, 4, 6, 0, 0, 0, 0);
    let bias = _mm_set1_epi32(8 * 128);
    for i in (0..whole).step_by(32) {
        // SAFETY: i + 32 <= codes.len().
        let v = unsafe { _mm256_loadu_si256(codes.as_ptr().add(i).cast()) };
        let by_8 = _mm256_sad_epu8(_mm256_xor_si256(v, offset), _mm256_setzero_si256());
        let four = _mm256_castsi256_si128(_mm256_permutevar8x32_epi32(by_8, low_dwords));
        // SAFETY: sums holds codes.len() / 8 values, so i / 8 + 4 <= sums.len().
        unsafe {
            _mm_storeu_si128(
                sums.as_mut_ptr().add(i / 8).cast(),
                _mm_slli_epi32::<5>(_mm_sub_epi32(bias, four)),
            )
        };
    }
    neg32_eight_sums(&codes[whole..], &mut sums[whole / 8..]);
}

/// `encode` in AVX2, the same operations on eight elements at once (same bits); x.len() a multiple of 32.
///
/// # Safety
/// The CPU must have AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn encode_avx2(x: &[f32], q: &mut [i8]) -> f32 {
    use std::arch::x86_64::*;
    debug_assert!(x.len() % GROUP == 0 && q.len() == x.len());
    let magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(i32::MAX));
    let load = |i: usize| {
        // SAFETY: i + 8 <= x.len() at every call below.
        unsafe { _mm256_loadu_ps(x.as_ptr().add(i)) }
    };
    // max|x|: a NaN element as `vmaxps`'s first operand yields the second, so it is skipped, as f32::max skips it.
    let mut m = _mm256_setzero_ps();
    for i in (0..x.len()).step_by(8) {
        m = _mm256_max_ps(_mm256_and_ps(load(i), magnitude), m);
    }
    let m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    let m2 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    let amax = _mm_cvtss_f32(_mm_max_ss(m2, _mm_movehdup_ps(m2)));
    let d = amax / 127.0;
    let id = _mm256_set1_ps(if d == 0.0 { 0.0 } else { 1.0 / d });
    let (half, one, sign) = (
        _mm256_set1_ps(0.5),
        _mm256_set1_ps(1.0),
        _mm256_set1_ps(-0.0),
    );
    let (lo, hi) = (_mm256_set1_ps(-127.0), _mm256_set1_ps(127.0));
    let code = |i: usize| {
        let y = _mm256_mul_ps(load(i), id);
        let t = _mm256_round_ps(y, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
        let frac = _mm256_and_ps(_mm256_sub_ps(y, t), magnitude);
        let step = _mm256_or_ps(_mm256_and_ps(y, sign), one);
        let r = _mm256_blendv_ps(
            t,
            _mm256_add_ps(t, step),
            _mm256_cmp_ps(frac, half, _CMP_GE_OQ),
        );
        // NaN to 0 (as a float's cast does), then the clamp; the values are whole, so truncation is exact.
        let r = _mm256_and_ps(r, _mm256_cmp_ps(r, r, _CMP_ORD_Q));
        _mm256_cvttps_epi32(_mm256_min_ps(_mm256_max_ps(r, lo), hi))
    };
    for i in (0..x.len()).step_by(32) {
        // Packing works within 128-bit halves: bytes come out as 4-element runs of the four vectors in the order
        // a0 b0 c0 d0 a1 b1 c1 d1 (run 0: elements 0-3, run 1: 4-7), which the permutation puts back in place.
        let ab = _mm256_packs_epi32(code(i), code(i + 8));
        let cd = _mm256_packs_epi32(code(i + 16), code(i + 24));
        let bytes = _mm256_permutevar8x32_epi32(
            _mm256_packs_epi16(ab, cd),
            _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7),
        );
        // SAFETY: i + 32 <= q.len().
        unsafe { _mm256_storeu_si256(q.as_mut_ptr().add(i).cast(), bytes) };
    }
    d
}

/// `encode_spans` with `encode` in AVX-512 (same bits): sixteen elements a vector, and the scales of sixteen spans
/// a vector (d = max|x| / 127, float16 rounding by F16C, 1 / d), so that no span waits on its own divisions.
///
/// # Safety
/// The CPU must have AVX-512 F/BW/VL and F16C.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,f16c")]
unsafe fn encode_avx512(x: &[f32], f16_scales: bool, codes: &mut [i8], scales: &mut [f32]) {
    use std::arch::x86_64::*;
    let span = x.len() / scales.len();
    debug_assert!(span % 16 == 0 && codes.len() == x.len());
    let load = |i: usize| {
        // SAFETY: i + 16 <= x.len() at every call below.
        unsafe { _mm512_loadu_ps(x.as_ptr().add(i)) }
    };
    // max|x| of each span: a NaN element as `vmaxps`'s first operand yields the second, so it is skipped.
    for (si, scale) in scales.iter_mut().enumerate() {
        let mut m = _mm512_setzero_ps();
        for i in (si * span..(si + 1) * span).step_by(16) {
            m = _mm512_max_ps(_mm512_abs_ps(load(i)), m);
        }
        *scale = _mm512_reduce_max_ps(m);
    }
    // d and 1 / d (0 for d = 0), sixteen spans at a time.
    let mut inverses = vec![0f32; scales.len()];
    for (d, id) in scales.chunks_mut(16).zip(inverses.chunks_mut(16)) {
        let lanes = ((1u32 << d.len()) - 1) as __mmask16;
        let v = _mm512_div_ps(
            _mm512_maskz_loadu_ps(lanes, d.as_ptr()),
            _mm512_set1_ps(127.0),
        );
        let nonzero = _mm512_cmp_ps_mask::<_CMP_NEQ_OQ>(v, _mm512_setzero_ps());
        let inverse = _mm512_maskz_div_ps(nonzero, _mm512_set1_ps(1.0), v);
        _mm512_mask_storeu_ps(id.as_mut_ptr(), lanes, inverse);
        _mm512_mask_storeu_ps(d.as_mut_ptr(), lanes, v);
        if f16_scales {
            // Rounded by the conversion (ties to even); past float16's range, where it gives infinity, by
            // `round_to_f16` (the rounded values stay below 65520).
            let beyond = _mm512_cmp_ps_mask::<_CMP_GE_OQ>(v, _mm512_set1_ps(65520.0));
            let rounded = _mm512_cvtph_ps(_mm512_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(v));
            _mm512_mask_storeu_ps(d.as_mut_ptr(), lanes & !beyond, rounded);
            if beyond != 0 {
                for d in d.iter_mut().filter(|d| **d >= 65520.0) {
                    *d = round_to_f16(*d);
                }
            }
        }
    }
    // Rounding half away from zero is truncation after adding ±(0.5 - 2^-25) with y's sign: exact for every
    // float (y + 0.49999997 rounds up to the next integer only from y's upper half, and for |y| >= 2^23 adds
    // nothing); the clamp comes before the truncation, which `vcvttps2dq` does.
    let below_half = _mm512_set1_epi32((0.5f32 - f32::EPSILON / 4.0).to_bits() as i32);
    let sign = _mm512_set1_epi32(i32::MIN);
    let (lo, hi) = (_mm512_set1_ps(-127.0), _mm512_set1_ps(127.0));
    for (si, &id) in inverses.iter().enumerate() {
        let id = _mm512_set1_ps(id);
        for i in (si * span..(si + 1) * span).step_by(16) {
            let y = _mm512_mul_ps(load(i), id);
            // (y & sign) | 0.49999997's bits.
            let nudge = _mm512_ternarylogic_epi32::<0xEA>(_mm512_castps_si512(y), sign, below_half);
            let r = _mm512_add_ps(y, _mm512_castsi512_ps(nudge));
            // NaN to 0 (as a float's cast does), then the clamp.
            let r = _mm512_maskz_max_ps(_mm512_cmp_ps_mask::<_CMP_ORD_Q>(r, r), r, lo);
            let q = _mm512_cvtsepi32_epi8(_mm512_cvttps_epi32(_mm512_min_ps(r, hi)));
            // SAFETY: i + 16 <= codes.len().
            unsafe { _mm_storeu_si128(codes.as_mut_ptr().add(i).cast(), q) };
        }
    }
}

/// `sixteen_sums` in AVX-512: 64 codes a vector, offset by 128 to bytes that `vpsadbw` adds up by eight.
///
/// # Safety
/// The CPU must have AVX-512 F/BW.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn sixteen_sums_avx512(codes: &[i8], sums: &mut [i32]) {
    use std::arch::x86_64::*;
    let whole = codes.len() / 64 * 64;
    let offset = _mm512_set1_epi8(i8::MIN);
    // Dwords 0, 4, 8 and 12: the low halves of the four 16-byte sums (each in the even qword of its lane).
    let low_dwords = _mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
    let bias = _mm_set1_epi32(16 * 128);
    for i in (0..whole).step_by(64) {
        // SAFETY: i + 64 <= codes.len().
        let v = unsafe { _mm512_loadu_si512(codes.as_ptr().add(i).cast()) };
        // Σ(code + 128) of each 8 bytes, in 8 qwords; then of each 16, in the even qword of each 128-bit lane.
        let by_8 = _mm512_sad_epu8(_mm512_xor_si512(v, offset), _mm512_setzero_si512());
        let by_16 = _mm512_add_epi64(by_8, _mm512_shuffle_epi32::<0x4E>(by_8));
        let four = _mm512_castsi512_si128(_mm512_permutexvar_epi32(low_dwords, by_16));
        // SAFETY: sums holds codes.len() / 16 values, so i / 16 + 4 <= sums.len().
        unsafe {
            _mm_storeu_si128(
                sums.as_mut_ptr().add(i / 16).cast(),
                _mm_sub_epi32(four, bias),
            )
        };
    }
    sixteen_sums(&codes[whole..], &mut sums[whole / 16..]);
}

/// One span's codes into `q`: q = round(x / d) with d = max|x| / 127 (0 when x is all zeros), ties away from
/// zero; returns d.
#[inline(always)]
fn encode(x: &[f32], q: &mut [i8]) -> f32 {
    // max|x| over 8 lanes, so that the loop vectorizes (max is exact: the order does not matter).
    let mut lanes = [0f32; 8];
    for chunk in x.chunks_exact(8) {
        for (m, v) in lanes.iter_mut().zip(chunk) {
            *m = m.max(v.abs());
        }
    }
    let amax = x
        .chunks_exact(8)
        .remainder()
        .iter()
        .fold(lanes.into_iter().fold(0f32, f32::max), |m, v| {
            m.max(v.abs())
        });
    let d = amax / 127.0;
    let id = if d == 0.0 { 0.0 } else { 1.0 / d };
    for (q, &v) in q.iter_mut().zip(x) {
        // f32::round (ties away from zero) in a form that vectorizes: y - trunc(y) is exact.
        let y = v * id;
        let t = y.trunc();
        let r = if (y - t).abs() >= 0.5 {
            t + 1f32.copysign(y)
        } else {
            t
        };
        // |y| <= 127 (+ rounding), except where 1/d overflows to inf (max|x| below ~3.7e-37): the clamp keeps
        // codes in -127..=127 there too, which the kernels' 16-bit pair sums rely on (a NaN casts to 0). Through
        // i32: a float's saturating cast to i8 compiles to one scalar conversion per element, to i32 it vectorizes.
        *q = r.clamp(-127.0, 127.0) as i32 as i8;
    }
    d
}

/// `v` (finite, >= 0, below 65520) rounded to the nearest float16 value, ties to even, as float32: the scale
/// llama.cpp stores in a Q8_0 block.
pub fn round_to_f16(v: f32) -> f32 {
    const TWO_POW_24: f32 = 16_777_216.0;
    if v < 1.0 / 16384.0 {
        // Below 2^-14, the smallest normal float16: subnormals are multiples of 2^-24, and v * 2^24 < 2^10 is
        // exact, so is rounding it.
        return (v * TWO_POW_24).round_ties_even() / TWO_POW_24;
    }
    // Normal float16: keep 10 of float32's 23 mantissa bits, ties to even (a carry moves into the exponent).
    let bits = v.to_bits();
    let rem = bits & 0x1FFF;
    let base = bits - rem;
    let up = rem > 0x1000 || (rem == 0x1000 && base & 0x2000 != 0);
    f32::from_bits(if up { base + 0x2000 } else { base })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn f16_rounding_matches_the_half_crate() {
        let mut s = 7u64;
        for i in 0..200_000u32 {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            // magnitudes from 2^-30 to 2^15, every mantissa pattern
            let v = f32::from_bits(((s >> 40) as u32 & 0x007F_FFFF) | ((97 + i % 45) << 23));
            let want = half::f16::from_f32(v).to_f32();
            assert_eq!(round_to_f16(v).to_bits(), want.to_bits(), "{v:e}");
        }
        assert_eq!(round_to_f16(0.0), 0.0);
    }

    /// The vectorized rounding is `f32::round`'s, ties and near-ties included: every tie up to ±126.5 and the 32
    /// floats on either side of each.
    #[test]
    fn codes_round_half_away_from_zero() {
        let mut x: Vec<f32> = (-254..=254).map(|i| i as f32 * 0.5).collect(); // every tie, max 127
        for tie in (0..127).map(|n| n as f32 + 0.5) {
            let (mut below, mut above) = (tie, tie);
            for _ in 0..32 {
                (below, above) = (below.next_down(), above.next_up());
                x.extend([below, above, -below, -above]);
            }
        }
        x.extend([126.49999, -1.4999999]);
        x.resize(x.len().next_multiple_of(128), 0.0);
        // One span, through this CPU's build (AVX-512 or AVX2 where present), then the portable one.
        let q8 = Q8Rows::q8_k(&x, x.len(), x.len());
        assert_eq!(q8.scales, [127.0 / 127.0]);
        for (c, v) in q8.codes.iter().zip(&x) {
            assert_eq!(i32::from(*c), v.round() as i32, "{v}");
        }
        let mut plain = vec![0i8; x.len()];
        assert_eq!(encode(&x, &mut plain), q8.scales[0]);
        assert_eq!(plain, q8.codes);
    }

    #[test]
    fn codes_and_scales_reconstruct_the_group() {
        let x: Vec<f32> = (0..64)
            .map(|i| ((i * 37 % 64) as f32 - 31.5) * 0.1)
            .collect();
        let q = Q8Rows::q8_0(&x, 64);
        for gi in 0..2 {
            let d = q.scale(0, gi);
            assert!(q.group(0, gi).iter().any(|&c| c.abs() == 127));
            for (c, v) in q.group(0, gi).iter().zip(&x[gi * 32..]) {
                assert!((f32::from(*c) * d - v).abs() <= d * 0.51 + v.abs() * 1e-3);
            }
        }
        let zero = Q8Rows::q8_0(&[0.0; 32], 32);
        assert!(zero.codes.iter().all(|&c| c == 0) && zero.scales == [0.0]);
    }

    /// A span so small that 1/d overflows to inf still gets codes in -127..=127 (the kernels' 16-bit pair sums
    /// rely on it): no -128, and zeros stay 0.
    #[test]
    fn codes_stay_within_127_when_the_scale_is_tiny() {
        let mut x = [0f32; 32];
        x[..4].copy_from_slice(&[1e-38, -1e-38, -4e-39, 0.0]);
        let q8 = Q8Rows::q8_k(&x, 32, 32);
        let d = q8.scales[0];
        assert!(d > 0.0 && (1.0 / d).is_infinite());
        assert_eq!(q8.codes[..4], [127, -127, -127, 0]);
    }

    /// Every build this CPU runs (AVX2, AVX-512) gives the portable rows bit for bit (codes, scales, sums), for
    /// every span length and both kinds of scale, on spans of every magnitude (float16 subnormals to past its
    /// range) and with infinities, NaNs, zeros and scales whose inverse overflows among them.
    #[test]
    fn every_build_gives_the_same_rows() {
        let portable = |x: &[f32], k: usize, span: usize, f16: bool| {
            quantize_with(
                x,
                k,
                span,
                |q, d| encode_spans(x, f16, q, d, encode),
                sixteen_sums,
            )
        };
        let mut builds: Vec<(&str, fn(&[f32], usize, usize, bool) -> Q8Rows)> = Vec::new();
        #[cfg(target_arch = "x86_64")]
        {
            if is_x86_feature_detected!("avx2") {
                // SAFETY: the CPU has AVX2.
                builds.push(("avx2", |x, k, s, f| unsafe { quantize_avx2(x, k, s, f) }));
            }
            if avx512_quantizer() {
                // SAFETY: the CPU has AVX-512 F/BW/VL and F16C.
                builds.push(("avx512", |x, k, s, f| unsafe {
                    quantize_avx512(x, k, s, f)
                }));
            }
        }
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        let mut s = 11u64;
        for case in 0..240 {
            let (span, f16) = ([GROUP, 128, 256][case % 3], case % 2 == 0);
            let (t, k) = (1 + case % 3, 2 * span);
            let scale = 2f32.powi(case as i32 % 73 - 42);
            let mut x: Vec<f32> = (0..t * k)
                .map(|_| {
                    s = s
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    ((s >> 40) as f32 / (1u64 << 23) as f32 - 1.0) * scale
                })
                .collect();
            let at = case * 7 % x.len();
            match case % 7 {
                1 => x[at] = f32::NAN,
                2 => x[at] = f32::INFINITY,
                3 => x[at] = f32::NEG_INFINITY,
                4 => x[..span].fill(0.0),
                5 => x[..span].iter_mut().for_each(|v| *v *= 1e-30),
                _ => {}
            }
            let want = portable(&x, k, span, f16);
            for (name, build) in &builds {
                let got = build(&x, k, span, f16);
                let what = format!("{name}, case {case} (span {span}, f16 {f16}, scale {scale:e})");
                assert_eq!(got.codes, want.codes, "{what}");
                assert_eq!(bits(&got.scales), bits(&want.scales), "{what}");
                assert_eq!(bits(&got.sums), bits(&want.sums), "{what}");
                assert_eq!(got.code_sums, want.code_sums, "{what}");
                assert_eq!(got.lane_sums, want.lane_sums, "{what}");
            }
        }
    }

    /// Every span's sums land at its own rows' and groups' places: Σx̂ and Σcodes per 32 codes, and for spans
    /// longer than 32 Σcodes per eighth of a span and per pair of groups (16 bits each, signed), and -32 · Σcodes
    /// per 8 codes when asked for.
    #[test]
    fn sums_follow_the_codes() {
        let (t, k) = (3, 512);
        let x: Vec<f32> = (0..t * k)
            .map(|i| ((i * 7919 % 1001) as f32 - 500.0) * 0.01)
            .collect();
        for span in [32, 128, 256] {
            let q8 = Q8Rows::in_spans(&x, k, span);
            assert_eq!(
                (q8.scales.len(), q8.sums.len()),
                (t * k / span, t * k / GROUP)
            );
            for (gi, g) in q8.codes.chunks_exact(GROUP).enumerate() {
                let d = q8.scales[gi * GROUP / span];
                assert_eq!(
                    q8.sums[gi],
                    d * code_sum(g) as f32,
                    "span {span}, group {gi}"
                );
            }
            let want: Vec<i32> = q8.codes.chunks_exact(GROUP).map(code_sum).collect();
            assert_eq!(q8.code_sums, want, "span {span}");
            if span == GROUP {
                assert!(q8.lane_sums.is_empty() && q8.code_sum_pairs.is_empty());
            } else {
                let want: Vec<i32> = q8.codes.chunks_exact(span / 8).map(code_sum).collect();
                assert_eq!(q8.lane_sums, want, "span {span}");
                let mut q8 = q8;
                assert!(q8.neg32_eight_sums.is_empty());
                q8.add_neg32_eight_sums();
                let neg32: Vec<i32> = q8
                    .codes
                    .chunks_exact(8)
                    .map(|c| -32 * code_sum(c))
                    .collect();
                assert_eq!(q8.neg32_eight_sums, neg32, "span {span}");
                let pairs: Vec<(i16, i16)> = q8
                    .code_sum_pairs
                    .iter()
                    .map(|&p| (p as i16, (p >> 16) as i16))
                    .collect();
                let want: Vec<(i16, i16)> = q8
                    .codes
                    .chunks_exact(2 * GROUP)
                    .map(|p| (code_sum(&p[..GROUP]) as i16, code_sum(&p[GROUP..]) as i16))
                    .collect();
                assert_eq!(pairs, want, "span {span}");
            }
        }
    }

    /// Q4_K's AMX layout (`add_group_pairs`): for every chunk of rows and pair of groups, each row's two groups in
    /// their block-diagonal places and zeros everywhere else, whatever the rows left for the last chunk.
    #[test]
    fn group_pairs_are_block_diagonal_tiles_of_the_codes() {
        let k = 256;
        for t in [1, 5, 8, 11, 16] {
            let x: Vec<f32> = (0..t * k)
                .map(|i| ((i * 7919 % 253) as f32) - 126.0)
                .collect();
            let mut q8 = Q8Rows::q8_k(&x, k, 128);
            q8.add_group_pairs();
            let pairs = k / (2 * GROUP);
            assert_eq!(
                q8.pairs.len(),
                t.div_ceil(PAIR_TOKENS) * pairs * PAIR_TILE_BYTES
            );
            for (i, tile) in q8.pairs.chunks_exact(PAIR_TILE_BYTES).enumerate() {
                let (c, h) = (i / pairs, i % pairs);
                let n = (t - PAIR_TOKENS * c).min(PAIR_TOKENS);
                let mut want = [0i8; PAIR_TILE_BYTES];
                for r in 0..n {
                    let row = PAIR_TOKENS * c + r;
                    let even = q8.group(row, 2 * h);
                    let odd = q8.group(row, 2 * h + 1);
                    assert!(even.iter().chain(odd).any(|&code| code != 0));
                    want[2 * GROUP * r..][..GROUP].copy_from_slice(even);
                    want[2 * GROUP * (n + r) + GROUP..][..GROUP].copy_from_slice(odd);
                }
                assert_eq!(tile, &want[..], "t={t} chunk {c} pair {h}");
            }
        }
    }
}
