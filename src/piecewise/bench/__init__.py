"""Benchmarks (docs/design.md §10): piecewise against eager and ``torch.compile`` in one run.

`run_bench` drives `worker` in fresh subprocesses (one per system, phase and model size) so cold
and warm starts are real process starts with their own caches, and prints every figure as a
ratio to its baseline from the same run. ``piecewise bench`` and ``benchmarks/run.py`` call it.
"""

from .suite import BenchConfig, run_bench

__all__ = ["BenchConfig", "run_bench"]
