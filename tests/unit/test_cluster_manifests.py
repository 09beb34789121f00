"""The files in cluster/ are checked here, since no Kubernetes or AWS is reachable from the tests.

- KubeRay RayCluster/RayJob: every field used must exist in the CRD, with the right type, and no
  other key is allowed at the levels checked. The schema below is a hand-written subset of
  KubeRay's CRDs (ray-project/kuberay v1.7.0, ray-operator/config/crd/bases/ray.io_rayclusters.yaml
  and ray.io_rayjobs.yaml; authOptions exists from v1.5.1 on). No PyPI package ships these CRDs.
- Policy: token authentication on, the dashboard not exposed outside the cluster, a GPU worker
  group with GPU limits, enough GPUs and CPUs for the recipe the RayJob runs, which must exist
  and validate, and a run directory on the shared volume (so that a retried job resumes).
- `ray up` YAML: validated against the JSON schema Ray itself ships (ray/autoscaler/ray-schema.json).
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from k3post.cli.main import main
from k3post.config.load import load_distill_recipe
from k3post.config.schema import DistillRecipe

REPO = Path(__file__).resolve().parents[2]
CLUSTER = REPO / "cluster"
IMAGE_ROOT = "/home/ray/k3post/"  # where cluster/Dockerfile puts the repository
SHARED = "/shared/"


# --- a KubeRay CRD subset: closed objects, typed leaves ----------------------------------------

@dataclass(frozen=True)
class MapOf:
    """An object with free keys whose values all have one type (e.g. rayStartParams)."""
    value: Any


@dataclass(frozen=True)
class ListOf:
    item: Any


@dataclass(frozen=True)
class Obj:
    """A closed object: only `fields` may appear; `required` must."""
    fields: dict
    required: tuple = ()


@dataclass(frozen=True)
class OneOf:
    values: tuple


OPEN = dict        # an object whose inside this test does not check
QUANTITY = (str, int)  # Kubernetes resource quantities: "4", 16, "128Gi", "500m"

RESOURCES = Obj({"limits": MapOf(QUANTITY), "requests": MapOf(QUANTITY), "claims": list})
CONTAINER = Obj({
    "name": str, "image": str, "command": ListOf(str), "args": ListOf(str), "env": ListOf(OPEN),
    "envFrom": list, "ports": ListOf(Obj({"containerPort": int, "name": str, "protocol": str, "hostPort": int,
                                          "hostIP": str})),
    "resources": RESOURCES, "volumeMounts": ListOf(Obj({"name": str, "mountPath": str, "readOnly": bool,
                                                        "subPath": str, "mountPropagation": str,
                                                        "subPathExpr": str, "recursiveReadOnly": str})),
    "imagePullPolicy": str, "lifecycle": OPEN, "livenessProbe": OPEN, "readinessProbe": OPEN,
    "startupProbe": OPEN, "securityContext": OPEN, "workingDir": str, "resizePolicy": list,
    "restartPolicy": str, "restartPolicyRules": list, "stdin": bool, "stdinOnce": bool, "tty": bool,
    "terminationMessagePath": str, "terminationMessagePolicy": str, "volumeDevices": list,
}, required=("name",))
# A subset of PodSpec's 42 fields (the ones a Ray pod template plausibly needs).
POD_SPEC = Obj({
    "containers": ListOf(CONTAINER), "initContainers": ListOf(CONTAINER), "volumes": ListOf(OPEN),
    "tolerations": ListOf(OPEN), "nodeSelector": MapOf(str), "affinity": OPEN, "serviceAccountName": str,
    "restartPolicy": str, "terminationGracePeriodSeconds": int, "securityContext": OPEN,
    "imagePullSecrets": ListOf(OPEN), "priorityClassName": str, "schedulerName": str,
}, required=("containers",))
TEMPLATE = Obj({"metadata": OPEN, "spec": POD_SPEC}, required=("spec",))
SERVICE_TYPES = ("ClusterIP", "NodePort", "LoadBalancer", "ExternalName")
HEAD_GROUP = Obj({
    "rayStartParams": MapOf(str), "template": TEMPLATE, "serviceType": OneOf(SERVICE_TYPES),
    "headService": OPEN, "enableIngress": bool, "ingressOptions": OPEN, "labels": MapOf(str), "resources": MapOf(str),
}, required=("template",))
WORKER_GROUP = Obj({
    "groupName": str, "replicas": int, "minReplicas": int, "maxReplicas": int, "rayStartParams": MapOf(str),
    "template": TEMPLATE, "idleTimeoutSeconds": int, "numOfHosts": int, "priority": int, "scaleStrategy": OPEN,
    "suspend": bool, "labels": MapOf(str), "resources": MapOf(str),
}, required=("groupName", "maxReplicas", "minReplicas", "template"))
CLUSTER_SPEC = Obj({
    "rayVersion": str, "headGroupSpec": HEAD_GROUP, "workerGroupSpecs": ListOf(WORKER_GROUP),
    "authOptions": Obj({"mode": OneOf(("disabled", "token")), "secretName": str, "enableK8sTokenAuth": bool}),
    "enableInTreeAutoscaling": bool, "autoscalerOptions": OPEN, "gcsFaultToleranceOptions": OPEN,
    "headServiceAnnotations": MapOf(str), "suspend": bool, "managedBy": str, "networkPolicy": OPEN,
    "tlsOptions": OPEN, "upgradeStrategy": OPEN, "historyServerOptions": OPEN,
}, required=("headGroupSpec",))
JOB_SPEC = Obj({
    "entrypoint": str, "runtimeEnvYAML": str, "rayClusterSpec": CLUSTER_SPEC, "clusterSelector": MapOf(str),
    "submissionMode": OneOf(("K8sJobMode", "HTTPMode", "InteractiveMode", "SidecarMode")),
    "shutdownAfterJobFinishes": bool, "ttlSecondsAfterFinished": int, "activeDeadlineSeconds": int,
    "backoffLimit": int, "suspend": bool, "jobId": str, "metadata": MapOf(str), "entrypointNumCpus": (int, float),
    "entrypointNumGpus": (int, float), "entrypointResources": str, "submitterPodTemplate": OPEN,
    "submitterConfig": OPEN, "deletionStrategy": OPEN, "managedBy": str, "preRunningDeadlineSeconds": int,
})
METADATA = Obj({"name": str, "namespace": str, "labels": MapOf(str), "annotations": MapOf(str)}, required=("name",))
KINDS = {
    "RayCluster": Obj({"apiVersion": str, "kind": str, "metadata": METADATA, "spec": CLUSTER_SPEC},
                      required=("apiVersion", "kind", "metadata", "spec")),
    "RayJob": Obj({"apiVersion": str, "kind": str, "metadata": METADATA, "spec": JOB_SPEC},
                  required=("apiVersion", "kind", "metadata", "spec")),
}
# Ray's RuntimeEnv fields (2.60).
RUNTIME_ENV_FIELDS = {"working_dir", "py_modules", "py_executable", "pip", "uv", "conda", "container", "image_uri",
                      "excludes", "env_vars", "java_jars", "config", "worker_process_setup_hook"}


def schema_errors(node: Any, schema: Any, path: str = "") -> list[str]:
    """Every place where `node` does not fit `schema`, as 'path: problem'."""
    if isinstance(schema, Obj):
        if not isinstance(node, dict):
            return [f"{path}: expected an object, got {type(node).__name__}"]
        errors = [f"{path}.{k}: unknown key" for k in node if k not in schema.fields]
        errors += [f"{path}.{k}: missing" for k in schema.required if k not in node]
        for key, value in node.items():
            if key in schema.fields:
                errors += schema_errors(value, schema.fields[key], f"{path}.{key}")
        return errors
    if isinstance(schema, MapOf):
        if not isinstance(node, dict):
            return [f"{path}: expected a map, got {type(node).__name__}"]
        return [e for k, v in node.items() for e in schema_errors(v, schema.value, f"{path}.{k}")]
    if isinstance(schema, ListOf):
        if not isinstance(node, list):
            return [f"{path}: expected a list, got {type(node).__name__}"]
        return [e for i, v in enumerate(node) for e in schema_errors(v, schema.item, f"{path}[{i}]")]
    if isinstance(schema, OneOf):
        return [] if node in schema.values else [f"{path}: {node!r} is not one of {schema.values}"]
    types = schema if isinstance(schema, tuple) else (schema,)
    # YAML booleans are not integers here, as in Kubernetes.
    if isinstance(node, bool) and bool not in types or not isinstance(node, types):
        return [f"{path}: expected {' or '.join(t.__name__ for t in types)}, got {type(node).__name__} {node!r}"]
    return []


def test_the_schema_checker_rejects_what_kubernetes_would():
    bad = {"apiVersion": "ray.io/v1", "kind": "RayCluster", "metadata": {"name": "x"},
           "spec": {"headGroupSpec": {"rayStartParams": {"num-cpus": 0}, "templat": {},
                                      "serviceType": "Public"},
                    "workerGroupSpecs": [{"groupName": "g", "replicas": "1", "minReplicas": 0, "maxReplicas": 1,
                                          "template": {"spec": {"containers": [{"image": "i"}]}}}]}}
    errors = "\n".join(schema_errors(bad, KINDS["RayCluster"]))
    for expected in (".spec.headGroupSpec.rayStartParams.num-cpus: expected str", ".spec.headGroupSpec.templat: "
                     "unknown key", ".spec.headGroupSpec.template: missing", "serviceType: 'Public' is not one of",
                     ".spec.workerGroupSpecs[0].replicas: expected int", "containers[0].name: missing"):
        assert expected in errors, (expected, errors)


# --- the manifests ------------------------------------------------------------------------------

def manifests() -> list[tuple[str, dict]]:
    docs = []
    for path in sorted(CLUSTER.glob("*.yaml")):
        docs += [(path.name, doc) for doc in yaml.safe_load_all(path.read_text()) if doc]
    return docs


def kuberay(kind: str) -> list[tuple[str, dict]]:
    return [(name, doc) for name, doc in manifests() if doc.get("kind") == kind]


def cluster_specs() -> list[tuple[str, dict]]:
    return ([(name, doc["spec"]) for name, doc in kuberay("RayCluster")]
            + [(name, doc["spec"]["rayClusterSpec"]) for name, doc in kuberay("RayJob")])


def test_cluster_ships_a_raycluster_a_rayjob_and_a_ray_up_yaml():
    assert [n for n, _ in kuberay("RayCluster")] == ["raycluster.yaml"]
    assert [n for n, _ in kuberay("RayJob")] == ["rayjob.yaml"]
    assert (CLUSTER / "aws.yaml").is_file() and (CLUSTER / "local-head.sh").is_file()


@pytest.mark.parametrize("kind", ["RayCluster", "RayJob"])
def test_kuberay_manifests_fit_the_crd(kind):
    for name, doc in kuberay(kind):
        assert doc["apiVersion"] == "ray.io/v1", name
        errors = schema_errors(doc, KINDS[kind], name)
        assert not errors, "\n".join(errors)


def test_ray_version_matches_the_project_pin():
    pinned = next(line for line in (REPO / "pyproject.toml").read_text().splitlines() if '"ray[default]==' in line)
    version = pinned.split("==")[1].strip('",')
    for name, spec in cluster_specs():
        assert spec["rayVersion"] == version, name
        images = {c["image"] for c in containers(spec)}
        assert len(images) == 1 and version in images.pop(), name  # one image, built on this Ray


def containers(spec: dict) -> list[dict]:
    groups = [spec["headGroupSpec"]] + spec.get("workerGroupSpecs", [])
    return [c for g in groups for c in g["template"]["spec"]["containers"]]


def test_token_authentication_is_on():
    for name, spec in cluster_specs():
        assert spec.get("authOptions", {}).get("mode") == "token", f"{name}: authOptions.mode is not token"
        for container in containers(spec):
            env = {e["name"]: e.get("value") for e in container.get("env", [])}
            assert env.get("RAY_AUTH_MODE") == "token", (name, container["name"])


def test_the_dashboard_is_not_exposed_outside_the_cluster():
    for name, spec in cluster_specs():
        head = spec["headGroupSpec"]
        assert head.get("serviceType", "ClusterIP") == "ClusterIP", name
        assert not head.get("enableIngress", False), name
        assert "spec" not in head.get("headService", {}) or head["headService"]["spec"].get("type", "ClusterIP") \
            == "ClusterIP", name
    for name, doc in manifests():  # no Service/Ingress of our own that would expose it
        assert doc.get("kind") not in ("Ingress", "Route"), name
        if doc.get("kind") == "Service":
            assert doc["spec"].get("type", "ClusterIP") == "ClusterIP", name


def gpu_groups(spec: dict) -> list[dict]:
    return [g for g in spec.get("workerGroupSpecs", [])
            if any("nvidia.com/gpu" in c.get("resources", {}).get("limits", {})
                   for c in g["template"]["spec"]["containers"])]


def quantity(value: Any) -> float:
    text = str(value)
    return float(text[:-1]) / 1000 if text.endswith("m") else float(text)


def test_a_gpu_worker_group_has_gpu_limits_matching_its_ray_start_params():
    for name, spec in cluster_specs():
        groups = gpu_groups(spec)
        assert groups, f"{name}: no worker group with nvidia.com/gpu limits"
        for group in groups:
            (ray_container,) = [c for c in group["template"]["spec"]["containers"] if c["name"] == "ray-worker"]
            gpus = quantity(ray_container["resources"]["limits"]["nvidia.com/gpu"])
            assert gpus >= 1
            if "num-gpus" in group["rayStartParams"]:
                assert quantity(group["rayStartParams"]["num-gpus"]) == gpus, name
            assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"], name


def rayjob_recipe() -> tuple[Path, list[str], list[str]]:
    """(recipe path in this repository, overrides, the rest) of the RayJob's entrypoint."""
    (_name, job), = kuberay("RayJob")
    words = shlex.split(job["spec"]["entrypoint"])
    assert words[:2] == ["k3post", "run"], "the image puts k3post on PATH (cluster/Dockerfile)"
    assert words[2].startswith(IMAGE_ROOT), words[2]
    overrides = [w for w in words[3:] if "=" in w and not w.startswith("-")]
    rest = [w for w in words[3:] if w not in overrides]
    return REPO / words[2].removeprefix(IMAGE_ROOT), overrides, rest


