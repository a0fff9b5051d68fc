//! Extents and request planning: validate a batch, coalesce adjacent extents, widen unaligned
//! pieces to aligned windows (read through a bounce region) and split everything into requests of
//! at most `request_size` bytes. Pure arithmetic: no I/O here.

use std::path::Path;

use crate::error::{Error, Result};

/// Copy file bytes `[file_offset, file_offset + length)` to destination bytes
/// `[dest_offset, dest_offset + length)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Extent {
    pub file_offset: u64,
    pub length: usize,
    pub dest_offset: usize,
}

/// One read syscall's worth of work (resubmitted from `file_offset + done` after a short read).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Request {
    /// Which of the reader's files it reads (`backend::Files`); 0 for a single file.
    pub file: usize,
    /// Where the read starts, in that file; a multiple of the alignment.
    pub file_offset: u64,
    /// Bytes asked of the kernel; a multiple of the alignment.
    pub len: usize,
    /// Bytes the request must deliver; `needed < len` only where the aligned window runs past
    /// the end of the file, where the kernel returns a short read that is still complete.
    pub needed: usize,
    pub target: Target,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target {
    /// Read straight into the destination at `dest_offset`.
    Direct { dest_offset: usize },
    /// Read into a bounce region, then copy bytes `[skip, needed)` of it to `dest_offset`.
    Bounce { skip: usize, dest_offset: usize },
}

/// How requests must be shaped: `alignment` (1 for buffered reads) divides `request_size`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Geometry {
    pub alignment: usize,
    pub request_size: usize,
}

/// Check every extent against the file size and the destination capacity.
pub fn validate(extents: &[Extent], path: &Path, file_size: u64, capacity: usize) -> Result<()> {
    for (index, e) in extents.iter().enumerate() {
        if e.length == 0 {
            continue;
        }
        let file_end = e.file_offset.checked_add(e.length as u64);
        if file_end.map_or(true, |end| end > file_size) {
            return Err(Error::UnexpectedEof {
                path: path.to_path_buf(),
                offset: e.file_offset,
                length: e.length as u64,
                end_of_file: file_size,
            });
        }
        if e.dest_offset
            .checked_add(e.length)
            .map_or(true, |end| end > capacity)
        {
            return Err(Error::DestinationTooSmall {
                index,
                dest_offset: e.dest_offset as u64,
                length: e.length as u64,
                capacity: capacity as u64,
            });
        }
    }
    Ok(())
}

/// Drop empty extents, sort by file offset and merge neighbours that are contiguous both in the
/// file and in the destination.
pub fn coalesce(extents: &[Extent]) -> Vec<Extent> {
    let mut sorted: Vec<Extent> = extents.iter().copied().filter(|e| e.length > 0).collect();
    sorted.sort_by_key(|e| (e.file_offset, e.dest_offset));
    let mut merged: Vec<Extent> = Vec::with_capacity(sorted.len());
    for e in sorted {
        match merged.last_mut() {
            Some(last)
                if last.file_offset + last.length as u64 == e.file_offset
                    && last.dest_offset + last.length == e.dest_offset =>
            {
                last.length += e.length;
            }
            _ => merged.push(e),
        }
    }
    merged
}

pub fn align_down(x: u64, alignment: usize) -> u64 {
    x - x % alignment as u64
}

pub fn align_up(x: u64, alignment: usize) -> u64 {
    align_down(x + alignment as u64 - 1, alignment)
}

/// Turn validated extents into requests. `dest_addr` is the destination's address: an extent
/// goes straight into it when file and destination are congruent modulo the alignment (its
/// unaligned head and tail still go through a bounce region); otherwise all of it bounces.
pub fn plan(extents: &[Extent], geometry: Geometry, dest_addr: usize) -> Vec<Request> {
    let a = geometry.alignment;
    let mut requests = Vec::new();
    for e in coalesce(extents) {
        let start = e.file_offset;
        let end = start + e.length as u64;
        let congruent = (dest_addr + e.dest_offset) % a == (start % a as u64) as usize;
        let body_start = align_up(start, a).min(end);
        let body_end = align_down(end, a).max(body_start);
        if !congruent || body_start == body_end {
            bounce(&mut requests, e, start, end, geometry);
            continue;
        }
        if start < body_start {
            bounce(&mut requests, e, start, body_start, geometry);
        }
        let mut offset = body_start;
        while offset < body_end {
            let len = (body_end - offset).min(geometry.request_size as u64) as usize;
            let dest_offset = e.dest_offset + (offset - start) as usize;
            requests.push(Request {
                file: 0,
                file_offset: offset,
                len,
                needed: len,
                target: Target::Direct { dest_offset },
            });
            offset += len as u64;
        }
        if body_end < end {
            bounce(&mut requests, e, body_end, end, geometry);
        }
    }
    requests
}

