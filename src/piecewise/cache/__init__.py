"""The persistent compile cache: key factors (`key`), the on-disk store (`store`) and the
maintenance tools behind ``piecewise cache`` (`tools`)."""

from .key import ENV_ALLOWLIST, compute_key, diff_factors
from .store import CacheEntry, atomic_write, resolve_root

__all__ = ["ENV_ALLOWLIST", "CacheEntry", "atomic_write", "compute_key", "diff_factors", "resolve_root"]
