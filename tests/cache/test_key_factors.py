"""Each cache key factor, flipped alone in a real process, misses; irrelevant changes hit."""

import os
import shutil
import textwrap

import pytest

from cachehelp import run_worker

SOURCE = textwrap.dedent(
    """
    import torch
    import piecewise.testing.toy  # noqa: F401

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


# -- the miss log line: which factors differ from the closest compile entry of the tag ---------------
def _entry(root, key, tag, factors, mtime):
    import json

    d = os.path.join(root, key, "rank_0_0", tag)
    os.makedirs(d)
    f = os.path.join(d, "cache_key_factors.json")
    with open(f, "w") as fh:
        json.dump(factors, fh)
    os.utime(f, (mtime, mtime))
    return d


def _miss_line(caplog, root, tag, factors, path="/nonexistent"):
    import logging

    from piecewise.backend import explain_miss

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="piecewise"):
        explain_miss(root, tag, factors, path)
    (line,) = [r.getMessage() for r in caplog.records if "compile cache miss" in r.getMessage()]
    return line


BASE = {"torch": "2.x", "config": {"max_num_tokens": 16, "mode": "piecewise", "backend": "eager"},
        "graph": "g1", "inputs": {"call": []}, "sources": {"toy.py": "aa"}}


def _with(**changes):
    import copy

    out = copy.deepcopy(BASE)
    for dotted, v in changes.items():
        cur = out
        *head, last = dotted.split("__")
        for part in head:
            cur = cur[part]
        cur[last] = v
    return out


def test_miss_names_only_the_factor_that_differs_from_the_compile_entry_not_the_newer_bundle(tmp_path, caplog):
    root = str(tmp_path)
    compiled = _entry(root, "a" * 20, "M", BASE, 1000)
    # the tag's warm-start bundle is written after the compile entry: newest, and start-key factors
    _entry(root, "b" * 20, "M", {"kind": "warm_start", "bundle_format": 1, "module": {}, "call": []}, 2000)
    line = _miss_line(caplog, root, "M", _with(config__max_num_tokens=32))
    assert line.endswith(" in config.max_num_tokens") and compiled in line


def test_miss_picks_the_closest_compile_entry_then_the_newest(tmp_path, caplog):
    root = str(tmp_path)
    close = _entry(root, "c" * 20, "M", _with(graph="g2"), 1000)  # 2 factors away from `now`
    _entry(root, "d" * 20, "M", _with(graph="g3", torch="1.x", sources__toy_py="bb"), 3000)  # newer, 3+ away
    now = _with(graph="g1", config__max_num_tokens=32)
    line = _miss_line(caplog, root, "M", now)
    assert close in line and line.endswith(" in config.max_num_tokens, graph")
    # a tie (one factor each): the newest wins
    older = _entry(root, "e" * 20, "M", _with(config__max_num_tokens=32, graph="x"), 4000)
    newer = _entry(root, "f" * 20, "M", _with(config__max_num_tokens=32, torch="9"), 5000)
    line = _miss_line(caplog, root, "M", now)
    assert newer in line and older not in line and line.endswith(" in torch")


def test_miss_ignores_other_tags_its_own_entry_and_unreadable_files(tmp_path, caplog):
    root = str(tmp_path)
    _entry(root, "1" * 20, "Other", _with(config__max_num_tokens=32), 5000)  # identical factors, other tag
    own = _entry(root, "2" * 20, "M", _with(config__max_num_tokens=32), 6000)  # the entry being written
    bad = _entry(root, "3" * 20, "M", BASE, 7000)
    with open(os.path.join(bad, "cache_key_factors.json"), "w") as fh:
        fh.write("{not json")
    _entry(root, "4" * 20, "M", {"kind": "warm_start", "bundle_format": 1}, 8000)
    line = _miss_line(caplog, root, "M", _with(config__max_num_tokens=32), path=own)
    assert "no compile entry for this tag" in line
    good = _entry(root, "5" * 20, "M", BASE, 1000)
    line = _miss_line(caplog, root, "M", _with(config__max_num_tokens=32), path=own)
    assert good in line and line.endswith(" in config.max_num_tokens")


def test_a_restart_with_one_changed_field_logs_only_that_field(tmp_path, caplog):
    """End to end in one process: the real entries (compile entry and warm-start bundle) of a tag."""
    import gc
    import logging

    import torch

    import piecewise as pw
    from piecewise.cache import tools
    from piecewise.testing.toy import TwoSplitModel

    root = str(tmp_path / "r")
    x = torch.randn(3, 8)
    for n in (16, 32):
        torch._dynamo.reset()
        cfg = pw.CompilationConfig(backend="eager", max_num_tokens=n, cache_dir=root, tag="restart")
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="piecewise"):
            cm = pw.compile(TwoSplitModel(), cfg, dynamic_arg_dims={"x": 0})
            cm(x)
        del cm
        gc.collect()  # releases the tag, as a process exit does
    kinds = sorted(e.kind for e in tools.list_entries(root))
    assert kinds == ["bundle", "bundle", "compile", "compile"], kinds
    (line,) = [r.getMessage() for r in caplog.records if "compile cache miss" in r.getMessage()]
    assert line.endswith(" in config.max_num_tokens"), line


def test_the_device_index_is_part_of_the_input_signature():
    """Inductor writes the device index into its wrapper code, so a piece compiled on cuda:0 must
    not be the one a rank on cuda:1 loads (ranks share entries of the same key). CPU tensors have
    no index and keep the plain device type."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from piecewise.cache.key import input_signature

    with FakeTensorMode():
        a, b = torch.empty(2, device="cuda:0"), torch.empty(2, device="cuda:1")
    assert input_signature([a]) != input_signature([b])
    assert "cuda:1" in str(input_signature([b])) and "'cpu'" in str(input_signature([torch.empty(2)]))
