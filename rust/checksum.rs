//! The store's checksum, xxh3-64 (seed 0, default secret), of a buffer that fills front to back.
//!
//! `Progressive` hashes a buffer while it is being read into: `advance` takes the whole 1 KiB blocks of the
//! part that has landed, `finish` the rest. A tensor read in 1 MiB requests is then mostly hashed as each
//! request lands, while its bytes are still in cache, instead of in a second pass over memory once the
//! whole tensor is in (on the project's VM: ~12-15 GB/s in place of ~7-9 GB/s, beside the decode).
//! The 64-byte stripe accumulation, nearly all of the work, runs in AVX2 where the CPU has it, chosen at
//! run time (the `xxhash-rust` crate picks SSE2 at compile time unless the whole build targets AVX2);
//! inputs of at most 240 bytes, which take other paths, go to that crate.
//!
//! Long inputs (XXH3 specification): 8 u64 accumulators; blocks of 16 stripes of 64 bytes, the stripe n
//! of a block keyed by secret[8n..8n + 64], each block followed by a scramble keyed by secret[128..192];
//! the last, partial block's whole stripes; the input's last 64 bytes keyed by secret[121..185]; the
//! accumulators merged with secret[11..75] and the length. Every result equals
//! `xxhash_rust::xxh3::xxh3_64` (tests).

const SECRET: [u8; 192] = [
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c,
    0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f,
    0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21,
    0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26, 0x4c,
    0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e, 0xa3,
    0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8,
    0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d,
    0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, 0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64,
    0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb, 0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb,
    0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49, 0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e,
    0x2b, 0x16, 0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce,
    0x45, 0xcb, 0x3a, 0x8f, 0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e,
];

const PRIME32_1: u64 = 0x9E37_79B1;
const PRIME32_2: u64 = 0x85EB_CA77;
const PRIME32_3: u64 = 0xC2B2_AE3D;
const PRIME64_1: u64 = 0x9E37_79B1_85EB_CA87;
const PRIME64_2: u64 = 0xC2B2_AE3D_27D4_EB4F;
const PRIME64_3: u64 = 0x1656_67B1_9E37_79F9;
const PRIME64_4: u64 = 0x85EB_CA77_C2B2_AE63;
const PRIME64_5: u64 = 0x27D4_EB2F_1656_67C5;

const STRIPE: usize = 64;
const STRIPES_PER_BLOCK: usize = (SECRET.len() - STRIPE) / 8;
const BLOCK: usize = STRIPE * STRIPES_PER_BLOCK;
/// Longest input the crate hashes by its short and mid-size paths.
const MID_SIZE_MAX: usize = 240;
const SCRAMBLE_KEY: usize = SECRET.len() - STRIPE;
const LAST_STRIPE_KEY: usize = SECRET.len() - STRIPE - 7;
const MERGE_KEY: usize = 11;

type Acc = [u64; 8];

const INITIAL_ACC: Acc = [
    PRIME32_3, PRIME64_1, PRIME64_2, PRIME64_3, PRIME64_4, PRIME32_2, PRIME64_5, PRIME32_1,
];

/// xxh3-64 of `bytes`.
pub fn xxh3_64(bytes: &[u8]) -> u64 {
    Progressive::new(bytes.len()).finish(bytes)
}

/// xxh3-64 of a buffer of `len` bytes being filled front to back.
#[derive(Debug, Clone)]
pub struct Progressive {
    acc: Acc,
    len: usize,
    /// Bytes taken into `acc`: whole blocks, fewer than the full-block loop's (len - 1) / BLOCK.
    hashed: usize,
}

impl Progressive {
    pub fn new(len: usize) -> Self {
        Self {
            acc: INITIAL_ACC,
            len,
            hashed: 0,
        }
    }

    /// Take the whole blocks of `landed`, the buffer's first `landed.len()` bytes, not taken yet.
    pub fn advance(&mut self, landed: &[u8]) {
        if self.len <= MID_SIZE_MAX {
            return;
        }
        let end = landed.len().min(self.full_blocks_end());
        if end > self.hashed + BLOCK - 1 {
            let blocks = (end - self.hashed) / BLOCK;
            accumulate_blocks(
                &mut self.acc,
                &landed[self.hashed..self.hashed + blocks * BLOCK],
            );
            self.hashed += blocks * BLOCK;
        }
    }

