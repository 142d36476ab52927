"""Cache key factors (docs/design.md §5.2): everything that can change the compiled code, and nothing else.

Factors are kept raw (JSON) next to each entry, so a miss can be explained factor by factor
(`diff_factors`). Excluded on purpose: host names, ports, PIDs, paths, credentials, the cache root
and cosmetic config fields (tag, cache_dir, debug) - a cache must survive being moved or baked into
an image, and must hit on every replica.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ..fingerprint import data_digest

# torch is imported where a factor needs it, not here: `piecewise cache ...` reads entries without it.

__all__ = ["ENV_ALLOWLIST", "env_factors", "file_hashes", "source_factors", "input_signature", "compute_key", "diff_factors",
           "diff_items", "KEY_FORMAT", "NOT_IN_KEY"]

#: Bump when the meaning of factors or the entry layout changes: old entries then miss.
KEY_FORMAT = 2  # 2: an entry records the size guards its pieces were compiled under (backend.SIZE_GUARDS)

#: Environment variables that change generated code. Inductor reads most of its TORCHINDUCTOR_*
#: flags into its config (already in the compiler hash); listing them here too makes a miss on
#: them explainable by name.
ENV_ALLOWLIST: tuple[str, ...] = (
    "TORCHINDUCTOR_MAX_AUTOTUNE",
    "TORCHINDUCTOR_MAX_AUTOTUNE_GEMM",
    "TORCHINDUCTOR_MAX_AUTOTUNE_POINTWISE",
    "TORCHINDUCTOR_FREEZING",
    "TORCHINDUCTOR_CPP_WRAPPER",
    "TORCHINDUCTOR_LAYOUT_OPTIMIZATION",
    "TORCHINDUCTOR_FALLBACK_RANDOM",
    "TORCHINDUCTOR_COMBO_KERNELS",
    "TORCHINDUCTOR_CPP_MAX_HORIZONTAL_FUSION_SIZE",
    "TORCHINDUCTOR_SIMD_LEN",
    "ATEN_CPU_CAPABILITY",
    "TORCH_CUDA_ARCH_LIST",
    "PIECEWISE_KEY_SALT",  # a user's explicit "invalidate everything" knob
)


def env_factors(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    env = os.environ if environ is None else environ
    return {k: env[k] for k in ENV_ALLOWLIST if k in env}


def _is_virtual(filename: str) -> bool:
    return filename.startswith("<") or not os.path.isfile(filename)


def file_hashes(filenames: Iterable[str]) -> dict[str, str]:
    """``{path: sha256 of content}`` for every real file among `filenames`, sorted by path.
    Virtual files (``<string>``, ``<frozen ...>``, FX's ``<eval_with_key>``) and unreadable ones
    are skipped."""
    out: dict[str, str] = {}
    for fn in sorted(set(filenames)):
        if _is_virtual(fn):
            continue
        try:
            with open(fn, "rb") as f:
                out[fn] = hashlib.sha256(f.read()).hexdigest()
        except OSError:
            continue
    return out


#: A mapping key that `compute_key` and `diff_factors` skip wherever it appears: a note kept in
#: ``cache_key_factors.json`` to explain a factor (the traced files' paths), never part of the key.
#: No base name, environment variable or config field can contain a "/".
NOT_IN_KEY = "/paths"


def source_factors(filenames: Iterable[str]) -> dict[str, Any]:
    """``{basename: sha256 of content}`` for every real traced file (see `file_hashes`), plus
    ``{NOT_IN_KEY: {basename: absolute path}}`` so a miss can say which file it was.

    The key uses the file's content and base name, not its absolute path, so the same code checked
    out elsewhere still hits."""
    out: dict[str, str] = {}
    paths: dict[str, str] = {}
    for fn, digest in file_hashes(filenames).items():
        name = os.path.basename(fn)
        # two traced files may share a base name (__init__.py): keep both, ordered by path
        while name in out:
            name += "+"
        out[name] = digest
        paths[name] = os.path.abspath(fn)
    result: dict[str, Any] = dict(sorted(out.items()))
    if paths:
        result[NOT_IN_KEY] = dict(sorted(paths.items()))
    return result


def _describe(x: Any) -> Any:
    import torch

    if isinstance(x, torch.Tensor):
        shape = ["*" if isinstance(s, torch.SymInt) else int(s) for s in x.shape]
        # the device index too: Inductor writes it into its wrapper code (cuda:0 vs cuda:1 differ)
        device = x.device.type if x.device.index is None else f"{x.device.type}:{x.device.index}"
        return {"dtype": str(x.dtype), "device": device, "shape": shape}
    if isinstance(x, torch.SymInt):
        return "symint"
    if x is None:
        return None
    return type(x).__name__


def input_signature(example_inputs: Sequence[Any], call_signature: Sequence[Any] | None = None) -> dict[str, Any]:
    """Ranks, dtypes, devices and static dims of the graph inputs, plus (from `pw.compile`) which
    call arguments were tensors, None or fixed values."""
    out: dict[str, Any] = {"graph_inputs": [_describe(x) for x in example_inputs], "call": list(call_signature or [])}
    aliases = storage_aliases(example_inputs)
    if aliases:  # absent when none, so the keys of graphs without aliased inputs stay as they were
        out["storage_aliases"] = aliases
    return out


def storage_aliases(example_inputs: Sequence[Any]) -> list[list[int]]:
    """``[i, j]`` for each graph input `j` on the storage of an earlier input `i` (a buffer that is a
    view of another): the compiled code is specialised to that aliasing, so it is part of the key."""
    import torch

    first: dict[int, int] = {}
    out = []
    for j, x in enumerate(example_inputs):
        if not isinstance(x, torch.Tensor):
            continue
        try:
            key = x.untyped_storage()._cdata  # fake tensors keep their real inputs' storage sharing
        except (RuntimeError, NotImplementedError, AttributeError):
            continue
        i = first.setdefault(key, j)
        if i != j:
            out.append([i, j])
    return out


def compute_key(factors: Mapping[str, Any]) -> str:
    """A 20-hex-digit key: sha256 of the canonical JSON of `factors` (without `NOT_IN_KEY` notes)."""
    return data_digest(_key_view(factors))[:20]


def _key_view(v: Any) -> Any:
    if isinstance(v, Mapping):
        return {k: _key_view(x) for k, x in v.items() if k != NOT_IN_KEY}
    return v


def diff_items(a: Mapping[str, Any], b: Mapping[str, Any], prefix: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], str]]:
    """The factors that differ between `a` and `b`, recursing into mappings, as ``(path, where)``:
    `path` the keys leading to the factor, `where` ``"both"`` (values differ), ``"first"`` or
    ``"second"`` (present only there). `NOT_IN_KEY` notes are skipped."""
    out: list[tuple[tuple[str, ...], str]] = []
    for k in sorted((set(a) | set(b)) - {NOT_IN_KEY}, key=str):
        path = (*prefix, k)
        if k not in a or k not in b:
            out.append((path, "second" if k not in a else "first"))
        elif isinstance(a[k], Mapping) and isinstance(b[k], Mapping):
            out += diff_items(a[k], b[k], path)
        elif a[k] != b[k]:
            out.append((path, "both"))
    return out


def diff_factors(a: Mapping[str, Any], b: Mapping[str, Any], prefix: str = "") -> list[str]:
    """Dotted names of the factors that differ between `a` and `b` (recursing into mappings);
    ``" (only in first)"`` / ``" (only in second)"`` marks a factor present on one side only."""
    out = []
    for path, where in diff_items(a, b):
        name = prefix + ".".join(str(p) for p in path)
        out.append(name if where == "both" else f"{name} (only in {where})")
    return out
