"""Pass-through model classes, built on first access (``mmserve.passthrough.models:<arch>``) so that
registering the plugin imports no vLLM model code; beside them, per family, its fixes of the stock vLLM
model (``FamilySpec.model_mixins``), each naming what upstream would make it unnecessary."""

from __future__ import annotations

import functools

from mmserve.families import FAMILIES


def register_models() -> None:
    """Register every family's pass-through architecture with vLLM's model registry."""
    from vllm import ModelRegistry

    supported = set(ModelRegistry.get_supported_archs())
    for family in FAMILIES.values():
        arch = family.passthrough_architecture
        if arch not in supported:
            ModelRegistry.register_model(arch, f"{__name__}:{arch}")


@functools.cache
def _model_class(arch: str) -> type:
    from mmserve.passthrough.processor import build_model_class

    family = next(f for f in FAMILIES.values() if f.passthrough_architecture == arch)
    return build_model_class(family)


def __getattr__(name: str) -> type:
    if any(f.passthrough_architecture == name for f in FAMILIES.values()):
        return _model_class(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
