"""The compiled fingerprint kernel: built from ``csrc/fingerprint.c`` on first use, cached, called through ctypes.

torch's CPU kernels do a 64-bit integer multiply one element at a time, so the
pure-torch fingerprint ran at about a tenth of memory bandwidth. The C kernel
does the same arithmetic in one vectorised pass (AVX-512 or AVX2 picked at run
time on x86-64, plain C elsewhere) and gives the same bits. The same library
has detector 1's test for NaN/Inf, one pass over the raw bits where torch
needed five ops per bucket; the product checks' pass over an operand (its
products with two vectors, one on its absolute values, in one read) and
their whole check of a product (that pass, the result's row sums and the
differences, in one call); and the
communication hook's fused bucket passes: a sum of squares (whose order is part of its definition, ``sdcguard.agent.grad_norm``)
together with the division by the world size before the all-reduce, or
together with the fingerprint after it.

The kernel is plain C11 with no Python or torch headers, so building it needs
only a C compiler (``$CC``, else ``cc`` or ``gcc``) and takes well under a
second. The shared library is cached under ``$SDCGUARD_CACHE_DIR`` (default
``$XDG_CACHE_HOME/sdcguard``, else ``~/.cache/sdcguard``) by a hash of the
source, the flags and the machine type; a cached library needs no compiler.
Concurrent ranks build into temporary files and the first rename wins. After loading, a self-check
compares the kernel with known answers of the torch implementation on every element width
(``KNOWN_ANSWERS``; a unit test recomputes them with ``sdcguard.agent.fingerprint``), so this module needs
neither torch nor the fingerprint module, and the element kinds are the library's own
(``sdc_fp_kind``), not a copy; the bucket passes and the product checks' two calls are checked against
their definitions and exact answers the same way.

``SDCGUARD_FINGERPRINT_KERNEL`` chooses:

- ``auto`` (default): the C kernel when it builds and passes the self-check,
  else the torch implementation, with one warning saying why;
- ``native``: the C kernel or an error (``NativeKernelError``) saying why not;
- ``torch``: never build or load the C kernel;
- ``triton``: tensors on a CUDA device are fingerprinted by the fused Triton
  kernels (``sdcguard.agent.kernels``; the ``gpu`` extra), and asking fails with
  ``TritonKernelError`` saying why where they cannot run (Triton not
  importable; no GPU and ``TRITON_INTERPRET`` unset): never a silent
  fallback. CPU tensors keep the C kernel as in ``auto``, except under
  ``TRITON_INTERPRET=1``, where Triton's interpreter takes them too (how the
  tests compare the kernels' bits on a CPU).

``SDCGUARD_FINGERPRINT_ISA`` (``scalar``, ``avx2`` or ``avx512``) caps the
instruction set, for tests and benchmarks. Only speed depends on either
setting: every choice gives the same fingerprint.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import math
import os
import platform
import random
import shutil
import struct
import subprocess
import tempfile
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "fingerprint.c"
KERNEL_ENV = "SDCGUARD_FINGERPRINT_KERNEL"
ISA_ENV = "SDCGUARD_FINGERPRINT_ISA"
CACHE_ENV = "SDCGUARD_CACHE_DIR"
MODES = ("auto", "native", "torch", "triton")
ISAS = ("scalar", "avx2", "avx512")
"""Instruction sets by the kernel's number for them."""
ABI = 9
"""The version of the C interface this loader speaks (``sdc_fp_abi()``)."""
CFLAGS = ("-O3", "-std=c11", "-fPIC", "-shared", "-pthread", "-fno-strict-aliasing")

ELEMENT_SIZES = (1, 2, 4, 8)
"""The integer widths the kernel reads (``fingerprint.bit_view`` gives one of them)."""
KNOWN_ANSWER_SEED = 20261130
KNOWN_ANSWER_CASES = ((8, False, 3 * 1024 + 37), (4, False, 2 * 1024 + 5), (2, False, 1024 + 3),
                      (1, False, 1024 + 9), (1, True, 1024 - 1))
"""(element size, unsigned, elements) of each self-check input: whole and partial blocks of every kind."""
KNOWN_ANSWERS = (
    (0xBBDA2FF139548BCA, 0xC62BBA889CAAB1CB, 0x278FD22A36652CF6),
    (0x1F534AAB78, 0x5DC773E6A6A2, 0x62E3E8815098BFD9),
    (0xFFFFFFFFFFFA255D, 0xFFFFFFFFE8A48C30, 0x1104062BCEFF7B8B),
    (0xFFFFFFFFFFFFF4B4, 0xFFFFFFFFFFF5A8E0, 0xF60888B085212D5C),
    (0x1FC5E, 0x3F47B8F, 0x25B679047EE4D72B),
)
"""The data lanes (no descriptor) of the torch implementation on ``known_answer_inputs()``, as unsigned 64-bit."""
FLOAT_FORMATS = {"float16": 1, "bfloat16": 2, "float32": 3, "float64": 4}
"""The non-finite scan's float formats, by torch dtype name."""
SUM_FORMATS = {"float16": 1, "bfloat16": 2, "float32": 3}
"""The sum of squares' float formats (those whose squares are exact in fp64), by torch dtype name."""
DIVIDE_FORMATS = frozenset({"float32"})
"""The formats the sum of squares can divide in the same pass (IEEE division as torch's; halves round through
fp32 in torch, so torch divides those)."""
SQ_ROW = 16
SQ_CHUNK = 4096
"""The sum of squares' rows (lanes) and chunk (256 rows), part of its definition (``sdcguard.agent.grad_norm``)."""


