"""JSON Schemas of the contract, checked into ``contract/schemas/`` and kept in sync by a test.

``python -m sdcguard.contract.schema`` rewrites them; ``python -m sdcguard.contract.schema --check``
exits 1 when a checked-in schema differs from the models.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pydantic import BaseModel

from sdcguard.contract.alarm import Alarm
from sdcguard.contract.checkpoint import CheckpointManifest, ResumePointer
from sdcguard.contract.incident import Incident

SCHEMA_DIR = Path(__file__).with_name("schemas")
MODELS: dict[str, type[BaseModel]] = {
    "alarm": Alarm,
    "checkpoint-manifest": CheckpointManifest,
    "resume-pointer": ResumePointer,
    "incident": Incident,
}


def render(model: type[BaseModel]) -> str:
    """The model's JSON Schema as stable, pretty-printed text."""
    return json.dumps(model.model_json_schema(mode="validation"), indent=2, sort_keys=True) + "\n"


def stale() -> list[str]:
    """Names of checked-in schemas that differ from the models (missing ones included)."""
    out = []
    for name, model in MODELS.items():
        path = SCHEMA_DIR / f"{name}.schema.json"
        if not path.exists() or path.read_text() != render(model):
            out.append(name)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sdcguard.contract.schema", description=__doc__)
    parser.add_argument("--check", action="store_true", help="only report stale schemas; exit 1 if any")
    args = parser.parse_args(argv)
    if args.check:
        names = stale()
        for name in names:
            print(f"stale: contract/schemas/{name}.schema.json (run: python -m sdcguard.contract.schema)")
        return 1 if names else 0
    SCHEMA_DIR.mkdir(exist_ok=True)
    for name, model in MODELS.items():
        (SCHEMA_DIR / f"{name}.schema.json").write_text(render(model))
        print(f"wrote contract/schemas/{name}.schema.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
