//! KV caches of float32, float16 or bfloat16 elements (the 16-bit ones as their bits): half the bytes a cached
//! position for long contexts. Keys and values are rounded to the cache's type when written (to nearest, ties to
//! even, as torch's `.to(dtype)`), and attention widens them back to float32, exactly, a block of positions at a
//! time (`attention`).

use super::halves::{bf16_bits, f16_bits};

/// One layer's keys or values [Hkv, capacity, hd] (a stack's: [L, Hkv, capacity, hd]), written by `attend`.
pub enum KvCache<'a> {
    F32(&'a mut [f32]),
    F16(&'a mut [u16]),
    Bf16(&'a mut [u16]),
}

/// A cache's elements, read.
#[derive(Clone, Copy)]
pub enum KvRows<'a> {
    F32(&'a [f32]),
    F16(&'a [u16]),
    Bf16(&'a [u16]),
}

impl KvCache<'_> {
    /// Elements.
    #[inline]
    pub(crate) fn len(&self) -> usize {
        match self {
            KvCache::F32(x) => x.len(),
            KvCache::F16(x) | KvCache::Bf16(x) => x.len(),
        }
    }

    /// Elements start..start + len (inside the cache).
    #[inline]
    pub fn part(&mut self, start: usize, len: usize) -> KvCache<'_> {
        match self {
            KvCache::F32(x) => KvCache::F32(&mut x[start..][..len]),
            KvCache::F16(x) => KvCache::F16(&mut x[start..][..len]),
            KvCache::Bf16(x) => KvCache::Bf16(&mut x[start..][..len]),
        }
    }

    /// `x` rounded to the cache's type into elements at..at + x.len() (inside the cache).
    pub fn store(&mut self, at: usize, x: &[f32]) {
        match self {
            KvCache::F32(c) => c[at..][..x.len()].copy_from_slice(x),
            KvCache::F16(c) => c[at..][..x.len()]
                .iter_mut()
                .zip(x)
                .for_each(|(h, &v)| *h = f16_bits(v)),
            KvCache::Bf16(c) => c[at..][..x.len()]
                .iter_mut()
                .zip(x)
                .for_each(|(h, &v)| *h = bf16_bits(v)),
        }
    }

    /// The elements, to read.
    #[inline]
    pub fn rows(&self) -> KvRows<'_> {
        match self {
            KvCache::F32(x) => KvRows::F32(x),
            KvCache::F16(x) => KvRows::F16(x),
            KvCache::Bf16(x) => KvRows::Bf16(x),
        }
    }
}

impl<'a> KvRows<'a> {
    /// Elements.
    #[inline]
    pub(crate) fn len(self) -> usize {
        match self {
            KvRows::F32(x) => x.len(),
            KvRows::F16(x) | KvRows::Bf16(x) => x.len(),
        }
    }

    /// Elements start..start + len (inside the cache). Always inlined: attention takes a part per block of positions.
    #[inline(always)]
    pub fn part(self, start: usize, len: usize) -> KvRows<'a> {
        match self {
            KvRows::F32(x) => KvRows::F32(&x[start..][..len]),
            KvRows::F16(x) => KvRows::F16(&x[start..][..len]),
            KvRows::Bf16(x) => KvRows::Bf16(&x[start..][..len]),
        }
    }
}
