"""The Lambda deployment package: the pipeline's code and its dependencies in one zip.

The zip holds ``sdcguard/lambdas/``, ``sdcguard/contract/`` and ``sdcguard/lineage/`` (with
``sdcguard/__init__.py``: the installed names, ``sdcguard.lambdas.handlers.record.handler``) and the third-party
packages that ``pyproject.toml`` declares for them (the core dependencies and
the ``lambdas`` extra), installed by pip as binary wheels for one
:class:`Target`: a Python version and an architecture. The Lambda runtime is
Python 3.12 on arm64 or x86_64; the local stand-in runs handlers on the
interpreter running it, so a stand-in deploy builds for :func:`local_target`.
That target is the only difference between the two.

boto3 and botocore are left out: the Lambda runtime ships them (and the
stand-in's interpreter has them), and they would more than double the package
(their size, with its date: docs/deploying.md).

When the interpreter building the package has the target's Python version
(always so for the stand-in), the package also carries bytecode compiled as
unchecked-hash ``.pyc`` files, which stay valid whatever the files' times after
unpacking: a handler's cold start then skips compiling pydantic, powertools and
the kubernetes client (about a third of the cold start; the figures, with
their date: docs/benchmarks.md, "Deploying"). Bytecode is specific to a Python version, so a package for another
version carries sources only.

Builds are cached under ``build/lambda/`` by a hash of their inputs (the
sources, the declared dependencies, the pinned constraints and the target), and
the zip is byte-for-byte reproducible, so an unchanged tree deploys without
rebuilding, re-uploading or updating a function.
"""

from __future__ import annotations

import compileall
import hashlib
import os
import platform
import py_compile
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
import zipfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("lambdas", "contract", "lineage")
# The folders above are packed under the one installed name, with its __init__.py (and not the rest of it).
NAMESPACE = "sdcguard"
CONSTRAINTS = ROOT / "requirements" / "constraints.txt"
CACHE = ROOT / "build" / "lambda"
# Provided by the runtime; never packaged.
RUNTIME_PROVIDED = frozenset({"boto3", "botocore", "s3transfer"})
# Bumped when the layout of the zip changes, so old cache entries are not reused.
FORMAT = "2"
_FIXED_TIME = (1980, 1, 1, 0, 0, 0)


class PackageError(RuntimeError):
    """The package could not be built; the message says which step failed and why."""


@dataclass(frozen=True)
class Target:
    """The interpreter the package must import on."""

    python_version: str
    """``MAJOR.MINOR``, e.g. ``3.12``."""
    architecture: str
    """Lambda's name for it: ``arm64`` or ``x86_64``."""

    def __post_init__(self) -> None:
        parts = self.python_version.split(".")
        if len(parts) != 2 or not all(p.isdigit() for p in parts):
            raise ValueError(f"python_version: expected MAJOR.MINOR such as 3.12, got {self.python_version!r}")
        if self.architecture not in ("arm64", "x86_64"):
            raise ValueError(f"architecture: expected arm64 or x86_64, got {self.architecture!r}")

    @property
    def platforms(self) -> list[str]:
        """pip ``--platform`` tags of Linux wheels the Lambda runtime (Amazon Linux 2023) can load."""
        machine = "aarch64" if self.architecture == "arm64" else "x86_64"
        return [f"manylinux2014_{machine}", f"manylinux_2_28_{machine}", f"manylinux_2_34_{machine}"]

    def __str__(self) -> str:
        return f"Python {self.python_version} {self.architecture}"

    @property
    def compiles(self) -> bool:
        """Whether this interpreter can compile bytecode the target will load (same Python version)."""
        return self.python_version == f"{sys.version_info.major}.{sys.version_info.minor}"


LAMBDA_TARGET = Target("3.12", "arm64")
"""The Lambda runtime of the template (python3.12) on the template's default architecture."""


def local_target() -> Target:
    """This interpreter's version and architecture: what the local stand-in runs handlers on."""
    machine = platform.machine().lower()
    architecture = "arm64" if machine in ("arm64", "aarch64") else "x86_64"
    return Target(f"{sys.version_info.major}.{sys.version_info.minor}", architecture)


