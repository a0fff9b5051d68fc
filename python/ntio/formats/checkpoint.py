"""Hugging Face checkpoints: a directory of `config.json`, safetensors shards (`model.safetensors`, or several named
by `model.safetensors.index.json`), `tokenizer.json` and `tokenizer_config.json`, read as a model file.

`Checkpoint(directory)` offers the interface of `GGUFFile`: tensors under GGUF's names (`model.layers.3.mlp.up_proj.
weight` is `blk.3.ffn_up.weight`), hyper-parameters under GGUF's keys, and the tokenizer as `tokenizer.huggingface.
json` (the whole tokenizer.json, the key GGUF's spec gives it) with the special ids and chat template beside it. A
tensor's bytes are read in place from its shard: F32, F16 and BF16 are types ntio computes with, so nothing is
converted. Tensor offsets lie in one offset space over the shards (`files`: each shard at a 4 KiB-aligned base past
the one before it), which one `_core.Reader` reads; `path` is the first shard.

Llama's q/k rows: llama.cpp's converter permutes them so that RoPE rotates pairs (2i, 2i+1); a checkpoint keeps
Hugging Face's order, where RoPE rotates (i, i + d/2). A Llama checkpoint therefore runs with NeoX-style RoPE
(`ntio.rope_kind`), which on the unpermuted rows is the same computation.
"""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path
from typing import Any

import gguf

from ntio.errors import ModelFormatError, UnsupportedModelError
from ntio.formats.gguf_file import ModelFileBase, TensorInfo

T = gguf.GGMLQuantizationType

CONFIG = "config.json"
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
TOKENIZER = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
CHAT_TEMPLATE = "chat_template.jinja"  # where newer transformers write the template

# Metadata key: the RoPE pairing of a model file whose q/k rows are not in llama.cpp's order (see the docstring).
ROPE_KIND_KEY = "ntio.rope_kind"

_SHARD_ALIGNMENT = 4096  # shard bases in the offset space: O_DIRECT's block, so reads keep their alignment
_DTYPES = {"F32": (T.F32, 4), "F16": (T.F16, 2), "BF16": (T.BF16, 2)}
_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2"}  # config.json model_type -> GGUF architecture
# The largest safetensors header accepted (the format's own readers cap it at 100 MB).
_MAX_HEADER = 100_000_000

# Hugging Face name -> GGUF name; {i} is the layer.
_GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_BLOCK_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
# RoPE scaling kinds a checkpoint may name: config.json's parameters -> their `{arch}.rope.scaling.*` keys (GGUF's
# where it has one; llama.cpp keeps Llama 3's factors as a tensor, rope_freqs.weight, which ntio computes instead).
_SCALING_KEYS = {
    "linear": {"factor": "factor"},
    "llama3": {"factor": "factor", "low_freq_factor": "low_freq_factor", "high_freq_factor": "high_freq_factor",
               "original_max_position_embeddings": "original_context_length"},
}
# Tensors a checkpoint may carry that the model does not use (buffers older transformers saved).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def is_checkpoint(path: Path) -> bool:
    return path.is_dir() and (path / CONFIG).is_file()


def gguf_name(hf_name: str) -> str | None:
    """The GGUF name of a checkpoint tensor, None for one ntio does not use."""
    if hf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[hf_name]
    parts = hf_name.split(".", 3)
    if len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[2].isdigit() and parts[3] in _BLOCK_NAMES:
        return f"blk.{int(parts[2])}.{_BLOCK_NAMES[parts[3]]}"
    return None


def _read_json(path: Path, *, what: str) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ModelFormatError(f"{path}: missing ({what})") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelFormatError(f"{path}: not JSON ({e})") from None


