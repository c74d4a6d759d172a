"""Engine-side support for the benchmarks: importable by qualified name in every vLLM process.

``bench/peers.py`` sends the same requests to several systems, and three of them (Triton's
``mm_ensemble`` and ``mm_llm`` called directly) share one engine. So that no
measured request is served from what an earlier copy of it left in that engine, every engine of the
benchmark runs with vLLM's prefix cache and multimodal processor cache off (engine arguments) and
with ``NoReuseEncoderCacheManager`` as its encoder cache, which vLLM can't switch off otherwise::

    {"ec_manager_config": {"encoder_cache_manager_cls": "mmserve_dev.benchmarking.NoReuseEncoderCacheManager"}}

The class is loaded in the engine core process (whoever started it: Triton's ``mm_llm``, ``vllm
serve``, an ``EngineRunner``), so it lives in the installed package, not beside the benchmark.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm.v1.core.encoder_cache_manager import EncoderCacheManager

if TYPE_CHECKING:
    from vllm.v1.request import Request


class NoReuseEncoderCacheManager(EncoderCacheManager):
    """vLLM 0.32's encoder cache without reuse across requests.

    vLLM keeps an item's encoder output after the last request that used it is done, until the space
    is needed, so a later request with the same item (same content hash) skips the encoder. Here the
    output is evicted as soon as no request in flight references it; requests in flight together
    still share an item, as they do in vLLM.
    """

    def free_encoder_input(self, request: Request, input_id: int) -> None:
        super().free_encoder_input(request, input_id)
        mm_hash = request.mm_features[input_id].identifier
        embeds = self.freeable.pop(mm_hash, None)
        if embeds is None:  # still referenced by a request in flight, or evicted already
            return
        # What EncoderCacheManager.can_allocate does to evict an entry.
        del self.cached[mm_hash]
        del self.num_embeds_by_hash[mm_hash]
        self.freed.append(mm_hash)
        self.num_free_slots += embeds
