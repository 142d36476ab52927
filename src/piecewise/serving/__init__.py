"""The serving engine: the reference Llama decoder written the way serving engines write models
(`piecewise.serving.llama`), the continuous-batching greedy decode loop that drives it
(`piecewise.serving.decode`), its one-kernel Triton attention (`piecewise.serving.triton_attention`)
and tensor parallelism over `torch.distributed` ranks (`piecewise.serving.tensor_parallel`).

Small, seeded, nothing downloaded; importing this package does not import `transformers`.
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
