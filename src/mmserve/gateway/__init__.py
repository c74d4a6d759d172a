"""An OpenAI-compatible chat API in front of the Triton models: ``/v1/chat/completions`` (streamed or
not; text, image and audio parts), ``/v1/models``, ``/health``.

Run it beside tritonserver (``scripts/serve.sh`` does) or against any Triton gRPC endpoint::

    python -m mmserve.gateway --triton-url 127.0.0.1:8001 --host 127.0.0.1 --port 9000

Modules: ``protocol`` (the request's pydantic models, what is accepted and refused), ``convert``
(request -> the Triton tensors, the ``messages`` conversation; logprobs back), ``media`` (remote
images, when allowed), ``triton`` (one shared gRPC stream for every request, responses told apart by id),
``errors`` (OpenAI's error shape and statuses), ``app`` (the FastAPI app), ``__main__`` (the CLI).
Importing it loads no web framework: ``create_app`` and ``GatewayConfig`` come from ``app``.
"""
