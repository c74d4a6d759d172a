"""mmserve's development tooling: what the tests, benchmarks and ``scripts/serve.sh`` use on this machine,
and never the Triton models or the GPU image (those import only ``mmserve``).

* ``triton``: start and stop a real ``tritonserver`` (CPU, Python backend) from the nvidia-pytriton wheel.
* ``tiny_models``: deterministic random-weight checkpoints built with the real families' processors.
* ``hf_reference``: the same models run by HF transformers on raw inputs, the tests' reference.
* ``samples``: deterministic sample media.
* ``benchmarking``: engine settings that keep benchmark requests from reusing each other's work.
"""
