"""Graph capture after a splitting op whose fake promises other strides than the op returns: the
op's output is copied into the fake's layout before the next piece's graph copies it into its
buffer, so captures succeed (Inductor's generated code asserts its inputs' strides)."""

import torch
import torch.nn as nn

import piecewise as pw
from piecewise.testing.graph_platform import fake_cpu_platform
from piecewise import CompilationConfig, counters
from piecewise.piece import LayoutPhase


@pw.splitting_op("pw_test_graphs_layout::heads", mutates_args=())
def _heads(q: torch.Tensor) -> torch.Tensor:
    return torch.tanh(q).contiguous()  # contiguous [2, n, 4]


@_heads.register_fake
def _(q):
    return torch.empty_like(q)  # q is a transposed view: strides (4, 8, 1), not the op's


class Heads(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.lin, self.out = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x):
        n = x.shape[0]
        q = self.lin(x).view(n, 2, 4).transpose(0, 1)
        y = torch.ops.pw_test_graphs_layout.heads(q)
        return self.out(y.transpose(0, 1).reshape(n, 8))


def test_captured_pieces_after_an_op_with_a_wrong_fake_replay_like_eager_with_inductor():
    torch.manual_seed(0)
    model = Heads().eval()
    gen = torch.Generator().manual_seed(1)
    with fake_cpu_platform(), torch.no_grad():
        cm = pw.compile(model, CompilationConfig(backend="inductor", max_num_tokens=16, cudagraph_capture_sizes=[4, 8]),
                        dynamic_arg_dims={"x": 0})
        with counters.expect(graphs_captured=2 * 2, layout_mismatches=1, recompiles=0):
            for n in (3, 7, 2, 12, 8, 5):  # padded to 4 and 8 (captured), 12 runs without graphs
                x = torch.randn(n, 8, generator=gen)
                torch.testing.assert_close(cm(x), model(x))
        assert counters.graph_replays > 0
    split = cm.backend.result.split
    (runner,) = [split.split_module.__dict__[it.name] for it in split.items if it.is_splitting]
    assert runner.phase is LayoutPhase.COPYING


def test_a_full_graph_captures_the_copy_into_the_fakes_layout():
    """cudagraph_mode="full" captures the splitting op with the rest; with no warm-up run the first
    check runs inside the capture (it reads no tensor value, which a capture refuses)."""
    torch.manual_seed(0)
    model = Heads().eval()
    gen = torch.Generator().manual_seed(2)
    cfg = CompilationConfig(backend="eager", max_num_tokens=16, cudagraph_mode="full", cudagraph_capture_sizes=[4, 8],
                            cudagraph_num_warmups=0)
    with fake_cpu_platform(), torch.no_grad():
        cm = pw.compile(model, cfg, dynamic_arg_dims={"x": 0})
        with counters.expect(graphs_captured=2, layout_mismatches=1):
            for n in (3, 7, 4, 8, 2):
                x = torch.randn(n, 8, generator=gen)
                torch.testing.assert_close(cm(x), model(x))
        assert counters.graph_replays >= 3
