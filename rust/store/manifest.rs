//! The store's manifest: JSON after the data, located by the header.
//!
//! ```json
//! {"format_version": 1,
//!  "metadata": {...every GGUF metadata key -> value, tokenizer arrays and chat template included...},
//!  "tensors": [{"name", "ggml_type", "shape" (PyTorch order), "offset" (absolute), "nbytes",
//!               "rows", "layer" (null for globals), "checksum" (xxh3-64)}, ...],
//!  "layers": [{"offset", "length"}, ...],   // extent of each layer's tensors
//!  "layouts": {"ffn_down_groups": {...}}}   // optional re-laid-out copies (`FfnDownGroups`)
//! ```
//! `metadata` is kept as raw JSON: Python interprets it; Rust only checks that it is an object.

use std::path::Path;

use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;

use super::error::{Result, StoreError};
use super::header::{Header, FORMAT_VERSION, HEADER_SIZE};
use super::index::{ExtentIndex, TensorSpan, STORE_ALIGNMENT};

#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    pub format_version: u32,
    pub metadata: Box<RawValue>,
    pub tensors: Vec<TensorRecord>,
    pub layers: Vec<LayerRecord>,
    pub layouts: Layouts,
}

/// Copies of tensors laid out for sparse reads (`convert --layout`), beside the dense tensors.
#[derive(Debug, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Layouts {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ffn_down_groups: Option<FfnDownGroups>,
}

/// Each layer's FFN down matrix [D, F] copied group-major, after every layer's dense tensors: group g holds
/// columns (neurons) [g·neurons, (g+1)·neurons) of all D rows, each row's `neurons / block` whole quantization
/// blocks (the blocks run along the neuron axis), row after row. A group is thus a row-major [D, neurons] matrix
/// in the tensor's own type, byte for byte its blocks: a permutation of whole blocks, never requantized.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FfnDownGroups {
    /// Neurons per group: a multiple of the down type's block.
    pub neurons: u64,
    pub copies: Vec<GroupedCopy>,
    /// Checksums of the same groups in each layer's dense gate and up matrices, read in place (absent from stores
    /// written before they were recorded).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub row_groups: Vec<RowGroups>,
}

/// A dense matrix whose rows are neurons (a layer's `ffn_gate.weight` or `ffn_up.weight` [F, D]): group g is its rows
/// [g·neurons, (g+1)·neurons), one contiguous run of its bytes (`ExtentIndex::row_extent`), not copied.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RowGroups {
    /// The dense tensor whose rows are grouped.
    pub tensor: String,
    /// xxh3-64 of each group's rows (their encoded bytes in the tensor), so that a read of some groups is checked.
    pub checksums: Vec<u64>,
}

