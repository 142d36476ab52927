"""Test-session setup: every cache lives in one session temp dir, removed at the end.

Set before torch is imported anywhere, so Inductor's on-disk caches (FX graph, AOTAutograd, C++
kernels) are shared by every test of the session and nothing is written outside the temp dir.
`make test` runs the suite on two pytest-xdist workers: the process that creates the dir passes it
to the workers through ``PIECEWISE_TEST_SESSION_DIR``, so they share it, and only it removes it.
"""

import os
import shutil
import tempfile

_OWNER = "PIECEWISE_TEST_SESSION_DIR" not in os.environ
if _OWNER:
    os.environ["PIECEWISE_TEST_SESSION_DIR"] = tempfile.mkdtemp(prefix="piecewise-tests-")
_SESSION_DIR = os.environ["PIECEWISE_TEST_SESSION_DIR"]
os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(_SESSION_DIR, "inductor")
os.environ["TRITON_CACHE_DIR"] = os.path.join(_SESSION_DIR, "triton")
os.environ["PIECEWISE_CACHE_DIR"] = os.path.join(_SESSION_DIR, "piecewise")
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_HOME"] = os.path.join(_SESSION_DIR, "hf")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

from piecewise.counters import counters  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="GPU tier: needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_sessionfinish(session, exitstatus):
    if _OWNER:
        shutil.rmtree(_SESSION_DIR, ignore_errors=True)
        os.environ.pop("PIECEWISE_TEST_SESSION_DIR", None)


@pytest.fixture
def session_dir():
    return _SESSION_DIR


@pytest.fixture(autouse=True)
def _isolated(monkeypatch, tmp_path_factory):
    """Each test: fresh Dynamo state, zeroed counters and its own (empty) piecewise cache root."""
    torch._dynamo.reset()
    counters.reset()
    monkeypatch.setenv("PIECEWISE_CACHE_DIR", str(tmp_path_factory.mktemp("pwcache")))
    yield
