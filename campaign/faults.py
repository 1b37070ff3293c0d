"""The fault models of the campaign, and how one fault is drawn from its seed.

A fault is bound to one rank's hardware and fires on a set of steps:
``transient`` corrupts one computation (the first micro-batch pass of its
step), ``intermittent`` a fraction of the steps of its window (every pass of
those steps, the audit's recomputation included), ``persistent`` every step
from its first on. Everything about a fault (rank, step, layer, element, bit)
is drawn from a seed derived from the campaign seed and its row id, so any row
can be replayed from the id alone.

Positions that depend on the model (which product, which element, which
parameter) are drawn as large integers here and reduced modulo the real
counts by the injector: the draw needs no model, and the same draw lands on
the same place in every run of the same model.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import asdict, dataclass, field
from typing import Any

PERSISTENCES = ("transient", "intermittent", "persistent")

MODELS: dict[str, str] = {
    "matmul_fwd": "a bit flip in one output element of a forward matrix product (linear, attention, conv) of a random layer",
    "matmul_bwd": "a bit flip in one output element of a backward matrix product of a random layer",
    "mercurial": "a faulty lane: the same element position wrong in every matrix product of the rank (stuck or periodic)",
    "activation": "one output element of a random Linear scaled by a factor (2 to 1e4)",
    "weight": "a bit flip in one weight after the optimizer update (memory)",
    "gradient": "a bit flip in one element of the rank's local gradient, before the all-reduce",
    "allreduce": "a bit flip in one element of the all-reduce result one rank receives",
    "optimizer": "a wrong element after optimizer.step(): a bit flip in one element's update of a weight or of its optimizer state (Adam's moments, SGD's momentum)",
    "checkpoint": "a bit flip in one byte of a checkpoint object the rank writes",
    "null": "a control: an activation scaled by 1.0 (fires, changes nothing); must be counted benign",
}
"""Every fault model, with what it corrupts."""

CAMPAIGN_MODELS = tuple(m for m in MODELS if m != "null")
"""The models a campaign draws by default (``null`` is the test's control)."""

INTERMITTENT_RATE = 0.25
"""An intermittent fault fires on its first step and on each later step of its window with this probability."""

BIT_CLASSES = ("sign", "exponent", "mantissa")


@dataclass(frozen=True)
class FaultSpec:
    """One fault to inject, fully determined by ``row_id`` and the campaign seed."""

    row_id: str
    """``model/persistence/index``, e.g. ``matmul_fwd/transient/007``."""
    model: str
    persistence: str
    seed: int
    rank: int
    """The rank whose hardware is faulty."""
    step: int
    """The first step the fault fires (for ``checkpoint``: the first corrupted checkpoint)."""
    steps: tuple[int, ...]
    """Every step the fault fires."""
    bit: int
    """Bit of the fp32 element that flips (0-22 mantissa, 23-30 exponent, 31 sign)."""
    bit_class: str
    direction: str
    """``fwd`` or ``bwd`` for product faults."""
    product: int
    """Which product of its direction in a pass (reduced modulo the count per pass)."""
    element: int
    """Which element of the corrupted tensor (reduced modulo its size)."""
    target: int
    """Which layer, parameter, optimizer tensor, bucket or checkpoint object (reduced modulo the count)."""
    factor: float
    """activation: the scale; mercurial: unused."""
    period: int
    """mercurial: 0 for a stuck bit in one element, else every ``period``-th element flips."""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def last_step(self) -> int:
        """The last step the fault fires."""
        return max(self.steps)

    def fires(self, step: int) -> bool:
        """Whether the fault fires at ``step``."""
        return step in self.steps

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> FaultSpec:
        """The inverse of ``to_dict``."""
        return cls(**{**data, "steps": tuple(data["steps"])})


def row_seed(campaign_seed: int, row_id: str) -> int:
    """The seed of one row: a hash, so that neighbouring ids do not share draws."""
    digest = hashlib.blake2b(f"{campaign_seed}:{row_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 62) - 1)


def row_id(model: str, persistence: str, index: int) -> str:
    """The id of the ``index``-th fault of ``model`` with ``persistence``."""
    return f"{model}/{persistence}/{index:03d}"


def parse_row_id(text: str) -> tuple[str, str, int]:
    """(model, persistence, index) of a row id; ValueError naming what is wrong."""
    parts = text.split("/")
    if len(parts) != 3:
        raise ValueError(f"row id: {text!r} is not model/persistence/index")
    model, persistence, index = parts
    if model not in MODELS:
        raise ValueError(f"row id: unknown fault model {model!r} (known: {', '.join(MODELS)})")
    if persistence not in PERSISTENCES:
        raise ValueError(f"row id: unknown persistence {persistence!r} (known: {', '.join(PERSISTENCES)})")
    if not index.isdigit():
        raise ValueError(f"row id: index {index!r} is not a number")
    return model, persistence, int(index)


def draw(campaign_seed: int, rid: str, *, world: int, first_step: int, span: int, horizon: int,
         checkpoint_gap: int) -> FaultSpec:
    """The fault of row ``rid``: its first step in ``[first_step, first_step + span)``, its window ``horizon`` steps.

    Raises ValueError for a malformed row id.
    """
    model, persistence, _ = parse_row_id(rid)
    seed = row_seed(campaign_seed, rid)
    rng = random.Random(seed)
    rank = rng.randrange(world)
    step = first_step + rng.randrange(span)
    bit_class = rng.choice(BIT_CLASSES)
    bit = {"sign": 31, "exponent": rng.randrange(23, 31), "mantissa": rng.randrange(0, 23)}[bit_class]
    big = 1 << 40
    direction = {"matmul_fwd": "fwd", "matmul_bwd": "bwd"}.get(model, rng.choice(("fwd", "bwd")))
    product, element, target = rng.randrange(big), rng.randrange(big), rng.randrange(big)
    factor = 1.0 if model == "null" else 10 ** rng.uniform(0.3, 4.0)
    period = rng.choice((0, 32, 64, 256))
    if model == "checkpoint":
        # Checkpoints at step - gap and step; the fault corrupts the last, and
        # (intermittent: maybe, persistent: always) the one before.
        earlier = step - checkpoint_gap
        if persistence == "transient":
            steps: tuple[int, ...] = (step,)
        elif persistence == "intermittent":
            steps = (earlier, step) if rng.random() < 0.5 else (step,)
        else:
            steps = (earlier, step)
    elif persistence == "transient":
        steps = (step,)
    elif persistence == "intermittent":
        steps = (step, *(s for s in range(step + 1, step + horizon) if rng.random() < INTERMITTENT_RATE))
    else:
        steps = tuple(range(step, step + horizon))
    return FaultSpec(row_id=rid, model=model, persistence=persistence, seed=seed, rank=rank, step=min(steps),
                     steps=steps, bit=bit, bit_class=bit_class, direction=direction, product=product,
                     element=element, target=target, factor=factor, period=period,
                     extra={"checkpoints": [step - checkpoint_gap, step]} if model == "checkpoint" else {})