class NativeKernelError(RuntimeError):
    """The C kernel could not be built, loaded or trusted (the message says which and why)."""


# -- whether the Triton kernels can run (here, not in sdcguard.agent.kernels, which imports this module) --------------

TRITON_INTERPRET_ENV = "TRITON_INTERPRET"


class TritonKernelError(NativeKernelError):
    """The Triton kernels cannot run here (the message says why and what to change)."""


def triton_interpreting() -> bool:
    """Whether ``TRITON_INTERPRET`` asks for Triton's CPU interpreter."""
    return os.environ.get(TRITON_INTERPRET_ENV, "").strip() not in ("", "0")


def triton_unavailable_reason(device: torch.device | None = None) -> str | None:
    """Why the Triton kernels cannot run on ``device`` (None: on this machine's GPU), or None when they can.

    Imports Triton (and torch, which this module otherwise does not need) only when called."""
    import importlib

    try:
        importlib.import_module("triton")
    except ImportError as exc:
        return (f"Triton is not importable ({exc}); install it with the agent's gpu extra "
                "(pip install 'sdcguard[gpu]') or choose another SDCGUARD_FINGERPRINT_KERNEL")
    if triton_interpreting():
        return None
    env = TRITON_INTERPRET_ENV
    if device is None:
        import torch

        if not torch.cuda.is_available():
            return (f"no CUDA device is visible and {env} is not set: Triton compiles for GPUs "
                    f"({env}=1 runs its CPU interpreter, slowly, for tests)")
        return None
    if device.type != "cuda":
        return (f"a tensor on {device}: Triton compiles for CUDA devices "
                f"({env}=1 runs its CPU interpreter, slowly, for tests)")
    return None


def require_triton(device: torch.device | None = None) -> None:
    """Raise TritonKernelError with the reason unless the Triton kernels can run on ``device`` (None: the GPU)."""
    reason = triton_unavailable_reason(device)
    if reason is not None:
        raise TritonKernelError(f"SDCGUARD_FINGERPRINT_KERNEL=triton: {reason}")


