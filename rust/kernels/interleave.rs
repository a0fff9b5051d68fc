//! Weight rows interleaved by eight, word by word: the layout of `QType::Q4_1X8`, `QType::Q4KX8` and
//! `QType::Q6KX8`, which a resident Q4_1, Q4_K or Q6_K matrix takes once at load so that its products read one
//! linear stream, unpack eight rows' scales at once and sum each row's products in its own vector lane, with no
//! reduction across lanes.
//!
//! A matrix of n rows (n a multiple of 8), each of `blocks` blocks of `BYTES` bytes, is stored as n / 8 groups of
//! eight rows; a group holds its rows' block 0, then block 1, and so on; and in a group's block, 32-bit word w of
//! row r sits at byte 32·w + 4·r, for the block's whole words. So one 32-byte load gives the same word of the eight
//! rows, lane r for row r (Q4_1: word 0 is d and m, words 1-4 the code bytes 0-15; Q4_K: `avx2::interleaved`;
//! Q6_K: `avx2::q6k_lanes`). A block of BYTES = 4·words + tail bytes (Q6_K: 52 words, then d's 2 bytes) ends with
//! its rows' tails, row by row: row r's at 32·words + tail·r. Bytes and size are those of the plain encoding, only
//! their order differs.

use super::rows::GROUP_ROWS;

/// Bytes per interleaved word.
const WORD: usize = 4;

/// The interleaved layout of `rows` (n = rows.len() / row_bytes rows of blocks of `block_bytes`) into `out`, of
/// the same size. n must be a multiple of `GROUP_ROWS`, row_bytes of block_bytes.
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

/// Copies every word (and tail) between its plain offset and its interleaved one; `pick(plain, mixed)` gives
/// (source offset, destination offset).
fn permute(
    src: &[u8],
    row_bytes: usize,
    block_bytes: usize,
    out: &mut [u8],
    pick: impl Fn(usize, usize) -> (usize, usize),
) {
    assert!(
        block_bytes > 0
            && row_bytes % block_bytes == 0
            && src.len() % (GROUP_ROWS * row_bytes) == 0
            && out.len() == src.len(),
        "interleave: {} bytes of rows of {row_bytes} in blocks of {block_bytes}",
        src.len()
    );
    let (words, tail) = (block_bytes / WORD, block_bytes % WORD);
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
                let (from, to) = pick(
                    plain_block + WORD * words,
                    mixed_block + GROUP_ROWS * WORD * words + tail * r,
                );
                out[to..to + tail].copy_from_slice(&src[from..from + tail]);
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
        round_trip(&plain, &mixed, row_bytes, block_bytes);
    }

    /// Blocks that are not whole words (Q6_K's 210 bytes): the words interleaved, then each row's last bytes.
    #[test]
    fn a_blocks_last_bytes_follow_its_words_row_by_row() {
        let (row_bytes, block_bytes) = (2 * 210, 210);
        let plain = test_bytes(16 * row_bytes, 7);
        let mut mixed = vec![0u8; plain.len()];
        interleave(&plain, row_bytes, block_bytes, &mut mixed);
        // Group 1, block 1, row 5: word 51 (bytes 204-207), then bytes 208-209 (Q6_K's d).
        let plain_at = 13 * row_bytes + block_bytes;
        let mixed_at = 8 * row_bytes + 8 * block_bytes;
        let word = mixed_at + 32 * 51 + 4 * 5;
        assert_eq!(plain[plain_at + 204..plain_at + 208], mixed[word..word + 4]);
        let tail = mixed_at + 32 * 52 + 2 * 5;
        assert_eq!(plain[plain_at + 208..plain_at + 210], mixed[tail..tail + 2]);
        round_trip(&plain, &mixed, row_bytes, block_bytes);
    }

    /// `deinterleave` restores `plain` from `mixed`, and `permute_in_place` goes both ways.
    fn round_trip(plain: &[u8], mixed: &[u8], row_bytes: usize, block_bytes: usize) {
        let mut back = vec![0u8; plain.len()];
        deinterleave(mixed, row_bytes, block_bytes, &mut back);
        assert_eq!(back, plain);
        let mut in_place = plain.to_vec();
        permute_in_place(&mut in_place, row_bytes, block_bytes, false);
        assert_eq!(in_place, mixed);
        permute_in_place(&mut in_place, row_bytes, block_bytes, true);
        assert_eq!(in_place, plain);
    }
}
