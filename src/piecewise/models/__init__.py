"""Deprecated: what lived here moved, and this package stands for it for one release.

- the transformers integration to `piecewise.hf`: ``models.hf`` -> `piecewise.hf.attention`,
  ``models.hf_generate`` -> `piecewise.hf.generate`, ``models.weights`` -> `piecewise.hf.gguf`,
  ``models.chat`` -> `piecewise.hf.chat`;
- the serving engine to `piecewise.serving`: ``models.llama``, ``models.decode``,
  ``models.triton_attention``, ``models.tensor_parallel`` keep their module names there;
- the toy models to `piecewise.testing.toy`.

Each old module path is a shim that warns (`DeprecationWarning`) and stands for the new module;
the names this package exported (``from piecewise.models import LlamaConfig``) warn on first use of
each and are the `piecewise.serving` objects.
"""

import importlib
import warnings
from typing import Any

#: name -> the module it now lives in
_MOVED = {
    "DecodeResult": "piecewise.serving.decode",
    "DecodeTrace": "piecewise.serving.decode",
    "default_trace": "piecewise.serving.decode",
    "greedy_decode": "piecewise.serving.decode",
    "make_prompts": "piecewise.serving.decode",
    "LLAMA_ATTENTION_OP": "piecewise.serving.llama",
    "LlamaBackbone": "piecewise.serving.llama",
    "LlamaConfig": "piecewise.serving.llama",
    "LlamaForCausalLM": "piecewise.serving.llama",
    "llama_attention": "piecewise.serving.llama",
}

__all__ = sorted(_MOVED)


def __getattr__(name: str) -> Any:
    if name in _MOVED:
        warnings.warn(f"piecewise.models.{name} moved to {_MOVED[name]}.{name} (also exported by piecewise.serving); "
                      "import it from there (piecewise.models is removed in the next release)",
                      DeprecationWarning, stacklevel=2)
        value = globals()[name] = getattr(importlib.import_module(_MOVED[name]), name)  # warn once per name
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