@dataclass(frozen=True)
class Kernel:
    """A loaded kernel and the instruction set its calls use."""

    lib: ctypes.CDLL
    isa: int
    path: Path
    kinds: dict[tuple[int, bool], int]
    """The library's element kind by (element size, unsigned byte)."""

    @property
    def isa_name(self) -> str:
        return ISAS[self.isa]

    def segment(self, data: int, n: int, kind: int, start: int, out: int) -> None:
        """Add the lanes of ``n`` elements at address ``data`` (element ``start`` of their tensor)
        to the three uint64 words at address ``out``. Releases the GIL while it runs."""
        if self.lib.sdc_fp_segment(data, n, kind, start, self.isa, out) != 0:
            raise NativeKernelError(f"fingerprint kernel: unknown element kind {kind}")

    def segment_threads(self, data: int, n: int, kind: int, start: int, threads: int, out: int) -> None:
        """``segment`` cut into ``threads`` pieces, each on a thread of this call's own (pieces add)."""
        if self.lib.sdc_fp_segment_threads(data, n, kind, start, self.isa, threads, out) != 0:
            raise NativeKernelError(f"fingerprint kernel: unknown element kind {kind}")

    def many(self, data: ctypes.Array, n: ctypes.Array, kinds: ctypes.Array, out: int) -> None:
        """Lanes of ``len(data)`` whole contiguous tensors into ``out`` (uint64 [count, 3])."""
        if self.lib.sdc_fp_many(len(data), data, n, kinds, self.isa, out) != 0:
            raise NativeKernelError("fingerprint kernel: unknown element kind")

    def concat(self, data: ctypes.Array, n: ctypes.Array, kind: int, out: int) -> None:
        """Add the lanes of ``len(data)`` contiguous pieces of one kind, taken as one tensor, to ``out``."""
        if self.lib.sdc_fp_concat(len(data), data, n, kind, self.isa, out) != 0:
            raise NativeKernelError(f"fingerprint kernel: unknown element kind {kind}")

    def nonfinite(self, data: int, n: int, float_format: int) -> bool:
        """Whether any of ``n`` floats of ``float_format`` (see ``FLOAT_FORMATS``) at ``data`` is a NaN or an infinity."""
        found = self.lib.sdc_nonfinite(data, n, float_format)
        if found < 0:
            raise NativeKernelError(f"nonfinite kernel: unknown float format {float_format}")
        return bool(found)

    def sum_of_squares(self, data: int, n: int, float_format: int) -> float:
        """The sum of squares (``sdcguard.agent.grad_norm``'s definition) of ``n`` floats of ``float_format`` (see
        ``SUM_FORMATS``) at ``data``; not finite exactly when one of them is not."""
        total = ctypes.c_double()
        if self.lib.sdc_sumsq(data, n, float_format, self.isa, ctypes.byref(total)) != 0:
            raise NativeKernelError(f"sum of squares: unknown float format {float_format}")
        return total.value

    def sum_of_squares_divide(self, data: int, n: int, float_format: int, divisor: int) -> float:
        """``sum_of_squares``, then each float divided by ``divisor`` in place, in one pass (``DIVIDE_FORMATS``)."""
        total = ctypes.c_double()
        if self.lib.sdc_sumsq_divide(data, n, float_format, divisor, self.isa, ctypes.byref(total)) != 0:
            raise NativeKernelError(f"sum of squares with division: float format {float_format} not supported")
        return total.value

    def fingerprint_sum_of_squares(self, data: int, n: int, float_format: int, out: int) -> float:
        """``segment`` of the floats' bits (start 0) into the three uint64 words at ``out``, and their
        ``sum_of_squares``, in one pass."""
        total = ctypes.c_double()
        if self.lib.sdc_fp_sumsq(data, n, float_format, self.isa, out, ctypes.byref(total)) != 0:
            raise NativeKernelError(f"fingerprint with sum of squares: unknown float format {float_format}")
        return total.value

    def dual_matvec(self, a: int, shape: tuple[int, int, int], strides: tuple[int, int, int], s: int, t: int,
                    vec_stride: int, e: int, b: int) -> None:
        """The product checks' pass over one fp32 operand: for ``shape`` = (batch, r, p) matrices at address
        ``a`` with element ``strides`` (batch, row, column; the row or the column stride 1), ``e = a @ s`` and
        ``b = |a| @ t`` (fp32, ``batch x r``, contiguous at ``e`` and ``b``), with ``p`` floats of ``s`` and
        ``t`` per matrix ``vec_stride`` apart (0: shared), in one read of ``a``."""
        batch, r, p = shape
        if self.lib.sdc_dual_matvec(a, batch, r, p, *strides, s, t, vec_stride, self.isa, e, b) != 0:
            raise NativeKernelError(f"dual matrix-vector pass: strides {strides} have no unit row or column stride")

    def row_check(self, a: int, shape: tuple[int, int, int], strides: tuple[int, int, int], s: int, t: int,
                  vec_stride: int, c: int, n: int, c_strides: tuple[int, int, int], alpha: float, bias: int | None,
                  bias_stride: int, beta: float, work: int, difference: int, bound: int) -> None:
        """The product checks' whole check of one fp32 product ``C = alpha A B + beta bias`` by its row sums: with
        ``A`` as in :meth:`dual_matvec` (``s = B 1``, ``t = |B| 1``), ``C`` ``batch x r x n`` at ``c`` with element
        strides ``c_strides`` (the row or the column stride 1) and a bias row of ``n`` floats ``bias_stride``
        apart (0: one value broadcast; None: no bias), ``difference = |C 1 - (alpha A s + beta Σ bias)|`` and
        ``bound = |alpha| |A| t + |beta| Σ |bias|`` (fp32, ``batch x r``, contiguous); ``work`` holds ``r``
        floats of scratch."""
        batch, r, p = shape
        if self.lib.sdc_row_check(a, batch, r, p, *strides, s, t, vec_stride, c, n, *c_strides, alpha, bias,
                                  bias_stride, beta, self.isa, work, difference, bound) != 0:
            raise NativeKernelError(f"row check: strides {strides} or {c_strides} have no unit row or column stride")

    def row_verdict(self, a: int, shape: tuple[int, int, int], strides: tuple[int, int, int],
                    b: tuple[int, tuple[int, int, int], int] | None, s: int, t: int, vec_stride: int, c: int, n: int,
                    c_strides: tuple[int, int, int], alpha: float, bias: int | None, bias_stride: int, beta: float,
                    work: int, judge: tuple[float, float, float], failed: int) -> None:
        """:meth:`row_check` judged in the same call: a row fails where ``difference <= coefficient bound +
        absolute`` does not hold (NaN included) and ``bound < limit`` (``judge`` = (coefficient, absolute,
        limit)); the int64 at ``failed`` gains one when a row fails. ``b``: ``None`` (``s`` and ``t`` given), or
        ``(address, (batch stride, row stride, column stride), ones)`` to compute them from ``B`` (``p x n``
        matrices; ``ones``: ``n`` floats of 1). ``work``: ``r + 2 batch r`` floats, and ``2 batch p`` more with
        ``b``."""
        batch, r, p = shape
        b_at, b_strides, ones = b if b is not None else (None, (0, 0, 0), None)
        if self.lib.sdc_row_verdict(a, batch, r, p, *strides, b_at, *b_strides, ones, s, t, vec_stride, c, n,
                                    *c_strides, alpha, bias, bias_stride, beta, self.isa, work, *judge, failed) != 0:
            raise NativeKernelError(f"row verdict: strides {strides}, {b_strides} or {c_strides} have no unit row or "
                                    "column stride")

    def with_isa(self, isa: int) -> Kernel:
        """This kernel limited to instruction set ``isa`` (at most the machine's best)."""
        return Kernel(self.lib, min(isa, self.lib.sdc_fp_best_isa()), self.path, self.kinds)

    def kind(self, element_size: int, unsigned_byte: bool) -> int:
        """The kernel's element kind for an integer view of ``element_size`` bytes (uint8 and bool: unsigned)."""
        return self.kinds[element_size, unsigned_byte and element_size == 1]


