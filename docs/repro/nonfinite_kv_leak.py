#!/usr/bin/env python3
"""Minimal reproduction: one request with non-finite audio poisons later, unrelated requests on
vLLM's CPU engine (stock vLLM 0.32, the project's plugin off). See docs/RELIABILITY.md.

    VLLM_CPU_KVCACHE_SPACE=1 .venv/bin/python docs/repro/nonfinite_kv_leak.py [models/qwen2_5_omni]

1. a short text prompt, greedy: its reference tokens;
2. a prompt with one audio clip whose samples are NaN (raw audio: vLLM runs the HF feature
   extractor itself) -- the features, then the KV cache entries of that request, are NaN;
3. the same short text prompt again, then two other short ones.
Observed on the CPU: (2) answers token 0 repeated, and (3) answers token 0 too -- the freed KV
blocks of (2) are reused with their NaN contents still reachable by attention -- until a longer
prompt overwrites them. The project rejects non-finite values before the engine instead.
"""

from __future__ import annotations

import os
import sys

os.environ["VLLM_PLUGINS"] = ""  # stock vLLM: the project's pass-through plugin not loaded
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def main() -> None:
    import numpy as np
    from transformers import AutoProcessor
    from vllm import LLM, SamplingParams

    model = sys.argv[1] if len(sys.argv) > 1 else "models/qwen2_5_omni"
    processor = AutoProcessor.from_pretrained(model)

    def chat(content: list[dict]) -> str:
        return processor.apply_chat_template(
            [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
        )

    llm = LLM(
        model=model,
        dtype="float32",
        max_model_len=2048,
        enforce_eager=True,
        seed=0,
        limit_mm_per_prompt={"audio": 1, "image": 0},
    )
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    short = [chat([{"type": "text", "text": t}]) for t in ("Hi.", "Tell me more.", "What is this?")]

    before = [o.outputs[0].token_ids for o in llm.generate(short, greedy)]
    nan_clip = np.full(16_000, np.nan, dtype=np.float32)
    poisoned = llm.generate(
        {
            "prompt": chat([{"type": "audio"}, {"type": "text", "text": "Listen."}]),
            "multi_modal_data": {"audio": [(nan_clip, 16_000)]},
        },
        greedy,
    )
    after = [llm.generate(p, greedy)[0].outputs[0].token_ids for p in short]

    print("NaN-audio request :", list(poisoned[0].outputs[0].token_ids))
    for prompt, a, b in zip(("Hi.", "Tell me more.", "What is this?"), before, after, strict=True):
        print(f"{prompt!r:16} before {list(a)}  after {list(b)}  {'same' if list(a) == list(b) else 'CHANGED'}")


if __name__ == "__main__":
    main()
