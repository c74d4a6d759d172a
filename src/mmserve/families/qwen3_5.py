"""Qwen3.5 (dense, ``Qwen3_5ForConditionalGeneration``): Qwen3-VL's images and timestamped videos
(the same processors and layout) in front of a hybrid language model, Gated DeltaNet linear attention
between full-attention layers; its vision tower has no DeepStack."""

from mmserve.families.base import FamilySpec, TowerSpec
from mmserve.families.qwen import QwenVisionImage, TimestampedVideo, VisionEmbeddings

# The language model's M-RoPE table: max_position_embeddings x 1 (as Qwen3-VL's, no video pruning).
_IMAGE = QwenVisionImage("<|image_pad|>", positions_factor=1)
_VIDEO = TimestampedVideo("<|video_pad|>")

QWEN3_5 = FamilySpec(
    name="qwen3_5",
    stock_architectures=("Qwen3_5ForConditionalGeneration",),
    passthrough_architecture="MMServePassthroughQwen3_5",
    vllm_model="vllm.model_executor.models.qwen3_5:Qwen3_5ForConditionalGeneration",
    modalities=(_IMAGE, _VIDEO),
    encoded=(VisionEmbeddings(_IMAGE), VisionEmbeddings(_VIDEO)),
    towers=(
        TowerSpec(
            ("image", "video"),
            "transformers.models.qwen3_5.modeling_qwen3_5:Qwen3_5VisionModel",
            ("vision_config",),
            "model.visual.",
        ),
    ),
)
