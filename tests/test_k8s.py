"""deploy/k8s (a kustomize base) and deploy/overlays: rendered with `kubectl kustomize`,
every object validated offline against the Kubernetes schemas (kubernetes-validate,
strict: unknown fields fail) and the ScaledObjects against KEDA's CRD schema (vendored
in tests/schemas); then what the manifests promise is checked against gpulane itself:
probes, GPU request and grace periods against the settings, KEDA's lists against the
queue keys, the preStop hook against a real worker, the API's probe paths against a
real API whose Redis is down."""

from __future__ import annotations

import copy
import os
import re
import shutil
import signal
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock
from urllib.parse import urlsplit

import httpx
import jsonschema
import kubernetes_validate  # type: ignore[import-untyped,unused-ignore]
import pytest
import yaml
from conftest import WorkerFactory, submit, wait_status

from dispatcher.contract import keys
from dispatcher.contract.settings import Settings
from testkit import ApiServer, free_port

ROOT = Path(__file__).resolve().parents[1]
BASE = ROOT / "deploy" / "k8s"
OVERLAYS = sorted((ROOT / "deploy" / "overlays").iterdir())
KEDA_CRD = Path(__file__).parent / "schemas" / "keda.sh_scaledobjects.yaml"
# The oldest Kubernetes the manifests are meant for, and the newest schema bundled.
K8S_VERSIONS = ("1.30", kubernetes_validate.latest_version())
# What a worker needs after the grace period before the kubelet's SIGKILL: hand the
# task back, stop the heartbeat thread (joined for up to 5 s), release the GPU claim and
# unregister (Redis calls with a 10 s socket timeout).
EXIT_MARGIN_S = 10.0

Obj = dict[str, Any]

# Trigger metadata KEDA v2.20.2 reads (pkg/scalers/redis_scaler.go,
# pkg/scalers/metrics_api_scaler.go, pkg/scalers/authentication): the CRD types
# `metadata` as a free map of strings, so a misspelt key would pass it and be ignored.
TRIGGER_KEYS = {
    "redis": {
        "address", "addresses", "host", "hosts", "port", "ports", "username", "password",
        "sentinelUsername", "sentinelPassword", "sentinelMaster", "unsafeSsl", "listLength",
        "activationListLength", "listName", "databaseIndex", "enableTLS",
    },
    "metrics-api": {
        "targetValue", "activationTargetValue", "url", "format", "valueLocation", "unsafeSsl",
        "aggregateFromKubeServiceEndpoints", "aggregationType", "timeout", "authMode",
        "authModes", "apiKey", "method", "keyParamName",
    },
}  # fmt: skip
# Keys the redis scaler also takes as `<key>FromEnv` (the target container's variable).
REDIS_FROM_ENV = {"address", "addresses", "host", "hosts", "port", "ports", "username",
                  "password", "sentinelUsername", "sentinelPassword", "sentinelMaster"}  # fmt: skip


