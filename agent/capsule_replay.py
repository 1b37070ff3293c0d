"""Replaying a capsule on this machine's device: does it compute the failing step's healthy bits?

:func:`replay` verifies the capsule (:func:`sdcguard.agent.capsule.load_capsule`),
picks this machine's device of the capsule's kind, applies the capsule's
settings (threads, determinism flags, TF32, SDPA backends) for the duration,
rebuilds the model through the recorded factory and loads the capsule's state
into it strictly, checks the environment signature
(:mod:`sdcguard.agent.determinism`), and recomputes the step N times with
:func:`sdcguard.agent.recompute.recompute_step`, the recomputation the ring audit and
the confirmation run, comparing every repetition's loss bits and gradient
fingerprints with the expected ones. What makes a capsule unusable here is a
:class:`CapsuleUnusable` with a :data:`Problem`, reported, never raised to
the caller of :func:`replay`. ``sdcguard replay`` is its command line; the
report's JSON is what the pipeline's Kubernetes Job will read. A simulated
fault in ``SDCGUARD_INJECT`` acts on the replay as on the training rank it
names (:func:`injected`), so drills and tests see a faulty node reproduce.

A capsule is untrusted input: whoever can write under the checkpoint prefix
(the job's tenant) writes its manifest, and its digests prove only that it
was not changed after it was written, not who wrote it. The factory it
names is the one thing a replay runs of it, so that factory is imported only
when a :class:`FactoryAllowList` holds it (the job's configured
``SDCGUARD_CAPSULE_FACTORY``, ``SDCGUARD_REPLAY_FACTORIES``, ``sdcguard
replay --allow-factory``), and this is decided on the manifest alone,
before any object of the capsule is read and before anything is imported.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
import socket
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal

import torch
from torch import nn

from sdcguard.agent import determinism
from sdcguard.agent import replay as seeding
from sdcguard.agent.capsule import (
    FACTORY_SPEC,
    Capsule,
    CapsuleCorrupt,
    CapsuleError,
    CapsuleManifest,
    CapsuleNotFound,
    Expected,
    ReplaySettings,
    load_capsule,
    map_tensors,
)
from sdcguard.agent.determinism import environment_signature, signature_differences
from sdcguard.agent.recompute import recompute_step
from sdcguard.agent.testing.inject import ENV_VAR, Injector, from_env
from sdcguard.lineage.errors import LineageError
from sdcguard.lineage.store import ObjectStore

REPORT_SCHEMA_VERSION: Final = "1"
"""The version of :meth:`ReplayReport.to_dict`'s object."""

Problem = Literal["missing", "corrupt", "device", "signature", "factory", "model", "injection"]
"""Why a capsule cannot be used here: no capsule at the location, a changed or missing object, no device of
its kind, another software or hardware signature, a factory that does not import or build, a model unlike
the capsule's state, or a malformed ``SDCGUARD_INJECT``."""


class CapsuleUnusable(CapsuleError):
    """A sound capsule that cannot be replayed here (another device, signature, or a factory that fails)."""

    def __init__(self, problem: Problem, reasons: Sequence[str]) -> None:
        super().__init__(f"{problem}: " + "; ".join(reasons))
        self.problem: Problem = problem
        self.reasons = list(reasons)


CONFIGURED_FACTORY_VAR: Final = "SDCGUARD_CAPSULE_FACTORY"
"""The job's configured factory (``GuardConfig.capsule_factory``'s variable): in the training container's
environment, which the pipeline's node-check Job copies, it is what a replay there admits by default."""
ALLOWED_FACTORIES_VAR: Final = "SDCGUARD_REPLAY_FACTORIES"
"""More factories a replay admits: ``package.module:function`` names, comma-separated."""
ALLOW_FLAG: Final = "--allow-factory"
"""``sdcguard replay``'s flag that admits one more factory (repeatable)."""


