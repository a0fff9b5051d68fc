"""Type stubs for ntio's native module (Rust; `rust/lib.rs` registers every `rust/*_bindings.rs`)."""

from os import PathLike
from typing import Any

from typing_extensions import Buffer  # collections.abc.Buffer from Python 3.12

__version__: str
BACKENDS: list[str]
HUGE_PAGE: int  # staging pools of at least this many bytes are mapped in whole huge pages
"""Backend names, best first: "io_uring", "pread", "buffered"."""

Extent = tuple[int, int, int]
"""(file_offset, length, dest_offset), in bytes."""

Check = tuple[str, int, int, int, int]
"""(tensor, file_offset, dest_offset, length, xxh3-64): after a batch's bytes land, its reader's I/O side hashes
destination bytes [dest_offset, dest_offset + length) and fails the batch (ReadError naming tensor and offset, errno
None) if they differ. A check must lie in bytes the batch's extents write."""

class ReadError(OSError):
    """Open or read failed, or an extent reaches past end of file (never zero-filled)."""
    path: str
    offset: int | None
    length: int | None
    errno: int | None  # None for end of file

class BufferError(ValueError):
    """A buffer cannot be used (the message names the argument): wrong element type, not C-contiguous, read-only
    where written, misaligned, wrong size, overlapping another argument; or a read destination too small for the
    extents, a slot not acquired (or a stale handle)."""

class SlotBusyError(RuntimeError):
    """A read into the slot is in flight (release/read refused), or no slot is free."""

class BackendUnavailableError(OSError):
    """A forced backend cannot work here: io_uring blocked, or O_DIRECT refused by the filesystem."""

class Reader:
    """One open file (or several in one offset space) and one I/O backend. Safe to share between threads; blocking
    calls release the GIL."""

    def __init__(self, path: str | PathLike[str] | list[tuple[str | PathLike[str], int]], backend: str | None = None,
                 queue_depth: int = 32, request_size: int = 1 << 20, faults: str | None = None) -> None:
        """path: one file, or `[(path, base), ...]`: files in one offset space (a checkpoint's shards; the first at
        base 0, each next base a multiple of 4096 at or past the end of the one before), an extent inside one of them.
        faults: fault injection for tests, e.g. "eio@1048576,short" (default: env NTIO_INJECT_FAULTS)."""
    @property
    def backend(self) -> str: ...  # "io_uring" | "pread" | "buffered"
    @property
    def path(self) -> str: ...  # the (first) file's
    @property
    def file_size(self) -> int: ...  # the end of the (last) file in the offset space
    @property
    def alignment(self) -> int: ...  # O_DIRECT alignment in bytes; 1 for "buffered"
    @property
    def queue_depth(self) -> int: ...
    @property
    def request_size(self) -> int: ...  # rounded up to the alignment
    def read(self, extents: list[Extent], slot: Slot, checks: list[Check] | None = None) -> None: ...
    def submit(self, extents: list[Extent], slot: Slot, checks: list[Check] | None = None) -> ReadHandle: ...
    def read_into(self, extents: list[Extent], dest: Buffer, checks: list[Check] | None = None) -> None:
        """Read into `dest`, a writable C-contiguous buffer of any element type (extents are in bytes), and wait."""
    def submit_into(self, extents: list[Extent], dest: Buffer, owner: Any = None,
                    checks: list[Check] | None = None) -> ReadHandle:
        """Start reading into `dest`; the handle holds its buffer until the read has ended and the handle is gone.
        `owner` is what `handle.owner` reports (default: the object `dest` exports from)."""

class ReadHandle:
    """A submitted batch. Dropping it waits for its I/O before releasing the destination's buffer."""

    def poll(self) -> bool: ...  # True once the batch has ended
    def wait(self) -> None: ...  # until the batch ends: raises its I/O error or failed check
    def wait_landed(self) -> None:
        """Until its bytes land (raises an I/O error); checks may still run: show nothing computed from the bytes
        before `wait` returns."""
    @property
    def elapsed(self) -> float | None: ...  # seconds from submit to its last byte landing (queued time included); None while in flight
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
    def address(self) -> int: ...  # of the Rust-owned slot memory (for numpy views, cudaHostRegister)
    @property
    def size(self) -> int: ...
    @property
    def index(self) -> int: ...
    @property
    def acquired(self) -> bool: ...
    @property
    def in_flight(self) -> bool: ...
    def release(self) -> None: ...

