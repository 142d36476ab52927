"""The saved artifact of a warm start (`piecewise.warmstart.CompiledArtifact`): what a cold start
saves loads back as the same trace, plan and pieces, and says when its traced code is stale."""

from __future__ import annotations

import dataclasses
import gc
import json
import os

import torch

import piecewise as pw
import piecewise.testing.toy  # noqa: F401  registers piecewise_models::toy_attention
from piecewise.cache import tools
from piecewise.compiled import CompiledPlan
from piecewise.warmstart import CompiledArtifact, decode_bundle


class Attn(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.ops.piecewise_models.toy_attention(self.lin(x), x, x)
        return self.lin(x).relu()


def _cold_start(root: str) -> tuple[bytes, dict]:
    """Compile and run `Attn` once with a cache root; the bundle's bytes and its index."""
    model = Attn()
    cm = pw.compile(model, pw.CompilationConfig(backend="eager", cache_dir=root, max_num_tokens=16), dynamic_arg_dims={"x": 0})
    x = torch.randn(5, 8)
    torch.testing.assert_close(cm(x), model(x))
    del cm
    gc.collect()
    (entry,) = [e for e in tools.list_entries(root) if e.kind == "bundle"]
    (rank,) = [d for d in os.listdir(os.path.join(root, entry.key)) if d.startswith("rank_")]
    (tag,) = os.listdir(os.path.join(root, entry.key, rank))
    with open(os.path.join(root, entry.key, rank, tag, "index.json")) as f:
        idx = json.load(f)
    with open(os.path.join(root, *idx["artifacts"]["bundle"]["file"].split("/")), "rb") as f:
        return f.read(), idx


def test_a_saved_artifact_loads_as_the_trace_plan_and_pieces_the_cold_start_built(tmp_path):
    data, idx = _cold_start(str(tmp_path / "c"))
    art = CompiledArtifact.load(data)
    assert isinstance(art.plan, CompiledPlan) and art.plan.cache_key == idx["meta"]["compile_key"]
    assert art.piece_names == [] and isinstance(art.dynamo, bytes) and art.dynamo
    assert any(os.path.basename(p) == os.path.basename(__file__) for p in art.sources), art.sources
    assert art.modules.get(__name__) == os.path.realpath(__file__)
    assert art.stale() == ""
    pieces = {n for n, _ in art.split_module.named_children()}
    assert len(pieces) >= 3, pieces  # before, the splitting op, after
    # saved again, it loads as the same artifact; decode_bundle's fields are the artifact's
    again = CompiledArtifact.load(art.save())
    assert (again.plan.cache_key, again.dynamo, again.sources, again.modules) == (art.plan.cache_key, art.dynamo,
                                                                                 art.sources, art.modules)
    assert again.split_module.code == art.split_module.code
    assert {n for n, _ in again.split_module.named_children()} == pieces
    body = decode_bundle(data)
    assert body["dynamo"] == art.dynamo and body["plan"].cache_key == art.plan.cache_key
    assert {n for n, _ in body["split_module"].named_children()} == pieces


def test_an_artifact_whose_traced_source_changed_is_stale(tmp_path):
    data, _ = _cold_start(str(tmp_path / "c"))
    art = CompiledArtifact.load(data)
    edited = dataclasses.replace(art, sources={path: "0" * 64 for path in art.sources})
    assert "changed since the bundle was made" in edited.stale()
    moved = dataclasses.replace(art, modules={__name__: "/elsewhere/other.py"})
    assert moved.stale().startswith(f"module {__name__} (traced from /elsewhere/other.py")
