"""The native reader (`ntio._core`) and its facade (`ntio.io`), against plain Python reads of the same file.

Every backend is checked byte for byte: io_uring and pread need a filesystem that takes O_DIRECT (pytest's
tmp_path; the test skips where it does not), io_uring also needs the kernel to allow rings (skipped where blocked).
"""

from __future__ import annotations

import errno
import gc
import os
import random
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from ntio import _core
from ntio.io import HostArena, open_reader, read_into, slot_array, submit_into

BACKENDS = ["io_uring", "pread", "buffered"]
FILE_SIZE = 3 * (1 << 20) + 12345  # not a multiple of any block size


def _random_bytes(n: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


@pytest.fixture(scope="module")
def data_file(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, bytes]:
    path = tmp_path_factory.mktemp("reader") / "model.bin"
    data = _random_bytes(FILE_SIZE, seed=1)
    path.write_bytes(data)
    return path, data


def _open(path: Path, backend: str, **options: int) -> _core.Reader:
    """A reader forced onto `backend`, or a skip where this machine or filesystem cannot run it."""
    try:
        return _core.Reader(path, backend=backend, **options)
    except _core.BackendUnavailableError as err:
        pytest.skip(str(err))


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return request.param


def _random_extents(rng: random.Random, file_size: int, dest_size: int, n: int) -> list[tuple[int, int, int]]:
    """Non-overlapping destination ranges, unaligned offsets and lengths, some empty, some ending at EOF."""
    extents, dest = [], 0
    for i in range(n):
        length = rng.choice([0, 1, 7, 511, 4096, 4097, 65536, rng.randrange(1, 300_000)])
        if dest + length > dest_size:
            break
        offset = file_size - length if i % 5 == 0 else rng.randrange(0, file_size - length + 1)
        extents.append((offset, length, dest))
        dest += length + rng.choice([0, 0, 1, 4096, 13])
    return extents


def _check(view: bytes | memoryview | np.ndarray, extents: list[tuple[int, int, int]], data: bytes) -> None:
    view = bytes(view)
    for offset, length, dest in extents:
        assert view[dest:dest + length] == data[offset:offset + length], (offset, length, dest)


@pytest.mark.parametrize("request_size", [1 << 20, 12288])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_backends_match_python_reads(data_file, backend, request_size, seed):
    path, data = data_file
    reader = _open(path, backend, request_size=request_size, queue_depth=8)
    assert reader.backend == backend and reader.file_size == len(data) and reader.path == str(path)
    assert reader.request_size % reader.alignment == 0
    pool = _core.StagingPool(1, 4 << 20)
    rng = random.Random(seed)

    slot = pool.acquire()
    extents = _random_extents(rng, len(data), slot.size, 40)
    reader.read(extents, slot)
    _check(slot_array(slot), extents, data)

    array = np.zeros(4 << 20, dtype=np.uint8)
    extents = _random_extents(rng, len(data), array.nbytes, 40)
    read_into(reader, extents, array)
    _check(array, extents, data)


def test_whole_file_and_exact_eof(data_file, backend):
    path, data = data_file
    reader = _open(path, backend, request_size=65536)
    pool = _core.StagingPool(1, len(data))
    slot = pool.acquire()
    reader.read([(0, len(data), 0)], slot)
    assert bytes(slot_array(slot)[:len(data)]) == data
    tail = np.zeros(10, dtype=np.uint8)
    read_into(reader, [(len(data) - 10, 10, 0), (len(data), 0, 0)], tail)
    assert tail.tobytes() == data[-10:]


def test_many_small_extents(data_file, backend):
    path, data = data_file
    reader = _open(path, backend)
    rng = random.Random(5)
    extents, dest = [], 0
    for _ in range(3000):
        length = rng.randrange(0, 64)
        extents.append((rng.randrange(0, len(data) - length), length, dest))
        dest += length
    array = np.zeros(dest, dtype=np.uint8)
    read_into(reader, extents, array)
    _check(array, extents, data)


def test_adjacent_extents_coalesce_to_the_same_bytes(data_file, backend):
    path, data = data_file
    reader = _open(path, backend, request_size=8192)
    pieces = [(i * 1000 + 3, 1000, i * 1000) for i in range(200)]
    array = np.zeros(200_000, dtype=np.uint8)
    read_into(reader, list(reversed(pieces)), array)
    assert array.tobytes() == data[3:200_003]


def test_past_eof_is_an_error_never_zero_filled(data_file, backend):
    path, data = data_file
    reader = _open(path, backend)
    slot = _core.StagingPool(1, 1 << 20).acquire()
    with pytest.raises(_core.ReadError) as info:
        reader.read([(len(data) - 100, 101, 0)], slot)
    err = info.value
    assert (err.path, err.offset, err.length, err.errno) == (str(path), len(data) - 100, 101, None)
    assert str(err) == f"{path}: read of 101 bytes at offset {len(data) - 100} hit end of file at {len(data)}"
    with pytest.raises(_core.ReadError):
        reader.submit([(len(data), 1, 0)], slot)
    assert not slot.in_flight
    slot.release()


def test_file_shrinking_under_the_reader_surfaces_at_wait(tmp_path, backend):
    path = tmp_path / "shrinks.bin"
    path.write_bytes(_random_bytes(1 << 20, seed=3))
    reader = _open(path, backend)
    os.truncate(path, 50_000)
    array = np.zeros(1 << 20, dtype=np.uint8)
    handle = submit_into(reader, [(0, 1 << 20, 0)], array)
    with pytest.raises(_core.ReadError, match="hit end of file at"):
        handle.wait()
    assert handle.poll()


def test_destination_too_small(data_file, backend):
    path, _ = data_file
    reader = _open(path, backend)
    with pytest.raises(_core.BufferError, match="too small for extent 1"):
        read_into(reader, [(0, 10, 0), (0, 10, 95)], np.zeros(100, dtype=np.uint8))


def test_unaligned_external_memory_goes_through_a_bounce_buffer(data_file, backend):
    path, data = data_file
    reader = _open(path, backend, request_size=16384)
    backing = np.zeros(300_001, dtype=np.uint8)
    array = backing[1:]  # address is 1 mod 4096
    extents = [(0, 100_000, 0), (8192, 70_000, 100_000), (4095, 100_000, 170_000)]
    read_into(reader, extents, array)
    _check(array, extents, data)


def test_submit_poll_wait(data_file, backend):
    path, data = data_file
    reader = _open(path, backend, request_size=8192, queue_depth=2)
    pool = _core.StagingPool(2, 2 << 20)
    slots = [pool.acquire(), pool.acquire()]
    handles = [reader.submit([(i * 1000, 2 << 20, 0)], slot) for i, slot in enumerate(slots)]
    for handle in handles:
        handle.wait()
        assert handle.poll()
        handle.wait()  # waiting again returns the same outcome
    for i, slot in enumerate(slots):
        assert bytes(slot_array(slot)) == data[i * 1000:i * 1000 + (2 << 20)]
        slot.release()


def test_slot_lifetime(data_file, backend):
    path, data = data_file
    # Small O_DIRECT requests one at a time: the read below stays in flight for a while.
    reader = _open(path, backend, request_size=4096, queue_depth=1)
    pool = _core.StagingPool(1, 3 << 20)
    slot = pool.acquire()
    handle = reader.submit([(0, 3 << 20, 0)], slot)
    try:
        slot.release()
    except _core.SlotBusyError as err:
        assert "in flight" in str(err)
        try:
            reader.read([(0, 1, 0)], slot)
        except _core.SlotBusyError:
            pass
        else:  # the read ended between the two calls (a page-cache read is quick): a new read is then legitimate
            assert handle.poll()
    else:  # the read ended before release() ran; a release is then legitimate
        assert handle.poll()
    handle.wait()
    assert not slot.in_flight
    if slot.acquired:
        reader.read([(5, 10, 0)], slot)  # reuse after wait
        assert bytes(slot_array(slot)[:10]) == data[5:15]
        pool.release(slot)
    with pytest.raises(_core.BufferError, match="not acquired"):
        slot.release()
    with pytest.raises(_core.BufferError, match="not acquired"):
        reader.read([(0, 1, 0)], slot)


def test_pool_acquire_release_and_views():
    pool = _core.StagingPool(2, 5000)
    assert (pool.n_slots, pool.slot_size, len(pool)) == (2, 8192, 2)
    a, b = pool.acquire(), pool.acquire()
    assert a.address % 4096 == 0 and b.address % 4096 == 0 and {a.index, b.index} == {0, 1}
    with pytest.raises(_core.SlotBusyError, match="no free staging slot"):
        pool.acquire()
    with pytest.raises(_core.SlotBusyError):
        pool.acquire(timeout=0.05)
    view = slot_array(a)
    assert view.dtype == np.uint8 and view.shape == (8192,) and view.ctypes.data == a.address
    view[:4] = [1, 2, 3, 4]
    assert bytes(slot_array(a)[:4]) == b"\x01\x02\x03\x04"
    del a
    gc.collect()
    assert pool.free_count == 0  # the view keeps the slot
    del view
    gc.collect()
    assert pool.free_count == 1

    threading.Timer(0.05, b.release).start()
    c = pool.acquire(timeout=None)  # blocks until the timer releases b
    assert pool.free_count == 0
    other = _core.StagingPool(1, 4096)
    with pytest.raises(_core.BufferError, match="another pool"):
        other.release(c)


def test_host_arena_hands_out_aligned_pieces_that_keep_it_alive(data_file):
    arena = HostArena([10, _core.HUGE_PAGE, _core.HUGE_PAGE])  # a mapping of its own, at a huge page
    first, second = arena.take(10), arena.take(_core.HUGE_PAGE)
    assert first.ctypes.data % _core.HUGE_PAGE == 0 and second.ctypes.data == first.ctypes.data + 4096
    assert first.dtype == np.uint8 and second.shape == (_core.HUGE_PAGE,) and not second.any()
    with pytest.raises(ValueError, match=r"host arena of 4198400 bytes: 4194304 more at 2101248 do not fit"):
        arena.take(2 * _core.HUGE_PAGE)
    last = arena.take(_core.HUGE_PAGE)  # what is left still fits
    assert last.ctypes.data == second.ctypes.data + _core.HUGE_PAGE
    del arena
    gc.collect()
    path, data = data_file
    read_into(open_reader(path), [(0, 4096, 0)], last)  # the pieces outlive the arena object: a read lands in them
    assert bytes(last[:4096]) == data[:4096]


def test_concurrent_readers_from_python_threads(data_file, backend):
    path, data = data_file
    reader = _open(path, backend, request_size=65536, queue_depth=4)
    pool = _core.StagingPool(4, 1 << 20)

    def work(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(10):
            slot = pool.acquire(timeout=None)
            extents = _random_extents(rng, len(data), slot.size, 8)
            if seed % 2:
                reader.read(extents, slot)
            else:
                reader.submit(extents, slot).wait()
            _check(slot_array(slot), extents, data)
            slot.release()

    with ThreadPoolExecutor(6) as pool_executor:
        list(pool_executor.map(work, range(12)))
    assert pool.free_count == 4


def test_read_into_torch_tensors(data_file, backend):
    torch = pytest.importorskip("torch")
    path, data = data_file
    reader = _open(path, backend)
    tensor = torch.zeros(100_000, dtype=torch.uint8)
    read_into(reader, [(1, 100_000, 0)], tensor)
    assert tensor.numpy().tobytes() == data[1:100_001]
    floats = torch.zeros(4096, dtype=torch.float32)  # extents are in bytes
    handle = submit_into(reader, [(0, 4096 * 4, 0)], floats)
    assert handle.owner is floats
    handle.wait()
    assert floats.numpy().tobytes() == data[:4096 * 4]
    assert torch.equal(torch.from_numpy(slot_array(_core.StagingPool(1, 4096).acquire())), torch.zeros(4096, dtype=torch.uint8))
    with pytest.raises(_core.BufferError, match="dest must be C-contiguous"):
        read_into(reader, [(0, 1, 0)], torch.zeros(8, 8, dtype=torch.uint8).t())
    halves = torch.zeros(8, dtype=torch.bfloat16)  # no numpy dtype: read as its bytes
    read_into(reader, [(5, 16, 0)], halves)
    assert halves.view(torch.uint8).numpy().tobytes() == data[5:21]
    with pytest.raises(_core.BufferError, match="dest must be C-contiguous"):
        read_into(reader, [(0, 1, 0)], torch.zeros(4, 4, dtype=torch.bfloat16).t())


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="pinned memory needs CUDA")
def test_read_into_pinned_tensor(data_file, backend):
    import torch

    path, data = data_file
    reader = _open(path, backend)
    pinned = torch.empty(1 << 20, dtype=torch.uint8, pin_memory=True)
    submit_into(reader, [(0, 1 << 20, 0)], pinned).wait()
    assert pinned.numpy().tobytes() == data[:1 << 20]
    assert torch.equal(pinned.cuda().cpu(), pinned)


def test_dropping_a_handle_waits_for_its_io(data_file, backend):
    path, data = data_file
    reader = _open(path, backend, request_size=4096, queue_depth=1)
    array = np.zeros(2 << 20, dtype=np.uint8)
    submit_into(reader, [(0, 2 << 20, 0)], array)  # handle dropped at once: must wait, not free mid-read
    gc.collect()
    assert array.tobytes() == data[:2 << 20]


def test_wrong_destinations_are_refused_before_any_read():
    """The destination crosses into Rust as a buffer, not an address: Rust refuses a strided or read-only one, or
    one too small for the extents, naming it; any element type is fine (extents are in bytes)."""
    data = Path(__file__).read_bytes()
    reader = _core.Reader(Path(__file__), backend="buffered")
    reads = [lambda dest: read_into(reader, [(0, 1, 0)], dest), lambda dest: submit_into(reader, [(0, 1, 0)], dest),
             lambda dest: reader.read_into([(0, 1, 0)], dest), lambda dest: reader.submit_into([(0, 1, 0)], dest)]
    read_only = np.zeros(16, dtype=np.uint8)
    read_only.flags.writeable = False
    for read in reads:
        with pytest.raises(_core.BufferError, match="dest must be C-contiguous"):
            read(np.zeros((4, 4), dtype=np.uint8).T)
        for dest in (read_only, b"0123456789abcdef", memoryview(bytearray(16)).toreadonly()):
            with pytest.raises(_core.BufferError, match="dest is read-only"):
                read(dest)
    assert not read_only.any()
    with pytest.raises(_core.BufferError, match="destination of 15 bytes is too small for extent 0"):
        read_into(reader, [(0, 16, 0)], np.zeros(15, dtype=np.uint8))
    with pytest.raises(_core.BufferError, match="destination of 15 bytes is too small"):
        submit_into(reader, [(0, 16, 0)], bytearray(15))
    with pytest.raises(TypeError, match="dest must support the buffer protocol"):
        read_into(reader, [(0, 1, 0)], [0] * 16)
    # Other buffer-protocol objects and element types are just bytes.
    buffer = bytearray(16)
    read_into(reader, [(0, 16, 0)], buffer)
    floats = np.zeros((2, 2), dtype=np.float32)
    read_into(reader, [(3, 16, 0)], floats)
    assert bytes(buffer) == data[:16] and floats.tobytes() == data[3:19]


def test_a_submitted_read_holds_its_destination_buffer(data_file):
    path, data = data_file
    reader = _core.Reader(path, backend="buffered")
    buffer = bytearray(4096)
    handle = reader.submit_into([(0, 4096, 0)], buffer)
    assert handle.owner is buffer  # no owner given: the exporting object
    with pytest.raises(BufferError):  # Python's own: a bytearray with a live export cannot be resized
        buffer.extend(b"x")
    handle.wait()
    with pytest.raises(BufferError):  # until the handle goes, not merely until the read ends
        buffer.extend(b"x")
    del handle
    gc.collect()
    buffer.extend(b"x")
    assert bytes(buffer[:4096]) == data[:4096]


def test_env_var_forces_backend_and_option_wins(data_file, monkeypatch):
    path, _ = data_file
    monkeypatch.setenv("NTIO_IO_BACKEND", "buffered")
    assert _core.Reader(path).backend == "buffered"
    assert _core.Reader(path).alignment == 1
    assert _open(path, "pread").backend == "pread"
    monkeypatch.setenv("NTIO_IO_BACKEND", "nonsense")
    with pytest.raises(ValueError, match="unknown I/O backend"):
        _core.Reader(path)
    monkeypatch.delenv("NTIO_IO_BACKEND")
    assert _core.Reader(path).backend in ("io_uring", "pread")  # disk-backed tmp_path takes O_DIRECT


def _refuses_o_direct(path: Path) -> bool:
    try:
        os.close(os.open(path, os.O_RDONLY | os.O_DIRECT))
    except OSError as err:
        return err.errno == errno.EINVAL
    return False


def test_probe_falls_back_to_buffered_where_o_direct_is_refused():
    # tmpfs refuses O_DIRECT on older kernels (6.6+ accept it); procfs always does.
    shm = Path("/dev/shm") / f"ntio-test-{os.getpid()}.bin"
    if shm.parent.is_dir():
        shm.write_bytes(b"x" * 10_000)
    try:
        candidates = (shm, Path("/proc/self/status"))
        path = next((p for p in candidates if p.exists() and _refuses_o_direct(p)), None)
        if path is None:
            pytest.skip("no filesystem here refuses O_DIRECT")
        reader = open_reader(path)
        assert (reader.backend, reader.alignment) == ("buffered", 1)
        if path == shm:
            array = np.zeros(3, dtype=np.uint8)
            read_into(reader, [(9_997, 3, 0)], array)
            assert array.tobytes() == b"xxx"
        for forced in ("io_uring", "pread"):
            with pytest.raises(_core.BackendUnavailableError, match="refuses O_DIRECT"):
                _core.Reader(path, backend=forced)
    finally:
        shm.unlink(missing_ok=True)


def test_open_errors_and_bad_options(tmp_path):
    with pytest.raises(_core.ReadError) as info:
        _core.Reader(tmp_path / "missing.gguf")
    assert info.value.errno == 2 and info.value.path.endswith("missing.gguf")
    assert isinstance(info.value, OSError) and "cannot open" in str(info.value)
    path = tmp_path / "small.bin"
    path.write_bytes(b"abc")
    with pytest.raises(ValueError, match="queue_depth"):
        _core.Reader(path, queue_depth=0)
    with pytest.raises(ValueError, match="unknown I/O backend"):
        _core.Reader(path, backend="mmap")
    with pytest.raises(ValueError):
        _core.StagingPool(0, 4096)
