"""Bit-exact tensor fingerprints: three 64-bit integer lanes computed from the raw bits.

A fingerprint reads a tensor's bit pattern (fp32 as int32, bf16 and fp16 as
int16, fp64 as int64, integer tensors as themselves, bool as 0/1; the values
are viewed, never converted) and reduces it to three 64-bit lanes with
wrap-around (mod 2**64) arithmetic. Writing ``v_i`` for element ``i`` of the
flattened tensor, sign-extended to 64 bits (bool and uint8: zero-extended),
``P = BLOCK`` and ``b = i // P``, ``j = i % P``:

- lane 0 = sum(v_i): any single-element change moves it;
- lane 1 = sum((i + 1) * v_i): with lane 0, any change of two elements
  (``+d`` at ``i``, ``-d`` at ``k``) moves it unless ``(i - k) * d`` is a
  multiple of 2**64, which needs both a huge tensor and a high-bit change;
- lane 2 = sum(w(b) * sq(u_i ^ T[j])), NOT linear in the elements: ``u_i`` is
  ``v_i`` (for 64-bit element types ``v_i ^ (v_i >> 32)``, which brings the
  top bits down so that a change confined to bit 63 is not lost when
  squared), ``T`` a fixed table of ``P`` pseudo-random 64-bit words, ``sq`` a
  square mod 2**64, and ``w(b)`` a pseudo-random odd weight per block.
  Linear lanes miss error patterns that cancel in every linear combination
  they form (``+d, -2d, +d`` at three neighbours keeps lanes 0 and 1); the
  change of a square, ``D * (2 m + D)``, depends on the value it hits and on
  the position's random word, so cancelling needs a coincidence of 64-bit
  random values. It is a square and not a multiply-xorshift hash because a
  square is one integer multiply in torch, and squaring after an xor with a
  random word already makes every output bit depend on all lower input bits.
  The position hash comes from a period-``P`` table and a per-block weight
  (instead of hashing every position) so that one xor against a cached table
  and one row reduction do the work; swapping elements of different blocks is
  still seen through ``w(b)``.

Then the tensor's dtype and shape are added to the lanes (a per-(dtype,
shape) constant), so a reinterpretation or a reshape of the same bits has a
different fingerprint, and an empty tensor has a defined one.

Integer sums are exact and independent of order, so the result does not
depend on the thread count, the chunk size, the kernel or the device.

Three implementations compute it. With ``SDCGUARD_FINGERPRINT_KERNEL=triton``
a fused Triton kernel (``sdcguard.agent.kernels.triton_fingerprint``) reads a GPU tensor
once, in place, whatever its strides. On the CPU a C kernel (``agent/csrc``, built
and loaded by ``sdcguard.agent.native``) reads the tensor in place in one vectorised
pass; it runs at a good fraction of memory bandwidth, where torch's CPU int64
multiply is not vectorised. Everywhere else (GPUs by default, or a CPU without a C
compiler) the torch implementation makes one pass over the tensor in chunks
(a multiple of ``P`` elements) that stay in cache: each chunk is widened into
a per-call int64 scratch buffer (the only copy; a non-contiguous tensor is
gathered there chunk by chunk, never copied whole), reduced by rows and
columns for lanes 0 and 1, xored, squared and row-reduced for lane 2.
Per-block partial sums stay on the tensor's device; the lanes are finished
with a few small ops at the end and nothing is read back to the host
(``to_hex`` does that, once). Tests hold both to a pure-Python reference.

Scratch buffers belong to a call, never to the module: the DDP communication
hook may fingerprint buckets concurrently from gloo threads. The only
module-level state is read-only tables, built once per device under a lock.
"""

from __future__ import annotations

import ctypes
import functools
import importlib
import os
import threading
from collections.abc import Iterable, Sequence
from types import ModuleType

import torch

from sdcguard.agent import native

LANES = 3
"""Lanes per fingerprint."""

BLOCK = 1024
"""``P``: period of the position table and the block of the per-block weights.

Part of the definition: changing it changes every fingerprint."""