_lock = threading.Lock()
_loaded: Kernel | None = None
_failure: str | None = None
_tried = False


def mode() -> str:
    """``SDCGUARD_FINGERPRINT_KERNEL``, validated (ValueError naming the variable)."""
    value = os.environ.get(KERNEL_ENV, "auto").strip().lower() or "auto"
    if value not in MODES:
        raise ValueError(f"{KERNEL_ENV}={value!r} is not valid: expected one of {', '.join(MODES)}")
    return value


def isa_limit() -> int:
    """``SDCGUARD_FINGERPRINT_ISA`` as the kernel's number (the highest when unset)."""
    value = os.environ.get(ISA_ENV, "").strip().lower()
    if not value:
        return len(ISAS) - 1
    if value not in ISAS:
        raise ValueError(f"{ISA_ENV}={value!r} is not valid: expected one of {', '.join(ISAS)}")
    return ISAS.index(value)


def kernel() -> Kernel | None:
    """The C kernel, built and loaded once per process; None when the torch implementation is to be used.

    Raises NativeKernelError when ``SDCGUARD_FINGERPRINT_KERNEL=native`` and
    the kernel cannot be had, or (a subclass, ``TritonKernelError``) ``triton``
    where Triton cannot run; ValueError for a bad setting."""
    global _loaded, _failure, _tried
    chosen = mode()
    if chosen == "torch":
        return None
    if chosen == "triton":
        # Checked on every call, as a bad setting is.
        require_triton()
    limit = isa_limit()  # a bad setting is refused on every call, not only the first
    with _lock:
        if not _tried:
            _tried = True
            try:
                _loaded = _load(limit)
            except NativeKernelError as exc:
                _failure = str(exc)
                if chosen != "native":
                    log.warning("fingerprints use the torch implementation (slower): %s", exc)
        if _loaded is None and chosen == "native":
            raise NativeKernelError(_failure or "the C kernel was not loaded")
        return _loaded


def cache_dir() -> Path:
    """Where built kernels are kept."""
    configured = os.environ.get(CACHE_ENV)
    if configured:
        return Path(configured)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "sdcguard"


def compiler() -> str:
    """The C compiler to build with; NativeKernelError when there is none."""
    for candidate in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if candidate and shutil.which(candidate.split()[0]):
            return candidate
    raise NativeKernelError("no C compiler found (set CC, or install cc/gcc)")


def build(directory: Path | None = None) -> Path:
    """Compile the kernel into the cache (unless it is there already) and return the library's path.

    A library already in the cache is used without looking for a compiler, so
    an image can be built with one (``python -m sdcguard.agent.native``) and run without."""
    # Not the compiler: any compiler's build of this source passes the same self-check.
    return build_library(SOURCE, "fingerprint", [*CFLAGS, "-o", "{target}", "{source}"], compiler, directory)


def build_library(source_path: Path, stem: str, command: Sequence[str], find_compiler: Callable[[], str],
                  directory: Path | None = None, key_parts: Sequence[str] = ()) -> Path:
    """Compile ``source_path`` into ``<cache>/<stem>-<hash>.so`` unless it is there already (the hash: the source,
    the machine, the command and ``key_parts``) and return its path. ``command``: the compiler's arguments, with
    ``{target}`` where the output goes and ``{source}`` the source (placeholders: the hash names no path); ``find_compiler`` is called only when a build is needed. The build writes
    a scratch file and renames it, so concurrent ranks' identical builds are harmless."""
    try:
        source = source_path.read_bytes()
    except OSError as exc:
        raise NativeKernelError(f"{source_path.name}: the source is missing from this installation: {exc}") from None
    key = hashlib.sha256(b"\0".join([source, platform.machine().encode(), " ".join(command).encode(),
                                     *(part.encode() for part in key_parts)])).hexdigest()[:16]
    candidates = [directory] if directory else [cache_dir()]
    if directory is None and not os.environ.get(CACHE_ENV):
        # A read-only home (common in containers) should not cost the fast path.
        candidates.append(Path(tempfile.gettempdir()) / f"sdcguard-{os.getuid()}")
    for place in candidates:
        if (place / f"{stem}-{key}.so").is_file():
            return place / f"{stem}-{key}.so"
    cc = find_compiler()
    problems = []
    for place in candidates:
        target = place / f"{stem}-{key}.so"
        try:
            place.mkdir(parents=True, exist_ok=True)
            fd, scratch = tempfile.mkstemp(prefix=target.stem + ".", suffix=".tmp", dir=place)
            os.close(fd)
            break
        except OSError as exc:
            problems.append(f"{place}: {exc}")
    else:
        raise NativeKernelError(f"cannot write the kernel cache ({'; '.join(problems)}); set {CACHE_ENV}")
    try:
        done = subprocess.run(
            [*cc.split(), *(scratch if arg == "{target}" else str(source_path) if arg == "{source}" else arg
                             for arg in command)],
            capture_output=True, text=True, timeout=300, check=False,
        )
        if done.returncode != 0:
            raise NativeKernelError(f"{cc} failed to build {source_path.name}: {done.stderr.strip()[-2000:]}")
        os.replace(scratch, target)  # atomic: a concurrent rank's identical build may win
    except (OSError, subprocess.SubprocessError) as exc:
        raise NativeKernelError(f"{cc} could not be run: {exc}") from None
    finally:
        if os.path.exists(scratch):
            os.unlink(scratch)
    return target


