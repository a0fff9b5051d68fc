"""Sparse FFN selections (ntio.policies.sparse_ffn): which neurons each token keeps, and that the engine computes
exactly those. Oracles: a sort of the scores for the choice, and Hugging Face transformers on the same GGUF in
float32 with the same neurons zeroed for the logits."""

from __future__ import annotations

import functools
import json
import math
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import ntio
from ntio.policies.sparse_ffn import (NeuronSelection, SparseFFNPolicy, UnitPredictor, consecutive_groups,
                                      unit_recall, unit_scores)
from references import rel_l2

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "The quick brown fox jumps over the lazy dog because"


def _scores(rule: str, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate).abs() if rule == "gate" else (F.silu(gate) * up).abs()


@pytest.mark.parametrize("rule", ["down", "gate"])
@pytest.mark.parametrize("keep", [0.3, 0.5, 1.0])
def test_each_token_keeps_its_highest_scoring_neurons(rule, keep):
    gen = torch.Generator().manual_seed(0)
    gate, up = torch.randn(5, 96, generator=gen), torch.randn(5, 96, generator=gen)
    neurons, units = NeuronSelection(rule, keep).masks(gate, up)
    assert torch.equal(neurons, units) and neurons.shape == (5, 96)
    score = _scores(rule, gate, up)
    for t in range(5):
        assert int(neurons[t].sum()) == math.ceil(keep * 96)
        if keep < 1:
            assert score[t][neurons[t]].min() > score[t][~neurons[t]].max()


def test_the_gate_rule_ignores_up_and_the_down_rule_does_not():
    gen = torch.Generator().manual_seed(1)
    gate, up = torch.randn(3, 64, generator=gen), torch.randn(3, 64, generator=gen)
    other_up = torch.randn(3, 64, generator=gen)
    gate_rule, down_rule = NeuronSelection("gate", 0.5), NeuronSelection("down", 0.5)
    assert torch.equal(gate_rule.masks(gate, up)[0], gate_rule.masks(gate, other_up)[0])
    assert not torch.equal(down_rule.masks(gate, up)[0], down_rule.masks(gate, other_up)[0])


def test_groups_are_kept_or_dropped_whole_by_their_summed_score():
    gen = torch.Generator().manual_seed(2)
    gate, up = torch.randn(4, 64, generator=gen), torch.randn(4, 64, generator=gen)
    groups = torch.randperm(64, generator=gen).view(8, 8)  # any neuron ids, not only consecutive ones
    neurons, units = NeuronSelection("down", 0.25, groups).masks(gate, up)
    assert units.shape == (4, 8) and units.sum(dim=1).tolist() == [2] * 4
    group_score = _scores("down", gate, up)[:, groups].sum(dim=-1)
    for t in range(4):
        assert group_score[t][units[t]].min() > group_score[t][~units[t]].max()
        for g in range(8):
            assert neurons[t, groups[g]].tolist() == [bool(units[t, g])] * 8
    assert consecutive_groups(64, 32).tolist() == [list(range(32)), list(range(32, 64))]
    assert consecutive_groups(64, 1) is None
    with pytest.raises(ValueError, match="a group of 48 neurons does not divide the FFN's 64"):
        consecutive_groups(64, 48)


