"""The fingerprint and the communication hook's bucket passes as fused Triton kernels: the bits of
``sdcguard.agent.fingerprint`` and ``sdcguard.agent.grad_norm``, at the memory traffic the work needs.

What each kernel reads and writes (the physical limit of each check):

- ``fingerprint(t)``: one read of ``t`` (any dtype ``sdcguard.agent.fingerprint`` reads,
  any strides, no copy), then one small atomic add per program;
- ``local_pass(buffer, divisor)``, before the all-reduce: one read and one
  write of the bucket: the non-finite flag from the raw exponent bits, the sum
  of squares (``sdcguard.agent.grad_norm``'s order: per-chunk values into a buffer,
  then one program adds them in order; no float atomics) and the division by
  the world size in place;
- ``reduced_pass(reduced)``, after it: one read: the fingerprint's lanes, the
  sum of squares and the flag;
- ``FingerprintLayout``: many tensors (weights, optimizer state, FSDP2's
  reduced gradient shards; single tensors or concatenations) with their
  addresses, sizes and tiles kept on the device per layout (no host-to-device
  copy per call) into a summary the caller may preallocate; on request the
  same read raises a non-finite flag from the raw exponent bits of every
  float tensor (``any_nonfinite``: the flag alone).

Every result stays on the device; nothing synchronises. The integer lanes are
wrapping int64 sums (atomics are exact), so the bits do not depend on how
programs are scheduled.

Triton is imported only when one of these runs (``gpu`` extra). It runs on a
CUDA device, or anywhere under ``TRITON_INTERPRET=1`` (its NumPy interpreter,
how the tests hold these kernels to the other implementations on a CPU). A
call where it cannot run raises ``TritonKernelError`` with the reason; nothing
falls back silently.
"""

from __future__ import annotations

import functools
import importlib
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType

import torch

from sdcguard.agent import fingerprint as fp
from sdcguard.agent import native

INTERPRET_ENV = native.TRITON_INTERPRET_ENV
ROWS = 4
"""Fingerprint blocks per tile of the fingerprint kernels (4,096 elements, one sum-of-squares chunk)."""
RUN = 16
"""Chunk sums the finishing program loads before it adds them (in order)."""
MAX_DIMS = 4
"""Dimensions the strided kernel indexes (after merging those that are contiguous with each other); a view
with more is walked along its leading dimensions."""
BUCKET_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
"""What the bucket passes read: the sum of squares' formats (their squares are exact in fp64)."""
_EXPONENT = {torch.float16: 0x7C00, torch.bfloat16: 0x7F80, torch.float32: 0x7F800000,
             torch.float64: 0x7FF0000000000000}
"""Each float format's exponent mask: an element whose exponent bits are all ones is a NaN or an infinity."""
PACKED = 6
"""int64 words of a bucket pass's result: lane 0-2, flag, sum of squares (fp64 bits), norm (fp64 bits)."""


# Defined in sdcguard.agent.native (which chooses the kernels and refuses a setting that cannot be honoured), so that
# the two modules do not import each other; the names stay this module's API.
TritonKernelError = native.TritonKernelError
unavailable_reason = native.triton_unavailable_reason
require = native.require_triton


@functools.cache
def _jit() -> ModuleType:
    # Imported on first use: this is where Triton is imported and the kernels defined.
    return importlib.import_module("sdcguard.agent.kernels._triton_jit")


_tables: dict[torch.device, torch.Tensor] = {}
_tables_lock = threading.Lock()


def _position_table(device: torch.device) -> torch.Tensor:
    """T (int64 [BLOCK]) on ``device``: built once per device, read-only."""
    with _tables_lock:
        table = _tables.get(device)
        if table is None:
            words = [fp.signed64(fp.position_word(j)) for j in range(fp.BLOCK)]
            table = _tables[device] = torch.tensor(words, dtype=torch.int64, device=device)
        return table


@functools.cache
def _max_programs(device: torch.device) -> int:
    """Programs per launch: a few per multiprocessor on a GPU (each walks tiles grid-stride); 2 in the
    interpreter, which runs them one after another (two show that partial results add)."""
    if device.type == "cuda":
        return 4 * torch.cuda.get_device_properties(device).multi_processor_count
    return 2


