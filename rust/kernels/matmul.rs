//! `quantized_matmul`: argument checks, activation quantization, kernel selection (AVX-512, AVX2, NEON or
//! scalar; integer or float) and the thread pool.
//!
//! Work is split across threads by output rows only: each output element is computed by one thread in a fixed
//! order, so results do not depend on the number of threads.

use std::sync::{Arc, RwLock};

pub use super::activation::Gate;
use super::blocks::{self, Dense, Format, GROUP};
use super::dot;
use super::q8::Q8Rows;
use super::rows::{Activations, Kernel, RowKernel, GROUP_ROWS, MAX_T, WIDE_ROWS};
use super::runs::Runs;
use super::team::Team;

/// Least work per chunk (`Runs`), in multiply-adds (weights x activation rows): ~10 us of integer kernel on one
/// core. With the caller joining a spinning team (`team`), splitting is cheap (rayon's pool had needed 2^20); the
/// size is chosen with TASKS_PER_THREAD.
const MIN_TASK_WORK: usize = 1 << 16;
/// Chunks per thread (`Runs`), so that uneven thread speeds even out: a multi-row pass's products end with one
/// thread idle for up to a chunk. With 8 (and tasks of 2^16), when the chunks were tasks handed out in turn,
/// resident SmolLM2 passes of 8 tokens ran 1.06-1.07x faster than with 4 (and 2^15), decode steps 1.03-1.04x; Qwen
/// 1.5B's within the noise (Zen 4 VM, 2026-11-27, in-process A/B).
const TASKS_PER_THREAD: usize = 8;
/// Bytes of activations (8-bit codes, or float32 rows for the float kernels) that the blocks of one tile take: a
/// chunk's weight rows meet a tile's blocks while those stay in L2 cache, then the next tile's. Without tiles a
/// 512-row prefill pass streamed every block from memory for each weight row (Qwen2.5-Coder-1.5B's FFN down
/// projection, k = 8960: 4.6 MB per row group).
const ACTIVATION_TILE_BYTES: usize = 256 << 10;

/// ggml tensor types the kernels compute with (ids as in the GGUF file).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QType {
    F32 = 0,
    F16 = 1,
    Q4_0 = 2,
    Q4_1 = 3,
    Q5_0 = 6,
    Q5_1 = 7,
    Q8_0 = 8,
    Q4K = 12,
    Q5K = 13,
    Q6K = 14,
    BF16 = 30,
    TQ1_0 = 34,
    TQ2_0 = 35,
    /// ntio's own (beyond ggml's ids): Q4_1 rows interleaved by eight (`interleave`), which resident matrices take
    /// at load; n and the matrix's first output column within a call must be multiples of 8.
    Q4_1X8 = 256 + 3,
    /// ntio's own: Q4_K rows interleaved by eight, as Q4_1X8.
    Q4KX8 = 256 + 12,
    /// ntio's own: Q6_K rows interleaved by eight, as Q4_1X8 (each block's 52 words, then its rows' d).
    Q6KX8 = 256 + 14,
}

impl QType {
    pub const ALL: [QType; 13] = [
        QType::F32,
        QType::F16,
        QType::Q4_0,
        QType::Q4_1,
        QType::Q5_0,
        QType::Q5_1,
        QType::Q8_0,
        QType::Q4K,
        QType::Q5K,
        QType::Q6K,
        QType::BF16,
        QType::TQ1_0,
        QType::TQ2_0,
    ];

    /// The type with id `id` (a ggml id, or an interleaved layout's), if supported.
    pub fn from_id(id: u32) -> Option<QType> {
        QType::ALL
            .into_iter()
            .chain([QType::Q4_1X8, QType::Q4KX8, QType::Q6KX8])
            .find(|q| *q as u32 == id)
    }

    /// Whether the type's rows are stored interleaved (in groups of `GROUP_ROWS`).
    pub fn interleaved_rows(self) -> bool {
        matches!(self, QType::Q4_1X8 | QType::Q4KX8 | QType::Q6KX8)
    }

    /// The interleaved layout of this type, if it has one: (its type, bytes per block of a row).
    pub fn interleaved(self) -> Option<(QType, usize)> {
        match self {
            QType::Q4_1 => Some((QType::Q4_1X8, blocks::Q4_1::BYTES)),
            QType::Q4K => Some((QType::Q4KX8, blocks::Q4K::BYTES)),
            QType::Q6K => Some((QType::Q6KX8, blocks::Q6K::BYTES)),
            _ => None,
        }
    }

    /// Whether resident matrices of this type take its interleaved layout on this CPU, where the interleaved
    /// kernels run at all (`interleaved_kernels`, which callers check): Q4_1 and Q4_K, and Q6_K only where AVX-512
    /// VNNI's products run its passes (decided for the best kernel set; a forced one keeps the choice). With AVX2's
    /// (and AVX-VNNI's) products its lanes at one or two activation rows cost more than the row kernel on plain rows;
    /// with AMX, tiles take its passes of several rows, on plain rows (`avx2::tiles`). Qwen2.5-Coder-1.5B's Q6_K
    /// matrices, cache-cold, 2 threads, interleaved over plain, at T = 1 / 2 / 4 / 8 / 16: AVX-512 VNNI 0.99 /
    /// 1.02 / 0.86 / 0.87 / 0.89, AVX2 1.04 / 1.07 / 0.95 / 0.93 / 1.02 (benches/RESULTS.md, thirty-seventh
    /// session).
    pub fn resident_interleaved(self) -> bool {
        if self == QType::Q6K {
            #[cfg(target_arch = "x86_64")]
            return products(Isa::Best) == super::avx2::Products::Avx512Vnni;
            #[cfg(not(target_arch = "x86_64"))]
            return false;
        }
        self.interleaved().is_some()
    }

    /// The type whose rows an interleaved layout holds (itself for the others).
    pub fn plain(self) -> QType {
        match self {
            QType::Q4_1X8 => QType::Q4_1,
            QType::Q4KX8 => QType::Q4K,
            QType::Q6KX8 => QType::Q6K,
            other => other,
        }
    }

    /// (elements, bytes) per block.
    pub fn block(self) -> (usize, usize) {
        let (elements, bytes, _) = self.layout();
        (elements, bytes)
    }

    /// Elements per activation scale in the integer kernels (`Format::SPAN`); dense types take none.
    pub fn span(self) -> Option<usize> {
        self.layout().2
    }

    /// (elements, bytes) per block and the activation span, from the type's format.
    fn layout(self) -> (usize, usize, Option<usize>) {
        fn q<F: Format>() -> (usize, usize, Option<usize>) {
            (F::BLOCK, F::BYTES, Some(F::SPAN))
        }
        fn d<D: Dense>() -> (usize, usize, Option<usize>) {
            (1, D::BYTES, None)
        }
        match self {
            QType::F32 => d::<blocks::F32>(),
            QType::F16 => d::<blocks::F16>(),
            QType::BF16 => d::<blocks::BF16>(),
            QType::Q4_0 => q::<blocks::Q4_0>(),
            QType::Q4_1 | QType::Q4_1X8 => q::<blocks::Q4_1>(),
            QType::Q5_0 => q::<blocks::Q5_0>(),
            QType::Q5_1 => q::<blocks::Q5_1>(),
            QType::Q8_0 => q::<blocks::Q8_0>(),
            QType::Q4K | QType::Q4KX8 => q::<blocks::Q4K>(),
            QType::Q5K => q::<blocks::Q5K>(),
            QType::Q6K | QType::Q6KX8 => q::<blocks::Q6K>(),
            QType::TQ1_0 => q::<blocks::TQ1_0>(),
            QType::TQ2_0 => q::<blocks::TQ2_0>(),
        }
    }

