"""Multimodal serving on Triton + vLLM with preprocessing before the engine."""