@dataclass(frozen=True)
class FactoryAllowList:
    """The factories a replay may import and call, by where each came from: nothing else of a capsule runs.

    A capsule names its factory itself, so the capsule cannot be what decides
    that the factory is safe to run: the job's configuration, the replaying
    machine's settings or the operator's command line decides.
    """

    configured: str | None = None
    """The job's configured factory (:data:`CONFIGURED_FACTORY_VAR`), None when it is not set."""
    setting: tuple[str, ...] = ()
    """From :data:`ALLOWED_FACTORIES_VAR`."""
    flags: tuple[str, ...] = ()
    """From ``--allow-factory`` (or the caller of :func:`replay`)."""

    def __post_init__(self) -> None:
        for source, specs in (("configured", (self.configured,) if self.configured else ()),
                              ("setting", self.setting), ("flags", self.flags)):
            for spec in specs:
                if not FACTORY_SPEC.fullmatch(spec):
                    raise ValueError(f"{source}: {spec!r} is not package.module:function")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, *, flags: Sequence[str] = ()) -> FactoryAllowList:
        """The allow-list of this process: :data:`CONFIGURED_FACTORY_VAR`, :data:`ALLOWED_FACTORIES_VAR`
        (comma-separated) and ``flags``. Raises :class:`ValueError` naming the variable whose value is not
        ``package.module:function`` names."""
        env = os.environ if env is None else env
        configured = env.get(CONFIGURED_FACTORY_VAR, "").strip() or None
        setting = tuple(s.strip() for s in env.get(ALLOWED_FACTORIES_VAR, "").split(",") if s.strip())
        if configured is not None and not FACTORY_SPEC.fullmatch(configured):
            raise ValueError(f"{CONFIGURED_FACTORY_VAR}: {configured!r} is not package.module:function")
        for spec in setting:
            if not FACTORY_SPEC.fullmatch(spec):
                raise ValueError(f"{ALLOWED_FACTORIES_VAR}: {spec!r} is not package.module:function "
                                 f"(a comma-separated list of them)")
        return cls(configured=configured, setting=setting, flags=tuple(flags))

    def admits(self, spec: str) -> bool:
        """Whether ``spec`` is on the list, exactly (no patterns: a module's other functions are not admitted)."""
        return spec == self.configured or spec in self.setting or spec in self.flags

    def describe(self) -> str:
        """Where each admitted factory came from, for the refusal."""
        return (f"{CONFIGURED_FACTORY_VAR}={self.configured or '(unset)'}, "
                f"{ALLOWED_FACTORIES_VAR}={','.join(self.setting) or '(unset)'}, "
                f"{ALLOW_FLAG}: {', '.join(self.flags) or 'none'}")

    def admit(self, manifest: CapsuleManifest) -> None:
        """Raises :class:`CapsuleUnusable` ("factory") when the manifest's factory is not on the list; imports
        nothing."""
        if self.admits(manifest.factory):
            return
        raise CapsuleUnusable("factory", [
            f"the capsule names factory {manifest.factory!r}, which is not on this replay's allow-list "
            f"({self.describe()}); a capsule is untrusted input and its factory is imported only when allowed: "
            f"if you trust that function, rerun with {ALLOW_FLAG} {manifest.factory}"])


def replay_device(device_type: str) -> torch.device | None:
    """The device a capsule recorded on ``device_type`` replays on here (None: there is none): the rank's
    GPU (``LOCAL_RANK``, else 0) for "cuda", the CPU for "cpu"."""
    if device_type == "cpu":
        return torch.device("cpu")
    if device_type == "cuda" and torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    return None


@contextlib.contextmanager
def applied(settings: ReplaySettings, device: torch.device) -> Iterator[None]:
    """Torch's global settings as ``settings`` recorded them, for the duration (restored afterwards)."""
    before = ReplaySettings.capture(nn.Module(), seed=0, step=0, rank=0)
    if device.type == "cuda":
        # Read by cuBLAS when its first handle is made: set before any matrix product on this device.
        if settings.cublas_workspace and not os.environ.get("CUBLAS_WORKSPACE_CONFIG"):
            os.environ["CUBLAS_WORKSPACE_CONFIG"] = settings.cublas_workspace
        torch.cuda.set_device(device)
    _set(settings)
    try:
        yield
    finally:
        _set(before)