def render(path: Path) -> list[Obj]:
    kubectl = shutil.which("kubectl")
    assert kubectl, "kubectl (with its built-in kustomize v5) is needed to render deploy/k8s"
    result = subprocess.run(
        [kubectl, "kustomize", str(path)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


@pytest.fixture(scope="module")
def base() -> list[Obj]:
    return render(BASE)


@pytest.fixture(scope="module", params=[BASE, *OVERLAYS], ids=lambda p: p.name)
def rendered(request: pytest.FixtureRequest) -> list[Obj]:
    return render(request.param)


def objects(objs: list[Obj], kind: str) -> list[Obj]:
    return [o for o in objs if o["kind"] == kind]


def one(objs: list[Obj], kind: str, name: str) -> Obj:
    [found] = [o for o in objects(objs, kind) if o["metadata"]["name"] == name]
    return found


def container(workload: Obj) -> Obj:
    [only] = workload["spec"]["template"]["spec"]["containers"]
    c: Obj = only
    return c


def workers(objs: list[Obj]) -> dict[str, Obj]:
    """Worker Deployments by the class their `--classes` names."""
    out = {}
    for deployment in objects(objs, "Deployment"):
        command = container(deployment)["command"]
        if command[:2] == ["gpulane", "worker"]:
            [cls] = command[command.index("--classes") + 1].split(",")
            out[cls] = deployment
    return out


def settings_of(objs: list[Obj], c: Obj) -> Settings:
    """The settings a container runs with: defaults, then its ConfigMap, then its env
    (as the pod gets them; a Secret created by the operator is not rendered)."""
    env: dict[str, str] = {}
    for source in c.get("envFrom", []):
        if "configMapRef" in source:
            env.update(one(objs, "ConfigMap", source["configMapRef"]["name"])["data"])
    env.update({var["name"]: var["value"] for var in c.get("env", []) if "value" in var})
    clean = {k: v for k, v in os.environ.items() if not k.startswith("GPULANE_")}
    with mock.patch.dict(os.environ, {**clean, **env}, clear=True):
        return Settings()


# --- schemas -------------------------------------------------------------------------


def test_base_renders_what_the_issue_asks_for(base: list[Obj]) -> None:
    kinds = sorted(o["kind"] for o in base)
    assert kinds == sorted(
        ["Namespace", "ConfigMap", "Service", "Service", "Service", "Deployment", "Deployment",
         "Deployment", "StatefulSet", "PodDisruptionBudget", "ScaledObject", "ScaledObject"]
    )  # fmt: skip
    namespaced = [o for o in base if o["kind"] != "Namespace"]
    assert {o["metadata"]["namespace"] for o in namespaced} == {"gpulane"}


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_object_validates_against_the_kubernetes_schema(
    rendered: list[Obj], version: str
) -> None:
    for obj in rendered:
        if obj["apiVersion"].startswith("keda.sh/"):
            continue  # a CRD: checked against KEDA's schema below
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            where = ".".join(str(p) for p in exc.path)
            pytest.fail(f"{obj['kind']}/{obj['metadata']['name']}: {where}: {exc.message}")


def test_the_kubernetes_validation_catches_mistakes(base: list[Obj]) -> None:
    """The check above can fail: a misspelt field and a wrong type are refused."""
    deployment = workers(base)["batch"]
    misspelt = copy.deepcopy(deployment)
    container(misspelt)["livenesProbe"] = container(misspelt).pop("livenessProbe")
    wrong_type = copy.deepcopy(deployment)
    wrong_type["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = "660"
    for bad in (misspelt, wrong_type):
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(bad, K8S_VERSIONS[0], strict=True)


def _no_unknown_fields(schema: Any) -> Any:
    """The CRD's schema with unknown fields refused, as `kubectl apply` with strict field
    validation does (an OpenAPI structural schema prunes them silently otherwise)."""
    if isinstance(schema, list):
        return [_no_unknown_fields(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _no_unknown_fields(v) for k, v in schema.items()}
    if (
        "properties" in out
        and "additionalProperties" not in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


@pytest.fixture(scope="module")
def keda_schema() -> jsonschema.Draft7Validator:
    crd = yaml.safe_load(KEDA_CRD.read_text())
    assert crd["spec"]["names"]["kind"] == "ScaledObject"
    [version] = [v for v in crd["spec"]["versions"] if v["name"] == "v1alpha1"]
    schema = _no_unknown_fields(version["schema"]["openAPIV3Schema"])
    jsonschema.Draft7Validator.check_schema(schema)
    return jsonschema.Draft7Validator(schema)


def test_scaled_objects_validate_against_kedas_crd(
    rendered: list[Obj], keda_schema: jsonschema.Draft7Validator
) -> None:
    scaled = objects(rendered, "ScaledObject")
    assert scaled
    for obj in scaled:
        assert obj["apiVersion"] == "keda.sh/v1alpha1"
        errors = [f"{e.json_path}: {e.message}" for e in keda_schema.iter_errors(obj)]
        assert not errors, f"{obj['metadata']['name']}: {errors}"
        for trigger in obj["spec"]["triggers"]:
            known = TRIGGER_KEYS[trigger["type"]]
            for key in trigger["metadata"]:
                base_key = key.removesuffix("FromEnv")
                ok = key in known or (key.endswith("FromEnv") and base_key in REDIS_FROM_ENV)
                assert ok, f"{obj['metadata']['name']}: KEDA's {trigger['type']} has no {key!r}"


def test_the_keda_validation_catches_mistakes(
    base: list[Obj], keda_schema: jsonschema.Draft7Validator
) -> None:
    good = objects(base, "ScaledObject")[0]
    wrong_type = copy.deepcopy(good)
    wrong_type["spec"]["minReplicaCount"] = "zero"
    unknown = copy.deepcopy(good)
    unknown["spec"]["minReplicas"] = 0
    no_target = copy.deepcopy(good)
    del no_target["spec"]["scaleTargetRef"]
    for bad in (wrong_type, unknown, no_target):
        assert list(keda_schema.iter_errors(bad))


# --- what the manifests promise, checked against gpulane ------------------------------


def test_selectors_match_their_pods(rendered: list[Obj]) -> None:
    pods = {
        o["metadata"]["name"]: o["spec"]["template"]["metadata"]["labels"]
        for o in rendered
        if o["kind"] in ("Deployment", "StatefulSet")
    }
    for workload in (o for o in rendered if o["kind"] in ("Deployment", "StatefulSet")):
        selector = workload["spec"]["selector"]["matchLabels"]
        assert selector.items() <= pods[workload["metadata"]["name"]].items()
    for obj in objects(rendered, "Service") + objects(rendered, "PodDisruptionBudget"):
        selector = obj["spec"]["selector"]
        selector = selector.get("matchLabels", selector)
        matched = [name for name, labels in pods.items() if selector.items() <= labels.items()]
        assert matched, f"{obj['kind']}/{obj['metadata']['name']} selects no pods"


def test_every_container_requests_resources(rendered: list[Obj]) -> None:
    for workload in (o for o in rendered if o["kind"] in ("Deployment", "StatefulSet")):
        for c in workload["spec"]["template"]["spec"]["containers"]:
            requests = c["resources"]["requests"]
            assert {"cpu", "memory"} <= set(requests), workload["metadata"]["name"]
            assert "memory" in c["resources"]["limits"], workload["metadata"]["name"]


def test_api_deployment_service_and_budget(base: list[Obj]) -> None:
    api = one(base, "Deployment", "gpulane-api")
    assert api["spec"]["replicas"] == 2
    c = container(api)
    assert c["command"][:2] == ["gpulane", "api"]
    assert c["command"][c["command"].index("--host") + 1] == "0.0.0.0"
    port = int(c["command"][c["command"].index("--port") + 1])
    [http] = c["ports"]
    assert http["containerPort"] == port
    assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": http["name"]}
    assert c["livenessProbe"]["httpGet"]["port"] == http["name"]
    service = one(base, "Service", "gpulane-api")
    assert service["spec"]["ports"][0]["targetPort"] == http["name"]
    budget = one(base, "PodDisruptionBudget", "gpulane-api")
    assert 1 <= budget["spec"]["minAvailable"] < api["spec"]["replicas"]


def test_api_probe_paths_on_a_real_api_whose_redis_is_down(base: list[Obj]) -> None:
    """Readiness (/health) fails while Redis is down, so no traffic goes to a replica that
    cannot serve; liveness still passes, so Kubernetes does not restart every API pod
    for a Redis outage."""
    c = container(one(base, "Deployment", "gpulane-api"))
    nowhere = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    server = ApiServer(Settings(redis_url=nowhere, heartbeat_interval_s=0.2, lease_ttl_s=1.0))
    server.start()
    try:
        with httpx.Client(base_url=server.url, timeout=10) as client:
            assert client.get(c["readinessProbe"]["httpGet"]["path"]).status_code == 503
            assert client.get(c["livenessProbe"]["httpGet"]["path"]).status_code == 200
    finally:
        server.stop()


def test_redis_keeps_tasks(base: list[Obj]) -> None:
    redis = one(base, "StatefulSet", "gpulane-redis")
    c = container(redis)
    args = c["args"]
    flags = dict(zip(args[::2], args[1::2], strict=True))
    assert flags["--appendonly"] == "yes"
    assert flags["--maxmemory-policy"] == "noeviction"
    [claim] = redis["spec"]["volumeClaimTemplates"]
    [mount] = [m for m in c["volumeMounts"] if m["name"] == claim["metadata"]["name"]]
    assert mount["mountPath"] == flags["--dir"]
    # The API and workers reach it by the Service in the settings.
    url = urlsplit(one(base, "ConfigMap", _configmap_name(base))["data"]["GPULANE_REDIS_URL"])
    service = one(base, "Service", str(url.hostname))
    assert service["spec"]["ports"][0]["port"] == url.port == c["ports"][0]["containerPort"]


def _configmap_name(objs: list[Obj]) -> str:
    [configmap] = objects(objs, "ConfigMap")
    name: str = configmap["metadata"]["name"]
    return name


def test_a_worker_deployment_per_class_on_one_gpu(rendered: list[Obj]) -> None:
    by_class = workers(rendered)
    settings = settings_of(rendered, container(next(iter(by_class.values()))))
    assert sorted(by_class) == sorted(settings.class_names)
    for deployment in by_class.values():
        assert "replicas" not in deployment["spec"]  # KEDA owns the count
        c = container(deployment)
        assert c["command"][c["command"].index("--gpu") + 1] == "auto"
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert c["resources"]["requests"]["nvidia.com/gpu"] == 1
        # Replace, not surge: a new pod could only wait for the old pod's GPU.
        assert deployment["spec"]["strategy"]["rollingUpdate"]["maxSurge"] == 0


def test_worker_probes_follow_the_settings(rendered: list[Obj]) -> None:
    for cls, deployment in workers(rendered).items():
        c = container(deployment)
        settings = settings_of(rendered, c)
        pod = deployment["spec"]["template"]["spec"]
        # The health file the probes read lies on a volume of the pod.
        assert settings.health_file is not None, cls
        [volume] = [
            v
            for v in pod["volumes"]
            for m in c["volumeMounts"]
            if m["name"] == v["name"] and Path(m["mountPath"]) == settings.health_file.parent
        ]
        assert "emptyDir" in volume
        probe = ["python", "-m", "worker.probe"]
        assert c["startupProbe"]["exec"]["command"] == [*probe, "live"]
        assert c["livenessProbe"]["exec"]["command"] == [*probe, "live"]
        assert c["readinessProbe"]["exec"]["command"] == [*probe, "ready"]
        for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
            # Python starts within the timeout; a probe is never more frequent than beats.
            assert c[kind]["timeoutSeconds"] >= 2
            assert c[kind]["periodSeconds"] >= settings.heartbeat_interval_s
        # At start a worker waits out a lease its name still holds (a restarted
        # container keeps its pod's name) for two lease periods before it beats.
        startup = c["startupProbe"]
        assert startup["periodSeconds"] * startup["failureThreshold"] > 2 * settings.lease_ttl_s
        # Liveness restarts only after several stale checks, each one already more than
        # one lease (3 beats) late: never for one slow beat.
        assert c["livenessProbe"]["failureThreshold"] >= 2


def test_worker_grace_period_covers_the_shutdown_grace(rendered: list[Obj]) -> None:
    for cls, deployment in workers(rendered).items():
        c = container(deployment)
        settings = settings_of(rendered, c)
        grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        assert grace >= settings.shutdown_grace_s + EXIT_MARGIN_S, (cls, grace)
    # Batch tasks may finish their default run time when their pod is scaled away.
    batch = settings_of(rendered, container(workers(rendered)["batch"]))
    assert batch.shutdown_grace_s >= batch.default_timeout_s


def _prestop(deployment: Obj) -> str:
    command = container(deployment)["lifecycle"]["preStop"]["exec"]["command"]
    assert command[:2] == ["sh", "-c"]
    script: str = command[2]
    return script


def test_worker_prestop_signals_the_worker_itself(base: list[Obj]) -> None:
    for deployment in workers(base).values():
        # Exec form: PID 1 is the worker, not a shell that would swallow the signal.
        assert container(deployment)["command"][0] == "gpulane"
        script = _prestop(deployment)
        assert re.search(r"\bkill -TERM 1\b", script)
        assert re.search(r"while kill -0 1\b", script)  # returns only once PID 1 is gone


def test_worker_prestop_lets_the_running_task_finish(
    base: list[Obj], known_types: None, http: httpx.Client, start_worker: WorkerFactory
) -> None:
    """The hook as Kubernetes runs it, aimed at a real worker instead of PID 1: one
    SIGTERM, and the hook waits, so the running task finishes instead of being handed
    back (a hook that returned at once would let the kubelet's own SIGTERM follow, a
    second signal: hand the task back now)."""
    worker = start_worker()
    task = submit(http, "sleep", {"seconds": 1.5})
    wait_status(http, task["id"], {"running"})
    script, n = re.subn(r"\b(kill -\w+) 1\b", rf"\1 {worker.pid}", _prestop(workers(base)["batch"]))
    assert n == 2
    reaper = threading.Thread(target=worker.process.wait)  # no zombie for `kill -0`
    reaper.start()
    hook = subprocess.run(["sh", "-c", script], capture_output=True, text=True, timeout=30)
    assert hook.returncode == 0, hook.stderr
    if worker.alive():  # what the kubelet does once the hook returns
        worker.process.send_signal(signal.SIGTERM)
    reaper.join(15)
    assert worker.process.returncode == 0, worker.output()
    record = wait_status(http, task["id"], {"succeeded", "failed", "queued"})
    assert record["status"] == "succeeded", record
    assert record["attempts"] == 1


def _scaled(objs: list[Obj]) -> Iterator[tuple[str, Obj, Obj]]:
    """(class, ScaledObject, its target Deployment) per worker class."""
    by_name = {d["metadata"]["name"]: (cls, d) for cls, d in workers(objs).items()}
    for scaled in objects(objs, "ScaledObject"):
        target = scaled["spec"]["scaleTargetRef"]["name"]
        assert target in by_name, f"{scaled['metadata']['name']} scales no worker Deployment"
        cls, deployment = by_name[target]
        yield cls, scaled, deployment


def test_a_scaled_object_per_class_on_its_queue(rendered: list[Obj]) -> None:
    found = list(_scaled(rendered))
    classes = [cls for cls, _, _ in found]
    assert sorted(classes) == sorted(workers(rendered))  # one each, none twice
    namespace = found[0][1]["metadata"]["namespace"]
    for cls, scaled, deployment in found:
        settings = settings_of(rendered, container(deployment))
        spec = scaled["spec"]
        # A class that refuses tasks while no worker serves it keeps one; others may
        # scale to zero and come back with the first queued task.
        minimum = 1 if settings.classes[cls].reject_without_workers else 0
        assert spec["minReplicaCount"] == minimum, cls
        assert spec["maxReplicaCount"] > minimum
        queued, running = spec["triggers"]
        assert queued["type"] == "redis"
        assert queued["metadata"]["listName"] == keys.queue(cls)
        assert int(queued["metadata"].get("activationListLength", "0")) == 0
        url = urlsplit(settings.redis_url_or_default)
        assert queued["metadata"]["databaseIndex"] == (url.path.strip("/") or "0")
        if "address" in queued["metadata"]:  # the base's own Redis, by Service and namespace
            host, port = queued["metadata"]["address"].rsplit(":", 1)
            assert host == f"{url.hostname}.{namespace}.svc"
            assert one(rendered, "Service", str(url.hostname))["spec"]["ports"][0]["port"] == int(
                port
            )
        else:  # from the worker's environment (the external Redis overlay)
            assert "addressFromEnv" in queued["metadata"]
            refs = [s for s in container(deployment)["envFrom"] if "secretRef" in s]
            assert refs, "addressFromEnv needs the variable in the worker's environment"
        # Tasks running count too: a scale-down never goes below the busy workers.
        assert running["type"] == "metrics-api"
        assert running["metadata"]["valueLocation"] == f'classes.#(name=="{cls}").running'
        api_url = urlsplit(running["metadata"]["url"])
        assert api_url.path == "/queues"
        assert api_url.hostname == f"gpulane-api.{namespace}.svc"
        api_service = one(rendered, "Service", "gpulane-api")
        assert api_url.port == api_service["spec"]["ports"][0]["port"]
