"""Qwen2.5-Omni thinker: text, images, audio and video, a video with its audio track too; the
project's default model."""

from mmserve.families.base import FamilySpec, TowerSpec
from mmserve.families.qwen import (
    AudioEmbeddings,
    AudioInVideo,
    QwenVisionImage,
    QwenVisionVideo,
    VisionEmbeddings,
    WhisperAudio,
)

_IMAGE = QwenVisionImage("<|IMAGE|>")
_AUDIO = WhisperAudio("<|AUDIO|>", fixed_frames=False)
# tokens_per_second: vLLM's thinker reads it from the vision config, 25 where it has none (the HF
# config's position_id_per_seconds)
_VIDEO = QwenVisionVideo("<|VIDEO|>", seconds_field="video_second_per_grid", audio_in_video=True, tokens_per_second=25)

QWEN2_5_OMNI = FamilySpec(
    name="qwen2_5_omni",
    stock_architectures=("Qwen2_5OmniModel", "Qwen2_5OmniForConditionalGeneration"),
    passthrough_architecture="MMServePassthroughQwen2_5OmniThinker",
    vllm_model=("vllm.model_executor.models.qwen2_5_omni_thinker:Qwen2_5OmniThinkerForConditionalGeneration"),
    modalities=(_IMAGE, _AUDIO, _VIDEO),
    encoded=(VisionEmbeddings(_IMAGE), AudioEmbeddings(_AUDIO), VisionEmbeddings(_VIDEO)),
    towers=(
        TowerSpec(
            ("image", "video"),
            "transformers.models.qwen2_5_omni.modeling_qwen2_5_omni:Qwen2_5OmniVisionEncoder",
            ("thinker_config", "vision_config"),
            "thinker.visual.",
        ),
        TowerSpec(
            ("audio",),
            "transformers.models.qwen2_5_omni.modeling_qwen2_5_omni:Qwen2_5OmniAudioEncoder",
            ("thinker_config", "audio_config"),
            "thinker.audio_tower.",
        ),
    ),
    audio_in_video=AudioInVideo(),
    model_mixins=(
        "mmserve.passthrough.models.qwen2_5_omni:OmniAudioInVideo",
        "mmserve.passthrough.models.qwen2_5_omni:OmniEmbeddings",
    ),
)
