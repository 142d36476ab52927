"""torch's pytree utilities (``torch.utils._pytree``): flattening nested containers of tensors.

Why piecewise needs them: inputs nested in tuples, lists, dicts and registered containers
(transformers' caches) are flattened the way Dynamo flattens them (``inputs``, ``piece``,
``compilers.partition``); a library pytree would not know torch's registered node types.

Verified on torch 2.13.0 (CPU); the module is imported by ``import torch`` and these names exist
since torch 2.0.
"""

from __future__ import annotations

from torch.utils._pytree import tree_flatten, tree_is_leaf, tree_map_only, tree_unflatten

__all__ = ["tree_flatten", "tree_unflatten", "tree_is_leaf", "tree_map_only"]
