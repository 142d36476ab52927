"""oneDNN (mkldnn) linear kernels with weights packed once, for CPU inference.

torch's own CPU ``mm`` of bfloat16 tensors already runs oneDNN, but reorders the plain weight into
oneDNN's blocked layout on every call; packing it once and calling the packed kernel gives the same
bits at about half the time of a decode step's linears (SmolLM2 shapes). Inductor does the same
only under ``freezing=True`` with weights as constants, which piecewise's pieces never have (the
weights are graph inputs).

Verified on torch 2.13.0 (CPU): ``torch.ops.mkldnn._reorder_linear_weight(weight, batch_size)``
returns an opaque mkldnn tensor of the weight in the layout oneDNN picks (``batch_size`` is a hint,
None for any); ``torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")`` computes
``x @ weight.T + bias`` for any number of rows of ``x``; ``torch.ops.mkldnn._is_mkldnn_bf16_supported``
/ ``_is_mkldnn_fp16_supported`` tell whether this CPU runs those dtypes in oneDNN; ``Tensor._version``
counts in-place writes. Where a name is
missing (another torch), `packable_dtypes` is empty and nothing is packed.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["packable_dtypes", "pack_linear_weight", "packed_linear", "tensor_version"]


@functools.cache
def packable_dtypes() -> frozenset[torch.dtype]:
    """The weight dtypes this torch and CPU can run through oneDNN's packed linear (empty where
    oneDNN is absent or the names above are missing)."""
    if not torch.backends.mkldnn.is_available():
        return frozenset()
    try:
        ops = torch.ops.mkldnn
        out = {torch.float32}
        if ops._is_mkldnn_bf16_supported():
            out.add(torch.bfloat16)
        if ops._is_mkldnn_fp16_supported():
            out.add(torch.float16)
        ops._reorder_linear_weight, ops._linear_pointwise  # noqa: B018 - present in this torch
    except (AttributeError, RuntimeError):  # pragma: no cover - another torch
        return frozenset()
    return frozenset(out)


def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor:
    """`weight` ([out_features, in_features], CPU) in oneDNN's layout for any batch (a new tensor)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, None)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ weight.T + bias`` with `packed` from `pack_linear_weight`; `x` is [rows, in_features]."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def tensor_version(t: torch.Tensor) -> int:
    """`t`'s in-place write counter (``Tensor._version``; shared by views of one storage): a packed
    copy made at one version is stale at another."""
    return t._version
