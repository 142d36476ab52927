"""Private torch in one place (docs/design/torch-internals.md): no module outside
``piecewise._torch`` names a private torch attribute, read with `ast` as tests/test_layers.py reads
imports; ``import piecewise`` patches nothing of torch's; the ``nn.Module`` patches are installed by
the first compiled model and taken off again when the last one is freed."""

from __future__ import annotations

import ast
import json
import pathlib
import subprocess
import sys

import pytest

SRC = pathlib.Path(__file__).resolve().parents[1] / "src" / "piecewise"

#: ``torch.ops`` namespaces that are torch's own internals (an op of ``aten`` or a library's
#: namespace is public, whatever its name)
PRIVATE_OP_NAMESPACES = frozenset({"mkl", "mkldnn", "higher_order"})


def _private(parts: list[str]) -> bool:
    """Whether the dotted name `parts` (rooted at ``torch``) names something private of torch: a
    component with a leading underscore (not a dunder), or a private ``torch.ops`` namespace.
    Components after ``torch.ops.<namespace>`` are op names, not attributes of torch's modules."""
    if not parts or parts[0] != "torch":
        return False
    if len(parts) >= 2 and parts[1] == "ops":
        return len(parts) >= 3 and (parts[2] in PRIVATE_OP_NAMESPACES or _underscored(parts[2]))
    return any(_underscored(p) for p in parts[1:])


def _underscored(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _chain(node: ast.AST) -> list[str] | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return [node.id, *reversed(parts)]
    return None


def private_torch_names(source: str) -> list[tuple[int, str]]:
    """(line, name) of every private torch name `source` uses: ``import torch._x``, ``from
    torch._x import y``, ``from torch.x import _y``, and attribute chains ``torch._x...`` (the
    outermost of a chain only, so each use counts once), also through a name an import bound to
    a torch module (``from torch.nn.modules import module as m`` then ``m._global_forward_hooks``)."""
    tree = ast.parse(source)
    inner: set[int] = set()
    aliases: dict[str, list[str]] = {"torch": ["torch"]}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            inner.add(id(node.value))
        elif isinstance(node, ast.Import):
            aliases.update({a.asname: a.name.split(".") for a in node.names if a.asname and a.name.split(".")[0] == "torch"})
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "torch":
            aliases.update({a.asname or a.name: [*node.module.split("."), a.name] for a in node.names})
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if _private(a.name.split("."))]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            mod = node.module.split(".")
            if _private(mod):
                out.append((node.lineno, node.module))
            elif mod[0] == "torch":
                out += [(node.lineno, f"{node.module}.{a.name}") for a in node.names if _private([*mod, a.name])]
        elif isinstance(node, ast.Attribute) and id(node) not in inner:
            chain = _chain(node)
            if chain is not None and chain[0] in aliases and _private([*aliases[chain[0]], *chain[1:]]):
                out.append((node.lineno, ".".join([*aliases[chain[0]], *chain[1:]])))
    return out


def test_no_module_outside_piecewise_torch_names_a_private_torch_attribute():
    found = [f"{p.relative_to(SRC)}:{line}: {name}"
             for p in sorted(SRC.rglob("*.py")) if p.relative_to(SRC).parts[0] != "_torch"
             for line, name in private_torch_names(p.read_text())]
    assert found == [], ("private torch names outside piecewise._torch (move each behind a named function or "
                         "re-export in the _torch module of its subsystem):\n" + "\n".join(found))


def test_piecewise_torch_holds_what_the_count_looks_for():
    """The package that may use them does (the count is not blind), and every module of it says
    the torch version it was verified on."""
    used = {p.name: private_torch_names(p.read_text()) for p in (SRC / "_torch").glob("*.py")}
    assert used["dynamo.py"] and used["inductor.py"] and used["ops.py"]
    for p in (SRC / "_torch").glob("*.py"):
        if p.name not in ("__init__.py", "_lazy.py"):
            assert "verified on torch 2.13" in p.read_text().lower(), p.name


