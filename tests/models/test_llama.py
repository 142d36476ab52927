"""The reference Llama decoder and its continuous-batching greedy loop (CPU tier)."""

from __future__ import annotations

import pytest
import torch

from piecewise.forward_context import ForwardContext, set_forward_context
from piecewise.serving.decode import default_trace, greedy_decode, make_prompts
from piecewise.serving.llama import LLAMA_ATTENTION_OP, LlamaConfig, LlamaForCausalLM, llama_attention
from piecewise.ops import registered_splitting_ops

ATTN = torch.ops.piecewise_models.llama_attention.default


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    return LlamaForCausalLM(LlamaConfig(), seed=0).eval()


def _step(model, ids, positions, seq_ids):
    t = lambda xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731
    with torch.no_grad():
        return model(t(ids), t(positions), t(seq_ids))


def _caches(model) -> list[torch.Tensor]:
    return [b.clone() for layer in model.layers for b in (layer.self_attn.k_cache, layer.self_attn.v_cache)]


def test_attention_is_a_registered_splitting_op():
    assert LLAMA_ATTENTION_OP == "piecewise_models::llama_attention"
    assert LLAMA_ATTENTION_OP in registered_splitting_ops()


def test_same_seed_same_weights_different_seed_different_weights():
    a, b, c = (LlamaForCausalLM(seed=s).state_dict() for s in (3, 3, 4))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["lm_head.weight"], c["lm_head.weight"])


def test_incremental_decode_matches_one_prefill(model):
    seq = make_prompts(1, model.config.vocab_size, seed=11, min_len=14, max_len=14)[0]
    model.reset_kv_cache()
    full = _step(model, seq, range(len(seq)), [2] * len(seq))

    # Prefill 5, a chunk of 4 that attends to cached and fresh keys, then one token at a time; in
    # another slot, with stale entries from the full run left in slot 2 to prove slots are separate.
    pieces, start = [], 0
    for end in (5, 9, *range(10, len(seq) + 1)):
        pieces.append(_step(model, seq[start:end], range(start, end), [6] * (end - start)))
        start = end
    torch.testing.assert_close(torch.cat(pieces), full, rtol=1e-5, atol=1e-5)


def test_tokens_do_not_depend_on_batching_or_arrival_order(model, greedy_margin):
    prompts = make_prompts(5, model.config.vocab_size, seed=5, min_len=2, max_len=12)
    forward = greedy_margin(model)
    run = lambda ps, **kw: greedy_decode(forward, ps, 6, reset=model.reset_kv_cache, **kw).tokens  # noqa: E731

    alone = [run([p])[0] for p in prompts]
    assert len({tuple(t) for t in alone}) == len(prompts)  # distinct outputs: the comparison means something
    assert run(prompts, arrival_steps=[0] * 5) == alone
    # Reversed order, uneven arrivals and two slots: requests wait, share steps, and reuse freed slots.
    order = [4, 2, 0, 3, 1]
    mixed = run([prompts[i] for i in order], arrival_steps=[3, 0, 5, 1, 1], max_num_seqs=2)
    assert mixed == [alone[i] for i in order]
    # Logits of different batch sizes differ by ~1e-6 (BLAS blocking): exact token equality holds on
    # every CPU only because no greedy choice is that close to a tie.
    forward.assert_far_from_ties()


def test_default_trace_varies_step_size(model):
    trace = default_trace(model.config.vocab_size)
    result = greedy_decode(model, trace.prompts, trace.max_new_tokens, arrival_steps=trace.arrival_steps,
                           max_num_seqs=model.config.max_num_seqs, max_seq_len=model.config.max_seq_len,
                           reset=model.reset_kv_cache)
    assert len(set(result.step_sizes)) >= 8
    # Every prompt token is fed once, then every generated token but the last.
    fed = sum(map(len, trace.prompts)) + len(trace.prompts) * (trace.max_new_tokens - 1)
    assert sum(result.step_sizes) == fed
    assert len(result.step_seconds) == len(result.step_sizes)
    assert all(len(t) == trace.max_new_tokens for t in result.tokens)
    assert len({tuple(t) for t in result.tokens}) == len(trace.prompts)


