"""Shared helpers for the model tests."""

from __future__ import annotations

import pytest
import torch

#: The smallest gap between the two largest logits a greedy token may have for exact token
#: comparisons across batch sizes, code paths and CPUs to be meaningful: logits of the same rows
#: differ by ~1e-6 between batch sizes (BLAS blocking) and ~1e-5 between eager and Inductor, so a
#: gap 100x above that cannot flip an argmax on any machine.
MIN_GREEDY_MARGIN = 1e-3


class GreedyMargin:
    """Wraps a decode ``forward(input_ids, positions, seq_ids)`` and records the smallest gap between
    the two largest logits of the rows `greedy_decode` takes its tokens from (the last row of each
    request: each request's tokens are contiguous and carry its own slot)."""

    def __init__(self, forward) -> None:
        self.forward = forward
        self.smallest = float("inf")

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, seq_ids: torch.Tensor) -> torch.Tensor:
        logits = self.forward(input_ids, positions, seq_ids)
        last = torch.ones_like(seq_ids, dtype=torch.bool)
        last[:-1] = seq_ids[1:] != seq_ids[:-1]
        top = logits[last].float().topk(2, dim=-1).values
        self.smallest = min(self.smallest, (top[:, 0] - top[:, 1]).min().item())
        return logits

    def assert_far_from_ties(self) -> None:
        """Every greedy choice seen so far won by more than `MIN_GREEDY_MARGIN`."""
        assert self.smallest > MIN_GREEDY_MARGIN, (
            f"a greedy token won by only {self.smallest:.2e}: exact token equality across batch sizes, code paths "
            "or CPUs is then a coin toss; pick prompts or seeds without near-ties")


@pytest.fixture
def greedy_margin():
    """``greedy_margin(forward)``: a `GreedyMargin` around `forward`; ``.smallest`` after decoding."""
    return GreedyMargin
