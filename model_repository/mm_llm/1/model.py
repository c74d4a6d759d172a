"""mm_llm: vLLM (V1 AsyncLLM) on already-processed multimodal tensors (Triton adapter, decoupled).

Inputs : input_ids (INT64 [tokens], placeholders expanded); optional pixel_values, image_grid_thw,
         input_features, feature_attention_mask (the HF processor's outputs; absent or empty: none),
         text_input (echoed unless exclude_input_in_output), stream, sampling_parameters (JSON),
         exclude_input_in_output and the return_* flags of Triton's vLLM backend.
         cancel_key (BYTES [1]): the client's secret; only a cancel that repeats it cancels the
         request (mmserve.serving.owners).
         cancel (BYTES [1]) + cancel_key: a control request: cancel the request whose Triton
         request id and cancel_key these are (mm_ensemble passes the client's id and key on;
         mmserve.client and the gateway send it when their client cancels); answered with an empty
         final response whether or not such a request exists, its other inputs ignored.
         drain (FP32 [1]) + operator_key: a control request before a stop (mmserve.drain), the
         operator's only (mmserve.operator): refuse new requests, give those in flight this many
         seconds, end the rest UNAVAILABLE, then answer.
         lora_adapters (BYTES [1], JSON) + operator_key: a control request, the operator's only:
         load, unload or reload (multi_lora.json) LoRA adapters while serving (mmserve.serving.lora);
         answered with text_output, the adapters now served ({name: folder}).
Outputs: text_output, output_ids, and when asked finish_reason, cumulative_logprob, logprobs,
         num_input_tokens, num_output_tokens. Streaming: the first delta at once, then at most
         one response per stream_flush_ms (config.pbtxt; per request in sampling_parameters).
Errors : [INVALID_ARG] bad input, [UNAVAILABLE] engine failed, restarting or stopping,
         [CANCELLED] cancelled, [INTERNAL] our fault (see mmserve.serving.triton). Every request
         gets exactly one final response (mmserve.serving.triton.TritonSink).
Health : a dead or wedged engine fails every request UNAVAILABLE, then the model asks Triton to
         unload it (readiness false); a keeper beside the server loads it back with a new engine
         (mmserve.serving.keeper; mmserve_dev.triton runs one). Needs
         --model-control-mode=explicit (scripts/serve.sh uses it).
Engine arguments come from model.json beside config.pbtxt; health settings from config.pbtxt
parameters. The logic lives in mmserve.serving.llm; see docs/tensors.md, docs/RELIABILITY.md.
"""

import functools
import json
import logging
import os
import threading

import numpy as np
import triton_python_backend_utils as pb_utils

from mmserve.serving.embedded import (
    arm_deadman_switch,
    finish_stub,
    freeze_startup_heap,
    prepare_stub,
    server_gone,
    use_utf8_locale,
)

use_utf8_locale()  # first: before torch or vLLM read a file (see its docstring)

from mmserve import operator, vllm_seam
from mmserve.errors import InputError, UnavailableError
from mmserve.serving.llm import STOPPING, STREAM_FLUSH_MS, HealthConfig, LLMConfig, LLMService, parse_request
from mmserve.serving.lora import AdapterError, parse_update
from mmserve.serving.metrics import TritonMetrics, TritonStatLogger
from mmserve.serving.owners import owner_of, request_id_of
from mmserve.serving.triton import TritonSink, first_bytes, flag, parameters, read_input

logger = logging.getLogger("mm_llm")


