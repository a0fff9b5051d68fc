//! `quantized_matmul`: argument checks, activation quantization, kernel selection (AVX-512, AVX2 or scalar;
//! integer or float) and the thread pool.
//!
//! Work is split across threads by output rows only: each output element is computed by one thread in a fixed
//! order, so results do not depend on the number of threads.

use std::sync::{Arc, RwLock};

use rayon::prelude::*;
use rayon::ThreadPool;

use super::blocks::{self, Dense, Format, GROUP};
use super::dot;
use super::q8::Q8Rows;
use super::rows::{Activations, RowKernel, MAX_T};

/// Least work per task, in multiply-adds (weights x activation rows): about 40-80 us on one core (AVX-512: a
/// 576 x 1536 Q4_1 matrix takes ~35 us, a 192 x 4096 Q4_K one ~60 us). Waking a second thread costs ~20 us, so
/// smaller matrices run on the calling thread: on 2 cores, splitting SmolLM2's 576-wide matrices made decode
/// 30% slower (67 vs 99 tok/s).
const MIN_TASK_WORK: usize = 1 << 18;
/// Tasks per thread, so that uneven thread speeds even out.
const TASKS_PER_THREAD: usize = 4;

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
}

impl QType {
    pub const ALL: [QType; 11] = [
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
    ];

    /// The type with ggml id `id`, if supported.
    pub fn from_id(id: u32) -> Option<QType> {
        QType::ALL.into_iter().find(|q| *q as u32 == id)
    }

    /// (elements, bytes) per block.
    pub fn block(self) -> (usize, usize) {
        fn q<F: Format>() -> (usize, usize) {
            (F::BLOCK, F::BYTES)
        }
        fn d<D: Dense>() -> (usize, usize) {
            (1, D::BYTES)
        }
        match self {
            QType::F32 => d::<blocks::F32>(),
            QType::F16 => d::<blocks::F16>(),
            QType::BF16 => d::<blocks::BF16>(),
            QType::Q4_0 => q::<blocks::Q4_0>(),
            QType::Q4_1 => q::<blocks::Q4_1>(),
            QType::Q5_0 => q::<blocks::Q5_0>(),
            QType::Q5_1 => q::<blocks::Q5_1>(),
            QType::Q8_0 => q::<blocks::Q8_0>(),
            QType::Q4K => q::<blocks::Q4K>(),
            QType::Q5K => q::<blocks::Q5K>(),
            QType::Q6K => q::<blocks::Q6K>(),
        }
    }

    fn affine(self) -> bool {
        matches!(self, QType::Q4_1 | QType::Q5_1 | QType::Q4K | QType::Q5K)
    }

    /// The row kernel for `isa` and `activations`: the widest this CPU runs and the type has, down to scalar.
    /// Dense types always take float activations.
    fn kernel(self, isa: Isa, activations: Activations8) -> RowKernel {
        let int = activations == Activations8::Int8;
        match self {
            QType::F32 => dense_kernel::<blocks::F32>(isa),
            QType::F16 => dense_kernel::<blocks::F16>(isa),
            QType::BF16 => dense_kernel::<blocks::BF16>(isa),
            QType::Q4_0 => quantized_kernel::<blocks::Q4_0>(isa, int),
            QType::Q4_1 => quantized_kernel::<blocks::Q4_1>(isa, int),
            QType::Q5_0 => quantized_kernel::<blocks::Q5_0>(isa, int),
            QType::Q5_1 => quantized_kernel::<blocks::Q5_1>(isa, int),
            QType::Q8_0 => quantized_kernel::<blocks::Q8_0>(isa, int),
            QType::Q4K => quantized_kernel::<blocks::Q4K>(isa, int),
            QType::Q5K => quantized_kernel::<blocks::Q5K>(isa, int),
            QType::Q6K => quantized_kernel::<blocks::Q6K>(isa, int),
        }
    }

    fn dense(self) -> bool {
        matches!(self, QType::F32 | QType::F16 | QType::BF16)
    }
}

/// A block format every kernel set decodes (on x86-64: the AVX2 and AVX-512 decoders too).
#[cfg(target_arch = "x86_64")]
trait Quantized: Format + super::avx2::SimdFormat + super::avx512::Avx512Format {}
#[cfg(target_arch = "x86_64")]
impl<F: Format + super::avx2::SimdFormat + super::avx512::Avx512Format> Quantized for F {}
#[cfg(not(target_arch = "x86_64"))]
trait Quantized: Format {}
#[cfg(not(target_arch = "x86_64"))]
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

