//! The extent index: from (layer | tensor | tensor rows) to byte extents of the file, for a GGUF
//! file and for a store alike; and the store's data layout (where `convert` puts each tensor).
//!
//! A tensor's encoded bytes are row-major: with PyTorch shape [..., K], each of its
//! `rows = product(shape[..-1])` rows is `row_bytes = K / block * type_size` bytes, so rows
//! `[start, stop)` are the single extent `offset + start * row_bytes .. offset + stop * row_bytes`.
//! An FFN neuron group is a row range of gate and up. In down [D, F] a neuron is a column, and its
//! quantization blocks run along the neurons: a store may hold a group-major copy of each down
//! matrix (`manifest::FfnDownGroups`), whose groups `ffn_group_extents` finds, and a checksum of each group of rows
//! of gate and up (`ffn_row_group_checksums`), whose groups are read in place.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use super::checksum;
use super::error::{Result, StoreError};
use super::manifest::{GroupedCopy, RowGroups};

/// Alignment of every tensor in a store: one O_DIRECT block / page, so a tensor (and a row range
/// that starts on a page) reads without a bounce buffer.
pub const STORE_ALIGNMENT: u64 = 4096;

/// Tensors of one layer closer than this are read as one extent: reading the padding between
/// them (under 4096 bytes in a store, under 32 in a GGUF) is cheaper than another request.
pub const MERGE_GAP: u64 = STORE_ALIGNMENT;

/// Where one tensor's encoded bytes are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorSpan {
    pub name: String,
    /// Absolute file offset of the first byte.
    pub offset: u64,
    pub nbytes: u64,
    /// Rows of the row-major encoding (1 for a vector); divides `nbytes`.
    pub rows: u64,
    /// The transformer block it belongs to; `None` for globals (embedding, output, norms).
    pub layer: Option<usize>,
    /// xxh3-64 of the bytes, where the file records one (a store; not a GGUF).
    pub checksum: Option<u64>,
}

impl TensorSpan {
    pub fn row_bytes(&self) -> u64 {
        self.nbytes / self.rows
    }
}

/// (file_offset, length) in bytes.
pub type FileExtent = (u64, u64);

pub struct ExtentIndex {
    path: PathBuf,
    tensors: Vec<TensorSpan>,
    by_name: HashMap<String, usize>,
    /// Tensor indices of each layer, in file order.
    layers: Vec<Vec<usize>>,
    /// Neurons per group and each layer's group-major copy of its FFN down matrix, where the store has them.
    ffn_groups: Option<(u64, HashMap<usize, GroupedCopy>)>,
    /// Tensor name -> the checksum of each of its row groups (of the FFN group size), where the store has them.
    row_groups: HashMap<String, Vec<u64>>,
}

impl ExtentIndex {
    pub fn new(path: &Path, tensors: Vec<TensorSpan>) -> Result<Self> {
        let bad = |reason: String| StoreError::BadManifest {
            path: path.to_path_buf(),
            reason,
        };
        let mut by_name = HashMap::with_capacity(tensors.len());
        let mut layers: Vec<Vec<usize>> = Vec::new();
        for (i, t) in tensors.iter().enumerate() {
            if t.rows == 0 || t.nbytes % t.rows != 0 {
                return Err(bad(format!(
                    "tensor {:?}: {} bytes are not {} equal rows",
                    t.name, t.nbytes, t.rows
                )));
            }
            if by_name.insert(t.name.clone(), i).is_some() {
                return Err(bad(format!("tensor {:?} appears twice", t.name)));
            }
            if let Some(layer) = t.layer {
                // A layer number is bounded by the tensor count (each layer has a tensor), which keeps
                // the layer table's allocation bounded by the file.
                if layer >= tensors.len() {
                    return Err(bad(format!(
                        "tensor {:?}: layer {layer} of a file with {} tensors",
                        t.name,
                        tensors.len()
                    )));
                }
                if layer >= layers.len() {
                    layers.resize_with(layer + 1, Vec::new);
                }
                layers[layer].push(i);
            }
        }
        for members in &mut layers {
            members.sort_by_key(|&i| tensors[i].offset);
        }
        Ok(Self {
            path: path.to_path_buf(),
            tensors,
            by_name,
            layers,
            ffn_groups: None,
            row_groups: HashMap::new(),
        })
    }

