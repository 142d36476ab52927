"""The recorded answer of Inductor's CPU vector-ISA probe (`piecewise.compilers.isa_record`).

Each check runs in a fresh process: the probe's answer is memoised per process.
"""

import json
import os
import subprocess
import sys

import pytest

CHECK = r'''
import json, sys
import torch
from torch._inductor import cpu_vec_isa
from piecewise.compilers import isa_record as I

root = sys.argv[1]
probes = []
orig = cpu_vec_isa.VecISA.check_build
cpu_vec_isa.VecISA.check_build = lambda self, code: probes.append(str(self)) or orig(self, code)
if sys.argv[2] == "probe":
    I.probe(root)
    used = False
else:
    used = I.use_record(root)
print(json.dumps({"used": used, "isa": [str(i) for i in cpu_vec_isa.valid_vec_isa_list()],
                  "picked": str(cpu_vec_isa.pick_vec_isa()), "probes": probes}))
'''


def _run(root, mode):
    p = subprocess.run([sys.executable, "-c", CHECK, str(root), mode], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def _record(root):
    (name,) = os.listdir(os.path.join(root, "isa"))
    return os.path.join(root, "isa", name)


@pytest.fixture(scope="module")
def probed(tmp_path_factory):
    root = tmp_path_factory.mktemp("isa")
    os.chmod(root, 0o755)
    return root, _run(root, "probe")


def test_a_recorded_probe_answer_is_used_without_probing(probed):
    root, first = probed
    assert os.path.exists(_record(root))
    again = _run(root, "use")
    assert again["used"] and again["probes"] == []
    assert again["isa"] == first["isa"] and again["picked"] == first["picked"]


@pytest.mark.parametrize("damage", ["junk", "unknown_isa", "missing_key"])
def test_a_damaged_or_foreign_record_is_ignored_and_the_cpu_probed(probed, tmp_path, damage):
    root, first = probed
    other = tmp_path / "root"
    os.makedirs(other / "isa")
    os.chmod(other, 0o755)
    body = {"junk": "{not json", "unknown_isa": json.dumps({"valid_vec_isa": ["avx9000"]}),
            "missing_key": json.dumps({"isa": ["avx2"]})}[damage]
    with open(other / "isa" / os.path.basename(_record(root)), "w") as f:
        f.write(body)
    r = _run(other, "use")
    assert not r["used"] and r["isa"] == first["isa"]


def test_a_record_another_user_could_write_is_not_trusted(probed, tmp_path):
    import shutil

    root, first = probed
    other = tmp_path / "shared"
    shutil.copytree(root, other)
    os.chmod(other, 0o777)
    assert not _run(other, "use")["used"]


def test_a_cold_start_with_inductor_records_the_probe_for_the_first_warm_start(tmp_path):
    import torch

    import piecewise as pw
    from piecewise.models.toy import ToyTransformer

    root = tmp_path / "c"
    cm = pw.compile(ToyTransformer(1, dim=8), pw.CompilationConfig(backend="inductor", cache_dir=str(root)),
                    dynamic_arg_dims={"x": 0})
    cm(torch.randn(3, 8))
    r = _run(root, "use")
    assert r["used"] and r["probes"] == []


EARLY = r'''
import json, sys, threading
import torch
import piecewise as pw
from piecewise import backend as B
from piecewise.compilers import isa_record as I
from piecewise.models.toy import ToyTransformer

events = []
orig_start, orig_call = I.start_probe, B.PiecewiseBackend.__call__
def start_probe(root):
    orig_start(root)
    events.append(("start_probe", I._probe_thread is not None))
def call(self, gm, example_inputs):
    events.append(("backend", I._probe_thread is not None and I._probe_thread.is_alive()))
    return orig_call(self, gm, example_inputs)
I.start_probe, B.PiecewiseBackend.__call__ = start_probe, call
patches = json.loads(sys.argv[2])
cm = pw.compile(ToyTransformer(1, dim=8), pw.CompilationConfig(backend="inductor", cache_dir=sys.argv[1],
                inductor_options=patches), dynamic_arg_dims={"x": 0})
x = torch.randn(3, 8)
ok = torch.allclose(cm(x), cm.module(x), rtol=1.3e-6, atol=1e-5)
print(json.dumps({"events": events, "equal": ok}))
'''


def _early(root, patches):
    p = subprocess.run([sys.executable, "-c", EARLY, str(root), json.dumps(patches)], capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_a_cold_compile_starts_the_probe_before_the_trace_and_records_it(tmp_path):
    root = tmp_path / "early"
    r = _early(root, {})
    assert r["equal"]
    # the probe thread was started by piecewise.compile's first call, before Dynamo handed the graph over
    assert r["events"][0] == ["start_probe", True]
    assert [e[0] for e in r["events"]].index("backend") > 0
    assert os.path.exists(_record(root))  # saved by the background probe itself
    # the next process finds the record and starts no probe thread
    again = _early(root, {})
    assert again["events"][0] == ["start_probe", False] and again["equal"]


def test_isa_settings_in_the_inductor_options_keep_the_probe_inside_the_compile(tmp_path):
    from piecewise.compilers.inductor import _patches_isa

    assert _patches_isa({"cpp.vec_isa_ok": False}) and _patches_isa({"cpp": {"simdlen": 256}})
    assert not _patches_isa({"max_autotune": False, "cpp": {"threads": 1}})
    r = _early(tmp_path / "patched", {"cpp.vec_isa_ok": False})
    assert r["equal"]
    assert "start_probe" not in [e[0] for e in r["events"]]


def test_the_background_probe_imports_nothing_while_the_caller_traces(tmp_path):
    """Two threads importing torch's modules at once can fail a circular import in one of them, so
    start_probe imports what the probe needs first, and the probe thread imports no module."""
    code = r'''
import json, sys
import torch
import piecewise.compilers.inductor
from piecewise.compilers import isa_record as I
seen = {}
orig = I.probe
def probe(root):
    before = set(sys.modules)
    orig(root)
    seen["new"] = sorted(set(sys.modules) - before)
I.probe = probe
I.start_probe(None)
I.wait_for_probe()
print(json.dumps(seen))
'''
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    assert json.loads(p.stdout.strip().splitlines()[-1]) == {"new": []}