DEFAULT_CHUNK = 31 * BLOCK
"""Elements per chunk on a CPU with several intra-op threads (a multiple of
``BLOCK``): 31,744, just under torch's intra-op grain size (32,768 elements),
so every op on a chunk runs on the calling thread.

Chunks at or above the grain size make each of the handful of ops per chunk a
parallel region; on a loaded machine (other ranks, gloo threads, the DDP
hook itself) each region waits for a descheduled thread. Measured on 16M fp32
with 2 intra-op threads under load (``./dev bench fingerprint -- --sweep``):
31K gave 0.18x memcpy, 32K and above 0.01-0.03x. The scratch buffer (248
KiB) stays in L2."""

SINGLE_THREAD_CHUNK = 128 * BLOCK
"""Elements per chunk on a CPU with one intra-op thread: no parallel regions
to fear, so larger chunks pay torch's fixed cost per op less often. Measured
on one thread: 8K 0.15x memcpy, 32K 0.30x, 128K 0.39x, 256K 0.38x, 512K
0.25x (out of a 2 MiB L2)."""

ACCELERATOR_CHUNK = 1024 * BLOCK
"""Elements per chunk on a GPU: kernels cost microseconds to launch, and 8 MiB
of scratch fits a data-centre GPU's L2. Not measured here (no GPU); the
result does not depend on it."""


def default_chunk(device: torch.device) -> int:
    """The chunk ``fingerprint`` uses on ``device`` when none is given.

    Only speed depends on it: every chunk size gives the same fingerprint."""
    if device.type != "cpu":
        return ACCELERATOR_CHUNK
    return SINGLE_THREAD_CHUNK if torch.get_num_threads() == 1 else DEFAULT_CHUNK


HEX_CHARS = 16 * LANES
"""Length of ``to_hex``'s output: the contract's Fingerprint format."""

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB

# Element types viewed as a signed integer of the same width. Integer types
# and bool are read as themselves.
_BIT_VIEWS: dict[torch.dtype, torch.dtype] = {
    torch.float64: torch.int64,
    torch.float32: torch.int32,
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
}
for _name in ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu"):
    if hasattr(torch, _name):
        _BIT_VIEWS[getattr(torch, _name)] = torch.int8
for _name, _signed_view in (("uint16", torch.int16), ("uint32", torch.int32), ("uint64", torch.int64)):
    # Wide unsigned types have few kernels in torch; their bits are read as the
    # signed type of the same width.
    if hasattr(torch, _name):
        _BIT_VIEWS[getattr(torch, _name)] = _signed_view
_AS_IS = {torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool}


def mix64(x: int) -> int:
    """SplitMix64's output function of ``x + golden ratio``, as an unsigned 64-bit int.

    The source of every pseudo-random constant in a fingerprint; deterministic
    across platforms and Python runs (unlike ``hash``)."""
    z = (x + _GOLDEN) & _MASK64
    z = ((z ^ (z >> 30)) * _MIX1) & _MASK64
    z = ((z ^ (z >> 27)) * _MIX2) & _MASK64
    return z ^ (z >> 31)


def signed64(x: int) -> int:
    """The two's-complement signed value of the low 64 bits of ``x`` (how torch's int64 holds it)."""
    x &= _MASK64
    return x - (1 << 64) if x >> 63 else x


def position_word(j: int) -> int:
    """``T[j]``: the pseudo-random word xored into position ``j`` of every block (unsigned)."""
    return mix64(2 * j)


def block_weight(b: int) -> int:
    """``w(b)``: the odd pseudo-random weight of block ``b`` in lane 2 (unsigned)."""
    return mix64(2 * b + 1) | 1