/// Requests that read file bytes `[from, to)` of extent `e` through aligned bounce windows.
fn bounce(requests: &mut Vec<Request>, e: Extent, from: u64, to: u64, geometry: Geometry) {
    let window_end = align_up(to, geometry.alignment);
    let mut window = align_down(from, geometry.alignment);
    while window < window_end {
        let len = (window_end - window).min(geometry.request_size as u64) as usize;
        let copy_from = from.max(window);
        let copy_to = to.min(window + len as u64);
        requests.push(Request {
            file: 0,
            file_offset: window,
            len,
            needed: (copy_to - window) as usize,
            target: Target::Bounce {
                skip: (copy_from - window) as usize,
                dest_offset: e.dest_offset + (copy_from - e.file_offset) as usize,
            },
        });
        window += len as u64;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ext(file_offset: u64, length: usize, dest_offset: usize) -> Extent {
        Extent {
            file_offset,
            length,
            dest_offset,
        }
    }

    const G: Geometry = Geometry {
        alignment: 4096,
        request_size: 16384,
    };

    /// Apply a plan to `file` the way a backend does, so tests check bytes, not request shapes.
    fn simulate(requests: &[Request], file: &[u8], dest_len: usize) -> Vec<u8> {
        let mut dest = vec![0u8; dest_len];
        for r in requests {
            let start = r.file_offset as usize;
            let got = &file[start..(start + r.len).min(file.len())];
            assert!(
                got.len() >= r.needed,
                "request {r:?} needs bytes past end of file"
            );
            match r.target {
                Target::Direct { dest_offset } => {
                    dest[dest_offset..dest_offset + r.len].copy_from_slice(got)
                }
                Target::Bounce { skip, dest_offset } => {
                    let n = r.needed - skip;
                    dest[dest_offset..dest_offset + n].copy_from_slice(&got[skip..r.needed]);
                }
            }
        }
        dest
    }

    #[test]
    fn alignment_helpers() {
        assert_eq!(align_down(4095, 4096), 0);
        assert_eq!(align_down(4096, 4096), 4096);
        assert_eq!(align_up(1, 4096), 4096);
        assert_eq!(align_up(8192, 4096), 8192);
        assert_eq!(align_up(0, 4096), 0);
    }

    #[test]
    fn coalesces_file_and_dest_adjacent_extents_in_any_order() {
        let merged = coalesce(&[
            ext(100, 50, 1000),
            ext(0, 100, 900),
            ext(150, 0, 0),
            ext(150, 10, 5000),
        ]);
        assert_eq!(merged, vec![ext(0, 150, 900), ext(150, 10, 5000)]);
    }

    #[test]
    fn aligned_extent_is_split_into_direct_requests() {
        let reqs = plan(&[ext(0, 40960, 0)], G, 0);
        assert_eq!(reqs.len(), 3);
        assert!(reqs
            .iter()
            .all(|r| matches!(r.target, Target::Direct { .. }) && r.len <= 16384));
        assert_eq!(reqs.iter().map(|r| r.len).sum::<usize>(), 40960);
        assert_eq!(
            reqs[2],
            Request {
                file: 0,
                file_offset: 32768,
                len: 8192,
                needed: 8192,
                target: Target::Direct { dest_offset: 32768 }
            }
        );
    }

    #[test]
    fn unaligned_congruent_extent_bounces_only_head_and_tail() {
        // File offset 100 lands at destination offset 100 of an aligned buffer: congruent.
        let reqs = plan(&[ext(100, 20000, 100)], G, 0x10000);
        let head = reqs[0];
        assert_eq!(
            head,
            Request {
                file: 0,
                file_offset: 0,
                len: 4096,
                needed: 4096,
                target: Target::Bounce {
                    skip: 100,
                    dest_offset: 100
                }
            }
        );
        let tail = *reqs.last().unwrap();
        assert_eq!(
            tail,
            Request {
                file: 0,
                file_offset: 16384,
                len: 4096,
                needed: 20100 - 16384,
                target: Target::Bounce {
                    skip: 0,
                    dest_offset: 16384
                }
            }
        );
        assert!(reqs[1..reqs.len() - 1]
            .iter()
            .all(|r| matches!(r.target, Target::Direct { .. })));
    }

    #[test]
    fn incongruent_extent_bounces_through_aligned_windows() {
        let reqs = plan(&[ext(100, 40000, 0)], G, 0x10000);
        assert!(reqs
            .iter()
            .all(|r| matches!(r.target, Target::Bounce { .. })));
        assert!(reqs
            .iter()
            .all(|r| r.file_offset % 4096 == 0 && r.len % 4096 == 0 && r.len <= 16384));
        assert_eq!(reqs[0].file_offset, 0);
        assert_eq!(
            reqs.last().unwrap().file_offset + reqs.last().unwrap().len as u64,
            align_up(40100, 4096)
        );
    }

    #[test]
    fn buffered_geometry_reads_everything_directly() {
        let g = Geometry {
            alignment: 1,
            request_size: 1000,
        };
        let reqs = plan(&[ext(7, 2500, 3)], g, 0x10001);
        assert_eq!(reqs.len(), 3);
        assert!(reqs
            .iter()
            .all(|r| matches!(r.target, Target::Direct { .. })));
    }

    #[test]
    fn plans_reproduce_the_file_bytes() {
        let file: Vec<u8> = (0..50_000u32).map(|i| (i * 7 + i / 251) as u8).collect();
        let extents = [
            ext(0, 0, 0),
            ext(1, 1, 0),
            ext(4095, 2, 10),
            ext(4096, 8192, 4108),
            ext(12288, 1, 12300),
            ext(30000, 50_000 - 30000, 20000),
            ext(5000, 25000, 40000),
        ];
        for g in [
            G,
            Geometry {
                alignment: 512,
                request_size: 1024,
            },
            Geometry {
                alignment: 1,
                request_size: 3,
            },
        ] {
            for dest_addr in [0usize, 4096 * 3, 13] {
                let dest = simulate(&plan(&extents, g, dest_addr), &file, 70_000);
                for e in extents {
                    let want = &file[e.file_offset as usize..e.file_offset as usize + e.length];
                    assert_eq!(
                        &dest[e.dest_offset..e.dest_offset + e.length],
                        want,
                        "{e:?} {g:?} {dest_addr}"
                    );
                }
            }
        }
    }

    #[test]
    fn validate_rejects_past_eof_and_small_destinations() {
        let p = Path::new("model.gguf");
        assert!(validate(&[ext(0, 100, 0), ext(50, 0, 1 << 40)], p, 100, 100).is_ok());
        let eof = validate(&[ext(123456, 65536, 0)], p, 100000, 1 << 20).unwrap_err();
        assert_eq!(
            eof.to_string(),
            "model.gguf: read of 65536 bytes at offset 123456 hit end of file at 100000"
        );
        assert!(matches!(
            validate(&[ext(u64::MAX, 2, 0)], p, 100, 100),
            Err(Error::UnexpectedEof { .. })
        ));
        let small = validate(&[ext(0, 10, 0), ext(0, 10, 95)], p, 100, 100).unwrap_err();
        assert!(matches!(
            small,
            Error::DestinationTooSmall {
                index: 1,
                dest_offset: 95,
                length: 10,
                capacity: 100
            }
        ));
    }

    mod properties {
        use super::*;
        use proptest::prelude::*;

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(2000))]

            /// Whatever the extents, validation refuses or the plan delivers every byte of every
            /// extent exactly where it belongs, with aligned requests that stay in the destination.
            #[test]
            fn validated_extents_plan_into_aligned_requests_covering_every_byte(
                raw in proptest::collection::vec((0u64..20_000, 0usize..9_000, 0usize..20_000), 0..6),
                file_size in 0u64..30_000,
                capacity in 0usize..30_000,
                dest_addr in (0usize..4).prop_map(|k| k * 512),
            ) {
                let extents: Vec<Extent> = raw.iter().map(|&(f, l, d)| ext(f, l, d)).collect();
                if validate(&extents, Path::new("f"), file_size, capacity).is_err() {
                    return Ok(());
                }
                let overlap = |a: &Extent, b: &Extent| {
                    a.dest_offset < b.dest_offset + b.length && b.dest_offset < a.dest_offset + a.length
                };
                if extents.iter().enumerate().any(|(i, a)| extents[..i].iter().any(|b| overlap(a, b))) {
                    return Ok(()); // two extents writing the same destination byte: either may win
                }
                let g = Geometry { alignment: 4096, request_size: 8192 };
                let requests = plan(&extents, g, dest_addr);
                let mut delivered = vec![None::<u64>; capacity];
                for r in &requests {
                    prop_assert!(r.file_offset % 4096 == 0 && r.len % 4096 == 0 && r.len <= 8192);
                    prop_assert!(r.needed <= r.len);
                    let (skip, dest) = match r.target {
                        Target::Direct { dest_offset } => {
                            prop_assert!((dest_addr + dest_offset) % 4096 == 0 && dest_offset + r.len <= capacity);
                            (0, dest_offset)
                        }
                        Target::Bounce { skip, dest_offset } => (skip, dest_offset),
                    };
                    for i in skip..r.needed {
                        delivered[dest + i - skip] = Some(r.file_offset + i as u64);
                    }
                }
                for e in extents {
                    for i in 0..e.length {
                        prop_assert_eq!(delivered[e.dest_offset + i], Some(e.file_offset + i as u64));
                    }
                }
            }
        }
    }
}