def load(path: Path, isa: int | None = None) -> Kernel:
    """Load a built kernel and set up its signatures; NativeKernelError if it is not one this loader speaks."""
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as exc:
        raise NativeKernelError(f"cannot load {path}: {exc}") from None
    lib.sdc_fp_abi.restype = ctypes.c_int
    if lib.sdc_fp_abi() != ABI:
        raise NativeKernelError(f"{path} speaks interface {lib.sdc_fp_abi()}, this loader {ABI}")
    lib.sdc_fp_kind.restype = ctypes.c_int
    lib.sdc_fp_kind.argtypes = [ctypes.c_int, ctypes.c_int]
    kinds = {(size, unsigned): lib.sdc_fp_kind(size, int(unsigned))
             for size in ELEMENT_SIZES for unsigned in (False, True) if size == 1 or not unsigned}
    if 0 in kinds.values():
        raise NativeKernelError(f"{path} has no element kind for {[k for k, v in kinds.items() if not v]}")
    lib.sdc_fp_init.restype = None
    lib.sdc_fp_init()
    lib.sdc_fp_best_isa.restype = ctypes.c_int
    lib.sdc_fp_segment.restype = ctypes.c_int
    lib.sdc_fp_segment.argtypes = [
        ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_uint64, ctypes.c_int, ctypes.c_void_p,
    ]
    lib.sdc_fp_segment_threads.restype = ctypes.c_int
    lib.sdc_fp_segment_threads.argtypes = [
        ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_uint64, ctypes.c_int, ctypes.c_int, ctypes.c_void_p,
    ]
    lib.sdc_fp_many.restype = ctypes.c_int
    lib.sdc_fp_many.argtypes = [
        ctypes.c_int64, ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_int64),
        ctypes.POINTER(ctypes.c_int32), ctypes.c_int, ctypes.c_void_p,
    ]
    lib.sdc_fp_concat.restype = ctypes.c_int
    lib.sdc_fp_concat.argtypes = [
        ctypes.c_int64, ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_int64),
        ctypes.c_int, ctypes.c_int, ctypes.c_void_p,
    ]
    lib.sdc_nonfinite.restype = ctypes.c_int
    lib.sdc_nonfinite.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
    lib.sdc_sumsq.restype = ctypes.c_int
    lib.sdc_sumsq.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
    lib.sdc_sumsq_divide.restype = ctypes.c_int
    lib.sdc_sumsq_divide.argtypes = [
        ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p,
    ]
    lib.sdc_fp_sumsq.restype = ctypes.c_int
    lib.sdc_fp_sumsq.argtypes = [
        ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
    ]
    lib.sdc_dual_matvec.restype = ctypes.c_int
    lib.sdc_dual_matvec.argtypes = [
        ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
        ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p,
        ctypes.c_void_p,
    ]
    lib.sdc_row_check.restype = ctypes.c_int
    lib.sdc_row_check.argtypes = [
        ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
        ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
        ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p, ctypes.c_int64,
        ctypes.c_float, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
    ]
    lib.sdc_row_verdict.restype = ctypes.c_int
    lib.sdc_row_verdict.argtypes = [
        ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
        ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
        ctypes.c_int64, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int,
        ctypes.c_void_p, ctypes.c_double, ctypes.c_double, ctypes.c_double, ctypes.c_void_p,
    ]
    best = lib.sdc_fp_best_isa()
    return Kernel(lib, best if isa is None else min(isa, best), path, kinds)


def _load(limit: int) -> Kernel:
    kernel = load(build(), limit)
    problem = self_check(kernel)
    if problem:
        raise NativeKernelError(
            f"the C kernel ({kernel.path.name}, {kernel.isa_name}) disagrees with torch's known answers: {problem}"
        )
    log.info("fingerprints use the C kernel (%s, %s)", kernel.isa_name, kernel.path)
    return kernel