# CPU kernels (rust/kernel_bindings.rs); use them through ntio.kernels.cpu_kernels.
KERNEL_TYPES: list[int]
"""ggml type ids `quantized_matmul` supports."""
INTERLEAVED_TYPES: dict[int, int]
"""ggml type id -> the id of its interleaved layout (`interleave`), which `quantized_matmul` takes."""
RESIDENT_INTERLEAVED_TYPES: list[int]
"""ggml type ids whose resident matrices take their interleaved layout on this CPU where its interleaved kernels run
(`interleaved_kernels`, `ops.interleave_rows`)."""
KERNEL_MAX_T: int
"""Activation rows the kernels take at once (longer inputs run in blocks of this many)."""
KERNEL_SPANS: dict[int, int]  # ggml type id -> elements per activation scale of its integer kernels
"""Elements per activation scale for the K-quants (the 32-element types take 32)."""

Matrix = tuple[Buffer, int, int, float]  # (raw, ggml type id, n, scale)
# A decoder block's weights: (attn_norm, qkv, qkv_bias, wo, ffn_norm, gate_up, down, attn_sub_norm, ffn_sub_norm).
Layer = tuple[Buffer, list[Matrix], Buffer | None, Matrix, Buffer, list[Matrix], Matrix, Buffer | None, Buffer | None]

def quantized_matmul(x: Buffer, t: int, k: int, matrices: list[Matrix], out: Buffer, *, isa: str = "best",
                     int8: bool = True, norm: Buffer | None = None, eps: float = 0.0, gate: str | None = None) -> None:
    """out [t, Σn] = prologue(x) [t, k] @ [W1; W2; ...].T, each matrix given as (raw, ggml type id, n, scale): W
    [n, k] GGUF-encoded in raw, its products times scale (GIL released).

    x: t * k float32 (t * 2k with gate); raw: uint8, exactly W's encoded size; out: t * Σn float32, writable,
    sharing no memory with x or any raw; norm: k float32; all C-contiguous buffers (numpy arrays; torch tensors via
    `.numpy()`). Prologue, in this order: gate (`silu` or `relu2`: x rows are [gate | up] -> act(gate) * up), then
    norm (RMSNorm of each row with eps); either may be absent. BufferError (a ValueError) naming the argument for a
    wrong element type, layout, writability or overlap; ValueError for an unsupported type or gate, sizes that do
    not match, or a kernel set this CPU lacks. isa: `best`, `amx`, `avx512`, `avxvnni`, `avx2`, `neon` or `scalar`;
    int8: activations of quantized types quantized to 8 bits (Q8_0 spans of 32; spans of 128 for the 256-element
    types) with integer products, else float32.
    """
def column_groups_matmul(x: Buffer, t: int, k: int, width: int, groups: list[tuple[int, Buffer]], qtype: int, n: int,
                         out: Buffer, *, isa: str = "best", int8: bool = True) -> None:
    """out [t, n] = sum_j x[:, first_j:first_j + width] @ G_j.T over groups (first_j, raw_j) of a matrix [n, k], each
    the encoding of its [n, width] columns (GIL released). Buffers and errors as in quantized_matmul."""
def decoder_stack(h: Buffer, d: int, layers: list[Layer],
                  sequences: list[tuple[Buffer, Buffer, int, int, Buffer, Buffer, Buffer | None, int]], *,
                  eps: float, n_heads: int, n_kv_heads: int, head_dim: int, rope_dim: int, neox: bool,
                  gate: str = "silu", isa: str = "best", int8: bool = True, gate_up: Buffer | None = None,
                  attention_only: bool = False, kv_dtype: str = "float32") -> None:
    """A stack of pre-norm decoder blocks over T new tokens of one or several sequences, h [T, D] float32 updated in
    place block after block (GIL released, no return to Python between blocks), each block
    h += Wo attn_sub_norm(attention(rope(Wqkv rms_norm(h) + qkv_bias))), then
    h += Wdown ffn_sub_norm(act(Wgate x) * (Wup x)), x = rms_norm(h), the sub-norms only where given (BitNet's) and
    act named by gate (`silu`, `relu2`). layers: one `Layer` per block, matrices as in `quantized_matmul`.
    sequences: (cache_k, cache_v, capacity, start, cos, sin, mask, rows) each, in row order: the next `rows` rows of
    h attend over that cache, with that rotation, mask and kv_dtype, as in `attend`; their rows add up to T; each cache
    [L, Hkv, capacity, hd] holds every block's, block i's the i-th (one block: [Hkv, capacity, hd]). Every product
    runs once over all T rows, each row's arithmetic that of a call of its own. h and the caches share no memory
    with each other or any other buffer; refusals name the buffer. With gate_up (float32 [T, 2F]) the last block
    stops after its FFN's gate/up products, written there; with attention_only, after its attention (its FFN
    matrices are not read)."""