def _set(s: ReplaySettings) -> None:
    seeding.pin_threads(s.threads)
    torch.use_deterministic_algorithms(s.deterministic, warn_only=s.warn_only)
    torch.backends.cudnn.benchmark = s.cudnn_benchmark
    torch.backends.cudnn.deterministic = s.cudnn_deterministic
    torch.backends.cuda.enable_flash_sdp(s.sdpa_flash)
    torch.backends.cuda.enable_mem_efficient_sdp(s.sdpa_mem_efficient)
    torch.backends.cuda.enable_math_sdp(s.sdpa_math)
    torch.backends.cuda.enable_cudnn_sdp(s.sdpa_cudnn)
    if determinism.has_fp32_precision_settings():
        # Each backend's own setting, as recorded (a capsule of an older writer: as torch maps the legacy ones),
        # never through the legacy getters, which raise once a script has used these.
        wanted: dict[str, str] = dict(s.fp32_precision) if s.fp32_precision is not None else _from_legacy(s)
        if determinism.fp32_precisions() != wanted:
            determinism.set_fp32_precisions(wanted)
        return
    # A torch without the per-backend settings: the legacy ones, only where they differ.
    if torch.get_float32_matmul_precision() != s.float32_matmul_precision:
        torch.set_float32_matmul_precision(s.float32_matmul_precision)
    if torch.backends.cuda.matmul.allow_tf32 != s.tf32_matmul:
        torch.backends.cuda.matmul.allow_tf32 = s.tf32_matmul
    if torch.backends.cudnn.allow_tf32 != s.tf32_cudnn:
        torch.backends.cudnn.allow_tf32 = s.tf32_cudnn


def _from_legacy(s: ReplaySettings) -> dict[str, str]:
    """The per-backend fp32 precisions a capsule's legacy settings meant (as torch maps them)."""
    word = s.float32_matmul_precision
    return {"cuda.matmul": "tf32" if s.tf32_matmul or word in ("high", "medium") else "ieee",
            "cuda.conv": "tf32" if s.tf32_cudnn else "ieee",
            "cpu.matmul": {"medium": "bf16", "high": "tf32"}.get(word, "ieee"), "cpu.conv": "ieee"}


def resolve_factory(spec: str) -> Callable[..., Any]:
    """The function ``package.module:function`` names. Raises :class:`CapsuleUnusable` ("factory") when the
    module does not import or has no such callable."""
    module_name, _, function_name = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # whatever stops the import, the reviewer must see it
        raise CapsuleUnusable("factory", [f"factory {spec!r}: module {module_name!r} cannot be imported here "
                                          f"({type(exc).__name__}: {exc})"]) from exc
    factory = getattr(module, function_name, None)
    if not callable(factory):
        raise CapsuleUnusable("factory", [f"factory {spec!r}: module {module_name!r} has no function "
                                          f"{function_name!r}"])
    return factory


@dataclass
class Prepared:
    """A capsule made ready on a device: the rebuilt module with the capsule's state, and its inputs."""

    capsule: Capsule
    device: torch.device
    module: nn.Module
    loss_fn: Callable[[nn.Module, Any], torch.Tensor]
    names: list[str]
    params: list[nn.Parameter]
    batches: list[Any]


def prepare(capsule: Capsule, device: torch.device) -> Prepared:
    """Rebuild the model through the capsule's factory, load its state strictly, and move it and the
    micro-batches to ``device``. Raises :class:`CapsuleUnusable` ("factory" or "model") naming what failed."""
    m = capsule.manifest
    factory = resolve_factory(m.factory)
    try:
        built = factory(**m.factory_args)
    except Exception as exc:
        raise CapsuleUnusable("factory", [f"factory {m.factory!r}(**{m.factory_args}) raised "
                                          f"{type(exc).__name__}: {exc}"]) from exc
    if not (isinstance(built, tuple) and len(built) == 2 and isinstance(built[0], nn.Module) and callable(built[1])):
        raise CapsuleUnusable("factory", [f"factory {m.factory!r} must return (nn.Module, loss_fn), "
                                          f"got {type(built).__name__}"])
    module, loss_fn = built
    try:
        module.load_state_dict(capsule.state, strict=True)
    except RuntimeError as exc:
        raise CapsuleUnusable("model", [f"factory {m.factory!r} builds a model unlike the capsule's state: "
                                        f"{str(exc).splitlines()[0]}"]) from None
    named = {n: p for n, p in module.named_parameters() if p.requires_grad}
    names = list(m.expected.grads)
    if sorted(named) != sorted(names):
        missing = sorted(set(names) - set(named))[:5]
        extra = sorted(set(named) - set(names))[:5]
        raise CapsuleUnusable("model", [f"the rebuilt model's trainable parameters differ from the capsule's "
                                        f"(absent here: {missing}, not in the capsule: {extra})"])
    module.to(device)
    module.train(m.settings.training)
    # Looked up again after the move: a conversion may swap the Parameter objects themselves.
    named = dict(module.named_parameters())
    params = [named[n] for n in names]
    batches = [map_tensors(b, functools.partial(torch.Tensor.to, device=device)) for b in capsule.batches]
    return Prepared(capsule, device, module, loss_fn, names, params, batches)