def test_pad_rows_under_forward_context_leave_cache_untouched(model):
    ids, positions, seq_ids = [5, 6, 7], [0, 1, 2], [0, 0, 0]
    model.reset_kv_cache()
    expected = _step(model, ids, positions, seq_ids)
    expected_caches = _caches(model)

    # Pad rows aimed at a written row of the real sequence and at an empty slot: neither may be written.
    model.reset_kv_cache()
    with set_forward_context(ForwardContext(num_tokens=3, padded_num_tokens=5)):
        padded = _step(model, ids + [9, 9], positions + [0, 4], seq_ids + [0, 1])
    torch.testing.assert_close(padded[:3], expected, rtol=1e-5, atol=1e-5)
    # The cells the real rows write hold K/V computed in a 3-row and a 5-row call: a 5-row matmul
    # rounds differently (~1e-6 on some CPUs), so they agree within the dtype's tolerance - which
    # still catches a pad row's K/V written over cell (slot 0, position 0). Every other cell, the
    # empty slot's position 4 included, is untouched: exactly equal (zero).
    written = torch.zeros(expected_caches[0].shape[:2], dtype=torch.bool)
    written[seq_ids, positions] = True
    for got, want in zip(_caches(model), expected_caches):
        torch.testing.assert_close(got[written], want[written])
        assert torch.equal(got[~written], want[~written]) and not got[~written].any()
        assert not got[1, 4].any()  # the pad row aimed at the empty slot


def test_attention_op_zeroes_pad_rows():
    q, k, v = torch.randn(4, 4, 8), torch.randn(4, 2, 8), torch.randn(4, 2, 8)
    k_cache, v_cache = torch.zeros(2, 8, 2, 8), torch.zeros(2, 8, 2, 8)
    positions, seq_ids = torch.tensor([0, 1, 0, 0]), torch.tensor([1, 1, 0, 0])
    with set_forward_context(ForwardContext(num_tokens=2, padded_num_tokens=4)):
        out = torch.empty_like(q)
        llama_attention(q, k, v, k_cache, v_cache, positions, seq_ids, 8**-0.5, out)
    assert torch.equal(out[2:], torch.zeros_like(out[2:]))
    assert out[:2].abs().sum() > 0
    assert k_cache[0].abs().sum() == 0 and torch.equal(k_cache[1, :2], k[:2])


def test_a_cpu_step_writes_its_kv_cache_in_the_compiled_piece_and_a_padded_step_is_refused(monkeypatch):
    """Where no graph platform pads steps (the CPU), each layer writes its keys and values in the
    piece before the attention op (fused there under Inductor) and the op only attends: same
    tokens and the same cache as the eager model. Under a platform, or on CUDA, the op writes
    the real rows itself. An op handed no k/v (written already) with pad rows raises: the pad rows
    would have been written over whatever cells they name."""
    import piecewise as pw
    from piecewise.counters import counters
    from piecewise.graphs.platform import register_platform
    from piecewise.serving import llama

    assert llama.kv_written_in_piece("cpu") and not llama.kv_written_in_piece("cuda")
    with register_platform("cpu", lambda: None):
        assert not llama.kv_written_in_piece("cpu")

    handed: list[bool] = []
    real = llama._cpu_attention

    def spy(q, k, v, *rest):
        handed.append(k is None and v is None)
        return real(q, k, v, *rest)

    monkeypatch.setattr(llama, "_cpu_attention", spy)
    cfg = LlamaConfig(num_layers=2)
    trace = default_trace(cfg.vocab_size)
    eager = LlamaForCausalLM(cfg, seed=3).eval()
    model = LlamaForCausalLM(cfg, seed=3).eval()
    kw = dict(arrival_steps=trace.arrival_steps, max_num_seqs=cfg.max_num_seqs)
    with torch.no_grad():
        want = greedy_decode(eager, trace.prompts, trace.max_new_tokens, reset=eager.reset_kv_cache, **kw)
        compiled = pw.compile(model, pw.CompilationConfig(backend="eager", cache_dir=None, max_num_tokens=64),
                              dynamic_arg_dims={"input_ids": 0, "positions": 0, "seq_ids": 0})
        handed.clear()
        with counters.expect(recompiles=0):
            got = greedy_decode(compiled, trace.prompts, trace.max_new_tokens, reset=model.reset_kv_cache, **kw)
    assert got.tokens == want.tokens
    assert handed and all(handed)  # every layer of every step: written in the piece
    for a, b in zip(_caches(model), _caches(eager)):
        torch.testing.assert_close(a, b)

    q, k_cache = torch.randn(4, 4, 8), torch.zeros(2, 8, 2, 8)
    with set_forward_context(ForwardContext(num_tokens=2, padded_num_tokens=4)):
        with pytest.raises(pw.InputError, match="pad rows"):
            llama_attention(q, None, None, k_cache, k_cache.clone(), torch.tensor([0, 1, 0, 0]),
                            torch.tensor([1, 1, 0, 0]), 8**-0.5, torch.empty_like(q))


