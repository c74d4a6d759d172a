"""Qwen2-Audio: audio through a Whisper encoder with absolute positions (clips padded to 30 s)."""

from mmserve.families.base import FamilySpec, TowerSpec
from mmserve.families.qwen import AudioEmbeddings, WhisperAudio

_AUDIO = WhisperAudio("<|AUDIO|>", fixed_frames=True)

QWEN2_AUDIO = FamilySpec(
    name="qwen2_audio",
    stock_architectures=("Qwen2AudioForConditionalGeneration",),
    passthrough_architecture="MMServePassthroughQwen2Audio",
    vllm_model="vllm.model_executor.models.qwen2_audio:Qwen2AudioForConditionalGeneration",
    modalities=(_AUDIO,),
    encoded=(AudioEmbeddings(_AUDIO),),
    towers=(
        TowerSpec(
            ("audio",),
            "transformers.models.qwen2_audio.modeling_qwen2_audio:Qwen2AudioEncoder",
            ("audio_config",),
            "audio_tower.",
            projector=(
                "transformers.models.qwen2_audio.modeling_qwen2_audio:Qwen2AudioMultiModalProjector",
                "multi_modal_projector.",
            ),
            padded=True,
        ),
    ),
    model_mixins=("mmserve.passthrough.models.qwen2_audio:Qwen2AudioEmbeddings",),
)
