"""vLLM plugin: register the pass-through architectures (see register())."""

import logging

logger = logging.getLogger(__name__)


def register() -> None:
    """Entry point of the ``vllm.general_plugins`` group; runs in every vLLM process.

    Warns (does not fail) when the installed vLLM is not the release ``mmserve.vllm_seam`` was
    written for: the pass-through may still work, and the warning says what to do if it doesn't.
    """
    from mmserve.passthrough.models import register_models
    from mmserve.vllm_seam import vllm_version_mismatch

    problem = vllm_version_mismatch()
    if problem is not None:
        logger.warning(problem)
    register_models()