@dataclass(frozen=True)
class Package:
    """A built deployment package."""

    path: Path
    sha256: str
    """Hex digest of the zip's bytes."""
    target: Target
    cached: bool
    """True when nothing was built: the zip for these inputs already existed."""
    seconds: float
    size: int

    @property
    def key_name(self) -> str:
        """A file name that changes whenever the content does (so CloudFormation updates the code)."""
        return f"sdcguard-lambda-{self.sha256[:20]}.zip"


def requirements(pyproject: Path = ROOT / "pyproject.toml") -> list[str]:
    """The third-party requirements of the Lambda code, as declared in ``pyproject.toml``.

    The core dependencies plus the ``lambdas`` extra, minus what the runtime provides.
    """
    project = tomllib.loads(pyproject.read_text(encoding="utf-8"))["project"]
    declared = [*project["dependencies"], *project["optional-dependencies"]["lambdas"]]
    return [r for r in declared if _dist_name(r) not in RUNTIME_PROVIDED]


def _dist_name(requirement: str) -> str:
    name = requirement
    for stop in "[<>=!~; ":
        name = name.split(stop, 1)[0]
    return name.strip().lower().replace("_", "-")


def _source_files() -> list[Path]:
    files = [ROOT / NAMESPACE / "__init__.py"]
    for package in SOURCES:
        for path in sorted((ROOT / package).rglob("*")):
            if (path.is_file() and "__pycache__" not in path.parts and path.suffix in (".py", ".json", ".typed")
                    and path not in files):
                files.append(path)
    return files


def _arcname(path: Path) -> str:
    """The name of a source file in the zip: under ``sdcguard/``, as it is installed."""
    rel = path.relative_to(ROOT).as_posix()
    return rel if rel.startswith(f"{NAMESPACE}/") else f"{NAMESPACE}/{rel}"


def _digest(parts: list[bytes]) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(hashlib.sha256(part).digest())
    return h.hexdigest()


def dependencies_key(target: Target, reqs: list[str]) -> str:
    """Cache key of the installed dependencies: what pip is asked for, the pins, and the target."""
    pins = CONSTRAINTS.read_bytes() if CONSTRAINTS.exists() else b""
    flavour = f"{FORMAT}{'+pyc' if target.compiles else ''}"
    return _digest([flavour.encode(), str(target).encode(), "\n".join(reqs).encode(), pins])


def package_key(target: Target, reqs: list[str]) -> str:
    """Cache key of the whole zip: the dependencies' key and every source file's path and bytes."""
    parts = [dependencies_key(target, reqs).encode()]
    for path in _source_files():
        parts += [_arcname(path).encode(), path.read_bytes()]
    return _digest(parts)


def _install_dependencies(target: Target, reqs: list[str], into: Path, *, log: _Log) -> None:
    # Unique per build: another process (a test, the drill) may build the same package at once.
    staging = into.with_name(f"{into.name}.{os.getpid()}.{time.monotonic_ns()}.partial")
    command = [
        sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
        "--target", str(staging),
        "--implementation", "cp",
        "--python-version", target.python_version,
        *[arg for tag in target.platforms for arg in ("--platform", tag)],
        "--only-binary=:all:",
        # pip's own .pyc files check source times, which unpacking changes.
        "--no-compile",
    ]  # fmt: skip
    if CONSTRAINTS.exists():
        command += ["--constraint", str(CONSTRAINTS)]
    log(f"installing {', '.join(reqs)} for {target} with pip")
    result = subprocess.run([*command, *reqs], capture_output=True, text=True, check=False)
    if result.returncode != 0:
        shutil.rmtree(staging, ignore_errors=True)
        raise PackageError(
            f"pip could not install the Lambda dependencies for {target}:\n{result.stderr.strip()[-4000:]}"
        )
    for entry in list(staging.iterdir()):
        if _dist_name(entry.name.split("-")[0]) in RUNTIME_PROVIDED:
            shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
    shutil.rmtree(staging / "bin", ignore_errors=True)
    if target.compiles:
        log("compiling the dependencies' bytecode")
        compileall.compile_dir(
            staging, quiet=2, workers=0, invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH
        )
    try:
        staging.rename(into)
    except OSError:
        if not into.is_dir():
            raise
        shutil.rmtree(staging, ignore_errors=True)  # another build finished the same dependencies first


