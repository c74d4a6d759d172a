"""Qwen3-VL (dense): images and videos through the Qwen3-VL vision tower (DeepStack), ``<|image_pad|>``
and ``<|video_pad|>`` placeholders, every temporal patch of a video a timestamped frame group."""

from mmserve.families.base import FamilySpec
from mmserve.families.qwen import QwenVisionImage, TimestampedVideo

QWEN3_VL = FamilySpec(
    name="qwen3_vl",
    stock_architectures=("Qwen3VLForConditionalGeneration",),
    passthrough_architecture="MMServePassthroughQwen3VL",
    vllm_model="vllm.model_executor.models.qwen3_vl:Qwen3VLForConditionalGeneration",
    # The language model's M-RoPE table: max_position_embeddings x 1 (no video pruning).
    modalities=(QwenVisionImage("<|image_pad|>", positions_factor=1), TimestampedVideo("<|video_pad|>")),
)
