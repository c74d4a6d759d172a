"""Every workaround for a Triton Inference Server release, in one list.

The tests and ``scripts/serve.sh`` run ``TRITON_TESTED`` (the CPU ``tritonserver`` binary of
nvidia-pytriton 0.7.0); the image (``Dockerfile``) runs ``TRITON_IMAGE`` (NGC 25.10). Each
``Workaround`` below says what the tested release does wrong, what mmserve does about it, which
files carry it (each names its key), why it is harmless where the release is fixed, and the release
that ends it. None has been re-measured on a later release yet: ``ends`` says so, and dropping one
means running ``tests/test_faults.py`` and ``bench/stops.py`` on that release first
(docs/RELIABILITY.md). ``tests/test_triton_seam.py`` checks that every note about a Triton release
in ``src/`` and ``model_repository/`` is in a file listed here and that the tested server is
``TRITON_TESTED``.

A server's release is read once, at its start (``mmserve_dev.triton.TritonServer.version``, from
``/v2``), and ``active(release)`` says which workarounds it needs: those not ``fixed_in`` a release
at or before it. The launcher prints them at every start, and applies the ones it carries (the
connection cut of HELD_STREAMS) only where they are active; the rest cost nothing where the bug is
gone (``harmless``) and stay on.
"""

from __future__ import annotations

from dataclasses import dataclass

TRITON_TESTED = "2.51.0"
"""The tritonserver release the tests run (its ``/v2`` metadata ``version``)."""

TRITON_IMAGE = "2.62.0"
"""The tritonserver release of the image's base, ``nvcr.io/nvidia/tritonserver:25.10-py3``."""

UNVERIFIED = "not known: not re-measured on a release after " + TRITON_TESTED


@dataclass(frozen=True)
class Workaround:
    key: str
    bug: str
    """What ``TRITON_TESTED`` does wrong (measured)."""
    fix: str
    """What mmserve does about it."""
    where: tuple[str, ...]
    """The files that carry it, relative to the repository; each names ``key``."""
    harmless: str
    """Why it costs nothing (or what it costs) on a release without the bug."""
    ends: str = UNVERIFIED
    fixed_in: str | None = None
    """The first release without the bug, where that was established (measured, or read in its
    source); None: none known."""


def release(version: str) -> tuple[int, ...]:
    """``"2.51.0"`` -> ``(2, 51, 0)`` (what follows the numbers, like ``dev``, is ignored)."""
    parts = []
    for part in version.split("."):
        digits = "".join(c for c in part if c.isdigit()) if part[:1].isdigit() else ""
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def active(version: str) -> tuple[Workaround, ...]:
    """The workarounds a server of release ``version`` needs."""
    current = release(version)
    return tuple(w for w in WORKAROUNDS if w.fixed_in is None or current < release(w.fixed_in))


