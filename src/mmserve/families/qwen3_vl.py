"""Qwen3-VL, dense and mixture-of-experts: images and videos through the Qwen3-VL vision tower (DeepStack),
``<|image_pad|>`` and ``<|video_pad|>`` placeholders, every temporal patch of a video a timestamped frame
group. The MoE variant differs in its language model only."""

from mmserve.families.base import FamilySpec, TowerSpec
from mmserve.families.qwen import QwenVisionImage, TimestampedVideo, VisionEmbeddings

# The language model's M-RoPE table: max_position_embeddings x 1 (no video pruning).
_IMAGE = QwenVisionImage("<|image_pad|>", positions_factor=1)
_VIDEO = TimestampedVideo("<|video_pad|>")

QWEN3_VL = FamilySpec(
    name="qwen3_vl",
    stock_architectures=("Qwen3VLForConditionalGeneration",),
    passthrough_architecture="MMServePassthroughQwen3VL",
    vllm_model="vllm.model_executor.models.qwen3_vl:Qwen3VLForConditionalGeneration",
    modalities=(_IMAGE, _VIDEO),
    # the tower's output with its DeepStack levels: (tokens, hidden x (1 + levels)), as vLLM takes it
    encoded=(VisionEmbeddings(_IMAGE), VisionEmbeddings(_VIDEO)),
    towers=(
        TowerSpec(
            ("image", "video"),
            "transformers.models.qwen3_vl.modeling_qwen3_vl:Qwen3VLVisionModel",
            ("vision_config",),
            "model.visual.",
        ),
    ),
)

QWEN3_VL_MOE = FamilySpec(
    name="qwen3_vl_moe",
    stock_architectures=("Qwen3VLMoeForConditionalGeneration",),
    passthrough_architecture="MMServePassthroughQwen3VLMoe",
    vllm_model="vllm.model_executor.models.qwen3_vl_moe:Qwen3VLMoeForConditionalGeneration",
    modalities=(_IMAGE, _VIDEO),
    encoded=(VisionEmbeddings(_IMAGE), VisionEmbeddings(_VIDEO)),
    towers=(
        TowerSpec(
            ("image", "video"),
            "transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe:Qwen3VLMoeVisionModel",
            ("vision_config",),
            "model.visual.",
        ),
    ),
)
