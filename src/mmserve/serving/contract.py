"""The tensors that travel between ``preprocess`` and ``mm_llm`` (and from clients that preprocess on
their side straight to ``mm_llm``): the HF processor's own names, native dtypes and shapes.

``preprocess`` always outputs every feature tensor, empty (zero items) when the request has no media
of that modality, so that one ensemble definition serves every family.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: type
    dims: tuple[int, ...]
    """Triton dims (-1: variable); no batch dimension (``max_batch_size: 0``)."""
    meaning: str


INPUT_IDS = TensorSpec(
    "input_ids", np.int64, (-1,),
    "prompt token ids, chat template applied, every media placeholder already expanded",
)

FEATURE_TENSORS: tuple[TensorSpec, ...] = (
    TensorSpec("pixel_values", np.float32, (-1, -1),
               "normalized image patches (sum of t*h*w over images, 3*2*14*14 for Qwen)"),
    TensorSpec("image_grid_thw", np.int64, (-1, 3), "patch grid (t, h, w) of each image"),
    TensorSpec("input_features", np.float32, (-1, -1, -1),
               "log-mel features (clips, mel bins, frames)"),
    TensorSpec("feature_attention_mask", np.int32, (-1, -1),
               "valid mel frames of each clip (clips, frames)"),
)

FEATURES_BY_NAME = {spec.name: spec for spec in FEATURE_TENSORS}


def empty_feature(spec: TensorSpec) -> np.ndarray:
    """A zero-item tensor of ``spec``: leading dim 0, other variable dims 0."""
    shape = tuple(0 if d == -1 else d for d in spec.dims)
    return np.zeros(shape, dtype=spec.dtype)