@dataclass(frozen=True)
class Repetition:
    """One recomputation of the capsule and how it compared with the expected bits."""

    index: int
    loss_match: bool
    loss: str
    """The loss it gave (``float.hex``)."""
    mismatched_params: list[str]
    seconds: float

    @property
    def match(self) -> bool:
        """The loss and every gradient fingerprint are the expected bits."""
        return self.loss_match and not self.mismatched_params


def recompute_once(prepared: Prepared, index: int = 1) -> Repetition:
    """Recompute the capsule's step once (seeded for its (seed, step, rank), under its autocast, scale and
    stance: compiled code eagerly where the pass ran it so) and compare the loss bits and every parameter's
    gradient fingerprint with the expected ones."""
    s = prepared.capsule.manifest.settings
    expected = prepared.capsule.manifest.expected
    device = prepared.device
    seed = functools.partial(seeding.seed_micro_batch, s.seed, s.step, s.rank)
    scale = None
    if s.grad_scale is not None:
        # As GradScaler.scale multiplies: by its fp32 scale tensor.
        factor = torch.full((), float.fromhex(s.grad_scale), dtype=torch.float32, device=device)
        scale = functools.partial(torch.mul, other=factor)

    def forward_context() -> contextlib.AbstractContextManager[Any]:
        return seeding.autocast_and_stance(device, s.autocast_dtype, eager=s.eager)

    started = time.perf_counter()
    rec = recompute_step(prepared.module, prepared.loss_fn, prepared.batches, prepared.names, prepared.params,
                         seed, scale=scale, forward_context=forward_context)
    found = Expected.from_recomputation(rec)
    seconds = time.perf_counter() - started
    mismatched = [n for n in prepared.names if found.grads[n] != expected.grads[n]]
    return Repetition(index=index, loss_match=found.loss_bits == expected.loss_bits, loss=found.loss,
                      mismatched_params=mismatched, seconds=round(seconds, 4))


@dataclass
class ReplayReport:
    """The outcome of replaying a capsule here: per repetition, or why it could not run."""

    capsule: str
    repeats: int
    repetitions: list[Repetition] = field(default_factory=list)
    problem: Problem | None = None
    reasons: list[str] = field(default_factory=list)
    device: str = ""
    step: int | None = None
    rank: int | None = None
    expected_loss: str | None = None
    injection: str | None = None
    """The simulated fault this replay ran under (``SDCGUARD_INJECT``, described), None on real hardware only."""

    @property
    def matched(self) -> int:
        """Repetitions that gave exactly the expected bits."""
        return sum(r.match for r in self.repetitions)

    @property
    def reproduced(self) -> int:
        """Repetitions that did not: the fault reproduced."""
        return len(self.repetitions) - self.matched

    @property
    def outcome(self) -> Literal["match", "mismatch", "unusable"]:
        """match: every repetition matched (exit 0); mismatch: one or more did not (1); unusable: not run (2)."""
        if self.problem is not None:
            return "unusable"
        return "match" if self.reproduced == 0 else "mismatch"

    @property
    def exit_code(self) -> int:
        """0 all matched, 1 any mismatch, 2 the capsule cannot be used here."""
        return {"match": 0, "mismatch": 1, "unusable": 2}[self.outcome]

    @property
    def verdict(self) -> str:
        """One line for the ledger and the notification."""
        n = len(self.repetitions)
        if self.problem is not None:
            return f"not replayed: {self.problem}: {self.reasons[0] if self.reasons else 'unknown'}"
        if self.reproduced == 0:
            return f"reproduced 0/{n}: every repetition gave the healthy bits"
        if self.reproduced == n:
            return f"reproduced {n}/{n}: persistent"
        return f"reproduced {self.reproduced}/{n}: intermittent"

    def to_dict(self, *, max_params: int = 20) -> dict[str, Any]:
        """The report as one JSON object (what ``sdcguard replay --json`` prints on its last line)."""
        return {
            "schema_version": REPORT_SCHEMA_VERSION,
            "capsule": self.capsule,
            "step": self.step,
            "rank": self.rank,
            "node": os.environ.get("NODE_NAME") or None,
            "host": socket.gethostname(),
            "device": self.device,
            "repeats": self.repeats,
            "matched": self.matched,
            "reproduced": self.reproduced,
            "outcome": self.outcome,
            "exit_code": self.exit_code,
            "verdict": self.verdict,
            "problem": self.problem,
            "reasons": self.reasons,
            "expected_loss": self.expected_loss,
            "injection": self.injection,
            "repetitions": [
                {"index": r.index, "match": r.match, "loss_match": r.loss_match, "loss": r.loss,
                 "mismatched_params": r.mismatched_params[:max_params],
                 "mismatched_count": len(r.mismatched_params), "seconds": r.seconds}
                for r in self.repetitions
            ],
        }


