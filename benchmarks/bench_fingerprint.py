"""Fingerprint throughput as a ratio to a memcpy and to a plain sum of the same tensor.

``./dev bench fingerprint [-- --elements 16M,64M --dtypes float32,bfloat16 --repeats 7 --sweep]``

For each tensor it times, interleaved in the same run, ``buffer.copy_(t)``
into a preallocated buffer (memcpy), ``t.sum()``, ``fingerprint(t)`` (the C
kernel when it is in use, see ``sdcguard.agent.native``) and ``fingerprint_torch(t)``
(the torch implementation, which GPUs use), and reports medians and the
throughput ratios ``memcpy time / fingerprint time`` (1.0 = as fast as a
memcpy; the target is >= 0.5) and ``sum time / fingerprint time``.
``--sweep`` also times the torch implementation at every chunk size in
``--chunks`` to show how its defaults (``default_chunk``) were chosen.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable

import torch

from sdcguard.agent import native
from sdcguard.agent.fingerprint import BLOCK, default_chunk, fingerprint, fingerprint_torch

_SUFFIX = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def _count(text: str) -> int:
    text = text.strip().upper()
    scale = _SUFFIX.get(text[-1:], 1)
    number = text[:-1] if text[-1:] in _SUFFIX else text
    try:
        value = int(number) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an element count: {text!r} (e.g. 16M, 65536)") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"element count must be positive: {text!r}")
    return value


def _counts(text: str) -> list[int]:
    return [_count(part) for part in text.split(",") if part.strip()]


def _dtypes(text: str) -> list[torch.dtype]:
    out = []
    for name in (part.strip() for part in text.split(",") if part.strip()):
        dtype = getattr(torch, name, None)
        if not isinstance(dtype, torch.dtype):
            raise argparse.ArgumentTypeError(f"unknown dtype: {name!r} (e.g. float32, bfloat16)")
        out.append(dtype)
    return out


def _median_seconds(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up: first-touch page faults and allocator growth are not the steady state
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _interleaved(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median seconds per function, measured round-robin so that load from other
    processes on a shared machine falls on all of them alike."""
    for fn in fns.values():
        fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in samples.items()}


def _label(n: int) -> str:
    for suffix in ("G", "M", "K"):
        if n % _SUFFIX[suffix] == 0:
            return f"{n // _SUFFIX[suffix]}{suffix}"
    return str(n)


def _tensor(dtype: torch.dtype, n: int) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(0)).to(dtype)


def main(argv: list[str]) -> int:
    """Print the throughput table (and the chunk sweep when asked); returns 0."""
    parser = argparse.ArgumentParser(prog="bench fingerprint", description=__doc__.splitlines()[0])
    parser.add_argument("--elements", type=_counts, default=[16 << 20, 64 << 20], help="e.g. 16M,64M")
    parser.add_argument("--dtypes", type=_dtypes, default=[torch.float32, torch.bfloat16])
    parser.add_argument("--repeats", type=int, default=7, help="timed repeats per measurement (median)")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--sweep", action="store_true", help="also time each chunk size in --chunks")
    parser.add_argument(
        "--chunks",
        type=_counts,
        default=[8 << 10, 16 << 10, 31 << 10, 32 << 10, 64 << 10, 128 << 10, 256 << 10],
    )
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    bad = [c for c in args.chunks if c % BLOCK]
    if bad:
        parser.error(f"--chunks must be multiples of {BLOCK}: {bad}")
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    kernel = native.kernel()
    implementation = f"C kernel ({kernel.isa_name})" if kernel else "torch (no C kernel: see the warning above)"
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; fingerprint: {implementation}; "
        f"torch implementation's chunk {_label(default_chunk(torch.device('cpu')))} elements"
    )
    print(
        f"{'dtype':<9} {'elements':>8} {'memcpy ms':>9} {'sum ms':>7} {'fp ms':>7} {'fp GB/s':>7} {'x memcpy':>8} {'x sum':>6}"
        f" {'torch fp ms':>11} {'x memcpy':>8}"
    )
    for dtype in args.dtypes:
        for n in args.elements:
            t = _tensor(dtype, n)
            buffer = torch.empty_like(t)
            got = _interleaved(
                {
                    "memcpy": functools.partial(buffer.copy_, t),
                    "sum": t.sum,
                    "fingerprint": functools.partial(fingerprint, t),
                    "torch": functools.partial(fingerprint_torch, t),
                },
                args.repeats,
            )
            memcpy, total, fp, slow = got["memcpy"], got["sum"], got["fingerprint"], got["torch"]
            gbs = t.numel() * t.element_size() / fp / 1e9
            print(
                f"{str(dtype).removeprefix('torch.'):<9} {_label(n):>8} {memcpy * 1e3:9.1f} {total * 1e3:7.1f} "
                f"{fp * 1e3:7.1f} {gbs:7.2f} {memcpy / fp:8.2f} {total / fp:6.2f} {slow * 1e3:11.1f} {memcpy / slow:8.2f}"
            )
            if args.sweep:
                for chunk in args.chunks:
                    seconds = _median_seconds(functools.partial(fingerprint_torch, t, chunk=chunk), args.repeats)
                    print(
                        f"    chunk {_label(chunk):>5}: {seconds * 1e3:7.1f} ms, x memcpy {memcpy / seconds:5.2f}"
                    )
            del t, buffer
    return 0
