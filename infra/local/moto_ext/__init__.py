"""The project's extensions to moto 5.2.5, one module per gap it fills.

moto has no plugin API, so each module replaces a few of moto's internals;
``install()`` applies them all (idempotent). The version is pinned in
pyproject.toml, and every module has a functional test that fails if moto
changes underneath it.
"""

from __future__ import annotations

import moto

from sdcguard.infra.local.moto_ext import (
    dynamodb_atomic,
    eks_endpoint,
    eventbridge_targets,
    eventbus_ref,
    hyperpod,
    lambda_runner,
    stepfunctions_cfn,
    stepfunctions_stop,
)

MOTO_VERSION = "5.2.5"
_installed = False


def install() -> None:
    """Apply every extension to this process's moto.

    Raises ``RuntimeError`` when the installed moto is not the version the
    extensions were written against.
    """
    global _installed
    if _installed:
        return
    if moto.__version__ != MOTO_VERSION:
        raise RuntimeError(f"the stand-in's moto extensions need moto {MOTO_VERSION}, found {moto.__version__}")
    for extension in (lambda_runner, eventbridge_targets, stepfunctions_cfn, eventbus_ref, hyperpod, eks_endpoint,
                      dynamodb_atomic, stepfunctions_stop):
        extension.install()
    _installed = True