class TritonPythonModel:
    def initialize(self, args):
        # tritonserver killed or crashed: take the engine's processes along (the stub alone wouldn't).
        prepare_stub(pb_utils, on_server_exit=self._kill_engine)
        model_config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(model_config):
            raise pb_utils.TritonModelException("mm_llm must be decoupled (model_transaction_policy)")
        params = parameters(model_config)
        health = HealthConfig(
            check_interval_s=float(params.get("engine_check_interval_s", HealthConfig.check_interval_s)),
            stall_timeout_s=float(params.get("engine_stall_timeout_s", HealthConfig.stall_timeout_s)),
        )
        self.model_name = args["model_name"]
        self.operator_key = operator.key_from_environment()  # the drain's (None: no drain at all)
        config = LLMConfig.from_file(os.path.join(args["model_repository"], "model.json"))
        self.metrics = TritonMetrics(
            pb_utils,
            {"model": args["model_name"], "version": args["model_version"]},
            inter_token_latency=flag(params, "report_inter_token_latency"),
            adapters=tuple(config.adapters.by_name),
        )
        stat_logger = functools.partial(TritonStatLogger, metrics=self.metrics, on_record=self._progress)
        flush_ms = float(params.get("stream_flush_ms", STREAM_FLUSH_MS))
        self.service = LLMService.start(
            config, stat_loggers=[stat_logger], health=health, on_failure=self._unload, stream_flush_ms=flush_ms
        )
        self.family = self.service.family
        vllm_seam.cache_vllm_envs()
        freeze_startup_heap()
        arm_deadman_switch()

    def _kill_engine(self):
        service = getattr(self, "service", None)
        if service is not None:
            service.runner.kill()

    def _progress(self):
        service = getattr(self, "service", None)
        if service is not None:
            service.note_progress()

    def _unload(self, reason):
        """After an engine failure: Triton unloads this model (readiness false); the keeper beside
        the server loads it back with a new engine (mmserve.serving.keeper)."""
        if server_gone():  # the call would never return (and hold the GIL meanwhile)
            return
        try:
            pb_utils.unload_model(self.model_name)
            logger.warning("unloading %s after an engine failure (%s)", self.model_name, reason)
        except Exception as exc:  # noqa: BLE001 - e.g. --model-control-mode none: no self-healing
            logger.error(
                "could not unload %s (%s): it answers UNAVAILABLE until tritonserver restarts; "
                "self-healing needs --model-control-mode=explicit",
                self.model_name,
                exc,
            )

    def execute(self, requests):
        for request in requests:
            sink = TritonSink(pb_utils, request)
            get = functools.partial(read_input, pb_utils, request)
            try:
                client_id = request_id_of(request.request_id())
                if (cancel := first_bytes(get("cancel"), "cancel")) is not None:
                    key = first_bytes(get("cancel_key"), "cancel_key")
                    if key is None:
                        raise InputError("cancel: expected the cancel_key the request was sent with (cancel_key)")
                    self.service.cancel(owner_of(cancel.decode("utf-8", "replace"), key))
                    sink.send_final()
                    continue
                if (drain := get("drain")) is not None and drain.size:
                    if not operator.is_operator(self.operator_key, first_bytes(get("operator_key"), "operator_key")):
                        raise InputError("drain: refused: the operator's key (operator_key) is missing or wrong")
                    threading.Thread(
                        target=self._drain, args=(float(drain.reshape(-1)[0]), sink), name="mm_llm-drain", daemon=True
                    ).start()
                    continue
                if (update := first_bytes(get("lora_adapters"), "lora_adapters")) is not None:
                    if not operator.is_operator(self.operator_key, first_bytes(get("operator_key"), "operator_key")):
                        raise InputError(
                            "lora_adapters: refused: the operator's key (operator_key) is missing or wrong"
                        )
                    entries = parse_update(self.service.adapters, update.decode("utf-8", "replace"))
                    threading.Thread(  # the engine loads the weights: execute goes on meanwhile
                        target=self._update_adapters, args=(entries, sink), name="mm_llm-lora", daemon=True
                    ).start()
                    continue
                owner = owner_of(client_id, first_bytes(get("cancel_key"), "cancel_key"))
                parsed = parse_request(
                    self.family,
                    get,
                    vocab_size=self.service.vocab_size,
                    max_model_len=self.service.max_model_len,
                    wire_decoders=self.service.wire_decoders,
                    adapters=self.service.adapters,
                )
            except Exception as exc:  # noqa: BLE001 - every failure is answered (triton_error scrubs it)
                sink.send_error(exc)
                continue
            if parsed.lora_request is not None:
                self.metrics.adapter_request(parsed.lora_request.lora_name)
            # Triton request ids need not be unique; the engine's must be.
            request_id = self.service.runner.new_request_id(client_id or "triton")
            self.service.submit(parsed, sink, request_id, owner=owner)
        return None

    def _update_adapters(self, entries, sink):
        try:
            served = self.service.update_adapters(self.service.adapters.updated(entries))
        except AdapterError as exc:
            sink.send_error(InputError(f"lora_adapters: {exc}"))
            return
        except Exception as exc:  # noqa: BLE001 - e.g. the engine failed meanwhile: answered, scrubbed
            sink.send_error(exc)
            return
        self.metrics.add_adapters(tuple(served.by_name))
        logger.info("LoRA adapters served now: %s", sorted(served.by_name))
        text = json.dumps(served.listing()).encode()
        sink.send({"text_output": np.array([text], dtype=np.object_)}, final=True)

    def _drain(self, grace_s, sink):
        logger.info("draining: %d request(s) in flight get %.1f s", self.service.in_flight(), grace_s)
        ended = self.service.drain(grace_s)
        logger.info("drained: %d request(s) ended UNAVAILABLE after the %.1f-s grace period", ended, grace_s)
        # A request the drain did not end (none should be left) would hold the model loaded.
        if unanswered := TritonSink.end_unfinished(UnavailableError(STOPPING), but=sink):
            logger.error("drained: %d request(s) had no final response; each was sent UNAVAILABLE", unanswered)
        sink.send_final()

    def finalize(self):
        self.service.shutdown()  # requests still in flight are answered; then no stats arrive
        if TritonSink.unfinished():
            logger.error("stopping with %d request(s) without a final response", TritonSink.unfinished())
        self.metrics.close()
        finish_stub()