WORKAROUNDS = (
    Workaround(
        "ERROR_CODE_TAG",
        "the error code of a decoupled model's response is lost: gRPC stream responses carry only the "
        "message, the HTTP generate endpoints answer 400 for every model error",
        "every error message starts with its code, '[UNAVAILABLE] ...'; clients read it back (mmserve.wire.code_of)",
        (
            "src/mmserve/wire.py",
            "src/mmserve/serving/triton.py",
            "src/mmserve/client.py",
            "src/mmserve/gateway/errors.py",
        ),
        "the code still travels as Triton's status where a release carries it; the tag is a prefix of the "
        "message and is read the same way",
        "HTTP: 2.52 maps model error codes to statuses (HttpCodeFromError); gRPC stream responses: " + UNVERIFIED,
    ),
    Workaround(
        "NO_POLL_AFTER_FINAL",
        "is_cancelled() on a request whose final response was sent crashes tritonserver (SIGSEGV in "
        "TRITONBACKEND_ResponseFactoryIsCancelled)",
        "TritonSink never asks a finished request; its final send and every poll hold one lock",
        ("src/mmserve/serving/triton.py",),
        "one uncontended lock per send and per poll",
    ),
    Workaround(
        "NO_UNLOAD_WHILE_FINALIZING",
        "a stub that calls unload_model while its model is being finalized crashes tritonserver",
        "LLMService calls on_failure (mm_llm: unload_model) only before its shutdown began, and its "
        "shutdown waits for a call in progress",
        ("src/mmserve/serving/llm.py",),
        "a stop waits for an unload already under way (it takes milliseconds)",
    ),
    Workaround(
        "KEEPER_OUTSIDE_THE_SERVER",
        "a Python model can say 'not ready' only by unloading itself, and it cannot load a model back: a "
        "stub that loads a model after its own unload corrupts its heap; one that polls is_model_ready "
        "beside its requests crashes tritonserver (boost::interprocess::lock_exception)",
        "a failed mm_llm unloads itself; mmserve.serving.keeper, a client of the HTTP repository API "
        "beside the server, loads it (and mm_ensemble) back",
        ("src/mmserve/serving/keeper.py",),
        "a sidecar that polls the repository index every second; it is how a fault heals on any release",
    ),
    Workaround(
        "CANCEL_CONTROL_INPUT",
        "the ensemble scheduler does not cancel a running step of a cancelled ensemble request, and a "
        "request cancelled mid-step can stay counted in flight (its model then never unloads)",
        "clients cancel on the engine: a control request with the 'cancel' input to mm_llm on the same "
        "stream; the gRPC stream's own cancel only if the request's end does not follow in time",
        ("src/mmserve/client.py", "src/mmserve/gateway/triton.py", "model_repository/mm_llm/config.pbtxt"),
        "one small extra request per cancel; the engine request stops at once either way",
    ),
    Workaround(
        "STREAM_HALF_CLOSE",
        "a gRPC stream keeps the first request sent on it, and so that request's model, until the stream "
        "ends; cancelling a stream whose requests have ended can leak that request for good (fixed in "
        "2.57, server#8078); either way the model never unloads and a stop runs into the exit timeout "
        "(exit code 1): measured, 5 stops of 5 with a client's stream left open, 1 CI run in 4 with "
        "mmserve.drain's stream cancelled after its answer",
        "a stream whose requests have all ended is half-closed (the client's end of the call), never "
        "cancelled, and mmserve.drain closes its stream before the server is signalled; the gateway's "
        "long-lived streams are half-closed at its stop, which comes before the server's",
        ("src/mmserve/drain.py", "src/mmserve/client.py", "src/mmserve/gateway/triton.py"),
        "a half-close is how a gRPC stream normally ends",
        "the cancellation leak: 2.57 (server#8078); a stream's hold on its first request: HELD_STREAMS",
    ),
    Workaround(
        "HELD_STREAMS",
        "a gRPC stream keeps its first request, and so that request's model, until the stream ends, "
        "whatever the request was (one Triton itself refused included): a client that keeps a stream "
        "open keeps the model from unloading. A failed mm_llm then stays UNLOADING and the keeper "
        "never healed it (measured: not ready 184 s and counting); and tritonserver, which ends gRPC "
        "connections only after the models' unload (2.51; 2.58 and later wait for them within the "
        "same exit timeout), runs into its exit timeout at a stop (exit code 1). Worse on 2.51: a "
        "stream whose first request Triton refused (a wrong dtype) and which is then cancelled (not "
        "half-closed: a client that disconnects) holds its model for good (measured; 2.57 reworked "
        "the stream's cancellation, server#8078: whether that ends it is not measured)",
        "the keeper loads a model that stays UNLOADING past pinned_unload_s anyway (Triton then loads "
        "a new instance beside the held one); the launcher's stop, once the drain has ended every "
        "request, shuts down the client connections tritonserver still holds (pidfd_getfd, as its "
        "parent)",
        (
            "src/mmserve/serving/keeper.py",
            "tools/mmserve_dev/triton/connections.py",
            "tools/mmserve_dev/triton/process.py",
        ),
        "a load only after 10 s of UNLOADING; connections ended only when a stop is 2 s old and "
        "nothing is in flight any more. Left on 2.51: the stop after a refused request's stream was "
        "cancelled ends at the exit timeout with exit code 1 (every process and file still removed)",
        "not fixed in 2.69 (read in its source: the stream's first state keeps its request until "
        "the stream ends); servers run without the launcher (the GPU image) keep Triton's stop",
    ),
    Workaround(
        "HTTP_FRONT_GUARD",
        "the HTTP frontend predates 25.07's fixes (CVE-2025-23310/23311): one request with a chunked "
        "body of 600,000 one-byte chunks, or JSON nested 100,000 deep, kills tritonserver (measured); "
        "a Content-Length is a memory reservation",
        "the CPU launcher binds tritonserver's HTTP endpoint to 127.0.0.1 and puts a front on the HTTP "
        "port that refuses chunked and compressed bodies, oversized heads and bodies and deep JSON "
        "before a byte reaches Triton, and relays the rest byte for byte",
        ("tools/mmserve_dev/triton/http_guard.py", "tools/mmserve_dev/triton/process.py"),
        "a relay in the launcher's process: about 15-25 us of CPU per streamed event, 70-120 us per "
        "small request (measured); Triton sees every HTTP client as 127.0.0.1",
        "2.59 (Triton 25.07's security bulletin); the GPU image (2.62) runs without it",
        fixed_in="2.59.0",
    ),
    Workaround(
        "SHARED_METRIC_FAMILIES",
        "a metric family (and a metric of the same labels) is shared by every instance of a model, "
        "and one instance's destructor deletes it for all: when a new instance loads while the old "
        "one still unloads (the keeper's load beside an instance a client holds: HELD_STREAMS; any "
        "reload), the old one's finalize broke the new one (measured: tritonserver aborted, or the new "
        "instance's responses hung and the stop ran into its exit timeout)",
        "the stubs never delete their metric families and metrics (an extra reference for the "
        "process's life: mmserve.serving.embedded.never_free)",
        ("src/mmserve/serving/embedded.py", "src/mmserve/serving/metrics.py", "src/mmserve/serving/encode.py"),
        "a few objects per model instance kept until its stub exits; the series stay on /metrics",
    ),
    Workaround(
        "READ_STREAM_TO_END",
        "closing a stream whose request Triton is completing crashes tritonserver",
        "the gateway reads a finished request's stream to its end (the empty final response) before it closes it",
        ("src/mmserve/gateway/app.py",),
        "one more response read per request, sent by Triton anyway",
    ),
    Workaround(
        "STUB_EXITS_WITH_SERVER",
        "a stub notices its server's death late or never (one ran 40 s after tritonserver's SIGKILL), "
        "and the engine processes it started run on with it",
        "a thread in mm_llm's stub polls its parent; once re-parented it kills the engine, removes its "
        "shared memory and exits",
        ("src/mmserve/serving/embedded.py",),
        "a getppid() per second",
    ),
    Workaround(
        "FREE_SENDERS_BEFORE_EXIT",
        "a response sender freed at the stub's interpreter exit crashes the stub",
        "finish_stub collects garbage at the end of finalize, while the stub can still free senders",
        ("src/mmserve/serving/embedded.py",),
        "one garbage collection per model unload",
    ),
    Workaround(
        "ENSEMBLE_TEXT_INPUT_OPTIONAL",
        "an ensemble request without a required input gets an empty success",
        "mm_ensemble marks text_input optional; preprocess answers '[INVALID_ARG] text_input: required'",
        ("model_repository/mm_ensemble/config.pbtxt",),
        "preprocess checks it on every release",
    ),
    Workaround(
        "NUMPY2_STUB",
        "the Python-backend stubs in the nvidia-pytriton 0.7.0 wheel are built with a pybind11 older "
        "than 2.12, which misreads dtype sizes under NumPy 2 (which vLLM needs)",
        "the CPU launcher installs a patched NumPy C-API table in its copy of the Python backend "
        "(development tooling only)",
        ("tools/mmserve_dev/triton/numpy2_compat.py",),
        "under NumPy 1 it does nothing; NGC's images build their stubs with a newer pybind11 and never "
        "load it (the image does not use the launcher)",
        "not needed by NGC's images (the Dockerfile's base); needed by every nvidia-pytriton wheel tested (0.7.0)",
    ),
)
"""Every Triton-release workaround of the project (``tests/test_triton_seam.py``)."""