def test_an_eager_call_under_a_full_graph_context_without_pad_rows_equals_a_plain_call():
    """An uncompiled model run inside a full-graph forward context with every row real: its layers
    hand k/v to the op, which writes them as in a full graph. Before, each layer wrote them itself
    on the CPU and the op then refused the call as padded ("3 real of 3")."""
    from piecewise.forward_context import RuntimeMode

    cfg = LlamaConfig(num_layers=2)
    plain, inside = LlamaForCausalLM(cfg, seed=4).eval(), LlamaForCausalLM(cfg, seed=4).eval()
    ids, positions, seq_ids = [5, 6, 7], [0, 1, 2], [1, 1, 1]
    want = _step(plain, ids, positions, seq_ids)
    ctx = ForwardContext(num_tokens=3, padded_num_tokens=3, runtime_mode=RuntimeMode.FULL,
                         num_tokens_device=torch.tensor(3))
    with set_forward_context(ctx):
        got = _step(inside, ids, positions, seq_ids)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for a, b in zip(_caches(inside), _caches(plain)):
        torch.testing.assert_close(a, b)


def test_dynamo_traces_fullgraph_with_dynamic_num_tokens():
    config = LlamaConfig(num_layers=3)
    model = LlamaForCausalLM(config, seed=1).eval()
    graphs: list[torch.fx.GraphModule] = []

    def recording_backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(model, backend=recording_backend, fullgraph=True)
    for n in (5, 9, 3):  # first size >= 2: Dynamo specialises sizes 0 and 1
        inputs = (torch.randint(0, config.vocab_size, (n,)), torch.arange(n), torch.arange(n) % 3)
        for t in inputs:
            torch._dynamo.mark_dynamic(t, 0)
        with torch.no_grad():
            model.reset_kv_cache()
            want = model(*inputs)
            model.reset_kv_cache()
            got = compiled(*inputs)
        # Dynamo's graph run eagerly against the module: another code path, the dtype's tolerance
        torch.testing.assert_close(got, want)
    torch._dynamo.reset()

    assert len(graphs) == 1  # no recompile across sizes
    graph = graphs[0].graph
    assert sum(node.target is ATTN for node in graph.nodes) == config.num_layers
    # The three inputs share one symbolic size: a backend sees a single dynamic dim, num_tokens.
    sizes = {str(node.meta["example_value"].shape[0]) for node in graph.nodes
             if node.op == "placeholder" and isinstance(node.meta.get("example_value"), torch.Tensor)
             and node.meta["example_value"].dim() == 1 and node.meta["example_value"].dtype == torch.int64}
    assert len(sizes) == 1 and not sizes.pop().isdigit()


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"num_heads": 4, "num_kv_heads": 3}, "num_heads"),
        ({"hidden_size": 0}, "hidden_size"),
        ({"num_layers": 2.0}, "num_layers"),
        ({"head_dim": 15}, "head_dim"),
        ({"rms_norm_eps": -1e-6}, "rms_norm_eps"),
        ({"rms_norm_eps": float("nan")}, "rms_norm_eps"),
        ({"rope_theta": -1.0}, "rope_theta"),
        ({"dtype": torch.int64}, "dtype"),
    ],
)
def test_config_rejects_nonsense_naming_the_field(fields, named):
    with pytest.raises(ValueError, match=f"LlamaConfig.{named}="):
        LlamaConfig(**fields)


def test_greedy_decode_rejects_requests_beyond_max_seq_len(model):
    with pytest.raises(ValueError, match="max_seq_len=16"):
        greedy_decode(model, [[1] * 10], 8, max_seq_len=16)


@pytest.mark.parametrize("order", ["runs", "interleaved", "decode", "one_token", "first_token", "aligned",
                                   "aligned_consecutive"])