def device_label(device: torch.device) -> str:
    """``cpu`` or ``cuda:0 (NVIDIA H200)``."""
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return str(device)


GPU_KEYS = ("gpu", "gpu.sm_count", "gpu.capability")
"""Signature keys that name the GPU model: cuBLAS is bit-reproducible only on the same one."""


IMPORTED_KEYS = ("flash_attn",)
"""Signature keys that the factory's own imports decide: checked only once the factory has run."""


def check_signature(capsule: Capsule, device: torch.device, *, before_import: bool = False) -> None:
    """Raises :class:`CapsuleUnusable` when this machine's environment signature differs from the capsule's:
    "device" for another GPU model (name, SM count, compute capability), else "signature" (software versions,
    settings). Run it under :func:`applied`, so the capsule's own settings are in force: with
    ``before_import`` before :func:`prepare`, over every key but :data:`IMPORTED_KEYS`, then again after it
    (the factory's imports, flash_attn's among them, are part of the signature)."""
    recorded = capsule.manifest.signature
    here = environment_signature(device)
    if before_import:
        recorded = {k: v for k, v in recorded.items() if k not in IMPORTED_KEYS}
        here = {k: v for k, v in here.items() if k not in IMPORTED_KEYS}
    differences = signature_differences([recorded, here])
    if not differences:
        return
    note = "rank [0] below is the capsule's environment, rank [1] this machine's"
    gpu = [k for k in GPU_KEYS if recorded.get(k) != here.get(k)]
    if gpu:
        raise CapsuleUnusable("device", [f"another GPU model: {recorded.get('gpu') or 'no GPU'} in the capsule, "
                                         f"{here.get('gpu') or 'no GPU'} here", note, *differences])
    raise CapsuleUnusable("signature", ["this machine's software signature differs from the capsule's", note,
                                        *differences])


