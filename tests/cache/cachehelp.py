"""Shared pieces of the cache tests: a fast artifact-saving adaptor and a subprocess runner.

`CodeAdaptor` is a real third-party adaptor (registered by name, as users would): its artifact is
the piece's generated Python source, and loading checks that source against the piece. It goes
through every cache path (save, checksum, load, quarantine) without Inductor's seconds per piece,
so fault-injection tests can run hundreds of trials.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import torch

from piecewise.compilers import CompiledPiece, CompilerAdaptor, register_adaptor
from piecewise.split import fx_forward

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "worker.py")


class CodeAdaptor(CompilerAdaptor):
    name = "code"

    def compute_hash(self) -> str:
        return hashlib.sha256(f"code-adaptor-1:{torch.__version__}".encode()).hexdigest()[:16]

    @property
    def saves_artifacts(self) -> bool:
        return True

    def compile(self, graph, example_inputs, target) -> CompiledPiece:
        return CompiledPiece(fx_forward(graph), graph.code.encode())

    def load(self, payload, graph):
        if payload.decode() != graph.code:
            raise ValueError("artifact source differs from the piece")
        return fx_forward(graph)


register_adaptor("code", CodeAdaptor)


def run_worker(root: str | None, *args: str, env: dict | None = None, timeout: float = 300, prefix: list[str] | None = None,
               check: bool = True) -> dict:
    """Run worker.py in a fresh process; returns its JSON report (counters, warnings, equality)."""
    e = dict(os.environ)
    e.pop("PIECEWISE_CACHE_DIR", None)
    if root is not None:
        e["PIECEWISE_CACHE_DIR"] = root
    e.update(env or {})
    cmd = [*(prefix or []), sys.executable, WORKER, *args]
    p = subprocess.run(cmd, env=e, capture_output=True, text=True, timeout=timeout)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if check and (p.returncode != 0 or not lines):
        raise AssertionError(f"worker failed ({p.returncode}): {' '.join(cmd)}\nstdout:{p.stdout[-3000:]}\nstderr:{p.stderr[-5000:]}")
    report = json.loads(lines[-1]) if lines else {}
    report["returncode"] = p.returncode
    report["stderr"] = p.stderr
    return report
