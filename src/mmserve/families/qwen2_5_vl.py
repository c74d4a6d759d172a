"""Qwen2.5-VL: images and videos through the vision tower, ``<|image_pad|>`` and ``<|video_pad|>``
placeholders."""

from mmserve.families.base import FamilySpec, TowerSpec
from mmserve.families.qwen import QwenVisionImage, QwenVisionVideo, VisionEmbeddings

_IMAGE = QwenVisionImage("<|image_pad|>")
_VIDEO = QwenVisionVideo("<|video_pad|>")

QWEN2_5_VL = FamilySpec(
    name="qwen2_5_vl",
    stock_architectures=("Qwen2_5_VLForConditionalGeneration",),
    passthrough_architecture="MMServePassthroughQwen2_5_VL",
    vllm_model="vllm.model_executor.models.qwen2_5_vl:Qwen2_5_VLForConditionalGeneration",
    modalities=(_IMAGE, _VIDEO),
    encoded=(VisionEmbeddings(_IMAGE), VisionEmbeddings(_VIDEO)),
    towers=(
        TowerSpec(
            ("image", "video"),
            "transformers.models.qwen2_5_vl.modeling_qwen2_5_vl:Qwen2_5_VisionTransformerPretrainedModel",
            ("vision_config",),
            "visual.",
        ),
    ),
)
