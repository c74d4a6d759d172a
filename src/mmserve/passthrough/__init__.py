"""vLLM plugin: register the pass-through architectures (see register())."""


def register() -> None:
    """Entry point of the ``vllm.general_plugins`` group; runs in every vLLM process."""
    from mmserve.passthrough.models import register_models

    register_models()
