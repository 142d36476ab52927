"""torch.distributed internals piecewise depends on.

Verified on torch 2.13.0 (CPU): ``torch.distributed._functional_collectives`` holds the
collectives Dynamo traces into graph ops (``all_reduce(t, "sum", group_name)`` returns a new
tensor, no in-place write, no ProcessGroup object in the graph). Imported when a tensor-parallel
forward first runs (this module is imported there), as the direct import was.
"""

from __future__ import annotations

from torch.distributed import _functional_collectives as functional_collectives

__all__ = ["functional_collectives"]

#: ``torch.distributed._functional_collectives``: the tensor-parallel linears' all-reduce
#: (``serving.tensor_parallel``); torch's traceable collectives have no public module.