    /// The hash of `bytes`, the whole buffer (`len` bytes), of which the blocks taken so far are a prefix.
    pub fn finish(mut self, bytes: &[u8]) -> u64 {
        assert_eq!(
            bytes.len(),
            self.len,
            "Progressive::finish: not the buffer it was made for"
        );
        if self.len <= MID_SIZE_MAX {
            return xxhash_rust::xxh3::xxh3_64(bytes);
        }
        self.advance(bytes);
        let tail = &bytes[self.hashed..self.len - 1];
        accumulate_stripes(&mut self.acc, &tail[..tail.len() / STRIPE * STRIPE], 0);
        accumulate_stripes(&mut self.acc, &bytes[self.len - STRIPE..], LAST_STRIPE_KEY);
        merge(&self.acc, (self.len as u64).wrapping_mul(PRIME64_1))
    }

    /// End of the blocks the full-block loop takes: (len - 1) / BLOCK of them.
    fn full_blocks_end(&self) -> usize {
        (self.len - 1) / BLOCK * BLOCK
    }
}

fn read_u64(bytes: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(bytes[at..at + 8].try_into().expect("8 bytes"))
}

fn merge(acc: &Acc, start: u64) -> u64 {
    let mut result = start;
    for pair in 0..4 {
        let key = MERGE_KEY + 16 * pair;
        let product = (acc[2 * pair] ^ read_u64(&SECRET, key)) as u128
            * (acc[2 * pair + 1] ^ read_u64(&SECRET, key + 8)) as u128;
        result = result.wrapping_add(product as u64 ^ (product >> 64) as u64);
    }
    result ^= result >> 37;
    result = result.wrapping_mul(0x1656_6791_9E37_79F9);
    result ^ (result >> 32)
}

/// Whole blocks (`blocks.len()` a multiple of BLOCK): each one's stripes, then a scramble.
fn accumulate_blocks(acc: &mut Acc, blocks: &[u8]) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2.
        return unsafe { avx2::accumulate_blocks(acc, blocks) };
    }
    scalar_blocks(acc, blocks)
}

fn scalar_blocks(acc: &mut Acc, blocks: &[u8]) {
    for block in blocks.chunks_exact(BLOCK) {
        accumulate_stripes(acc, block, 0);
        for (i, lane) in acc.iter_mut().enumerate() {
            let mixed = *lane ^ (*lane >> 47) ^ read_u64(&SECRET, SCRAMBLE_KEY + 8 * i);
            *lane = mixed.wrapping_mul(PRIME32_1);
        }
    }
}