@pytest.mark.parametrize("source, expected", [
    ("import torch._dynamo", ["torch._dynamo"]),
    ("import torch.utils._pytree as pytree", ["torch.utils._pytree"]),
    ("from torch._inductor import config", ["torch._inductor"]),
    ("from torch.distributed import _functional_collectives", ["torch.distributed._functional_collectives"]),
    ("x = torch._C._has_storage(t)", ["torch._C._has_storage"]),
    ("op = torch.ops.higher_order.auto_functionalized", ["torch.ops.higher_order.auto_functionalized"]),
    ("op = torch.ops.mkldnn._linear_pointwise", ["torch.ops.mkldnn._linear_pointwise"]),
    ("op = torch.ops.aten._local_scalar_dense.default", []),
    ("op = torch.ops.aten.mm.default", []),
    ("import torch.fx.experimental.symbolic_shapes", []),
    ("n = torch.__version__", []),
    ("from piecewise._torch import dynamo", []),
    ("from torch.nn.modules import module as m\nh = m._global_forward_hooks", ["torch.nn.modules.module._global_forward_hooks"]),
    ("from torch import nn\nf = nn.Module.__setattr__", []),
])
def test_the_count_catches_what_it_is_for(source, expected):
    assert [name for _, name in private_torch_names(source)] == expected


_PATCH_STATE = r"""
import builtins, json, sys
import torch, torch.nn.modules
from torch.nn.modules import module as nn_module
from torch.utils.hooks import RemovableHandle

NAMES = ("_apply", "train", "register_forward_hook", "register_forward_pre_hook", "register_parameter",
         "__delattr__", "__setattr__", "__call__")

def snapshot():
    return {**{n: id(getattr(torch.nn.Module, n)) for n in NAMES},
            "remove": id(RemovableHandle.remove), "__import__": id(builtins.__import__),
            **{f: id(getattr(nn_module, f)) for f in ("register_module_forward_hook", "register_module_forward_pre_hook")},
            "param_hooks": len(nn_module._global_parameter_registration_hooks),
            "buffer_hooks": len(nn_module._global_buffer_registration_hooks),
            "module_hooks": len(nn_module._global_module_registration_hooks)}

def changed(a, b):
    return sorted(k for k in a if a[k] != b[k])

torch_own = snapshot()
import piecewise, piecewise.api, piecewise.state
after_import = snapshot()
out = {"import": changed(torch_own, after_import)}
if sys.argv[1] == "lifetime":
    import gc
    import piecewise as pw
    x = torch.randn(3, 4)
    cms = [pw.compile(torch.nn.Linear(4, 4), pw.CompilationConfig(backend="eager", cache_dir=None), dynamic_arg_dims={"input": 0})
           for _ in range(2)]
    for cm in cms:
        cm(x)
    out["compiled"] = changed(torch_own, snapshot())
    m = cms[0].module
    e = piecewise.state.epoch()
    m.weight = torch.nn.Parameter(torch.randn(4, 4))
    out["epoch_moves_while_compiled"] = piecewise.state.epoch() > e
    del cms[0], cm
    gc.collect()
    out["one_freed"] = changed(torch_own, snapshot())
    cms.clear()
    gc.collect()
    out["all_freed"] = changed(torch_own, snapshot())
    cm = pw.compile(torch.nn.Linear(4, 4), pw.CompilationConfig(backend="eager", cache_dir=None), dynamic_arg_dims={"input": 0})
    cm(x)
    out["compiled_again"] = changed(torch_own, snapshot())
    e = piecewise.state.epoch()
    cm.module.train(False)
    out["epoch_moves_again"] = piecewise.state.epoch() > e
print(json.dumps(out))
"""

_PATCHED = ["__delattr__", "__setattr__", "_apply", "buffer_hooks", "module_hooks", "param_hooks", "register_forward_hook",
            "register_forward_pre_hook", "register_module_forward_hook", "register_module_forward_pre_hook",
            "register_parameter", "remove", "train"]


def _patch_state(mode: str) -> dict:
    p = subprocess.run([sys.executable, "-c", _PATCH_STATE, mode], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_import_piecewise_patches_nothing_of_torch():
    """A fresh process: after ``import piecewise`` (and its compile entry, ``piecewise.api``),
    ``nn.Module``'s methods, hook handles, torch's hook registries and ``builtins.__import__`` are
    torch's and Python's own."""
    assert _patch_state("import") == {"import": []}


def test_module_patches_live_as_long_as_a_compiled_model():
    """The first compiled model installs the ``nn.Module`` patches (the state epoch moves on a
    parameter assignment); they stay while one compiled model is alive, are taken off when the
    last one is freed (every patched name is torch's own again, no registration hook of ours is
    left), and a later compile installs them again."""
    out = _patch_state("lifetime")
    assert out["import"] == []
    assert out["compiled"] == _PATCHED
    assert out["epoch_moves_while_compiled"] is True
    assert out["one_freed"] == _PATCHED
    assert out["all_freed"] == []
    assert out["compiled_again"] == _PATCHED
    assert out["epoch_moves_again"] is True
