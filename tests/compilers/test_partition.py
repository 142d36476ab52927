"""The Inductor-partition split strategy (real Inductor compiles sharing the session's
TORCHINDUCTOR_CACHE_DIR): config checks, one compile per target, eager splitting ops between
partitions, whole-graph post-grad passes, scoped Inductor settings, the cache and its explanation.
Graph capture of partitions is in tests/graphs/test_capture.py (both strategies)."""

import logging
import uuid

import pytest
import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

import piecewise as pw
from piecewise import CompilationConfig, counters
from piecewise.compilers.partition import PartitionedCallable, partition_scope
from piecewise.testing.toy import ToyTransformer

PARTITION = dict(backend="inductor", split_strategy="inductor_partition")


@pytest.mark.parametrize("fields, named", [
    (dict(split_strategy="dynamo"), "split_strategy='dynamo' is not one of"),
    (dict(split_strategy="inductor_partition", backend="eager"), "backend='eager'"),
    (dict(split_strategy="inductor_partition", mode="full"), "mode='full'"),
    (dict(split_strategy="inductor_partition", inductor_options={"custom_should_partition_ops": []}),
     r"inductor_options sets \['custom_should_partition_ops'\]"),
    (dict(split_strategy="inductor_partition", inductor_options={"graph_partition": False, "max_autotune": False}),
     r"inductor_options sets \['graph_partition'\]"),
    (dict(split_strategy="inductor_partition", inductor_options={"cpp_wrapper": True}), r"\['cpp_wrapper'\].*C\+\+ wrapper"),
    (dict(split_strategy="inductor_partition", inductor_options={"triton": {"cudagraphs": True}}), r"\['triton'\]"),
])
def test_config_refuses_what_the_strategy_cannot_do_naming_the_field(fields, named):
    with pytest.raises(pw.ConfigError, match=named):
        CompilationConfig(**fields)


def test_a_torch_without_the_partition_hooks_is_refused_naming_the_version(monkeypatch):
    import torch._inductor.utils as inductor_utils

    monkeypatch.delattr(inductor_utils, "set_customized_partition_wrappers")
    with pytest.raises(pw.ConfigError, match=r"torch >= 2\.9\.1.*set_customized_partition_wrappers.*split_strategy='fx'"):
        CompilationConfig(**PARTITION)
    CompilationConfig(split_strategy="fx")  # the default strategy needs none of it


def test_the_strategy_is_a_code_factor_of_the_cache_key():
    from piecewise.cache.key import diff_factors

    a = CompilationConfig(backend="inductor").code_factors()
    b = CompilationConfig(**PARTITION).code_factors()
    assert a["split_strategy"] == "fx" and b["split_strategy"] == "inductor_partition"
    assert diff_factors(a, b) == ["split_strategy"]


def test_one_whole_graph_compile_per_target_equal_to_eager_at_every_size():
    model = ToyTransformer(num_layers=3, dim=16)
    cfg = CompilationConfig(**PARTITION, max_num_tokens=32, compile_ranges=[8], compile_sizes=[4])
    cm = pw.compile(model, cfg, dynamic_arg_dims={"x": 0})
    gen = torch.Generator().manual_seed(0)
    # 2 ranges + 1 size, each one compile of the whole graph (the FX split compiles 3 pieces x 3)
    with counters.expect(dynamo_traces=1, compiler_invocations=3, pieces_compiled=1, splitting_pieces=0, recompiles=0):
        for n in range(1, 33):
            x = torch.randn(n, 16, generator=gen)
            torch.testing.assert_close(cm(x), model(x), rtol=1e-4, atol=1e-4)
    (runner,) = cm.backend.runners
    assert len(runner.callables) == 3
    for fn in runner.callables:
        assert isinstance(fn, PartitionedCallable)
        assert [s.index for s in fn.partitions] == [0, 1, 2, 3], "3 attention ops cut the graph into 4 partitions"
        assert all(s.count == 4 for s in fn.partitions)


def test_splitting_ops_run_eagerly_between_partitions():
    calls = []

    @pw.splitting_op("pw_test_partition::scaled", mutates_args=())
    def scaled(x: torch.Tensor) -> torch.Tensor:
        calls.append(x.shape[0])
        return x * 3

    @scaled.register_fake
    def _(x):
        return torch.empty_like(x)

    class M(torch.nn.Module):
        def forward(self, x):
            y = torch.ops.pw_test_partition.scaled(x.sin())
            return torch.ops.pw_test_partition.scaled(y + 1).cos()

    model = M()
    cm = pw.compile(model, CompilationConfig(**PARTITION, max_num_tokens=16), dynamic_arg_dims={"x": 0})
    gen = torch.Generator().manual_seed(1)
    for n in (5, 1, 16):
        calls.clear()
        x = torch.randn(n, 4, generator=gen)
        torch.testing.assert_close(cm(x), model(x), rtol=1e-5, atol=1e-5)
        assert calls == [n, n, n, n], "two op calls in the compiled forward, two in eager"
    (fn,) = cm.backend.runners[0].callables
    assert len(fn.partitions) == 3


class SplittingOpCounter(CustomGraphPass):
    """Records, per post-grad graph it is run on, how many splitting-op calls that graph holds."""

    def __init__(self):
        self.seen: list[int] = []
        self._uuid = uuid.uuid4().hex  # fresh: Inductor's FX graph cache must not skip the pass

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.seen.append(sum(1 for n in graph.nodes if "toy_attention" in str(n.target)))

    def uuid(self):
        return self._uuid