def descriptor(dtype: torch.dtype, shape: Sequence[int]) -> tuple[int, int, int]:
    """The per-(dtype, shape) constants added to the three lanes (unsigned).

    Built from a stable text of the dtype and shape (FNV-1a), so it does not
    depend on the Python process."""
    text = f"{dtype}|{','.join(str(int(d)) for d in shape)}".encode()
    h = 0xCBF29CE484222325
    for byte in text:
        h = ((h ^ byte) * 0x100000001B3) & _MASK64
    return mix64(h), mix64(h ^ 0x5555555555555555), mix64(h ^ 0xAAAAAAAAAAAAAAAA)


def bit_view(t: torch.Tensor) -> torch.Tensor:
    """``t``'s elements as integers of the same width, sharing its storage (no copy).

    Complex tensors are read as their real and imaginary parts (a trailing
    dimension of 2). Raises TypeError for an element type with no integer
    reading (none of torch's current types)."""
    if t.is_complex():
        t = torch.view_as_real(t)
    if t.dtype in _AS_IS:
        return t
    target = _BIT_VIEWS.get(t.dtype)
    if target is None:
        raise TypeError(f"fingerprint: no integer view for dtype {t.dtype}")
    if t.dim() == 0:
        return t.reshape(1).view(target).reshape(())
    return t.view(target)


def _mix64(x: torch.Tensor) -> torch.Tensor:
    """``mix64`` on an int64 tensor (wrapping arithmetic; logical shifts by masking)."""
    z = x + signed64(_GOLDEN)
    z = (z ^ ((z >> 30) & ((1 << 34) - 1))) * signed64(_MIX1)
    z = (z ^ ((z >> 27) & ((1 << 37) - 1))) * signed64(_MIX2)
    return z ^ ((z >> 31) & ((1 << 33) - 1))


def block_weights(blocks: torch.Tensor) -> torch.Tensor:
    """``block_weight`` for an int64 tensor of block indices, computed on its device."""
    return _mix64(blocks * 2 + 1) | 1


class _Tables:
    """Read-only per-device tables; built once, replaced (never mutated) when more blocks are needed."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.position = torch.tensor(
            [signed64(position_word(j)) for j in range(BLOCK)], dtype=torch.int64, device=device
        ).view(1, BLOCK)
        self.column_weight = torch.arange(1, BLOCK + 1, dtype=torch.int64, device=device)
        self.block_index = torch.empty(0, dtype=torch.int64, device=device)
        self.block_weight = torch.empty(0, dtype=torch.int64, device=device)

    def blocks(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(b * BLOCK, w(b)) for blocks 0..n-1, as int64 tensors on the device."""
        index, weight = self.block_index, self.block_weight
        if index.numel() < n:
            size = max(n, 2 * index.numel(), 64)
            index = torch.arange(size, dtype=torch.int64, device=self.device) * BLOCK
            weight = block_weights(torch.arange(size, dtype=torch.int64, device=self.device))
            # Readers hold the old pair until they finish; both stay valid.
            self.block_index, self.block_weight = index, weight
        return index[:n], weight[:n]


_tables: dict[torch.device, _Tables] = {}
_tables_lock = threading.Lock()


def _tables_for(device: torch.device) -> _Tables:
    with _tables_lock:
        tables = _tables.get(device)
        if tables is None:
            tables = _tables[device] = _Tables(device)
        return tables


