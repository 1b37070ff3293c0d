"""The product checks' compiled path (``csrc/products.cpp``): built against the running torch on first use, cached.

Intercepted and checked from Python, a matrix product cost about 25 µs on the
GPT example before any pass over its operands: the operator's Python kernel,
the site's naming, a dozen tensor queries, the weight's row sums looked up, a
30-argument ctypes call. This library registers C++ kernels for ``mm``,
``addmm``, ``bmm`` and ``baddbmm`` at torch's ``ADInplaceOrView`` key in their
place, names each product as the Python form does (the naming hooks keep its
module stack), and checks an fp32 CPU product whose bound the Python form has
computed once (``Products.terms``) by the fingerprint library's
``sdc_row_verdict``, with a weight's row sums kept per step. Every other
product (another dtype or device, a layout it does not take, a bound not
known yet) goes to the Python form with its name, so the two give the same
verdicts under the same names. The convolutions stay with the Python
interception and name through the same state.

It needs a C++ compiler (``$CXX``, else ``c++``, ``g++`` or ``clang++``) and
the Python headers the interpreter was built with; the build takes about ten
seconds and is cached beside the fingerprint kernel (``SDCGUARD_CACHE_DIR``),
by a hash of the source, the flags, torch's and Python's versions. Where it
cannot be built the checks run in Python (slower, the same verdicts), and say
so once. ``SDCGUARD_PRODUCTS_KERNEL``: ``auto`` (the default), ``compiled``
(an error where it cannot be had), ``python`` (the Python form throughout);
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
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from typing import Any

import torch

from sdcguard.agent import native

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "products.cpp"
ABI = 3
ENV = "SDCGUARD_PRODUCTS_KERNEL"
MODES = ("auto", "compiled", "python")

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
    state, i64, i32, f64 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_double
    signatures: dict[str, tuple[Any, list[Any]]] = {
        "sdc_px_install": (i32, []),
        "sdc_px_uninstall": (None, []),
        "sdc_px_watch": (None, [state]),
        "sdc_px_unwatch": (None, [state]),
        "sdc_px_new": (state, [ctypes.c_void_p, ctypes.c_void_p, i32, ctypes.py_object, ctypes.py_object]),
        "sdc_px_free": (None, [state]),
        "sdc_px_kernel": (None, [state, ctypes.c_void_p, ctypes.c_void_p, i32]),
        "sdc_px_module": (None, [state, i32, ctypes.c_char_p, i32]),
        "sdc_px_enabled": (None, [state, i32, i32, i32, i32, i32, i32, i32]),
        "sdc_px_enter": (None, [state, i32]),
        "sdc_px_leave": (None, [state]),
        "sdc_px_end_pass": (None, [state]),
        "sdc_px_forward_site": (i32, [state, i32, ctypes.POINTER(i64), ctypes.POINTER(i64)]),
        "sdc_px_backward_site": (i32, [state, ctypes.c_uint64, ctypes.POINTER(i64), ctypes.POINTER(i32)]),
        "sdc_px_depth": (i64, [state]),
        "sdc_px_node_call": (i64, [state, ctypes.c_uint64]),
        "sdc_px_begin_step": (None, [state, ctypes.c_void_p, i64, ctypes.c_void_p, i64, i64]),
        "sdc_px_counts": (None, [state, ctypes.c_void_p]),
        "sdc_px_forget_terms": (None, [state]),
        "sdc_px_terms": (None, [state, i64, i64, i32, i32, f64, f64, f64]),
    }
    for name, (restype, argtypes) in signatures.items():
        function = getattr(lib, name)
        function.restype = restype
        function.argtypes = argtypes
    return lib


def install(lib: ctypes.PyDLL) -> None:
    """The C++ kernels of ``mm``, ``addmm``, ``bmm``, ``baddbmm`` at ``ADInplaceOrView`` (until :func:`uninstall`)."""
    if lib.sdc_px_install() != 0:
        raise native.NativeKernelError("torch refused the product checks' kernels")


def uninstall(lib: ctypes.PyDLL) -> None:
    lib.sdc_px_uninstall()


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


OPERATORS = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
             torch.ops.aten.baddbmm.default)
"""The operators the C++ kernels intercept, in the library's numbering (``Op`` in products.cpp)."""