def _readable(bits: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """An integer view the kernel loads (bool as uint8) and whether the element is 64-bit."""
    if bits.dtype == torch.bool:
        bits = bits.view(torch.uint8)
    return bits, bits.element_size() == 8


def _merged(shape: Sequence[int], strides: Sequence[int]) -> tuple[list[int], list[int]]:
    """Sizes and strides with unit dimensions dropped and neighbours that step through memory as one merged."""
    sizes: list[int] = []
    steps: list[int] = []
    for size, stride in zip(shape, strides, strict=True):
        if size == 1:
            continue
        if sizes and steps[-1] == size * stride:
            sizes[-1] *= size
            steps[-1] = stride
        else:
            sizes.append(size)
            steps.append(stride)
    return (sizes, steps) if sizes else ([1], [1])


def _add_lanes(bits: torch.Tensor, start: int, out: torch.Tensor, flag: torch.Tensor | None = None,
               exponent: int = 0) -> None:
    """Add the data lanes of ``bits`` (an integer view, any strides) at logical positions ``start``.. to
    ``out`` (int64 [3] on the same device); with ``flag`` (int32 [1]) and an ``exponent`` mask (the bits'
    float format's), raise ``flag`` to 1 when an element is NaN or infinite, from the same read."""
    n = bits.numel()
    if n == 0:
        return
    bits, wide = _readable(bits)
    sizes, steps = _merged(bits.shape, bits.stride())
    if len(sizes) > MAX_DIMS:
        # Rare (a view of five or more dimensions that no merge flattens): one launch per leading index.
        view = bits.as_strided(sizes, steps)
        inner = n // sizes[0]
        for index in range(sizes[0]):
            _add_lanes(view[index], start + index * inner, out, flag, exponent)
        return
    strided = not (len(sizes) == 1 and steps[0] == 1)
    padded_sizes = [1] * (MAX_DIMS - len(sizes)) + sizes
    padded_steps = [0] * (MAX_DIMS - len(steps)) + steps
    blocks = (start + n - 1) // fp.BLOCK - start // fp.BLOCK + 1
    tiles = -(-blocks // ROWS)
    programs = min(tiles, _max_programs(bits.device))
    flagged = flag is not None and exponent != 0
    _jit().fingerprint_kernel[(programs,)](
        bits, n, start, padded_sizes[1], padded_sizes[2], padded_sizes[3], *padded_steps,
        _position_table(bits.device), out, tiles, flag if flagged else out, WIDE=wide, STRIDED=strided,
        ROWS=ROWS, EXPONENT=exponent if flagged else 0,
    )


def fingerprint(t: torch.Tensor) -> torch.Tensor:
    """``sdcguard.agent.fingerprint.fingerprint(t)`` (int64 [3] on ``t``'s device, the same bits) by the Triton kernel.

    Reads ``t`` in place whatever its strides. Raises TritonKernelError where
    Triton cannot run on ``t``'s device, TypeError for an unsupported dtype."""
    require(t.device)
    bits = fp.bit_view(t.detach())
    out = fp.descriptor_lanes(t).clone()
    _add_lanes(bits.reshape(1) if bits.dim() == 0 else bits, 0, out)
    return out


def fingerprint_concat(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """``sdcguard.agent.fingerprint.fingerprint_concat(tensors)`` by the Triton kernel: each piece read in place at its
    offset. Raises ValueError for no tensors or mixed dtypes or devices, TritonKernelError where Triton
    cannot run."""
    return layout_for([list(tensors)])()[0]


def fingerprint_many(tensors: Sequence[torch.Tensor], *, out: torch.Tensor | None = None) -> torch.Tensor:
    """``sdcguard.agent.fingerprint.fingerprint_many(tensors)`` (int64 [n, 3]) by the multi-tensor kernel, its
    metadata cached per layout (``layout_for``). ``out``: a preallocated int64 [n, 3] to write into."""
    tensors = list(tensors)
    if not tensors:
        return torch.empty(0, fp.LANES, dtype=torch.int64, device="cpu") if out is None else out
    return layout_for([[t] for t in tensors])(out)


@dataclass(frozen=True)
class _Group:
    """Contiguous pieces of one element type, as the multi-tensor kernel reads them (all on the device)."""

    element: str
    """The Triton element type's name."""
    wide: bool
    pieces: torch.Tensor
    """int64 [k, 4]: each piece's address, row, position in the row and float format's exponent mask (0: not a
    float)."""
    sizes: torch.Tensor
    tile_piece: torch.Tensor
    tile_block: torch.Tensor
    tiles: int
    floats: bool
    """Whether a piece is a float tensor (a pass for the flag alone skips the group otherwise)."""


_TRITON_INTS = {torch.int8: "int8", torch.uint8: "uint8", torch.int16: "int16", torch.int32: "int32",
                torch.int64: "int64"}


class FingerprintLayout:
    """Fingerprints of a fixed list of rows, each one tensor or the concatenation of several of one dtype
    (``fingerprint`` or ``fingerprint_concat`` of it), by one launch per element width.

    Built once per layout: every piece's address, size, row and position and
    every tile's piece and first block go to the device here, together with
    the rows' descriptors; a call then copies nothing from the host. A layout
    holds the contiguous tensors' addresses, not the tensors: they must stay
    alive and where they are while it is used (``layout_for`` finds the layout
    for where they are now). Raises ValueError for
    an empty row, mixed dtypes in a row or tensors on several devices,
    TritonKernelError where Triton cannot run on their device, TypeError for an
    unsupported dtype."""

    def __init__(self, rows: Sequence[Sequence[torch.Tensor]]) -> None:
        flat = [t for row in rows for t in row]
        self.device = flat[0].device if flat else torch.device("cpu")
        require(self.device)
        descriptors: list[list[int]] = []
        pieces: dict[tuple[str, bool], list[tuple[int, int, torch.Tensor, int]]] = {}
        self.strided: list[tuple[int, int, torch.Tensor, int]] = []
        """(row, position, bits, exponent mask) of the pieces the multi-tensor kernel cannot read (not
        contiguous), each read by the strided kernel (and held by the layout)."""
        for r, row in enumerate(rows):
            if not row:
                raise ValueError(f"FingerprintLayout: row {r} has no tensors")
            dtype = row[0].dtype
            position = 0
            for t in row:
                if t.dtype != dtype or t.device != self.device:
                    raise ValueError(f"FingerprintLayout: row {r} mixes {dtype} on {self.device} with "
                                     f"{t.dtype} on {t.device}; a row is one dtype, a layout one device")
                bits, wide = _readable(fp.bit_view(t.detach()))
                exponent = _EXPONENT.get(t.dtype, 0)
                if bits.numel() and bits.is_contiguous():
                    pieces.setdefault((_TRITON_INTS[bits.dtype], wide), []).append((r, position, bits, exponent))
                elif bits.numel():
                    self.strided.append((r, position, bits, exponent))
                position += bits.numel()
            shape = tuple(row[0].shape) if len(row) == 1 else (sum(t.numel() for t in row),)
            descriptors.append([fp.signed64(d) for d in fp.descriptor(dtype, shape)])
        self.rows = len(rows)
        self.descriptors = torch.tensor(descriptors, dtype=torch.int64, device=self.device).reshape(-1, fp.LANES)
        self.groups = [self._group(element, wide, members) for (element, wide), members in pieces.items()]

    def _group(self, element: str, wide: bool, members: list[tuple[int, int, torch.Tensor, int]]) -> _Group:
        addresses, sizes, tile_piece, tile_block = [], [], [], []
        for k, (row, position, bits, exponent) in enumerate(members):
            # Tiles are whole blocks of the row's positions; the kernel masks what lies outside this piece.
            addresses += [bits.data_ptr(), row, position, fp.signed64(exponent)]
            sizes.append(bits.numel())
            first, last = position // fp.BLOCK, (position + bits.numel() - 1) // fp.BLOCK
            for block in range(first, last + 1, ROWS):
                tile_piece.append(k)
                tile_block.append(block)
        on = functools.partial(torch.tensor, dtype=torch.int64, device=self.device)
        return _Group(element, wide, on(addresses).reshape(-1, 4), on(sizes), on(tile_piece), on(tile_block),
                      len(tile_piece), any(m[3] for m in members))

    def __call__(self, out: torch.Tensor | None = None, *, nonfinite: torch.Tensor | None = None) -> torch.Tensor:
        """The rows' fingerprints, int64 [rows, 3] on the device: into ``out`` when given (preallocated,
        contiguous int64 [rows, 3] on the device; ValueError otherwise), else a new tensor.

        ``nonfinite``: an int32 [1] on the device, set to 1 by the same read when an element of a float
        tensor (fp16, bf16, fp32, fp64) is a NaN or an infinity, and left as it is otherwise (pass zeros).
        The fingerprints are the same bits with or without it."""
        if out is None:
            out = self.descriptors.clone()
        else:
            if (out.dtype != torch.int64 or tuple(out.shape) != (self.rows, fp.LANES) or out.device != self.device
                    or not out.is_contiguous()):
                raise ValueError(f"FingerprintLayout: out must be a contiguous int64 [{self.rows}, {fp.LANES}] on "
                                 f"{self.device}, got {out.dtype} {list(out.shape)} on {out.device}")
            out.copy_(self.descriptors)
        self._launch(out, nonfinite)
        return out

    def scan_nonfinite(self, nonfinite: torch.Tensor) -> torch.Tensor:
        """Only the flag of ``__call__`` (``nonfinite``, returned): one read of every float tensor, no lanes."""
        self._launch(None, nonfinite)
        return nonfinite

    def _launch(self, out: torch.Tensor | None, nonfinite: torch.Tensor | None) -> None:
        """The kernels: lanes into ``out`` (None: none), the flag into ``nonfinite`` (None: none)."""
        if nonfinite is not None and (nonfinite.dtype != torch.int32 or nonfinite.numel() != 1
                                      or nonfinite.device != self.device):
            raise ValueError(f"FingerprintLayout: nonfinite must be an int32 [1] on {self.device}, got "
                             f"{nonfinite.dtype} {list(nonfinite.shape)} on {nonfinite.device}")
        jit = _jit()
        table = _position_table(self.device)
        lanes = out if out is not None else self.descriptors  # never written without LANES
        flag = nonfinite if nonfinite is not None else lanes  # never written without FLAG
        for group in self.groups:
            if out is None and not group.floats:
                continue
            programs = min(group.tiles, _max_programs(self.device))
            per_program = -(-group.tiles // programs)
            jit.many_kernel[(programs,)](
                group.pieces, group.sizes, group.tile_piece, group.tile_block, table, lanes, flag,
                group.tiles, per_program, ELEMENT=getattr(jit.tl, group.element), WIDE=group.wide, ROWS=ROWS,
                LANES=out is not None, FLAG=nonfinite is not None,
            )
        for row, position, bits, exponent in self.strided:
            if out is not None:
                _add_lanes(bits, position, out[row], nonfinite, exponent)
            elif nonfinite is not None and exponent:
                # The strided kernel always computes lanes: into scratch that nobody reads.
                _add_lanes(bits, position, torch.zeros(fp.LANES, dtype=torch.int64, device=self.device),
                           nonfinite, exponent)


_layouts: dict[tuple[object, ...], FingerprintLayout] = {}
_layouts_lock = threading.Lock()
LAYOUTS_KEPT = 1024
"""Layouts ``layout_for`` keeps, the least recently used dropped first. A step uses one per DDP bucket on audit
steps (80-160 on a large model: each bucket's gradients are fingerprinted apart) besides the weights' and the
optimizer state's: with 16 kept, every bucket's layout was built again on every audit step, each build a copy of
its metadata from the host (a wait on the host each, hundreds a step). A layout holds addresses and a few small
int64 tensors on the device (about 12 KB for a 25 MB bucket), so 1,024 cost a few MB at most."""


def layout_for(rows: Sequence[Sequence[torch.Tensor]]) -> FingerprintLayout:
    """The ``FingerprintLayout`` for ``rows``, cached by every tensor's address, dtype, shape and strides
    (which determine the layout's metadata entirely, so a layout found again is valid for whatever tensors
    are at those addresses now); at most ``LAYOUTS_KEPT`` are kept, the least recently used dropped first. A
    layout with a non-contiguous tensor holds it, so it is built afresh each time instead of cached."""
    key = tuple(tuple((t.data_ptr(), t.dtype, tuple(t.shape), t.stride(), t.device) for t in row) for row in rows)
    with _layouts_lock:
        layout = _layouts.pop(key, None)
        if layout is not None:
            _layouts[key] = layout  # the most recently used last: dropped last
    if layout is not None:
        return layout
    layout = FingerprintLayout(rows)
    if not layout.strided:
        with _layouts_lock:
            if len(_layouts) >= LAYOUTS_KEPT:
                del _layouts[next(iter(_layouts))]
            _layouts[key] = layout
    return layout


def any_nonfinite(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """A 0-dim bool on the tensors' device: does any element of any of ``tensors`` (one device) hold a NaN or
    an infinity (an exponent of all ones; non-float tensors never do)? One multi-tensor launch per element
    width, its metadata cached per layout (``layout_for``); no host synchronisation. Raises as
    ``FingerprintLayout``."""
    device = tensors[0].device if tensors else torch.device("cpu")
    floats = [t for t in tensors if t.numel() and t.dtype in _EXPONENT]
    if not floats:
        return torch.zeros((), dtype=torch.bool, device=device)
    flag = torch.zeros(1, dtype=torch.int32, device=device)
    return layout_for([[t] for t in floats]).scan_nonfinite(flag)[0] != 0


@dataclass(frozen=True)
class BucketSummary:
    """What one bucket pass found, as views of one int64 [6] tensor on the bucket's device (``packed``)."""

    packed: torch.Tensor
    """int64 [6]: lanes 0-2, the flag (0 or 1), the sum of squares and the norm (fp64 bits)."""
    with_fingerprint: bool

    @property
    def nonfinite(self) -> torch.Tensor:
        """0-dim bool: does the bucket hold a NaN or an infinity (an exponent of all ones)?"""
        return self.packed[3:4].view(torch.bool)[0]  # the low byte of a 0/1 word (little-endian)

    @property
    def sum_of_squares(self) -> torch.Tensor:
        """0-dim fp64: ``sdcguard.agent.grad_norm.sum_of_squares`` of the bucket as it was read (canonical NaN)."""
        return self.packed[4:5].view(torch.float64)[0]

    @property
    def norm(self) -> torch.Tensor:
        """0-dim fp64: its square root (``grad_norm.norm_from_sum``)."""
        return self.packed[5:6].view(torch.float64)[0]

    @property
    def fingerprint(self) -> torch.Tensor | None:
        """int64 [3]: ``sdcguard.agent.fingerprint.fingerprint`` of the bucket, when asked for."""
        return self.packed[:3] if self.with_fingerprint else None


def bucket_readable(t: torch.Tensor) -> bool:
    """Whether the bucket passes read ``t``: a contiguous fp16, bf16 or fp32 tensor (where Triton runs)."""
    return t.dtype in BUCKET_DTYPES and t.is_contiguous()


def chosen_for_bucket(t: torch.Tensor) -> bool:
    """Whether the communication hook should take ``t``'s bucket passes here: the setting sends ``t``'s device
    to these kernels (``sdcguard.agent.fingerprint.triton_kernels_for``) and they read ``t`` (``bucket_readable``).
    Where the setting asks for them and Triton cannot run, the passes themselves raise TritonKernelError."""
    return fp.triton_kernels_for(t.device) is not None and bucket_readable(t)


def local_pass(buffer: torch.Tensor, divisor: int | None) -> BucketSummary:
    """Before the all-reduce, one read and one write: the flag, the sum of squares and the norm of
    ``buffer`` as it is, then ``buffer`` divided by ``divisor`` in place (None: not divided) with torch's
    CPU bits (IEEE division in fp32, rounded to the element type).

    Raises ValueError for a bucket the kernel does not read (see ``bucket_readable``) or a divisor below 1,
    TritonKernelError where Triton cannot run."""
    if divisor is not None and divisor < 1:
        raise ValueError(f"local_pass: divisor must be at least 1, got {divisor}")
    return _bucket(buffer, divisor, fingerprint=False)


def reduced_pass(reduced: torch.Tensor, *, fingerprint: bool = True) -> BucketSummary:
    """After the all-reduce, one read: the flag, the sum of squares, the norm and (if asked) the fingerprint
    of ``reduced``. Raises as ``local_pass``."""
    return _bucket(reduced, None, fingerprint=fingerprint)


def _bucket(t: torch.Tensor, divisor: int | None, *, fingerprint: bool) -> BucketSummary:
    require(t.device)
    if t.dtype not in BUCKET_DTYPES or not t.is_contiguous():
        raise ValueError(f"bucket pass: reads contiguous {', '.join(str(d) for d in BUCKET_DTYPES)}, "
                         f"got {t.dtype}{'' if t.is_contiguous() else ' (not contiguous)'}")
    n = t.numel()
    chunks = -(-n // native.SQ_CHUNK)
    programs = max(1, min(chunks, _max_programs(t.device)))
    device = t.device
    sums = torch.empty(max(chunks, 1), dtype=torch.float64, device=device)
    parts = torch.empty(programs, 4, dtype=torch.int64, device=device)
    packed = torch.empty(PACKED, dtype=torch.int64, device=device)
    jit = _jit()
    bits = {torch.float32: jit.tl.int32}.get(t.dtype, jit.tl.int16)
    jit.bucket_kernel[(programs,)](
        t.detach(), n, chunks, float(divisor or 1), _position_table(device), sums, parts,
        BITS=bits, EXPONENT=_EXPONENT[t.dtype], BF16=t.dtype == torch.bfloat16, FINGERPRINT=fingerprint, DIVIDE=divisor is not None,
    )
    jit.finish_kernel[(1,)](
        sums, chunks, parts, programs, fp.descriptor_lanes(t), packed,
        PARTS=max(2, 1 << (programs - 1).bit_length()), RUN=RUN,
    )
    return BucketSummary(packed, fingerprint)