/// Stripes of `bytes` (whole ones; at most a block's), the stripe n keyed by SECRET[key + 8n..].
fn accumulate_stripes(acc: &mut Acc, bytes: &[u8], key: usize) {
    for (n, stripe) in bytes.chunks_exact(STRIPE).enumerate() {
        for i in 0..8 {
            let data = read_u64(stripe, 8 * i);
            let keyed = data ^ read_u64(&SECRET, key + 8 * n + 8 * i);
            acc[i ^ 1] = acc[i ^ 1].wrapping_add(data);
            acc[i] = acc[i].wrapping_add((keyed & 0xFFFF_FFFF) * (keyed >> 32));
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{Acc, BLOCK, PRIME32_1, SCRAMBLE_KEY, SECRET, STRIPE, STRIPES_PER_BLOCK};
    use std::arch::x86_64::*;

    /// `super::accumulate_blocks` with the 8 accumulators in two 256-bit registers.
    ///
    /// # Safety
    /// The CPU must have AVX2.
    #[target_feature(enable = "avx2")]
    pub unsafe fn accumulate_blocks(acc: &mut Acc, blocks: &[u8]) {
        debug_assert_eq!(blocks.len() % BLOCK, 0);
        let secret = SECRET.as_ptr();
        // SAFETY (every load and store below): unaligned 32-byte accesses inside `acc` (64 bytes),
        // SECRET (the largest key offset is 8 * 15 + 32, or SCRAMBLE_KEY + 32, under 192 - 32) and
        // the block (stripe offsets below BLOCK - 32).
        unsafe {
            let lanes = acc.as_mut_ptr().cast::<__m256i>();
            let mut a = [_mm256_loadu_si256(lanes), _mm256_loadu_si256(lanes.add(1))];
            let prime = _mm256_set1_epi64x(PRIME32_1 as i64);
            for block in blocks.chunks_exact(BLOCK) {
                for n in 0..STRIPES_PER_BLOCK {
                    for (half, a) in a.iter_mut().enumerate() {
                        let at = n * STRIPE + 32 * half;
                        let data = _mm256_loadu_si256(block.as_ptr().add(at).cast());
                        let key = _mm256_loadu_si256(secret.add(8 * n + 32 * half).cast());
                        let keyed = _mm256_xor_si256(data, key);
                        // (low 32 bits) * (high 32 bits) of each keyed lane; each lane's data added to
                        // its neighbour (lanes 2i and 2i + 1 swapped).
                        let product = _mm256_mul_epu32(keyed, _mm256_srli_epi64::<32>(keyed));
                        let swapped = _mm256_shuffle_epi32::<0b01_00_11_10>(data);
                        *a = _mm256_add_epi64(_mm256_add_epi64(*a, swapped), product);
                    }
                }
                for (half, a) in a.iter_mut().enumerate() {
                    let key = _mm256_loadu_si256(secret.add(SCRAMBLE_KEY + 32 * half).cast());
                    let mixed =
                        _mm256_xor_si256(_mm256_xor_si256(*a, _mm256_srli_epi64::<47>(*a)), key);
                    // mixed * PRIME32_1 mod 2^64, from 32x32-bit products of its low and high halves.
                    let low = _mm256_mul_epu32(mixed, prime);
                    let high = _mm256_mul_epu32(_mm256_srli_epi64::<32>(mixed), prime);
                    *a = _mm256_add_epi64(low, _mm256_slli_epi64::<32>(high));
                }
            }
            _mm256_storeu_si256(lanes, a[0]);
            _mm256_storeu_si256(lanes.add(1), a[1]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn bytes(len: usize, seed: u64) -> Vec<u8> {
        let mut x = seed | 1;
        (0..len)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect()
    }

    #[test]
    fn equals_the_crate_at_every_length_around_the_path_and_block_boundaries() {
        let data = bytes(5 * BLOCK + 300, 7);
        for len in
            (0..=2 * BLOCK + 200).chain([3 * BLOCK - 1, 3 * BLOCK, 3 * BLOCK + 1, 5 * BLOCK + 300])
        {
            let input = &data[..len];
            assert_eq!(
                xxh3_64(input),
                xxhash_rust::xxh3::xxh3_64(input),
                "length {len}"
            );
        }
    }

    #[test]
    fn the_scalar_blocks_equal_the_dispatched_ones() {
        let data = bytes(7 * BLOCK, 3);
        let mut dispatched = INITIAL_ACC;
        accumulate_blocks(&mut dispatched, &data);
        let mut scalar = INITIAL_ACC;
        scalar_blocks(&mut scalar, &data);
        assert_eq!(dispatched, scalar);
    }

    proptest! {
        #[test]
        fn advancing_over_any_landed_prefixes_gives_the_crates_hash(
            len in 0usize..40_000,
            seed in any::<u64>(),
            cuts in proptest::collection::vec(0usize..40_000, 0..8),
        ) {
            let data = bytes(len, seed);
            let mut cuts: Vec<usize> = cuts.into_iter().map(|c| c.min(len)).collect();
            cuts.sort_unstable();
            let mut hash = Progressive::new(len);
            for cut in cuts {
                hash.advance(&data[..cut]);
            }
            prop_assert_eq!(hash.finish(&data), xxhash_rust::xxh3::xxh3_64(&data));
        }
    }
}