    /// The index with group-major copies of down matrices (checked against their tensors by the manifest), one
    /// per layer at most.
    pub fn with_ffn_groups(mut self, neurons: u64, copies: Vec<GroupedCopy>) -> Result<Self> {
        let mut by_layer = HashMap::with_capacity(copies.len());
        for copy in copies {
            let layer = self.tensor(&copy.tensor)?.layer;
            let Some(layer) = layer.filter(|l| !by_layer.contains_key(l)) else {
                return Err(StoreError::BadManifest {
                    path: self.path.clone(),
                    reason: format!(
                        "a second FFN group copy of layer {layer:?} ({:?})",
                        copy.tensor
                    ),
                });
            };
            by_layer.insert(layer, copy);
        }
        self.ffn_groups = Some((neurons, by_layer));
        Ok(self)
    }

    /// The index with the checksums of row groups of dense tensors (checked against their tensors by the manifest),
    /// one list per tensor at most.
    pub fn with_row_groups(mut self, row_groups: Vec<RowGroups>) -> Result<Self> {
        for rows in row_groups {
            self.tensor(&rows.tensor)?;
            if self.row_groups.contains_key(&rows.tensor) {
                return Err(StoreError::BadManifest {
                    path: self.path.clone(),
                    reason: format!("FFN row groups of {:?} listed twice", rows.tensor),
                });
            }
            self.row_groups.insert(rows.tensor, rows.checksums);
        }
        Ok(self)
    }

    /// The checksum of each row group (rows [g·n, (g+1)·n), n = `ffn_group_neurons`) of dense tensor `tensor`.
    pub fn ffn_row_group_checksums(&self, tensor: &str) -> Result<&[u64]> {
        self.row_groups
            .get(tensor)
            .map(Vec::as_slice)
            .ok_or_else(|| {
                self.not_found(format!(
                    "no FFN row group checksums for tensor {tensor:?}; write the store again with \
                 `ntio convert --layout ffn-groups` to record them"
                ))
            })
    }

    /// Neurons per FFN group, where the store has group-major copies of its down matrices.
    pub fn ffn_group_neurons(&self) -> Option<u64> {
        self.ffn_groups.as_ref().map(|(neurons, _)| *neurons)
    }

    fn grouped_copy(&self, layer: usize) -> Result<&GroupedCopy> {
        self.ffn_groups
            .as_ref()
            .and_then(|(_, copies)| copies.get(&layer))
            .ok_or_else(|| self.not_found(format!("no FFN group layout for layer {layer}")))
    }

    /// The extents of groups `groups` (in that order) of `layer`'s down copy: one aligned extent each.
    pub fn ffn_group_extents(&self, layer: usize, groups: &[u64]) -> Result<Vec<FileExtent>> {
        let copy = self.grouped_copy(layer)?;
        groups
            .iter()
            .map(|&g| match g < copy.checksums.len() as u64 {
                true => Ok((copy.offset + g * copy.stride, copy.group_bytes)),
                false => Err(self.not_found(format!(
                    "no FFN group {g} in layer {layer} ({} groups)",
                    copy.checksums.len()
                ))),
            })
            .collect()
    }

    /// The checksum of each group of `layer`'s down copy.
    pub fn ffn_group_checksums(&self, layer: usize) -> Result<&[u64]> {
        Ok(&self.grouped_copy(layer)?.checksums)
    }

