"""Qwen2-Audio: audio through a Whisper encoder with absolute positions (clips padded to 30 s)."""

from mmserve.families.base import FamilySpec
from mmserve.families.qwen import WhisperAudio

QWEN2_AUDIO = FamilySpec(
    name="qwen2_audio",
    stock_architectures=("Qwen2AudioForConditionalGeneration",),
    passthrough_architecture="MMServePassthroughQwen2Audio",
    vllm_model="vllm.model_executor.models.qwen2_audio:Qwen2AudioForConditionalGeneration",
    modalities=(WhisperAudio("<|AUDIO|>", fixed_frames=True),),
)
