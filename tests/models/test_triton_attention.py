"""The reference decoder's Triton attention kernel, checked against SDPA on the CPU under Triton's
interpreter. `make test` installs Triton into .venv/triton, off the venv's path; the checks run
in a subprocess that puts it on PYTHONPATH (triton_interpret_checks.py)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
TRITON_DIR = Path(os.environ.get("PIECEWISE_TRITON_PATH", ROOT / ".venv" / "triton"))


@pytest.fixture(scope="module")
def checks():
    if not (TRITON_DIR / "triton").is_dir():
        pytest.fail(f"Triton is not installed at {TRITON_DIR}: run `make test` (it installs it there), or point "
                    "PIECEWISE_TRITON_PATH at a folder holding the triton package")
    env = dict(os.environ, TRITON_INTERPRET="1", PIECEWISE_LLAMA_ATTENTION="triton",
               PYTHONPATH=os.pathsep.join([str(TRITON_DIR), str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("triton_interpret_checks.py"))], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert {r["check"] for r in rows} == {"kernel", "num_real", "decoder"}, proc.stdout
    return rows


def test_kernel_equals_sdpa_on_a_mixed_batch(checks):
    """Decode tokens and two prefills in one batch, positions over several kernel blocks, fp32 and
    fp16, GQA groups 1 and 3, head dims 16 and 24: within the dtype's tolerance of SDPA, every
    element written."""
    kernels = [r for r in checks if r["check"] == "kernel"]
    assert len(kernels) == 4
    for r in kernels:
        assert not r["nan"] and r["max_abs"] <= r["tol"], r


def test_pad_rows_by_a_device_count_are_zero(checks):
    (r,) = [r for r in checks if r["check"] == "num_real"]
    assert r["pad_zero"] and r["real_max_abs"] <= 1e-5


def test_reference_decoder_on_the_kernel_decodes_the_sdpa_tokens(checks):
    (r,) = [r for r in checks if r["check"] == "decoder"]
    assert r["equal"] and len(r["tokens"]) == 3 and r["max_abs"] <= 1e-4


def test_attention_impl_is_validated(monkeypatch):
    from piecewise.errors import ConfigError
    from piecewise.serving import llama

    monkeypatch.setattr(llama, "_attention_impl", None)
    monkeypatch.setenv("PIECEWISE_LLAMA_ATTENTION", "flash")
    with pytest.raises(ConfigError, match="PIECEWISE_LLAMA_ATTENTION='flash'"):
        llama.attention_impl()
    monkeypatch.setenv("PIECEWISE_LLAMA_ATTENTION", "SDPA")
    assert llama.attention_impl() == "sdpa"
    assert not llama._use_triton(torch.zeros(1))  # forced SDPA: never the kernel
