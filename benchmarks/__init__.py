"""Benchmarks: ``./dev bench [NAME ...]``.

Each ``benchmarks/bench_<name>.py`` exposes ``main(argv: list[str]) -> int`` and
prints its figures as ratios against a baseline measured in the same run: these
machines are noisy, so absolute times are not comparable between runs.
"""