    fn affine(self) -> bool {
        matches!(
            self,
            QType::Q4_1 | QType::Q5_1 | QType::Q4K | QType::Q5K | QType::Q4_1X8 | QType::Q4KX8
        )
    }

    /// The kernel for `isa` and `activations`: the widest this CPU runs and the type has, down to scalar.
    /// Dense types always take float activations.
    fn kernel(self, isa: Isa, activations: Activations8) -> Kernel {
        let int = activations == Activations8::Int8;
        match self {
            QType::F32 => Kernel::Row(dense_kernel::<blocks::F32>(isa)),
            QType::F16 => Kernel::Row(dense_kernel::<blocks::F16>(isa)),
            QType::BF16 => Kernel::Row(dense_kernel::<blocks::BF16>(isa)),
            QType::Q4_0 => quantized_kernel::<blocks::Q4_0>(isa, int),
            QType::Q4_1 => quantized_kernel::<blocks::Q4_1>(isa, int),
            QType::Q5_0 => quantized_kernel::<blocks::Q5_0>(isa, int),
            QType::Q5_1 => quantized_kernel::<blocks::Q5_1>(isa, int),
            QType::Q8_0 => quantized_kernel::<blocks::Q8_0>(isa, int),
            QType::Q4K => quantized_kernel::<blocks::Q4K>(isa, int),
            QType::Q5K => quantized_kernel::<blocks::Q5K>(isa, int),
            QType::Q6K => quantized_kernel::<blocks::Q6K>(isa, int),
            QType::TQ1_0 => quantized_kernel::<blocks::TQ1_0>(isa, int),
            QType::TQ2_0 => quantized_kernel::<blocks::TQ2_0>(isa, int),
            QType::Q4_1X8 | QType::Q4KX8 | QType::Q6KX8 => {
                self.interleaved_kernel(isa, activations)
            }
        }
    }

    /// An interleaved layout's kernel: its AVX2 integer group kernel where it runs (VNNI's products where allowed
    /// and present, `products`), else the plain type's row kernel on each group restored to rows. Either gives the
    /// plain rows' bits.
    fn interleaved_kernel(self, isa: Isa, activations: Activations8) -> Kernel {
        #[cfg(target_arch = "x86_64")]
        if activations == Activations8::Int8 && isa != Isa::Scalar && super::avx2::available() {
            return match self {
                QType::Q4KX8 => super::avx2::q4_k_x8(products(isa)),
                QType::Q6KX8 => super::avx2::q6_k_x8(products(isa)),
                _ => super::avx2::q4_1_x8(products(isa)),
            };
        }
        match self.plain().kernel(isa, activations) {
            Kernel::Row(kernel) => Kernel::Interleaved(kernel),
            _ => unreachable!(
                "plain kernels are row kernels but for AVX2's integer ones, taken above"
            ),
        }
    }
}

/// Whether interleaved rows have kernels of their own under `isa` and `activations` (else each group is restored
/// to rows first, slower than plain rows): where they do, resident matrices pay to take the layout.
pub fn interleaved_kernels(isa: Isa, activations: Activations8) -> bool {
    matches!(
        QType::Q4_1X8.kernel(isa, activations),
        Kernel::Group(_) | Kernel::Wide(_)
    )
}

/// A block format every kernel set decodes (on x86-64: the AVX2 and AVX-512 decoders too).
#[cfg(target_arch = "x86_64")]
trait Quantized: Format + super::avx2::SimdFormat + super::avx512::Avx512Format {}
#[cfg(target_arch = "x86_64")]
impl<F: Format + super::avx2::SimdFormat + super::avx512::Avx512Format> Quantized for F {}
#[cfg(target_arch = "aarch64")]
trait Quantized: Format + super::neon::NeonFormat {}
#[cfg(target_arch = "aarch64")]
impl<F: Format + super::neon::NeonFormat> Quantized for F {}
#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
trait Quantized: Format {}
#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
impl<F: Format> Quantized for F {}

/// A dense type every kernel set loads.
#[cfg(target_arch = "x86_64")]
trait DenseRow: Dense + super::avx2::SimdDense {}
#[cfg(target_arch = "x86_64")]
impl<D: Dense + super::avx2::SimdDense> DenseRow for D {}
#[cfg(not(target_arch = "x86_64"))]
trait DenseRow: Dense {}
#[cfg(not(target_arch = "x86_64"))]
impl<D: Dense> DenseRow for D {}

/// The kernel of format `F`: AVX-512 for float activations where allowed and present, else AVX2 (integer: a group
/// kernel for the legacy formats (sixteen rows a call with AVX-512 VNNI) and for Q4_K (its rows regrouped into the
/// interleaved layout for passes of several rows), the row kernel for the other K-quants, their products VNNI's where
/// allowed and present, `products`); on aarch64 NEON for 8-bit activations (`sdot` where the CPU has it); else scalar;
/// integer (8-bit activations) or float.
fn quantized_kernel<F: Quantized>(isa: Isa, int: bool) -> Kernel {
    #[cfg(target_arch = "x86_64")]
    {
        if !int && matches!(isa, Isa::Best | Isa::Amx | Isa::Avx512) && super::avx512::available() {
            return Kernel::Row(super::avx512::quantized::<F>());
        }
        if isa != Isa::Scalar && super::avx2::available() {
            return if int {
                F::int_kernel(products(isa))
            } else {
                Kernel::Row(super::avx2::quantized::<F>())
            };
        }
    }
    #[cfg(target_arch = "aarch64")]
    if int && matches!(isa, Isa::Best | Isa::Neon) {
        return Kernel::Row(super::neon::int::<F>(true));
    }
    let _ = isa;
    Kernel::Row(if int {
        dot::int_row::<F>
    } else {
        dot::quantized_row::<F>
    })
}

/// The byte products of `isa`'s AVX2 integer kernels: AMX's where the set allows them (`best`, `amx`) and the CPU
/// has them, else AVX-512 VNNI's where allowed (`best`, `avx512`) and present, else AVX-VNNI's where allowed
/// (`best`, `avxvnni`) and present, else AVX2's.
#[cfg(target_arch = "x86_64")]
fn products(isa: Isa) -> super::avx2::Products {
    use super::avx2::Products;
    match isa {
        Isa::Best | Isa::Amx if Products::Amx.available() => Products::Amx,
        Isa::Best | Isa::Avx512 if Products::Avx512Vnni.available() => Products::Avx512Vnni,
        Isa::Best | Isa::AvxVnni if Products::AvxVnni.available() => Products::AvxVnni,
        _ => Products::Madd,
    }
}

/// The row kernel of dense type `D`: AVX2 unless scalar is asked for or the CPU lacks it.
fn dense_kernel<D: DenseRow>(isa: Isa) -> RowKernel {
    #[cfg(target_arch = "x86_64")]
    if isa != Isa::Scalar && super::avx2::available() {
        return super::avx2::dense::<D>();
    }
    let _ = isa;
    dot::dense_row::<D>
}

