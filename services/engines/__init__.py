"""Inference engines behind one async protocol (`base.Engine`): sim, hf, vllm."""
