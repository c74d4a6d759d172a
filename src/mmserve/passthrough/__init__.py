"""vLLM plugin: register the pass-through architectures (see register())."""

import logging
import os

logger = logging.getLogger(__name__)


def register() -> None:
    """Entry point of the ``vllm.general_plugins`` group; runs in every vLLM process.

    Warns (does not fail) when the installed vLLM is not the release ``mmserve.vllm_seam`` was
    written for: the pass-through may still work, and the warning says what to do if it doesn't.
    In an engine core a Triton stub started, also ties its life to the stub's
    (``mmserve.serving.embedded.die_with_triton_stub``).
    """
    from mmserve.passthrough.models import register_models
    from mmserve.serving.embedded import die_with_triton_stub
    from mmserve.vllm_seam import vllm_version_mismatch

    problem = vllm_version_mismatch()
    if problem is not None:
        logger.warning(problem)
    register_models()
    from mmserve.vllm_seam import fix_cpu_lora_ops

    fix_cpu_lora_ops()  # on the CPU platform: its LoRA ops applied an adapter to base-model rows
    if die_with_triton_stub():
        logger.info("this process (pid %d) dies with its Triton stub", os.getpid())