/// Which row kernels run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isa {
    /// The widest this CPU has: AVX-512 (float kernels of quantized types; in the integer kernels AMX tiles
    /// where written, VNNI products elsewhere, AVX-512's or else AVX-VNNI's), AVX2 + FMA, NEON (aarch64: the
    /// integer kernels), else scalar.
    Best,
    /// `Avx512` with AMX tiles in the integer kernels that have them (Q4_K's and Q6_K's, in passes of 5
    /// activation rows or more; Q8_0's, of 9 or more); refused on a CPU without AMX, or where the OS does not
    /// grant this process the tile state.
    Amx,
    /// AVX-512 F/BW/VL float kernels where written (quantized types), the AVX2 integer kernels with AVX-512
    /// VNNI products where the CPU has VNNI, AVX2 for the rest. Callers check `Isa::available` first
    /// (`ntio._core.kernel_isa_available`).
    Avx512,
    /// The AVX2 kernels, the integer ones with AVX-VNNI's products (VEX-encoded: Intel client cores from Alder
    /// Lake on, which lack AVX-512; refused on a CPU without AVX-VNNI), to test those on AVX-512 machines.
    AvxVnni,
    /// AVX2 + FMA where the CPU has them, else scalar (to test the AVX2 kernels on AVX-512 machines).
    Avx2,
    /// NEON integer kernels, with `sdot` where the CPU has it (aarch64 only).
    Neon,
    Scalar,
}

impl Isa {
    /// The set named `name` (`best`, `amx`, `avx512`, `avxvnni`, `avx2`, `neon`, `scalar`), if there is one.
    pub fn from_name(name: &str) -> Option<Isa> {
        match name {
            "best" => Some(Isa::Best),
            "amx" => Some(Isa::Amx),
            "avx512" => Some(Isa::Avx512),
            "avxvnni" => Some(Isa::AvxVnni),
            "avx2" => Some(Isa::Avx2),
            "neon" => Some(Isa::Neon),
            "scalar" => Some(Isa::Scalar),
            _ => None,
        }
    }

    /// Whether the set's 8-bit kernels are vector code on this CPU (AVX2, AVX-512 or NEON), not the scalar
    /// fallback, which multiplies long prefill passes ~12x slower than dequantizing for a float32 GEMM (SmolLM2,
    /// 512-token passes, Zen 4 VM, 2026-11-27).
    pub fn vectorized(self) -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            self != Isa::Scalar && super::avx2::available()
        }
        #[cfg(target_arch = "aarch64")]
        {
            self != Isa::Scalar
        }
        #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
        {
            false
        }
    }

    /// Whether this CPU runs the set: a forced set the CPU lacks is refused, never run into SIGILL.
    pub fn available(self) -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            match self {
                Isa::Best | Isa::Scalar => true,
                Isa::Avx512 => super::avx512::available() && super::avx2::available(),
                Isa::Amx => super::avx512::available() && super::avx2::Products::Amx.available(),
                Isa::AvxVnni => super::avx2::Products::AvxVnni.available(),
                Isa::Avx2 => super::avx2::available(),
                Isa::Neon => false,
            }
        }
        #[cfg(target_arch = "aarch64")]
        {
            matches!(self, Isa::Best | Isa::Neon | Isa::Scalar)
        }
        #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
        {
            matches!(self, Isa::Best | Isa::Scalar)
        }
    }
}

/// How activations meet the weights.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activations8 {
    /// Quantized to 8 bits per 32-element group (`q8`), integer dot products (as llama.cpp): the default.
    Int8,
    /// float32 activations and float32 products: the reference path, exact to float32 rounding.
    Float,
}

#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    #[error("{0}")]
    Mismatch(String),
    #[error("could not start {threads} kernel threads: {reason}")]
    Threads { threads: usize, reason: String },
    #[error("a kernel task panicked (a bug in ntio's kernels)")]
    Panicked,
    #[error("could not allocate {bytes} bytes of RAM")]
    Memory { bytes: usize },
}

fn mismatch(message: String) -> Result<(), KernelError> {
    Err(KernelError::Mismatch(message))
}

/// A weight matrix [n, k] in its GGUF encoding (n rows of k / block blocks), row-major, whose products are
/// multiplied by `scale` (a per-tensor weight scale, as BitNet's; 1 for every other model: exact).
#[derive(Clone, Copy)]
pub struct Matrix<'a> {
    pub raw: &'a [u8],
    pub qtype: QType,
    pub n: usize,
    pub scale: f32,
}

impl<'a> Matrix<'a> {
    /// A matrix with no scale of its own.
    pub fn new(raw: &'a [u8], qtype: QType, n: usize) -> Matrix<'a> {
        Matrix {
            raw,
            qtype,
            n,
            scale: 1.0,
        }
    }
}

/// RMSNorm of each row: x / sqrt(mean(x²) + eps) · weight [k].
#[derive(Clone, Copy)]
pub struct RmsNorm<'a> {
    pub weight: &'a [f32],
    pub eps: f32,
}

/// What is done to the activations before the product, once for every matrix of the call, in this order: an
/// optional gating (x [t, 2k] holds [gate | up] rows -> act(gate) · up, [t, k]: a gated FFN's input to its down
/// projection), then an optional RMSNorm of each row.
#[derive(Clone, Copy, Default)]
pub struct Prologue<'a> {
    pub gate: Option<Gate>,
    pub norm: Option<RmsNorm<'a>>,
}

impl<'a> Prologue<'a> {
    /// RMSNorm only.
    pub fn norm(weight: &'a [f32], eps: f32) -> Prologue<'a> {
        Prologue {
            gate: None,
            norm: Some(RmsNorm { weight, eps }),
        }
    }

    /// Floats per activation row given for `k` product columns.
    fn row_len(&self, k: usize) -> usize {
        if self.gate.is_some() {
            2 * k
        } else {
            k
        }
    }

    /// x [t, row_len] -> [t, k]: borrowed as is, or computed.
    fn apply<'x>(&self, x: &'x [f32], t: usize, k: usize) -> std::borrow::Cow<'x, [f32]> {
        let mut y = match self.gate {
            None if self.norm.is_none() => return std::borrow::Cow::Borrowed(x),
            None => x.to_vec(),
            Some(gate) => {
                // Runs on the calling thread while the team waits (`activation`: vectorized where the CPU can).
                let mut y = vec![0f32; t * k];
                for (row, out) in x.chunks_exact(2 * k).zip(y.chunks_exact_mut(k)) {
                    let (g, u) = row.split_at(k);
                    gate.apply(g, u, out);
                }
                y
            }
        };
        if let Some(RmsNorm { weight, eps }) = self.norm {
            for row in y.chunks_exact_mut(k) {
                let mean = row.iter().map(|v| v * v).sum::<f32>() / k as f32;
                let scale = 1.0 / (mean + eps).sqrt();
                for (v, w) in row.iter_mut().zip(weight) {
                    *v = *v * scale * w;
                }
            }
        }
        std::borrow::Cow::Owned(y)
    }
}

