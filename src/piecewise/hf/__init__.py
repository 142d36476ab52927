"""The transformers integration: attention for transformers models that splits at each layer
(`piecewise.hf.attention`), transformers ``generate()`` on a compiled model over a KV cache
piecewise owns (`piecewise.hf.generate`), pretrained weights read offline from GGUF files
(`piecewise.hf.gguf`) and the chat turn behind ``piecewise generate`` (`piecewise.hf.chat`).

Nothing is imported here, so importing this package imports neither `transformers` nor registers
any op; import the module you need.
"""