def known_answer_inputs() -> list[bytes]:
    """The raw bytes of each ``KNOWN_ANSWER_CASES`` input (little-endian, from a fixed seed)."""
    rng = random.Random(KNOWN_ANSWER_SEED)
    return [rng.randbytes(size * n) for size, _, n in KNOWN_ANSWER_CASES]


def kernel_lanes(kernel: Kernel, data: bytes, element_size: int, unsigned_byte: bool) -> tuple[int, int, int]:
    """The kernel's data lanes for ``data`` read as integers of ``element_size`` bytes, as unsigned 64-bit."""
    buffer = ctypes.create_string_buffer(data, len(data))
    out = (ctypes.c_uint64 * 3)()
    kernel.segment(ctypes.addressof(buffer), len(data) // element_size, kernel.kind(element_size, unsigned_byte),
                   0, ctypes.addressof(out))
    return out[0], out[1], out[2]


_NONFINITE_BITS = {  # format -> (struct code, NaN, +inf, -inf)
    "float16": ("H", 0x7E00, 0x7C00, 0xFC00),
    "bfloat16": ("H", 0x7FC0, 0x7F80, 0xFF80),
    "float32": ("I", 0x7FC00000, 0x7F800000, 0xFF800000),
    "float64": ("Q", 0x7FF8000000000000, 0x7FF0000000000000, 0xFFF0000000000000),
}


def _finite_bits(name: str, rng: random.Random, n: int) -> list[int]:
    values = [rng.uniform(-4.0, 4.0) for _ in range(n)]
    if name == "float16":
        return list(struct.unpack(f"<{n}H", struct.pack(f"<{n}e", *values)))
    if name == "bfloat16":
        return [bits >> 16 for bits in struct.unpack(f"<{n}I", struct.pack(f"<{n}f", *values))]
    if name == "float32":
        return list(struct.unpack(f"<{n}I", struct.pack(f"<{n}f", *values)))
    return list(struct.unpack(f"<{n}Q", struct.pack(f"<{n}d", *values)))


def sum_of_squares_reference(values: list[float]) -> float:
    """The sum of squares by its definition (``sdcguard.agent.grad_norm``), in plain Python floats (IEEE doubles):
    the reference the kernel's self-check and the tests hold both implementations to.

    Chunks of ``SQ_CHUNK`` elements, 256 rows of ``SQ_ROW``, the last padded with zeros; squares in fp64; rows
    added pairwise (2i + 2i+1) level by level to one row; its lanes folded (l + l+8, l+4, l+2, l+1); the chunks'
    values added in order from 0."""
    total = 0.0
    for start in range(0, len(values), SQ_CHUNK):
        piece = [v * v for v in values[start:start + SQ_CHUNK]]
        piece += [0.0] * (SQ_CHUNK - len(piece))
        rows = [piece[r:r + SQ_ROW] for r in range(0, SQ_CHUNK, SQ_ROW)]
        while len(rows) > 1:
            rows = [[a + b for a, b in zip(rows[i], rows[i + 1], strict=True)] for i in range(0, len(rows), 2)]
        row = rows[0]
        width = SQ_ROW // 2
        while width:
            row = [row[lane] + row[lane + width] for lane in range(width)]
            width //= 2
        total += row[0]
    return total


def _values(name: str, bits: list[int]) -> list[float]:
    """The floats of ``name`` whose bit patterns are ``bits``, as Python floats (exact)."""
    n = len(bits)
    if name == "float16":
        return list(struct.unpack(f"<{n}e", struct.pack(f"<{n}H", *bits)))
    if name == "bfloat16":
        return list(struct.unpack(f"<{n}f", struct.pack(f"<{n}I", *(b << 16 for b in bits))))
    return list(struct.unpack(f"<{n}f", struct.pack(f"<{n}I", *bits)))


def _check_sums(kernel: Kernel, rng: random.Random) -> str | None:
    """The bucket passes against ``sum_of_squares_reference`` and the fingerprint lanes, on a whole chunk and a
    partial one; the fp32 division against Python's (exactly rounded to fp32: a double's quotient rounds to the
    nearest float correctly, as 53 >= 2 * 24 + 2 bits)."""
    n = SQ_CHUNK + 1037
    for name, code in SUM_FORMATS.items():
        form = _NONFINITE_BITS[name][0]
        bits = _finite_bits(name, rng, n)
        want = sum_of_squares_reference(_values(name, bits))
        data = struct.pack(f"<{n}{form}", *bits)
        buffer = ctypes.create_string_buffer(data, len(data))
        got = kernel.sum_of_squares(ctypes.addressof(buffer), n, code)
        if got != want:
            return f"the sum of squares of {n} {name}: {got!r} instead of {want!r}"
        lanes = (ctypes.c_uint64 * 3)()
        got = kernel.fingerprint_sum_of_squares(ctypes.addressof(buffer), n, code, ctypes.addressof(lanes))
        if got != want or tuple(lanes) != kernel_lanes(kernel, data, struct.calcsize(form), False):
            return f"the fingerprint with the sum of squares of {n} {name} disagrees with the parts"
        # A world of 3 divides; one of 4 multiplies by the exact reciprocal, which must give the same bits.
        for divisor in (3, 4) if name in DIVIDE_FORMATS else ():
            buffer = ctypes.create_string_buffer(data, len(data))
            got = kernel.sum_of_squares_divide(ctypes.addressof(buffer), n, code, divisor)
            divided = struct.unpack(f"<{n}f", buffer.raw[:len(data)])
            expected = struct.unpack(f"<{n}f", struct.pack(f"<{n}f", *(v / divisor for v in _values(name, bits))))
            if got != want or divided != expected:
                return f"the sum of squares with division by {divisor} of {n} {name} disagrees with Python's"
    return None


