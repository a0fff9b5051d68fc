"""Corrupt bytes never become tokens: a store's tensors are checked against their checksums whenever they are read
(resident once, streamed at every read), and a failing disk (EIO, short reads: injected in the Rust reader) is one
line naming file and offset. The real SmolLM2 model, converted to a store; the bad bytes are the probe's targets
(a norm's exponent, a Q4_1 block scale)."""

from __future__ import annotations

import shutil

import pytest

import ntio
from ntio.errors import ModelFormatError, ModelIOError, NtioError
from ntio.formats.store import StoreFile, convert
from tests.test_cli import assert_user_error, ntio as run_cli

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def smollm2_store(smollm2_path, tmp_path_factory):
    return convert(smollm2_path, tmp_path_factory.mktemp("store") / "smollm2.ntio")


def corrupt(store, tmp_path, tensor: str, at: int, xor: int):
    """A copy of `store` with byte `at` of `tensor` XORed with `xor`; returns (path, the tensor's file offset)."""
    bad = shutil.copy(store, tmp_path / "bad.ntio")
    offset = StoreFile(bad).tensor(tensor).offset
    with open(bad, "r+b") as f:
        f.seek(offset + at)
        byte = f.read(1)[0]
        f.seek(offset + at)
        f.write(bytes([byte ^ xor]))
    return bad, offset


def pieces_until_error(m, n: int = 8) -> tuple[list[str], Exception | None]:
    got = []
    try:
        for piece in m.stream(PROMPT, n):
            got.append(piece)
    except ModelFormatError as e:
        return got, e
    return got, None


@pytest.mark.parametrize("tiers", ["C", "A"])
def test_a_flipped_norm_exponent_is_caught_before_any_token(smollm2_store, tmp_path, tiers):
    # Byte 3 of the first float32 of the norm: its exponent (the probe's flip gave token 0 and empty text).
    bad, offset = corrupt(smollm2_store, tmp_path, "blk.7.ffn_norm.weight", 3, 0x40)
    message = rf"bad\.ntio: checksum mismatch in tensor 'blk\.7\.ffn_norm\.weight' \(extent at offset {offset}, "
    if tiers == "A":  # resident: checked once, when it is read at load
        with pytest.raises(ModelFormatError, match=message):
            ntio.load(bad, tiers="A")
        return
    m = ntio.load(bad, tiers="C")
    got, err = pieces_until_error(m)
    assert got == [] and err is not None and err.args[0].startswith(str(bad.parent))
    assert "\n" not in str(err)
    with pytest.raises(ModelFormatError, match=message):  # and again on the next attempt: nothing is cached
        m.generate(PROMPT, 2)


def test_bad_bytes_computed_on_while_hashed_never_reach_a_token(smollm2_store, tmp_path):
    # A streamed group is computed on as soon as it lands, while it is hashed. The last layer's check is the last
    # one a forward waits for (no later read into its slot settles it first): its failure must still come before
    # the forward returns logits, so before any token.
    last = ntio.load(smollm2_store, tiers="A").config.n_layers - 1
    bad, offset = corrupt(smollm2_store, tmp_path, f"blk.{last}.ffn_down.weight", 1, 0x04)
    m = ntio.load(bad, tiers="C")
    got, err = pieces_until_error(m)
    assert got == [] and err is not None, got
    assert f"checksum mismatch in tensor 'blk.{last}.ffn_down.weight' (extent at offset {offset}, " in str(err)


def test_a_flipped_quant_scale_fails_the_cli_with_one_line_and_no_text(smollm2_store, tmp_path):
    # The first fp16 scale of a Q4_1 block of ffn_up (the probe's flip changed the answer, exit 0).
    bad, _ = corrupt(smollm2_store, tmp_path, "blk.12.ffn_up.weight", 1, 0x04)
    out = run_cli("generate", "-m", str(bad), "--tiers", "C", "-p", PROMPT, "-n", "4")
    assert_user_error(out, "bad.ntio", "checksum mismatch in tensor 'blk.12.ffn_up.weight'")
    assert out.stdout == ""
    # Verification off is the user's explicit choice: the corrupt model then runs.
    out = run_cli("generate", "-m", str(bad), "--tiers", "C", "-p", PROMPT, "-n", "4", "--no-verify")
    assert out.returncode == 0, out.stderr


def test_a_store_overwritten_while_streaming_stops_the_stream(smollm2_store, tmp_path):
    # The probe: 20 MB of layer data zeroed while `generate --tiers C -n 200` ran gave 200 tokens and exit 0.
    path = shutil.copy(smollm2_store, tmp_path / "live.ntio")
    m = ntio.load(path, tiers="C")
    first_layer = StoreFile(path).tensor("blk.0.attn_norm.weight").offset
    stream = iter(m.stream(PROMPT, 200))
    next(stream)
    with open(path, "r+b") as f:
        f.seek(first_layer)
        f.write(bytes(20 << 20))
    with pytest.raises(ModelFormatError, match=r"live\.ntio: checksum mismatch in tensor 'blk\.\d+\."):
        for _ in stream:
            pass


def test_a_gguf_records_no_checksums_and_still_streams(smollm2_path):
    m = ntio.load(smollm2_path, tiers="C")
    assert m.generate(PROMPT, 3).n_generated_tokens == 3


def test_injected_eio_is_one_line_naming_file_and_offset(smollm2_path, monkeypatch):
    down = ntio.load(smollm2_path, tiers="A").file.tensor("blk.3.ffn_down.weight")
    at = down.offset + 1000
    monkeypatch.setenv("NTIO_INJECT_FAULTS", f"eio@{at}")
    with pytest.raises(ModelIOError, match=r"read of \d+ bytes at offset \d+ failed: Input/output error") as e:
        ntio.load(smollm2_path, tiers="A")
    assert str(e.value).startswith(str(smollm2_path))
    m = ntio.load(smollm2_path, tiers="C")
    got = []
    with pytest.raises(ModelIOError) as e:
        for piece in m.stream(PROMPT, 4):
            got.append(piece)
    assert got == []
    offset = int(str(e.value).split(" at offset ")[1].split()[0])
    assert offset <= at < offset + (1 << 20)  # the failed request covers the injected byte
    out = run_cli("generate", "-m", str(smollm2_path), "--tiers", "C", "-p", PROMPT, "-n", "4",
                  env={"NTIO_INJECT_FAULTS": f"eio@{at}"})
    assert_user_error(out, str(smollm2_path), "Input/output error", "at offset")
    assert out.stdout == ""


def test_injected_short_reads_change_nothing(smollm2_store, monkeypatch):
    want = ntio.load(smollm2_store, tiers="C").generate(PROMPT, 6).token_ids
    monkeypatch.setenv("NTIO_INJECT_FAULTS", "short")
    for tiers in ("C", "A"):
        assert ntio.load(smollm2_store, tiers=tiers).generate(PROMPT, 6).token_ids == want


def test_a_bad_fault_spec_names_the_variable(smollm2_path, monkeypatch):
    monkeypatch.setenv("NTIO_INJECT_FAULTS", "eio@soon")
    with pytest.raises(NtioError, match=r"NTIO_INJECT_FAULTS=\"eio@soon\""):  # one line, not a traceback
        ntio.load(smollm2_path, tiers="C")
