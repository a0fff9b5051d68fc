//! Weight rows interleaved by eight, word by word: the layout of `QType::Q4_1X8` and `QType::Q4KX8`, which a
//! resident Q4_1 or Q4_K matrix takes once at load so that its products read one linear stream, unpack eight
//! rows' scales at once and sum each row's products in its own vector lane, with no reduction across lanes.
//!
//! A matrix of n rows (n a multiple of 8), each of `blocks` blocks of `BYTES` bytes (a multiple of 4), is stored
//! as n / 8 groups of eight rows; a group holds its rows' block 0, then block 1, and so on; and in a group's block,
//! 32-bit word w of row r sits at byte 32·w + 4·r. So one 32-byte load gives the same word of the eight rows, lane
//! r for row r (Q4_1: word 0 is d and m, words 1-4 the code bytes 0-15; Q4_K: `avx2::interleaved`). Bytes and
//! size are those of the plain encoding, only their order differs.

use super::rows::GROUP_ROWS;

/// Bytes per interleaved word.
const WORD: usize = 4;

/// The interleaved layout of `rows` (n = rows.len() / row_bytes rows of blocks of `block_bytes`) into `out`, of
/// the same size. n must be a multiple of `GROUP_ROWS`, row_bytes of block_bytes, block_bytes of 4.
pub fn interleave(rows: &[u8], row_bytes: usize, block_bytes: usize, out: &mut [u8]) {
    permute(rows, row_bytes, block_bytes, out, |plain, mixed| {
        (plain, mixed)
    });
}

/// The plain rows of an interleaved layout (`interleave`'s inverse), into `out` of the same size.
pub fn deinterleave(mixed: &[u8], row_bytes: usize, block_bytes: usize, out: &mut [u8]) {
    permute(mixed, row_bytes, block_bytes, out, |plain, mixed| {
        (mixed, plain)
    });
}

/// `interleave` (or with `inverse`, `deinterleave`) in place, one group of rows at a time (a group's bytes of
/// scratch).
pub fn permute_in_place(rows: &mut [u8], row_bytes: usize, block_bytes: usize, inverse: bool) {
    let mut scratch = vec![0u8; GROUP_ROWS * row_bytes];
    for group in rows.chunks_mut(GROUP_ROWS * row_bytes) {
        scratch.copy_from_slice(group);
        if inverse {
            deinterleave(&scratch, row_bytes, block_bytes, group);
        } else {
            interleave(&scratch, row_bytes, block_bytes, group);
        }
    }
}

/// Copies every word between its plain offset and its interleaved one; `pick(plain, mixed)` gives (source offset,
/// destination offset).
fn permute(
    src: &[u8],
    row_bytes: usize,
    block_bytes: usize,
    out: &mut [u8],
    pick: impl Fn(usize, usize) -> (usize, usize),
) {
    assert!(
        block_bytes % WORD == 0
            && row_bytes % block_bytes == 0
            && src.len() % (GROUP_ROWS * row_bytes) == 0
            && out.len() == src.len(),
        "interleave: {} bytes of rows of {row_bytes} in blocks of {block_bytes}",
        src.len()
    );
    let words = block_bytes / WORD;
    let group_bytes = GROUP_ROWS * row_bytes;
    for group in (0..src.len()).step_by(group_bytes) {
        for block in 0..row_bytes / block_bytes {
            let mixed_block = group + block * GROUP_ROWS * block_bytes;
            for r in 0..GROUP_ROWS {
                let plain_block = group + r * row_bytes + block * block_bytes;
                for w in 0..words {
                    let (from, to) = pick(
                        plain_block + WORD * w,
                        mixed_block + GROUP_ROWS * WORD * w + WORD * r,
                    );
                    out[to..to + WORD].copy_from_slice(&src[from..from + WORD]);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::rows::test_bytes;
    use super::*;

    #[test]
    fn words_land_where_the_layout_says_and_come_back() {
        let (row_bytes, block_bytes) = (3 * 20, 20);
        let plain = test_bytes(16 * row_bytes, 5);
        let mut mixed = vec![0u8; plain.len()];
        interleave(&plain, row_bytes, block_bytes, &mut mixed);
        // Group 1, block 1, row 3, word 4 (Q4_1 code bytes 12-15): plain at row 11's block 1, byte 16.
        let plain_at = 11 * row_bytes + block_bytes + 16;
        let mixed_at = 8 * row_bytes + 8 * block_bytes + 32 * 4 + 4 * 3;
        assert_eq!(plain[plain_at..plain_at + 4], mixed[mixed_at..mixed_at + 4]);
        let mut back = vec![0u8; plain.len()];
        deinterleave(&mixed, row_bytes, block_bytes, &mut back);
        assert_eq!(back, plain);
        let mut in_place = plain.clone();
        permute_in_place(&mut in_place, row_bytes, block_bytes, false);
        assert_eq!(in_place, mixed);
        permute_in_place(&mut in_place, row_bytes, block_bytes, true);
        assert_eq!(in_place, plain);
    }
}