@pytest.mark.parametrize("strategy, seen", [("fx", [0, 0, 0]), ("inductor_partition", [2])])
def test_post_grad_passes_see_the_whole_graph_only_with_inductor_partition(strategy, seen):
    rec = SplittingOpCounter()
    model = ToyTransformer(num_layers=2, dim=16)
    cfg = CompilationConfig(backend="inductor", split_strategy=strategy, max_num_tokens=16,
                            inductor_options={"post_grad_custom_post_pass": rec})
    cm = pw.compile(model, cfg, dynamic_arg_dims={"x": 0})
    x = torch.randn(3, 16)
    torch.testing.assert_close(cm(x), model(x), rtol=1e-4, atol=1e-4)
    assert rec.seen == seen


def _inductor_state():
    from torch._inductor import config as inductor_config
    from torch._inductor import utils as inductor_utils
    from torch._inductor.scheduler import Scheduler

    return (inductor_config.graph_partition, list(inductor_config.custom_should_partition_ops),
            inductor_utils._unstable_customized_partition_wrapper.wrapper, Scheduler.__dict__["should_partition"])


def test_inductor_settings_are_restored_after_a_compile_and_after_a_failure():
    before = _inductor_state()
    model = ToyTransformer(num_layers=1, dim=16)
    cm = pw.compile(model, CompilationConfig(**PARTITION, max_num_tokens=8), dynamic_arg_dims={"x": 0})
    cm(torch.randn(2, 16))
    assert _inductor_state() == before
    with pytest.raises(RuntimeError, match="inside the scope"):
        with partition_scope(["piecewise_models::toy_attention"]) as slots:
            assert _inductor_state() != before
            assert slots == []
            raise RuntimeError("inside the scope")
    assert _inductor_state() == before


def test_reference_decoder_tokens_equal_eager_and_a_second_process_loads_the_one_artifact(tmp_path):
    from piecewise.serving import LlamaConfig, LlamaForCausalLM, default_trace, greedy_decode

    cfg = LlamaConfig(num_layers=2)
    trace = default_trace(cfg.vocab_size)

    def decode(fn, model):
        return greedy_decode(fn, trace.prompts, trace.max_new_tokens, arrival_steps=trace.arrival_steps,
                             max_num_seqs=cfg.max_num_seqs, reset=model.reset_kv_cache).tokens

    ref_model = LlamaForCausalLM(cfg, seed=5)
    ref = decode(ref_model, ref_model)
    config = CompilationConfig(**PARTITION, max_num_tokens=64, cache_dir=str(tmp_path / "c"))
    dims = {"input_ids": 0, "positions": 0, "seq_ids": 0}
    model = LlamaForCausalLM(cfg, seed=5)
    with counters.expect(compiler_invocations=1, artifacts_saved=1, recompiles=0):
        assert decode(pw.compile(model, config, dynamic_arg_dims=dims), model) == ref
    torch._dynamo.reset()
    model = LlamaForCausalLM(cfg, seed=5)
    with counters.expect(compiler_invocations=0, cache_loads=1, recompiles=0):
        assert decode(pw.compile(model, config, dynamic_arg_dims=dims), model) == ref


def test_a_cache_miss_after_a_strategy_change_names_the_factor(tmp_path, caplog):
    root = str(tmp_path / "c")
    model = ToyTransformer(num_layers=1, dim=16)
    x = torch.randn(3, 16)
    for strategy in ("fx", "inductor_partition"):
        torch._dynamo.reset()
        cfg = CompilationConfig(backend="inductor", split_strategy=strategy, max_num_tokens=8, cache_dir=root,
                                tag="strategy_change")
        with caplog.at_level(logging.INFO, logger="piecewise"):
            cm = pw.compile(model, cfg, dynamic_arg_dims={"x": 0})
            torch.testing.assert_close(cm(x), model(x), rtol=1e-4, atol=1e-4)
        del cm
    misses = [r.getMessage() for r in caplog.records if "compile cache miss: differs from" in r.getMessage()]
    # the strategy, and the passes that follow from it (packed linears stay out of partitions that
    # graphs may capture: cudagraph_mode "auto")
    assert len(misses) == 1 and misses[0].endswith(" in compiler.hash, config.split_strategy"), misses


def test_a_splitting_op_inductor_generates_code_for_is_refused_before_any_compile():
    class M(torch.nn.Module):
        def forward(self, x):
            return torch.ops.aten._softmax(x.sin(), 0, False).cos()

    model = M()
    fx = CompilationConfig(backend="eager", splitting_ops=["aten::_softmax"], max_num_tokens=8)
    x = torch.randn(3, 4)
    torch.testing.assert_close(pw.compile(model, fx, dynamic_arg_dims={"x": 0})(x), model(x))  # the FX split cuts there
    torch._dynamo.reset()
    cfg = CompilationConfig(**PARTITION, splitting_ops=["aten::_softmax"], max_num_tokens=8)
    with counters.expect(compiler_invocations=0):
        with pytest.raises(pw.ConfigError, match=r"cannot cut at \['aten\._softmax\.default.*piecewise.splitting_op"):
            pw.compile(model, cfg, dynamic_arg_dims={"x": 0})(x)