def replay(
    location: str | ObjectStore,
    *,
    repeats: int = 5,
    progress: Callable[[str], None] | None = None,
    allowed: FactoryAllowList | None = None,
) -> ReplayReport:
    """Verify the capsule at ``location``, make it ready on this machine's device, and recompute it
    ``repeats`` times, comparing every repetition's bits with the expected ones.

    In this order, each before the next: the manifest's digest; its factory
    on ``allowed`` (default: :meth:`FactoryAllowList.from_env`); every
    object's digest; the device and the environment signature; only then is
    the factory imported and called. What makes the capsule unusable here
    (not found, corrupt, a factory not allowed, another device kind or
    signature, a factory that fails) is in the report (``problem``,
    ``reasons``, exit code 2), never raised. ``progress`` gets one line per
    stage and repetition. Raises :class:`ValueError` for ``repeats`` < 1 or an
    allow-list setting that is not ``package.module:function`` names.
    """
    if repeats < 1:
        raise ValueError(f"repeats: must be >= 1, got {repeats}")
    allowed = FactoryAllowList.from_env() if allowed is None else allowed
    say = progress or (lambda _line: None)
    name = location if isinstance(location, str) else location.uri()
    report = ReplayReport(capsule=name, repeats=repeats)
    try:
        say(f"verifying {name}")
        capsule = load_capsule(location, admit=allowed.admit)
    except CapsuleUnusable as exc:  # its factory is not allowed: nothing of it was read further
        report.problem, report.reasons = exc.problem, exc.reasons
        return report
    except (CapsuleNotFound, LineageError) as exc:
        report.problem, report.reasons = "missing", [str(exc)]
        return report
    except CapsuleCorrupt as exc:
        report.problem, report.reasons = "corrupt", [str(exc)]
        return report
    except _read_errors() as exc:  # no such bucket, access denied, the store unreachable: nothing replayed
        report.problem, report.reasons = "missing", [f"{name}: cannot be read here ({type(exc).__name__}: {exc})"]
        return report
    m = capsule.manifest
    report.capsule, report.step, report.rank, report.expected_loss = capsule.location, m.settings.step, \
        m.settings.rank, m.expected.loss
    device = replay_device(m.settings.device_type)
    if device is None:
        report.problem = "device"
        report.reasons = [f"the capsule was recorded on {m.settings.device_type!r}; this machine has no such device"]
        return report
    report.device = device_label(device)
    try:
        with applied(m.settings, device):
            say(f"step {m.settings.step}, rank {m.settings.rank}'s {len(capsule.batches)} micro-batch(es), "
                f"{capsule.size_bytes} bytes; rebuilding the model with {m.factory} on {report.device}")
            check_signature(capsule, device, before_import=True)
            prepared = prepare(capsule, device)
            check_signature(capsule, device)
            injector = injected(prepared, report)
            try:
                for i in range(1, repeats + 1):
                    repetition = recompute_once(prepared, i)
                    report.repetitions.append(repetition)
                    say(_describe(repetition, repeats))
            finally:
                if injector is not None:
                    injector.remove()
    except CapsuleUnusable as exc:
        report.problem, report.reasons = exc.problem, exc.reasons
    return report


def injected(prepared: Prepared, report: ReplayReport) -> Injector | None:
    """The simulated faulty hardware of ``SDCGUARD_INJECT``, installed on the replay's module as on a training
    rank's: this replay runs as the capsule's rank, at its step, on node ``NODE_NAME``. A persistent fault
    (``repeat`` > 1) whose steps cover the capsule's step and bound to that rank or node corrupts every
    repetition; a transient one corrupts none (see :meth:`sdcguard.agent.testing.inject.Injector.install_on_module`). Says so
    loudly on stderr; records the fault in ``report.injection``. None when it is off. Raises
    :class:`CapsuleUnusable` ("injection") for a malformed value or a model the fault cannot hook."""
    try:
        injection = from_env()
    except ValueError as exc:
        raise CapsuleUnusable("injection", [f"{ENV_VAR}: {exc}"]) from exc
    if injection is None:
        return None
    s = prepared.capsule.manifest.settings
    node = os.environ.get("NODE_NAME", "")
    injector = Injector(injection, s.rank, node)  # announces itself on stderr
    try:
        fires = injector.install_on_module(prepared.module, s.step)
    except ValueError as exc:
        injector.remove()
        raise CapsuleUnusable("injection", [f"{ENV_VAR}: {exc}"]) from exc
    report.injection = injection.describe()
    print(f"!!! SDCGUARD FAULT INJECTION: replaying step {s.step} as rank {s.rank} on node {node or '(unset)'}: "
          f"the simulated fault {'corrupts every repetition' if fires else 'does not fire here'} !!!",
          file=sys.stderr, flush=True)
    return injector


def _read_errors() -> tuple[type[BaseException], ...]:
    """What reading a capsule's store can raise besides the lineage errors: the S3 client's, and the OS's."""
    try:
        from botocore.exceptions import BotoCoreError, ClientError
    except ImportError:  # no S3 support installed: only local capsules
        return (OSError,)
    return (BotoCoreError, ClientError, OSError)


def _describe(r: Repetition, repeats: int) -> str:
    head = f"repetition {r.index}/{repeats}: "
    if r.match:
        return head + f"match ({r.seconds:.2f} s)"
    parts = [] if r.loss_match else [f"loss {r.loss} differs"]
    if r.mismatched_params:
        names = ", ".join(r.mismatched_params[:5]) + (", ..." if len(r.mismatched_params) > 5 else "")
        parts.append(f"gradients of {len(r.mismatched_params)} parameter(s) differ: {names}")
    return head + "MISMATCH, " + "; ".join(parts) + f" ({r.seconds:.2f} s)"
