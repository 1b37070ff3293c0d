"""Product checks: every matrix product of a rank's pass verified by checksums (algorithm-based fault tolerance).

For a product ``C = A B`` (``A`` is ``m x p``, ``B`` is ``p x n``) the column
sums obey ``1ᵀC = (1ᵀA) B``, and the row sums ``C 1 = A (B 1)``. Both sides
cost a matrix-vector product, not a matrix product, so a fault in the
product (a flipped bit in one output element, a wrong partial sum) is seen
at its own micro-batch, on the rank that made it, before the all-reduce
spreads it to every replica. The same identities hold for the two backward
products of ``Y = X Wᵀ`` (``dX = dY W``, ``dW = dYᵀ X``) and, summed over
channels, for a convolution and both of its backward products.

The two sides never agree exactly: the product and the checksums are
rounded. The check compares their difference against a bound that is
rigorous for the arithmetic that ran (Higham's ``gamma_n = n u / (1 - n u)``):

    |C 1 - A (B 1)|_i  ≤  c · Σ_k |A_ik| Σ_j |B_kj|  +  (underflow)

where ``c`` adds up the product's accumulation error ``gamma_p`` (``p`` the
accumulation length, ``u`` the accumulation's unit roundoff: fp32 for fp32,
bf16 and fp16 products), the rounding of the operands on the way in (TF32
when it is allowed), the rounding of ``C`` into a narrower output dtype
(bf16/fp16 autocast), and the rounding of the checksums themselves (the sums
over a row and the matrix-vector product, computed in fp32, fp64 for fp64
products). ``Σ|A||B|`` comes from the same checksums on absolute values. A
clean run therefore never trips it, whatever the data; what it cannot see is
an error below that bound (low mantissa bits of an output element: the
smallest error seen is measured per dtype in the tests and in
docs/detectors.md) and any fault after the product (an activation corrupted
in memory): that is the magnitude trigger's.

Mechanism: the product operators' kernels at torch's ``ADInplaceOrView``
dispatch key (``_Interception``, installed with the checks), which runs
below autograd and autocast and above any dispatch mode and the device's
kernel. So the checks see the products as they run, in the dtypes that
actually ran: ``mm``, ``addmm``, ``bmm``, ``baddbmm`` (``nn.Linear``,
``F.linear``, ``torch.matmul``, ``@``, ``torch.bmm``: every product they
lower to) and ``convolution`` / ``convolution_backward`` (``nn.Conv1d/2d/3d``,
``F.conv*``; not transposed convolutions), and only these operators enter
Python: the pass's other operators run as they would without the checks.
They are checked inside :meth:`ProductChecks.watching` (entered around the
rank's own forward and backward) and pass unchecked outside it. Nothing in
the model changes: the products run as they would, and forward hooks
installed on the modules only name the sites. A backward product is named
after its forward product through the autograd node's sequence number.
Under activation checkpointing (``torch.utils.checkpoint``, either
implementation), a module's forward recomputed inside the backward gives
forward products, named ``"... forward (recomputed)"``, and the backward
products keep their names. A dispatch mode around the step (the campaign's
fault injectors) runs below the interception wherever it is entered, so the
checks see the results it hands on, as they see a faulty kernel's. Compiled
code (``torch.compile``: a compiled model, or a compiled function the model
calls) calls none of these operators, so inside :meth:`ProductChecks.watching`
it runs eagerly (``torch.compiler.set_stance("force_eager")``), and compiled
outside it; a model with compiled modules is warned of it.

Where the compiled path is built (``sdcguard.agent.native_products``,
``csrc/products.cpp``; the default wherever a C++ compiler and the Python
headers are at hand), the four matrix-product operators are intercepted by
C++ kernels at the same key instead: they name the product (the naming
hooks keep their module stack) and check an fp32 CPU product in C++, and
hand every other product to the Python form with its name, so that both
give the same verdicts under the same names; the convolutions stay with the
Python interception and name through the same state. From Python, the
interception, the naming and a product's check cost about 25 µs a product
on the GPT example, more than the pass over its operands.

Cost: a product is checked by its row sums, ``C 1 = A (B 1)``, with the
weight as ``B`` where one operand is a parameter: ``B 1`` and ``|B| 1`` are
computed once per step and serve every micro-batch, so a product costs the
sum of ``C`` and two matrix-vector products on ``A`` (with ``B 1`` and with
``|B| 1``). On the CPU an fp32 product is checked and judged whole in one
call of the compiled kernel (``sdcguard.agent.native``'s ``sdc_row_verdict``:
one read of ``A``, one of ``C``, one of ``B`` where it is not a weight; a
failing product counted straight into its site's int64). Other products
(the fused Triton kernel on a GPU, the torch form) leave their differences
and bounds in the pass's rows, judged together when the pass ends, into the
same int64 per site on the device: a few device operations per pass instead
of several per product, and no host synchronisation.

Not seen: products inside fused kernels that do not lower to these
operators (``F.scaled_dot_product_attention``'s fused kernels; ``einsum``
lowers to ``bmm`` and is seen), products of tensor subclasses (an FSDP2 sharded
``DTensor`` is skipped; FSDP2's unsharded parameters are plain tensors in the
forward and backward, so their products are seen), transposed convolutions,
and 1-D operand products (``mv``, ``dot``).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import threading
import warnings
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from sdcguard.agent import native_products
from sdcguard.agent.determinism import FP32_PRECISIONS, fp32_precisions

log = logging.getLogger(__name__)

_aten = torch.ops.aten
_MATMULS = {_aten.mm, _aten.addmm, _aten.bmm, _aten.baddbmm}
_CONVS = {_aten.convolution, _aten.convolution_backward}
_PLAIN = (torch.Tensor, torch.nn.Parameter)
_PRODUCT_FREE = frozenset({
    torch.nn.Dropout, torch.nn.Dropout1d, torch.nn.Dropout2d, torch.nn.Dropout3d, torch.nn.AlphaDropout,
    torch.nn.LayerNorm, torch.nn.RMSNorm, torch.nn.GroupNorm, torch.nn.BatchNorm1d, torch.nn.BatchNorm2d,
    torch.nn.BatchNorm3d, torch.nn.Embedding, torch.nn.GELU, torch.nn.ReLU, torch.nn.SiLU, torch.nn.Tanh,
    torch.nn.Sigmoid, torch.nn.Softmax, torch.nn.Identity, torch.nn.Flatten, torch.nn.Sequential,
    torch.nn.ModuleList, torch.nn.ModuleDict})
"""Modules of these exact types (torch's own; a subclass may override ``forward``) compute no matrix product in
their own forward (a container's products are its children's): the checks hang no naming hooks on them, since a
product is named after the innermost module running it and a module's hooks cost every call of it."""

KINDS = ("forward", "backward", "linear", "matmul", "conv")
"""What ``enabled`` switches: the directions, and the kinds of product (an ``nn.Linear``'s, a bare matmul, a
convolution)."""

FIRST, COUNT = range(2)
"""The layout of :meth:`ProductChecks.summary`: the first failing site's index (-1: none), how many failed."""

_LAYOUTS = 16
"""Judging layouts (the sites and lengths of one pass's checksums) kept on the device: a few pass shapes per job."""

REDUCED_PRECISION_SPLITS = 32
"""On CUDA with ``allow_bf16/fp16_reduced_precision_reduction`` (torch's default), cuBLAS may add split-K partial
sums in the output dtype: the bound allows this many partials added in it."""

_UNIT_ROUNDOFF = {torch.float64: 2.0 ** -53, torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8,
                  torch.float16: 2.0 ** -11}
_SMALLEST = {torch.float64: 2.0 ** -1074, torch.float32: 2.0 ** -149, torch.bfloat16: 2.0 ** -133,
             torch.float16: 2.0 ** -24}
"""The spacing of subnormals: the absolute error of rounding a tiny value (gradual underflow)."""


def matmul_settings() -> tuple[tuple[str, ...], tuple[bool, ...]]:
    """torch's settings that change a product's rounding: each backend's fp32 precision (how it may round fp32
    operands: ``sdcguard.agent.determinism.fp32_precisions``, in ``FP32_PRECISIONS`` order), and whether cuBLAS
    may use reduced-precision bf16/fp16 reductions."""
    precisions = fp32_precisions()
    return tuple(precisions[name] for name in FP32_PRECISIONS), (
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction,
        torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction)


_OPERAND_ROUNDING = {"ieee": 0.0, "tf32": 2.0 ** -11, "bf16": 2.0 ** -8}
"""Relative error of rounding an fp32 operand to each precision a backend may use."""


def gamma(n: int, u: float) -> float:
    """Higham's ``gamma_n = n u / (1 - n u)``, the relative error bound of ``n`` rounded additions; ``inf`` when
    ``n u >= 1`` (no bound)."""
    nu = n * u
    return nu / (1.0 - nu) if nu < 1.0 else math.inf


@dataclass(frozen=True)
class Arithmetic:
    """What the bound assumes of one product: its accumulation, input and output rounding, and the checksums'."""

    accumulation: float
    """Unit roundoff of the product's accumulation."""
    inputs: float
    """Relative error of rounding each operand before it is multiplied (TF32: 2^-11; 0 when exact)."""
    output: float
    """Unit roundoff of rounding the result into its dtype when that is narrower than the accumulation, else 0."""
    reduction: float
    """Relative error of adding partial sums in a narrower dtype (cuBLAS reduced-precision split-K), else 0."""
    checksum: float
    """Unit roundoff of the checksums (fp32, fp64 for fp64 products)."""
    tiny: float
    """Absolute error of one rounding in the output dtype near zero (gradual underflow)."""
    largest: float
    """The output dtype's largest finite value (an infinite output is legitimate only where the bound reaches it)."""

    @staticmethod
    def of(operand: torch.dtype, output: torch.dtype, device: torch.device, *, conv: bool,
           settings: tuple[tuple[str, ...], tuple[bool, ...]] | None = None) -> Arithmetic | None:
        """The arithmetic of a product of ``operand`` tensors into ``output`` on ``device``; None for a dtype that
        is not checked (integers, fp8, complex). Reads torch's fp32-precision and reduced-precision settings as
        they are now, or takes them from ``settings`` (:func:`matmul_settings`, read once per pass by the
        checks)."""
        precision, flags = settings if settings is not None else matmul_settings()
        return _arithmetic(operand, output, device.type, conv, precision, flags)

    @staticmethod
    def _of(operand: torch.dtype, output: torch.dtype, device_type: str, conv: bool, precisions: tuple[str, ...],
            flags: tuple[bool, ...]) -> Arithmetic | None:
        bf16_reduced, fp16_reduced = flags
        if operand not in _UNIT_ROUNDOFF or output not in _UNIT_ROUNDOFF:
            return None
        wide = operand == torch.float64
        accumulation = _UNIT_ROUNDOFF[torch.float64 if wide else torch.float32]
        inputs = 0.0
        if operand == torch.float32:
            # The backend's own setting (cuBLAS, cuDNN, oneDNN); a device of another type: the coarsest of all.
            by_name = dict(zip(FP32_PRECISIONS, precisions, strict=True))
            name = f"{device_type}.{'conv' if conv else 'matmul'}"
            inputs = _OPERAND_ROUNDING[by_name[name]] if name in by_name else max(
                _OPERAND_ROUNDING[p] for p in precisions)
            if inputs:
                inputs = (1.0 + inputs) ** 2 - 1.0  # both operands of each product rounded
        reduction = 0.0
        if device_type == "cuda" and not conv and (
                (operand == torch.bfloat16 and bf16_reduced) or (operand == torch.float16 and fp16_reduced)):
            reduction = gamma(REDUCED_PRECISION_SPLITS, _UNIT_ROUNDOFF[operand])
        out_u = _UNIT_ROUNDOFF[output]
        return Arithmetic(accumulation=accumulation, inputs=inputs,
                          output=out_u if out_u > accumulation else 0.0, reduction=reduction,
                          checksum=_UNIT_ROUNDOFF[torch.float64 if wide else torch.float32],
                          tiny=_SMALLEST[output], largest=torch.finfo(output).max)

    @functools.lru_cache(maxsize=4096)  # noqa: B019 (a few shapes per model; the instances are few and frozen)
    def coefficient(self, p: int, m: int) -> float:
        """``c`` such that ``|checksum difference| <= c · Σ|A||B| + tiny terms``, for accumulation length ``p``
        and checksum length ``m``, where ``Σ|A||B|`` is itself computed in the checksum's precision."""
        product = (1 + self.inputs) * (1 + gamma(p, self.accumulation)) * (1 + self.reduction) * (1 + self.output) - 1
        g_m = gamma(m, self.checksum)
        # Σ_i C_ij in the checksum's precision, |Σ_i C_ij| <= (1 + product) T; Σ_i A_ik, then its product with B
        # (rounded operands too when TF32 is on: our own matrix-vector product runs under the same setting).
        sum_c = g_m * (1 + product)
        sum_a = g_m
        gemv = ((1 + self.inputs) * (1 + gamma(p, self.checksum)) - 1) * (1 + g_m)
        total = product + sum_c + sum_a + gemv
        # T is computed from absolute values (nonnegative sums: relative error only), and the comparison rounds.
        computed_low = (1 - gamma(m, self.checksum)) * (1 - gamma(p, self.checksum)) * (1 - self.inputs)
        if not total < math.inf or computed_low <= 0:
            return math.inf
        return total / computed_low * (1 + 8 * self.checksum)

    def absolute(self, p: int, m: int) -> float:
        """The underflow term: every rounding of the ``m (p + 2)`` additions and the ``m`` outputs near zero."""
        return 2 * m * self.tiny + m * (p + 4) * _SMALLEST[torch.float32]


_arithmetic = functools.lru_cache(maxsize=256)(Arithmetic._of)


@dataclass(frozen=True)
class _Layout:
    """One pass's judging vectors on the device, per checksum and per product (``_layout_vectors``)."""

    coefficients: torch.Tensor
    absolutes: torch.Tensor
    limits: torch.Tensor
    product_of: torch.Tensor
    """The product of each checksum."""
    site_of: torch.Tensor
    """The site of each product."""
    host: tuple[torch.Tensor, ...]
    """The host tensors they were copied from (kept alive for a non-blocking copy from pinned memory)."""


class ProductChecks:
    """Checksums on every matrix product of ``model``'s passes run inside :meth:`watching`.

    Build it once around the bare model (under DDP: ``ddp.module``): it
    installs forward hooks that name the sites and nothing else. Per step:
    :meth:`begin_step` (zeroes the flags), the rank's own forward and
    backward inside ``with checks.watching():``, then :meth:`summary` (a
    2-int64 device tensor: the first failing site, how many failed) joins the
    step's collective. ``flags`` holds one int64 per site (the failing
    products counted), ``sites`` their names (``"blocks.0.qkv forward"``,
    ``"... backward dX"``, ``"... backward dW"``; a bare matmul's operands are
    ``dA``/``dB``). ``enabled`` switches kinds off (keys in :data:`KINDS`).
    ``margin`` multiplies the bound (1: the rigorous bound; a test shrinks it
    to show that a tighter one would fail clean runs). ``compiled`` False
    names and checks every product in Python (as where the compiled path,
    ``sdcguard.agent.native_products``, cannot be built), so that
    :meth:`on_product` sees each one. Raises ``ValueError``
    for an unknown kind, a margin that is not positive or a capacity below 1.
    """

    def __init__(self, model: torch.nn.Module, *, device: torch.device | None = None,
                 enabled: Sequence[str] = KINDS, margin: float = 1.0, capacity: int = 4096,
                 compiled: bool = True) -> None:
        unknown = set(enabled) - set(KINDS)
        if unknown:
            raise ValueError(f"enabled: unknown kind(s) {sorted(unknown)}; known: {', '.join(KINDS)}")
        if not margin > 0:
            raise ValueError(f"margin: must be > 0, got {margin}")
        if capacity < 1:
            raise ValueError(f"capacity: must be >= 1, got {capacity}")
        if device is None:
            first = next(iter(model.parameters()), None)
            device = first.device if first is not None else torch.device("cpu")
        self.device = device
        self.enabled = {kind: kind in enabled for kind in KINDS}
        self.margin = margin
        self.capacity = capacity
        self._flags = torch.zeros(capacity, dtype=torch.int64, device=device)
        self.sites: list[str] = []
        self._checked = self._unchecked = 0
        self._index: dict[str, int] = {}
        self._stack: list[tuple[str, torch.nn.Module]] = []
        self._watching = False
        """Inside :meth:`watching`: the naming hooks do nothing outside it."""
        self._ordinal: dict[str, int] = {}
        self._forward_sites: dict[int, tuple[str, str]] = {}
        self._node: tuple[int, int] = (-1, 0)
        self._handles: list[Any] = []
        self._params = [p for p in model.parameters() if p.is_floating_point()]
        self._weights: set[int] = set()
        self._weight_rows: dict[tuple[Any, ...], tuple[torch.Tensor, torch.Tensor]] = {}
        self._weight_buffers: dict[tuple[Any, ...], tuple[tuple[torch.Tensor, torch.Tensor],
                                                          tuple[torch.Tensor, torch.Tensor]]] = {}
        """The compiled passes' outputs for a weight's sums, by its storage and layout, kept from step to step and
        written again each step (a fresh pair of tensors per weight and step cost more than the two passes)."""
        self._pending: list[tuple[torch.Tensor, torch.Tensor] | None] = []
        """Checksums queued for judging, in layout order: (differences, bounds), or None for a product the fused
        Triton check wrote straight into ``_rows`` (its span in ``_spans``; on the rank's device). The compiled
        CPU check judges its product itself (``_verdict``) and queues nothing."""
        self._rows = torch.empty(2, 0, dtype=torch.float32, device=self.device)
        self._spans: list[tuple[int, int]] = []
        self._work = torch.empty(0, dtype=torch.float32, device="cpu")
        """The compiled verdict's scratch (CPU floats, grown as needed)."""
        self._layout: list[tuple[int, int, float, float, float]] = []
        self._layouts: dict[tuple[Any, ...], _Layout] = {}
        self._scratch: dict[tuple[torch.dtype, int], torch.Tensor] = {}
        self._ones_cache: dict[int, torch.Tensor] = {}
        by_compile = [name or "<model>" for name, module in model.named_modules() if _compiled(module)]
        if by_compile:
            log.warning("product checks: %s compiled (torch.compile); compiled code calls none of the operators the "
                        "checks see, so inside the checks it runs eagerly (every product is still checked) and "
                        "compiled outside them",
                        ", ".join(by_compile[:3]) + (f" and {len(by_compile) - 3} more" if len(by_compile) > 3 else ""))
        # The compiled path where it can be had (raises where SDCGUARD_PRODUCTS_KERNEL=compiled says it must): its
        # C++ kernels intercept the matrix products for all checks, installed with the first.
        available = native_products.library()
        _INTERCEPTION.install(available)
        self._intercepting = True
        self._settings: tuple[tuple[str, ...], tuple[bool, ...]] | None = None
        self._fused: Any = None
        """``sdcguard.agent.kernels.triton_products`` where the setting sends the rank's device to the Triton kernels."""
        self._terms: dict[tuple[Any, ...], tuple[Arithmetic | None, float, float, tuple[float, float, float]]] = {}
        """A product's bound terms by (dtypes, device, lengths, bias), for the settings in ``_settings``."""
        hooked = [(name, module) for name, module in model.named_modules()
                  if not name or type(module) not in _PRODUCT_FREE]  # the others run no product of their own
        self._labels = [name or "<model>" for name, _ in hooked]
        self._compiled: native_products.Products | None = None
        """These checks' state in the compiled path (``sdcguard.agent.native_products``, csrc/products.cpp) while
        its C++ kernels intercept (``_INTERCEPTION.library``): it names the matrix products and checks those of fp32
        on the CPU in C++, handing the rest to the Python form, named; its bounds are given from here as the Python
        form computes them. None under the Python interception (every product named and checked in Python)."""
        self._named_in_cpp = False
        """The matrix products named in C++: the naming hooks keep its stack, and the convolutions (intercepted in
        Python) are named through it. False with ``compiled=False`` or the Python form chosen (every product then
        goes from the C++ kernels to :meth:`on_product`)."""
        library = _INTERCEPTION.library
        if library is not None:
            self._compiled = native_products.Products(
                library, _weak(self, ProductChecks._site), _weak(self, ProductChecks._from_compiled),
                [(label, isinstance(module, torch.nn.Linear)) for label, (_, module) in zip(self._labels, hooked, strict=True)])
            self._named_in_cpp = compiled and available is not None
            self._compiled.enabled(self.enabled, python_form=not self._named_in_cpp)
        self._refresh()
        if self._compiled is not None:
            self._compiled_step()
        for index, (name, module) in enumerate(hooked):
            self._handles.append(module.register_forward_pre_hook(self._entering(name, module, index)))
            self._handles.append(module.register_forward_hook(self._leaving, always_call=True))

    def __deepcopy__(self, memo: dict[int, Any]) -> ProductChecks:
        # A deep copy of the model (an EMA copy, say) copies its naming hooks, and with them these checks: the
        # compiled kernels they hold cannot be copied, and a second set of checks would watch nothing. The copy's
        # hooks name for these checks, and only inside watching(), which the copy's own forward is not run in.
        return self

    # -- the step's interface -----------------------------------------------------------------------------

    def begin_step(self) -> None:
        """Zero the flags and forget the last step's forward products (call it before the step's passes)."""
        self._flags.zero_()
        self._pending.clear()
        self._spans.clear()
        self._layout.clear()
        self._weight_rows.clear()
        if len(self._weight_buffers) > 2 * len(self._params) + 16:
            self._weight_buffers.clear()  # storages that moved (FSDP2 unshards into fresh ones): keep the live ones
        # Looked up afresh each step: a parameter may have moved (load_state_dict, FSDP2's unsharded storage).
        self._weights = {p.untyped_storage().data_ptr() for p in self._params if type(p) in _PLAIN}
        self._forward_sites.clear()
        self._checked = self._unchecked = 0
        if self._compiled is not None:
            self._compiled_step()

    @property
    def checked(self) -> int:
        """Products checked since the last :meth:`begin_step` (host-side counts; they cost no sync)."""
        return self._checked + (self._compiled.counts()[0] if self._compiled is not None else 0)

    @checked.setter
    def checked(self, value: int) -> None:
        self._checked = value - (self._compiled.counts()[0] if self._compiled is not None else 0)

    @property
    def unchecked(self) -> int:
        """Products seen but not checkable since the last :meth:`begin_step` (a subclass, a dtype, no bound)."""
        return self._unchecked + (self._compiled.counts()[1] if self._compiled is not None else 0)

    @unchecked.setter
    def unchecked(self, value: int) -> None:
        self._unchecked = value - (self._compiled.counts()[1] if self._compiled is not None else 0)

    reset = begin_step

    @contextlib.contextmanager
    def watching(self) -> Iterator[ProductChecks]:
        """Check every product computed inside (forward and backward alike): enter it around the rank's own pass.

        Recomputations of other ranks' micro-batches belong outside it: their flags would be charged to this
        rank's sites."""
        self._refresh()
        self._watching = True
        try:
            # Compiled code (a compiled model, or a function the model calls) calls no operator the interception
            # sees: inside the checks it runs eagerly, as torch.compile's "force_eager" stance makes it.
            with _INTERCEPTION.watched_by(self), torch.compiler.set_stance("force_eager"):
                yield self
        finally:
            self._watching = False
            self._stack.clear()
            if self._compiled is not None:
                self._compiled.end_pass()
            self._judge_pending()

    def _refresh(self) -> None:
        """Read torch's rounding settings and which kernels take the pass over an operand, once per pass: the
        fused Triton kernel where ``SDCGUARD_FINGERPRINT_KERNEL=triton`` sends the rank's device to it (a GPU;
        the CPU under ``TRITON_INTERPRET=1``), else the compiled C kernel on the CPU, else torch."""
        settings = matmul_settings()
        if settings != self._settings:
            self._terms.clear()
            if self._compiled is not None:
                self._compiled.forget_terms()
        self._settings = settings
        self._fused = _triton_products(self.device)
        self._kernel = _native_kernel() if self.device.type == "cpu" and self._fused is None else None
        compiled = self._compiled
        if compiled is not None and compiled.kernel is not self._kernel:
            self._use_kernel(compiled, self._kernel)

    def _use_kernel(self, compiled: native_products.Products, kernel: Any) -> None:
        """The compiled path checks with ``kernel``'s passes (None: sends every product to the Python form)."""
        compiled.use_kernel(kernel)

    def _compiled_step(self) -> None:
        assert self._compiled is not None
        self._compiled.begin_step(self._flags, self._weights, 2 * len(self._params) + 16)

    def _arithmetic(self, operand: torch.dtype, output: torch.dtype, device: torch.device, *,
                    conv: bool) -> Arithmetic | None:
        return Arithmetic.of(operand, output, device, conv=conv, settings=self._settings)

    @property
    def flags(self) -> torch.Tensor:
        """Failing products per site (index into ``sites``), int64 on the device; the last slot also takes any
        site past ``capacity``. Reading it judges any checksums not judged yet (still no host sync)."""
        self._judge_pending()
        return self._flags

    def summary(self) -> torch.Tensor:
        """``[first failing site or -1, number of failing sites]``, int64 on the device (no host sync)."""
        hit = self.flags > 0
        count = hit.sum()
        first = torch.where(count > 0, hit.to(torch.int8).argmax(), torch.full_like(count, -1))
        return torch.stack([first, count])

    def findings(self, gathered: torch.Tensor) -> list[tuple[int, str]]:
        """(rank, site name) of every failing product in ``gathered``: one row per rank, either every rank's
        :meth:`summary` (the first failing site of each) or its whole ``flags`` (every failing site). Site
        indices are this rank's: every rank runs the same model, so the same sites in the same order. Raises
        ``ValueError`` for another width."""
        rows = gathered.detach().to("cpu", torch.int64)
        if rows.dim() != 2 or rows.shape[1] not in (2, self.capacity):
            raise ValueError(f"gathered: expected [world, 2] summaries or [world, {self.capacity}] flags, "
                             f"got {tuple(rows.shape)}")
        found: list[tuple[int, str]] = []
        if rows.shape[1] == 2 and self.capacity != 2:
            for rank, (first, count) in enumerate(rows.tolist()):
                if count > 0:
                    found.append((rank, self.site_name(first)))
            return found
        for rank, index in torch.nonzero(rows > 0).tolist():
            found.append((rank, self.site_name(index)))
        return found

    def site_name(self, index: int) -> str:
        """The name of site ``index`` (``"site <index>"`` for one this rank has not seen)."""
        return self.sites[index] if 0 <= index < len(self.sites) else f"site {index}"

    def remove(self) -> None:
        """Take the naming hooks off the model again (and torch's product operators back to their own kernels
        once no checks are left installed)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self._intercepting:
            self._intercepting = False
            _INTERCEPTION.uninstall()
            if self._compiled is not None:
                self._compiled.close()

    # -- naming ---------------------------------------------------------------------------------------------

    def _entering(self, name: str, module: torch.nn.Module, index: int) -> Any:
        root = index == 0
        if self._named_in_cpp:
            assert self._compiled is not None
            enter = self._compiled.enter

            def cpp_hook(_module: torch.nn.Module, _inputs: Any) -> None:
                if self._watching:
                    enter(index)  # the root's index is 0; the C++ side keeps the stack and the ordinals
            return cpp_hook

        def hook(_module: torch.nn.Module, _inputs: Any) -> None:
            if not self._watching:
                return  # outside the checks (and what torch.compile traces of a module's call there)
            if not self._stack:
                if root:
                    self._ordinal.clear()  # every pass names its products alike
                else:
                    # A submodule run on its own: activation checkpointing recomputing it in the backward. Its
                    # products are named as in its forward.
                    prefix = name + "."
                    for label in [label for label in self._ordinal if label == name or label.startswith(prefix)]:
                        del self._ordinal[label]
            self._stack.append((name, module))
        return hook

    def _leaving(self, _module: torch.nn.Module, _inputs: Any, _output: Any) -> None:
        if self._watching:
            if self._named_in_cpp:
                assert self._compiled is not None
                self._compiled.leave()
            elif self._stack:
                self._stack.pop()

    def _site(self, name: str) -> int:
        index = self._index.get(name)
        if index is None:
            index = min(len(self.sites), self.capacity - 1)
            self._index[name] = index
            self.sites.append(name)
        return index

    def _forward_site(self, conv: bool) -> tuple[str, str]:
        """(the forward product's site base name, its kind), from the module running it."""
        name, module = self._stack[-1] if self._stack else ("", None)
        label = name or "<model>"
        n = self._ordinal.get(label, 0)
        self._ordinal[label] = n + 1
        base = label if n == 0 else f"{label} #{n}"
        if conv:
            return base, "conv"
        return base, "linear" if isinstance(module, torch.nn.Linear) and n == 0 else "matmul"

    # -- checking -------------------------------------------------------------------------------------------

    def on_product(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        """Check one product the mode saw (``func`` ran on ``args`` and returned ``out``)."""
        packet = func.overloadpacket
        node = torch._C._current_autograd_node()
        if self._named_in_cpp:
            self._conv_named_in_cpp(packet, args, kwargs, out, node)  # the C++ kernels take the matrix products
            return
        conv = packet in _CONVS
        # A module's forward running inside a backward node is activation checkpointing's recomputation: its
        # products are forward products (and must not count as the node's own backward products).
        recomputed = node is not None and bool(self._stack)
        if node is None or recomputed:
            if not self.enabled["forward"]:
                return
            base, kind = self._forward_site(conv)
            if not self.enabled[kind]:
                return
            if torch.is_grad_enabled() and (args[0].requires_grad or args[1].requires_grad or (
                    len(args) > 2 and isinstance(args[2], torch.Tensor) and args[2].requires_grad)):
                # Its autograd node was made just before it ran: its sequence number is the last.
                self._forward_sites[torch._C._autograd._get_sequence_nr() - 1] = (base, kind)
            self._check(packet, args, kwargs, out, f"{base} forward (recomputed)" if recomputed else f"{base} forward")
            return
        if not self.enabled["backward"]:
            return
        seq = node._sequence_nr()
        forward = self._forward_sites.get(seq)
        if forward is None:
            base, kind = f"<{node.name()}>", "conv" if conv else "matmul"
        else:
            base, kind = forward
        if not self.enabled[kind]:
            return
        calls = self._node[1] + 1 if self._node[0] == seq else 1
        self._node = (seq, calls)
        if packet == _aten.convolution_backward:
            self._check_conv_backward(args, out, base)
            return
        operand = ("dX" if self._left_operand(node, calls) else "dW") if kind == "linear" else (
            "dA" if self._left_operand(node, calls) else "dB")
        self._check(packet, args, kwargs, out, f"{base} backward {operand}")

    def _conv_named_in_cpp(self, packet: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any,
                           node: Any) -> None:
        """A convolution's product named as :meth:`on_product` names one, through the C++ naming state (the
        matrix products, named there, share the modules' ordinals and the forward sites)."""
        compiled = self._compiled
        assert compiled is not None
        if node is None or compiled.depth() > 0:
            requires_grad = torch.is_grad_enabled() and any(
                isinstance(t, torch.Tensor) and t.requires_grad for t in args[:3])
            label, n, _ = compiled.forward_site(requires_grad)
            if label >= 0:
                base = self._base(label, n)
                self._check(packet, args, kwargs, out,
                            f"{base} forward" if node is None else f"{base} forward (recomputed)")
            return
        if not self.enabled["backward"]:
            return
        seq = node._sequence_nr()
        label, n, index = compiled.backward_site(seq)
        kind = KINDS[index] if label >= 0 else "conv"
        if not self.enabled[kind]:
            return
        base = self._base(label, n) if label >= 0 else f"<{node.name()}>"
        calls = compiled.node_call(seq)
        if packet == _aten.convolution_backward:
            self._check_conv_backward(args, out, base)
            return
        # A convolution run inside a backward node (a custom Function's backward): named as on_product names it.
        left = self._left_operand(node, calls)
        operand = ("dX" if left else "dW") if kind == "linear" else ("dA" if left else "dB")
        self._check(packet, args, kwargs, out, f"{base} backward {operand}")

    def _base(self, label: int, n: int) -> str:
        return self._labels[label] if n == 0 else f"{self._labels[label]} #{n}"

    def _from_compiled(self, op: int, a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, alpha: float,
                       beta: float, out: torch.Tensor, site: str | None) -> None:
        """A matrix product the C++ interception hands to the Python form: named (``site``), or to be named here
        too (None: the Python form wanted)."""
        func = native_products.OPERATORS[op]
        args, kwargs = ((bias, a, b), {"beta": beta, "alpha": alpha}) if bias is not None else ((a, b), {})
        if site is None:
            self.on_product(func, args, kwargs, out)
        else:
            self.check_named(func.overloadpacket, args, kwargs, out, site)

    @staticmethod
    def _left_operand(node: Any, calls: int) -> bool:
        """Whether the ``calls``-th product of a backward ``node`` is the gradient of the forward product's left
        operand. Autograd's formulas (derivatives.yaml) compute the inputs' gradients in argument order, and
        only those of inputs that need one; the shapes cannot tell (a transposed layout, square operands)."""
        edges = node.next_functions
        first = 1 if len(edges) == 3 else 0  # addmm/baddbmm: (bias, left, right); mm/bmm: (left, right)
        needed = [i for i in (first, first + 1) if i < len(edges) and edges[i][0] is not None]
        return calls <= len(needed) and needed[calls - 1] == first

    def check_named(self, packet: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any, site: str) -> None:
        """The Python form's check of one product ``site`` names (``packet`` ran on ``args``, returned ``out``)."""
        self._check(packet, args, kwargs, out, site)

    def _check(self, packet: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any, site: str) -> None:
        if packet == _aten.convolution:
            self._check_conv(args, out, site)
            return
        if packet in (_aten.addmm, _aten.baddbmm):
            bias, a, b = args[0], args[1], args[2]
            beta, alpha = kwargs.get("beta", 1), kwargs.get("alpha", 1)
        else:
            bias, a, b, beta, alpha = None, args[0], args[1], 1, 1
        if not _plain(a, b, out) or (bias is not None and not _plain(bias)):
            self.unchecked += 1
            return
        self._verify_product(a, b, out, bias, float(alpha), float(beta), site)

    def _verify_product(self, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, bias: torch.Tensor | None,
                        alpha: float, beta: float, site: str) -> None:
        """``c = beta·bias + alpha·(a @ b)`` (batched over leading dims), by its row sums ``c 1 = a (b 1)``.

        The operand taken by rows (``b``: its row sums and its rows' absolute sums) is the weight where one
        operand is a parameter, so that those two vectors are computed once per step and serve the products of
        every micro-batch; the other operand (``a``) then costs two matrix-vector products per product, with
        ``b 1`` and with ``|b| 1`` (the bound ``Σ_k |a_ik| Σ_j |b_kj|``), and the result one sum."""
        weights = self._weights
        storage = b.untyped_storage().data_ptr()
        weight_b = storage in weights
        row_bias = bias  # broadcast along the rows (an nn.Linear's), unless swapped below
        swapped = not weight_b and a.untyped_storage().data_ptr() in weights
        if swapped:
            a, b, c = b.mT, a.mT, c.mT
            storage, weight_b = b.untyped_storage().data_ptr(), True
            bias = None if bias is None else bias.expand(c.mT.shape).mT
            row_bias = None if bias is None else bias  # a full matrix now: only the torch form takes it
        p, n = a.shape[-1], c.shape[-1]
        key = (a.dtype, c.dtype, c.device, p, n, bias is not None)
        terms = self._terms.get(key)
        if terms is None:
            terms = self._terms[key] = self._terms_of(a.dtype, c.dtype, c.device, p, n, bias is not None)
            if self._named_in_cpp and a.dtype == c.dtype == torch.float32 and c.device.type == "cpu":
                assert self._compiled is not None
                self._compiled.terms(p, n, bias is not None, None if terms[0] is None else terms[3])
        arithmetic, coefficient, absolute, judge = terms
        if arithmetic is None:
            self.unchecked += 1
            return
        if self._kernel is not None and self._verdict(a, b, storage if weight_b else None, c, row_bias, alpha, beta,
                                                      judge, site):
            return
        if bias is not None and not swapped:
            bias = bias.expand(c.shape)
        work = torch.float64 if a.dtype == torch.float64 else torch.float32
        sums_b, abs_sums_b = self._row_stats(b, work)
        if self._fused is not None and self._fused_row_check(a, sums_b, abs_sums_b, c, row_bias, alpha, beta):
            self._queued(arithmetic, coefficient, absolute, c.shape[:-1].numel(), site)
            return
        observed = c.sum(-1, dtype=work)
        fused = self._dual(a, sums_b, abs_sums_b)
        if fused is not None:
            expected, bound = fused
        else:
            expected = _matvec(self._widened(a, work, 1), sums_b)
            bound = _matvec(self._absolute(a, work, 0), abs_sums_b)
        if alpha != 1:
            expected, bound = expected * alpha, bound * abs(alpha)
        if bias is not None and beta != 0:
            sum_bias, abs_bias = _row_sums(bias.mT, work)
            expected = expected + beta * sum_bias
            bound = bound + abs(beta) * abs_bias
        self._judge(observed, expected, bound, coefficient, absolute, arithmetic, site)

    def _terms_of(self, operand: torch.dtype, output: torch.dtype, device: torch.device, p: int, n: int,
                  bias: bool) -> tuple[Arithmetic | None, float, float, tuple[float, float, float]]:
        """(arithmetic, coefficient, underflow term, and the three as the compiled verdict takes them: the
        coefficient times ``margin``, the underflow term, the limit below which a bound is judged) of a product of
        ``p``-long accumulations into ``n`` columns; arithmetic None where no bound applies (a dtype not checked,
        or no finite coefficient)."""
        arithmetic = self._arithmetic(operand, output, device, conv=False)
        coefficient = math.inf if arithmetic is None else arithmetic.coefficient(p + (2 if bias else 0), n)
        if arithmetic is None or not coefficient < math.inf:
            return None, math.inf, math.inf, (math.inf, math.inf, 0.0)
        absolute = arithmetic.absolute(p, n)
        return arithmetic, coefficient, absolute, (coefficient * self.margin, absolute,
                                                   arithmetic.largest / (1 + coefficient))

    def _verdict(self, a: torch.Tensor, b: torch.Tensor, weight_b: int | None, c: torch.Tensor,
                 bias: torch.Tensor | None, alpha: float, beta: float, judge: tuple[float, float, float],
                 site: str) -> bool:
        """The whole check of an fp32 CPU product, judged, by the compiled kernel in one call
        (``sdcguard.agent.native``'s ``sdc_row_verdict``, where torch takes a dozen operations): a failing product
        counted straight into ``flags``, with the row sums of ``b`` computed in the same call unless ``b`` is a
        weight (``weight_b``: its storage's address; then they are the step's, computed once). False where it does
        not apply (then the torch form runs)."""
        a_strides, b_strides, c_strides = a.stride(), b.stride(), c.stride()
        dims = len(a_strides)
        if a.dtype != torch.float32 or b.dtype != torch.float32 or c.dtype != torch.float32 or (
                dims not in (2, 3) or len(b_strides) != dims or len(c_strides) != dims) or not a.is_cpu or (
                a_strides[-1] != 1 and a_strides[-2] != 1) or (c_strides[-1] != 1 and c_strides[-2] != 1):
            return False
        bias_at, bias_stride = None, 0
        if bias is not None and beta != 0:
            # Only a bias broadcast along the rows (an nn.Linear's): one row of n, or one value.
            if bias.dtype != torch.float32 or bias.numel() != bias.shape[-1] or bias.shape[-1] not in (1, c.shape[-1]):
                return False
            bias_at, bias_stride = bias.data_ptr(), bias.stride(-1) if bias.shape[-1] > 1 else 0
        shape = a.shape
        batch, r, p = (shape[0], shape[1], shape[2]) if dims == 3 else (1, shape[0], shape[1])
        n = c.shape[-1]
        if weight_b is not None:
            s, t = self._row_stats(b, torch.float32, weight_b)
            if not (s.is_contiguous() and t.is_contiguous()):
                s, t = s.contiguous(), t.contiguous()
            b_at, b_batch, b_row, b_col, ones = None, 0, 0, 0, None
            s_at, t_at, vectors = s.data_ptr(), t.data_ptr(), p if s.dim() == 2 and s.shape[0] > 1 else 0
        elif b_strides[-1] == 1 or b_strides[-2] == 1:
            b_at, b_batch, b_row, b_col = b.data_ptr(), b_strides[0] if dims == 3 else 0, b_strides[-2], b_strides[-1]
            ones, s_at, t_at, vectors = self._ones(n, b.device).data_ptr(), None, None, 0
        else:
            return False
        needed = r + 2 * batch * (r + p)
        if self._work.numel() < needed:
            self._work = torch.empty(needed, dtype=torch.float32, device="cpu")
        index = self._site(site)
        kernel = self._kernel
        if kernel is None or kernel.lib.sdc_row_verdict(
                a.data_ptr(), batch, r, p, a_strides[0] if dims == 3 else 0, a_strides[-2], a_strides[-1],
                b_at, b_batch, b_row, b_col, ones, s_at, t_at, vectors, c.data_ptr(), n,
                c_strides[0] if dims == 3 else 0, c_strides[-2], c_strides[-1], alpha, bias_at, bias_stride, beta,
                kernel.isa, self._work.data_ptr(), judge[0], judge[1], judge[2],
                self._flags.data_ptr() + 8 * index) != 0:
            return False
        self.checked += 1
        return True

    def _fused_row_check(self, a: torch.Tensor, s: torch.Tensor, t: torch.Tensor, c: torch.Tensor,
                         bias: torch.Tensor | None, alpha: float, beta: float) -> bool:
        """The whole check of a product by the fused Triton kernel (``triton_products.row_check``: one launch where
        torch takes five to eleven operations, no copy of an operand), written straight into the pass's rows on
        the device; False where it does not apply (then the torch form runs)."""
        fused = self._fused
        reads = fused.READS
        if a.device.type != self.device.type or not fused.readable(a, s) or c.dtype not in reads or (
                bias is not None and beta != 0 and (bias.dtype not in reads or bias.numel() != bias.shape[-1]
                                                    or bias.shape[-1] not in (1, c.shape[-1]))):
            return False
        rows = c.shape[:-1].numel()
        start = self._reserve(rows)
        fused.row_check(a, s, t, c, bias if beta != 0 else None, alpha, beta, self._rows, start)
        self._pending.append(None)
        self._spans.append((start, start + rows))
        return True

    def _reserve(self, count: int) -> int:
        """The start of ``count`` fresh slots of ``_rows`` after the pass's last (grown, kept, as needed)."""
        start = self._spans[-1][1] if self._spans else 0
        if start + count > self._rows.shape[1]:
            grown = torch.empty(2, max(2 * self._rows.shape[1], start + count, 4096), dtype=torch.float32,
                                device=self._rows.device)
            grown[:, :start] = self._rows[:, :start]
            self._rows = grown
        return start

    def _row_stats(self, b: torch.Tensor, work: torch.dtype,
                   storage: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(b 1, |b| 1)``: the row sums of ``b`` and of its absolute values, in ``work``. A parameter's are kept
        for the step, keyed by its storage, layout and version (the weights do not change inside a step; the
        entry holds no tensor of its own). ``storage``: ``b``'s storage's address, where the caller has it."""
        if storage is None:
            storage = b.untyped_storage().data_ptr()
        if storage not in self._weights:
            return self._row_sums_of(b, work)
        shape, strides = tuple(b.shape), b.stride()
        key = (storage, b.storage_offset(), shape, strides, b.dtype, b._version, work)
        stats = self._weight_rows.get(key)
        if stats is None:
            if self._kernel is not None and len(shape) == 2 and b.dtype == work == torch.float32 and (
                    b.device.type == "cpu") and 1 in strides:
                return self._weight_sums(b, key)
            stats = self._weight_rows[key] = self._row_sums_of(b, work)
        return stats

    def _weight_sums(self, w: torch.Tensor, key: tuple[Any, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """A 2-D fp32 CPU weight's row sums and absolute row sums, and those of its transpose, by two compiled
        passes in a row: the forward takes one layout of a weight and the input's gradient the other. Both are
        kept for the step; the first is returned."""
        rows, cols = w.shape
        row_stride, col_stride = w.stride()
        storage, offset, _, _, dtype, version, work = key
        place = (storage, offset, rows, cols, row_stride, col_stride)
        buffers = self._weight_buffers.get(place)
        if buffers is None:
            by_rows = torch.empty(2, rows, dtype=torch.float32, device="cpu")
            by_columns = torch.empty(2, cols, dtype=torch.float32, device="cpu")
            sums, magnitudes = by_rows.unbind(0)
            sums_t, magnitudes_t = by_columns.unbind(0)
            self._weight_buffers[place] = ((sums, magnitudes), (sums_t, magnitudes_t))
        else:
            (sums, magnitudes), (sums_t, magnitudes_t) = buffers
        at, across = sums.data_ptr(), sums_t.data_ptr()
        ones = self._ones(max(rows, cols), w.device).data_ptr()
        kernel = self._kernel
        assert kernel is not None  # _row_stats sends a weight here only with the compiled kernel loaded
        dual, isa = kernel.lib.sdc_dual_matvec, kernel.isa
        if dual(w.data_ptr(), 1, rows, cols, 0, row_stride, col_stride, ones, ones, 0, isa, at, at + 4 * rows) != 0 or (
                dual(w.data_ptr(), 1, cols, rows, 0, col_stride, row_stride, ones, ones, 0, isa, across,
                     across + 4 * cols) != 0):
            raise RuntimeError(f"the compiled pass refused a weight of strides {(row_stride, col_stride)}")
        transposed = (storage, offset, (cols, rows), (col_stride, row_stride), dtype, version, work)
        stats = self._weight_rows[key] = (sums, magnitudes)
        self._weight_rows[transposed] = (sums_t, magnitudes_t)
        return stats

    def _row_sums_of(self, b: torch.Tensor, work: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        ones = self._ones(b.shape[-1], b.device)
        fused = self._dual(b, ones, ones)
        if fused is not None:
            return fused
        return b.sum(-1, dtype=work), self._absolute(b, work, 2).sum(-1)

    def _ones(self, n: int, device: torch.device) -> torch.Tensor:
        ones = self._ones_cache.get(n)
        if ones is None or ones.device != device:
            ones = self._ones_cache[n] = torch.ones(n, dtype=torch.float32, device=device)
        return ones

    def _dual(self, a: torch.Tensor, s: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(a @ s, |a| @ t)`` in one read of ``a``: by the fused Triton kernel where it is chosen (an fp16,
        bf16 or fp32 operand with fp32 vectors, any strides: ``sdcguard.agent.kernels.triton_products``), else
        for an fp32 CPU operand by the compiled kernel (``sdcguard.agent.native``). Torch takes up to five
        passes and two copies of ``a`` (widened, absolute). None where neither applies (then torch runs)."""
        fused = self._fused
        if fused is not None and a.device.type == self.device.type and fused.readable(a, s):
            return fused.dual_matvec(a, s, t)
        kernel = self._kernel
        if kernel is None or a.device.type != "cpu" or a.dtype != torch.float32 or a.dim() not in (2, 3) or (
                s.dtype != a.dtype) or (a.stride(-1) != 1 and a.stride(-2) != 1):
            return None
        *batch, r, p = a.shape
        vectors = s.dim() == 2 and s.shape[0] > 1
        s, t = s.contiguous(), t.contiguous()
        out = torch.empty(2, *batch, r, dtype=torch.float32, device="cpu")
        kernel.dual_matvec(a.data_ptr(), (batch[0] if batch else 1, r, p),
                           (a.stride(0) if batch else 0, a.stride(-2), a.stride(-1)),
                           s.data_ptr(), t.data_ptr(), p if vectors else 0, out[0].data_ptr(), out[1].data_ptr())
        return out[0], out[1]

    def _scratch_like(self, t: torch.Tensor, dtype: torch.dtype, slot: int) -> torch.Tensor:
        """An uninitialised CPU tensor of ``t``'s shape (contiguous) from scratch buffer ``slot``: a fresh
        allocation of this size costs its page faults on every call, more than the pass that fills it."""
        scratch = self._scratch.get((dtype, slot))
        if scratch is None or scratch.numel() < t.numel():
            scratch = self._scratch[(dtype, slot)] = torch.empty(t.numel(), dtype=dtype, device="cpu")
        return scratch[:t.numel()].view(t.shape)

    def _widened(self, t: torch.Tensor, work: torch.dtype, slot: int) -> torch.Tensor:
        """``t`` in ``work`` (itself when it already is), in ``t``'s own memory order."""
        if t.dtype == work:
            return t
        if t.device.type != "cpu":
            return t.to(work)
        transposed = _transposed(t)
        source = t.mT if transposed else t
        wide = self._scratch_like(source, work, slot).copy_(source)
        return wide.mT if transposed else wide

    def _absolute(self, t: torch.Tensor, work: torch.dtype, slot: int) -> torch.Tensor:
        """``|t|`` in ``work``, in ``t``'s own memory order (a transposed copy is several times slower); on the
        CPU in scratch buffer ``slot``, valid until that slot is used again."""
        if t.device.type != "cpu":
            return t.abs() if t.dtype == work else t.abs().to(work)
        transposed = _transposed(t)
        source = self._widened(t.mT if transposed else t, work, 3)
        absolute = torch.abs(source, out=self._scratch_like(source, work, slot))
        return absolute.mT if transposed else absolute

    def _judge(self, observed: torch.Tensor, expected: torch.Tensor, bound: torch.Tensor, coefficient: float,
               absolute: float, arithmetic: Arithmetic, site: str) -> None:
        """Queue the checksums of ``site`` to be judged with the pass's others (:meth:`_judge_pending`).

        The test, per checksum: ``|observed - expected| <= coefficient · bound + absolute``, false for a NaN too:
        an infinite or NaN checksum from finite operands is a fault, unless the bound reaches the dtype's range
        (a legitimate overflow, as a GradScaler's fp16 step has); operands that are not finite leave ``bound``
        not finite, and such a product is the non-finite check's."""
        difference = torch.sub(observed, expected).abs_()
        self._pending.append((difference.reshape(-1), bound.expand_as(difference).reshape(-1)))
        self._queued(arithmetic, coefficient, absolute, difference.numel(), site)

    def _queued(self, arithmetic: Arithmetic, coefficient: float, absolute: float, count: int, site: str) -> None:
        """Enter the product just queued (``count`` checksums of ``site``) in the pass's layout."""
        self._layout.append((self._site(site), count, coefficient * self.margin, absolute,
                             arithmetic.largest / (1 + coefficient)))
        self.checked += 1

    def _judge_pending(self) -> None:
        """Judge every queued checksum at once and count the failing products per site into ``flags``: a few
        device operations per pass instead of several per product, and still no host synchronisation."""
        if not self._pending:
            return
        key = tuple(self._layout)
        vectors = self._layouts.get(key)
        if vectors is None:
            vectors = self._layouts[key] = self._layout_vectors(self._layout)
            while len(self._layouts) > _LAYOUTS:
                del self._layouts[next(iter(self._layouts))]
        coefficients, absolutes, limits, product_of, site_of = (
            vectors.coefficients, vectors.absolutes, vectors.limits, vectors.product_of, vectors.site_of)
        if all(entry is None for entry in self._pending):
            differences, bounds = self._rows[:, :self._spans[-1][1]]
        else:
            spans = iter(self._spans)
            pieces = [entry if entry is not None else tuple(self._rows[:, slice(*next(spans))])
                      for entry in self._pending]
            differences = torch.cat([d for d, _ in pieces])
            bounds = torch.cat([e for _, e in pieces])
        self._pending.clear()
        self._spans.clear()
        self._layout.clear()
        within = differences <= torch.addcmul(absolutes, bounds, coefficients)
        failing = (bounds < limits) > within
        products = torch.zeros(site_of.numel(), dtype=torch.int64, device=self._flags.device)
        products.index_add_(0, product_of, failing.to(torch.int64))
        self._flags.index_add_(0, site_of, (products > 0).to(torch.int64))

    def _layout_vectors(self, layout: Sequence[tuple[int, int, float, float, float]]) -> _Layout:
        """Per checksum: the coefficient, the underflow term and the representable limit; the product of each
        checksum and the site of each product, on the device (built once per layout; copied from pinned memory
        without blocking on a GPU). The host tensors are kept with them for that copy's sake."""
        sites = [site for site, *_ in layout]
        lengths = [length for _, length, *_ in layout]
        per_product = torch.tensor([entry[2:] for entry in layout], dtype=torch.float64, device="cpu").T.contiguous()
        host: tuple[torch.Tensor, ...] = (per_product, torch.tensor(sites, dtype=torch.int64, device="cpu"),
                                          torch.tensor(lengths, dtype=torch.int64, device="cpu"),
                                          torch.arange(len(layout), device="cpu"))
        device = self._flags.device
        if device.type == "cuda" and torch.cuda.is_available():
            host = tuple(t.pin_memory() for t in host)
        per_product_d, sites_d, lengths_d, products_d = (t.to(device, non_blocking=True) for t in host)
        total = sum(lengths)
        expanded = torch.repeat_interleave(per_product_d, lengths_d, dim=1, output_size=total)
        product_of = torch.repeat_interleave(products_d, lengths_d, output_size=total)
        coefficients, absolutes, limits = expanded.unbind(0)
        return _Layout(coefficients, absolutes, limits, product_of, sites_d, host)

    # -- convolutions ------------------------------------------------------------------------------------------

    def _check_conv(self, args: tuple[Any, ...], out: torch.Tensor, site: str) -> None:
        x, w, bias, stride, padding, dilation, transposed, _output_padding, groups = args[:9]
        if transposed or not _plain(x, w, out) or (bias is not None and not _plain(bias)):
            self.unchecked += 1
            return
        arithmetic = self._arithmetic(x.dtype, out.dtype, out.device, conv=True)
        if arithmetic is None:
            self.unchecked += 1
            return
        g = int(groups)
        c_out = w.shape[0]
        p = w[0].numel()  # input channels per group x kernel: each output element's accumulation length
        m = c_out // g
        work = torch.float64 if x.dtype == torch.float64 else torch.float32
        # Σ over each group's output channels: conv with the group's filters summed (one output channel per group).
        w_groups = w.to(work).reshape(g, m, *w.shape[1:])
        x_work = x.to(work)
        conv = _conv_of(x.dim())
        expected = conv(x_work, w_groups.sum(1), None, stride, padding, dilation, g)
        bound = conv(x_work.abs(), w_groups.abs().sum(1), None, stride, padding, dilation, g)
        observed = out.reshape(out.shape[0], g, m, *out.shape[2:]).sum(2, dtype=work)
        if bias is not None:
            b = bias.to(work).reshape(g, m)
            shape = (1, g) + (1,) * (out.dim() - 2)
            expected = expected + b.sum(1).reshape(shape)
            bound = bound + b.abs().sum(1).reshape(shape)
        coefficient = arithmetic.coefficient(p + 2, m)
        if not coefficient < math.inf:
            self.unchecked += 1
            return
        self._judge(observed, expected, bound, coefficient, arithmetic.absolute(p, m), arithmetic, site)

    def _check_conv_backward(self, args: tuple[Any, ...], out: Any, base: str) -> None:
        dy, x, w, _bias_sizes, stride, padding, dilation, transposed, output_padding, groups, mask = args[:11]
        dx, dw = out[0], out[1]
        if transposed or not _plain(dy, x, w):
            self.unchecked += 1
            return
        g = int(groups)
        c_out, c_in_g = w.shape[0], w.shape[1]
        m_out = c_out // g
        work = torch.float64 if x.dtype == torch.float64 else torch.float32
        dy_work, x_work, w_work = dy.to(work), x.to(work), w.to(work)
        spatial = tuple(x.shape[2:])
        if mask[0] and isinstance(dx, torch.Tensor) and _plain(dx):
            arithmetic = self._arithmetic(dy.dtype, dx.dtype, dx.device, conv=True)
            # Σ over each group's input channels of dX: the input gradient of the filters summed over theirs.
            w_sum = w_work.sum(1, keepdim=True)
            w_abs = w_work.abs().sum(1, keepdim=True)
            shape_only = x_work.new_empty(()).expand(x.shape[0], g, *spatial)
            expected = _aten.convolution_backward(dy_work, shape_only, w_sum, None, stride, padding, dilation,
                                                  False, output_padding, g, [True, False, False])[0]
            bound = _aten.convolution_backward(dy_work.abs(), shape_only, w_abs, None, stride, padding, dilation,
                                               False, output_padding, g, [True, False, False])[0]
            observed = dx.reshape(dx.shape[0], g, c_in_g, *spatial).sum(2, dtype=work)
            p = m_out * math.prod(w.shape[2:])
            self._judge_if(arithmetic, observed, expected, bound, p, c_in_g, f"{base} backward dX")
        if mask[1] and isinstance(dw, torch.Tensor) and _plain(dw):
            arithmetic = self._arithmetic(dy.dtype, dw.dtype, dw.device, conv=True)
            # Σ over each group's output channels of dW: the weight gradient of dY summed over them.
            dy_sum = dy_work.reshape(dy.shape[0], g, m_out, *dy.shape[2:]).sum(2)
            dy_abs = dy_work.abs().reshape(dy.shape[0], g, m_out, *dy.shape[2:]).sum(2)
            shape_only = w_work.new_empty(()).expand(g, c_in_g, *w.shape[2:])
            expected = _aten.convolution_backward(dy_sum, x_work, shape_only, None, stride, padding, dilation,
                                                  False, output_padding, g, [False, True, False])[1]
            bound = _aten.convolution_backward(dy_abs, x_work.abs(), shape_only, None, stride, padding, dilation,
                                               False, output_padding, g, [False, True, False])[1]
            observed = dw.reshape(g, m_out, c_in_g, *w.shape[2:]).sum(1, dtype=work)
            p = dy.shape[0] * math.prod(dy.shape[2:])
            self._judge_if(arithmetic, observed, expected, bound, p, m_out, f"{base} backward dW")

    def _judge_if(self, arithmetic: Arithmetic | None, observed: torch.Tensor, expected: torch.Tensor,
                  bound: torch.Tensor, p: int, m: int, site: str) -> None:
        coefficient = arithmetic.coefficient(p + 2, m) if arithmetic is not None else math.inf
        if arithmetic is None or not coefficient < math.inf:
            self.unchecked += 1
            return
        self._judge(observed, expected, bound, coefficient, arithmetic.absolute(p, m), arithmetic, site)


class _Interception:
    """The product operators' kernels at torch's ``ADInplaceOrView`` dispatch key, below autograd and autocast and
    above any dispatch mode and the device's kernel: each runs the operator as it is, then hands the product and
    its result to the checks inside :meth:`ProductChecks.watching`.

    Only these operators enter Python (a dispatch mode would take every operator of the pass there, which on the
    GPT example cost more than the checks). Autograd has already made the product's node and, in the backward,
    runs it as the current node, so the sites are named as under a mode; a dispatch mode around the step (the
    campaign's fault injectors) runs below, and its results are what the checks see. The key's kernel for these
    operators is otherwise a fallthrough (they are neither views nor in place); registered while checks are
    installed, the operators run through it unchecked outside :meth:`ProductChecks.watching`.

    Checked: products made on the thread that entered :meth:`ProductChecks.watching` and those of the autograd
    engine's backward (on a GPU its own thread); another thread's products pass unchecked."""

    OPERATORS = (_aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default,
                 _aten.convolution.default, _aten.convolution_backward.default)

    def __init__(self) -> None:
        self._library: Any = None
        self.library: Any = None
        """The compiled path's library while its C++ kernels take the matrix products (else None)."""
        self._installed = 0
        self._watchers: list[ProductChecks] = []
        self._thread = 0

    def install(self, compiled: Any = None) -> None:
        """Installed with the first checks (``compiled``: the compiled path's library, whose C++ kernels then take
        the four matrix-product operators; the convolutions stay here) and kept while any checks are."""
        if self._installed == 0:
            operators: tuple[Any, ...] = self.OPERATORS
            if compiled is not None:
                native_products.install(compiled)
                self.library = compiled
                operators = tuple(op for op in operators if op not in native_products.OPERATORS)
            library = torch.library.Library("aten", "IMPL")
            with warnings.catch_warnings():
                # "Overriding a previously registered kernel": the key's fallthrough for these operators.
                warnings.simplefilter("ignore", UserWarning)
                for operator in operators:
                    library.impl(operator._schema.name.removeprefix("aten::"), self._kernel(operator),
                                 "ADInplaceOrView")
            self._library = library
        self._installed += 1

    def uninstall(self) -> None:
        self._installed -= 1
        if self._installed == 0 and self._library is not None:
            self._library._destroy()
            self._library = None
            if self.library is not None:
                native_products.uninstall(self.library)
                self.library = None

    @contextlib.contextmanager
    def watched_by(self, checks: ProductChecks) -> Iterator[None]:
        thread = self._thread
        self._thread = threading.get_ident()
        self._watchers.append(checks)
        compiled = checks._compiled if self.library is not None else None
        if compiled is not None:
            compiled.watch()
        try:
            yield
        finally:
            if compiled is not None:
                compiled.unwatch()
            self._watchers.remove(checks)
            self._thread = thread

    def _kernel(self, operator: Any) -> Any:
        watchers = self._watchers
        below = torch._C._AutoDispatchBelowADInplaceOrView

        def kernel(*args: Any, **kwargs: Any) -> Any:
            with below():
                out = operator(*args, **kwargs)
            if watchers and (threading.get_ident() == self._thread or torch._C._current_autograd_node() is not None):
                for checks in reversed(watchers):  # innermost first, as nested modes would see it
                    checks.on_product(operator, args, kwargs, out)
            return out
        return kernel


_INTERCEPTION = _Interception()


def _weak(owner: ProductChecks, method: Any) -> Any:
    """``method`` of ``owner`` as a callback the compiled path holds: through a weak reference, so that holding
    it keeps nothing alive."""
    ref = weakref.ref(owner)

    def call(*args: Any) -> Any:
        target = ref()
        if target is None:
            raise RuntimeError("product checks: called after they were freed")
        return method(target, *args)
    return call


def _plain(*tensors: Any) -> bool:
    """Plain (not subclass: not an FSDP2 DTensor, not a fake tensor) floating tensors with elements."""
    for t in tensors:  # noqa: SIM110 (a loop, not all() over a generator: this runs for every product)
        if type(t) not in _PLAIN or not t.is_floating_point() or t.numel() == 0:
            return False
    return True


def _compiled(module: torch.nn.Module) -> bool:
    """Whether ``module`` runs through torch.compile (``torch.compile(module)``'s wrapper, or ``module.compile()``)."""
    return type(module).__module__.startswith("torch._dynamo") or getattr(module, "_compiled_call_impl", None) is not None


def _triton_products(device: torch.device) -> Any:
    """``sdcguard.agent.kernels.triton_products`` where the setting sends ``device``'s tensors to the Triton
    kernels (``sdcguard.agent.fingerprint.triton_kernels_for``, the one place they are chosen), else None."""
    from sdcguard.agent import fingerprint

    if fingerprint.triton_kernels_for(device) is None:
        return None
    from sdcguard.agent.kernels import triton_products

    return triton_products


def _native_kernel() -> Any:
    """The compiled kernel, or None (not built, refused, or ``SDCGUARD_FINGERPRINT_KERNEL=torch``)."""
    from sdcguard.agent import native

    return native.kernel()


def _transposed(t: torch.Tensor) -> bool:
    """Whether ``t``'s last two dims are stored transposed (its ``.mT`` is the row-major one)."""
    return t.dim() >= 2 and t.stride(-1) != 1 and t.stride(-2) == 1


def _matvec(m: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``m @ v`` for ``m`` ``[..., r, p]`` and ``v`` ``[..., p]``: ``[..., r]`` (a BLAS matrix-vector product on
    ``m``'s own layout, transposed or not)."""
    if m.dim() == 2:
        return torch.mv(m, v)
    return torch.matmul(m, v.unsqueeze(-1)).squeeze(-1)


def _row_sums(t: torch.Tensor, work: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Σ over dim -2 of ``t`` and of ``|t|``, reading a broadcast (stride-0) dimension once."""
    rows = t.shape[-2]
    if t.stride(-2) == 0:
        one = t.select(-2, 0).to(work)
        return one * rows, one.abs() * rows
    if t.stride(-1) == 0:
        column = t.select(-1, 0)
        total = column.sum(-1, dtype=work, keepdim=True).expand(*t.shape[:-2], t.shape[-1])
        absolute = torch.linalg.vector_norm(column, 1, dim=-1, dtype=work, keepdim=True).expand_as(total)
        return total, absolute
    return t.sum(-2, dtype=work), torch.linalg.vector_norm(t, 1, dim=-2, dtype=work)


def _conv_of(rank: int) -> Any:
    """``F.conv1d/2d/3d`` for an input of ``rank`` dimensions (batch and channel included)."""
    return {3: torch.nn.functional.conv1d, 4: torch.nn.functional.conv2d, 5: torch.nn.functional.conv3d}[rank]


__all__ = ["COUNT", "FIRST", "KINDS", "Arithmetic", "ProductChecks", "gamma"]
