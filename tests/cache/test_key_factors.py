"""Each cache key factor, flipped alone in a real process, misses; irrelevant changes hit."""

import os
import shutil
import textwrap

import pytest

from cachehelp import run_worker

SOURCE = textwrap.dedent(
    """
    import torch
    import piecewise.models.toy  # noqa: F401

    class Model(torch.nn.Module):
        dim = 8

        def forward(self, x, bias=None):
            # {comment}
            y = torch.ops.piecewise_models.toy_attention(x.sin(), x, x)
            if bias is not None:
                y = y + bias
            return torch.ops.piecewise_models.toy_attention(y * 2, y, y).tanh()
    """
)


def _hit(r):
    c = r["counters"]
    return c.get("cache_hits", 0) == 1 and c.get("compiler_invocations", 0) == 0 and c.get("cache_misses", 0) == 0


def _miss(r):
    c = r["counters"]
    return c.get("cache_misses", 0) == 1 and c.get("compiler_invocations", 0) > 0


@pytest.fixture
def model_file(tmp_path):
    path = tmp_path / "user_model.py"
    path.write_text(SOURCE.format(comment="v1"))
    return str(path)


def test_code_factors_each_miss_alone(tmp_path, model_file):
    root = str(tmp_path / "root")
    base = ("--source", model_file)
    first = run_worker(root, *base)
    assert _miss(first) and first["equal"]
    assert _hit(run_worker(root, *base))
    # an allow-listed environment variable
    assert _miss(run_worker(root, *base, env={"PIECEWISE_KEY_SALT": "1"}))
    # a config field that changes code
    assert _miss(run_worker(root, *base, "--max-num-tokens", "32"))
    # the split-op set (same graph, same pieces: only the set differs)
    assert _miss(run_worker(root, *base, "--splitting-ops", "piecewise_models::toy_attention"))
    # an input that is None in one run and a tensor in the other
    r = run_worker(root, *base, "--with-bias")
    assert _miss(r) and r["equal"]
    # an edit to a traced source file that changes nothing but a comment
    with open(model_file, "w") as f:
        f.write(SOURCE.format(comment="v2"))
    assert _miss(run_worker(root, *base))


def test_irrelevant_changes_still_hit(tmp_path, model_file):
    root = str(tmp_path / "root")
    base = ("--source", model_file)
    assert _miss(run_worker(root, *base))
    # unrelated env var, HOME, and (necessarily) another PID
    assert _hit(run_worker(root, *base, env={"SOME_UNRELATED_VAR": "x", "HOME": str(tmp_path)}))
    # another host name, in a private UTS namespace
    r = run_worker(root, *base, prefix=["unshare", "-u", "sh", "-c", 'hostname other-host && exec "$0" "$@"'])
    assert _hit(r)
    # the root moved elsewhere: paths inside are relative
    moved = str(tmp_path / "moved" / "root")
    os.makedirs(os.path.dirname(moved))
    shutil.move(root, moved)
    assert _hit(run_worker(moved, *base))


def test_inductor_config_is_a_factor(tmp_path):
    root = str(tmp_path / "root")
    first = run_worker(root, "--backend", "inductor")
    assert _miss(first) and first["equal"]
    warm = run_worker(root, "--backend", "inductor")
    assert _hit(warm) and warm["counters"]["cache_loads"] == 3
    assert _miss(run_worker(root, "--backend", "inductor", "--inductor-option", "fallback_random=True"))
