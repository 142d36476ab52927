"""The old module paths (issue 46 item 3: `piecewise.models` holds only what it says) keep working
for one release: each warns (`DeprecationWarning` naming the new path) and stands for the moved
module itself, so every name, private ones included, is the same object. Nothing in the repository
imports an old path any more, and `import piecewise` warns about none of this."""

from __future__ import annotations

import importlib
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

#: old module path -> new module path
MOVED = {
    "piecewise.models.hf": "piecewise.hf.attention",
    "piecewise.models.hf_generate": "piecewise.hf.generate",
    "piecewise.models.weights": "piecewise.hf.gguf",
    "piecewise.models.chat": "piecewise.hf.chat",
    "piecewise.models.decode": "piecewise.serving.decode",
    "piecewise.models.llama": "piecewise.serving.llama",
    "piecewise.models.triton_attention": "piecewise.serving.triton_attention",
    "piecewise.models.tensor_parallel": "piecewise.serving.tensor_parallel",
    "piecewise.models.toy": "piecewise.testing.toy",
    "piecewise.bench.redis_server": "piecewise.testing.redis_server",
}

#: the names `piecewise.models` exported, now `piecewise.serving`'s
PACKAGE_NAMES = ["DecodeResult", "DecodeTrace", "LLAMA_ATTENTION_OP", "LlamaBackbone", "LlamaConfig",
                 "LlamaForCausalLM", "default_trace", "greedy_decode", "llama_attention", "make_prompts"]


def _forget(old: str) -> None:
    """As if `old` had never been imported in this process (the new module stays: its ops are
    registered once)."""
    sys.modules.pop(old, None)
    parent, _, name = old.rpartition(".")
    if parent in sys.modules:
        vars(sys.modules[parent]).pop(name, None)


@pytest.mark.parametrize("old", sorted(MOVED))
def test_each_old_module_path_warns_and_is_the_moved_module(old):
    new = importlib.import_module(MOVED[old])
    _forget(old)
    with pytest.warns(DeprecationWarning, match=re.escape(f"{old} moved to {MOVED[old]}")):
        module = importlib.import_module(old)
    assert module is new
    names = [n for n in vars(new) if not n.startswith("__")]
    assert names and all(getattr(module, n) is getattr(new, n) for n in names)
    # the from-import form a user writes binds the same module
    parent, _, name = old.rpartition(".")
    assert getattr(importlib.import_module(parent), name) is new


@pytest.mark.parametrize("name", PACKAGE_NAMES)
def test_the_names_piecewise_models_exported_warn_and_are_the_serving_objects(name):
    import piecewise.models
    import piecewise.serving

    vars(piecewise.models).pop(name, None)  # a first use in this process
    with pytest.warns(DeprecationWarning, match=re.escape(f"piecewise.models.{name} moved to piecewise.serving.")):
        value = getattr(piecewise.models, name)
    assert value is getattr(piecewise.serving, name)
    assert sorted(piecewise.models.__all__) == sorted(PACKAGE_NAMES)
    with pytest.raises(AttributeError, match="no attribute 'nonexistent'"):
        piecewise.models.nonexistent  # noqa: B018


def test_import_piecewise_and_the_new_packages_warn_about_no_moved_module():
    code = ("import warnings\n"
            "with warnings.catch_warnings(record=True) as caught:\n"
            "    warnings.simplefilter('always')\n"
            "    import piecewise\n"
            "    piecewise.compile\n"
            f"    for m in {sorted(set(MOVED.values()) | {'piecewise.serving', 'piecewise.demo', 'piecewise.cli'})!r}:\n"
            "        __import__(m)\n"
            "print([str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)"
            " and 'moved to' in str(w.message)])\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


#: an import of an old path, in Python (a module or a script in a string) and in docs' code
OLD_IMPORT = re.compile(r"\bpiecewise\.models\b|\bpiecewise\.bench\.redis_server\b|from \.\.?models\b"
                        r"|from \.\.?bench\.redis_server\b|from \.redis_server\b|from piecewise import models\b")


def _repository_files() -> list[pathlib.Path]:
    shims = {ROOT / "src/piecewise/models", ROOT / "src/piecewise/bench/redis_server.py", pathlib.Path(__file__)}
    files = [*(ROOT / "src").rglob("*.py"), *(ROOT / "tests").rglob("*.py"), *(ROOT / "benchmarks").rglob("*.py"),
             *(ROOT / "scripts").rglob("*"), *(ROOT / "docs").rglob("*.md"), ROOT / "README.md", ROOT / "Makefile",
             ROOT / "pyproject.toml", ROOT / "mkdocs.yml"]
    return [p for p in files if p.is_file() and "__pycache__" not in p.parts
            and not any(p == s or s in p.parents for s in shims)]


def test_nothing_in_the_repository_imports_an_old_path():
    found = []
    for path in _repository_files():
        for i, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if path.suffix == ".md" and not re.match(r"\s*(from|import) |:::", line):
                continue  # prose may name the old paths (the deprecation note)
            if OLD_IMPORT.search(line):
                found.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()}")
    assert not found, "old module paths still imported:\n" + "\n".join(found)


def test_the_old_path_check_catches_each_form():
    for line in ["from piecewise.models import hf", "import piecewise.models.toy", "from ..models.llama import X",
                 "from piecewise.bench.redis_server import RedisServer", "from .redis_server import RedisServer"]:
        assert OLD_IMPORT.search(line), line
    assert not OLD_IMPORT.search("from piecewise.hf import attention as hf")
    assert not OLD_IMPORT.search("from transformers.models.llama.modeling_llama import apply_rotary_pos_emb")