def test_cpu_attention_paths_equal_the_gathered_attention(order):
    """Every CPU path of the attention op against the gather path (the one full graphs use) over
    the same cache with this step's keys and values written: a mixed batch (two prefills, one
    from position 0, decode tokens, a slot used twice) in runs and shuffled (more tokens than
    slots: by sequence), a decode batch (fewer tokens than slots: rows gathered up to the longest
    sequence only), one token (a batch-1 decode step: strided views, no mask), one token at
    position 0, and decode batches whose tokens share one position (one SDPA without a mask over
    gathered or, for consecutive slots, viewed rows), with inf and NaN past that position (what an
    earlier occupant of a slot may have left), which must reach no result. The op must write
    exactly this step's cache rows."""
    from piecewise.serving.llama import _gathered_attention

    g = torch.Generator().manual_seed(3)
    slots, length, kv, heads, dim = 5, 24, 2, 6, 16
    k_cache = torch.randn(slots, length, kv, dim, generator=g)
    v_cache = torch.randn(slots, length, kv, dim, generator=g)
    seq = [0] * 9 + [3] * 4 + [1, 2, 4] + [0] * 2  # slot 0 in two runs, at later positions
    pos = list(range(9)) + list(range(6, 10)) + [17, 3, 23] + [9, 10]
    if order == "interleaved":
        perm = torch.randperm(len(seq), generator=g).tolist()
        seq, pos = [seq[i] for i in perm], [pos[i] for i in perm]
    elif order == "decode":
        seq, pos = [1, 2, 4], [17, 3, 20]
    elif order == "one_token":
        seq, pos = [2], [17]
    elif order == "first_token":
        seq, pos = [4], [0]
    elif order.startswith("aligned"):
        seq, pos = ([1, 2, 3] if order == "aligned_consecutive" else [4, 0, 2]), [11] * 3
        k_cache[:, 12:] = float("inf")
        v_cache[:, 12:] = float("nan")
    seq, pos = torch.tensor(seq), torch.tensor(pos)
    q = torch.randn(len(seq), heads, dim, generator=g)
    k, v = torch.randn(len(seq), kv, dim, generator=g), torch.randn(len(seq), kv, dim, generator=g)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    want_k[seq, pos], want_v[seq, pos] = k, v
    want = _gathered_attention(q, want_k, want_v, seq, pos, 0.25)
    got = torch.full_like(q, float("nan"))  # every row must be written
    llama_attention(q, k, v, k_cache, v_cache, pos, seq, 0.25, got)
    torch.testing.assert_close(got, want, rtol=1.3e-6, atol=1e-5)
    for cache, expect in ((k_cache, want_k), (v_cache, want_v)):  # copies: exact (NaN where NaN was)
        torch.testing.assert_close(cache, expect, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("slot,position", [(0, 8), (0, -1), (2, 0)])
def test_a_single_token_outside_the_cache_is_an_index_error_and_writes_nothing(slot, position):
    """The one-token CPU path writes through a strided view, where a position past the slot's rows
    would land in the next slot's: it raises as the index_put_ of the other paths does."""
    k_cache, v_cache = torch.zeros(2, 8, 2, 8), torch.zeros(2, 8, 2, 8)
    q, k, v = torch.randn(1, 4, 8), torch.randn(1, 2, 8), torch.randn(1, 2, 8)
    with pytest.raises(IndexError, match="outside the cache"):
        llama_attention(q, k, v, k_cache, v_cache, torch.tensor([position]), torch.tensor([slot]), 0.25, torch.empty_like(q))
    assert not k_cache.any() and not v_cache.any()


def test_compute_logits_equals_the_full_projection():
    """`compute_logits` (the rows an engine samples; on the CPU the packed kernel for 4-64 float32
    rows) against `forward`'s ``nn.Linear`` for 1, 3 and 8 rows, with and without a bias: equal
    within float32 rounding, [rows, vocab_size]."""
    model = LlamaForCausalLM(LlamaConfig(num_layers=1, vocab_size=300), seed=0)
    hidden = torch.randn(8, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    for bias in (False, True):
        if bias:
            model.lm_head.bias = torch.nn.Parameter(torch.randn(300))
        for rows in (hidden[:1], hidden[2:5], hidden):
            with torch.no_grad():
                got, want = model.compute_logits(rows), model.lm_head(rows)
            assert got.shape == (rows.shape[0], 300)
            torch.testing.assert_close(got, want, rtol=1.3e-6, atol=1e-5)


def test_an_engine_projecting_only_sampled_rows_decodes_the_same_tokens(model):
    import piecewise as pw
    from piecewise.counters import counters

    trace = default_trace(model.config.vocab_size)
    kw = dict(arrival_steps=trace.arrival_steps, max_num_seqs=model.config.max_num_seqs,
              max_seq_len=model.config.max_seq_len, reset=model.reset_kv_cache)
    with torch.no_grad():
        full = greedy_decode(model, trace.prompts, trace.max_new_tokens, **kw)
        projected = []

        def head(rows):
            projected.append(rows.shape[0])
            return model.compute_logits(rows)

        backbone = pw.compile(model.backbone(), pw.CompilationConfig(backend="eager", cache_dir=None, max_num_tokens=64),
                              dynamic_arg_dims={"input_ids": 0, "positions": 0, "seq_ids": 0})
        engine = greedy_decode(backbone, trace.prompts, trace.max_new_tokens, compute_logits=head, **kw)
    assert engine.tokens == full.tokens
    # one projected row per generated token, against every fed token before
    assert sum(projected) == len(trace.prompts) * trace.max_new_tokens < sum(full.step_sizes)
    assert counters.recompiles == 0
