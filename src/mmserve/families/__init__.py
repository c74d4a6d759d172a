"""The model families the project serves, and the one place that knows each family's rules.

Adding a family: write a module like ``qwen2_5_vl.py`` that declares a ``FamilySpec`` (reusing or
writing a ``ModalitySpec`` per modality) and list it in ``FAMILIES``. See docs/adding-a-family.md.
"""

from __future__ import annotations

from mmserve.families.audioflamingo3 import AUDIO_FLAMINGO_3
from mmserve.families.base import FamilySpec, FieldSpec, ModalitySpec, TowerSpec
from mmserve.families.internvl import INTERNVL
from mmserve.families.qwen2_5_omni import QWEN2_5_OMNI
from mmserve.families.qwen2_5_vl import QWEN2_5_VL
from mmserve.families.qwen2_audio import QWEN2_AUDIO
from mmserve.families.qwen3_5 import QWEN3_5
from mmserve.families.qwen3_omni import QWEN3_OMNI
from mmserve.families.qwen3_vl import QWEN3_VL, QWEN3_VL_MOE

FAMILIES: dict[str, FamilySpec] = {
    f.name: f
    for f in (
        QWEN2_5_OMNI,
        QWEN2_5_VL,
        QWEN2_AUDIO,
        QWEN3_VL,
        QWEN3_VL_MOE,
        QWEN3_5,
        QWEN3_OMNI,
        INTERNVL,
        AUDIO_FLAMINGO_3,
    )
}
DEFAULT_FAMILY = QWEN2_5_OMNI.name


def get_family(name: str) -> FamilySpec:
    try:
        return FAMILIES[name]
    except KeyError:
        raise KeyError(f"unknown model family {name!r}; known: {sorted(FAMILIES)}") from None


def family_for_architecture(architecture: str) -> FamilySpec:
    """The family of a checkpoint's (stock or pass-through) architecture."""
    for family in FAMILIES.values():
        if architecture in family.stock_architectures or architecture == family.passthrough_architecture:
            return family
    raise KeyError(f"no model family serves architecture {architecture!r}")


def register_family(family: FamilySpec) -> None:
    """Add a user's own family (call before vLLM loads plugins, e.g. from your own plugin)."""
    FAMILIES[family.name] = family


__all__ = [
    "DEFAULT_FAMILY",
    "FAMILIES",
    "FamilySpec",
    "FieldSpec",
    "ModalitySpec",
    "TowerSpec",
    "family_for_architecture",
    "get_family",
    "register_family",
]
