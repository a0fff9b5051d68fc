"""Errors by kind: a failed read becomes ModelFormatError (past end of file) or ModelIOError (the OS said no), both
naming file and offset; options are named by their library parameter, and the CLI shows the flag instead."""

from __future__ import annotations

import errno
import subprocess
import sys

import numpy as np
import pytest

from ntio import _core
from ntio.errors import ModelFormatError, ModelIOError, read_error
from ntio.io import read_into


def _failed_read(path, extents, backend="buffered") -> OSError:
    reader = _core.Reader(path, backend=backend)
    with pytest.raises(OSError) as e:
        read_into(reader, extents, np.empty(4096, dtype=np.uint8))
    return e.value


def test_a_read_the_os_refuses_is_an_io_error_naming_file_and_offset(tmp_path):
    # A directory opens, but the kernel refuses to read it (EISDIR): an error with an errno, as EIO would be
    # (injecting EIO itself is the hardening issue's reader hook).
    err = read_error(_failed_read(tmp_path, [(0, 100, 0)]))
    assert isinstance(err, ModelIOError) and not isinstance(err, ModelFormatError)
    assert str(err).startswith(f"{tmp_path}: read of 100 bytes at offset 0 failed") and "\n" not in str(err)


def test_a_read_past_the_end_is_a_format_error_naming_file_and_offset(tmp_path):
    path = tmp_path / "short.bin"
    path.write_bytes(b"x" * 1000)
    err = read_error(_failed_read(path, [(900, 200, 0)]))
    assert isinstance(err, ModelFormatError)
    assert str(path) in str(err) and "900" in str(err)


def test_any_oserror_gets_a_kind():
    assert isinstance(read_error(OSError(errno.EIO, "Input/output error", "m.gguf")), ModelIOError)


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "ntio.cli", *args], capture_output=True, text=True)


def test_cli_names_the_flag_for_a_library_parameter(smollm2_path):
    out = _cli("generate", "-m", str(smollm2_path), "-p", "a", "--ctx-size", "64", "--ram-budget", "1MB")
    assert out.returncode == 1
    line = out.stderr.strip()
    assert "\n" not in line and "Traceback" not in line
    assert line.startswith("ntio: error: --ram-budget 976.56 KiB is too small") and "--ctx-size" in line
    assert "max_context" not in line and "ram_budget" not in line
    out = _cli("perplexity", "-m", str(smollm2_path), "-f", __file__, "--ctx-size", "64", "--ctx", "100")
    assert out.returncode == 1 and "--ctx 100 exceeds" in out.stderr