/// out [t, Σn] = prologue(x) [t, k] · [W1; W2; ...]ᵀ: the matrices' outputs side by side, every matrix [n_i, k]
/// GGUF-encoded, float32 accumulation, any t (rows go through the kernels in blocks of MAX_T, the blocks in tiles of
/// ACTIVATION_TILE_BYTES); quantized types take `activations` as given (dense types always float), quantized once
/// for all matrices. Size errors name the argument (`x`, `raw`, `out`, `norm`).
pub fn quantized_matmul(
    x: &[f32],
    t: usize,
    k: usize,
    prologue: Prologue,
    matrices: &[Matrix],
    out: &mut [f32],
    isa: Isa,
    activations: Activations8,
) -> Result<(), KernelError> {
    if t == 0 {
        return mismatch("t = 0 activation rows; the kernels take at least 1".to_string());
    }
    let mut first = 0;
    for m in matrices {
        if m.qtype.interleaved_rows() && (m.n % GROUP_ROWS != 0 || first % GROUP_ROWS != 0) {
            return mismatch(format!(
                "{:?} weights [{}, {k}] at output column {first}: interleaved rows come in groups of \
                 {GROUP_ROWS} (rows and first column multiples of {GROUP_ROWS})",
                m.qtype, m.n
            ));
        }
        first += m.n;
        let (block, bytes) = m.qtype.block();
        if k % block != 0 {
            return mismatch(format!(
                "k = {k} is not a multiple of the {:?} block size {block}",
                m.qtype
            ));
        }
        if m.raw.len() != m.n * (k / block * bytes) {
            return mismatch(format!(
                "raw has {} bytes; {:?} weights [{}, {k}] take {} bytes",
                m.raw.len(),
                m.qtype,
                m.n,
                m.n * (k / block * bytes)
            ));
        }
    }
    let row_len = prologue.row_len(k);
    if x.len() != t * row_len {
        return mismatch(format!(
            "x has {} floats, [{t}, {row_len}] needs {}",
            x.len(),
            t * row_len
        ));
    }
    if let Some(RmsNorm { weight, .. }) = prologue.norm {
        if weight.len() != k {
            return mismatch(format!("norm has {} floats, not k = {k}", weight.len()));
        }
    }
    let n: usize = matrices.iter().map(|m| m.n).sum();
    if out.len() != t * n {
        return mismatch(format!(
            "out has {} floats, [{t}, {n}] needs {}",
            out.len(),
            t * n
        ));
    }
    if n == 0 {
        return Ok(());
    }
    let x = prologue.apply(x, t, k);
    let x = &x[..];
    let int = activations == Activations8::Int8;
    // The activation spans the matrices need (`Format::SPAN`), each quantized once: spans of 32 exactly as
    // llama.cpp's Q8_0 (float16 scales), longer ones with float32 scales.
    let mut spans: Vec<usize> = matrices.iter().filter_map(|m| m.qtype.span()).collect();
    spans.sort_unstable();
    spans.dedup();
    let affine = matrices.iter().any(|m| m.qtype.affine());
    // The AMX kernels take the activations laid out for their tiles in passes of several rows: Q6_K's and Q8_0's
    // by token (`Q8Rows::columns`), Q4_K's by pair of groups (`Q8Rows::pairs`). For one layout, the fewest rows any
    // matrix of activation span `span` takes tiles from.
    let tiles_from = |span: usize, by_pairs: bool| -> Option<usize> {
        #[cfg(target_arch = "x86_64")]
        if int && products(isa) == super::avx2::Products::Amx {
            return matrices
                .iter()
                .filter(|m| m.qtype.span() == Some(span))
                .filter_map(|m| match (m.qtype, by_pairs) {
                    (QType::Q6K, false) => Some(super::avx2::Q6K_TILE_MIN_ROWS),
                    (QType::Q8_0, false) => Some(super::avx2::Q8_0_TILE_MIN_ROWS),
                    (QType::Q4K | QType::Q4KX8, true) => Some(super::avx2::Q4K_TILE_MIN_ROWS),
                    _ => None,
                })
                .min();
        }
        let _ = (span, by_pairs);
        None
    };
    // Q6_K's lane kernels with VNNI's products start each half sub-block's sum from -32 times its codes' sum: for
    // interleaved rows at every number of activation rows, for plain rows from Q6K_LANES_MIN_ROWS (fewer take the
    // row kernel, which does not read them).
    #[cfg(target_arch = "x86_64")]
    let q6_k_halves = |rows: usize| {
        int && products(isa) != super::avx2::Products::Madd
            && matrices.iter().any(|m| match m.qtype {
                QType::Q6KX8 => true,
                QType::Q6K => rows >= super::avx2::Q6K_LANES_MIN_ROWS,
                _ => false,
            })
    };
    #[cfg(not(target_arch = "x86_64"))]
    let q6_k_halves = |_: usize| false;
    // Blocks of up to MAX_T activation rows: each weight row meets every block of a tile while it is in L1 cache.
    let blocks: Vec<Activations> = x
        .chunks(MAX_T * k)
        .map(|x| Activations {
            x,
            sums: if affine && activations == Activations8::Float {
                x.chunks_exact(GROUP).map(|g| g.iter().sum()).collect()
            } else {
                Vec::new()
            },
            q8: if int {
                spans
                    .iter()
                    .map(|&s| {
                        let mut q8 = Q8Rows::in_spans(x, k, s);
                        let rows = x.len() / k;
                        if tiles_from(s, false).is_some_and(|from| rows >= from) {
                            q8.add_token_columns();
                        }
                        if tiles_from(s, true).is_some_and(|from| rows >= from) {
                            q8.add_group_pairs();
                        }
                        if q6_k_halves(rows) && Some(s) == QType::Q6K.span() {
                            q8.add_neg32_eight_sums();
                        }
                        q8
                    })
                    .collect()
            } else {
                Vec::new()
            },
            t: x.len() / k,
            k,
        })
        .collect();
    // Each matrix: its kernel, encoded row length and first output column.
    let plan: Vec<(Kernel, usize, usize)> = matrices
        .iter()
        .scan(0, |first, m| {
            let (block, bytes) = m.qtype.block();
            let entry = (m.qtype.kernel(isa, activations), k / block * bytes, *first);
            *first += m.n;
            Some(entry)
        })
        .collect();
    // Blocks per tile: as many as fill ACTIVATION_TILE_BYTES, at least one.
    let activation_row_bytes = if int { k } else { 4 * k };
    let tile_blocks = (ACTIVATION_TILE_BYTES / (MAX_T * activation_row_bytes)).max(1);
    let out_ptr = OutPtr(out.as_mut_ptr());
    // Output columns of the rows of one tile (blocks first_block.. of the call).
    let tile_columns = |first_block: usize,
                        blocks: &[Activations],
                        columns: std::ops::Range<usize>| {
        // out[bi · MAX_T + ti, c..c + values.len()] = values · scale: one run of columns of one output row, in
        // a loop the compiler vectorizes (element by element, after a kernel's vector stores, the loads stalled).
        let store = |bi: usize, ti: usize, c: usize, values: &[f32], scale: f32| {
            let bi = first_block + bi;
            // SAFETY: bi * MAX_T + ti < t and c + values.len() <= n, so the run is inside `out` (t * n floats,
            // checked above); chunks own disjoint column ranges, so no two threads write the same element; `out`
            // outlives the call.
            let run = unsafe {
                std::slice::from_raw_parts_mut(out_ptr.at((bi * MAX_T + ti) * n + c), values.len())
            };
            for (o, &v) in run.iter_mut().zip(values) {
                *o = v * scale;
            }
        };
        for (m, &(kernel, row_bytes, first)) in matrices.iter().zip(&plan) {
            let (start, stop) = (columns.start.max(first), columns.end.min(first + m.n));
            match kernel {
                Kernel::Row(kernel) => {
                    let mut y = [0f32; MAX_T];
                    for c in start..stop {
                        let row = &m.raw[(c - first) * row_bytes..][..row_bytes];
                        for (bi, a) in blocks.iter().enumerate() {
                            kernel(a, row, &mut y);
                            for (ti, v) in y[..a.t].iter().enumerate() {
                                store(bi, ti, c, std::slice::from_ref(v), m.scale);
                            }
                        }
                    }
                }
                Kernel::Interleaved(kernel) => {
                    let mut plain = vec![0u8; GROUP_ROWS * row_bytes];
                    let mut y = [0f32; MAX_T];
                    let block_bytes = m.qtype.block().1;
                    for c in (start..stop).step_by(GROUP_ROWS) {
                        let group = &m.raw[(c - first) * row_bytes..][..GROUP_ROWS * row_bytes];
                        super::interleave::deinterleave(group, row_bytes, block_bytes, &mut plain);
                        for (j, row) in plain.chunks_exact(row_bytes).enumerate() {
                            for (bi, a) in blocks.iter().enumerate() {
                                kernel(a, row, &mut y);
                                for (ti, v) in y[..a.t].iter().enumerate() {
                                    store(bi, ti, c + j, std::slice::from_ref(v), m.scale);
                                }
                            }
                        }
                    }
                }
                Kernel::Group(kernel) => {
                    group_columns(kernel, m, row_bytes, first, start..stop, blocks, &store)
                }
                Kernel::Wide(kernel) => {
                    group_columns(kernel, m, row_bytes, first, start..stop, blocks, &store)
                }
            }
        }
    };
    // Output columns [start, stop) of the whole call, tile by tile, matrix by matrix.
    let columns_fn = |columns: std::ops::Range<usize>| {
        for (i, tile) in blocks.chunks(tile_blocks).enumerate() {
            tile_columns(i * tile_blocks, tile, columns.clone());
        }
    };
    let team = team()?;
    let threads = team.threads();
    // Chunks of at least MIN_TASK_WORK multiply-adds, up to TASKS_PER_THREAD per thread.
    let tasks = (n * k * t / MIN_TASK_WORK).clamp(1, threads * TASKS_PER_THREAD);
    // Whole groups of weight rows per chunk (where the matrices' sizes allow), pairs of them for a wide kernel.
    let wide = plan
        .iter()
        .any(|(kernel, ..)| matches!(kernel, Kernel::Wide(_)));
    let unit = if wide { WIDE_ROWS } else { GROUP_ROWS };
    let chunk = n.div_ceil(tasks).next_multiple_of(unit);
    let chunks = n.div_ceil(chunk);
    if threads == 1 || chunks == 1 {
        columns_fn(0..n);
        return Ok(());
    }
    // One run of chunks per thread, the rest stolen (`Runs`).
    let runs = Runs::new(chunks, threads);
    let run = |r| {
        while let Some(c) = runs.next(r) {
            columns_fn(c * chunk..((c + 1) * chunk).min(n));
        }
    };
    if !team.run(threads, &run) {
        return Err(KernelError::Panicked);
    }
    Ok(())
}

