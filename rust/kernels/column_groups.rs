//! Products over some column groups of a matrix: a sparse FFN's down projection [D, F] reads only the groups of
//! neurons (columns) its tokens keep, each group the row-major encoding of its columns (`store`'s group-major
//! copy: [D, width], one or more whole blocks a row), and sums their products.
//!
//! out [t, n] = Σ_j x[:, first_j .. first_j + width] · G_jᵀ, the groups in the order given: exactly the dense
//! product with every other column of x zeroed, up to float rounding (each group's product is rounded to float32
//! before the sum). With 8-bit activations the codes are those of the dense product: every activation span lies
//! inside one group, since a group is whole blocks and a span never crosses a block.

use super::matmul::{quantized_matmul, Activations8, Isa, KernelError, Matrix, Prologue, QType};

/// Columns [first, first + width) of a matrix [n, k], as the encoding of the matrix [n, width] they make.
#[derive(Clone, Copy)]
pub struct ColumnGroup<'a> {
    pub first: usize,
    pub raw: &'a [u8],
}

/// out [t, n] = Σ_groups x[:, first .. first + width] · rawᵀ for x [t, k] (module doc). `groups` may be empty
/// (out = 0); each group is whole blocks of `qtype`, inside [0, k). Errors name the group at fault.
#[allow(clippy::too_many_arguments)]
pub fn column_groups_matmul(
    x: &[f32],
    t: usize,
    k: usize,
    width: usize,
    groups: &[ColumnGroup],
    qtype: QType,
    n: usize,
    out: &mut [f32],
    isa: Isa,
    activations: Activations8,
) -> Result<(), KernelError> {
    let mismatch = |message: String| Err(KernelError::Mismatch(message));
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
    for (j, g) in groups.iter().enumerate() {
        if g.first + width > k {
            return mismatch(format!(
                "group {j}: columns {}..{} are outside k = {k}",
                g.first,
                g.first + width
            ));
        }
    }
    out.fill(0.0);
    // One group's activations [t, width] and product [t, n], reused.
    let mut columns = vec![0f32; t * width];
    let mut product = vec![0f32; t * n];
    for (j, g) in groups.iter().enumerate() {
        for (dst, src) in columns.chunks_exact_mut(width).zip(x.chunks_exact(k)) {
            dst.copy_from_slice(&src[g.first..g.first + width]);
        }
        let matrix = [Matrix::new(g.raw, qtype, n)];
        quantized_matmul(
            &columns,
            t,
            width,
            Prologue::default(),
            &matrix,
            &mut product,
            isa,
            activations,
        )
        .map_err(|e| match e {
            KernelError::Mismatch(message) => {
                KernelError::Mismatch(format!("group {j}: {message}"))
            }
            other => other,
        })?;
        for (o, p) in out.iter_mut().zip(&product) {
            *o += p;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::rows::{test_bytes as bytes, test_l2};
    use super::*;

    /// The groups of a row-major matrix [n, k] of `qtype`, `width` columns each, as `store` lays them out.
    fn group_major(w: &[u8], qtype: QType, n: usize, k: usize, width: usize) -> Vec<Vec<u8>> {
        let (block, size) = qtype.block();
        let (row_bytes, group_row_bytes) = (k / block * size, width / block * size);
        (0..k / width)
            .map(|j| {
                (0..n)
                    .flat_map(|r| &w[r * row_bytes + j * group_row_bytes..][..group_row_bytes])
                    .copied()
                    .collect()
            })
            .collect()
    }

    /// For every type, both activation paths and several t: the groups' sum equals the dense product of the same
    /// matrix with every column outside the groups zeroed (relative L2 <= 1e-5 a row: float rounding only).
    #[test]
    fn column_groups_give_the_dense_product_with_the_other_columns_zeroed() {
        let (n, k) = (19, 1024);
        for qtype in QType::ALL.into_iter().filter(|q| !q.interleaved_rows()) {
            let (block, size) = qtype.block();
            let width = block.max(32);
            let w = bytes(n * k / block * size, 7);
            let groups = group_major(&w, qtype, n, k, width);
            // Every third group, last first.
            let kept: Vec<usize> = (0..k / width).rev().filter(|j| j % 3 != 1).collect();
            for act in [Activations8::Int8, Activations8::Float] {
                for t in [1, 3, 9, 17] {
                    let x: Vec<f32> = bytes(t * k, 3)
                        .iter()
                        .map(|&b| f32::from(b) / 127.0 - 1.0)
                        .collect();
                    let mut zeroed = vec![0f32; t * k];
                    for (row, src) in zeroed.chunks_exact_mut(k).zip(x.chunks_exact(k)) {
                        for &j in &kept {
                            row[j * width..][..width].copy_from_slice(&src[j * width..][..width]);
                        }
                    }
                    let mut dense = vec![0f32; t * n];
                    let m = [Matrix::new(&w, qtype, n)];
                    quantized_matmul(
                        &zeroed,
                        t,
                        k,
                        Prologue::default(),
                        &m,
                        &mut dense,
                        Isa::Best,
                        act,
                    )
                    .unwrap();
                    let list: Vec<ColumnGroup> = kept
                        .iter()
                        .map(|&j| ColumnGroup {
                            first: j * width,
                            raw: &groups[j],
                        })
                        .collect();
                    let mut out = vec![f32::NAN; t * n];
                    column_groups_matmul(
                        &x,
                        t,
                        k,
                        width,
                        &list,
                        qtype,
                        n,
                        &mut out,
                        Isa::Best,
                        act,
                    )
                    .unwrap();
                    for (ti, (d, o)) in dense.chunks(n).zip(out.chunks(n)).enumerate() {
                        let (diff, norm) = test_l2(d, o);
                        assert!(
                            norm > 0.0 && diff <= 1e-5 * norm,
                            "{qtype:?} {act:?} t={t} row {ti}: {diff} vs {norm}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn no_groups_give_zeros_and_bad_groups_are_named() {
        let (n, k, width) = (8, 512, 256);
        let raw = bytes(n * 210, 1);
        let x = vec![0.5f32; k];
        let mut out = vec![f32::NAN; n];
        column_groups_matmul(
            &x,
            1,
            k,
            width,
            &[],
            QType::Q6K,
            n,
            &mut out,
            Isa::Best,
            Activations8::Int8,
        )
        .unwrap();
        assert!(out.iter().all(|&v| v == 0.0));
        let call = |first: usize, second: &[u8]| {
            let mut out = vec![0f32; n];
            let groups = [
                ColumnGroup {
                    first: 0,
                    raw: &raw,
                },
                ColumnGroup { first, raw: second },
            ];
            column_groups_matmul(
                &x,
                1,
                k,
                width,
                &groups,
                QType::Q6K,
                n,
                &mut out,
                Isa::Best,
                Activations8::Int8,
            )
        };
        assert!(call(256, &raw).is_ok());
        let message = |r: Result<(), KernelError>| match r {
            Err(KernelError::Mismatch(m)) => m,
            _ => panic!("accepted"),
        };
        assert_eq!(
            message(call(384, &raw)),
            "group 1: columns 384..640 are outside k = 512"
        );
        assert!(message(call(256, &raw[..200])).starts_with("group 1: raw has 200 bytes"));
    }
}
