"""Shared helpers for the model tests."""

from __future__ import annotations

import contextlib

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


def left_padded_prompts(lengths, seed=1, low=3, high=512):
    """A left-padded batch: ids ``[B, max(lengths)]`` int64 (random ids in ``[low, high)``) and its
    attention_mask (0 on the left pads)."""
    gen = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, width - n:] = torch.randint(low, high, (n,), generator=gen)
        mask[i, width - n:] = 1
    return ids, mask


def greedy_reference(model, ids, mask, **kw):
    """`model`'s greedy ``generate()`` sequences, after checking every chosen token won by more than
    `MIN_GREEDY_MARGIN` (so exact token equality with another code path is meaningful on any CPU);
    non-finite scores (a logits processor's -inf) never count as the runner-up."""
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, do_sample=False, output_scores=True, return_dict_in_generate=True,
                             **kw)
    for scores in out.scores:
        finite = scores.float().masked_fill(~torch.isfinite(scores), -1e9)
        top = finite.topk(2, dim=-1).values
        assert (top[:, 0] - top[:, 1]).min().item() > MIN_GREEDY_MARGIN, "near-tie in the reference; change the seed"
    return out.sequences


@contextlib.contextmanager
def forward_assigned(model, compiled):
    """The torch.compile pattern: ``model.forward = compiled`` for the block, then undone."""
    model.forward = compiled
    try:
        yield model
    finally:
        del model.forward