def check_kernel_isa(name: str) -> None:
    """ValueError unless kernel set `name` (`best`, `amx`, `avx512`, `avxvnni`, `avx2`, `neon`, `scalar`) exists and
    this CPU runs it."""
def attend(qkv: Buffer, cache_k: Buffer, cache_v: Buffer, capacity: int, start: int, cos: Buffer, sin: Buffer,
           mask: Buffer | None, out: Buffer, *, n_heads: int, n_kv_heads: int, head_dim: int, rope_dim: int,
           neox: bool, kv_dtype: str = "float32") -> None:
    """Attention of T new tokens over one layer's KV cache (GIL released): RoPE on qkv's queries and keys
    [T, (Hq + 2 Hkv) hd] in place (cos, sin [T, rope_dim/2]; pairs (2i, 2i+1), or (i, i + rope_dim/2) if neox),
    keys and values written at positions start.. of cache_k, cache_v [Hkv, capacity, hd], then out [T, Hq hd] =
    softmax(q k^T / sqrt(hd)) v over the start + T cached positions (mask [T, start + T] uint8, nonzero: may
    attend; None: all). The caches hold kv_dtype: float32, float16, or bfloat16 as its int16 bits (numpy has no
    bfloat16); keys and values are rounded to it (to nearest, ties to even) and the arithmetic is float32. qkv, the
    caches and out must share no memory; refusals name the buffer."""
def dequantize(raw: Buffer, qtype: int, k: int, out: Buffer) -> None:
    """Rows of k elements of ggml type `qtype` encoded back to back in raw (uint8) -> out [rows, k] float32, the
    values gguf-py's dequantizer gives, bit for bit (GIL released). A size that is not whole rows, or an interleaved
    layout's id, is a ValueError."""
def interleave(raw: Buffer, qtype: int, n: int, k: int, *, inverse: bool = False) -> int:
    """Rewrites n rows of k elements of ggml type `qtype` (raw: uint8, writable) in place into the type's interleaved
    layout (rows in groups of 8, word w of row r at byte 4 (8w + r) of each block of the group) and returns that
    layout's id (for `quantized_matmul`); with `inverse`, qtype is the layout's id and the rows go back (the plain id is returned). A type
    without the layout, n not a multiple of 8, k not whole blocks or a wrong size is a ValueError."""
def vectorized_kernels(name: str) -> bool:
    """Whether kernel set `name`'s 8-bit kernels are vector code on this CPU (AVX2, AVX-512, NEON), not the scalar
    fallback; a ValueError as `check_kernel_isa`."""
def interleaved_kernels(isa: str = "best", int8: bool = True) -> bool:
    """Whether interleaved rows have kernels of their own under that kernel set (else each group is restored to rows
    at every product, slower than plain rows)."""
def set_kernel_threads(n: int) -> None:
    """Use `n` kernel threads (0: one per available CPU)."""
def kernel_threads() -> int: ...
def memory_read_seconds(nbytes: int, repeats: int = 5) -> list[float]: ...

# -- the ntio store and the extent index (`rust/store_bindings.rs`) ------------------------------------------------

STORE_MAGIC: bytes  # b"NTIOSTOR"
STORE_FORMAT_VERSION: int
STORE_ALIGNMENT: int  # 4096: every store tensor starts on a multiple

FileExtent = tuple[int, int]
"""(file_offset, length), in bytes."""

