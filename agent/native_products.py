"""The product checks' compiled path (``csrc/products.cpp``): built against the running torch on first use, cached.

A product checked from Python cost about 10 µs of the checks' own Python on
the GPT example (tensor queries, the weight's row sums looked up, a
30-argument ctypes call) before the pass over its operands. This library takes
the product's tensors in one call and does the rest in C++: an fp32 CPU
product whose bound the Python form has computed once (``terms``) is checked
and judged there by the fingerprint library's ``sdc_row_verdict``; anything
else answers 0 and is checked by the Python form, so the two check the same
products alike.

It needs a C++ compiler (``$CXX``, else ``c++``, ``g++`` or ``clang++``) and
the Python headers the interpreter was built with; the build takes about ten
seconds and is cached beside the fingerprint kernel (``SDCGUARD_CACHE_DIR``),
by a hash of the source, the flags, torch's and Python's versions. Where it
cannot be built the checks run in Python (slower, the same verdicts), and say
so once. ``SDCGUARD_PRODUCTS_KERNEL=python`` keeps the Python form;
``python -m sdcguard.agent.native_products`` builds it now (say, in an image).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import shutil
import sys
import sysconfig
import threading
from collections.abc import Collection
from pathlib import Path

import torch

from sdcguard.agent import native

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "products.cpp"
ABI = 1
ENV = "SDCGUARD_PRODUCTS_KERNEL"
MODES = ("auto", "compiled", "python")

CHECKED, UNCHECKABLE, PYTHON = 1, 2, 0
"""``check``'s answers: checked (a failure counted into its site), no bound applies, the Python form's."""

_lock = threading.Lock()
_library: ctypes.PyDLL | None = None
_failure: str | None = None
_tried = False


def compiler() -> str:
    """The C++ compiler to build with; NativeKernelError when there is none."""
    for candidate in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if candidate and shutil.which(candidate.split()[0]):
            return candidate
    raise native.NativeKernelError("no C++ compiler found (set CXX, or install g++)")


def _command() -> list[str]:
    root = Path(torch.__file__).parent
    include = sysconfig.get_paths()["include"]
    if not (Path(include) / "Python.h").is_file():
        raise native.NativeKernelError(f"no Python headers at {include} (install the python3-dev package)")
    return ["-O2", "-std=c++20", "-fPIC", "-shared", "-w",
            f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
            f"-I{root / 'include'}", f"-I{root / 'include' / 'torch' / 'csrc' / 'api' / 'include'}", f"-I{include}",
            "-o", "{target}", "{source}", f"-L{root / 'lib'}", "-ltorch_cpu", "-lc10", "-ltorch_python",
            f"-Wl,-rpath,{root / 'lib'}"]


def build(directory: Path | None = None) -> Path:
    """Compile the library into the cache (unless it is there already) and return its path."""
    return native.build_library(SOURCE, "products", _command(), compiler, directory,
                                key_parts=(torch.__version__, sys.version))


def load(path: Path) -> ctypes.PyDLL:
    """Load a built library (holding the GIL in its calls: it reads Python objects) and set up its signatures."""
    try:
        lib = ctypes.PyDLL(str(path))
    except OSError as exc:
        raise native.NativeKernelError(f"cannot load {path}: {exc}") from None
    lib.sdc_px_abi.restype = ctypes.c_int
    if lib.sdc_px_abi() != ABI:
        raise native.NativeKernelError(f"{path} speaks interface {lib.sdc_px_abi()}, this loader {ABI}")
    lib.sdc_px_new.restype = ctypes.c_void_p
    lib.sdc_px_new.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.py_object, ctypes.py_object]
    lib.sdc_px_free.restype = None
    lib.sdc_px_free.argtypes = [ctypes.c_void_p]
    lib.sdc_px_begin_step.restype = None
    lib.sdc_px_begin_step.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                                      ctypes.c_int64, ctypes.c_int64]
    lib.sdc_px_forget_terms.restype = None
    lib.sdc_px_forget_terms.argtypes = [ctypes.c_void_p]
    lib.sdc_px_terms.restype = None
    lib.sdc_px_terms.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.c_int,
                                 ctypes.c_double, ctypes.c_double, ctypes.c_double]
    lib.sdc_px_check.restype = ctypes.c_int
    lib.sdc_px_check.argtypes = [ctypes.c_void_p, ctypes.py_object, ctypes.py_object, ctypes.py_object,
                                 ctypes.py_object, ctypes.c_double, ctypes.c_double, ctypes.c_int64]
    return lib


def mode() -> str:
    """``SDCGUARD_PRODUCTS_KERNEL``, validated (ValueError naming the variable)."""
    value = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if value not in MODES:
        raise ValueError(f"{ENV}={value!r} is not valid: expected one of {', '.join(MODES)}")
    return value


def library() -> ctypes.PyDLL | None:
    """The library, built and loaded once per process; None where the Python form is to be used. Raises
    NativeKernelError when ``SDCGUARD_PRODUCTS_KERNEL=compiled`` and it cannot be had."""
    global _library, _failure, _tried
    chosen = mode()
    if chosen == "python":
        return None
    with _lock:
        if not _tried:
            _tried = True
            try:
                _library = load(build())
            except native.NativeKernelError as exc:
                _failure = str(exc)
                if chosen != "compiled":
                    log.warning("product checks run in Python (slower, the same verdicts): %s", exc)
        if _library is None and chosen == "compiled":
            raise native.NativeKernelError(_failure or "the product checks' library was not loaded")
        return _library


def reset_for_tests() -> None:
    """Forget the loaded library, so the next ``library()`` reads the setting again."""
    global _library, _failure, _tried
    with _lock:
        _library, _failure, _tried = None, None, False


class Products:
    """One :class:`~sdcguard.agent.product_checks.ProductChecks`' state in the library: the step's weights and
    flags, the bounds given so far, the weights' row sums. ``kernel``: the fingerprint library whose
    ``sdc_row_verdict`` and ``sdc_dual_matvec`` do the passes."""

    def __init__(self, lib: ctypes.PyDLL, kernel: native.Kernel, *, verdict: int | None = None,
                 dual: int | None = None) -> None:
        self.lib = lib
        self.kernel = kernel
        self._verdict = verdict if verdict is not None else ctypes.cast(kernel.lib.sdc_row_verdict,
                                                                        ctypes.c_void_p).value
        self._dual = dual if dual is not None else ctypes.cast(kernel.lib.sdc_dual_matvec, ctypes.c_void_p).value
        self._state = lib.sdc_px_new(self._verdict, self._dual, kernel.isa, torch.Tensor, torch.nn.Parameter)
        self.check = functools.partial(lib.sdc_px_check, self._state)
        """``check(a, b, c, bias or None, alpha, beta, site)``: ``CHECKED``, ``UNCHECKABLE`` or ``PYTHON``."""

    def begin_step(self, flags: torch.Tensor, weights: Collection[int], keep: int) -> None:
        """A new step: its flags (int64 per site, CPU), the storages' addresses of its weights; the weights' row
        sums of past steps are stale, and dropped whole once more than ``keep`` places are held."""
        addresses = (ctypes.c_int64 * len(weights))(*weights)  # not a tensor: a script's default device is not ours
        self.lib.sdc_px_begin_step(self._state, flags.data_ptr(), flags.numel(), addresses, len(weights), keep)

    def terms(self, p: int, n: int, bias: bool, judge: tuple[float, float, float] | None) -> None:
        """The bound of an fp32 CPU product (``judge``: the compiled verdict's three terms; None: no bound)."""
        if judge is None:
            self.lib.sdc_px_terms(self._state, p, n, int(bias), 0, 0.0, 0.0, 0.0)
        else:
            self.lib.sdc_px_terms(self._state, p, n, int(bias), 1, *judge)

    def forget_terms(self) -> None:
        self.lib.sdc_px_forget_terms(self._state)

    def __del__(self) -> None:
        state, self._state = getattr(self, "_state", None), None
        if state:
            self.lib.sdc_px_free(state)


def main(argv: list[str] | None = None) -> int:
    """``python -m sdcguard.agent.native_products``: build the library into the cache now and report."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m sdcguard.agent.native_products",
                                     description="Build the product checks' compiled path into the cache and load it.")
    parser.parse_args(argv)
    try:
        path = build()
        load(path)
    except (native.NativeKernelError, ValueError) as exc:
        print(f"product checks' library: not available: {exc}")
        return 1
    print(f"product checks' library: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
