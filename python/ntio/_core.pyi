"""Type stubs for ntio's native module (Rust, `rust/bindings.rs`)."""

from os import PathLike
from typing import Any

__version__: str
BACKENDS: list[str]
"""Backend names, best first: "io_uring", "pread", "buffered"."""

Extent = tuple[int, int, int]
"""(file_offset, length, dest_offset), in bytes."""

class ReadError(OSError):
    """Open or read failed, or an extent reaches past end of file (never zero-filled)."""
    path: str
    offset: int | None
    length: int | None
    errno: int | None  # None for end of file

class BufferError(ValueError):
    """The destination cannot take the extents: too small, slot not acquired (or a stale handle)."""

class SlotBusyError(RuntimeError):
    """A read into the slot is in flight (release/read refused), or no slot is free."""

class BackendUnavailableError(OSError):
    """A forced backend cannot work here: io_uring blocked, or O_DIRECT refused by the filesystem."""

class Reader:
    """One open file and one I/O backend. Safe to share between threads; blocking calls release the GIL."""

    def __init__(self, path: str | PathLike[str], backend: str | None = None, queue_depth: int = 32,
                 request_size: int = 1 << 20) -> None: ...
    @property
    def backend(self) -> str: ...  # "io_uring" | "pread" | "buffered"
    @property
    def path(self) -> str: ...
    @property
    def file_size(self) -> int: ...
    @property
    def alignment(self) -> int: ...  # O_DIRECT alignment in bytes; 1 for "buffered"
    @property
    def queue_depth(self) -> int: ...
    @property
    def request_size(self) -> int: ...  # rounded up to the alignment
    def read(self, extents: list[Extent], slot: Slot) -> None: ...
    def submit(self, extents: list[Extent], slot: Slot) -> ReadHandle: ...
    def read_into_address(self, extents: list[Extent], address: int, nbytes: int) -> None: ...
    def submit_into_address(self, extents: list[Extent], address: int, nbytes: int,
                            owner: Any = None) -> ReadHandle: ...

class ReadHandle:
    """A submitted batch. Dropping it waits for its I/O before releasing `owner`."""

    def poll(self) -> bool: ...
    def wait(self) -> None: ...
    @property
    def owner(self) -> Any: ...

class StagingPool:
    """`n_slots` slots of `slot_size` bytes (rounded up to 4096), 4096-aligned, owned by Rust."""

    def __init__(self, n_slots: int, slot_size: int) -> None: ...
    def acquire(self, timeout: float | None = 0.0) -> Slot:
        """A free slot; SlotBusyError if none frees up within `timeout` s (0: don't wait; None: wait forever)."""
    def release(self, slot: Slot) -> None: ...
    @property
    def n_slots(self) -> int: ...
    @property
    def slot_size(self) -> int: ...
    @property
    def free_count(self) -> int: ...
    def __len__(self) -> int: ...

class Slot:
    """An acquired slot; released by `release()` or when the last reference goes (after any read into it)."""

    @property
    def address(self) -> int: ...
    @property
    def size(self) -> int: ...
    @property
    def index(self) -> int: ...
    @property
    def acquired(self) -> bool: ...
    @property
    def in_flight(self) -> bool: ...
    def release(self) -> None: ...
