"""GPU tier of generation (marker `gpu`; skipped without CUDA by the root conftest, never deleted).

Both generation paths on a real CUDA device with real CUDA graphs and Inductor: transformers
``generate()`` on a `pw.compile`d model (decode steps replayed as piecewise or full graphs) and the
reference decoder from `from_hf` in the continuous-batching loop. Tokens equal transformers' eager
greedy tokens on the same device; no recompiles; the decode graphs are replayed. The CPU tier runs
the same paths on a fake graph platform (tests/graphs/test_capture.py, test_from_hf.py).
"""

from __future__ import annotations

import pytest
import torch

import piecewise as pw
from piecewise import CompilationConfig, counters
from piecewise.hf import attention as pw_hf
from piecewise.serving.decode import greedy_decode
from piecewise.serving.llama import LlamaForCausalLM
from test_from_hf import _requests, tiny_hf

pytestmark = pytest.mark.gpu

DIMS = {"input_ids": 0, "positions": 0, "seq_ids": 0}


def _hf_cases(seed: int):
    """(ids, attention_mask) for batches 1..4 and prompt lengths 1..9 on CUDA, one row left-padded
    where the batch has more than one row and the prompt more than two tokens."""
    gen = torch.Generator().manual_seed(seed)
    for batch, length, new in ((1, 5, 6), (3, 9, 4), (4, 2, 7), (2, 1, 5), (3, 6, 3), (1, 9, 4)):
        ids = torch.randint(1, 256, (batch, length), generator=gen)
        mask = torch.ones(batch, length, dtype=torch.long)
        if batch > 1 and length > 2:
            mask[0, :2] = 0
        yield ids.cuda(), mask.cuda(), new


@pytest.mark.parametrize("mode", ["piecewise", "full"])
def test_transformers_generate_on_cuda_replays_decode_graphs_and_equals_eager(mode, tmp_path):
    """Compiled ``generate()`` with Inductor pieces and CUDA graphs: the KV cache piecewise owns lives
    on the device, the decode step is captured per batch size (``mode``: pieces between the attention
    ops, or the whole step with the attention op inside), and every token equals sdpa eager's."""
    pw_hf.register_hf_attention()
    model = pw_hf.tiny_llama(num_layers=2).cuda()
    ref = pw_hf.tiny_llama(num_layers=2, attn_implementation="sdpa").cuda()
    cm = pw.compile(model, CompilationConfig(backend="inductor", max_num_seqs=4, max_model_len=64, cudagraph_mode=mode,
                                             cache_dir=str(tmp_path)))
    with counters.expect(recompiles=0):
        for ids, mask, new in _hf_cases(7):
            kw = dict(attention_mask=mask, max_new_tokens=new, do_sample=False, use_cache=True, pad_token_id=0)
            with torch.no_grad():
                want = ref.generate(ids, **kw)
            assert torch.equal(cm.generate(ids, **kw), want), (ids.shape, new)
    assert cm._route.step.k_cache_0.device.type == "cuda"
    decode = counters.by_tag[f"{cm.tag}_generate_decode"]
    assert decode.dynamo_traces == 1 and decode.graphs_captured > 0 and decode.graph_replays > 0


def test_assigned_forward_generate_on_cuda_equals_eager(tmp_path):
    """``model.forward = compiled`` then ``model.generate(...)`` on CUDA, static-cache spelling."""
    pw_hf.register_hf_attention()
    model = pw_hf.tiny_llama(num_layers=2, seed=3).cuda()
    ref = pw_hf.tiny_llama(num_layers=2, seed=3, attn_implementation="sdpa").cuda()
    model.forward = pw.compile(model, CompilationConfig(backend="inductor", max_num_seqs=4, max_model_len=64,
                                                        cache_dir=str(tmp_path)))
    with counters.expect(recompiles=0):
        for ids, mask, new in _hf_cases(9):
            kw = dict(attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=0)
            with torch.no_grad():
                want = ref.generate(ids, **kw)
                got = model.generate(ids, cache_implementation="static", **kw)
            assert torch.equal(got, want), (ids.shape, new)


def test_engine_on_cuda_with_graphs_equals_hf_per_prompt(greedy_margin, tmp_path):
    """The reference decoder from a transformers checkpoint on CUDA, Inductor pieces replayed as CUDA
    graphs, 7 requests through 3 slots arriving at different steps: each request's tokens equal
    transformers' eager greedy tokens for that prompt alone."""
    hf = tiny_hf("llama-tied-mqa", seed=5).cuda()
    prompts, arrivals, budgets = _requests(seed=6)
    want = []
    for p, n in zip(prompts, budgets):
        x = torch.tensor([p], device="cuda")
        with torch.no_grad():
            out = hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=n)
        want.append(out[0, len(p):].tolist())
    model = LlamaForCausalLM.from_hf(hf, max_num_seqs=3, max_seq_len=48)
    cm = pw.compile(model, CompilationConfig(backend="inductor", max_num_tokens=64, cache_dir=str(tmp_path)),
                    dynamic_arg_dims=DIMS)
    forward = greedy_margin(cm)
    with counters.expect(recompiles=0, dynamo_traces=1):
        run = greedy_decode(forward, prompts, budgets, arrival_steps=arrivals, eos_token_ids=model.eos_token_ids,
                            config=model.config, reset=model.reset_kv_cache, device="cuda")
    assert run.tokens == want
    assert counters.by_tag[cm.tag].graph_replays > 0
    forward.assert_far_from_ties()