/// One down matrix's group-major copy: group g is `group_bytes` at `offset + g * stride`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GroupedCopy {
    /// The dense tensor it copies (a layer's `ffn_down.weight`).
    pub tensor: String,
    pub offset: u64,
    pub group_bytes: u64,
    /// `group_bytes` rounded up to the store's alignment: every group is an aligned extent.
    pub stride: u64,
    /// xxh3-64 of each group's bytes, so that a read of some groups is checked.
    pub checksums: Vec<u64>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TensorRecord {
    pub name: String,
    /// ggml type code (GGMLQuantizationType).
    pub ggml_type: u32,
    pub shape: Vec<u64>,
    pub offset: u64,
    pub nbytes: u64,
    pub rows: u64,
    pub layer: Option<usize>,
    pub checksum: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LayerRecord {
    pub offset: u64,
    pub length: u64,
}

impl Manifest {
    /// Parse and check a manifest against its header: version, every tensor aligned and inside
    /// the data region, rows consistent with the shape, layer records equal to the index's.
    pub fn parse(bytes: &[u8], header: &Header, path: &Path) -> Result<(Self, ExtentIndex)> {
        // Reasons quote the file's own strings (field and tensor names): control characters
        // are escaped so the error stays one line.
        let bad = |reason: String| StoreError::BadManifest {
            path: path.to_path_buf(),
            reason: reason
                .chars()
                .map(|c| match c.is_control() {
                    true => c.escape_debug().to_string(),
                    false => c.to_string(),
                })
                .collect(),
        };
        let manifest: Manifest =
            serde_json::from_slice(bytes).map_err(|e| bad(format!("invalid JSON: {e}")))?;
        if manifest.format_version != header.format_version {
            return Err(bad(format!(
                "format_version {} disagrees with the header's {}",
                manifest.format_version, header.format_version
            )));
        }
        if manifest.format_version > FORMAT_VERSION {
            return Err(StoreError::UnsupportedVersion {
                path: path.to_path_buf(),
                version: manifest.format_version,
                supported: FORMAT_VERSION,
            });
        }
        if !manifest.metadata.get().trim_start().starts_with('{') {
            return Err(bad("metadata is not an object".into()));
        }
        for t in &manifest.tensors {
            let rows = t
                .shape
                .iter()
                .rev()
                .skip(1)
                .try_fold(1u64, |n, &d| n.checked_mul(d));
            let Some(rows) = rows else {
                return Err(bad(format!(
                    "tensor {:?}: shape {:?} overflows",
                    t.name, t.shape
                )));
            };
            let end = t.offset.checked_add(t.nbytes);
            if t.offset < HEADER_SIZE as u64
                || t.offset % STORE_ALIGNMENT != 0
                || end.map_or(true, |end| end > header.manifest_offset)
            {
                return Err(bad(format!(
                    "tensor {:?} at offset {} ({} bytes) is not an aligned extent of the data region",
                    t.name, t.offset, t.nbytes
                )));
            }
            if t.shape.is_empty() || t.rows != rows {
                return Err(bad(format!(
                    "tensor {:?} has {} rows, but its shape {:?} has {rows}",
                    t.name, t.rows, t.shape
                )));
            }
            // The bytes must be what the type makes of the shape: rows of whole blocks.
            let Some(ggml) = crate::gguf::ggml_type(t.ggml_type) else {
                return Err(bad(format!(
                    "tensor {:?} has unknown ggml type {}",
                    t.name, t.ggml_type
                )));
            };
            let width = t.shape[t.shape.len() - 1];
            let expected = rows.checked_mul(width / ggml.block * ggml.type_size);
            if width == 0 || width % ggml.block != 0 || expected != Some(t.nbytes) {
                return Err(bad(format!(
                    "tensor {:?}: {} bytes of {} do not encode shape {:?}",
                    t.name, t.nbytes, ggml.name, t.shape
                )));
            }
        }
        let index = ExtentIndex::new(
            path,
            manifest.tensors.iter().map(TensorRecord::span).collect(),
        )?;
        let indexed: Vec<LayerRecord> = (0..index.n_layers())
            .map(|layer| match index.layer_extents(layer)?.as_slice() {
                [(offset, length)] => Ok(LayerRecord {
                    offset: *offset,
                    length: *length,
                }),
                _ => Err(bad(format!("layer {layer}'s tensors are not contiguous"))),
            })
            .collect::<Result<_>>()?;
        if indexed != manifest.layers {
            return Err(bad("the layer table disagrees with the tensor table".into()));
        }
        let index = match &manifest.layouts.ffn_down_groups {
            None => index,
            Some(groups) => {
                let neurons = groups.neurons;
                for copy in &groups.copies {
                    check_copy(&manifest, copy, neurons, header).map_err(|reason| {
                        bad(format!("FFN group copy of {:?}: {reason}", copy.tensor))
                    })?;
                }
                for rows in &groups.row_groups {
                    check_row_groups(&manifest, rows, neurons).map_err(|reason| {
                        bad(format!("FFN row groups of {:?}: {reason}", rows.tensor))
                    })?;
                }
                index
                    .with_ffn_groups(neurons, groups.copies.clone())?
                    .with_row_groups(groups.row_groups.clone())?
            }
        };
        Ok((manifest, index))
    }
}

/// A group-major copy must be what its tensor makes of `neurons`: whole blocks per row, the tensor's columns in
/// whole groups, a checksum per group, aligned groups inside the data region.
fn check_copy(
    manifest: &Manifest,
    copy: &GroupedCopy,
    neurons: u64,
    header: &Header,
) -> std::result::Result<(), String> {
    let t = layer_matrix(manifest, &copy.tensor)?;
    // The tensor passed its own checks: a known type, rows of whole blocks.
    let ggml = crate::gguf::ggml_type(t.ggml_type).ok_or("unknown type")?;
    let width = t.shape[1];
    if neurons == 0 || neurons % ggml.block != 0 || width % neurons != 0 {
        return Err(format!(
            "{neurons} neurons a group are not whole {} blocks of {} dividing its {width} columns",
            ggml.name, ggml.block
        ));
    }
    let groups = width / neurons;
    let group_bytes = t.rows * (neurons / ggml.block) * ggml.type_size;
    let stride = group_bytes.next_multiple_of(STORE_ALIGNMENT);
    let end = stride
        .checked_mul(groups - 1)
        .and_then(|n| n.checked_add(copy.offset))
        .and_then(|n| n.checked_add(group_bytes));
    if copy.group_bytes != group_bytes
        || copy.stride != stride
        || copy.checksums.len() as u64 != groups
    {
        return Err(format!(
            "{} groups of {} bytes a {} apart, not {groups} of {group_bytes} a {stride} apart",
            copy.checksums.len(),
            copy.group_bytes,
            copy.stride
        ));
    }
    if copy.offset < HEADER_SIZE as u64
        || copy.offset % STORE_ALIGNMENT != 0
        || end.map_or(true, |end| end > header.manifest_offset)
    {
        return Err(format!(
            "offset {} is not an aligned extent of the data region",
            copy.offset
        ));
    }
    Ok(())
}

/// The record of tensor `name`, a layer's matrix.
fn layer_matrix<'m>(
    manifest: &'m Manifest,
    name: &str,
) -> std::result::Result<&'m TensorRecord, String> {
    let t = manifest
        .tensors
        .iter()
        .find(|t| t.name == name)
        .ok_or("no such tensor")?;
    if t.layer.is_none() || t.shape.len() != 2 {
        return Err("not a layer's matrix".into());
    }
    Ok(t)
}