class Products:
    """One :class:`~sdcguard.agent.product_checks.ProductChecks`' state in the library: its naming (the modules,
    the stack the naming hooks keep, the ordinals, the forward sites), the step's weights and flags, the bounds
    given so far, the weights' row sums.

    ``kernel``: the fingerprint library whose ``sdc_row_verdict`` and ``sdc_dual_matvec`` do the passes (None:
    every product goes to the Python form). ``site``: a site's name to its index (registering a new one);
    ``fallback(op, a, b, bias, alpha, beta, out, site)``: the Python form's check of a product ``site`` names
    (None: name it in Python too)."""

    def __init__(self, lib: ctypes.PyDLL, site: Callable[[str], int], fallback: Callable[..., None],
                 modules: Sequence[tuple[str, bool]]) -> None:
        self.lib = lib
        self.kernel: native.Kernel | None = None
        self._state = lib.sdc_px_new(None, None, 0, site, fallback)
        for index, (label, linear) in enumerate(modules):
            lib.sdc_px_module(self._state, index, label.encode(), int(linear))
        self.enter = functools.partial(lib.sdc_px_enter, self._state)
        """``enter(module id)``: a module's forward begins (the naming hook)."""
        self.leave = functools.partial(lib.sdc_px_leave, self._state)
        self._counts = (ctypes.c_int64 * 2)()
        self._ordinal, self._depth, self._kind = ctypes.c_int64(), ctypes.c_int64(), ctypes.c_int()

    def use_kernel(self, kernel: native.Kernel | None, *, verdict: int | None = None,
                   dual: int | None = None) -> None:
        """Check with ``kernel``'s passes (``verdict``, ``dual``: other functions of the same signatures, by
        address); None sends every product to the Python form."""
        self.kernel = kernel
        if kernel is None:
            self.lib.sdc_px_kernel(self._state, None, None, 0)
            return
        verdict = verdict if verdict is not None else ctypes.cast(kernel.lib.sdc_row_verdict, ctypes.c_void_p).value
        dual = dual if dual is not None else ctypes.cast(kernel.lib.sdc_dual_matvec, ctypes.c_void_p).value
        self.lib.sdc_px_kernel(self._state, verdict, dual, kernel.isa)

    def enabled(self, kinds: dict[str, bool], *, checking: bool = True, python_form: bool = False) -> None:
        """What is checked (``ProductChecks.enabled``); ``checking`` False names the products and checks none;
        ``python_form`` sends every product to the Python form, named there."""
        self.lib.sdc_px_enabled(self._state, *(int(kinds[k]) for k in ("forward", "backward", "linear", "matmul",
                                                                         "conv")), int(checking), int(python_form))

    def watch(self) -> None:
        self.lib.sdc_px_watch(self._state)

    def unwatch(self) -> None:
        self.lib.sdc_px_unwatch(self._state)

    def end_pass(self) -> None:
        self.lib.sdc_px_end_pass(self._state)

    def depth(self) -> int:
        """How many modules' forwards are running (the naming hooks' stack)."""
        return int(self.lib.sdc_px_depth(self._state))

    def forward_site(self, requires_grad: bool) -> tuple[int, int, int]:
        """A convolution's forward product: (its module's id or -1 where it is not checked, its ordinal, the stack's
        depth), its forward site recorded for its backward."""
        label = self.lib.sdc_px_forward_site(self._state, int(requires_grad), ctypes.byref(self._ordinal),
                                             ctypes.byref(self._depth))
        return label, self._ordinal.value, self._depth.value

    def backward_site(self, seq: int) -> tuple[int, int, int]:
        """(module id or -1 where none, ordinal, kind index in ``KINDS``) of the forward product of a backward
        node's sequence number."""
        label = self.lib.sdc_px_backward_site(self._state, seq, ctypes.byref(self._ordinal), ctypes.byref(self._kind))
        return label, self._ordinal.value, self._kind.value

    def node_call(self, seq: int) -> int:
        """How many products of the backward node ``seq`` this one makes, counted with the matrix products'."""
        return int(self.lib.sdc_px_node_call(self._state, seq))

    def counts(self) -> tuple[int, int]:
        """(products checked, not checkable) here since the step began."""
        self.lib.sdc_px_counts(self._state, self._counts)
        return self._counts[0], self._counts[1]

    def begin_step(self, flags: torch.Tensor, weights: Collection[int], keep: int) -> None:
        """A new step: its flags (int64 per site, CPU), the storages' addresses of its weights; the weights' row
        sums of past steps are stale, and dropped whole once more than ``keep`` places are held."""
        addresses = (ctypes.c_int64 * len(weights))(*weights)  # not a tensor: a script's default device is not ours
        on_cpu = flags.device.type == "cpu"
        self.lib.sdc_px_begin_step(self._state, flags.data_ptr() if on_cpu else None, flags.numel(), addresses,
                                   len(weights), keep)

    def terms(self, p: int, n: int, bias: bool, judge: tuple[float, float, float] | None) -> None:
        """The bound of an fp32 CPU product (``judge``: the compiled verdict's three terms; None: no bound)."""
        if judge is None:
            self.lib.sdc_px_terms(self._state, p, n, int(bias), 0, 0.0, 0.0, 0.0)
        else:
            self.lib.sdc_px_terms(self._state, p, n, int(bias), 1, *judge)

    def forget_terms(self) -> None:
        self.lib.sdc_px_forget_terms(self._state)

    def close(self) -> None:
        """Free the state (it leaves any watch); idempotent."""
        state, self._state = getattr(self, "_state", None), None
        if state:
            self.lib.sdc_px_free(state)

    __del__ = close


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
