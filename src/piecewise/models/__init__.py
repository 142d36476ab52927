"""Reference models for tests, the demo and benchmarks: small, seeded, nothing downloaded.

`piecewise.models.hf` (transformers models) is not imported here, so importing this package does
not import `transformers`.
"""

from .decode import DecodeResult, DecodeTrace, default_trace, greedy_decode, make_prompts
from .llama import LLAMA_ATTENTION_OP, LlamaBackbone, LlamaConfig, LlamaForCausalLM, llama_attention

__all__ = [
    "DecodeResult",
    "DecodeTrace",
    "LLAMA_ATTENTION_OP",
    "LlamaBackbone",
    "LlamaConfig",
    "LlamaForCausalLM",
    "default_trace",
    "greedy_decode",
    "llama_attention",
    "make_prompts",
]