def write_zip(zip_path: Path, deps: Path, *, compile_sources: bool) -> None:
    """Write the package: the installed dependencies in ``deps``, then ``SOURCES`` (and their bytecode)."""
    entries: list[tuple[str, Path]] = []
    for path in sorted(deps.rglob("*")):
        # __pycache__ holds bytecode only when the dependencies were compiled for the target.
        if path.is_file() and (path.suffix != ".pyc" or compile_sources):
            entries.append((path.relative_to(deps).as_posix(), path))
    entries += [(_arcname(path), path) for path in _source_files()]
    partial = zip_path.with_name(f"{zip_path.name}.{os.getpid()}.{time.monotonic_ns()}.partial")
    with tempfile.TemporaryDirectory(prefix="sdcguard-pyc-") as scratch:
        if compile_sources:
            entries += _compiled_sources(Path(scratch))
        with zipfile.ZipFile(partial, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=6) as zf:
            for name, path in sorted(entries):
                # Fixed times and modes: the same inputs give the same bytes.
                info = zipfile.ZipInfo(name, date_time=_FIXED_TIME)
                info.external_attr = (0o755 if os.access(path, os.X_OK) else 0o644) << 16
                info.compress_type = zipfile.ZIP_DEFLATED
                zf.writestr(info, path.read_bytes())
    partial.replace(zip_path)


def _compiled_sources(scratch: Path) -> list[tuple[str, Path]]:
    out = []
    for path in _source_files():
        if path.suffix != ".py":
            continue
        rel = Path(_arcname(path))
        name = f"{rel.parent.as_posix()}/__pycache__/{rel.stem}.{sys.implementation.cache_tag}.pyc"
        target = scratch / name
        target.parent.mkdir(parents=True, exist_ok=True)
        py_compile.compile(
            str(path),
            cfile=str(target),
            dfile=rel.as_posix(),
            doraise=True,
            invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH,
        )
        out.append((name, target))
    return out


class _Log:
    def __init__(self, progress: bool) -> None:
        self.progress = progress

    def __call__(self, message: str) -> None:
        if self.progress:
            print(f"package: {message}", file=sys.stderr, flush=True)


KEEP_ZIPS = 6
"""Built zips kept in the cache; older ones are removed (each source change makes a new one)."""


def prune_cache(cache: Path = CACHE, keep: int = KEEP_ZIPS) -> list[Path]:
    """Remove all but the ``keep`` most recently used zips from ``cache``; returns what was removed.

    The dependency folders stay: they are slow to rebuild and change only with the pins.
    """
    zips = sorted(cache.glob("*.zip"), key=_mtime, reverse=True)
    removed = []
    for old in zips[keep:]:
        old.unlink(missing_ok=True)
        removed.append(old)
    return removed


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except FileNotFoundError:  # removed by a concurrent build's pruning
        return 0.0


def build_package(target: Target = LAMBDA_TARGET, *, cache: Path = CACHE, progress: bool = False) -> Package:
    """Build (or reuse) the deployment package for ``target``.

    Returns the zip and whether it came from the cache. Raises
    :class:`PackageError` when pip cannot install the dependencies for the
    target (no matching wheels, no access to the package index).
    """
    started = time.monotonic()
    log = _Log(progress)
    reqs = requirements()
    key = package_key(target, reqs)
    zip_path = cache / f"{key[:32]}.zip"
    cached = zip_path.exists()
    if cached:
        try:
            os.utime(zip_path)  # most recently used: kept by prune_cache
        except FileNotFoundError:
            cached = False  # pruned by another build just now
    if not cached:
        cache.mkdir(parents=True, exist_ok=True)
        deps = cache / f"deps-{dependencies_key(target, reqs)[:32]}"
        if not deps.is_dir():
            _install_dependencies(target, reqs, deps, log=log)
        else:
            log(f"dependencies for {target} from the cache")
        write_zip(zip_path, deps, compile_sources=target.compiles)
        prune_cache(cache)
    data = zip_path.read_bytes()
    package = Package(
        path=zip_path,
        sha256=hashlib.sha256(data).hexdigest(),
        target=target,
        cached=cached,
        seconds=time.monotonic() - started,
        size=len(data),
    )
    log(f"{package.path.name}: {package.size / 1e6:.1f} MB for {target} "
        f"({'cached' if cached else 'built'} in {package.seconds:.1f} s)")  # fmt: skip
    return package
