"""Multimodal serving on Triton + vLLM with preprocessing before the engine.

Importing this package (or any of its modules) changes no process-wide state; what the Triton
Python-backend stub needs is done by the adapters (``mmserve.serving.embedded``).
"""
