"""Writing a file whole or not at all: `replacing(target)` yields a temporary file beside the target, which
becomes the target (synced, with the permissions a new file gets under the umask) only when the block ends
without an error; otherwise it is removed. An OSError becomes one line naming the target."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from ntio.errors import NtioError


@contextlib.contextmanager
def replacing(target: Path) -> Iterator[BinaryIO]:
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