class StoreFormatError(ValueError):
    """A malformed store: bad magic, future version, truncated, bad manifest, checksum mismatch (names the file,
    and the tensor and offset where one is at fault)."""

class ExtentIndex:
    """Layer / tensor / row range → file extents, for a GGUF (built from its tensor table) or a store."""

    def __init__(self, path: str | PathLike[str],
                 tensors: list[tuple[str, int, int, int, int | None]]) -> None:
        """tensors: (name, offset, nbytes, rows, layer or None for globals)."""
    @property
    def n_layers(self) -> int: ...
    def layer_tensors(self, layer: int) -> list[str]: ...  # in file order; LookupError if no such layer
    def layer_extents(self, layer: int) -> list[FileExtent]: ...  # tensors < 4096 B apart share one extent
    def tensor_extent(self, name: str) -> FileExtent: ...
    def row_extent(self, name: str, start: int, stop: int) -> FileExtent: ...  # rows [start, stop)
    def checksum(self, name: str) -> int | None: ...  # the xxh3-64 the file records (None in a GGUF)
    def verify(self, name: str, data: Buffer) -> None:
        """Check a whole tensor's bytes (a C-contiguous buffer) against its checksum (StoreFormatError); no-op for a
        GGUF."""
    @property
    def ffn_group_neurons(self) -> int | None: ...  # neurons per group of the store's down copies, else None
    # Groups of a layer's group-major down copy (`convert --layout ffn-groups`); LookupError where there is none.
    def ffn_group_extents(self, layer: int, groups: list[int]) -> list[FileExtent]: ...  # in the order given
    def ffn_group_checksums(self, layer: int) -> list[int]: ...  # xxh3-64 of each group
    def verify_ffn_group(self, layer: int, group: int, data: Buffer) -> None: ...  # StoreFormatError naming it
    # xxh3-64 of each row group [g·n, (g+1)·n) of a layer's dense gate or up tensor (n = ffn_group_neurons); LookupError
    # naming the tensor where the store records none.
    def ffn_row_group_checksums(self, tensor: str) -> list[int]: ...

def open_store(path: str | PathLike[str]) -> tuple[int, str, list[tuple[str, int, list[int], int, int]], ExtentIndex]:
    """(format_version, metadata JSON, [(name, ggml_type, shape, offset, nbytes)], index); checks header + manifest."""
def store_header(manifest_offset: int, manifest: bytes) -> bytes: ...  # the 4096-byte header page
def plan_store_layout(groups: list[list[int]]) -> list[list[int]]:
    """Offsets for tensor sizes grouped (globals, layer 0, layer 1, ...): 4096-aligned, each group contiguous."""
def checksum(data: Buffer) -> int: ...  # xxh3-64 of a C-contiguous buffer's bytes
def piece_checksums(data: Buffer, piece_nbytes: int) -> list[int]: ...  # xxh3-64 of each piece, the last maybe shorter

class Hasher:
    """xxh3-64 of bytes given piece by piece: `digest()` equals `checksum` of everything given to `update`."""
    def update(self, data: Buffer) -> None: ...
    def digest(self) -> int: ...

# -- GGUF (`rust/gguf_bindings.rs`) -------------------------------------------------------------------------------

class GGUFFormatError(ValueError):
    """A malformed GGUF header (one line naming the file, the key or tensor, and the byte offset)."""

def parse_gguf(path: str | PathLike[str], data: Buffer) -> tuple[
        int, int, int, list[tuple[str, Any]], list[tuple[str, int, list[int], int, int]]]:
    """Parse the GGUF whose bytes are `data` (the mapped file; `path` names it in errors), bounded by its size:
    (version, alignment, data_offset, [(key, value)] in file order, [(name, ggml_type, dims in ne order, absolute
    offset, nbytes)])."""

# -- benchmarks (`rust/bench_bindings.rs`) -----------------------------------------------------------------------

def timed_read(path: str | PathLike[str] | list[tuple[str | PathLike[str], int]], extents: list[Extent], nbytes: int,
               backend: str | None = None, queue_depth: int = 32,
               request_size: int = 1 << 20) -> tuple[str, float, list[float]]:
    """Read extents into a fresh scratch buffer of `nbytes` through a new Reader (`path` as Reader takes it):
    (backend, seconds, per-request latencies in µs)."""
