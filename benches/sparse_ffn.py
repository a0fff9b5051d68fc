"""What a sparse FFN costs in perplexity, by rule, keep share and unit (issue 20's price list, quality half).

For each model: perplexity of an evaluation text with each token's FFN keeping the `keep` share of its units (the
others count as 0; ntio.policies.sparse_ffn), as a ratio to dense. Units are single neurons, groups of consecutive
neurons (a quantization block of the down matrix holds 32 or 256 of them: the smallest unit its bytes can be read
in without requantizing), or groups of neurons clustered by co-activation on a calibration text (balanced recursive
bisection along the first principal direction of the neurons' activation patterns), which a re-laid-out store
could read as one extent. Then how the union of the units kept grows with the tokens in one pass (prefill,
speculative verification), which is what such a pass would read.

The "predicted" rule (`--rules predicted`, consecutive units) scores units from the FFN's input alone, before any
FFN byte is read: one `UnitPredictor` per layer and unit size (rank `--predictor-rank`), fitted to the order of the
"down" rule's unit scores on the calibration text (as `ntio calibrate --ffn-predictors` fits them), for every keep
share; each row reports the share of the "down" rule's units it kept on the evaluation text (`oracle_recall`).

Reading one neuron's down weights alone needs the down matrix stored by neuron ([F, D]). `--down-rows TYPE...`
prices doing that by quantizing it again as rows, with a copy of the model whose down matrices are the transposed
matrix quantized to TYPE (from the GGUF's values, by gguf-py) and turned back (float32), dense and with the down
rule per neuron at the middle --keep.

`--neuron-major` prices the down rule per neuron without quantizing again: down [D, F] laid out losslessly as
each neuron's codes ([F, D], 4 or 6 bits a weight) beside a header of each row's block scales and minimums (0.5-1
bit a weight), read whole. It checks that the codes and the header alone rebuild gguf-py's dequantized matrix bit
for bit, then measures which share of down's bytes each evaluation token's kept neurons need (header included), read
by the byte (RAM), by 512 B sector or by 4 KiB page (O_DIRECT from disk), in the file's neuron order and with the
neurons sorted by how often the calibration text kept them; and the layers' bytes then read, against dense.

`--group-scores sum norm exact` prices ways of ranking the store's groups (one quantization block of down's
neurons) under the down rule: Σ |a| over a group, each neuron weighing 1; Σ |a_i| · ||down[:, i]||, the down
matrix's column norms weighing each neuron (the policy's own, as this script runs it); and ||down[:, g] · a_g||, each
group's own contribution to the output (it needs every down byte, so it bounds what any ranking of one group at a
time can do).

Texts are this project's own, so no model saw them in training: calibration, the package's docstrings; evaluation,
README.md. Prints one JSON object per measurement, then a summary object.

`--streamed` adds the other half of the price list: each model converted to a store with the ffn-groups layout
(`ntio convert --layout ffn-groups`, in a temporary directory), then greedy decoding with every layer read from disk
at every token (all-C), dense and with each rule and keep share (units: the store's groups), in alternating rounds:
bytes read per decode token and decode tok/s, each as a ratio to the same round's dense run (medians over rounds),
beside the perplexity ratio of those units. `--json` writes everything, `--plot` draws perplexity ratio against
bytes per token, one line per rule (matplotlib: `pip install ntio[plot]`).

    python benches/sparse_ffn.py --model smollm2-135m qwen2.5-coder-1.5b --groups 1 32 256 --clustered 8 32
    python benches/sparse_ffn.py --model qwen2.5-coder-1.5b --rules down --keep 0.5 --groups 1 --down-rows Q8_0 Q5_0
    python benches/sparse_ffn.py --model smollm2-135m --rules down gate predicted --keep 0.5 0.3 --groups 1 \
        --calib-tokens 8192
    python benches/sparse_ffn.py --rules down --groups --group-scores sum norm exact --union-tokens 4
    python benches/sparse_ffn.py --model qwen2.5-coder-1.5b --rules down --groups 1 --neuron-major --union-tokens 4
    python benches/sparse_ffn.py --rules predicted --groups --streamed --rounds 2 --json sparse_ffn_predicted.json
    python benches/sparse_ffn.py --groups --union-tokens 4 --streamed --rounds 3 --json sparse_ffn.json \
        --plot sparse_ffn.png
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import statistics
import sys
import tempfile
from pathlib import Path

import gguf
import numpy as np
import torch
import torch.nn.functional as F

import ntio
from bigger_than_ram import machine
from ntio.fetch import resolve_model
from ntio.formats.gguf_metadata import copy_metadata
from ntio.formats.store import DownNorms, StoreFile, convert, widest_group_neurons
from ntio.plots import check_figure_path, pyplot, save_png
from ntio.policies.base import FFNMask, LoadPolicy
from ntio.policies.sparse_ffn import (RULES, NeuronSelection, SparseFFNPolicy, UnitPredictor, consecutive_groups,
                                     unit_scores)
from ntio.policies.sparse_ffn import fit_predictors as fit_unit_predictors

ROOT = Path(__file__).resolve().parent.parent
CTX = 512


def calibration_text() -> str:
    """The package's longer docstrings (module, class and function), in file order."""
    docs = []
    for path in sorted((ROOT / "python" / "ntio").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) > 200:
                    docs.append(doc)
    return "\n\n".join(docs)


