"""The Hugging Face engine: a real transformer (any local causal LM, or a tiny random Llama) behind the
Engine protocol, with real KV tensors, a block-level prefix cache and batched decoding.

Needs the `hf` extra (torch, transformers); `services.engines.hf.engine.HfEngine` is the entry point.
"""