def _blocks(tables: _Tables, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    with _tables_lock:
        return tables.blocks(n)


@functools.lru_cache(maxsize=4096)
def _descriptor_lanes(dtype: torch.dtype, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    # Shared and only ever read: callers add it into their own tensors.
    return torch.tensor([signed64(d) for d in descriptor(dtype, shape)], dtype=torch.int64, device=device)


class _Feeder:
    """Walks a tensor's elements in logical (row-major) order, in pieces of at most ``chunk`` elements."""

    chunk: int
    fill: int

    def feed(self, x: torch.Tensor) -> None:
        """Append ``x``'s elements in logical (row-major) order, any strides."""
        if x.numel() == 0:
            return
        if x.dim() == 0:
            x = x.reshape(1)
        if x.dim() == 1 or x.is_contiguous():
            flat = x.reshape(-1)  # a view: 1-D or contiguous
            start = 0
            while start < flat.numel():
                take = min(self.chunk - self.fill, flat.numel() - start)
                self._put(flat[start : start + take])
                start += take
            return
        row = x[0].numel()
        index = 0
        while index < x.shape[0]:
            rows = (self.chunk - self.fill) // row
            if rows == 0:
                # A row larger than the space left: descend into it.
                self.feed(x[index])
                index += 1
                continue
            rows = min(rows, x.shape[0] - index)
            self._put(x[index : index + rows])
            index += rows

    def _put(self, x: torch.Tensor) -> None:
        raise NotImplementedError


class _Reducer(_Feeder):
    """One fingerprint in progress (torch implementation): a per-call scratch buffer and the per-block partial sums."""

    def __init__(
        self, numel: int, wide: bool, device: torch.device, chunk: int, scratch: torch.Tensor | None
    ):
        self.chunk = min(chunk, max(BLOCK, -(-numel // BLOCK) * BLOCK))
        self.wide = wide
        self.tables = _tables_for(device)
        if scratch is None or scratch.numel() < self.chunk or scratch.device != device:
            scratch = torch.empty(self.chunk, dtype=torch.int64, device=device)
        self.scratch = scratch
        self.shifted = torch.empty(self.chunk, dtype=torch.int64, device=device) if wide else None
        n_blocks = -(-numel // BLOCK)
        self.row_sums = torch.empty(n_blocks, dtype=torch.int64, device=device)
        self.square_sums = torch.empty(n_blocks, dtype=torch.int64, device=device)
        self.column_sums = torch.zeros(BLOCK, dtype=torch.int64, device=device)
        self.column_part = torch.empty(BLOCK, dtype=torch.int64, device=device)
        self.fill = 0
        self.block = 0

    def _put(self, x: torch.Tensor) -> None:
        n = x.numel()
        # The widening (and, for strided input, gathering) copy: the one write of the data.
        self.scratch[self.fill : self.fill + n].view(x.shape).copy_(x)
        self.fill += n
        if self.fill == self.chunk:
            self._reduce(self.fill)
            self.fill = 0

    def _reduce(self, n: int) -> None:
        full, rest = divmod(n, BLOCK)
        if full:
            self._reduce_blocks(self.scratch[: full * BLOCK].view(full, BLOCK), full)
        if rest:
            self._reduce_blocks(self.scratch[full * BLOCK : n].view(1, rest), 1)

    def _reduce_blocks(self, v: torch.Tensor, k: int) -> None:
        width = v.shape[1]
        b = self.block
        torch.sum(v, dim=1, out=self.row_sums[b : b + k])
        column_part = self.column_part[:width]
        torch.sum(v, dim=0, out=column_part)
        self.column_sums[:width].add_(column_part)
        if self.wide:
            assert self.shifted is not None
            shifted = self.shifted[: v.numel()].view(v.shape)
            torch.bitwise_right_shift(v, 32, out=shifted)
            v.bitwise_xor_(shifted)
        v.bitwise_xor_(self.tables.position[:, :width])
        v.mul_(v)
        torch.sum(v, dim=1, out=self.square_sums[b : b + k])
        self.block += k

    def finish(self, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
        """The three lanes (int64 [3], on the device) with the descriptor added."""
        if self.fill:
            self._reduce(self.fill)
            self.fill = 0
        n = self.block
        offsets, weights = _blocks(self.tables, n)
        rows, squares = self.row_sums[:n], self.square_sums[:n]
        lane0 = rows.sum()
        lane1 = (rows * offsets).sum() + (self.column_sums * self.tables.column_weight).sum()
        lane2 = (squares * weights).sum()
        return torch.stack((lane0, lane1, lane2)).add_(_descriptor_lanes(dtype, tuple(shape), rows.device))


def _checked_chunk(chunk: int | None, device: torch.device) -> int:
    if chunk is None:
        return default_chunk(device)
    if chunk <= 0 or chunk % BLOCK:
        raise ValueError(f"fingerprint: chunk must be a positive multiple of {BLOCK}, got {chunk}")
    return chunk


def _kernel_for(device: torch.device) -> native.Kernel | None:
    """The C kernel when ``device`` is the CPU and the kernel is in use; else None (torch implementation)."""
    return native.kernel() if device.type == "cpu" else None


def triton_kernels_for(device: torch.device) -> ModuleType | None:
    """``sdcguard.agent.kernels.triton_fingerprint`` when its kernels do the work for tensors on ``device``, else None.

    The one place the Triton kernels are chosen: ``SDCGUARD_FINGERPRINT_KERNEL=triton``
    and a device other than the CPU (there its calls raise ``TritonKernelError`` with
    the reason when Triton cannot run: no silent fallback), or the CPU under
    ``TRITON_INTERPRET=1`` (its interpreter: tests). Imported only then."""
    if native.mode() != "triton":
        return None
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET", "").strip() in ("", "0"):
        return None
    return importlib.import_module("sdcguard.agent.kernels.triton_fingerprint")


def _fingerprint(
    t: torch.Tensor, chunk: int, scratch: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The lanes of ``t`` by whichever implementation its device uses, and the scratch buffer to reuse."""
    fused = triton_kernels_for(t.device)
    if fused is not None:
        return fused.fingerprint(t), scratch
    kernel = _kernel_for(t.device)
    if kernel is not None:
        return fingerprint_native(t, kernel, chunk=chunk), scratch
    return _fingerprint_torch(t, chunk, scratch)


def _fingerprint_torch(
    t: torch.Tensor, chunk: int, scratch: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    bits = bit_view(t.detach())
    reducer = _Reducer(bits.numel(), bits.element_size() == 8, bits.device, chunk, scratch)
    reducer.feed(bits)
    return reducer.finish(t.dtype, tuple(t.shape)), reducer.scratch


def fingerprint(t: torch.Tensor, *, chunk: int | None = None) -> torch.Tensor:
    """The fingerprint of ``t``: an int64 tensor of 3 lanes on ``t``'s device.

    Equal bits, dtype and shape give equal lanes on any device, thread count
    or ``chunk`` (elements per chunk; None picks ``default_chunk(t.device)``);
    see the module docstring for the exact definition. On the CPU the C kernel
    (``sdcguard.agent.native``) does the work when it is available, else torch; with
    ``SDCGUARD_FINGERPRINT_KERNEL=triton``, the fused Triton kernel on a GPU
    (``sdcguard.agent.kernels.triton_fingerprint``). Does
    not synchronise with the device. Raises ValueError if ``chunk`` is not a
    positive multiple of ``BLOCK``, TypeError for an unsupported dtype."""
    lanes, _ = _fingerprint(t, _checked_chunk(chunk, t.device), None)
    return lanes


def fingerprint_torch(t: torch.Tensor, *, chunk: int | None = None) -> torch.Tensor:
    """``fingerprint`` by the torch implementation, whatever the device and the kernel setting."""
    return _fingerprint_torch(t, _checked_chunk(chunk, t.device), None)[0]


PARALLEL_MIN = 1 << 22
"""Elements from which the C kernel splits a contiguous tensor across as many
threads as torch has intra-op threads (a piece each, on threads the kernel
starts for the call; the lanes are sums, so pieces add)."""

def _kernel_kind(kernel: native.Kernel, bits: torch.Tensor) -> int:
    """The C kernel's element kind for an integer view from ``bit_view`` (uint8 and bool zero-extend)."""
    return kernel.kind(bits.element_size(), bits.dtype in (torch.uint8, torch.bool))


class _NativeFeeder(_Feeder):
    """A strided tensor for the C kernel: gathered chunk by chunk into a same-type scratch buffer."""

    def __init__(self, kernel: native.Kernel, bits: torch.Tensor, chunk: int, out: torch.Tensor) -> None:
        self.kernel = kernel
        self.chunk = chunk
        self.fill = 0  # pieces go to the kernel at once: the scratch is never part-filled between calls
        self.kind = _kernel_kind(kernel, bits)
        self.scratch = torch.empty(chunk, dtype=bits.dtype, device="cpu")
        self.index = 0
        self.out = out

    def _put(self, x: torch.Tensor) -> None:
        n = x.numel()
        if not x.is_contiguous():
            x = self.scratch[:n].view(x.shape).copy_(x)
        self.kernel.segment(x.data_ptr(), n, self.kind, self.index, self.out.data_ptr())
        self.index += n


def fingerprint_native(t: torch.Tensor, kernel: native.Kernel, *, chunk: int | None = None) -> torch.Tensor:
    """``fingerprint`` of a CPU tensor by the C kernel ``kernel`` (``sdcguard.agent.native.kernel()``).

    A contiguous tensor is read in place (split across torch's intra-op
    threads from ``PARALLEL_MIN`` elements); a strided one is gathered
    ``chunk`` elements at a time. Raises ValueError for a tensor not on the CPU."""
    if t.device.type != "cpu":
        raise ValueError(f"fingerprint_native: the C kernel reads CPU memory, not {t.device}")
    bits = bit_view(t.detach())
    n = bits.numel()
    kind = _kernel_kind(kernel, bits)
    threads = torch.get_num_threads()
    if n and not bits.is_contiguous():
        out = torch.zeros(LANES, dtype=torch.int64, device="cpu")
        _NativeFeeder(kernel, bits, _checked_chunk(chunk, t.device), out).feed(bits)
    elif n >= PARALLEL_MIN and threads > 1:
        out = torch.zeros(LANES, dtype=torch.int64, device="cpu")
        kernel.segment_threads(bits.data_ptr(), n, kind, 0, threads, out.data_ptr())
    else:
        out = torch.zeros(LANES, dtype=torch.int64, device="cpu")
        if n:
            kernel.segment(bits.data_ptr(), n, kind, 0, out.data_ptr())
    return out.add_(_descriptor_lanes(t.dtype, tuple(t.shape), t.device))


def descriptor_lanes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s per-(dtype, shape) constants as int64 [3] on its device: what a kernel's data lanes need added to
    be ``fingerprint(t)``. Shared and read-only: add it into your own tensor, never write to it."""
    return _descriptor_lanes(t.dtype, tuple(t.shape), t.device)


def fingerprint_many(tensors: Iterable[torch.Tensor], *, chunk: int | None = None) -> torch.Tensor:
    """Fingerprints of several tensors: int64 [n, 3], row k for the k-th tensor.

    The tensors must share one device (the result lives there); an empty
    iterable gives a [0, 3] tensor on the CPU. Raises ValueError for mixed
    devices or a bad ``chunk``, TypeError for an unsupported dtype."""
    if chunk is not None:
        _checked_chunk(chunk, torch.device("cpu"))
    tensors = list(tensors)
    if not tensors:
        return torch.empty(0, LANES, dtype=torch.int64, device="cpu")
    device = tensors[0].device
    chunk = _checked_chunk(chunk, device)
    for t in tensors:
        if t.device != device:
            raise ValueError(f"fingerprint_many: tensors on {device} and {t.device}; use one device")
    fused = triton_kernels_for(device)
    if fused is not None:
        return fused.fingerprint_many(tensors)
    kernel = _kernel_for(device)
    if kernel is not None:
        return _many_native(tensors, kernel, chunk)
    rows: list[torch.Tensor | None] = [None] * len(tensors)
    # Tensors of at most one block (biases, norms, scalars) are done together:
    # per tensor, one copy instead of a score of small ops.
    small: dict[bool, list[int]] = {False: [], True: []}
    scratch: torch.Tensor | None = None
    for k, t in enumerate(tensors):
        bits = bit_view(t.detach())
        if bits.numel() <= BLOCK:
            small[bits.element_size() == 8].append(k)
            continue
        rows[k], scratch = _fingerprint(t, chunk, scratch)
    for wide, members in small.items():
        if members:
            lanes = _fingerprint_small([tensors[k] for k in members], wide, device)
            for k, row in zip(members, lanes.unbind(0), strict=True):
                rows[k] = row
    return torch.stack([row for row in rows if row is not None])


def _many_native(tensors: list[torch.Tensor], kernel: native.Kernel, chunk: int) -> torch.Tensor:
    """``fingerprint_many`` on the CPU: the contiguous tensors in one kernel call, the others one by one."""
    out = torch.zeros(len(tensors), LANES, dtype=torch.int64, device="cpu")
    batch: list[int] = []
    views: list[torch.Tensor] = []
    for k, t in enumerate(tensors):
        bits = bit_view(t.detach())
        if bits.is_contiguous() and bits.numel() < PARALLEL_MIN:
            batch.append(k)
            views.append(bits)
        else:
            out[k] = fingerprint_native(t, kernel, chunk=chunk)
    if batch:
        count = len(batch)
        data = (ctypes.c_void_p * count)(*(v.data_ptr() for v in views))
        sizes = (ctypes.c_int64 * count)(*(v.numel() for v in views))
        kinds = (ctypes.c_int32 * count)(
            *(_kernel_kind(kernel, v) for v in views)
        )
        lanes = torch.empty(count, LANES, dtype=torch.int64, device="cpu")
        kernel.many(data, sizes, kinds, lanes.data_ptr())
        lanes.add_(_descriptors(tuple((tensors[k].dtype, tuple(tensors[k].shape)) for k in batch)))
        out[batch] = lanes
    return out


def packed_rows(tensors: Sequence[torch.Tensor], pack_below: int) -> list[list[torch.Tensor]]:
    """The rows of a packed fingerprint (``sdcguard.agent.weights.packed_fingerprints``), as a multi-tensor kernel
    takes them (a row of one tensor is ``fingerprint`` of it, a longer one ``fingerprint_concat``): every
    tensor of at least ``pack_below`` elements alone, in order; then the smaller ones, concatenated per
    (dtype, device) in order of first appearance. A smaller one alone in its group is given flattened
    (``fingerprint_concat`` of one tensor: its shape is its length); a view unless it is strided."""
    small: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        if t.numel() < pack_below:
            small.setdefault((t.dtype, t.device), []).append(t)
    rows = [[t] for t in tensors if t.numel() >= pack_below]
    return rows + [group if len(group) > 1 else [group[0].reshape(-1)] for group in small.values()]


def fingerprint_concat(tensors: Sequence[torch.Tensor], *, chunk: int | None = None) -> torch.Tensor:
    """``fingerprint(torch.cat([t.reshape(-1) for t in tensors]))``, without making the concatenation.

    The tensors must share one dtype and one device and there must be at
    least one. Both implementations stream the pieces at their offsets (the
    lanes are sums over elements). Raises ValueError for mixed dtypes or
    devices or no tensors, TypeError for an unsupported dtype."""
    if not tensors:
        raise ValueError("fingerprint_concat: no tensors")
    dtype, device = tensors[0].dtype, tensors[0].device
    for t in tensors:
        if t.dtype != dtype or t.device != device:
            raise ValueError(
                f"fingerprint_concat: {dtype} on {device} and {t.dtype} on {t.device}; use one dtype and device"
            )
    chunk = _checked_chunk(chunk, device)
    total = sum(t.numel() for t in tensors)
    fused = triton_kernels_for(device)
    if fused is not None:
        return fused.fingerprint_concat(tensors)
    kernel = _kernel_for(device)
    if kernel is not None and not dtype.is_complex and all(t.is_contiguous() for t in tensors):
        # The common case (a model's parameters and optimizer state): one kernel
        # call, reading each tensor in place; a real tensor's bits are its memory.
        first = bit_view(tensors[0].detach())
        kind = _kernel_kind(kernel, first)
        count = len(tensors)
        data = (ctypes.c_void_p * count)(*(t.data_ptr() for t in tensors))
        sizes = (ctypes.c_int64 * count)(*(t.numel() for t in tensors))
        out = torch.zeros(LANES, dtype=torch.int64, device="cpu")
        kernel.concat(data, sizes, kind, out.data_ptr())
        return out.add_(_descriptor_lanes(dtype, (total,), device))
    bits = [bit_view(t.detach()) for t in tensors]
    if kernel is None:
        reducer = _Reducer(sum(b.numel() for b in bits), bits[0].element_size() == 8, device, chunk, None)
        for b in bits:
            reducer.feed(b)
        return reducer.finish(dtype, (total,))
    out = torch.zeros(LANES, dtype=torch.int64, device="cpu")
    feeder = _NativeFeeder(kernel, bits[0], chunk, out)
    for b in bits:
        feeder.feed(b)
    return out.add_(_descriptor_lanes(dtype, (total,), device))


@functools.lru_cache(maxsize=256)
def _descriptors(keys: tuple[tuple[torch.dtype, tuple[int, ...]], ...]) -> torch.Tensor:
    # Shared and only ever read, like _descriptor_lanes: a model's parameter list repeats every step.
    return torch.tensor([[signed64(d) for d in descriptor(dtype, shape)] for dtype, shape in keys],
                        dtype=torch.int64, device="cpu")


def _fingerprint_small(tensors: list[torch.Tensor], wide: bool, device: torch.device) -> torch.Tensor:
    """Fingerprints [m, 3] of tensors of at most ``BLOCK`` elements each, in one padded [m, BLOCK] matrix."""
    tables = _tables_for(device)
    bits = [bit_view(t.detach()) for t in tensors]
    lengths = [b.numel() for b in bits]
    width = max(1, *lengths)
    values = torch.zeros(len(tensors), width, dtype=torch.int64, device=device)
    for k, b in enumerate(bits):
        if lengths[k]:
            values[k, : lengths[k]].copy_(b.reshape(-1))
    # Padding is zero, which adds nothing to lanes 0 and 1; lane 2 masks it out.
    column_weight = tables.column_weight[:width]
    lane0 = values.sum(1)
    lane1 = (values * column_weight).sum(1)
    if wide:
        values.bitwise_xor_(values >> 32)
    values.bitwise_xor_(tables.position[:, :width])
    values.mul_(values)
    padding = column_weight > torch.tensor(lengths, dtype=torch.int64, device=device).unsqueeze(1)
    values.masked_fill_(padding, 0)
    _, weights = _blocks(tables, 1)
    lane2 = values.sum(1) * weights
    desc = torch.stack([_descriptor_lanes(t.dtype, tuple(t.shape), device) for t in tensors])
    return torch.stack((lane0, lane1, lane2), dim=1).add_(desc)


def combine(per_tensor: torch.Tensor) -> torch.Tensor:
    """One fingerprint (int64 [3]) for a whole model from its per-tensor fingerprints [n, 3].

    Order-sensitive: it is the fingerprint of the [n, 3] matrix itself, so
    swapping two tensors, dropping one or adding one changes it. Each row
    already carries its tensor's dtype and shape. Raises ValueError unless
    ``per_tensor`` is an int64 [n, 3] tensor."""
    if per_tensor.dtype != torch.int64 or per_tensor.dim() != 2 or per_tensor.shape[1] != LANES:
        raise ValueError(
            f"combine: expected an int64 [n, {LANES}] tensor, got {per_tensor.dtype} {list(per_tensor.shape)}"
        )
    return fingerprint(per_tensor)


def to_hex(lanes: torch.Tensor) -> str:
    """The lanes as 48 lowercase hex characters (16 per lane, lane 0 first): the contract's Fingerprint.

    Reads the lanes back to the host (one synchronisation). Raises ValueError
    unless ``lanes`` holds exactly 3 int64 values."""
    if lanes.dtype != torch.int64 or lanes.numel() != LANES:
        raise ValueError(
            f"to_hex: expected {LANES} int64 lanes, got {lanes.dtype} with {lanes.numel()} values"
        )
    return "".join(f"{v & _MASK64:016x}" for v in lanes.reshape(-1).tolist())
