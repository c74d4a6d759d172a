"""What one call from a Python-backend model into tritonserver costs: a metric update, a streamed
response (with one or two output tensors, as ``mm_llm`` sends them), ``is_cancelled``.

``mm_llm`` makes these calls per request and per engine step; each is a blocking round trip between
the model's stub process and tritonserver, paid on both sides. This runs the real ``tritonserver``
with one decoupled Python model that, on request, makes one kind of call N times in a row and reports
its own wall and thread-CPU time per call; the benchmark adds tritonserver's CPU time per call (from
/proc, over the same interval). Run on an idle machine: nothing else is measured.

    .venv/bin/python bench/triton_calls.py [--calls 5000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import queue
import sys
import tempfile
import textwrap
from pathlib import Path

import common
import numpy as np
import psutil

ROOT = Path(__file__).resolve().parents[1]
KINDS = (
    "observe",
    "set",
    "increment",
    "build_text_ids",
    "send_text",
    "send_text_ids",
    "send_text_ids_reason",
    "send_five",
    "is_cancelled",
)

CONFIG = """\
backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [ { name: "KIND", data_type: TYPE_STRING, dims: [ 1 ] }, { name: "N", data_type: TYPE_INT64, dims: [ 1 ] } ]
output [ { name: "text_output", data_type: TYPE_STRING, dims: [ -1 ] },
         { name: "output_ids", data_type: TYPE_INT64, dims: [ -1 ] },
         { name: "finish_reason", data_type: TYPE_STRING, dims: [ -1 ] },
         { name: "num_input_tokens", data_type: TYPE_UINT32, dims: [ 1 ] },
         { name: "num_output_tokens", data_type: TYPE_UINT32, dims: [ -1 ] },
         { name: "TIMES", data_type: TYPE_FP64, dims: [ 2 ] } ]
instance_group [ { kind: KIND_CPU, count: 1 } ]
"""

MODEL = """\
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        family = pb_utils.MetricFamily
        self.families = [family(name=f"calls_{kind}", description="d", kind=getattr(family, kind.upper()))
                         for kind in ("histogram", "gauge", "counter")]
        labels = {"model": "calls"}
        self.histogram = self.families[0].Metric(labels=labels, buckets=[0.01, 0.1, 1.0])
        self.gauge = self.families[1].Metric(labels=labels)
        self.counter = self.families[2].Metric(labels=labels)

    def execute(self, requests):
        for request in requests:
            kind = pb_utils.get_input_tensor_by_name(request, "KIND").as_numpy()[0].decode()
            n = int(pb_utils.get_input_tensor_by_name(request, "N").as_numpy()[0])
            sender = request.get_response_sender()
            text = np.array(["tok".encode()], dtype=np.object_)
            ids = np.array([1234], dtype=np.int64)
            reason = np.array([b""], dtype=np.object_)
            count = np.array([1], dtype=np.uint32)
            calls = {
                "observe": lambda: self.histogram.observe(0.005),
                "set": lambda: self.gauge.set(3),
                "increment": lambda: self.counter.increment(1),
                "build_text_ids": lambda: pb_utils.InferenceResponse(
                    output_tensors=[pb_utils.Tensor("text_output", text), pb_utils.Tensor("output_ids", ids)]),
                "send_text": lambda: sender.send(pb_utils.InferenceResponse(
                    output_tensors=[pb_utils.Tensor("text_output", text)])),
                "send_text_ids": lambda: sender.send(pb_utils.InferenceResponse(
                    output_tensors=[pb_utils.Tensor("text_output", text), pb_utils.Tensor("output_ids", ids)])),
                "send_text_ids_reason": lambda: sender.send(pb_utils.InferenceResponse(
                    output_tensors=[pb_utils.Tensor("text_output", text), pb_utils.Tensor("output_ids", ids),
                                    pb_utils.Tensor("finish_reason", reason)])),
                "send_five": lambda: sender.send(pb_utils.InferenceResponse(
                    output_tensors=[pb_utils.Tensor("text_output", text), pb_utils.Tensor("output_ids", ids),
                                    pb_utils.Tensor("finish_reason", reason),
                                    pb_utils.Tensor("num_input_tokens", count),
                                    pb_utils.Tensor("num_output_tokens", count)])),
                "is_cancelled": sender.is_cancelled,
            }
            call = calls[kind]
            wall, cpu = time.perf_counter(), time.thread_time()
            for _ in range(n):
                call()
            times = np.array([(time.perf_counter() - wall) / n, (time.thread_time() - cpu) / n])
            sender.send(pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("TIMES", times)]),
                        flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
"""


def cpu_seconds(pid: int) -> float:
    return common.cpu_seconds([psutil.Process(pid)])


def measure(url: str, server_pid: int, kind: str, calls: int) -> tuple[float, float, float]:
    """(stub wall, stub CPU, tritonserver CPU) per call, in seconds."""
    import tritonclient.grpc as grpcclient

    answers: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    inputs = [grpcclient.InferInput("KIND", [1], "BYTES"), grpcclient.InferInput("N", [1], "INT64")]
    inputs[0].set_data_from_numpy(np.array([kind.encode()], dtype=np.object_))
    inputs[1].set_data_from_numpy(np.array([calls], dtype=np.int64))
    before = cpu_seconds(server_pid)
    client.async_stream_infer("calls", inputs)
    while True:
        result, error = answers.get(timeout=300)
        if error is not None:
            raise RuntimeError(str(error))
        times = result.as_numpy("TIMES")
        if times is not None:
            break
    server = (cpu_seconds(server_pid) - before) / calls
    client.stop_stream()
    client.close()
    return float(times[0]), float(times[1]), server


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=5000, help="calls per measurement")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)

    from mmserve_dev.triton import TritonServer

    with tempfile.TemporaryDirectory(prefix="mmserve-calls-") as folder:
        model = Path(folder) / "calls"
        (model / "1").mkdir(parents=True)
        (model / "config.pbtxt").write_text(CONFIG)
        (model / "1" / "model.py").write_text(MODEL)
        server = TritonServer(folder)
        server.start(timeout=120)
        pid = server.pid
        assert pid is not None  # started
        try:
            results: dict[str, list[tuple[float, float, float]]] = {kind: [] for kind in KINDS}
            measure(server.grpc_url, pid, "observe", 100)  # warm-up
            for _ in range(args.rounds):
                for kind in KINDS:
                    results[kind].append(measure(server.grpc_url, pid, kind, args.calls))
        finally:
            server.stop()

    print(
        textwrap.dedent(f"""\
        {args.calls} calls per measurement, median of {args.rounds} round(s); µs per call
        | call | stub wall | stub CPU | tritonserver CPU | CPU, both |
        |---|---:|---:|---:|---:|""")
    )
    summary = {}
    for kind, rows in results.items():
        wall, stub, triton = (float(np.median([row[i] for row in rows])) * 1e6 for i in range(3))
        summary[kind] = {"stub_wall_us": wall, "stub_cpu_us": stub, "tritonserver_cpu_us": triton}
        print(f"| {kind} | {wall:.1f} | {stub:.1f} | {triton:.1f} | {stub + triton:.1f} |")
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
