"""The three dynamic-shape modes (`CompilationConfig.dynamic_shapes`) on the reference decoder and a
transformers model: each equals eager at every size it accepts, with one trace and no recompile;
``backed`` refuses sizes below 2 before running; ``unbacked`` refuses a branch on the size."""

import pytest
import torch

import piecewise as pw
from piecewise import CompilationConfig, counters
from piecewise.errors import CompileError, ConfigError, InputError, SizeRefusedError
from piecewise.serving import LlamaConfig, LlamaForCausalLM
from piecewise.hf import attention as hf
from piecewise.tags import scoped_tags

MODES = ["backed_size_oblivious", "backed", "unbacked"]
LLAMA_DIMS = {"input_ids": 0, "positions": 0, "seq_ids": 0}


def _sizes(mode):
    # the first call decides the trace: size 1 where the mode allows it (the case that specialises)
    return [2, 1, 9, 31, 5] if mode == "backed" else [1, 2, 9, 31, 5]


@pytest.mark.parametrize("mode", MODES)
def test_reference_decoder_equals_eager_in_every_mode(mode):
    cfg = LlamaConfig(num_layers=2)
    model = LlamaForCausalLM(cfg, seed=1)
    cm = pw.compile(model, CompilationConfig(backend="eager", max_num_tokens=32, dynamic_shapes=mode),
                    dynamic_arg_dims=LLAMA_DIMS)
    gen = torch.Generator().manual_seed(0)
    with counters.expect(recompiles=0, dynamo_traces=1):
        for n in _sizes(mode):
            ids = torch.randint(0, cfg.vocab_size, (n,), generator=gen)
            pos = torch.randint(0, cfg.max_seq_len, (n,), generator=gen)
            seq = torch.randint(0, cfg.max_num_seqs, (n,), generator=gen)
            if mode == "backed" and n < 2:
                with pytest.raises(InputError, match="dynamic_shapes='backed'"):
                    cm(ids, pos, seq)
                continue
            model.reset_kv_cache()
            got = cm(ids, pos, seq)
            model.reset_kv_cache()
            torch.testing.assert_close(got, model(ids, pos, seq), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", ["backed_size_oblivious", "backed"])
def test_transformers_llama_equals_eager_in_the_backed_modes(mode):
    hf.register_hf_attention()
    model = hf.tiny_llama(num_layers=2)
    cm = pw.compile(model, CompilationConfig(backend="eager", max_num_tokens=64, dynamic_shapes=mode),
                    dynamic_arg_dims={"input_ids": 1})
    gen = torch.Generator().manual_seed(0)
    with counters.expect(recompiles=0, dynamo_traces=1):
        for n in _sizes(mode):
            ids = torch.randint(0, 256, (1, n), generator=gen)
            if mode == "backed" and n < 2:
                with pytest.raises(InputError, match="below 2"):
                    cm(input_ids=ids)
                continue
            torch.testing.assert_close(cm(input_ids=ids).logits, model(input_ids=ids).logits, rtol=1e-5, atol=1e-5)


def test_transformers_llama_under_unbacked_is_refused_naming_the_line():
    """transformers' mask code (``torch.diff`` over position ids in masking_utils) guards on the
    sequence length, which an unbacked size cannot answer: a typed error names that line."""
    hf.register_hf_attention()
    model = hf.tiny_llama(num_layers=2)
    cm = pw.compile(model, CompilationConfig(backend="eager", max_num_tokens=64, dynamic_shapes="unbacked"),
                    dynamic_arg_dims={"input_ids": 1})
    with pytest.raises(CompileError, match=r"unbacked dynamic shapes\): .*masking_utils"):
        cm(input_ids=torch.randint(0, 256, (1, 5)))


class _BranchOnSize(torch.nn.Module):
    def forward(self, x):
        if x.shape[0] > 4:  # a Python branch on the dynamic size
            return x * 2
        return x + 1


def test_unbacked_refuses_a_branch_on_the_size_at_trace_time():
    cm = pw.compile(_BranchOnSize(), CompilationConfig(backend="eager", dynamic_shapes="unbacked", mode="full"),
                    dynamic_arg_dims={"x": 0})
    with pytest.raises(CompileError, match=r"unbacked dynamic shapes\): .*x.shape\[0\] > 4"):
        cm(torch.randn(6, 3))


@pytest.mark.parametrize("mode", ["backed_size_oblivious", "backed"])
def test_a_branch_on_the_size_is_refused_for_the_sizes_its_guard_excludes(mode, tmp_path, caplog):
    """Dispatch skips Dynamo's guards, so the traced branch (x * 2, for sizes > 4) would run for
    every size: the guard Dynamo recorded is evaluated at compile time instead and the sizes it
    excludes raise `InputError`; a warm start from the bundle refuses them too."""
    cfg = CompilationConfig(backend="eager", mode="full", max_num_tokens=16, dynamic_shapes=mode, cache_dir=str(tmp_path),
                            tag="branch", max_size_classes=1)
    cm = pw.compile(_BranchOnSize(), cfg, dynamic_arg_dims={"x": 0})
    x = torch.randn(6, 3)
    torch.testing.assert_close(cm(x), x * 2)
    assert "the trace took x.shape[0] > 4" in caplog.text and "5..16" in caplog.text
    for n in (5, 16):
        x = torch.randn(n, 3)
        torch.testing.assert_close(cm(x), x * 2)
    for n in (2, 4):
        with pytest.raises(SizeRefusedError, match=r"x.shape\[0\] = \d refused: .*x.shape\[0\] > 4.*5..16"):
            cm(torch.randn(n, 3))
    torch._dynamo.reset()
    with scoped_tags():  # the first model still holds its tag: the second gets the same one (and its bundle)
        warm = pw.compile(_BranchOnSize(), cfg, dynamic_arg_dims={"x": 0})
    with counters.expect(bundle_hits=1, dynamo_traces=0):
        torch.testing.assert_close(warm(x), x * 2)
    with pytest.raises(InputError, match="refused"):
        warm(torch.randn(3, 3))


def test_the_memo_of_checked_sizes_stays_bounded(monkeypatch):
    """Each distinct tuple of sizes is checked once and memoised; past `SIZES_MEMOISED` tuples the
    memo starts again, and a size checked before is still served or refused as its guard says."""
    from piecewise import compiled as compiled_module

    monkeypatch.setattr(compiled_module, "SIZES_MEMOISED", 3)
    cm = pw.compile(_BranchOnSize(), CompilationConfig(backend="eager", mode="full", max_num_tokens=16, max_size_classes=1),
                    dynamic_arg_dims={"x": 0})
    stitched = None
    for n in (6, 5, 7, 2, 8, 9, 3, 5, 10, 2, 6):
        x = torch.randn(n, 3)
        if n > 4:
            torch.testing.assert_close(cm(x), x * 2)
        else:
            with pytest.raises(SizeRefusedError, match=rf"x.shape\[0\] = {n} refused"):
                cm(x)
        if stitched is None:
            stitched = cm.backend.result.stitched
        assert 1 <= len(stitched._sizes_failing) <= 3, n


class _LastPositionProjection(torch.nn.Module):
    """Tokens [N] (the token count) and a batch x [B, T, 16]: x[:, -1:] is a strided [B, 1, 16] view
    that matmul folds into [B, 16] without a copy only when B == 1, so a trace at B == 1 records the
    guard Eq(B, 1) on a size that is not the token count (what transformers' ``logits_to_keep=1``
    does before lm_head)."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(8, 16, generator=torch.Generator().manual_seed(0)))

    def forward(self, tokens, x):
        return tokens * 2, torch.nn.functional.linear(x[:, -1:, :], self.w)


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_a_guard_on_a_size_other_than_the_token_count_is_refused(backend, tmp_path, caplog):
    """Before, only guards on the token count were checked: with Inductor a batch of 2 after a
    first call with 1 returned wrong values silently. Now every dynamic size's guards are checked
    on each call, through a warm start too."""
    cfg = CompilationConfig(backend=backend, mode="full", max_num_tokens=16, cache_dir=str(tmp_path), tag="last_proj",
                            max_size_classes=1)
    dims = {"tokens": 0, "x": (0, 1)}
    model = _LastPositionProjection().eval()
    cm = pw.compile(model, cfg, dynamic_arg_dims=dims)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad(), counters.expect(recompiles=0, dynamo_traces=1):
        for n, t in ((4, 5), (7, 3), (16, 16)):  # batch 1 at every token count and length: served
            tokens, x = torch.randn(n, generator=gen), torch.randn(1, t, 16, generator=gen)
            for got, want in zip(cm(tokens, x), model(tokens, x)):
                torch.testing.assert_close(got, want)
        assert "x.shape[0] 1..1 (of 1..16)" in caplog.text
        for b in (2, 3, 16):
            with pytest.raises(InputError, match=rf"x.shape\[0\] = {b} refused: .*Eq\(x.shape\[0\], 1\).*functional.linear"):
                cm(torch.randn(4), torch.randn(b, 5, 16))
    torch._dynamo.reset()
    with scoped_tags():
        warm = pw.compile(_LastPositionProjection().eval(), cfg, dynamic_arg_dims=dims)
    with torch.no_grad(), counters.expect(bundle_hits=1, dynamo_traces=0):
        tokens, x = torch.randn(3, generator=gen), torch.randn(1, 6, 16, generator=gen)
        torch.testing.assert_close(warm(tokens, x)[1], model(tokens, x)[1])
        with pytest.raises(InputError, match=r"x.shape\[0\] = 2 refused"):
            warm(torch.randn(4), torch.randn(2, 5, 16))


class _Tied(torch.nn.Module):
    def forward(self, x, y):  # x + y makes the trace take y.shape[0] == x.shape[0]
        return (x + y) * 2


class _Double(torch.nn.Module):
    def forward(self, x, y):
        return y * 2 if y.shape[0] == 2 * x.shape[0] else y + 1


class _PrunedInput(torch.nn.Module):
    def forward(self, x, y):  # only y's size is read: the graph does not take y
        return x * 2 if y.shape[0] > 4 else x + 1


class _DivideBySize(torch.nn.Module):
    def forward(self, x, y):  # the guard divides by y.shape[0] - 1, zero at size 1
        return (x * 2 if x.shape[0] // (y.shape[0] - 1) > 2 else x + 1), y - 1


def test_input_dims_the_trace_tied_are_checked_on_every_call():
    """The trace gives y's dim x's symbol (or 2 * it): with the eager adaptor a y of 1 row would
    broadcast, and the traced side of a branch on the relation would run, silently."""
    cfg = CompilationConfig(backend="eager", mode="full", max_num_tokens=16, max_size_classes=1)
    tied = pw.compile(_Tied(), cfg, dynamic_arg_dims={"x": 0, "y": 0})
    torch.testing.assert_close(tied(torch.ones(4, 3), torch.ones(4, 3)), torch.full((4, 3), 4.0))
    with pytest.raises(SizeRefusedError, match=r"y.shape\[0\] == x.shape\[0\]"):
        tied(torch.ones(5, 3), torch.ones(1, 3))
    double = pw.compile(_Double(), CompilationConfig(backend="eager", mode="full", max_num_tokens=16, tag="double",
                                                     max_size_classes=1),
                        dynamic_arg_dims={"x": 0, "y": 0})
    y = torch.randn(6, 3)
    torch.testing.assert_close(double(torch.randn(3, 3), y), y * 2)
    torch.testing.assert_close(double(torch.randn(5, 3), torch.ones(10, 3)), torch.full((10, 3), 2.0))
    with pytest.raises(SizeRefusedError, match=r"y.shape\[0\] = 5, x.shape\[0\] = 4 refused: .*y.shape\[0\] == 2\*x.shape\[0\]"):
        double(torch.randn(4, 3), torch.randn(5, 3))


def test_a_guard_on_an_input_the_graph_does_not_take_is_a_compile_error():
    cm = pw.compile(_PrunedInput(), CompilationConfig(backend="eager", mode="full", max_num_tokens=16),
                    dynamic_arg_dims={"x": 0, "y": 0})
    with pytest.raises(CompileError, match=r"y.shape\[0\] > 4 .*the size of an input the graph does not take"):
        cm(torch.randn(6, 3), torch.randn(6, 3))


def test_a_guard_undefined_at_some_sizes_refuses_them():
    """x.shape[0] // (y.shape[0] - 1) is a division by zero at y.shape[0] == 1: refused there, not
    a crash of the compile."""
    model = _DivideBySize()
    cm = pw.compile(model, CompilationConfig(backend="eager", mode="full", max_num_tokens=16, max_size_classes=1),
                    dynamic_arg_dims={"x": 0, "y": 0})
    for n, m in ((9, 2), (12, 4), (16, 3)):
        x, y = torch.randn(n, 3), torch.randn(m, 3)
        for got, want in zip(cm(x, y), model(x, y)):
            torch.testing.assert_close(got, want)
    for n, m in ((9, 1), (4, 3)):
        with pytest.raises(SizeRefusedError, match=rf"y.shape\[0\] = {m}, x.shape\[0\] = {n} refused"):
            cm(torch.randn(n, 3), torch.randn(m, 3))


def test_the_mode_is_validated_and_in_the_cache_key():
    with pytest.raises(ConfigError, match="dynamic_shapes"):
        CompilationConfig(dynamic_shapes="oblivious")
    keys = {CompilationConfig(dynamic_shapes=m).code_factors()["dynamic_shapes"] for m in MODES}
    assert keys == set(MODES)
