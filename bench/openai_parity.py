"""The same OpenAI chat requests to stock ``vllm serve`` and to this project's gateway, side by side.

Not a speed comparison: both serve one checkpoint (the tiny Qwen2.5-Omni by default,
``$MMSERVE_MODEL`` otherwise) with the same engine arguments (``model_repository/mm_llm/model.json``),
``vllm serve`` with ``--enable-auto-tool-choice --tool-call-parser hermes`` (how vLLM serves tool
calls for the Qwen families); every request is sent to both, not streamed and streamed, and what the
client gets is compared: the content, the tool calls (name and arguments; ids are random on both),
the finish reason and the usage. Greedy decoding, so the texts must be equal.

The requests: tool calling in every ``tool_choice`` (named, required, required with
``parallel_tool_calls: false``, auto with no call made, auto made to call by a regex constraint,
none), a conversation that carries an assistant's call and the tool's answer, and a named call about
an image. Prints a line per request and mode; exit status 1 on any difference.

Reproduce (about 4 minutes on 2 CPU cores, most of it starting the two engines)::

    VLLM_CPU_KVCACHE_SPACE=1 .venv/bin/python bench/openai_parity.py
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import sys
import tempfile
import urllib.request
from pathlib import Path
from typing import Any

from common import SERVED_MODEL_NAME, START_TIMEOUT_S, VllmServer
from peers import ENSEMBLE, VLLM_SERVE, engine_arguments, start_gateway, triton_repository

from mmserve_dev.samples import WEATHER_TOOL

WEATHER = WEATHER_TOOL
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The time in a time zone.",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}},
    },
}
HERMES_CALL = r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Oslo|Rome)"\}\}\n</tool_call>'


def _image_part() -> dict[str, Any]:
    from mmserve_dev.samples import encode_image, sample_image

    data = base64.b64encode(encode_image(sample_image(5, size=(112, 84)))).decode()
    return {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}}


def requests() -> dict[str, dict[str, Any]]:
    ask = [{"role": "user", "content": "What is the weather in Oslo, and the time?"}]
    both = {"tools": [WEATHER, TIME]}
    answered = [
        *ask,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "Snow, -3 C"},
    ]
    named = {"type": "function", "function": {"name": "get_weather"}}
    image = [{"role": "user", "content": [_image_part(), {"type": "text", "text": "Where is this? Its weather?"}]}]
    return {
        "named": {"messages": ask, **both, "tool_choice": named},
        "required": {"messages": ask, **both, "tool_choice": "required"},
        "required, one call": {"messages": ask, **both, "tool_choice": "required", "parallel_tool_calls": False},
        "auto (no call)": {"messages": ask, **both},
        "auto (a call)": {"messages": ask, **both, "structured_outputs": {"regex": HERMES_CALL}},
        "none": {"messages": ask, **both, "tool_choice": "none"},
        "after a call": {"messages": answered, **both},
        "named, image": {"messages": image, "tools": [WEATHER], "tool_choice": named},
    }


def post(url: str, body: dict[str, Any]) -> tuple[int, Any]:
    request = urllib.request.Request(
        f"{url}/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=300) as reply:
            raw = reply.read().decode()
            status = reply.status
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())["error"]["message"]
    if not body.get("stream"):
        return status, json.loads(raw)
    return status, [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: {")]


def outcome(status: int, answer: Any, stream: bool) -> dict[str, Any]:
    """What a client keeps of an answer: content, calls (name, arguments), finish reason, usage."""
    if status != 200:
        return {"status": status}
    if not stream:
        choice = answer["choices"][0]
        message = choice["message"]
        calls = [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls") or []]
        usage = answer["usage"]
        return {
            "content": message["content"] or "",
            "tool_calls": calls,
            "finish_reason": choice["finish_reason"],
            "usage": (usage["prompt_tokens"], usage["completion_tokens"]),
        }
    content, joined, finish = "", dict[int, list[str]](), None
    for chunk in answer:
        for choice in chunk["choices"]:
            delta = choice["delta"]
            content += delta.get("content") or ""
            for call in delta.get("tool_calls") or []:
                name, arguments = joined.setdefault(call["index"], ["", ""])
                function = call.get("function") or {}
                joined[call["index"]] = [
                    name + (function.get("name") or ""),
                    arguments + (function.get("arguments") or ""),
                ]
            finish = choice.get("finish_reason") or finish
    return {"content": content, "tool_calls": [tuple(joined[k]) for k in sorted(joined)], "finish_reason": finish}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-tokens", type=int, default=96)
    args = parser.parse_args(argv)
    from mmserve_dev.triton import TritonServer

    engine_args, _ = engine_arguments({}, [ENSEMBLE, VLLM_SERVE])
    differences = 0
    with tempfile.TemporaryDirectory(prefix="openai-parity-") as folder, contextlib.ExitStack() as stack:
        vllm = VllmServer(
            engine_args,
            Path(folder) / "vllm.log",
            flags=["--enable-auto-tool-choice", "--tool-call-parser", "hermes"],
        )
        vllm.launch()
        stack.callback(vllm.stop)
        triton = TritonServer(
            triton_repository(engine_args, Path(folder)), load_models=["preprocess", "mm_llm", "mm_ensemble"]
        )
        stack.callback(triton.stop)
        triton.start(timeout=START_TIMEOUT_S)
        _, port = start_gateway(triton, stack)
        vllm.wait_ready()
        peers = {"vllm serve": (vllm.url, SERVED_MODEL_NAME), "gateway": (f"http://127.0.0.1:{port}", "mm_ensemble")}
        for name, fields in requests().items():
            for stream in (False, True):
                got = {}
                for system, (url, model) in peers.items():
                    body = {
                        "model": model,
                        "temperature": 0.0,
                        "max_tokens": args.max_tokens,
                        **fields,
                        "stream": stream,
                    }
                    got[system] = outcome(*post(url, body), stream)
                same = got["vllm serve"] == got["gateway"]
                differences += not same
                mode = "streamed" if stream else "whole"
                print(
                    f"{'same' if same else 'DIFFERENT':9} {name:20} {mode:8} {json.dumps(got['gateway'], ensure_ascii=False)}"
                )
                if not same:
                    print(f"          vllm serve: {json.dumps(got['vllm serve'], ensure_ascii=False)}")
    print(f"{differences} difference(s)")
    return 1 if differences else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