def test_the_down_rule_weighs_each_neuron_by_its_down_columns_norm():
    """With `down_norms`, a token keeps the groups of largest Σ|silu(g) · u| · ||down[:, i]||, and a predictor's
    recall is counted against those; the gate rule ignores the norms."""
    gen = torch.Generator().manual_seed(3)
    gate, up, x = torch.randn(4, 64, generator=gen), torch.randn(4, 64, generator=gen), torch.randn(4, 8)
    norms = torch.rand(64, generator=gen) * 4
    weighed = NeuronSelection("down", 0.25, consecutive_groups(64, 8)).masks(gate, up * norms)[0]
    plain = NeuronSelection("down", 0.25, consecutive_groups(64, 8)).masks(gate, up)[0]
    assert not torch.equal(weighed, plain)
    asked = []
    policy = SparseFFNPolicy(NeuronSelection("down", 0.25), group_reads=8,
                             down_norms=lambda layer: asked.append(layer) or norms)
    assert torch.equal(policy.ffn_mask(5)(x, gate, up), weighed) and asked == [5]
    policy.ffn_mask(5)(x, gate, up)
    assert asked == [5]  # asked once per layer
    policy.selection = NeuronSelection("gate", 0.25)
    assert torch.equal(policy.ffn_mask(6)(x, gate, up), NeuronSelection("gate", 0.25, consecutive_groups(64, 8)
                                                                        ).masks(gate, up)[0]) and asked == [5]
    scores = unit_scores(gate, up, 8, norms)
    assert torch.allclose(scores, (F.silu(gate) * up * norms).abs().view(4, 8, 8).sum(dim=2))

    class Fixed(UnitPredictor):  # scores the 8 groups in a fixed order
        def forward(self, x):
            return torch.arange(8.0).expand(x.shape[0], -1)

    policy = SparseFFNPolicy(NeuronSelection("predicted", 0.25), predictors={5: Fixed(8, 8, 2, 8)},
                             down_norms=lambda layer: norms)
    policy.ffn_mask(5)(x, gate, up)
    want = _top_share_of(scores, 0.25)
    assert policy.oracle_recall() == pytest.approx(float(want[:, 6:].sum() / want.sum()))


def _top_share_of(score: torch.Tensor, keep: float) -> torch.Tensor:
    """[T, G] bool: each row's ceil(keep · G) largest scores, by a full sort."""
    order = score.argsort(dim=1, descending=True)[:, : math.ceil(keep * score.shape[1])]
    return torch.zeros_like(score, dtype=torch.bool).scatter_(1, order, True)


@pytest.mark.parametrize("rule, keep", [("sparse", 0.5), ("down", 0.0), ("gate", 1.5)])
def test_bad_selections_are_refused(rule, keep):
    with pytest.raises(ValueError, match="sparse FFN (rule|keep)"):
        NeuronSelection(rule, keep)
    with pytest.raises(ValueError, match="the predicted rule needs a predictor's scores"):
        NeuronSelection("predicted", 0.5).masks(torch.zeros(1, 8), torch.zeros(1, 8))
    with pytest.raises(ValueError, match="layer 3's predictor scores groups of 32 neurons, the store's FFN groups "
                                         "have 256"):
        SparseFFNPolicy(NeuronSelection("predicted", 0.5), predictors={3: UnitPredictor(8, 4, 2, 32)}, group_reads=256)