    /// Check `bytes`, group `group` of `layer`'s down copy, against its checksum.
    pub fn verify_ffn_group(&self, layer: usize, group: u64, bytes: &[u8]) -> Result<()> {
        let (offset, length) = self.ffn_group_extents(layer, &[group])?[0];
        let copy = self.grouped_copy(layer)?;
        if bytes.len() as u64 == length && checksum(bytes) == copy.checksums[group as usize] {
            return Ok(());
        }
        Err(StoreError::ChecksumMismatch {
            path: self.path.clone(),
            tensor: format!("{} group {group}", copy.tensor),
            offset,
            length,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn tensors(&self) -> &[TensorSpan] {
        &self.tensors
    }

    pub fn n_layers(&self) -> usize {
        self.layers.len()
    }

    fn not_found(&self, what: String) -> StoreError {
        StoreError::NotFound {
            path: self.path.clone(),
            what,
        }
    }

    pub fn tensor(&self, name: &str) -> Result<&TensorSpan> {
        self.by_name
            .get(name)
            .map(|&i| &self.tensors[i])
            .ok_or_else(|| self.not_found(format!("no tensor {name:?}")))
    }

    /// The tensors of `layer`, in file order.
    pub fn layer_tensors(&self, layer: usize) -> Result<Vec<&TensorSpan>> {
        let members = self.layers.get(layer).ok_or_else(|| {
            self.not_found(format!(
                "no layer {layer} (the file has {} layers)",
                self.layers.len()
            ))
        })?;
        Ok(members.iter().map(|&i| &self.tensors[i]).collect())
    }

    /// The extents covering every tensor of `layer`: tensors less than `MERGE_GAP` apart share
    /// one extent (padding included). A store's layer is one extent.
    pub fn layer_extents(&self, layer: usize) -> Result<Vec<FileExtent>> {
        let mut extents: Vec<FileExtent> = Vec::new();
        for t in self.layer_tensors(layer)? {
            let end = t.offset + t.nbytes;
            match extents.last_mut() {
                Some((start, len)) if t.offset <= *start + *len + MERGE_GAP => {
                    *len = (*len).max(end - *start);
                }
                _ => extents.push((t.offset, t.nbytes)),
            }
        }
        Ok(extents)
    }

    pub fn tensor_extent(&self, name: &str) -> Result<FileExtent> {
        let t = self.tensor(name)?;
        Ok((t.offset, t.nbytes))
    }

    /// The extent of rows `[start, stop)` of tensor `name`.
    pub fn row_extent(&self, name: &str, start: u64, stop: u64) -> Result<FileExtent> {
        let t = self.tensor(name)?;
        if start > stop || stop > t.rows {
            return Err(self.not_found(format!(
                "rows {start}..{stop} are outside tensor {name:?} ({} rows)",
                t.rows
            )));
        }
        let row_bytes = t.row_bytes();
        Ok((t.offset + start * row_bytes, (stop - start) * row_bytes))
    }

    /// Check `bytes`, the whole encoded tensor `name`, against its recorded checksum (a no-op
    /// for files that record none).
    pub fn verify(&self, name: &str, bytes: &[u8]) -> Result<()> {
        let t = self.tensor(name)?;
        let intact = bytes.len() as u64 == t.nbytes
            && t.checksum.map_or(true, |want| checksum(bytes) == want);
        if intact {
            Ok(())
        } else {
            Err(StoreError::ChecksumMismatch {
                path: self.path.clone(),
                tensor: t.name.clone(),
                offset: t.offset,
                length: t.nbytes,
            })
        }
    }
}

/// Data offsets for a new store: `groups` (globals, then layer 0, 1, ...) hold tensor sizes in
/// the order they are written. Every tensor starts on a `STORE_ALIGNMENT` boundary, the first at
/// `data_start`, and each group's tensors follow one another, so a layer is one extent.
pub fn plan_layout(data_start: u64, groups: &[Vec<u64>]) -> Vec<Vec<u64>> {
    let mut next = data_start.next_multiple_of(STORE_ALIGNMENT);
    groups
        .iter()
        .map(|sizes| {
            sizes
                .iter()
                .map(|&nbytes| {
                    let offset = next;
                    next = (offset + nbytes).next_multiple_of(STORE_ALIGNMENT);
                    offset
                })
                .collect()
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn span(name: &str, offset: u64, nbytes: u64, rows: u64, layer: Option<usize>) -> TensorSpan {
        TensorSpan {
            name: name.into(),
            offset,
            nbytes,
            rows,
            layer,
            checksum: None,
        }
    }

    #[test]
    fn row_ranges_map_to_byte_extents() {
        // A Q4_K [1536, 576] matrix: 576 / 256 blocks of 144 bytes... use K = 512: 2 blocks = 288 B/row.
        let index = ExtentIndex::new(
            Path::new("m"),
            vec![span("blk.0.ffn_up.weight", 8192, 1536 * 288, 1536, Some(0))],
        )
        .unwrap();
        assert_eq!(
            index.row_extent("blk.0.ffn_up.weight", 256, 512).unwrap(),
            (8192 + 256 * 288, 256 * 288)
        );
        assert_eq!(
            index.row_extent("blk.0.ffn_up.weight", 0, 1536).unwrap(),
            index.tensor_extent("blk.0.ffn_up.weight").unwrap()
        );
        assert_eq!(
            index.row_extent("blk.0.ffn_up.weight", 7, 7).unwrap(),
            (8192 + 7 * 288, 0)
        );
        for (start, stop) in [(0, 1537), (5, 4)] {
            let err = index
                .row_extent("blk.0.ffn_up.weight", start, stop)
                .unwrap_err();
            assert!(matches!(err, StoreError::NotFound { .. }), "{err}");
        }
        assert!(index.row_extent("missing", 0, 1).is_err());
    }

    #[test]
    fn planned_layers_are_aligned_contiguous_single_extents() {
        let groups = vec![vec![10_000, 2304], vec![2304, 5000, 4096], vec![1]];
        let offsets = plan_layout(4096, &groups);
        assert_eq!(
            offsets,
            vec![vec![4096, 16384], vec![20480, 24576, 32768], vec![36864]]
        );
        let mut spans = Vec::new();
        for (g, (sizes, offs)) in groups.iter().zip(&offsets).enumerate() {
            for (i, (&n, &o)) in sizes.iter().zip(offs).enumerate() {
                assert_eq!(o % STORE_ALIGNMENT, 0);
                let layer = if g == 0 { None } else { Some(g - 1) };
                spans.push(span(&format!("t{g}.{i}"), o, n, 1, layer));
            }
        }
        let index = ExtentIndex::new(Path::new("m"), spans).unwrap();
        assert_eq!(index.n_layers(), 2);
        assert_eq!(
            index.layer_extents(0).unwrap(),
            vec![(20480, 32768 + 4096 - 20480)]
        );
        assert_eq!(index.layer_extents(1).unwrap(), vec![(36864, 1)]);
        assert!(index.layer_extents(2).is_err());
    }

    #[test]
    fn gguf_layers_merge_across_small_padding_only() {
        let index = ExtentIndex::new(
            Path::new("m.gguf"),
            vec![
                span("b", 1000 + 100 + 28, 50, 1, Some(0)),
                span("a", 1000, 100, 1, Some(0)),
                span("far", 100_000, 10, 1, Some(0)),
            ],
        )
        .unwrap();
        assert_eq!(
            index.layer_extents(0).unwrap(),
            vec![(1000, 178), (100_000, 10)]
        );
        let names: Vec<_> = index
            .layer_tensors(0)
            .unwrap()
            .iter()
            .map(|t| t.name.as_str())
            .collect();
        assert_eq!(names, ["a", "b", "far"]);
    }

    #[test]
    fn verify_names_tensor_and_offset() {
        let data = vec![7u8; 100];
        let mut t = span("blk.3.ffn_up.weight", 123456, 100, 1, Some(0));
        t.checksum = Some(checksum(&data));
        let index = ExtentIndex::new(Path::new("m.ntio"), vec![t]).unwrap();
        index.verify("blk.3.ffn_up.weight", &data).unwrap();
        let mut flipped = data.clone();
        flipped[42] ^= 0x10;
        assert_eq!(
            index.verify("blk.3.ffn_up.weight", &flipped).unwrap_err().to_string(),
            "m.ntio: checksum mismatch in tensor 'blk.3.ffn_up.weight' (extent at offset 123456, 100 bytes)"
        );
    }

    #[test]
    fn bad_tables_are_rejected() {
        let p = Path::new("m");
        assert!(ExtentIndex::new(p, vec![span("x", 0, 10, 3, None)]).is_err());
        // A layer number beyond the tensor count would size the layer table from the file's say-so.
        assert!(ExtentIndex::new(p, vec![span("x", 0, 10, 1, Some(1 << 40))]).is_err());
        assert!(ExtentIndex::new(
            p,
            vec![span("x", 0, 10, 1, None), span("x", 10, 1, 1, None)]
        )
        .is_err());
    }
}