/// Output columns `columns` of matrix `m` (its first output column `first`, rows of `row_bytes`) for every
/// activation block, with a group kernel of W rows a call: `store(block, row, column, values, scale)` writes each
/// call's outputs.
fn group_columns<const W: usize>(
    kernel: fn(&Activations, &[u8], usize, &mut [[f32; W]; MAX_T]),
    m: &Matrix,
    row_bytes: usize,
    first: usize,
    columns: std::ops::Range<usize>,
    blocks: &[Activations],
    store: &impl Fn(usize, usize, usize, &[f32], f32),
) {
    let mut y = [[0f32; W]; MAX_T];
    for c in columns.clone().step_by(W) {
        let count = (columns.end - c).min(W);
        let rows = &m.raw[(c - first) * row_bytes..][..count * row_bytes];
        for (bi, a) in blocks.iter().enumerate() {
            kernel(a, rows, row_bytes, &mut y);
            for (ti, lanes) in y[..a.t].iter().enumerate() {
                store(bi, ti, c, &lanes[..count], m.scale);
            }
        }
    }
}

/// The output base pointer, shared by the tasks of one call (each writes its own elements).
#[derive(Clone, Copy)]
pub(super) struct OutPtr(pub(super) *mut f32);
// SAFETY: tasks write disjoint elements (see `quantized_matmul`) and the buffer outlives the pool call.
unsafe impl Send for OutPtr {}
// SAFETY: as above.
unsafe impl Sync for OutPtr {}

impl OutPtr {
    pub(super) fn at(self, i: usize) -> *mut f32 {
        self.0.wrapping_add(i)
    }
}

/// The kernel threads; `None` until first used or sized by `set_threads`.
static TEAM: RwLock<Option<Arc<Team>>> = RwLock::new(None);

fn build_team(threads: usize) -> Result<Arc<Team>, KernelError> {
    Team::new(threads)
        .map(Arc::new)
        .map_err(|e| KernelError::Threads {
            threads,
            reason: e.to_string(),
        })
}

pub(super) fn team() -> Result<Arc<Team>, KernelError> {
    if let Some(team) = TEAM.read().unwrap_or_else(|e| e.into_inner()).as_ref() {
        return Ok(Arc::clone(team));
    }
    let mut slot = TEAM.write().unwrap_or_else(|e| e.into_inner());
    if slot.is_none() {
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        *slot = Some(build_team(threads)?);
    }
    Ok(Arc::clone(slot.as_ref().expect("team just set")))
}

/// Use `threads` kernel threads from now on (0: one per available CPU). Calls in flight keep their team.
pub fn set_threads(threads: usize) -> Result<(), KernelError> {
    let threads = if threads == 0 {
        std::thread::available_parallelism().map_or(1, |n| n.get())
    } else {
        threads
    };
    let team = build_team(threads)?;
    *TEAM.write().unwrap_or_else(|e| e.into_inner()) = Some(team);
    Ok(())
}

/// Kernel threads in use (the caller included).
pub fn threads() -> usize {
    team().map_or(1, |p| p.threads())
}

#[cfg(test)]
mod tests {
    use super::super::rows::{test_bytes as bytes, test_l2};
    use super::*;

    /// Activation rows [t, k] in [-1, 1]; the first rows are the same whatever t.
    fn activations(t: usize, k: usize) -> Vec<f32> {
        bytes(t * k, 2)
            .iter()
            .map(|&b| f32::from(b) / 127.0 - 1.0)
            .collect()
    }

    fn run(qtype: QType, t: usize, n: usize, k: usize, isa: Isa, act: Activations8) -> Vec<f32> {
        run_on(&activations(t, k), qtype, n, k, isa, act)
    }

    /// x [t, k] times n weight rows of qtype (the same rows for the same n and k).
    fn run_on(
        x: &[f32],
        qtype: QType,
        n: usize,
        k: usize,
        isa: Isa,
        act: Activations8,
    ) -> Vec<f32> {
        let t = x.len() / k;
        let (block, size) = qtype.block();
        let w = bytes(n * k / block * size, 1);
        let mut out = vec![0f32; t * n];
        let m = Matrix::new(&w, qtype, n);
        quantized_matmul(x, t, k, Prologue::default(), &[m], &mut out, isa, act).unwrap();
        out
    }

    /// Every SIMD path (AVX-512 via `Best` where the CPU has it, AVX2) against the scalar kernels, per
    /// activation row, for every type, both activation paths and every t: relative L2 error <= 1e-5 (float32
    /// reassociation only: the integer sums are exact in both).
    #[test]
    fn simd_and_scalar_kernels_agree_for_every_type() {
        let (n, k) = (37, 768); // odd n; 3 K-quant blocks, 24 legacy blocks
        for (qtype, act) in QType::ALL
            .into_iter()
            .flat_map(|q| [(q, Activations8::Int8), (q, Activations8::Float)])
        {
            for t in (1..=MAX_T).chain([2 * MAX_T + 7]) {
                let scalar = run(qtype, t, n, k, Isa::Scalar, act);
                for isa in [Isa::Best, Isa::Avx2, Isa::Neon]
                    .into_iter()
                    .filter(|i| i.available())
                {
                    let simd = run(qtype, t, n, k, isa, act);
                    for (ti, (s, v)) in scalar.chunks(n).zip(simd.chunks(n)).enumerate() {
                        let (diff, norm) = test_l2(s, v);
                        assert!(
                            norm > 0.0 && diff <= 1e-5 * norm,
                            "{qtype:?} {act:?} {isa:?} t={t} row {ti}: {diff} vs {norm}"
                        );
                    }
                }
            }
        }
    }