/// The row kernel of format `F`: AVX-512 for float activations where allowed and present, else AVX2, else
/// scalar; integer (8-bit activations) or float.
fn quantized_kernel<F: Quantized>(isa: Isa, int: bool) -> RowKernel {
    #[cfg(target_arch = "x86_64")]
    {
        if !int && matches!(isa, Isa::Best | Isa::Avx512) && super::avx512::available() {
            return super::avx512::quantized::<F>();
        }
        if isa != Isa::Scalar && super::avx2::available() {
            return if int {
                super::avx2::int::<F>()
            } else {
                super::avx2::quantized::<F>()
            };
        }
    }
    let _ = isa;
    if int {
        dot::int_row::<F>
    } else {
        dot::quantized_row::<F>
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
    /// The widest this CPU has: AVX-512 (float kernels of quantized types), AVX2 + FMA, else scalar.
    Best,
    /// AVX-512 F/BW/VL float kernels where written (quantized types), AVX2 for the rest. Callers check
    /// `Isa::available` first (`ntio._core.kernel_isa_available`).
    Avx512,
    /// AVX2 + FMA where the CPU has them, else scalar (to test the AVX2 kernels on AVX-512 machines).
    Avx2,
    Scalar,
}

impl Isa {
    /// The set named `name` (`best`, `avx512`, `avx2`, `scalar`), if there is one.
    pub fn from_name(name: &str) -> Option<Isa> {
        match name {
            "best" => Some(Isa::Best),
            "avx512" => Some(Isa::Avx512),
            "avx2" => Some(Isa::Avx2),
            "scalar" => Some(Isa::Scalar),
            _ => None,
        }
    }

    /// Whether this CPU runs the set: a forced set the CPU lacks is refused, never run into SIGILL.
    pub fn available(self) -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            match self {
                Isa::Best | Isa::Scalar => true,
                Isa::Avx512 => super::avx512::available() && super::avx2::available(),
                Isa::Avx2 => super::avx2::available(),
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
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
}

fn mismatch(message: String) -> Result<(), KernelError> {
    Err(KernelError::Mismatch(message))
}

/// out [t, n] = x [t, k] · Wᵀ, W [n, k] encoded as `qtype` in `raw` (n rows of k / block blocks), float32
/// accumulation; quantized types take `activations` as given (dense types always float). Size errors name the
/// argument (`x`, `raw`, `out`).
#[allow(clippy::too_many_arguments)]
pub fn quantized_matmul(
    x: &[f32],
    raw: &[u8],
    qtype: QType,
    t: usize,
    n: usize,
    k: usize,
    out: &mut [f32],
    isa: Isa,
    activations: Activations8,
) -> Result<(), KernelError> {
    let (block, bytes) = qtype.block();
    if t == 0 || t > MAX_T {
        return mismatch(format!(
            "t = {t} activation rows; the kernels take 1 to {MAX_T}"
        ));
    }
    if k % block != 0 {
        return mismatch(format!(
            "k = {k} is not a multiple of the {qtype:?} block size {block}"
        ));
    }
    let row_bytes = k / block * bytes;
    if raw.len() != n * row_bytes {
        return mismatch(format!(
            "raw has {} bytes; {qtype:?} weights [{n}, {k}] take {} bytes",
            raw.len(),
            n * row_bytes
        ));
    }
    if x.len() != t * k {
        return mismatch(format!(
            "x has {} floats, [{t}, {k}] needs {}",
            x.len(),
            t * k
        ));
    }
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
    let int = activations == Activations8::Int8 && !qtype.dense();
    let q8 = int.then(|| Q8Rows::quantize(x, k));
    let sums = if qtype.affine() && !int {
        x.chunks_exact(GROUP).map(|g| g.iter().sum()).collect()
    } else {
        Vec::new()
    };
    let a = Activations { x, sums, q8, t, k };
    let kernel = qtype.kernel(isa, activations);
    let out_ptr = OutPtr(out.as_mut_ptr());
    let rows_fn = |rows: std::ops::Range<usize>| {
        let mut y = [0f32; MAX_T];
        for r in rows {
            kernel(&a, &raw[r * row_bytes..][..row_bytes], &mut y);
            for (ti, &v) in y[..t].iter().enumerate() {
                // SAFETY: ti < t and r < n, so ti * n + r is inside `out` (t * n floats, checked above); tasks
                // own disjoint row ranges, so no two threads write the same element; `out` outlives the call.
                unsafe { *out_ptr.at(ti * n + r) = v };
            }
        }
    };
    let pool = pool()?;
    let threads = pool.current_num_threads();
    // Equal tasks of at least MIN_TASK_WORK (at T = 1: a 576 x 576 matrix is one task; a 576 x 4096 Q4_K one, 2;
    // the 49152 x 576 head, 8 of 6144 rows on 2 threads).
    let tasks = (n * k * t / MIN_TASK_WORK).clamp(1, threads * TASKS_PER_THREAD);
    let rows_per_task = n.div_ceil(tasks);
    if threads == 1 || rows_per_task >= n {
        rows_fn(0..n);
    } else {
        let tasks = n.div_ceil(rows_per_task);
        pool.install(|| {
            (0..tasks)
                .into_par_iter()
                .for_each(|i| rows_fn(i * rows_per_task..((i + 1) * rows_per_task).min(n)))
        });
    }
    Ok(())
}

/// The output base pointer, shared by the tasks of one call (each writes its own elements).
#[derive(Clone, Copy)]
struct OutPtr(*mut f32);
// SAFETY: tasks write disjoint elements (see `quantized_matmul`) and the buffer outlives the pool call.
unsafe impl Send for OutPtr {}
// SAFETY: as above.
unsafe impl Sync for OutPtr {}

impl OutPtr {
    fn at(self, i: usize) -> *mut f32 {
        self.0.wrapping_add(i)
    }
}

/// The kernel thread pool; `None` until first used or sized by `set_threads`.
static POOL: RwLock<Option<Arc<ThreadPool>>> = RwLock::new(None);

fn build_pool(threads: usize) -> Result<Arc<ThreadPool>, KernelError> {
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .thread_name(|i| format!("ntio-kernel-{i}"))
        .build()
        .map(Arc::new)
        .map_err(|e| KernelError::Threads {
            threads,
            reason: e.to_string(),
        })
}

fn pool() -> Result<Arc<ThreadPool>, KernelError> {
    if let Some(pool) = POOL.read().unwrap_or_else(|e| e.into_inner()).as_ref() {
        return Ok(Arc::clone(pool));
    }
    let mut slot = POOL.write().unwrap_or_else(|e| e.into_inner());
    if slot.is_none() {
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        *slot = Some(build_pool(threads)?);
    }
    Ok(Arc::clone(slot.as_ref().expect("pool just set")))
}

/// Use `threads` kernel threads from now on (0: one per available CPU). Calls in flight keep their pool.
pub fn set_threads(threads: usize) -> Result<(), KernelError> {
    let threads = if threads == 0 {
        std::thread::available_parallelism().map_or(1, |n| n.get())
    } else {
        threads
    };
    let pool = build_pool(threads)?;
    *POOL.write().unwrap_or_else(|e| e.into_inner()) = Some(pool);
    Ok(())
}

/// Kernel threads in use.
pub fn threads() -> usize {
    pool().map_or(1, |p| p.current_num_threads())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Pseudo-random bytes, bit 6 clear in every odd byte: every (little-endian) f16/bf16/f32 field they form
    /// has the top exponent bit clear, so it is finite and below 2 in magnitude; codes still take every value.
    fn bytes(len: usize, seed: u64) -> Vec<u8> {
        let mut s = seed;
        (0..len)
            .map(|i| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                (s >> 33) as u8 & if i % 2 == 1 { 0xBF } else { 0xFF }
            })
            .collect()
    }

    fn run(qtype: QType, t: usize, n: usize, k: usize, isa: Isa, act: Activations8) -> Vec<f32> {
        let (block, size) = qtype.block();
        let w = bytes(n * k / block * size, 1);
        let x: Vec<f32> = bytes(t * k, 2)
            .iter()
            .map(|&b| f32::from(b) / 127.0 - 1.0)
            .collect();
        let mut out = vec![0f32; t * n];
        quantized_matmul(&x, &w, qtype, t, n, k, &mut out, isa, act).unwrap();
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
            for t in 1..=MAX_T {
                let scalar = run(qtype, t, n, k, Isa::Scalar, act);
                for isa in [Isa::Best, Isa::Avx2] {
                    let simd = run(qtype, t, n, k, isa, act);
                    for (ti, (s, v)) in scalar.chunks(n).zip(simd.chunks(n)).enumerate() {
                        let norm = s.iter().map(|v| v * v).sum::<f32>().sqrt();
                        let diff = s
                            .iter()
                            .zip(v)
                            .map(|(a, b)| (a - b) * (a - b))
                            .sum::<f32>()
                            .sqrt();
                        assert!(
                            norm > 0.0 && diff <= 1e-5 * norm,
                            "{qtype:?} {act:?} {isa:?} t={t} row {ti}: {diff} vs {norm}"
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
        let mut out = vec![0f32; 2];
        let x = vec![0f32; 64];
        let bad = |r: Result<(), KernelError>| assert!(matches!(r, Err(KernelError::Mismatch(_))));
        bad(quantized_matmul(
            &x,
            &[0; 39],
            QType::Q4_1,
            1,
            2,
            64,
            &mut out,
            Isa::Best,
            Activations8::Int8,
        )); // 80 bytes needed
        bad(quantized_matmul(
            &x,
            &[0; 80],
            QType::Q4_1,
            1,
            2,
            48,
            &mut out,
            Isa::Best,
            Activations8::Int8,
        )); // k not whole blocks
        bad(quantized_matmul(
            &x,
            &[0; 80],
            QType::Q4_1,
            0,
            2,
            64,
            &mut out,
            Isa::Best,
            Activations8::Int8,
        )); // no rows
        bad(quantized_matmul(
            &x,
            &[0; 80],
            QType::Q4_1,
            1,
            2,
            64,
            &mut out[..1],
            Isa::Best,
            Activations8::Int8,
        ));
        let ok = quantized_matmul(&x, &[0; 80], QType::Q4_1, 1, 2, 64, &mut out, Isa::Best, Activations8::Int8);
        assert!(ok.is_ok());
    }
}
