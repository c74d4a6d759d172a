"""Qwen3-Omni thinker (``Qwen3OmniMoeForConditionalGeneration``, the thinker only): text, images, audio
and video, a video with its audio track too. Qwen3-VL's markers and tower (patch 16, DeepStack) without
the timestamps, Qwen3-Omni's audio encoder (13 tokens per 100 mel frames), the video's time positions at
the thinker's ``position_id_per_seconds``, and a video's audio interleaved with its frames token by token."""

from mmserve.families.base import FamilySpec, TowerSpec
from mmserve.families.qwen import (
    AudioEmbeddings,
    AudioInVideo,
    QwenVisionImage,
    QwenVisionVideo,
    VisionEmbeddings,
    WhisperAudio,
    qwen3_omni_output_length,
)

# Every run between its markers: vLLM's thinker places a run's next token as its end marker.
_VISION = ("<|vision_start|>", "<|vision_end|>")
_IMAGE = QwenVisionImage("<|image_pad|>", enclosed_by=_VISION)
# clips up to 30 s (3000 frames), what vLLM 0.32 profiles, though the extractor's window is 300 s
_AUDIO = WhisperAudio(
    "<|audio_pad|>",
    fixed_frames=False,
    output_length=qwen3_omni_output_length,
    enclosed_by=("<|audio_start|>", "<|audio_end|>"),
)
_VIDEO = QwenVisionVideo(
    "<|video_pad|>",
    seconds_field="video_second_per_grid",
    audio_in_video=True,
    tokens_per_second_field="position_id_per_seconds",
    enclosed_by=_VISION,
)

QWEN3_OMNI = FamilySpec(
    name="qwen3_omni",
    stock_architectures=("Qwen3OmniMoeForConditionalGeneration",),
    passthrough_architecture="MMServePassthroughQwen3OmniMoeThinker",
    vllm_model="vllm.model_executor.models.qwen3_omni_moe_thinker:Qwen3OmniMoeThinkerForConditionalGeneration",
    modalities=(_IMAGE, _AUDIO, _VIDEO),
    # the vision tower's output with its DeepStack levels beside it (as Qwen3-VL's), the audio tower's
    encoded=(VisionEmbeddings(_IMAGE), AudioEmbeddings(_AUDIO), VisionEmbeddings(_VIDEO)),
    towers=(
        TowerSpec(
            ("image", "video"),
            "transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe:Qwen3OmniMoeVisionEncoder",
            ("thinker_config", "vision_config"),
            "thinker.visual.",
        ),
        TowerSpec(
            ("audio",),
            "transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe:Qwen3OmniMoeAudioEncoder",
            ("thinker_config", "audio_config"),
            "thinker.audio_tower.",
        ),
    ),
    audio_in_video=AudioInVideo(
        layout="mmserve.passthrough.models.qwen3_omni:qwen3_omni_audio_in_video_tokens",
        video_token="video_token_id",
        audio_token="audio_token_id",
        markers="<|vision_start|><|audio_start|>",
    ),
    model_mixins=(
        "mmserve.passthrough.models.qwen3_omni:Qwen3OmniAudioInVideo",
        "mmserve.passthrough.models.qwen3_omni:Qwen3OmniEmbeddings",
    ),
)