def test_the_rayjob_runs_a_recipe_that_exists_and_validates(capsys):
    recipe, overrides, rest = rayjob_recipe()
    assert recipe.is_file(), recipe
    assert main(["validate", str(recipe)]) == 0, capsys.readouterr().err
    load_distill_recipe(recipe, overrides)  # the overrides apply too
    assert rest[0] == "--run-dir" and rest[1].startswith(SHARED), "the run dir must be on the shared volume"


def needs(recipe: DistillRecipe) -> list[tuple[float, float]]:
    """(CPUs, GPUs) of every actor the recipe starts."""
    groups = [recipe.resources.samplers, recipe.resources.learner] + [t.resources for t in recipe.teachers.values()]
    return [(g.num_cpus, g.num_gpus) for g in groups for _ in range(g.replicas)]


def test_the_cluster_has_room_for_every_actor_of_the_recipe():
    recipe_path, overrides, _ = rayjob_recipe()
    actors = needs(load_distill_recipe(recipe_path, overrides))
    assert sum(gpus for _, gpus in actors) > 0, "the RayJob's recipe should use the GPU group"
    for name, spec in cluster_specs():
        pods = []
        for group in spec.get("workerGroupSpecs", []):
            limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
            pods += [(quantity(limits["cpu"]), quantity(limits.get("nvidia.com/gpu", 0)))] * group["replicas"]
        head_cpus = quantity(spec["headGroupSpec"]["rayStartParams"].get("num-cpus", 0))
        # First-fit placement, biggest actors first: each actor must fit in one pod.
        free = [list(p) for p in pods] + [[head_cpus, 0.0]]
        for cpus, gpus in sorted(actors, key=lambda a: (-a[1], -a[0])):
            slot = next((f for f in free if f[0] >= cpus and f[1] >= gpus), None)
            assert slot is not None, f"{name}: no pod left for an actor needing {cpus} CPU, {gpus} GPU"
            slot[0] -= cpus
            slot[1] -= gpus