    /// The integer kernels with AMX's and VNNI's products (AVX-512's, AVX-VNNI's) where the CPU has them give the
    /// AVX2 products' bits: the integer sums are the same and so is every float step, for every type and tile size.
    #[test]
    fn vnni_products_give_the_avx2_kernels_bits() {
        let (n, k) = (19, 768);
        for isa in [Isa::Amx, Isa::Avx512, Isa::AvxVnni]
            .into_iter()
            .filter(|isa| isa.available())
        {
            for qtype in QType::ALL {
                for t in (1..=MAX_T).chain([MAX_T + 9]) {
                    let vnni = run(qtype, t, n, k, isa, Activations8::Int8);
                    let avx2 = run(qtype, t, n, k, Isa::Avx2, Activations8::Int8);
                    assert!(
                        vnni.iter()
                            .zip(&avx2)
                            .all(|(a, b)| a.to_bits() == b.to_bits()),
                        "{isa:?} {qtype:?} t={t}"
                    );
                }
            }
        }
    }

    /// Q6_K's lanes in AVX-512 vectors give the AVX2 kernels' bits both ways they scale a sub-block's sum: whole,
    /// with `vpmulld` (AMD's cores), and by halves, with `vpdpwssd` (Intel's), whichever this CPU takes; on plain
    /// rows (lanes from Q6K_LANES_MIN_ROWS activation rows) and interleaved ones, 40 rows: two pairs of groups and
    /// a lone group.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn q6_k_sums_whole_or_by_halves_give_the_same_bits() {
        if !Isa::Avx512.available() {
            return;
        }
        let (n, k) = (40, 512);
        for whole in [false, true] {
            super::super::avx2::force_whole_sub_sums(Some(whole));
            for qtype in [QType::Q6K, QType::Q6KX8] {
                for t in [1, 3, 4, 8, 16, MAX_T + 9] {
                    let avx512 = run(qtype, t, n, k, Isa::Avx512, Activations8::Int8);
                    let avx2 = run(qtype, t, n, k, Isa::Avx2, Activations8::Int8);
                    assert!(
                        avx512
                            .iter()
                            .zip(&avx2)
                            .all(|(a, b)| a.to_bits() == b.to_bits()),
                        "whole: {whole}, {qtype:?} t={t}"
                    );
                }
            }
        }
        super::super::avx2::force_whole_sub_sums(None);
    }

    /// Dense rows whose length is not a multiple of the SIMD kernel's 32-weight step (its 8-weight and scalar
    /// tails): AVX2 against scalar within float32 reassociation, and each row the same bits at any row count.
    #[test]
    fn dense_kernels_take_any_row_length() {
        for qtype in [QType::F32, QType::F16, QType::BF16] {
            for k in [5, 40, 779] {
                let scalar = run(qtype, 3, 11, k, Isa::Scalar, Activations8::Float);
                let simd = run(qtype, 3, 11, k, Isa::Avx2, Activations8::Float);
                let (diff, norm) = test_l2(&scalar, &simd);
                assert!(diff <= 1e-5 * norm, "{qtype:?} k={k}: {diff} vs {norm}");
                let one = run(qtype, 1, 11, k, Isa::Avx2, Activations8::Float);
                assert_eq!(one[..], simd[..11], "{qtype:?} k={k}");
            }
        }
    }

    /// Each activation row's result is the same bits whatever the number of rows in the call (and so whichever
    /// tile computes it): speculative verify passes rely on it for exact greedy output.
    #[test]
    fn a_rows_result_does_not_depend_on_how_many_rows_share_the_call() {
        let (n, k) = (9, 768);
        for (qtype, act) in QType::ALL
            .into_iter()
            .flat_map(|q| [(q, Activations8::Int8), (q, Activations8::Float)])
        {
            for isa in [Isa::Amx, Isa::Avx512, Isa::Avx2, Isa::Scalar]
                .into_iter()
                .filter(|i| i.available())
            {
                let all = run(qtype, MAX_T + 8, n, k, isa, act);
                for t in 1..=MAX_T + 8 {
                    let some = run(qtype, t, n, k, isa, act);
                    assert!(
                        some.iter()
                            .zip(&all)
                            .all(|(a, b)| a.to_bits() == b.to_bits()),
                        "{qtype:?} {act:?} {isa:?}: t={t} differs from t={}",
                        MAX_T + 8
                    );
                }
            }
        }
    }

    /// A call whose activations take several tiles (ACTIVATION_TILE_BYTES) gives each row the bits the row gives
    /// in a call of its own: the tiles' rows land in their places of `out`.
    #[test]
    fn rows_in_later_activation_tiles_land_in_their_places() {
        let (n, k) = (9, 4096); // 8-bit tiles of 2 blocks, float tiles of 1
        let t = 5 * MAX_T + 3;
        let x = activations(t, k);
        for (qtype, act) in QType::ALL
            .into_iter()
            .flat_map(|q| [(q, Activations8::Int8), (q, Activations8::Float)])
        {
            let all = run_on(&x, qtype, n, k, Isa::Best, act);
            for ti in [0, 2 * MAX_T - 1, 2 * MAX_T, 3 * MAX_T + 1, 4 * MAX_T, t - 1] {
                let alone = run_on(&x[ti * k..][..k], qtype, n, k, Isa::Best, act);
                assert!(
                    alone
                        .iter()
                        .zip(&all[ti * n..][..n])
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{qtype:?} {act:?}: row {ti} of {t}"
                );
            }
        }
    }

    /// Each weight row's result is the same bits whether it is computed alone or among others (the group
    /// kernels compute eight or sixteen rows at once, a partial group at a matrix's end, and tasks start anywhere).
    #[test]
    fn a_weight_rows_result_does_not_depend_on_its_neighbours() {
        let (t, n, k) = (3, 21, 256);
        for qtype in QType::ALL {
            for isa in [Isa::Best, Isa::Avx2] {
                let (block, size) = qtype.block();
                let row_bytes = k / block * size;
                let w = bytes(n * row_bytes, 3);
                let x: Vec<f32> = bytes(t * k, 4)
                    .iter()
                    .map(|&b| f32::from(b) / 127.0 - 1.0)
                    .collect();
                let product = |raw: &[u8], rows: usize| {
                    let mut out = vec![0f32; t * rows];
                    let m = Matrix::new(raw, qtype, rows);
                    quantized_matmul(
                        &x,
                        t,
                        k,
                        Prologue::default(),
                        &[m],
                        &mut out,
                        isa,
                        Activations8::Int8,
                    )
                    .unwrap();
                    out
                };
                let all = product(&w, n);
                for c in 0..n {
                    let alone = product(&w[c * row_bytes..][..row_bytes], 1);
                    for ti in 0..t {
                        assert_eq!(
                            alone[ti].to_bits(),
                            all[ti * n + c].to_bits(),
                            "{qtype:?} {isa:?}: row {c}, activation row {ti}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn results_do_not_depend_on_the_thread_count() {
        set_threads(1).unwrap();
        let int8 = Activations8::Int8;
        let one = run(QType::Q4_1, 5, 3000, 576, Isa::Best, int8);
        set_threads(2).unwrap();
        assert_eq!(one, run(QType::Q4_1, 5, 3000, 576, Isa::Best, int8));
    }

    #[test]
    fn mismatched_sizes_are_errors() {
        let x = vec![0f32; 64];
        let call = |raw: &[u8], t: usize, k: usize, prologue: Prologue, out: usize| {
            let m = Matrix::new(raw, QType::Q4_1, 2);
            let mut out = vec![0f32; out];
            quantized_matmul(
                &x[..t.max(1) * k.min(64)],
                t,
                k,
                prologue,
                &[m],
                &mut out,
                Isa::Best,
                Activations8::Int8,
            )
        };
        let bad = |r: Result<(), KernelError>| assert!(matches!(r, Err(KernelError::Mismatch(_))));
        bad(call(&[0; 39], 1, 64, Prologue::default(), 2)); // 80 bytes needed
        bad(call(&[0; 80], 1, 48, Prologue::default(), 2)); // k not whole blocks
        bad(call(&[0; 80], 0, 64, Prologue::default(), 2)); // no rows
        bad(call(&[0; 80], 1, 64, Prologue::default(), 1)); // out too small
        let swiglu = Prologue {
            gate: Some(Gate::Silu),
            norm: None,
        };
        bad(call(&[0; 80], 1, 64, swiglu, 2)); // SwiGLU takes [gate | up]: 128 floats a row
        let norm = [1f32; 32];
        bad(call(&[0; 80], 1, 64, Prologue::norm(&norm, 1e-5), 2)); // norm of k floats
        assert!(call(&[0; 80], 1, 64, Prologue::default(), 2).is_ok());
    }

    /// Several matrices of different types in one call: each one's columns equal its own call's, and the
    /// prologues equal the float32 formulas applied before a plain call.
    #[test]
    fn matrices_side_by_side_and_prologues() {
        let (t, k) = (3, 256);
        let x: Vec<f32> = bytes(2 * t * k, 2)
            .iter()
            .map(|&b| f32::from(b) / 127.0 - 1.0)
            .collect();
        let types = [QType::Q4K, QType::Q6K, QType::Q8_0];
        let raws: Vec<Vec<u8>> = types
            .iter()
            .zip([5, 7, 9])
            .map(|(q, n)| bytes(n * k / q.block().0 * q.block().1, n as u64))
            .collect();
        let ms: Vec<Matrix> = types
            .iter()
            .zip(&raws)
            .zip([5, 7, 9])
            .map(|((&qtype, raw), n)| Matrix::new(raw, qtype, n))
            .collect();
        let norm: Vec<f32> = (0..k).map(|i| 0.5 + i as f32 / k as f32).collect();
        let gated = |act: fn(f32) -> f32| -> Vec<f32> {
            x.chunks_exact(2 * k)
                .flat_map(|r| (0..k).map(move |i| act(r[i]) * r[k + i]))
                .collect()
        };
        let silu = gated(super::super::activation::silu);
        let relu2 = gated(|g| g.max(0.0) * g.max(0.0));
        let normed = |x: &[f32]| -> Vec<f32> {
            x.chunks_exact(k)
                .flat_map(|r| {
                    let s = 1.0 / (r.iter().map(|v| v * v).sum::<f32>() / k as f32 + 1e-5).sqrt();
                    r.iter().zip(&norm).map(move |(v, w)| v * s * w)
                })
                .collect()
        };
        let gated_norm = |gate| Prologue {
            gate: Some(gate),
            norm: Prologue::norm(&norm, 1e-5).norm,
        };
        let (normed_x, normed_relu2) = (normed(&x[..t * k]), normed(&relu2));
        let cases = [
            (Prologue::default(), &x[..t * k], &x[..t * k]),
            (
                Prologue {
                    gate: Some(Gate::Silu),
                    norm: None,
                },
                &x[..],
                &silu[..],
            ),
            (Prologue::norm(&norm, 1e-5), &x[..t * k], &normed_x[..]),
            (gated_norm(Gate::Relu2), &x[..], &normed_relu2[..]),
        ];
        for (prologue, input, plain) in cases {
            let mut all = vec![0f32; t * 21];
            quantized_matmul(
                input,
                t,
                k,
                prologue,
                &ms,
                &mut all,
                Isa::Best,
                Activations8::Int8,
            )
            .unwrap();
            let mut first = 0;
            for m in &ms {
                let mut one = vec![0f32; t * m.n];
                quantized_matmul(
                    plain,
                    t,
                    k,
                    Prologue::default(),
                    &[*m],
                    &mut one,
                    Isa::Best,
                    Activations8::Int8,
                )
                .unwrap();
                for ti in 0..t {
                    assert_eq!(&all[ti * 21 + first..][..m.n], &one[ti * m.n..][..m.n]);
                }
                first += m.n;
            }
        }
    }

    /// Q4_1, Q4_K and Q6_K rows interleaved by eight give the plain rows' bits in every kernel set, on both
    /// activation paths and for every row count, beside a plain matrix in the same call and with more than one
    /// task per matrix.
    #[test]
    fn interleaved_rows_give_the_plain_rows_bits() {
        let (n, k) = (48, 768);
        for (qtype, seed) in [(QType::Q4_1, 6), (QType::Q4K, 16), (QType::Q6K, 26)] {
            let (mixed_type, size) = qtype.interleaved().unwrap();
            let row_bytes = k / qtype.block().0 * size;
            let plain = bytes(n * row_bytes, seed);
            let mut mixed = vec![0u8; plain.len()];
            super::super::interleave::interleave(&plain, row_bytes, size, &mut mixed);
            interleaved_products_agree(k, n, (&plain, qtype), (&mixed, mixed_type));
        }
    }

    /// Q4_K at the bounds its exact sums rely on (`SuperBlock::SPAN_TOTALS`, and `Madd`'s 16-bit pair-sums in the
    /// interleaved kernel): every code 15, every sub-scale and offset multiplier 63, every activation code +127 or
    /// -127. Plain rows (the row kernel for one activation row, regrouped beyond) and the interleaved layout agree
    /// bit for bit, and both give Σ (d·63·15 - dmin·63)·x to float32 rounding.
    #[test]
    fn q4_k_at_its_bounds_sums_exactly() {
        let (n, k) = (16, 512);
        let mut block = [0xFFu8; 144];
        block[..4].copy_from_slice(&[0x00, 0x3C, 0x00, 0x38]); // d = 1, dmin = 0.5 (float16)
        let plain = block.repeat(n * k / 256);
        let mut mixed = vec![0u8; plain.len()];
        super::super::interleave::interleave(&plain, k / 256 * 144, 144, &mut mixed);
        let isas = [Isa::Best, Isa::Avx512, Isa::AvxVnni, Isa::Avx2];
        for sign in [1.0f32, -1.0] {
            for t in [1, 2, 8, 33] {
                let x = vec![sign; t * k]; // codes of ±127, one scale per span
                for isa in isas.into_iter().filter(|i| i.available()) {
                    let product = |w: &[u8], qtype: QType| {
                        let mut out = vec![0f32; t * n];
                        let m = [Matrix::new(w, qtype, n)];
                        quantized_matmul(
                            &x,
                            t,
                            k,
                            Prologue::default(),
                            &m,
                            &mut out,
                            isa,
                            Activations8::Int8,
                        )
                        .unwrap();
                        out
                    };
                    let (want, got) = (product(&plain, QType::Q4K), product(&mixed, QType::Q4KX8));
                    let exact = sign * (63.0 * 15.0 - 0.5 * 63.0) * k as f32;
                    for (a, b) in want.iter().zip(&got) {
                        assert_eq!(a.to_bits(), b.to_bits(), "{isa:?} t={t} sign {sign}");
                        assert!(
                            (a - exact).abs() <= 1e-6 * exact.abs(),
                            "{isa:?} t={t}: {a} vs {exact}"
                        );
                    }
                }
            }
        }
    }

    /// Q6_K at the bounds its exact span sums rely on (`SuperBlock::SPAN_TOTALS`; the lane kernels' sub-block sums,
    /// whole or as 16-bit pair-sums, times sub-scales, and their offsets): every code q = +31 or -32, every
    /// sub-scale -128 or +127, every activation code +127 or -127. Passes of any number of activation rows (the
    /// row kernel, the lanes of eight or sixteen rows, a lone group of eight beside pairs, AMX's tiles where
    /// present), on plain rows or interleaved ones, with every kernel set, give each row the one-row pass's bits,
    /// and Σ d·sc·q·x to float32 rounding.
    #[test]
    fn q6_k_at_its_bounds_sums_exactly() {
        let k = 512;
        let isas = [Isa::Best, Isa::Avx512, Isa::AvxVnni, Isa::Avx2];
        // (code fill byte, sub-scale byte, q); 16 rows are one pair of groups, 24 a pair and a lone group.
        let cases = [
            (0xFF, 0x80u8, 31.0f32),
            (0x00, 0x80, -32.0),
            (0xFF, 0x7F, 31.0),
        ];
        for (n, (fill, scale, q)) in [16, 24]
            .into_iter()
            .flat_map(|n| cases.map(|case| (n, case)))
        {
            let mut block = [fill; 210]; // ql and qh: every code c = 63 (q = 31) or 0 (q = -32)
            block[192..208].fill(scale);
            block[208..].copy_from_slice(&[0x00, 0x3C]); // d = 1 (float16)
            let w = block.repeat(n * k / 256);
            let mut mixed = vec![0u8; w.len()];
            super::super::interleave::interleave(&w, k / 256 * 210, 210, &mut mixed);
            let sc = f32::from(scale as i8);
            for sign in [1.0f32, -1.0] {
                let exact = sign * sc * q * k as f32;
                for isa in isas.into_iter().filter(|i| i.available()) {
                    let product = |t: usize, w: &[u8], qtype: QType| {
                        let mut out = vec![0f32; t * n];
                        let (x, m) = (vec![sign; t * k], [Matrix::new(w, qtype, n)]);
                        let int8 = Activations8::Int8;
                        quantized_matmul(&x, t, k, Prologue::default(), &m, &mut out, isa, int8)
                            .unwrap();
                        out
                    };
                    let one = product(1, &w, QType::Q6K);
                    assert!(
                        one.iter().all(|y| (y - exact).abs() <= 1e-6 * exact.abs()),
                        "{isa:?} {one:?} vs {exact}"
                    );
                    for t in [1, 2, 3, 4, 5, 6, 8, 16, 33] {
                        let alls = [product(t, &w, QType::Q6K), product(t, &mixed, QType::Q6KX8)];
                        for (layout, all) in alls.iter().enumerate() {
                            for (i, y) in all.iter().enumerate() {
                                assert_eq!(
                                    y.to_bits(),
                                    one[i % n].to_bits(),
                                    "{isa:?} n={n} t={t} output {i} (interleaved: {})",
                                    layout == 1
                                );
                            }
                        }
                    }
                }
            }
        }
    }

    /// The products of `plain` and its interleaved layout `mixed` (n rows of k elements), each beside five Q4_0
    /// rows, are equal bit for bit (see `interleaved_rows_give_the_plain_rows_bits`).
    fn interleaved_products_agree(
        k: usize,
        n: usize,
        plain: (&[u8], QType),
        mixed: (&[u8], QType),
    ) {
        let other = bytes(5 * k / 32 * 18, 7); // five Q4_0 rows after the interleaved ones
        for act in [Activations8::Int8, Activations8::Float] {
            for isa in [
                Isa::Best,
                Isa::Amx,
                Isa::Avx512,
                Isa::Avx2,
                Isa::Neon,
                Isa::Scalar,
            ]
            .into_iter()
            .filter(|i| i.available())
            {
                for t in (1..=MAX_T).chain([MAX_T + 9]) {
                    let x: Vec<f32> = bytes(t * k, 8)
                        .iter()
                        .map(|&b| f32::from(b) / 127.0 - 1.0)
                        .collect();
                    let product = |w: &[u8], qtype: QType| {
                        let mut out = vec![0f32; t * (n + 5)];
                        let ms = [
                            Matrix::new(w, qtype, n),
                            Matrix::new(&other, QType::Q4_0, 5),
                        ];
                        quantized_matmul(&x, t, k, Prologue::default(), &ms, &mut out, isa, act)
                            .unwrap();
                        out
                    };
                    let (want, got) = (product(plain.0, plain.1), product(mixed.0, mixed.1));
                    assert!(
                        want.iter()
                            .zip(&got)
                            .all(|(a, b)| a.to_bits() == b.to_bits()),
                        "{:?} {act:?} {isa:?} t={t}",
                        mixed.1
                    );
                }
            }
        }
    }

    /// Interleaved rows come in whole groups of eight, at an output column that is a multiple of eight.
    #[test]
    fn interleaved_rows_out_of_their_groups_are_errors() {
        let k = 256;
        let row_bytes = k / 32 * 20;
        let x = vec![0.5f32; k];
        let call = |ms: &[Matrix]| {
            let mut out = vec![0f32; ms.iter().map(|m| m.n).sum()];
            quantized_matmul(
                &x,
                1,
                k,
                Prologue::default(),
                ms,
                &mut out,
                Isa::Best,
                Activations8::Int8,
            )
        };
        let w = vec![0u8; 16 * row_bytes];
        let q8 = vec![0u8; 3 * k / 32 * 34];
        assert!(matches!(
            call(&[Matrix::new(&w[..12 * row_bytes], QType::Q4_1X8, 12)]),
            Err(KernelError::Mismatch(_))
        ));
        let after_three = [
            Matrix::new(&q8, QType::Q8_0, 3),
            Matrix::new(&w, QType::Q4_1X8, 16),
        ];
        assert!(matches!(call(&after_three), Err(KernelError::Mismatch(_))));
        let before_three = [
            Matrix::new(&w, QType::Q4_1X8, 16),
            Matrix::new(&q8, QType::Q8_0, 3),
        ];
        assert!(call(&before_three).is_ok());
    }

    /// A matrix's scale multiplies its outputs, and only its own: a scale of 1 changes no bit.
    #[test]
    fn a_matrix_scale_multiplies_its_outputs() {
        let (t, k) = (2, 256);
        let x: Vec<f32> = bytes(t * k, 5)
            .iter()
            .map(|&b| f32::from(b) / 127.0 - 1.0)
            .collect();
        let (a, b) = (bytes(3 * 66, 6), bytes(4 * 54, 7));
        let product = |scales: [f32; 2]| {
            let ms = [
                Matrix {
                    scale: scales[0],
                    ..Matrix::new(&a, QType::TQ2_0, 3)
                },
                Matrix {
                    scale: scales[1],
                    ..Matrix::new(&b, QType::TQ1_0, 4)
                },
            ];
            let mut out = vec![0f32; t * 7];
            quantized_matmul(
                &x,
                t,
                k,
                Prologue::default(),
                &ms,
                &mut out,
                Isa::Best,
                Activations8::Int8,
            )
            .unwrap();
            out
        };
        let (plain, scaled) = (product([1.0, 1.0]), product([0.5, 3.0]));
        for (i, (p, s)) in plain.iter().zip(&scaled).enumerate() {
            let want = p * if i % 7 < 3 { 0.5 } else { 3.0 };
            assert_eq!(s.to_bits(), want.to_bits(), "output {i}");
        }
    }
}
