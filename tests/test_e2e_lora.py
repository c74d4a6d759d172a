"""LoRA adapters served end to end: ``model_repository/`` (a copy whose ``mm_llm/model.json`` enables LoRA
and whose ``multi_lora.json`` names two tiny adapters, in Triton's vLLM backend's format) on a real
tritonserver serving Qwen2.5-VL's tiny checkpoint; ``lora_name`` in ``sampling_parameters`` through
``mm_ensemble`` (the project's client) and ``model=<adapter>`` through the OpenAI gateway (the ``openai``
SDK), against HF transformers + peft on the same image; an unknown adapter refused by name with the
server serving on; a bad adapter failing the model's load with its name.

The server is this module's own, started before the session's shared server and stopped before it
starts (``own_server``): one engine at a time."""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from mmserve import settings
from mmserve_dev.samples import encode_image, sample_image

from utils import ROOT, Endpoints
from utils import client as _client

pytestmark = [pytest.mark.server, pytest.mark.own_server]

FAMILY = "qwen2_5_vl"
QUESTION = "What is it?"


@pytest.fixture(scope="module")
def adapters(tiny_models):
    from mmserve_dev.tiny_adapters import build_all_adapters

    return build_all_adapters(families=(FAMILY,), checkpoints=tiny_models)[FAMILY]


def lora_repository(tmp_path, adapters, **engine_args):
    """A copy of ``model_repository/`` whose mm_llm serves ``adapters`` (name -> folder)."""
    repository = tmp_path / "model_repository"
    shutil.copytree(ROOT / "model_repository", repository, ignore=shutil.ignore_patterns("__pycache__"))
    model_json = repository / "mm_llm" / "model.json"
    lora = {"enable_lora": True, "max_lora_rank": 16, "max_loras": 2, **engine_args}
    model_json.write_text(json.dumps({**json.loads(model_json.read_text()), **lora}))
    (repository / "mm_llm" / "multi_lora.json").write_text(json.dumps({k: str(v) for k, v in adapters.items()}))
    return repository


def _env(tiny_models):
    return {
        settings.MODEL.name: str(tiny_models[FAMILY]),
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
    }


@pytest.fixture(scope="module")
def server(tiny_models, adapters, tmp_path_factory):
    from mmserve_dev.triton import TritonServer

    if settings.TRITON_GRPC_URL.get():
        pytest.skip("MMSERVE_TRITON_GRPC_URL: the suite starts no server, and this module needs its own")
    repository = lora_repository(tmp_path_factory.mktemp("lora"), adapters)
    with TritonServer(repository, env=_env(tiny_models), drain="mm_llm") as triton:
        yield Endpoints(triton.grpc_url, triton.http_url, triton.metrics_url, server=triton)


@pytest.fixture(scope="module")
def expected(tiny_models, adapters):
    """HF transformers (+ peft) greedy tokens for the image question: base and each adapter."""
    from peft import PeftModel

    from mmserve_dev.hf_reference import HFReference, chat_prompt

    image = sample_image(31, size=(140, 112))
    tokens = {}
    for name in (None, *adapters):
        reference = HFReference(FAMILY, tiny_models[FAMILY])
        if name is not None:
            reference.model = PeftModel.from_pretrained(reference.model, str(adapters[name])).eval()
        text = chat_prompt(FAMILY, reference.processor, ["image", f"text:{QUESTION}"])
        tokens[name] = reference.generate(text, images=[image], max_new_tokens=12)
    assert len({tuple(t) for t in tokens.values()}) == 3
    return image, tokens


def test_a_request_names_its_adapter(server, expected):
    """``lora_name`` in ``sampling_parameters`` through mm_ensemble: each adapter's tokens = HF + peft's,
    the base model's without it, streamed or not; all three in flight at once; an unknown name is
    refused ``[INVALID_ARG]`` naming it, and the next request answers as before."""
    import concurrent.futures

    from mmserve.client import ClientError

    image, tokens = expected
    png = encode_image(image)
    client = _client(server)

    def ask(name, stream=False):
        return client.generate(
            QUESTION, [png], lora_name=name, max_tokens=12, temperature=0.0, stream=stream
        ).output_ids

    for name, want in tokens.items():
        assert ask(name) == want, name
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        names = [*tokens, *tokens]
        answers = list(pool.map(lambda n: ask(n, stream=True), names))
    assert answers == [tokens[name] for name in names]
    with pytest.raises(ClientError, match=r"lora_name 'sql' is not an adapter of this model \(it serves \["):
        ask("sql")
    assert ask("lora_r8") == tokens["lora_r8"]
    # Triton's /metrics: the requests per adapter (the refused one not among them)
    deadline = time.monotonic() + 10
    while (counts := adapter_metrics(server)).get(("mmserve:lora_requests_total", "lora_r8")) != 4:
        assert time.monotonic() < deadline, counts
        time.sleep(0.2)
    assert counts[("mmserve:lora_requests_total", "lora_r16")] == 3
    # the scheduler's gauges, as of the engine's last step (an idle engine records none: as vLLM's own)
    for gauge in ("vllm:lora_requests_running", "vllm:lora_requests_waiting"):
        assert all(0 <= counts[(gauge, adapter)] <= 6 for adapter in ("lora_r8", "lora_r16")), counts