def test_the_shared_volume_is_mounted_everywhere_and_shared():
    (_, pvc), = [(n, d) for n, d in manifests() if d.get("kind") == "PersistentVolumeClaim"]
    assert "ReadWriteMany" in pvc["spec"]["accessModes"]
    for name, spec in cluster_specs():
        for container in containers(spec):
            assert any(m["mountPath"] == SHARED.rstrip("/") for m in container.get("volumeMounts", [])), name


def test_the_rayjob_runtime_env_is_a_valid_runtime_env():
    (_, job), = kuberay("RayJob")
    runtime_env = yaml.safe_load(job["spec"]["runtimeEnvYAML"])
    assert set(runtime_env) <= RUNTIME_ENV_FIELDS
    assert all(isinstance(v, str) for v in runtime_env.get("env_vars", {}).values())
    assert runtime_env["env_vars"]["RAY_AUTH_MODE"] == "token"


# --- ray up -------------------------------------------------------------------------------------

def ray_up_config() -> dict:
    return yaml.safe_load((CLUSTER / "aws.yaml").read_text())


def test_the_ray_up_yaml_fits_rays_own_schema():
    import jsonschema
    import ray.autoscaler

    schema = json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())
    jsonschema.validate(ray_up_config(), schema)
    with pytest.raises(jsonschema.ValidationError):  # the schema is strict enough to catch a typo
        jsonschema.validate({**ray_up_config(), "head_start_ray_comands": []}, schema)


def test_the_ray_up_cluster_is_on_aws_with_gpus_auth_and_a_private_dashboard():
    config = ray_up_config()
    assert config["provider"]["type"] == "aws"
    assert config["head_node_type"] in config["available_node_types"]
    assert any(t["resources"].get("GPU", 0) >= 1 for t in config["available_node_types"].values())
    head = " ".join(config["head_start_ray_commands"])
    assert "--dashboard-host=127.0.0.1" in head and "0.0.0.0" not in head
    for commands in (config["head_start_ray_commands"], config["worker_start_ray_commands"]):
        assert "RAY_AUTH_MODE=token" in " ".join(commands)