def read_safetensors_header(path: Path) -> tuple[int, dict[str, tuple[T, tuple[int, ...], int, int]]]:
    """The data offset and, per tensor, (type, shape, absolute offset, nbytes) of one safetensors file; every range
    checked to be inside the file, of the size its dtype and shape make, and disjoint from the others."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise ModelFormatError(f"{path}: {size} bytes is too short for a safetensors file")
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > min(size - 8, _MAX_HEADER):
                raise ModelFormatError(f"{path}: the safetensors header of {header_len} bytes is longer than the file "
                                       f"({size} bytes)")
            raw = f.read(header_len)
    except FileNotFoundError:
        raise ModelFormatError(f"{path}: missing (a safetensors shard)") from None
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelFormatError(f"{path}: the safetensors header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise ModelFormatError(f"{path}: the safetensors header is not a JSON object")
    data_start = 8 + header_len
    data_len = size - data_start
    tensors: dict[str, tuple[T, tuple[int, ...], int, int]] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if not (isinstance(entry, dict) and isinstance(entry.get("shape"), list)
                and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in entry["shape"])
                and isinstance(entry.get("data_offsets"), list) and len(entry["data_offsets"]) == 2
                and all(isinstance(o, int) and not isinstance(o, bool) for o in entry["data_offsets"])):
            raise ModelFormatError(f"{path}: tensor {name!r} has no valid dtype, shape and data_offsets")
        dtype = entry.get("dtype")
        if dtype not in _DTYPES:
            raise UnsupportedModelError(f"{path}: tensor {name!r} has dtype {str(dtype)[:20]!r}; ntio reads "
                                        f"{', '.join(_DTYPES)} checkpoints")
        qtype, item = _DTYPES[dtype]
        shape = tuple(entry["shape"])
        begin, end = entry["data_offsets"]
        if not 0 <= begin <= end <= data_len:
            raise ModelFormatError(f"{path}: tensor {name!r} data_offsets [{begin}, {end}] fall outside the file's "
                                   f"{data_len} data bytes")
        if end - begin != math.prod(shape) * item:
            raise ModelFormatError(f"{path}: tensor {name!r} has {end - begin} bytes, but {dtype} {list(shape)} "
                                   f"takes {math.prod(shape) * item}")
        tensors[name] = (qtype, shape, data_start + begin, end - begin)
    ordered = sorted((offset, nbytes, name) for name, (_, _, offset, nbytes) in tensors.items() if nbytes)
    for (offset, nbytes, name), (next_offset, _, next_name) in zip(ordered, ordered[1:]):
        if offset + nbytes > next_offset:
            raise ModelFormatError(f"{path}: tensors {name!r} and {next_name!r} overlap (at byte {next_offset})")
    return data_start, tensors


def _shards(directory: Path) -> list[Path]:
    """The checkpoint's safetensors files: those the index names, else model.safetensors."""
    index_path = directory / INDEX
    if index_path.is_file():
        index = _read_json(index_path, what="the shard index")
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise ModelFormatError(f"{index_path}: no 'weight_map' of tensor names to shard files")
        names = list(dict.fromkeys(weight_map.values()))
        bad = next((name for name in names if Path(name).name != name or name in ("", ".", "..")), None)
        if bad is not None:
            raise ModelFormatError(f"{index_path}: shard {bad[:60]!r} is not a file name in the checkpoint directory")
        shards = [directory / name for name in names]
        for shard in shards:
            if not shard.is_file():
                raise ModelFormatError(f"{index_path}: shard {shard.name!r} is named in the index but missing")
        return shards
    if (directory / SINGLE).is_file():
        return [directory / SINGLE]
    raise ModelFormatError(f"{directory}: no {SINGLE} or {INDEX}")


