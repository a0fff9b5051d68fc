//! CPU matrix-vector kernels over GGUF-encoded weights: out [t, n] = x [t, k] · Wᵀ for small t, reading each
//! weight block once per call. By default activations are quantized to 8 bits per 32 elements (`q8`, llama.cpp's
//! Q8_0) and meet the weight codes in integer dot products; float32 activations remain as the reference path.
//!
//! - `blocks`: block layouts, scale decoding and scalar code decoding per type;
//! - `halves`: float16 and bfloat16 to and from float32;
//! - `q8`: activation quantization;
//! - `dequant`: encoded rows decoded to float32 (embedding lookups);
//! - `interleave`: rows interleaved by eight, word by word (the layout resident Q4_1 and Q4_K matrices take);
//! - `rows`: what every row kernel shares (the activations of a call, the row-kernel signature, `MAX_T`);
//! - `dot`: portable scalar row kernels (integer and float);
//! - `avx2`: AVX2/FMA row kernels, integer and float (x86-64, selected at run time);
//! - `avx512`: AVX-512 float row kernels for the block-quantized types (x86-64, selected at run time);
//! - `neon`: NEON integer row kernels for the block-quantized types (aarch64; `sdot` selected at run time);
//! - `exp`: e^x as one polynomial, the same bits scalar and vectorized;
//! - `activation`: the FFN gate's activation over a row (SiLU through `exp`);
//! - `kv`: KV caches of float32, float16 or bfloat16 elements;
//! - `attention`: RoPE, KV-cache writes and attention of a few new tokens (float32 arithmetic over any `kv` cache);
//! - `block`: a whole pre-norm decoder block (the products and attention above) in one call, or a stack of them;
//! - `team`: the kernel threads, which the calling thread joins;
//! - `runs`: a call's chunks of work as one run per thread, with stealing at the end;
//! - `memory_rate`: how fast those threads read RAM (a decode step's roofline);
//! - `matmul`: the entry point, argument checks, kernel selection and work split;
//! - `column_groups`: products over some column groups of a matrix (a sparse FFN's down projection).
//!
//! Imports go one way: the row kernels (`dot`, `avx2`, `avx512`, `neon`) use `blocks` and `rows`; `matmul` uses
//! them all.

mod activation;
mod attention;
#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
mod block;
mod blocks;
mod column_groups;
mod dequant;
mod dot;
mod exp;
mod halves;
mod interleave;
mod kv;
mod matmul;
mod memory_rate;
#[cfg(target_arch = "aarch64")]
mod neon;
mod q8;
mod rows;
mod runs;
mod team;

pub use attention::{attend, AttentionShape, RopeKind};
pub use block::{decoder_stack, BlockCache, BlockEnd, BlockSettings, BlockWeights};
pub use column_groups::{column_groups_matmul, ColumnGroup};
pub use dequant::dequantize;
pub use interleave::permute_in_place;
pub use kv::{KvCache, KvRows};
pub use matmul::{
    interleaved_kernels, quantized_matmul, set_threads, threads, Activations8, Gate, Isa,
    KernelError, Matrix, Prologue, QType,
};
pub use memory_rate::memory_read_seconds;
pub use rows::MAX_T;
