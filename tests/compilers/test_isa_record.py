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