/// Row groups must be what their tensor makes of `neurons`: a layer's matrix, its rows in whole groups, a checksum
/// per group.
fn check_row_groups(
    manifest: &Manifest,
    rows: &RowGroups,
    neurons: u64,
) -> std::result::Result<(), String> {
    let t = layer_matrix(manifest, &rows.tensor)?;
    if neurons == 0 || t.rows % neurons != 0 {
        return Err(format!(
            "{neurons} neurons a group do not divide its {} rows",
            t.rows
        ));
    }
    let groups = t.rows / neurons;
    if rows.checksums.len() as u64 != groups {
        return Err(format!(
            "{} checksums for its {groups} groups",
            rows.checksums.len()
        ));
    }
    Ok(())
}

impl TensorRecord {
    fn span(&self) -> TensorSpan {
        TensorSpan {
            name: self.name.clone(),
            offset: self.offset,
            nbytes: self.nbytes,
            rows: self.rows,
            layer: self.layer,
            checksum: Some(self.checksum),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const HEADER: Header = Header {
        format_version: 1,
        manifest_offset: 16384,
        manifest_length: 1000,
        manifest_checksum: 0,
    };

    fn manifest(tensors: &str, layers: &str) -> String {
        format!(
            r#"{{"format_version": 1, "metadata": {{"general.architecture": "llama"}},
                "tensors": [{tensors}], "layers": [{layers}], "layouts": {{}}}}"#
        )
    }