def adapter_metrics(server) -> dict[tuple[str, str], float]:
    """(metric, lora_name) -> value, from Triton's /metrics."""
    import urllib.request

    text = urllib.request.urlopen(server.metrics, timeout=10).read().decode()
    found = {}
    for line in text.splitlines():
        if 'lora_name="' in line and not line.startswith("#"):
            name = line.split("{", 1)[0]
            adapter = line.split('lora_name="', 1)[1].split('"', 1)[0]
            found[(name, adapter)] = float(line.rsplit(" ", 1)[1])
    return found


def test_the_gateway_serves_adapters_as_models(server, expected, tmp_path):
    """``python -m mmserve.gateway --lora-modules lora_r8 lora_r16``: the OpenAI SDK with
    ``model="lora_r8"`` gets the adapter's answer (= mm_ensemble's with lora_name), ``/v1/models``
    lists the base model and each adapter with the base as its parent, an unknown model is a 404."""
    import openai
    from test_openai import Gateway

    image, tokens = expected
    png = encode_image(image)
    gateway = Gateway(server.grpc, tmp_path / "gateway.log", "--lora-modules", "lora_r8", "lora_r16=/ignored")
    try:
        sdk = gateway.sdk()
        listed = {card.id: getattr(card, "parent", None) for card in sdk.models.list().data}
        assert listed == {"mm_ensemble": None, "lora_r8": "mm_ensemble", "lora_r16": "mm_ensemble"}
        content = [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(png).decode()}},
            {"type": "text", "text": QUESTION},
        ]
        for name in ("lora_r8", "lora_r16", "mm_ensemble"):
            reply = sdk.chat.completions.create(
                model=name, messages=[{"role": "user", "content": content}], max_tokens=12, temperature=0.0
            )
            lora = None if name == "mm_ensemble" else name
            direct = _client(server).generate(QUESTION, [png], lora_name=lora, max_tokens=12, temperature=0.0)
            assert direct.output_ids == tokens[lora]
            assert reply.choices[0].message.content == direct.text, name
        with pytest.raises(openai.NotFoundError, match="and its LoRA adapters"):
            sdk.chat.completions.create(model="sql", messages=[{"role": "user", "content": QUESTION}], max_tokens=4)
        # vLLM's runtime updates are off by default: no such endpoint
        assert _post(gateway.url + "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/x"})[0] == 404
    finally:
        gateway.stop()


def _post(url: str, body: dict, headers: dict | None = None) -> tuple[int, str]:
    import requests

    reply = requests.post(url, json=body, headers=headers or {}, timeout=120)
    return reply.status_code, reply.text


def update_adapters(server, update: dict, key: str | None) -> dict[str, str]:
    """``mmserve.adapters.update_adapters`` with ``key`` as the operator's (None: none)."""
    from mmserve.adapters import update_adapters as send

    return send(server.grpc, update, operator_key=key or "")


