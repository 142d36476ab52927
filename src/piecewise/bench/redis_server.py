"""Deprecated: moved to `piecewise.testing.redis_server`. This module stands for it for one release (every name
of `piecewise.testing.redis_server` is reachable here, as the same object) and warns on import."""

import sys
import warnings

from piecewise.testing import redis_server as _moved

warnings.warn(f"{__name__} moved to {_moved.__name__}; import it from there "
              f"({__name__} is removed in the next release)", DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved
