"""Every tensor the agent makes names its device (and, where the kind of number is not implied, its dtype).

A training script may set torch's defaults before its loop
(``torch.set_default_device("cuda")``, ``torch.set_default_dtype(torch.bfloat16)``): a host buffer made
without ``device=`` would then be a GPU tensor handed to the compiled kernels by address, and a vector of
ones without ``dtype=`` would be read as fp32 when it is not. The guard's whole step is run under such
defaults in tests/unit/test_agent_guard.py and the product-check tests; this reads every call in agent/,
so that the paths those runs do not reach keep the rule too.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
AGENT = ROOT / "agent"

NEEDS_DEVICE_AND_DTYPE = frozenset({"empty", "zeros", "ones", "full", "tensor", "rand", "randn", "eye", "linspace",
                                    "logspace", "empty_strided", "as_tensor", "scalar_tensor"})
NEEDS_DEVICE = frozenset({"arange", "randint", "randperm"})
"""Integer by their arguments; their device is still the default's unless named."""


def unnamed(source: str, where: str) -> list[str]:
    """``torch.<factory>(...)`` calls in ``source`` that leave their device or dtype to torch's defaults."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch"):
            continue
        name, given = node.func.attr, {k.arg for k in node.keywords}
        if None in given:
            continue  # **kwargs: the caller names them
        missing = [k for k in ("device", "dtype") if k not in given and (
            name in NEEDS_DEVICE_AND_DTYPE or (k == "device" and name in NEEDS_DEVICE))]
        if missing:
            found.append(f"{where}:{node.lineno}: torch.{name}(...) without {' or '.join(missing)}=")
    return found


def test_every_tensor_the_agent_makes_names_its_device_and_dtype() -> None:
    found = [line for path in sorted(AGENT.rglob("*.py"))
             for line in unnamed(path.read_text(), str(path.relative_to(ROOT)))]
    assert found == []


def test_the_reading_finds_what_it_looks_for() -> None:
    assert unnamed("x = torch.zeros(3, dtype=torch.int64)\n", "a.py") == [
        "a.py:1: torch.zeros(...) without device="]
    assert unnamed("x = torch.ones(3, device='cpu')\n", "a.py") == ["a.py:1: torch.ones(...) without dtype="]
    assert unnamed("i = torch.arange(4)\n", "a.py") == ["a.py:1: torch.arange(...) without device="]
    assert unnamed("x = torch.zeros(3, dtype=torch.int64, device=d)\ny = torch.zeros_like(x)\n"
                   "z = torch.arange(4, device=d)\n", "a.py") == []