def test_adapters_change_while_serving(server, expected, adapters):
    """The operator's ``lora_adapters`` control request: an adapter unloaded while a request on another
    is in flight (that one answers as before; the unloaded one is refused by name from then on), one
    loaded under a new name from a folder (its answer = HF + peft's), a bad folder refused naming it
    with nothing changed, ``reload`` back to ``multi_lora.json``; an ordinary client refused."""
    import concurrent.futures

    from mmserve.client import ClientError

    image, tokens = expected
    png = encode_image(image)
    client = _client(server)
    key = server.server.operator_key

    def ask(name, **kwargs):
        return client.generate(QUESTION, [png], lora_name=name, max_tokens=12, temperature=0.0, **kwargs).output_ids

    with pytest.raises(ClientError, match=r"lora_adapters: refused: the operator's key \(operator_key\) is missing"):
        update_adapters(server, {"unload": ["lora_r8"]}, None)
    with pytest.raises(ClientError, match=r"lora_adapters: refused"):
        update_adapters(server, {"unload": ["lora_r8"]}, "x" * 43)
    assert ask("lora_r8") == tokens["lora_r8"]

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        in_flight = [pool.submit(ask, "lora_r16", stream=True) for _ in range(2)]
        served = update_adapters(server, {"unload": ["lora_r8"]}, key)
        assert [future.result() for future in in_flight] == [tokens["lora_r16"]] * 2
    assert served == {"lora_r16": str(adapters["lora_r16"])}
    with pytest.raises(
        ClientError, match=r"lora_name 'lora_r8' is not an adapter of this model \(it serves \['lora_r16'\]\)"
    ):
        ask("lora_r8")

    served = update_adapters(server, {"load": {"sql": str(adapters["lora_r8"])}}, key)
    assert set(served) == {"lora_r16", "sql"}
    assert ask("sql") == tokens["lora_r8"] and ask("lora_r16") == tokens["lora_r16"] and ask(None) == tokens[None]
    with pytest.raises(ClientError, match=r"lora_adapters: adapter 'bad': .* is not a folder"):
        update_adapters(server, {"load": {"bad": "/nonexistent/adapter"}}, key)
    with pytest.raises(
        ClientError, match=r"lora_adapters: unload: 'nope' not served \(it serves \['lora_r16', 'sql'\]\)"
    ):
        update_adapters(server, {"unload": ["nope"]}, key)
    assert ask("sql") == tokens["lora_r8"]  # nothing changed

    reload = subprocess.run(  # multi_lora.json again, as the operator types it
        [sys.executable, "-m", "mmserve.adapters", "--url", server.grpc, "reload"],
        env={**os.environ, settings.OPERATOR_KEY.name: key},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert reload.returncode == 0, reload.stderr
    assert json.loads(reload.stdout) == {name: str(path) for name, path in adapters.items()}
    assert ask("lora_r8") == tokens["lora_r8"]
    with pytest.raises(ClientError, match=r"lora_name 'sql' is not an adapter"):
        ask("sql")
    deadline = time.monotonic() + 10
    while adapter_metrics(server).get(("mmserve:lora_requests_total", "sql")) != 2:
        assert time.monotonic() < deadline, adapter_metrics(server)
        time.sleep(0.2)


def test_the_gateway_loads_and_unloads_adapters(server, expected, adapters, tmp_path):
    """``--allow-runtime-lora-updating``: vLLM's ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``
    with the operator's key (401 without), their answers and refusals as ``vllm serve``'s; a loaded
    adapter is a model the SDK names (its answer = mm_ensemble's with the same folder), an unloaded one a
    404."""
    import openai
    from test_openai import Gateway

    image, tokens = expected
    png = encode_image(image)
    key = server.server.operator_key
    gateway = Gateway(
        server.grpc,
        tmp_path / "gateway.log",
        "--allow-runtime-lora-updating",
        env={settings.OPERATOR_KEY.name: key},
    )
    operator = {"mmserve-operator-key": key}
    load, unload = gateway.url + "/v1/load_lora_adapter", gateway.url + "/v1/unload_lora_adapter"
    body = {"lora_name": "sql", "lora_path": str(adapters["lora_r8"])}
    try:
        assert _post(load, body)[0] == 401
        assert _post(load, body, {"mmserve-operator-key": "y" * 43})[0] == 401
        assert _post(load, body, operator) == (200, "Success: LoRA adapter 'sql' added successfully.")
        status, text = _post(load, body, operator)
        assert status == 400 and "The lora adapter 'sql' has already been loaded" in text
        assert _post(load, {**body, "load_inplace": True}, operator)[0] == 200
        status, text = _post(load, {"lora_name": "bad", "lora_path": "/nonexistent/adapter"}, operator)
        assert status == 400 and "adapter 'bad'" in text and "is not a folder" in text
        sdk = gateway.sdk()
        assert {card.id: getattr(card, "parent", None) for card in sdk.models.list().data} == {
            "mm_ensemble": None,
            "sql": "mm_ensemble",
        }
        content = [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(png).decode()}},
            {"type": "text", "text": QUESTION},
        ]
        reply = sdk.chat.completions.create(
            model="sql", messages=[{"role": "user", "content": content}], max_tokens=12, temperature=0.0
        )
        direct = _client(server).generate(QUESTION, [png], lora_name="sql", max_tokens=12, temperature=0.0)
        assert direct.output_ids == tokens["lora_r8"] and reply.choices[0].message.content == direct.text
        assert _post(unload, {"lora_name": "sql"}, operator) == (
            200,
            "Success: LoRA adapter 'sql' removed successfully.",
        )
        status, text = _post(unload, {"lora_name": "sql"}, operator)
        assert status == 404 and "The lora adapter 'sql' cannot be found." in text
        with pytest.raises(openai.NotFoundError):
            sdk.chat.completions.create(model="sql", messages=[{"role": "user", "content": QUESTION}], max_tokens=4)
    finally:
        gateway.stop()


def test_a_bad_adapter_fails_the_load_naming_it(tiny_models, adapters, tmp_path):
    """An adapter whose rank exceeds ``max_lora_rank``: mm_llm does not load, and its log says which
    adapter and why (checked before the engine starts)."""
    from mmserve_dev.triton import TritonServer
    from mmserve_dev.triton.install import TritonServerError

    if settings.TRITON_GRPC_URL.get():
        pytest.skip("MMSERVE_TRITON_GRPC_URL: the suite starts no server")
    repository = lora_repository(tmp_path, adapters, max_lora_rank=8)
    with pytest.raises(TritonServerError) as failed, TritonServer(repository, env=_env(tiny_models)):
        pass
    assert "adapter 'lora_r16': rank 16 exceeds max_lora_rank 8 (model.json)" in str(failed.value) + _log(failed.value)


def _log(error: Exception) -> str:
    """The server log a ``TritonServerError`` names."""
    import re
    from pathlib import Path

    match = re.search(r"log (\S+\.log)", str(error))
    return Path(match.group(1).rstrip(":")).read_text(errors="replace") if match else ""
