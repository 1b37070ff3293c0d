"""The compiled fingerprint kernel: built from ``csrc/fingerprint.c`` on first use, cached, called through ctypes.

torch's CPU kernels do a 64-bit integer multiply one element at a time, so the
pure-torch fingerprint ran at about a tenth of memory bandwidth. The C kernel
does the same arithmetic in one vectorised pass (AVX-512 or AVX2 picked at run
time on x86-64, plain C elsewhere) and gives the same bits. The same library
has detector 1's test for NaN/Inf, one pass over the raw bits where torch
needed five ops per bucket.

The kernel is plain C11 with no Python or torch headers, so building it needs
only a C compiler (``$CC``, else ``cc`` or ``gcc``) and takes well under a
second. The shared library is cached under ``$SDCGUARD_CACHE_DIR`` (default
``$XDG_CACHE_HOME/sdcguard``, else ``~/.cache/sdcguard``) by a hash of the
source, the flags and the machine type; a cached library needs no compiler.
Concurrent ranks build into temporary files and the first rename wins. After loading, a self-check
compares the kernel with the torch implementation on every element width.

``SDCGUARD_FINGERPRINT_KERNEL`` chooses:

- ``auto`` (default): the C kernel when it builds and passes the self-check,
  else the torch implementation, with one warning saying why;
- ``native``: the C kernel or an error (``NativeKernelError``) saying why not;
- ``torch``: never build or load the C kernel.

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
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "fingerprint.c"
KERNEL_ENV = "SDCGUARD_FINGERPRINT_KERNEL"
ISA_ENV = "SDCGUARD_FINGERPRINT_ISA"
CACHE_ENV = "SDCGUARD_CACHE_DIR"
MODES = ("auto", "native", "torch")
ISAS = ("scalar", "avx2", "avx512")
"""Instruction sets by the kernel's number for them."""
ABI = 4
"""The version of the C interface this loader speaks (``sdc_fp_abi()``)."""
CFLAGS = ("-O3", "-std=c11", "-fPIC", "-shared", "-pthread", "-fno-strict-aliasing")

KINDS = {1: 1, 2: 3, 4: 4, 8: 5}
"""Kernel element kind by element size, for signed elements (uint8 and bool: 2)."""
KIND_UNSIGNED_BYTE = 2
FLOAT_FORMATS = {"float16": 1, "bfloat16": 2, "float32": 3, "float64": 4}
"""The non-finite scan's float formats, by torch dtype name."""


class NativeKernelError(RuntimeError):
    """The C kernel could not be built, loaded or trusted (the message says which and why)."""


@dataclass(frozen=True)
class Kernel:
    """A loaded kernel and the instruction set its calls use."""

    lib: ctypes.CDLL
    isa: int
    path: Path

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

    def with_isa(self, isa: int) -> Kernel:
        """This kernel limited to instruction set ``isa`` (at most the machine's best)."""
        return Kernel(self.lib, min(isa, self.lib.sdc_fp_best_isa()), self.path)


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
    the kernel cannot be had, ValueError for a bad setting."""
    global _loaded, _failure, _tried
    chosen = mode()
    if chosen == "torch":
        return None
    limit = isa_limit()  # a bad setting is refused on every call, not only the first
    with _lock:
        if not _tried:
            _tried = True
            try:
                _loaded = _load(limit)
            except NativeKernelError as exc:
                _failure = str(exc)
                if chosen == "auto":
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
    an image can be built with one (``python -m agent.native``) and run without."""
    try:
        source = SOURCE.read_bytes()
    except OSError as exc:
        raise NativeKernelError(f"the kernel's source is missing from this installation: {exc}") from None
    # Not the compiler: any compiler's build of this source passes the same self-check.
    key = hashlib.sha256(b"\0".join([source, platform.machine().encode(), " ".join(CFLAGS).encode()])).hexdigest()[:16]
    candidates = [directory] if directory else [cache_dir()]
    if directory is None and not os.environ.get(CACHE_ENV):
        # A read-only home (common in containers) should not cost the fast path.
        candidates.append(Path(tempfile.gettempdir()) / f"sdcguard-{os.getuid()}")
    for place in candidates:
        if (place / f"fingerprint-{key}.so").is_file():
            return place / f"fingerprint-{key}.so"
    cc = compiler()
    problems = []
    for place in candidates:
        target = place / f"fingerprint-{key}.so"
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
            [*cc.split(), *CFLAGS, "-o", scratch, str(SOURCE)],
            capture_output=True, text=True, timeout=120, check=False,
        )
        if done.returncode != 0:
            raise NativeKernelError(f"{cc} failed to build {SOURCE.name}: {done.stderr.strip()[-2000:]}")
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
    best = lib.sdc_fp_best_isa()
    return Kernel(lib, best if isa is None else min(isa, best), path)


def _load(limit: int) -> Kernel:
    kernel = load(build(), limit)
    problem = self_check(kernel)
    if problem:
        raise NativeKernelError(f"the C kernel ({kernel.path.name}, {kernel.isa_name}) disagrees with torch: {problem}")
    log.info("fingerprints use the C kernel (%s, %s)", kernel.isa_name, kernel.path)
    return kernel


def self_check(kernel: Kernel) -> str | None:
    """Compare the kernel with the torch implementation on each element width; None when they agree."""
    import torch

    from agent import fingerprint as fp

    g = torch.Generator().manual_seed(20261130)
    cases = [
        torch.randint(-(2**62), 2**62, (3 * fp.BLOCK + 37,), generator=g, dtype=torch.int64),
        torch.randint(-(2**31), 2**31, (2 * fp.BLOCK + 5,), generator=g, dtype=torch.int64).to(torch.int32),
        torch.randint(-(2**15), 2**15, (fp.BLOCK + 3,), generator=g, dtype=torch.int64).to(torch.int16),
        torch.randint(-128, 128, (fp.BLOCK + 9,), generator=g, dtype=torch.int64).to(torch.int8),
        torch.randint(0, 256, (fp.BLOCK - 1,), generator=g, dtype=torch.int64).to(torch.uint8),
    ]
    for t in cases:
        want = fp.fingerprint_torch(t)
        got = fp.fingerprint_native(t, kernel)
        if not torch.equal(want, got):
            return f"{t.dtype} of {t.numel()} elements: {fp.to_hex(got)} instead of {fp.to_hex(want)}"
    for name, code in FLOAT_FORMATS.items():
        values = torch.randn(5000, generator=g).to(getattr(torch, name))
        for bad, expected in ((None, False), (math.nan, True), (math.inf, True), (-math.inf, True)):
            probe = values.clone()
            if bad is not None:
                probe[4321] = bad
            if kernel.nonfinite(probe.data_ptr(), probe.numel(), code) != expected:
                return f"the non-finite scan of {name} with {bad} at one element did not say {expected}"
    return None


def kind_of(element_size: int, unsigned_byte: bool) -> int:
    """The kernel's element kind for an integer view of ``element_size`` bytes."""
    if element_size == 1 and unsigned_byte:
        return KIND_UNSIGNED_BYTE
    return KINDS[element_size]


def reset_for_tests() -> None:
    """Forget the loaded kernel, so the next ``kernel()`` reads the settings again."""
    global _loaded, _failure, _tried
    with _lock:
        _loaded, _failure, _tried = None, None, False


def main(argv: list[str] | None = None) -> int:
    """``python -m agent.native``: build the kernel into the cache now (say, in a training image) and report."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m agent.native",
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