def _shard_bases(shards: list[Path]) -> list[int]:
    """Each shard's base in the checkpoint's offset space: the first at 0, each next on a 4 KiB boundary (what
    `_core.Reader` takes) with at least one whole empty block after the end of the one before. So a block never
    spans two shards, and the extent index, which merges tensors less than a block apart into one extent, never
    merges tensors of two shards."""
    bases = [0]
    for shard in shards[:-1]:
        end = bases[-1] + shard.stat().st_size
        bases.append(-(-end // _SHARD_ALIGNMENT) * _SHARD_ALIGNMENT + _SHARD_ALIGNMENT)
    return bases


def _hyperparameters(config: dict[str, Any], path: Path) -> tuple[str, dict[str, Any]]:
    """The GGUF architecture and hyper-parameter keys for config.json's values."""
    model_type = config.get("model_type")
    arch = _ARCHITECTURES.get(model_type) if isinstance(model_type, str) else None
    if arch is None:
        raise UnsupportedModelError(f"{path}: model_type {str(model_type)[:40]!r} is not supported (supported: "
                                    f"{', '.join(_ARCHITECTURES)})")

    # transformers 5 writes RoPE's settings as one dict, `rope_parameters`; earlier versions as rope_theta and
    # rope_scaling.
    rope = config.get("rope_parameters")
    rope = rope if isinstance(rope, dict) else {}

    def get(key: str, kind: type, default: Any = None) -> Any:
        value = rope.get(key, config.get(key)) if key == "rope_theta" else config.get(key)
        value = default if value is None else value  # null is absent
        if value is None or isinstance(value, bool) or not isinstance(value, kind):
            raise ModelFormatError(f"{path}: key {key!r} must be {'an integer' if kind is int else 'a number'}, "
                                   f"got {str(value)[:40]!r}")
        return value

    n_heads = get("num_attention_heads", int)
    d_model = get("hidden_size", int)
    head_dim = config.get("head_dim")
    if head_dim is not None and n_heads and head_dim * n_heads != d_model:
        raise UnsupportedModelError(f"{path}: key 'head_dim' ({head_dim}) is not hidden_size / num_attention_heads "
                                    f"({d_model} / {n_heads}); ntio runs models whose heads split hidden_size")
    quantization = config.get("quantization_config")
    if quantization:
        method = quantization.get("quant_method") if isinstance(quantization, dict) else quantization
        raise UnsupportedModelError(f"{path}: key 'quantization_config' names a quantized checkpoint "
                                    f"({str(method)[:40]!r}); ntio reads F32, F16 and BF16 checkpoints")
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModelError(f"{path}: key 'hidden_act' is {str(act)[:40]!r}; ntio runs {arch} with silu")
    if arch == "llama" and (config.get("attention_bias") or config.get("mlp_bias")):
        raise UnsupportedModelError(f"{path}: key 'attention_bias'/'mlp_bias' is set; ntio's llama has no biases")
    metadata: dict[str, Any] = {
        "general.architecture": arch,
        f"{arch}.block_count": get("num_hidden_layers", int),
        f"{arch}.context_length": get("max_position_embeddings", int),
        f"{arch}.embedding_length": d_model,
        f"{arch}.feed_forward_length": get("intermediate_size", int),
        f"{arch}.attention.head_count": n_heads,
        f"{arch}.attention.head_count_kv": get("num_key_value_heads", int, n_heads),
        f"{arch}.rope.freq_base": float(get("rope_theta", (int, float), 10000.0)),
        f"{arch}.attention.layer_norm_rms_epsilon": float(get("rms_norm_eps", (int, float))),
        f"{arch}.vocab_size": get("vocab_size", int),
    }
    scaling = config.get("rope_scaling") or rope
    kind = scaling.get("rope_type", scaling.get("type", "default")) if isinstance(scaling, dict) else scaling
    if kind != "default":
        if kind not in _SCALING_KEYS:
            raise UnsupportedModelError(f"{path}: RoPE scaling of type {str(kind)[:40]!r} is not supported from a "
                                        f"checkpoint ({' and '.join(_SCALING_KEYS)} are)")
        metadata[f"{arch}.rope.scaling.type"] = kind
        for key, gguf_key in _SCALING_KEYS[kind].items():
            value = scaling.get(key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ModelFormatError(f"{path}: {kind} RoPE scaling needs a positive {key!r}, got "
                                       f"{str(value)[:40]!r}")
            metadata[f"{arch}.rope.scaling.{gguf_key}"] = value
    if arch == "llama":
        metadata[ROPE_KIND_KEY] = "neox"
    return arch, metadata


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken's dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _tokenizer_metadata(directory: Path, config: dict[str, Any]) -> dict[str, Any]:
    """tokenizer.json whole, and the special ids, BOS rule and chat template of tokenizer_config.json."""
    tokenizer_path = directory / TOKENIZER
    try:
        text = tokenizer_path.read_text(encoding="utf-8")
        tokenizer = json.loads(text)
    except FileNotFoundError:
        raise ModelFormatError(f"{tokenizer_path}: missing (ntio reads a checkpoint's fast tokenizer)") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelFormatError(f"{tokenizer_path}: not JSON ({e})") from None
    model = tokenizer.get("model") if isinstance(tokenizer, dict) else None
    if not isinstance(model, dict) or not isinstance(model.get("vocab"), dict):
        raise ModelFormatError(f"{tokenizer_path}: no 'model' with a 'vocab'")
    ids = dict(model["vocab"])
    ids.update({t["content"]: t["id"] for t in tokenizer.get("added_tokens") or []
                if isinstance(t, dict) and isinstance(t.get("content"), str) and isinstance(t.get("id"), int)})
    settings_path = directory / TOKENIZER_CONFIG
    settings = _read_json(settings_path, what="the tokenizer's settings") if settings_path.is_file() else {}
    metadata: dict[str, Any] = {"tokenizer.huggingface.json": text}
    for name, key in (("bos", "bos"), ("eos", "eos"), ("pad", "padding"), ("unk", "unknown")):
        token = _token_text(settings.get(f"{name}_token"))
        if token is not None:
            if token not in ids:
                raise ModelFormatError(f"{settings_path}: {name}_token {token[:40]!r} is not in {TOKENIZER}")
            metadata[f"tokenizer.ggml.{key}_token_id"] = ids[token]
            continue
        token_id = config.get(f"{name}_token_id")  # config.json's (a list: the first)
        token_id = token_id[0] if isinstance(token_id, list) and token_id else token_id
        if isinstance(token_id, int) and not isinstance(token_id, bool):
            metadata[f"tokenizer.ggml.{key}_token_id"] = token_id
    add_bos = settings.get("add_bos_token")
    if not isinstance(add_bos, bool):  # not said: what the tokenizer's post-processor does, as transformers would
        bos = _token_text(settings.get("bos_token"))
        processor = json.dumps(tokenizer.get("post_processor") or {})
        add_bos = bos is not None and '"TemplateProcessing"' in processor and json.dumps(bos) in processor
    metadata["tokenizer.ggml.add_bos_token"] = add_bos
    template = settings.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"),
                        None)
    if not isinstance(template, str) and (directory / CHAT_TEMPLATE).is_file():
        template = (directory / CHAT_TEMPLATE).read_text(encoding="utf-8")
    if isinstance(template, str):
        metadata["tokenizer.chat_template"] = template
    return metadata


class Checkpoint(ModelFileBase):
    """A Hugging Face checkpoint directory read as a model file (see the module docstring)."""

    version = None  # not a GGUF

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)
        config_path = self.directory / CONFIG
        config = _read_json(config_path, what="a checkpoint's config")
        if not isinstance(config, dict):
            raise ModelFormatError(f"{config_path}: not a JSON object")
        arch, metadata = _hyperparameters(config, config_path)
        self.shards = _shards(self.directory)
        self.path = self.shards[0]
        self._bases = dict(zip(self.shards, _shard_bases(self.shards)))  # shard -> its base in the offset space
        self.tensors: dict[str, TensorInfo] = {}
        self.tensor_files: dict[str, Path] = {}
        for shard, base in self._bases.items():
            for hf_name, (qtype, shape, offset, nbytes) in read_safetensors_header(shard)[1].items():
                name = gguf_name(hf_name)
                if name is None:
                    if hf_name.endswith(_IGNORED_SUFFIXES):
                        continue
                    raise UnsupportedModelError(f"{shard}: tensor {hf_name!r} is not part of a {arch} model ntio "
                                                "knows")
                if name in self.tensors:
                    raise ModelFormatError(f"{shard}: tensor {hf_name!r} is also in {self.tensor_files[name].name}")
                self.tensors[name] = TensorInfo(name, qtype, shape, base + offset, nbytes)
                self.tensor_files[name] = shard
        if config.get("tie_word_embeddings", False):
            self.tensors.pop("output.weight", None)  # tied: the embedding is the head, as in GGUF
        elif "token_embd.weight" in self.tensors and "output.weight" not in self.tensors:
            raise ModelFormatError(f"{self.directory}: tensor 'lm_head.weight' is missing and config.json does not "
                                   "tie the embeddings")
        name = config.get("_name_or_path", config.get("_model_name_or_path"))
        metadata["general.name"] = name if isinstance(name, str) and name else self.directory.name
        metadata.update(_tokenizer_metadata(self.directory, config))
        self.metadata: dict[str, Any] = metadata
        self._maps: dict[Path, Any] = {}

    @property
    def files(self) -> list[tuple[Path, int]]:
        return list(self._bases.items())

    def tensor_bytes(self, name: str):
        """The bytes of one tensor as a read-only uint8 view of its mapped shard."""
        import numpy as np

        info = self.tensor(name)
        shard = self.tensor_files[name]
        data = self._maps.get(shard)
        if data is None:
            data = self._maps[shard] = np.memmap(shard, dtype=np.uint8, mode="r")
        offset = info.offset - self._bases[shard]
        return data[offset : offset + info.nbytes]