def first_tokens(m: ntio.LLM, text: str, n: int) -> str:
    """The text's prefix of about n tokens (cut at a character bound, found by tokenizing)."""
    ids = m.tokenizer.encode(text)
    return text if len(ids) <= n else m.tokenizer.decode(ids[:n])


class Recorder(LoadPolicy):
    """Reads everything, keeps everything, and records every layer's FFN input x [T, D] and the down rule's neuron
    scores |silu(gate) * up| * ||down[:, i]|| [T, F] (`down_norms`: layer -> [F]), in float16 (a Qwen 1.5B layer's
    8k calibration tokens take 170 MB so)."""

    def __init__(self, down_norms: DownNorms) -> None:
        super().__init__()
        self.down_norms = down_norms
        self.inputs: dict[int, list[torch.Tensor]] = {}
        self.activations: dict[int, list[torch.Tensor]] = {}

    def ffn_mask(self, layer: int) -> FFNMask:
        def record(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
            self.inputs.setdefault(layer, []).append(x.half())
            scores = (F.silu(gate) * up * self.down_norms(layer)).abs()
            self.activations.setdefault(layer, []).append(scores.half())
            return torch.ones_like(gate, dtype=torch.bool)

        return record


def bisect(patterns: torch.Tensor, ids: torch.Tensor, size: int) -> list[torch.Tensor]:
    """Neuron ids split into groups of `size` neurons with similar activation patterns ([F, N], one row each):
    halves (in whole groups) along the first principal direction of their patterns, recursively."""
    if ids.numel() <= size:
        return [ids]
    x = patterns[ids] - patterns[ids].mean(dim=0)
    direction = torch.linalg.svd(x, full_matrices=False).Vh[0]
    order = ids[(x @ direction).argsort()]
    half = ids.numel() // size // 2 * size
    return bisect(patterns, order[:half], size) + bisect(patterns, order[half:], size)


def clustered_groups(activations: dict[int, list[torch.Tensor]], size: int) -> dict[int, torch.Tensor]:
    """Per layer, [F / size, size] neuron groups clustered by co-activation on the recorded tokens."""
    groups = {}
    for layer, parts in activations.items():
        a = torch.cat(parts).float()  # [N, F]
        shares = a / a.sum(dim=1, keepdim=True).clamp_min(1e-12)  # each token's activation mass over neurons
        patterns = (shares / shares.norm(dim=0, keepdim=True).clamp_min(1e-12)).T.contiguous()  # [F, N]
        groups[layer] = torch.stack(bisect(patterns, torch.arange(a.shape[1]), size))
    return groups


def union_growth(m: ntio.LLM, policy: SparseFFNPolicy, ids: list[int], sizes: list[int]) -> dict[int, float]:
    """Mean share of units kept by some token of a pass, for passes of each size over consecutive tokens."""
    growth = {}
    for size in sizes:
        policy.union.clear()
        for start in range(0, min(len(ids), CTX) - size + 1, size):
            m.engine.forward(torch.tensor(ids[start : start + size]), start)
        growth[size] = round(policy.union_fraction(), 4)
    return growth


def with_requantized_down(src: Path, dst: Path, qtype: gguf.GGMLQuantizationType) -> Path:
    """A copy of GGUF `src` whose ffn_down matrices [D, F] are what a transposed store would compute with: the
    transpose [F, D] quantized to `qtype` from the dequantized values, dequantized again and transposed back,
    stored as float32."""
    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(dst, reader.fields["general.architecture"].contents())
    copy_metadata(reader, writer)
    for t in reader.tensors:
        if t.name.endswith("ffn_down.weight"):
            rows = gguf.quants.dequantize(t.data, t.tensor_type).T  # [F, D]
            again = gguf.quants.dequantize(gguf.quants.quantize(np.ascontiguousarray(rows), qtype), qtype)
            writer.add_tensor(t.name, np.ascontiguousarray(again.T, dtype=np.float32))
        else:
            writer.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def fit_predictors(recorder: Recorder, neurons: int, args: argparse.Namespace) -> dict[int, UnitPredictor]:
    """One predictor per layer of units of `neurons` consecutive neurons, fitted on the recorded calibration tokens
    to the "down" rule's unit scores from the layer before's FFN input (the first layer's: its own), as `ntio
    calibrate --ffn-predictors` fits them."""
    return fit_unit_predictors({layer: torch.cat(x).float() for layer, x in recorder.inputs.items()},
                               {layer: torch.cat(a).float().unflatten(1, (-1, neurons)).sum(2)
                                for layer, a in recorder.activations.items()},
                               neurons, args.predictor_rank, args.predictor_epochs)


def price_down_rows(name: str, args: argparse.Namespace, evaluation: str, dense: float) -> list[dict]:
    """Perplexity ratios to the original dense model with the down matrices requantized as rows (`--down-rows`)."""
    rows, keep = [], args.keep[len(args.keep) // 2]
    for type_name in args.down_rows:
        with tempfile.TemporaryDirectory() as tmp:
            path = with_requantized_down(resolve_model(name), Path(tmp) / "down-rows.gguf",
                                         gguf.GGMLQuantizationType[type_name])
            m = ntio.load(path, max_context=CTX, threads=args.threads)
            policy = m.policy = SparseFFNPolicy(NeuronSelection("down", 1.0), down_norms=DownNorms(m.file))
            for k in (1.0, keep):
                policy.selection = NeuronSelection("down", k)
                ppl = m.perplexity(evaluation, ctx=CTX).perplexity
                row = {"model": name, "rule": "down", "keep": k, "unit": f"{type_name} row", "neurons_per_unit": 1,
                       "perplexity": ppl, "ratio": round(ppl / dense, 4)}
                print(json.dumps(row), flush=True)
                rows.append(row)
            m.close()
    return rows


# Bits of code per weight and of header per weight of a neuron-major down matrix, by GGUF type (`rebuilt_from_codes`).
NEURON_MAJOR_BITS = {gguf.GGMLQuantizationType.Q4_1: (4, 1.0), gguf.GGMLQuantizationType.Q4_K: (4, 0.5),
                     gguf.GGMLQuantizationType.Q6_K: (6, 0.5625)}
GRANULARITIES = (1, 512, 4096)  # bytes a read comes in: RAM, a disk sector, a page (O_DIRECT)


def rebuilt_from_codes(raw: np.ndarray, qtype: gguf.GGMLQuantizationType, shape: tuple[int, int]) -> np.ndarray:
    """Down matrix [D, F] (its GGUF bytes) rebuilt, float32, from each weight's own code (one unsigned code a weight,
    unpacked) and its row block's header alone, with gguf-py's float32 operations in its order (Q4_1: d·q + m; Q4_K:
    (d·sc)·q - (dmin·m); Q6_K: (d·sc)·(q - 32)). A neuron-major layout stores the codes transposed, [F, D]: a
    permutation, so equal bits here mean that layout loses nothing."""
    d_rows, f = shape
    b = raw.reshape(d_rows, -1)

    def f16(at: int) -> np.ndarray:
        return blocks[..., at:at + 2].copy().view(np.float16).astype(np.float32)  # [D, blocks, 1]

    if qtype == gguf.GGMLQuantizationType.Q4_1:
        blocks = b.reshape(d_rows, f // 32, 20)
        qs = blocks[..., 4:]
        codes = np.concatenate([qs & 15, qs >> 4], axis=2)  # [D, blocks, 32]: low nibbles first
        rebuilt = f16(0) * codes.astype(np.float32) + f16(2)
    elif qtype == gguf.GGMLQuantizationType.Q4_K:
        blocks = b.reshape(d_rows, f // 256, 144)
        s = blocks[..., 4:16]
        sc = np.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 15) | (s[..., 0:4] >> 6 << 4)], axis=2)
        mn = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | (s[..., 4:8] >> 6 << 4)], axis=2)
        qs = blocks[..., 16:].reshape(d_rows, f // 256, 4, 32)
        codes = np.stack([qs & 15, qs >> 4], axis=3).reshape(d_rows, f // 256, 8, 32)  # 64 weights: low, high
        rebuilt = ((f16(0) * sc.astype(np.float32))[..., None] * codes.astype(np.float32)
                   - (f16(2) * mn.astype(np.float32))[..., None])
    elif qtype == gguf.GGMLQuantizationType.Q6_K:
        blocks = b.reshape(d_rows, f // 256, 210)
        ql, qh = blocks[..., :128].reshape(d_rows, -1, 2, 64), blocks[..., 128:192].reshape(d_rows, -1, 2, 1, 32)
        low = np.stack([ql[..., :32] & 15, ql[..., 32:] & 15, ql[..., :32] >> 4, ql[..., 32:] >> 4], axis=3)
        codes = (low | ((qh >> np.array([0, 2, 4, 6], np.uint8)[:, None]) & 3) << 4).reshape(d_rows, -1, 16, 16)
        sc = blocks[..., 192:208].copy().view(np.int8).astype(np.float32)
        rebuilt = (f16(208) * sc)[..., None] * (codes.astype(np.float32) - 32)
    else:
        raise SystemExit(f"--neuron-major prices {', '.join(t.name for t in NEURON_MAJOR_BITS)} down matrices, "
                         f"not {qtype.name}")
    return rebuilt.reshape(d_rows, f).astype(np.float32)


def read_share(kept: torch.Tensor, column_bytes: int, granularity: int, f: int) -> float:
    """Share of the [F, column_bytes] codes that reading the kept neurons' columns (positions `kept`) fetches, in
    aligned pieces of `granularity` bytes: each column's pieces [first, last], less those the columns before it
    (in position order) already fetched."""
    kept = kept.sort().values
    first, last = kept * column_bytes // granularity, ((kept + 1) * column_bytes - 1) // granularity
    fetched = torch.cat([last.new_full((1,), -1), last[:-1]])  # last piece fetched before each column
    new = (last - torch.maximum(first, fetched + 1) + 1).clamp_min(0)
    return float(new.sum()) / math.ceil(f * column_bytes / granularity)


def price_neuron_major(name: str, args: argparse.Namespace, calibration: Recorder, evaluation: str) -> list[dict]:
    """The down rule per neuron from a lossless neuron-major down layout (`--neuron-major`): the split checked, then
    the bytes each evaluation token's kept neurons need, by read granularity and neuron order (module doc)."""
    recorder = Recorder(calibration.down_norms)
    m = ntio.load(name, max_context=CTX, policy=recorder, threads=args.threads)
    m.perplexity(evaluation, ctx=CTX)
    scores = {layer: torch.cat(a) for layer, a in recorder.activations.items()}
    layer_bytes = sum(m.file.tensor(n).nbytes for n in m.file.tensors if n.startswith("blk."))
    downs = {layer: m.file.tensor(f"blk.{layer}.ffn_down.weight") for layer in scores}
    checked = {}
    for info in downs.values():
        if info.qtype not in checked:  # one matrix per type: codes and header rebuild it bit for bit
            raw = np.array(m.file.tensor_bytes(info.name))
            want = gguf.quants.dequantize(raw, info.qtype).reshape(info.shape)
            checked[info.qtype] = bool(np.array_equal(rebuilt_from_codes(raw, info.qtype, info.shape).view(np.uint32),
                                                      want.astype(np.float32).view(np.uint32)))
            if not checked[info.qtype]:
                raise SystemExit(f"{info.name}: the neuron-major codes and header do not rebuild it")
    m.close()
    read: dict[tuple[float, str, int], float] = {}  # (keep, order, granularity) -> down bytes read, all layers
    for layer, a in scores.items():
        info, a, calib = downs[layer], a.float(), torch.cat(calibration.activations[layer]).float()
        d_rows, f = info.shape
        code_bits, header_bits = NEURON_MAJOR_BITS[info.qtype]
        header = info.nbytes * header_bits / (code_bits + header_bits)
        for keep in args.keep:
            k = math.ceil(keep * f)
            counts = torch.bincount(calib.topk(k).indices.flatten(), minlength=f)
            orders = {"file": torch.arange(f), "calibration frequency": counts.argsort(descending=True)}
            for order_name, order in orders.items():
                position = torch.empty(f, dtype=torch.long)
                position[order] = torch.arange(f)
                for granularity in GRANULARITIES:
                    share = statistics.mean(read_share(position[a[t].topk(k).indices], d_rows * code_bits // 8,
                                                       granularity, f) for t in range(0, a.shape[0], 4))
                    key = keep, order_name, granularity
                    read[key] = read.get(key, 0.0) + header + (info.nbytes - header) * share
    down_bytes = sum(info.nbytes for info in downs.values())
    rows = []
    for (keep, order_name, granularity), got in read.items():
        rows.append({"model": name, "rule": "down", "keep": keep, "unit": "neuron-major", "order": order_name,
                     "granularity_bytes": granularity, "lossless": {t.name: ok for t, ok in checked.items()},
                     "down_read_share": round(got / down_bytes, 4),
                     "layer_bytes_ratio": round((layer_bytes - down_bytes + got) / layer_bytes, 4)})
        print(json.dumps(rows[-1]), flush=True)
    return rows


class GroupScored(SparseFFNPolicy):
    """The down rule over consecutive groups of `neurons`, each token's groups ranked by `score`: "sum" (Σ |a_i| over
    the group, each neuron weighing 1), "norm" (Σ |a_i| · ||down[:, i]||, the down matrix's column norms weighing each
    neuron: the policy's own with `down_norms`) or "exact" (||down[:, g] · a_g||, each group's own contribution to
    the FFN's output: the best a per-token ranking of one group at a time can do, and it needs every down byte).
    `downs`: layer -> down [D, F]."""

    def __init__(self, downs: dict[int, torch.Tensor], neurons: int) -> None:
        super().__init__(NeuronSelection("down", 1.0))
        self.downs, self.neurons, self.score = downs, neurons, "sum"
        self.norms = {layer: w.norm(dim=0) for layer, w in downs.items()}

    def ffn_mask(self, layer: int) -> FFNMask:
        n, w = self.neurons, self.downs[layer]
        # Scores given per group, as a predictor's are.
        ranking = NeuronSelection("predicted", self.selection.keep, consecutive_groups(w.shape[1], n))

        def mask(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
            if self.score == "exact":
                a = (F.silu(gate) * up).unflatten(1, (-1, n))  # [T, G, n]
                score = torch.einsum("tgn,dgn->tgd", a, w.unflatten(1, (-1, n))).norm(dim=2)  # [T, G]
            else:
                score = unit_scores(gate, up * self.norms[layer] if self.score == "norm" else up, n)
            return ranking.masks(None, None, score)[0]

        return mask


def price_group_scores(name: str, args: argparse.Namespace, evaluation: str, dense: float,
                       neurons: int) -> list[dict]:
    """Perplexity ratios of the down rule over the store's groups of `neurons`, each way of ranking them
    (`GroupScored`, `--group-scores`), at every --keep."""
    reader = gguf.GGUFReader(resolve_model(name))
    downs = {int(t.name.split(".")[1]): torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type))
             for t in reader.tensors if t.name.endswith("ffn_down.weight")}  # [D, F] float32
    policy = GroupScored(downs, neurons)
    m = ntio.load(name, max_context=CTX, policy=policy, threads=args.threads)
    rows = []
    for keep in args.keep:
        for score in args.group_scores:
            policy.selection, policy.score = NeuronSelection("down", keep), score
            ppl = m.perplexity(evaluation, ctx=CTX).perplexity
            row = {"model": name, "rule": "down", "keep": keep, "unit": "consecutive", "neurons_per_unit": neurons,
                   "group_score": score, "perplexity": ppl, "ratio": round(ppl / dense, 4)}
            print(json.dumps(row), flush=True)
            rows.append(row)
    m.close()
    return rows


STREAMED_PROMPT = "Write a Python function that returns the n-th Fibonacci number, with a docstring."


def decode(store: Path, policy: SparseFFNPolicy | None, args: argparse.Namespace) -> dict:
    """Greedy decoding with every layer read from disk at every token: decode tok/s and bytes read per decode token."""
    m = ntio.load(store, tiers="C", policy=policy, threads=args.threads)
    done = m.generate(STREAMED_PROMPT, max_new_tokens=args.tokens, chat=True)
    stats = m.stats.summary()
    m.close()
    return {"tok_s": done.decode_tok_s, "bytes_per_token": stats["bytes_read_per_token"]}


def price_reads(name: str, args: argparse.Namespace, quality: dict[tuple[str, float, int], float],
                predictors: dict[int, UnitPredictor]) -> list[dict]:
    """The streamed price list (`--streamed`): per rule and keep share, all-C decoding against dense in alternating
    rounds, beside the perplexity ratio of the store's units (from `quality`, keyed (rule, keep, neurons));
    `predictors`: the predicted rule's, for the store's groups."""
    settings = [(rule, keep) for rule in args.rules for keep in args.keep]
    runs: dict[tuple[str, float] | None, list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        store = convert(resolve_model(name), Path(tmp) / "grouped.ntio", layout="ffn-groups")
        neurons = StoreFile(store).ffn_group_neurons
        for _ in range(args.rounds):
            for setting in [None, *settings]:
                policy = None if setting is None else SparseFFNPolicy(
                    NeuronSelection(*setting), predictors=predictors if setting[0] == "predicted" else {},
                    group_reads=neurons, down_norms=DownNorms(StoreFile(store)))
                runs.setdefault(setting, []).append(decode(store, policy, args))
    dense = runs[None]
    rows = [{"model": name, "rule": "dense", "neurons_per_unit": neurons, "tok_s": [r["tok_s"] for r in dense],
             "bytes_per_token": statistics.median(r["bytes_per_token"] for r in dense)}]
    for rule, keep in settings:
        mine = runs[rule, keep]
        rows.append({
            "model": name, "rule": rule, "keep": keep, "neurons_per_unit": neurons,
            "perplexity_ratio": quality.get((rule, keep, neurons)),
            "bytes_ratio": round(statistics.median(r["bytes_per_token"] / d["bytes_per_token"]
                                                   for r, d in zip(mine, dense)), 4),
            "tok_s_ratio": round(statistics.median(r["tok_s"] / d["tok_s"] for r, d in zip(mine, dense)), 4),
            "tok_s": [r["tok_s"] for r in mine],
            "bytes_per_token": statistics.median(r["bytes_per_token"] for r in mine),
        })
    for row in rows:
        print(json.dumps(row), flush=True)
    return rows


def plot(rows: list[dict], out: Path) -> None:
    """Perplexity ratio against bytes per token (both to dense), one line per rule, a panel per model."""
    plt = pyplot("--plot")
    priced = [r for r in rows if "bytes_ratio" in r and r.get("perplexity_ratio") is not None]
    models = sorted({r["model"] for r in priced})
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5), squeeze=False)
    for ax, model in zip(axes[0], models):
        ax.scatter([1.0], [1.0], marker="*", s=120, color="black", label="dense")
        for color, rule in enumerate(RULES):
            mine = [r for r in priced if r["model"] == model and r["rule"] == rule]
            pts = sorted((r["bytes_ratio"], r["perplexity_ratio"]) for r in mine)
            if pts:
                ax.plot(*zip(*pts), marker="o", color=f"C{color}",
                        label=f"{rule} (groups of {mine[0]['neurons_per_unit']})")
                for r in mine:
                    ax.annotate(f"keep {r['keep']:g}, {r['tok_s_ratio']:.2f}x tok/s",
                                (r["bytes_ratio"], r["perplexity_ratio"]), fontsize=7)
        ax.set(title=f"{model}, all layers read from disk", xlabel="bytes read per decode token / dense",
               ylabel="perplexity / dense", yscale="log")
        ax.legend(fontsize=8)
    fig.tight_layout()
    save_png(fig, out)


def measure(name: str, args: argparse.Namespace) -> list[dict]:
    m = ntio.load(name, max_context=CTX, threads=args.threads)
    norms = DownNorms(m.file)
    policy = m.policy = SparseFFNPolicy(NeuronSelection("down", 1.0), down_norms=norms)
    d_ff = m.config.d_ff
    evaluation = first_tokens(m, (ROOT / "README.md").read_text(), args.eval_tokens)
    calibration = first_tokens(m, calibration_text(), args.calib_tokens)
    dense = m.perplexity(evaluation, ctx=CTX).perplexity
    rows = [{"model": name, "rule": "dense", "perplexity": dense}]
    print(json.dumps(rows[0]), flush=True)

    # (kind, neurons per unit, the units: one [G, size] for every layer, or per layer)
    units: list[tuple[str, int, torch.Tensor | None, dict[int, torch.Tensor]]] = [
        ("consecutive", size, consecutive_groups(d_ff, size), {}) for size in args.groups if d_ff % size == 0]
    recorder = Recorder(norms)
    if args.clustered or "predicted" in args.rules or args.neuron_major:  # (the recorded calibration text)
        calibrating = ntio.load(name, max_context=CTX, policy=recorder, threads=args.threads)
        calibrating.perplexity(calibration, ctx=CTX)
        calibrating.close()
        units += [("clustered", size, None, clustered_groups(recorder.activations, size)) for size in args.clustered]

    eval_ids = m.tokenizer.encode(evaluation)
    predictors: dict[int, dict[int, UnitPredictor]] = {}  # neurons per unit -> layer -> predictor
    for kind, size, shared, per_layer in units:
        for rule in args.rules:
            if rule == "predicted" and kind != "consecutive":
                continue  # a predictor scores consecutive units
            for keep in args.keep:
                policy.selection, policy.groups = NeuronSelection(rule, keep, shared), per_layer
                if rule == "predicted" and size not in predictors:
                    predictors[size] = fit_predictors(recorder, size, args)
                policy.predictors = predictors[size] if rule == "predicted" else {}
                policy.recall.clear()
                ppl = m.perplexity(evaluation, ctx=CTX).perplexity
                row = {"model": name, "rule": rule, "keep": keep, "unit": kind, "neurons_per_unit": size,
                       "perplexity": ppl, "ratio": round(ppl / dense, 4)}
                if rule == "predicted":
                    row.update(predictor_rank=args.predictor_rank, oracle_recall=round(policy.oracle_recall(), 4))
                row["union_by_pass_tokens"] = union_growth(m, policy, eval_ids, args.union_tokens)
                print(json.dumps(row), flush=True)
                rows.append(row)
    # The group size a grouped store of this model has (`ntio convert --layout ffn-groups`).
    neurons = widest_group_neurons(m.file.tensor(f"blk.{i}.ffn_down.weight").qtype for i in range(m.config.n_layers))
    if args.streamed:  # the units a grouped store reads, priced with the groups given or not
        for rule in args.rules:
            for keep in args.keep:
                if not any(r.get("neurons_per_unit") == neurons and r.get("unit") == "consecutive" and
                           r["rule"] == rule and r["keep"] == keep for r in rows):
                    if rule == "predicted" and neurons not in predictors:
                        predictors[neurons] = fit_predictors(recorder, neurons, args)
                    policy.predictors = predictors.get(neurons, {}) if rule == "predicted" else {}
                    policy.selection, policy.groups = NeuronSelection(rule, keep, consecutive_groups(d_ff, neurons)), {}
                    policy.recall.clear()
                    ppl = m.perplexity(evaluation, ctx=CTX).perplexity
                    rows.append({"model": name, "rule": rule, "keep": keep, "unit": "consecutive",
                                 "neurons_per_unit": neurons, "perplexity": ppl, "ratio": round(ppl / dense, 4)})
                    if rule == "predicted":
                        rows[-1].update(predictor_rank=args.predictor_rank,
                                        oracle_recall=round(policy.oracle_recall(), 4))
                    rows[-1]["union_by_pass_tokens"] = union_growth(m, policy, eval_ids, args.union_tokens)
                    print(json.dumps(rows[-1]), flush=True)
    m.close()
    rows += price_down_rows(name, args, evaluation, dense)
    if args.neuron_major:
        rows += price_neuron_major(name, args, recorder, evaluation)
    if args.group_scores:
        rows += price_group_scores(name, args, evaluation, dense, neurons)
    if args.streamed:
        quality = {(r["rule"], r["keep"], r["neurons_per_unit"]): r["ratio"] for r in rows
                   if r.get("unit") == "consecutive"}
        rows += price_reads(name, args, quality, predictors.get(neurons, {}))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", nargs="+", default=["smollm2-135m", "qwen2.5-coder-1.5b"])
    ap.add_argument("--rules", nargs="+", default=["down", "gate"], choices=["down", "gate", "predicted"])
    ap.add_argument("--keep", type=float, nargs="+", default=[0.7, 0.5, 0.3])
    ap.add_argument("--groups", type=int, nargs="*", default=[1, 32, 256], help="consecutive neurons per unit")
    ap.add_argument("--clustered", type=int, nargs="*", default=[], help="co-activation clustered neurons per unit")
    ap.add_argument("--union-tokens", type=int, nargs="+", default=[4, 16, 64], help="tokens per pass for the union")
    ap.add_argument("--down-rows", nargs="*", default=[], choices=["Q8_0", "Q5_1", "Q5_0", "Q4_1", "Q4_0"],
                    help="price down matrices stored as rows (transposed, quantized again) in these types")
    ap.add_argument("--group-scores", nargs="*", default=[], choices=["sum", "norm", "exact"],
                    help="price ways of ranking the store's groups under the down rule (GroupScored)")
    ap.add_argument("--neuron-major", action="store_true",
                    help="price the down rule per neuron from a lossless neuron-major down layout (module doc)")
    ap.add_argument("--eval-tokens", type=int, default=2048)
    ap.add_argument("--calib-tokens", type=int, default=2048)
    ap.add_argument("--predictor-rank", type=int, default=128)
    ap.add_argument("--predictor-epochs", type=int, default=8)
    ap.add_argument("--threads", type=int)
    ap.add_argument("--streamed", action="store_true", help="the streamed price list (module doc)")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds of the streamed runs")
    ap.add_argument("--tokens", type=int, default=32, help="greedy tokens per streamed run")
    ap.add_argument("--json", type=Path, help="write the summary object here")
    ap.add_argument("--plot", type=Path, help="draw the streamed price list here (with --streamed)")
    args = ap.parse_args()
    if args.plot:
        check_figure_path(args.plot)
    rows = [row for name in args.model for row in measure(name, args)]
    summary = {"machine": machine(), "ctx": CTX, "command": " ".join(sys.argv), "results": rows}
    print(json.dumps(summary))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1) + "\n")
    if args.plot:
        plot(rows, args.plot)


if __name__ == "__main__":
    main()
