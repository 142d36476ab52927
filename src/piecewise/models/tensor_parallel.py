"""Deprecated: moved to `piecewise.serving.tensor_parallel`. This module stands for it for one release (every name
of `piecewise.serving.tensor_parallel` is reachable here, as the same object) and warns on import."""

import sys
import warnings

from piecewise.serving import tensor_parallel as _moved

warnings.warn(f"{__name__} moved to {_moved.__name__}; import it from there "
              f"({__name__} is removed in the next release)", DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved
