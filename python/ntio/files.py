"""Writing a file whole or not at all: `replacing(target)` yields a temporary file beside the target, which
becomes the target (synced, with the permissions a new file gets under the umask) only when the block ends
without an error; otherwise it is removed. An OSError becomes one line naming the target. `writable(target)`
checks beforehand what `replacing` would refuse, for commands that work minutes before they write."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from ntio.errors import NtioError


def writable(target: Path) -> Path:
    """The file that `replacing(target)` writes: `target`, or the file a symbolic link there points to (written
    through, not replaced by a file). One line naming `target` where it cannot be: something other than a regular
    file there (a directory, a device), or no directory to hold it."""
    real = Path(os.path.realpath(target))
    if real.exists() and not real.is_file():
        raise NtioError(f"cannot write {target}: it exists and is not a regular file")
    if not real.parent.is_dir():
        raise NtioError(f"cannot write {target}: no directory {real.parent}")
    return real


@contextlib.contextmanager
def replacing(target: Path) -> Iterator[BinaryIO]:
    target = writable(target)
    try:
        fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    except OSError as e:
        raise NtioError(f"cannot write {target}: {e.strerror}") from None
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, target)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        if isinstance(e, OSError):
            raise NtioError(f"cannot write {target}: {e.strerror or e}") from None
        raise