def self_check(kernel: Kernel) -> str | None:
    """Compare the kernel with the torch implementation's known answers on each element width, the bucket
    passes with their definition, and the product checks' pass with exact answers; None when they agree."""
    for (size, unsigned, n), data, want in zip(KNOWN_ANSWER_CASES, known_answer_inputs(), KNOWN_ANSWERS, strict=True):
        got = kernel_lanes(kernel, data, size, unsigned)
        if got != want:
            kind = f"{'u' if unsigned else ''}int{8 * size}"
            return f"{kind} of {n} elements: lanes {got} instead of {want}"
    rng = random.Random(KNOWN_ANSWER_SEED)
    for name, code in FLOAT_FORMATS.items():
        form, nan, inf, ninf = _NONFINITE_BITS[name]
        values = _finite_bits(name, rng, 5000)
        for bad, expected in ((None, False), (nan, True), (inf, True), (ninf, True)):
            probe = list(values)
            if bad is not None:
                probe[4321] = bad
            buffer = ctypes.create_string_buffer(struct.pack(f"<{len(probe)}{form}", *probe))
            if kernel.nonfinite(ctypes.addressof(buffer), len(probe), code) != expected:
                return f"the non-finite scan of {name} with {bad} at one element did not say {expected}"
            if name in SUM_FORMATS and math.isfinite(
                    kernel.sum_of_squares(ctypes.addressof(buffer), len(probe), code)) == expected:
                return f"the sum of squares of {name} with {bad} at one element was not {'in' * expected}finite"
    return (_check_sums(kernel, rng) or _check_dual(kernel, rng) or _check_row_check(kernel, rng)
            or _check_row_verdict(kernel, rng))


def _check_dual(kernel: Kernel, rng: random.Random) -> str | None:
    """The product checks' pass against exact answers: small integers, whose fp32 sums are exact in any order, in
    a batch of two matrices stored by rows and by columns, past a vector register's width (rows of 37) and through
    every block of rows the pass by columns takes (83 rows: 64, 16 and 3 at a time with AVX-512, 32 and 19 with
    AVX2)."""
    batch, r, p = 2, 83, 37
    values = [float(rng.randint(-8, 8)) for _ in range(batch * r * p)]
    s = [float(rng.randint(-3, 3)) for _ in range(batch * p)]
    t = [float(rng.randint(0, 3)) for _ in range(batch * p)]
    want_e = [sum(values[(n * r + i) * p + k] * s[n * p + k] for k in range(p)) for n in range(batch) for i in range(r)]
    want_b = [sum(abs(values[(n * r + i) * p + k]) * t[n * p + k] for k in range(p))
              for n in range(batch) for i in range(r)]
    by_columns = [values[(n * r + i) * p + k] for n in range(batch) for k in range(p) for i in range(r)]
    floats = ctypes.c_float * (batch * r * p)
    vectors = ctypes.c_float * (batch * p)
    s_buf, t_buf = vectors(*s), vectors(*t)
    for layout, data, strides in (("rows", values, (r * p, p, 1)), ("columns", by_columns, (r * p, 1, r))):
        a = floats(*data)
        e, b = (ctypes.c_float * (batch * r))(), (ctypes.c_float * (batch * r))()
        kernel.dual_matvec(ctypes.addressof(a), (batch, r, p), strides, ctypes.addressof(s_buf),
                           ctypes.addressof(t_buf), p, ctypes.addressof(e), ctypes.addressof(b))
        if list(e) != want_e or list(b) != want_b:
            return f"the product checks' pass by {layout}: {list(e)}, {list(b)} instead of {want_e}, {want_b}"
    return None