@pytest.mark.parametrize("neurons", [1, 4])
def test_a_predictor_learns_which_units_its_input_decides(neurons):
    """Activations relu(x · W) are a function of x that a rank-4D predictor can represent (relu(x), relu(-x) and a
    linear map): fitted on 4,096 tokens to the units' scores, it keeps most of the top quarter's units on 512 tokens
    it never saw (0.91 for single neurons and 0.80 for groups of 4 when written), and a predictor of random weights
    about a quarter (0.26 and 0.30)."""
    gen = torch.Generator().manual_seed(3)
    d, f, keep = 16, 64, 0.25
    w = torch.randn(d, f, generator=gen)
    x = torch.randn(4096 + 512, d, generator=gen)
    a = F.relu(x @ w)
    scores = unit_scores(torch.full_like(a, 20.0), a, neurons)  # silu(20) = 20: 20 Σ a over each unit (a ≥ 0)
    assert torch.allclose(scores, 20 * a.unflatten(1, (-1, neurons)).sum(2), rtol=1e-5)
    predictor = UnitPredictor.fit(x[:4096], scores[:4096], rank=4 * d, neurons=neurons, epochs=20)
    assert predictor.d_ff == f and predictor.neurons == neurons
    assert unit_recall(predictor(x[4096:]), scores[4096:], keep) > 0.75
    assert unit_recall(UnitPredictor(d, f // neurons, 4 * d, neurons).eval()(x[4096:]), scores[4096:], keep) < 0.4
    # Its state is what a calibration file keeps, and gives the same scores back.
    again = UnitPredictor.from_state(predictor.state(), neurons)
    assert torch.equal(again(x[:8]), predictor(x[:8]))


@torch.inference_mode()
def test_the_predicted_rule_keeps_the_predictors_choice_from_the_ffn_input(smollm2_path, hf_smollm2):
    """The x a mask receives is the FFN's normed input (transformers' MLP input on the same GGUF), the predicted rule
    keeps the predictor's top groups for it, and recall counts how many of the down rule's groups it kept."""
    seen: dict[str, torch.Tensor] = {}

    class Spy(UnitPredictor):  # remembers its input and scores the 48 groups of 32 neurons by a fixed order
        def forward(self, x):
            seen.setdefault("x", x)
            return torch.arange(48.0).expand(x.shape[0], -1)

    policy = SparseFFNPolicy(NeuronSelection("predicted", 0.25), predictors={0: Spy(576, 48, 4, 32)})
    m = ntio.load(smollm2_path, max_context=64, policy=policy, cpu_activations="float32")
    ids = m.encode_prompt(PROMPT)
    mask = policy.ffn_mask(0)
    m.engine.forward(torch.tensor(ids), 0)
    m.close()
    hf_input = {}
    hook = hf_smollm2.model.layers[0].mlp.register_forward_hook(lambda mod, args, out: hf_input.setdefault("x", args[0]))
    hf_smollm2(torch.tensor([ids]), use_cache=False)
    hook.remove()
    assert rel_l2(seen["x"], hf_input["x"][0]) <= 1e-4
    gate, up = torch.randn(2, 1536), torch.randn(2, 1536)
    policy.recall.clear()
    kept = mask(seen["x"][:2], gate, up)
    assert kept.sum(dim=1).tolist() == [384, 384] and kept[:, 1152:].all()  # the top quarter of the order: 12 groups
    want = NeuronSelection("down", 0.25, consecutive_groups(1536, 32)).masks(gate, up)[1]
    assert policy.oracle_recall() == pytest.approx(float(want[:, 36:].sum() / want.sum()))
    # Before gate and up are computed (the predicted rule's reads), the mask needs x alone and counts no recall.
    assert torch.equal(mask(seen["x"][:2], None, None), kept) and len(policy.recall) == 1


def _masked_mlp(mlp, keep: float, group: int = 1, rule: str = "down", weighed: bool = False):
    """transformers' SwiGLU MLP with each token keeping its ceil(keep * F / group) groups of `group` consecutive
    neurons of largest Σ|silu(g) * u| (the down rule; `weighed`: Σ|silu(g) * u| * ||down[:, i]||, transformers' own
    down weights) or Σ|silu(g)| (the gate rule)."""
    norms = mlp.down_proj.weight.norm(dim=0) if weighed else 1.0  # [F]

    def forward(x):
        act = mlp.act_fn(mlp.gate_proj(x))
        a = act * mlp.up_proj(x)  # [B, T, F]
        score = (a * norms if rule == "down" else act).abs().unflatten(-1, (-1, group)).sum(dim=-1)  # [B, T, G]
        top = score.topk(math.ceil(keep * score.shape[-1]), dim=-1).indices
        kept = torch.zeros_like(score).scatter_(-1, top, 1.0).repeat_interleave(group, dim=-1)
        return mlp.down_proj(a * kept)

    return forward


@torch.inference_mode()
def test_the_engine_computes_exactly_the_kept_neurons_as_transformers_does(smollm2_path, hf_smollm2, monkeypatch):
    keep = 0.3
    policy = SparseFFNPolicy(NeuronSelection("down", keep))
    m = ntio.load(smollm2_path, max_context=64, policy=policy, cpu_activations="float32")
    ids = m.encode_prompt(PROMPT)
    got = m.engine.forward(torch.tensor(ids), 0, all_logits=True)  # T > 1: the torch products
    policy.union.clear()
    decode = m.engine.forward(torch.tensor([11]), len(ids))  # T = 1: the CPU kernels
    assert policy.union_fraction() == pytest.approx(math.ceil(keep * 1536) / 1536)  # one token: its own
    m.close()
    dense = hf_smollm2(torch.tensor([ids + [11]]), use_cache=False).logits[0]
    for layer in hf_smollm2.model.layers:
        monkeypatch.setattr(layer.mlp, "forward", _masked_mlp(layer.mlp, keep))
    want = hf_smollm2(torch.tensor([ids + [11]]), use_cache=False).logits[0]
    assert rel_l2(want, dense) > 0.05  # the masking matters ...
    assert rel_l2(got, want[:-1]) <= 1e-4  # ... and both engines mask the same neurons
    assert rel_l2(decode, want[-1]) <= 1e-4


@torch.inference_mode()
def test_a_pass_over_several_tokens_reads_the_union_of_their_neurons(smollm2_path):
    policy = SparseFFNPolicy(NeuronSelection("down", 0.3, consecutive_groups(1536, 32)))
    m = ntio.load(smollm2_path, max_context=64, policy=policy)
    m.engine.forward(torch.tensor(m.encode_prompt(PROMPT)), 0)
    assert set(policy.union) == set(range(m.config.n_layers))
    assert all(len(shares) == 1 for shares in policy.union.values())  # one pass, one share per layer
    assert 0.3 < policy.union_fraction() <= 1.0
    m.close()


@pytest.fixture(scope="module")
def grouped_smollm2(smollm2_path, tmp_path_factory):
    """SmolLM2 as a store with the ffn-groups layout: its Q4_1 down matrices also in groups of 32 neurons."""
    from ntio.formats.store import convert

    return convert(smollm2_path, tmp_path_factory.mktemp("grouped") / "smollm2.ntio", layout="ffn-groups")


def _all_c_pass(store: Path, policy: SparseFFNPolicy | None) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Every layer read from disk: the prompt's logits, then one decode step's and the bytes that step read."""
    m = ntio.load(store, max_context=64, policy=policy, tiers="C", cpu_activations="float32")
    ids = m.encode_prompt(PROMPT)
    prompt = m.engine.forward(torch.tensor(ids), 0, all_logits=True)
    decode = m.engine.forward(torch.tensor([11]), len(ids))
    read = m.stats.last().bytes_read
    m.close()
    return prompt, decode, read


def _flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x01]))


@torch.inference_mode()
def test_streamed_layers_read_only_the_kept_down_groups_and_give_transformers_logits(grouped_smollm2, hf_smollm2,
                                                                                     monkeypatch):
    """All layers on disk, read without down; each FFN reads the groups of 32 its tokens keep from the store's
    group-major copy, ranked with each neuron weighed by the norm of its down column the store records: the logits
    are transformers' with the same groups zeroed (ranked by its own down weights' norms), and a decode step reads
    exactly the kept groups' bytes less than one keeping all."""
    from ntio.formats.store import DownNorms, StoreFile

    def run(keep: float | None) -> tuple[torch.Tensor, torch.Tensor, int]:
        norms = DownNorms(StoreFile(grouped_smollm2))
        return _all_c_pass(grouped_smollm2, None if keep is None else SparseFFNPolicy(
            NeuronSelection("down", keep), group_reads=32, down_norms=norms))

    prompt, decode, read = run(0.5)
    _, _, read_all = run(1.0)
    _, _, read_dense = run(None)
    stride = 12288  # a group: 576 rows of one Q4_1 block of 20 B = 11,520 B, in whole 4 KiB pages
    assert read_all == read_dense - 30 * 576 * 48 * 20 + 30 * 48 * stride  # 30 layers: no dense down, every group
    assert read_all - read == 30 * (48 - 24) * stride  # 24 of 48 groups not read
    ids = ntio.load(grouped_smollm2, max_context=64).encode_prompt(PROMPT)
    for layer in hf_smollm2.model.layers:
        monkeypatch.setattr(layer.mlp, "forward", _masked_mlp(layer.mlp, 0.5, group=32, weighed=True))
    want = hf_smollm2(torch.tensor([ids + [11]]), use_cache=False).logits[0]
    assert rel_l2(prompt, want[:-1]) <= 1e-4
    assert rel_l2(decode, want[-1]) <= 1e-4
    for layer in hf_smollm2.model.layers:  # unweighed ranks choose other groups
        monkeypatch.setattr(layer.mlp, "forward", _masked_mlp(layer.mlp, 0.5, group=32))
    assert rel_l2(prompt, hf_smollm2(torch.tensor([ids]), use_cache=False).logits[0]) > 1e-3


@pytest.mark.parametrize("depth", [8, 1])
@torch.inference_mode()
def test_large_layer_reads_whose_groups_follow_go_through_a_shallow_queue(grouped_smollm2, monkeypatch, depth):
    """A streamed layer read without down (its groups read once gate and up are known) goes through a reader of
    GROUP_READ_QUEUE_DEPTH requests in flight where it alone fills them with whole requests (with requests of 256
    KiB, SmolLM2's 1.7 MB reads fill one, not eight), so that the groups' reads do not wait behind the default
    depth's; a dense pass, and the predicted rule's (its groups read while the layer before computes), read through
    the default reader alone."""
    from ntio import _core
    from ntio.runtime import loader

    class Fixed(UnitPredictor):  # scores the 48 groups of 32 neurons by a fixed order
        def forward(self, x):
            return torch.arange(48.0).expand(x.shape[0], -1)

    down = SparseFFNPolicy(NeuronSelection("down", 0.5), group_reads=32)
    predicted = SparseFFNPolicy(NeuronSelection("predicted", 0.5), group_reads=32,
                                predictors={layer: Fixed(576, 48, 4, 32) for layer in range(30)})
    monkeypatch.setattr(loader, "GROUP_READ_QUEUE_DEPTH", depth)
    for policy in (down, None, predicted):
        m = ntio.load(grouped_smollm2, max_context=64, policy=policy, tiers="C")
        m.loader.reader = _core.Reader(m.loader.layout.file.files, request_size=256 << 10)
        m.engine.forward(torch.tensor(m.encode_prompt(PROMPT)), 0)
        shallow = m.loader._layers_before_groups
        assert m.stats.last().bytes_read > 0
        if policy is down and depth == 1:
            assert shallow.queue_depth == 1
        else:
            assert shallow is None
        m.close()


@torch.inference_mode()
def test_the_gate_rule_reads_gate_whole_then_only_its_groups_up_rows_and_down_columns(grouped_smollm2, hf_smollm2,
                                                                                       monkeypatch):
    """All layers on disk, read without up and down (seed 002's order): each FFN computes gate whole, chooses its
    tokens' groups by Σ|silu(gate)|, then reads their up rows and down groups: the logits are transformers' with
    the same groups zeroed, and a step keeping every group reads the pages around the up rows and every down group
    in place of the dense up and down, to the byte."""
    from ntio.formats.store import StoreFile

    prompt, decode, _ = _all_c_pass(grouped_smollm2, SparseFFNPolicy(NeuronSelection("gate", 0.5), group_reads=32))
    ids = ntio.load(grouped_smollm2, max_context=64).encode_prompt(PROMPT)
    for layer in hf_smollm2.model.layers:
        monkeypatch.setattr(layer.mlp, "forward", _masked_mlp(layer.mlp, 0.5, group=32, rule="gate"))
    want = hf_smollm2(torch.tensor([ids + [11]]), use_cache=False).logits[0]
    assert rel_l2(prompt, want[:-1]) <= 1e-4
    assert rel_l2(decode, want[-1]) <= 1e-4
    _, _, read = _all_c_pass(grouped_smollm2, SparseFFNPolicy(NeuronSelection("gate", 1.0), group_reads=32))
    _, _, expected = _all_c_pass(grouped_smollm2, None)
    store = StoreFile(grouped_smollm2)
    for layer in range(30):
        up = store.tensors[f"blk.{layer}.ffn_up.weight"]
        expected -= up.nbytes + store.tensors[f"blk.{layer}.ffn_down.weight"].nbytes
        expected += -(-(up.offset + up.nbytes) // 4096) * 4096 - up.offset // 4096 * 4096 + 48 * 12288
    assert read == expected


def test_a_store_with_the_ffn_layout_plans_room_for_its_group_reads(grouped_smollm2, smollm2_path):
    """Streamed from a store with the FFN layout, the plan's staging holds the two group scratches besides the slots
    (each at least every group of the largest layer: its gate and up rows and its down copy's groups), up to the
    rounding of the staging pool to whole 2 MiB pages; resident, neither has staging."""
    from click.testing import CliRunner

    from ntio.cli import main as cli
    from ntio.formats.store import StoreFile

    def staging(path, tiers: str) -> int:
        result = CliRunner().invoke(cli, ["plan", str(path), "--tiers", tiers, "--json"])
        assert result.exit_code == 0, result.output
        return json.loads(result.output)["parts"]["staging"]

    store = StoreFile(grouped_smollm2)
    one_read = max(store.tensors[f"blk.{i}.ffn_gate.weight"].nbytes + store.tensors[f"blk.{i}.ffn_up.weight"].nbytes
                   + 48 * 12288 for i in range(30))
    assert staging(grouped_smollm2, "C") - staging(smollm2_path, "C") >= 2 * one_read - 2**21
    assert staging(grouped_smollm2, "A") == staging(smollm2_path, "A") == 0


def test_a_corrupt_down_group_fails_the_read_naming_it(grouped_smollm2, tmp_path):
    from ntio.errors import ModelFormatError
    from ntio.formats.store import StoreFile

    bad = shutil.copy(grouped_smollm2, tmp_path / "bad.ntio")
    (offset, length), = StoreFile(bad).ffn_group_extents(3, [5])
    _flip_byte(bad, offset + length // 2)
    m = ntio.load(bad, max_context=64, tiers="C", policy=SparseFFNPolicy(NeuronSelection("down", 1.0), group_reads=32))
    with pytest.raises(ModelFormatError, match=r"bad\.ntio: checksum mismatch in tensor 'blk\.3\.ffn_down\.weight "
                                               r"group 5'"):
        m.generate(PROMPT, max_new_tokens=2)
    m.close()


def test_sparse_ffn_options_name_what_is_wrong(grouped_smollm2, smollm2_path):
    from click.testing import CliRunner

    from ntio.cli import main as cli

    run = lambda *args: CliRunner().invoke(cli, [*args, "-p", "hi", "-n", "2"])  # noqa: E731
    result = run("generate", "-m", str(smollm2_path), "--sparse-ffn", "down")
    assert result.exit_code == 1 and result.output.count("\n") == 1
    assert "lacks: `ntio convert" in result.output and "--layout ffn-groups` writes one" in result.output
    result = run("generate", "-m", str(grouped_smollm2), "--keep", "0.5")
    assert result.exit_code == 1 and "--keep needs --sparse-ffn" in result.output
    result = run("generate", "-m", str(grouped_smollm2), "--sparse-ffn", "down", "--keep", "0")
    assert result.exit_code == 2 and "0<x<=1" in result.output
    result = run("generate", "-m", str(grouped_smollm2), "--sparse-ffn", "gate", "--keep", "0.7", "--tiers", "C",
                 "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)["sparse_ffn"]
    assert report["rule"] == "gate" and report["group_neurons"] == 32 and report["union_fraction"] == pytest.approx(
        math.ceil(0.7 * 48) / 48)


class _FixedOrder(UnitPredictor):
    """Scores SmolLM2's 48 groups of 32 neurons by a fixed order, whatever the input: the top share is the last
    groups, one run."""

    def __init__(self) -> None:
        super().__init__(576, 48, 1, 32)

    def forward(self, x):
        return torch.arange(48.0).expand(x.shape[0], -1)


def _random_predictors(n_layers: int) -> dict[int, UnitPredictor]:
    torch.manual_seed(5)
    return {layer: UnitPredictor(576, 48, 16, 32).eval() for layer in range(n_layers)}


def _predicted_mlp(mlp, layer: int, predictor: UnitPredictor, keep: float, inputs: dict[int, torch.Tensor]):
    """transformers' SwiGLU MLP of `layer` with each token keeping the ceil(keep * 48) groups of 32 neurons
    `predictor` scores highest from the layer before's MLP input (layer 0: its own), which `inputs` keeps."""

    def forward(x):
        inputs[layer] = x
        score = predictor(inputs[max(layer - 1, 0)])  # [B, T, 48]
        top = score.topk(math.ceil(keep * 48), dim=-1).indices
        kept = torch.zeros_like(score).scatter_(-1, top, 1.0).repeat_interleave(32, dim=-1)
        return mlp.down_proj(mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x) * kept)

    return forward


@torch.inference_mode()
def test_the_predicted_rule_reads_only_its_groups_rows_and_columns_and_gives_transformers_logits(
        grouped_smollm2, hf_smollm2, monkeypatch):
    """All layers on disk, read without gate, up and down; each FFN reads the gate and up rows and the down groups
    of the groups its predictor chose from its input: the logits are transformers' with the same groups zeroed
    (per token, each layer's from the layer before's MLP input: the predictors here are random), and a decode step
    keeping the last half of the groups reads the pages around their gate and up rows and their down groups, to the
    byte."""
    from ntio.formats.store import StoreFile
    from ntio.runtime.loader import LayerLoader

    run = functools.partial(_all_c_pass, grouped_smollm2)
    predictors = _random_predictors(30)
    prompt, decode, _ = run(SparseFFNPolicy(NeuronSelection("predicted", 0.5), predictors=predictors, group_reads=32))
    ids = ntio.load(grouped_smollm2, max_context=64).encode_prompt(PROMPT)
    inputs: dict[int, torch.Tensor] = {}
    for layer, block in enumerate(hf_smollm2.model.layers):
        monkeypatch.setattr(block.mlp, "forward", _predicted_mlp(block.mlp, layer, predictors[layer], 0.5, inputs))
    want = hf_smollm2(torch.tensor([ids + [11]]), use_cache=False).logits[0]
    assert rel_l2(prompt, want[:-1]) <= 1e-4
    assert rel_l2(decode, want[-1]) <= 1e-4

    fixed = {layer: _FixedOrder() for layer in range(30)}
    ahead: list[bool] = []  # per FFN read: whether its groups were read while the layer before computed
    events: list[str] = []  # group reads submitted ("s<layer>") and waited for ("w<layer>"), in order
    read_groups, submit_groups, wait = LayerLoader._read_groups, LayerLoader._submit_groups, LayerLoader._wait
    monkeypatch.setattr(LayerLoader, "_read_groups", lambda self, layer, rows, ids: (
        ahead.append(layer in self._groups_ahead), read_groups(self, layer, rows, ids))[1])
    group_reads: dict[int, tuple[int, object]] = {}  # id of a group read's handle -> its layer and the handle

    def submitted(self, layer, parts, ids):
        events.append(f"s{layer}")
        read = submit_groups(self, layer, parts, ids)
        group_reads[id(read.handle)] = layer, read.handle  # kept: no other handle takes its id
        return read

    monkeypatch.setattr(LayerLoader, "_submit_groups", submitted)
    monkeypatch.setattr(LayerLoader, "_wait", lambda self, handle, landed=False: (
        landed and id(handle) in group_reads and events.append(f"w{group_reads[id(handle)][0]}"),
        wait(self, handle, landed))[1])
    _, _, read = run(SparseFFNPolicy(NeuronSelection("predicted", 0.5), predictors=fixed, group_reads=32))
    assert ahead == [False, *[True] * 29] * 2  # the prompt's pass, then the decode step's: all but layer 0
    # Each layer's groups wait behind the next layer's, submitted as soon as they were chosen.
    assert events == ["s0", *[e for layer in range(29) for e in (f"s{layer + 1}", f"w{layer}")], "w29"] * 2
    _, _, read_dense = run(None)
    store = StoreFile(grouped_smollm2)
    expected = read_dense
    for layer in range(30):
        for part in ("gate", "up"):
            info = store.tensors[f"blk.{layer}.ffn_{part}.weight"]
            expected -= info.nbytes
            start, stop = info.offset + 768 * 360, info.offset + 1536 * 360  # rows of groups 24-47: 360 B a row
            expected += -(-stop // 4096) * 4096 - start // 4096 * 4096  # in whole pages
        expected -= store.tensors[f"blk.{layer}.ffn_down.weight"].nbytes
        expected += 24 * 12288  # the down groups 24-47: 11,520 B each in whole pages
    assert read == expected


def test_a_corrupt_gate_row_group_fails_the_read_naming_it(grouped_smollm2, tmp_path):
    from ntio.errors import ModelFormatError
    from ntio.formats.model_file import row_extent
    from ntio.formats.store import StoreFile

    bad = shutil.copy(grouped_smollm2, tmp_path / "bad.ntio")
    offset, length = row_extent(StoreFile(bad), "blk.3.ffn_gate.weight", 5 * 32, 6 * 32)
    _flip_byte(bad, offset + length // 2)
    policy = SparseFFNPolicy(NeuronSelection("predicted", 1.0), predictors={3: _FixedOrder()}, group_reads=32)
    m = ntio.load(bad, max_context=64, tiers="C", policy=policy)
    with pytest.raises(ModelFormatError, match=r"bad\.ntio: checksum mismatch in tensor 'blk\.3\.ffn_gate\.weight "
                                               r"group 5'"):
        m.generate(PROMPT, max_new_tokens=2)
    m.close()


@pytest.fixture(scope="module")
def smollm2_predictors(grouped_smollm2, tmp_path_factory):
    """`ntio calibrate --ffn-predictors` on the grouped store, on README.md: (the file, what it printed)."""
    from click.testing import CliRunner

    from ntio.cli import main as cli

    path = tmp_path_factory.mktemp("predictors") / "smollm2.cal"
    result = CliRunner().invoke(cli, ["calibrate", "-m", str(grouped_smollm2), "--corpus", str(ROOT / "README.md"),
                                      "--tokens", "1024", "--ctx", "128", "--layers", "10", "--distill-epochs", "0",
                                      "--ffn-predictors", "-o", str(path)])
    assert result.exit_code == 0, result.output
    return path, result.output


def test_calibrate_fits_predictors_that_recall_more_than_chance_on_held_out_text(smollm2_predictors):
    """Recall of the down rule's groups on the held-out 40%: a random choice keeps `keep` of them on average."""
    from ntio.decoding.self_draft import Calibration

    path, output = smollm2_predictors
    assert "sparse FFN predictors of groups of 32 neurons for 30 layers; held-out recall of the down rule's" in output
    ffn = torch.load(path, weights_only=True)["ffn"]
    assert ffn["neurons"] == 32 and sorted(map(int, ffn["layers"])) == list(range(30))
    assert ffn["recall"]["0.5"] > 0.55 and ffn["recall"]["0.3"] > 0.35
    assert Calibration.load(path, torch.load(path, weights_only=True)["model"], 576).ffn["neurons"] == 32


def test_predicted_options_name_what_is_wrong(grouped_smollm2, smollm2_predictors, tmp_path):
    from click.testing import CliRunner

    from ntio.cli import main as cli

    path, _ = smollm2_predictors
    def run(*args: str):
        return CliRunner().invoke(cli, ["generate", "-m", str(grouped_smollm2), *args, "-p", "hi", "-n", "2"])

    result = run("--sparse-ffn", "predicted")
    assert result.exit_code == 1 and result.output.count("\n") == 1
    assert ("predicted needs --ffn-predictors CALIBRATION (`ntio calibrate --ffn-predictors` writes one)"
            in result.output)
    result = run("--sparse-ffn", "down", "--ffn-predictors", str(path))
    assert result.exit_code == 1 and "--ffn-predictors needs --sparse-ffn predicted" in result.output
    payload = torch.load(path, weights_only=True)
    for change, message in [("model", "calibrated for another model"), ("ffn", "no sparse FFN predictors in it")]:
        other = dict(payload, **{change: "0" * 32 if change == "model" else None})
        torch.save(other, tmp_path / "other.cal")
        result = run("--sparse-ffn", "predicted", "--ffn-predictors", str(tmp_path / "other.cal"))
        assert result.exit_code == 1 and result.output.count("\n") == 1 and message in result.output, result.output
    result = run("--sparse-ffn", "predicted", "--ffn-predictors", str(path), "--keep", "0.7", "--tiers", "C", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)["sparse_ffn"]
    assert report["rule"] == "predicted" and report["oracle_recall"] is None
    assert report["calibrated_recall"] == pytest.approx({k: v for k, v in payload["ffn"]["recall"].items()})
