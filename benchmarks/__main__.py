"""Run every benchmark (or the ones named): ``python -m benchmarks [NAME ...] [-- ARGS]``."""

from __future__ import annotations

import importlib
import pkgutil
import sys
import time

import benchmarks


def available() -> list[str]:
    """Names of the benchmark modules, without the ``bench_`` prefix."""
    return sorted(
        m.name.removeprefix("bench_")
        for m in pkgutil.iter_modules(benchmarks.__path__)
        if m.name.startswith("bench_")
    )


def main(argv: list[str]) -> int:
    names, _, rest = (argv[: argv.index("--")], None, argv[argv.index("--") + 1 :]) if "--" in argv else (argv, None, [])
    # Without "--", options after the names go to the benchmarks: ./dev bench coverage --quick --out DIR
    first_option = next((i for i, a in enumerate(names) if a.startswith("-")), len(names))
    if first_option and not rest:
        names, rest = names[:first_option], names[first_option:]
    if any(n in ("-h", "--help") for n in names):
        print(f"usage: ./dev bench [NAME ...] [-- ARGS]\nbenchmarks: {', '.join(available())}")
        return 0
    unknown = sorted(set(names) - set(available()))
    if unknown:
        print(f"bench: unknown benchmark(s): {', '.join(unknown)}; known: {', '.join(available())}")
        return 2
    status = 0
    for name in names or available():
        print(f"\n### {name}", flush=True)
        started = time.perf_counter()
        module = importlib.import_module(f"benchmarks.bench_{name}")
        # A long benchmark runs its short form (its WHOLE_SET_ARGS) when every benchmark runs.
        status |= module.main(rest if names else [*getattr(module, "WHOLE_SET_ARGS", []), *rest])
        print(f"({name}: {time.perf_counter() - started:.1f} s)")
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