    const EMBD: &str = r#"{"name": "token_embd.weight", "ggml_type": 8, "shape": [4, 32], "offset": 4096,
                           "nbytes": 136, "rows": 4, "layer": null, "checksum": 1}"#;
    const NORM: &str = r#"{"name": "blk.0.attn_norm.weight", "ggml_type": 0, "shape": [32], "offset": 8192,
                           "nbytes": 128, "rows": 1, "layer": 0, "checksum": 2}"#;

    #[test]
    fn parses_a_valid_manifest_into_an_index() {
        let text = manifest(
            &format!("{EMBD}, {NORM}"),
            r#"{"offset": 8192, "length": 128}"#,
        );
        let (m, index) = Manifest::parse(text.as_bytes(), &HEADER, Path::new("m.ntio")).unwrap();
        assert_eq!(m.tensors.len(), 2);
        assert_eq!(index.layer_extents(0).unwrap(), vec![(8192, 128)]);
        assert_eq!(
            index.row_extent("token_embd.weight", 1, 3).unwrap(),
            (4096 + 34, 68)
        );
    }

    #[test]
    fn rejects_bad_manifests_with_a_reason() {
        let p = Path::new("m.ntio");
        let layer = r#"{"offset": 8192, "length": 128}"#;
        let cases = [
            ("not json".to_string(), "invalid JSON"),
            (manifest(EMBD, ""), ""),
            (
                manifest(&format!("{EMBD}, {NORM}"), ""),
                "layer table disagrees",
            ),
            (
                manifest(&EMBD.replace("4096", "4100"), ""),
                "not an aligned extent",
            ),
            (
                manifest(&NORM.replace("8192", "16384"), layer),
                "not an aligned extent",
            ),
            (
                manifest(&EMBD.replace("\"rows\": 4", "\"rows\": 3"), ""),
                "has 3 rows",
            ),
            (
                manifest(EMBD, "").replace("\"layouts\"", "\"extra\": 1, \"layouts\""),
                "unknown field",
            ),
            (
                // A JSON escape puts a newline into the field name the error quotes.
                manifest(EMBD, "").replacen("\"tensors\"", r#""t\nsors""#, 1),
                "unknown field `t\\nsors`",
            ),
            (
                manifest(EMBD, "").replace("\"format_version\": 1", "\"format_version\": 2"),
                "disagrees with the header",
            ),
            (
                manifest(EMBD, "").replace("{\"general.architecture\": \"llama\"}", "[]"),
                "not an object",
            ),
        ];
        for (text, reason) in cases {
            match Manifest::parse(text.as_bytes(), &HEADER, p) {
                Ok(_) => assert!(reason.is_empty(), "accepted: {text}"),
                Err(err) => assert!(
                    !reason.is_empty()
                        && err.to_string().contains(reason)
                        && !err.to_string().contains('\n'),
                    "{err} (wanted {reason:?})"
                ),
            }
        }
    }

    /// A Q8_0 down matrix [2, 64] of layer 0 and its group-major copy (2 groups of 32 neurons) after it.
    const DOWN: &str = r#"{"name": "blk.0.ffn_down.weight", "ggml_type": 8, "shape": [2, 64], "offset": 8192,
                           "nbytes": 136, "rows": 2, "layer": 0, "checksum": 3}"#;
    const GROUPS: &str = r#"{"ffn_down_groups": {"neurons": 32, "copies": [{"tensor": "blk.0.ffn_down.weight",
                             "offset": 12288, "group_bytes": 68, "stride": 4096, "checksums": [5, 6]}]}}"#;

    #[test]
    fn ffn_group_copies_index_one_aligned_extent_a_group() {
        let header = Header {
            manifest_offset: 20480,
            ..HEADER
        };
        let text = manifest(DOWN, r#"{"offset": 8192, "length": 136}"#)
            .replace("{}}", &format!("{GROUPS}}}"));
        let (m, index) = Manifest::parse(text.as_bytes(), &header, Path::new("m.ntio")).unwrap();
        assert_eq!(m.layouts.ffn_down_groups.unwrap().copies.len(), 1);
        assert_eq!(index.ffn_group_neurons(), Some(32));
        assert_eq!(
            index.ffn_group_extents(0, &[1, 0]).unwrap(),
            vec![(16384, 68), (12288, 68)]
        );
        assert!(index.ffn_group_extents(0, &[2]).is_err());
        assert!(index.ffn_group_extents(1, &[0]).is_err());
        let bad = [
            (
                GROUPS.replace("\"neurons\": 32", "\"neurons\": 16"),
                "not whole Q8_0 blocks",
            ),
            (
                GROUPS.replace("\"neurons\": 32", "\"neurons\": 96"),
                "dividing its 64 columns",
            ),
            (GROUPS.replace("[5, 6]", "[5]"), "1 groups of 68 bytes"),
            (
                GROUPS.replace("\"stride\": 4096", "\"stride\": 68"),
                "a 68 apart",
            ),
            (GROUPS.replace("12288", "12290"), "not an aligned extent"),
            (GROUPS.replace("12288", "16384"), "not an aligned extent"),
            (
                GROUPS.replace("blk.0.ffn_down", "blk.1.ffn_down"),
                "no such tensor",
            ),
            (
                GROUPS.replace("\"neurons\"", "\"rows\": 1, \"neurons\""),
                "unknown field",
            ),
        ];
        for (groups, reason) in bad {
            let text = manifest(DOWN, r#"{"offset": 8192, "length": 136}"#)
                .replace("{}}", &format!("{groups}}}"));
            match Manifest::parse(text.as_bytes(), &header, Path::new("m.ntio")) {
                Ok(_) => panic!("accepted {groups}"),
                Err(err) => assert!(
                    err.to_string().contains(reason),
                    "{err} (wanted {reason:?})"
                ),
            }
        }
    }

    /// Layer 0's Q8_0 gate [64, 32] beside the down matrix, and the checksums of its 2 groups of 32 rows.
    const GATE: &str = r#"{"name": "blk.0.ffn_gate.weight", "ggml_type": 8, "shape": [64, 32], "offset": 12288,
                           "nbytes": 2176, "rows": 64, "layer": 0, "checksum": 4}"#;
    const GATE_GROUPS: &str = r#"{"tensor": "blk.0.ffn_gate.weight", "checksums": [7, 8]}"#;

    /// The manifest of DOWN and GATE with an ffn-groups layout (the copy moved past GATE) whose `row_groups` list is
    /// `row_groups` (None: a manifest written before row groups were recorded, without the field).
    fn with_row_groups(row_groups: Option<&str>) -> String {
        let field = row_groups.map_or(String::new(), |list| format!(r#", "row_groups": [{list}]"#));
        let layouts = GROUPS
            .replace("12288", "16384")
            .replace("}]}}", &format!("}}]{field}}}}}"));
        manifest(
            &format!("{DOWN}, {GATE}"),
            r#"{"offset": 8192, "length": 6272}"#,
        )
        .replace("{}}", &format!("{layouts}}}"))
    }

    #[test]
    fn ffn_row_groups_index_a_checksum_a_group_of_rows() {
        let header = Header {
            manifest_offset: 24576,
            ..HEADER
        };
        let parse = |text: String| Manifest::parse(text.as_bytes(), &header, Path::new("m.ntio"));
        let (m, index) = parse(with_row_groups(Some(GATE_GROUPS))).unwrap();
        assert_eq!(m.layouts.ffn_down_groups.unwrap().row_groups.len(), 1);
        let gate = index.ffn_row_group_checksums("blk.0.ffn_gate.weight");
        assert_eq!(gate.unwrap(), &[7, 8]);
        let down = index.ffn_row_group_checksums("blk.0.ffn_down.weight");
        assert_eq!(
            down.unwrap_err().to_string(),
            "m.ntio: no FFN row group checksums for tensor \"blk.0.ffn_down.weight\"; write the store again with \
             `ntio convert --layout ffn-groups` to record them"
        );
        // A store written before row groups were recorded opens, without them.
        let (_, index) = parse(with_row_groups(None)).unwrap();
        assert_eq!(index.ffn_group_neurons(), Some(32));
        assert!(index
            .ffn_row_group_checksums("blk.0.ffn_gate.weight")
            .is_err());
        let bad = [
            (
                GATE_GROUPS.replace("[7, 8]", "[7]"),
                "1 checksums for its 2 groups",
            ),
            (
                GATE_GROUPS.replace("[7, 8]", "[7, 8, 9]"),
                "3 checksums for its 2 groups",
            ),
            (
                GATE_GROUPS.replace("ffn_gate", "ffn_up"),
                "\"blk.0.ffn_up.weight\": no such tensor",
            ),
            (
                GATE_GROUPS.replace("ffn_gate", "ffn_down"),
                "\"blk.0.ffn_down.weight\": 32 neurons a group do not divide its 2 rows",
            ),
            (
                format!("{GATE_GROUPS}, {GATE_GROUPS}"),
                "\"blk.0.ffn_gate.weight\" listed twice",
            ),
            (
                GATE_GROUPS.replace("\"checksums\"", "\"rows\": 1, \"checksums\""),
                "unknown field",
            ),
        ];
        for (row_groups, reason) in bad {
            match parse(with_row_groups(Some(&row_groups))) {
                Ok(_) => panic!("accepted {row_groups}"),
                Err(err) => assert!(
                    err.to_string().contains(reason) && !err.to_string().contains('\n'),
                    "{err} (wanted {reason:?})"
                ),
            }
        }
    }

    #[test]
    fn ffn_row_groups_need_a_layer_matrix_in_whole_groups() {
        let tensor = |name: &str, shape: &[u64], layer: Option<usize>| TensorRecord {
            name: name.into(),
            ggml_type: 0,
            shape: shape.to_vec(),
            offset: 4096,
            nbytes: 4 * shape.iter().product::<u64>(),
            rows: shape[..shape.len() - 1].iter().product(),
            layer,
            checksum: 0,
        };
        let manifest = Manifest {
            format_version: 1,
            metadata: RawValue::from_string("{}".into()).unwrap(),
            tensors: vec![
                tensor("output.weight", &[64, 8], None),
                tensor("blk.0.ffn_norm.weight", &[64], Some(0)),
                tensor("blk.0.ffn_up.weight", &[96, 8], Some(0)),
            ],
            layers: vec![],
            layouts: Layouts::default(),
        };
        let check = |tensor: &str, groups: usize, neurons: u64| {
            let rows = RowGroups {
                tensor: tensor.into(),
                checksums: vec![0; groups],
            };
            check_row_groups(&manifest, &rows, neurons)
        };
        check("blk.0.ffn_up.weight", 3, 32).unwrap();
        assert_eq!(
            check("output.weight", 2, 32).unwrap_err(),
            "not a layer's matrix"
        );
        assert_eq!(
            check("blk.0.ffn_norm.weight", 2, 32).unwrap_err(),
            "not a layer's matrix"
        );
        assert_eq!(
            check("blk.0.ffn_up.weight", 1, 64).unwrap_err(),
            "64 neurons a group do not divide its 96 rows"
        );
        assert!(
            check("blk.0.ffn_up.weight", 0, 0).is_err(),
            "no groups of no neurons"
        );
    }

    #[test]
    fn ffn_group_checks_name_the_group() {
        let copy = GroupedCopy {
            tensor: "blk.0.ffn_down.weight".into(),
            offset: 12288,
            group_bytes: 4,
            stride: 4096,
            checksums: vec![checksum_of(&[1, 2, 3, 4]), 0],
        };
        let index = || {
            let down = TensorSpan {
                name: copy.tensor.clone(),
                offset: 8192,
                nbytes: 8,
                rows: 1,
                layer: Some(0),
                checksum: None,
            };
            ExtentIndex::new(Path::new("m.ntio"), vec![down]).unwrap()
        };
        let twice = index().with_ffn_groups(32, vec![copy.clone(), copy.clone()]);
        assert!(twice.is_err(), "two copies of one layer");
        let index = index().with_ffn_groups(32, vec![copy]).unwrap();
        index.verify_ffn_group(0, 0, &[1, 2, 3, 4]).unwrap();
        assert_eq!(
            index.verify_ffn_group(0, 1, &[1, 2, 3, 4]).unwrap_err().to_string(),
            "m.ntio: checksum mismatch in tensor 'blk.0.ffn_down.weight group 1' (extent at offset 16384, 4 bytes)"
        );
    }

    fn checksum_of(bytes: &[u8]) -> u64 {
        super::super::checksum(bytes)
    }

    mod properties {
        use super::*;
        use proptest::prelude::*;

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(2000))]

            /// A valid manifest with one number or one byte replaced: a one-line error naming the
            /// file, or an index whose every tensor is an aligned, in-bounds extent of its shape.
            #[test]
            fn mutated_manifests_are_refused_in_one_line_or_consistent(
                number in any::<u64>(),
                nth in 0usize..40,
                byte in any::<(usize, u8)>(),
                use_byte in any::<bool>(),
            ) {
                let layer = r#"{"offset": 8192, "length": 128}"#;
                let text = manifest(&format!("{EMBD}, {NORM}"), layer);
                let mutated = if use_byte {
                    let mut bytes = text.clone().into_bytes();
                    let at = byte.0 % bytes.len();
                    bytes[at] = byte.1;
                    bytes
                } else {
                    // Replace the nth run of digits with `number`.
                    let runs: Vec<(usize, usize)> = text
                        .char_indices()
                        .filter(|&(i, c)| c.is_ascii_digit() && !text[..i].ends_with(|p: char| p.is_ascii_digit()))
                        .map(|(i, _)| (i, text[i..].find(|c: char| !c.is_ascii_digit()).map_or(text.len(), |n| i + n)))
                        .collect();
                    let (start, end) = runs[nth % runs.len()];
                    format!("{}{number}{}", &text[..start], &text[end..]).into_bytes()
                };
                match Manifest::parse(&mutated, &HEADER, Path::new("m.ntio")) {
                    Ok((m, index)) => {
                        for t in &m.tensors {
                            prop_assert!(t.offset % STORE_ALIGNMENT == 0 && t.offset + t.nbytes <= HEADER.manifest_offset);
                            prop_assert!(index.tensor_extent(&t.name).is_ok());
                        }
                    }
                    Err(e) => {
                        let message = e.to_string();
                        prop_assert!(message.starts_with("m.ntio: ") && !message.contains('\n'), "{}", message);
                    }
                }
            }
        }
    }
}