def _check_row_check(kernel: Kernel, rng: random.Random) -> str | None:
    """The product checks' whole check of a product against exact answers (small integers again): a batch of
    two, ``C`` stored by rows and by columns, ``alpha`` -2 and a bias row with ``beta`` 1/2, so every term of
    both outputs counts; rows of 61 take every step of a row's sum (32, 16 and 13 with AVX-512; 48, 8 and 5 with
    AVX2)."""
    batch, r, p, n = 2, 3, 19, 61
    a = [float(rng.randint(-4, 4)) for _ in range(batch * r * p)]
    s = [float(rng.randint(-3, 3)) for _ in range(p)]
    t = [float(rng.randint(0, 3)) for _ in range(p)]
    c = [float(rng.randint(-6, 6)) for _ in range(batch * r * n)]
    alpha, beta = -2.0, 0.5
    bias = [float(rng.randint(-4, 4)) for _ in range(n)]
    shift, shift_abs = beta * sum(bias), abs(beta) * sum(abs(x) for x in bias)
    want_d, want_b = [], []
    for m in range(batch):
        for i in range(r):
            row = a[(m * r + i) * p:(m * r + i + 1) * p]
            expected = alpha * sum(x * y for x, y in zip(row, s, strict=True)) + shift
            want_d.append(abs(sum(c[(m * r + i) * n:(m * r + i + 1) * n]) - expected))
            want_b.append(abs(alpha) * sum(abs(x) * y for x, y in zip(row, t, strict=True)) + shift_abs)
    by_columns = [c[(m * r + i) * n + j] for m in range(batch) for j in range(n) for i in range(r)]
    a_buf = (ctypes.c_float * len(a))(*a)
    bias_buf = (ctypes.c_float * n)(*bias)
    s_buf, t_buf = (ctypes.c_float * p)(*s), (ctypes.c_float * p)(*t)
    for layout, data, strides in (("rows", c, (r * n, n, 1)), ("columns", by_columns, (r * n, 1, r))):
        c_buf = (ctypes.c_float * len(data))(*data)
        work = (ctypes.c_float * r)()
        d, b = (ctypes.c_float * (batch * r))(), (ctypes.c_float * (batch * r))()
        kernel.row_check(ctypes.addressof(a_buf), (batch, r, p), (r * p, p, 1), ctypes.addressof(s_buf),
                         ctypes.addressof(t_buf), 0, ctypes.addressof(c_buf), n, strides, alpha,
                         ctypes.addressof(bias_buf), 1, beta, ctypes.addressof(work), ctypes.addressof(d),
                         ctypes.addressof(b))
        if list(d) != want_d or list(b) != want_b:
            return f"the product check with C by {layout}: {list(d)}, {list(b)} instead of {want_d}, {want_b}"
    return None


def _check_row_verdict(kernel: Kernel, rng: random.Random) -> str | None:
    """The judged check against exact answers: a batch of two ``C = A B`` in small integers, ``B``'s row sums
    computed by the kernel, clean (no row fails, whatever the bound) and with one element off by 1 (exactly the
    one failing row with a zero allowance; none with the bound's own allowance of 1, nor past the limit)."""
    batch, r, p, n = 2, 3, 19, 21
    a = [float(rng.randint(-4, 4)) for _ in range(batch * r * p)]
    b = [float(rng.randint(-3, 3)) for _ in range(batch * p * n)]
    c = [sum(a[(m * r + i) * p + k] * b[(m * p + k) * n + j] for k in range(p))
         for m in range(batch) for i in range(r) for j in range(n)]
    a_buf, b_buf = (ctypes.c_float * len(a))(*a), (ctypes.c_float * len(b))(*b)
    ones = (ctypes.c_float * n)(*([1.0] * n))
    work = (ctypes.c_float * (r + 2 * batch * r + 2 * batch * p))()
    cases = (("clean", 0.0, (0.0, 0.0, math.inf), 0), ("one element off by 1", 1.0, (0.0, 0.0, math.inf), 1),
             ("off by 1 within an allowance of 1", 1.0, (0.0, 1.0, math.inf), 0),
             ("off by 1 past the limit", 1.0, (0.0, 0.0, 0.0), 0))
    for name, error, judge, want in cases:
        faulty = list(c)
        faulty[(1 * r + 2) * n + 5] += error
        c_buf = (ctypes.c_float * len(faulty))(*faulty)
        failed = ctypes.c_int64(0)
        kernel.row_verdict(ctypes.addressof(a_buf), (batch, r, p), (r * p, p, 1),
                           (ctypes.addressof(b_buf), (p * n, n, 1), ctypes.addressof(ones)), 0, 0, 0,
                           ctypes.addressof(c_buf), n, (r * n, n, 1), 1.0, None, 0, 1.0, ctypes.addressof(work),
                           judge, ctypes.addressof(failed))
        if failed.value != want:
            return f"the judged product check, {name}: {failed.value} failing instead of {want}"
    return None


def reset_for_tests() -> None:
    """Forget the loaded kernel, so the next ``kernel()`` reads the settings again."""
    global _loaded, _failure, _tried
    with _lock:
        _loaded, _failure, _tried = None, None, False


def main(argv: list[str] | None = None) -> int:
    """``python -m sdcguard.agent.native``: build the kernel into the cache now (say, in a training image) and report."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m sdcguard.agent.native",
        description="Build the fingerprint C kernel into the cache, load it and check it against torch.",
    )
    parser.parse_args(argv)
    try:
        loaded = _load(isa_limit())
    except (NativeKernelError, ValueError) as exc:
        print(f"fingerprint kernel: not available: {exc}")
        return 1
    print(f"fingerprint kernel: {loaded.path} ({loaded.isa_name}), agrees with the torch implementation")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
