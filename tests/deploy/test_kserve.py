"""deploy/kserve/ (ServingRuntime, ClusterServingRuntime, InferenceService examples) checked offline against KServe's
CRD schemas and against the real server.

* Schemas: every object is validated with ``jsonschema`` against the ``openAPIV3Schema`` of the KServe v0.20.0
  CRDs vendored in ``tests/deploy/data/kserve/v0.20.0`` (README there: source, commit, licence; digests checked
  here). The OpenAPI extensions are mapped to JSON Schema as the API server reads them: ``nullable``,
  ``x-kubernetes-int-or-string``, ``x-kubernetes-preserve-unknown-fields``, ``x-kubernetes-embedded-resource``;
  objects without ``additionalProperties`` refuse unknown fields (the API server would prune them; ``kubectl
  apply --validate=strict`` refuses them). CEL rules (``x-kubernetes-validations``) are not evaluated.
  Broken objects must fail (``test_schema_rejects_broken_objects``).
* KServe's own logic, restated from its v0.20.0 sources (file names in the helpers): runtime selection by model
  format label, protocol version, the ServingRuntime webhook's priority rules, ``{{.Name}}`` templating of the
  container, the merge of ``predictor.model`` into the runtime's ``kserve-container`` (args appended), the
  Service it derives from the first container port, the HPA reconciler (Resource metrics only) and KEDA's
  External metrics. The merged pod is validated as a Kubernetes Deployment with ``kubernetes-validate``.
* The real server: the container's command and args (templated) go through ``relserve.service.main``'s parser
  and ``config_from_args`` with ``/mnt/models`` mapped to the default checkpoints the examples name; ports,
  probe services and drain time against the loaded config; finally ``relserve serve`` runs with exactly the
  runtime's args and environment (plus loopback host and free ports; in-pod paths mapped to local files) and
  answers tritonclient's v2 calls: a single checkpoint, one sub-directory per model, and qa.yaml's TLS + token.
  tritonclient runs in the venv that tests/serving/test_kserve_v2.py caches (it needs protobuf<7).
"""

from __future__ import annotations

import copy
import functools
import gzip
import hashlib
import json
import math
import re
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

jsonschema = pytest.importorskip("jsonschema", reason="jsonschema is in the test extra: pip install -e '.[test]'")
kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is in the test extra")
from kubernetes_validate import utils as kv  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
KSERVE = REPO / "deploy" / "kserve"
KSERVE_VERSION = "v0.20.0"
CRD_DIR = Path(__file__).resolve().parent / "data" / "kserve" / KSERVE_VERSION
CRD_FILES = {  # kind -> (file, sha256 of the original YAML)
    "ServingRuntime": ("serving.kserve.io_servingruntimes.yaml",
                       "380a3e1e1444cef9b8b88819596692728868205a2147dc66423be469a4a7bbb1"),
    "ClusterServingRuntime": ("serving.kserve.io_clusterservingruntimes.yaml",
                              "c6f6bbb1b4b11afd1e38bd6d7255a8795b86efa2b7d14946ccff9d23592e6846"),
    "InferenceService": ("serving.kserve.io_inferenceservices.yaml.gz",
                         "57c3bf13f77de94678bf2ae3748056ec071ad2b9e88d6a28f44fb4710758fcff"),
}
LICENSE_SHA256 = "c71d239df91726fc519c6eb72d318ec65820627232b2f796219e87dcf35d0ab4"
RUNTIME_FILES = {"relserve-cpu": KSERVE / "runtimes" / "servingruntime-cpu.yaml",
                 "relserve-gpu": KSERVE / "runtimes" / "servingruntime-gpu.yaml"}
CLUSTER_RUNTIMES = KSERVE / "runtimes" / "clusterservingruntimes.yaml"
ISVC_DIR = KSERVE / "inferenceservices"
MODEL_MOUNT = "/mnt/models"           # KServe constants.DefaultModelLocalMountPath
CONTAINER = "kserve-container"        # KServe constants.InferenceServiceContainerName
DEFAULT_GRACE_S = 30                  # Kubernetes' default terminationGracePeriodSeconds
K8S_VERSIONS = ("1.27.0", kv.latest_version())
# modelFormat -> the config.json model_type of the checkpoints it stands for
FORMAT_MODEL_TYPES = {("deberta", "1"): {"deberta"}, ("deberta", "2"): {"deberta-v2"},
                      ("deberta", "3"): {"deberta-v2"}, ("rnnsearch", "1"): {"rnnsearch"}}


def _docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _runtimes() -> dict[str, dict]:
    out = {}
    for name, path in RUNTIME_FILES.items():
        (doc,) = _docs(path)
        assert doc["metadata"]["name"] == name
        out[name] = doc
    return out


def _isvcs() -> dict[str, dict]:
    return {d["metadata"]["name"]: d for p in sorted(ISVC_DIR.glob("*.yaml")) for d in _docs(p)}


def _all_objects() -> list[tuple[str, dict]]:
    files = sorted(KSERVE.rglob("*.yaml"))
    assert files
    return [(str(p.relative_to(KSERVE)), d) for p in files for d in _docs(p)]


# ------------------------------------------------------------------------------------ CRD schemas

_YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml: the 1.9 MB CRD in seconds, not a minute


@functools.cache
def _crd(kind: str) -> dict:
    name, digest = CRD_FILES[kind]
    raw = (CRD_DIR / name).read_bytes()
    if name.endswith(".gz"):
        raw = gzip.decompress(raw)
    assert hashlib.sha256(raw).hexdigest() == digest, f"{name} is not the vendored KServe {KSERVE_VERSION} file"
    crd = yaml.load(raw, Loader=_YAML_LOADER)
    assert crd["kind"] == "CustomResourceDefinition" and crd["spec"]["names"]["kind"] == kind
    return crd


def _to_json_schema(node: Any) -> Any:
    """An OpenAPI v3 structural schema as JSON Schema, with the Kubernetes extensions applied (module doc)."""
    if isinstance(node, list):
        return [_to_json_schema(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: _to_json_schema(v) for k, v in node.items() if k not in ("nullable", "x-kubernetes-validations")}
    if "properties" in node:  # a field named like a keyword ("properties", "type") is still a field
        out["properties"] = {k: _to_json_schema(v) for k, v in node["properties"].items()}
    if node.get("x-kubernetes-int-or-string") and "anyOf" not in node:
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if node.get("x-kubernetes-embedded-resource"):
        props = out.setdefault("properties", {})
        for key in ("apiVersion", "kind"):
            props.setdefault(key, {"type": "string"})
        props.setdefault("metadata", {"type": "object"})
    if (node.get("type") == "object" or "properties" in node) and "additionalProperties" not in node \
            and not node.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    if node.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    return out


_OBJECT_META = {  # what a client may set in metadata (ObjectMeta), names as DNS-1123 labels / subdomains
    "type": "object", "additionalProperties": False, "required": ["name"],
    "properties": {
        "name": {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", "maxLength": 63},
        "namespace": {"type": "string"},
        "labels": {"type": "object", "additionalProperties": {"type": "string"}},
        "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
    },
}


@pytest.fixture(scope="module")
def validators() -> dict[tuple[str, str], Any]:
    """(apiVersion, kind) -> a jsonschema validator of the CRD version that is served."""
    out = {}
    for kind in CRD_FILES:
        crd = _crd(kind)
        for version in crd["spec"]["versions"]:
            if not version.get("served"):
                continue
            schema = _to_json_schema(version["schema"]["openAPIV3Schema"])
            schema["properties"]["metadata"] = _OBJECT_META
            schema["required"] = sorted({*schema.get("required", []), "apiVersion", "kind", "metadata", "spec"})
            cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
            cls.check_schema(schema)
            out[(f"{crd['spec']['group']}/{version['name']}", kind)] = cls(schema)
    return out


def _errors(validators, doc: dict) -> list[str]:
    key = (doc.get("apiVersion"), doc.get("kind"))
    assert key in validators, f"{key} is no kind of the vendored KServe CRDs"
    return [f"{'/'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}"
            for e in validators[key].iter_errors(doc)]


def test_vendored_crds_are_the_release_files_with_their_licence():
    assert hashlib.sha256((CRD_DIR / "LICENSE").read_bytes()).hexdigest() == LICENSE_SHA256
    assert "Apache License" in (CRD_DIR / "LICENSE").read_text()[:200]
    readme = (CRD_DIR / "README.md").read_text()
    assert KSERVE_VERSION in readme and "1fb781055dd1567164358233e1125142ca6ef1fe" in readme
    assert "Apache License 2.0" in readme
    for kind, (name, digest) in CRD_FILES.items():
        assert name in readme and digest in readme
        _crd(kind)
    assert _crd("ClusterServingRuntime")["spec"]["scope"] == "Cluster"
    assert _crd("ServingRuntime")["spec"]["scope"] == "Namespaced"


@pytest.mark.parametrize("where,doc", _all_objects(), ids=lambda x: x if isinstance(x, str) else "")
def test_objects_validate_against_kserve_crds(validators, where, doc):
    assert doc["kind"] in CRD_FILES, where
    assert not _errors(validators, doc), f"{where}: {_errors(validators, doc)}"
    if doc["kind"] == "ClusterServingRuntime":
        assert "namespace" not in doc["metadata"], "a cluster-scoped object has no namespace"


def _broken(path: str, mutate) -> tuple[str, dict]:
    doc = copy.deepcopy(_docs(KSERVE / path)[0])
    mutate(doc)
    return path, doc


def _runtime_container(doc: dict) -> dict:
    return doc["spec"]["containers"][0]


BROKEN = {
    "unknown container field": lambda: _broken("runtimes/servingruntime-cpu.yaml",
                                               lambda d: _runtime_container(d).update(portz=[])),
    "unknown spec field": lambda: _broken("runtimes/servingruntime-cpu.yaml",
                                          lambda d: d["spec"].update(supportedModelFormat=[])),
    "format without name": lambda: _broken("runtimes/servingruntime-gpu.yaml",
                                           lambda d: d["spec"]["supportedModelFormats"][0].pop("name")),
    "priority below 1": lambda: _broken("runtimes/servingruntime-cpu.yaml",
                                        lambda d: d["spec"]["supportedModelFormats"][0].update(priority=0)),
    "containerPort as text": lambda: _broken("runtimes/servingruntime-cpu.yaml",
                                             lambda d: _runtime_container(d)["ports"][0].update(containerPort="h2c")),
    "no containers": lambda: _broken("runtimes/servingruntime-cpu.yaml", lambda d: d["spec"].pop("containers")),
    "cluster runtime misspelt": lambda: _broken("runtimes/clusterservingruntimes.yaml",
                                                lambda d: d["spec"].update(protocolVersion=["grpc-v2"])),
    "minReplicas as text": lambda: _broken("inferenceservices/sentiment.yaml",
                                           lambda d: d["spec"]["predictor"].update(minReplicas="two")),
    "scale metric type unknown": lambda: _broken(
        "inferenceservices/sentiment.yaml",
        lambda d: d["spec"]["predictor"]["autoScaling"]["metrics"][0].update(type="Queue")),
    "quantity not a quantity": lambda: _broken(
        "inferenceservices/translate-de-en.yaml",
        lambda d: d["spec"]["predictor"]["autoScaling"]["metrics"][0]["external"]["target"].update(value="lots")),
    "model format missing name": lambda: _broken("inferenceservices/qa.yaml",
                                                 lambda d: d["spec"]["predictor"]["model"]["modelFormat"].pop("name")),
    "probe port missing": lambda: _broken(
        "inferenceservices/qa.yaml", lambda d: d["spec"]["predictor"]["model"]["startupProbe"]["grpc"].pop("port")),
    "bad object name": lambda: _broken("inferenceservices/qa.yaml", lambda d: d["metadata"].update(name="QA_model")),
}


# where each broken object's error must be reported (so that it fails for the reason meant)
BROKEN_AT = {
    "unknown container field": "spec/containers/0: Additional properties", "unknown spec field": "spec: Additional",
    "format without name": "spec/supportedModelFormats/0: 'name'",
    "priority below 1": "spec/supportedModelFormats/0/priority:",
    "containerPort as text": "spec/containers/0/ports/0/containerPort:", "no containers": "spec: 'containers'",
    "cluster runtime misspelt": "spec: Additional", "minReplicas as text": "spec/predictor/minReplicas:",
    "scale metric type unknown": "spec/predictor/autoScaling/metrics/0/type:",
    "quantity not a quantity": "spec/predictor/autoScaling/metrics/0/external/target/value:",
    "model format missing name": "spec/predictor/model/modelFormat: 'name'",
    "probe port missing": "spec/predictor/model/startupProbe/grpc: 'port'", "bad object name": "metadata/name:",
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_schema_rejects_broken_objects(validators, case):
    where, doc = BROKEN[case]()
    errors = _errors(validators, doc)
    assert any(e.startswith(BROKEN_AT[case]) for e in errors), f"{case}: the broken {where} gave {errors}"


# ------------------------------------------------------------------------------------ KServe's own rules

def _format_labels(runtime: dict, explicit: bool) -> set[str]:
    """predictor_model.go getServingRuntimeSupportedModelFormatLabelSet: without an explicit runtime only
    autoSelect formats count."""
    out = set()
    for f in runtime["spec"]["supportedModelFormats"]:
        if explicit or f.get("autoSelect"):
            out.add(f"mt:{f['name']}")
            if "version" in f:
                out.add(f"mt:{f['name']}:{f['version']}")
    return out


def _model_label(model_format: dict) -> str:
    return f"mt:{model_format['name']}" + (f":{model_format['version']}" if "version" in model_format else "")


def test_runtimes_declare_formats_protocol_and_priorities():
    runtimes = _runtimes()
    for name, rt in runtimes.items():
        spec = rt["spec"]
        assert spec["protocolVersions"] == ["grpc-v2"] and spec.get("multiModel") is False
        assert {(f["name"], f.get("version")) for f in spec["supportedModelFormats"]} == \
            {*FORMAT_MODEL_TYPES, ("relserve", "1")}
        # servingruntime_webhook.go validateModelFormatPrioritySame: one priority per autoSelect format name
        prio: dict[str, int] = {}
        for f in spec["supportedModelFormats"]:
            if f.get("autoSelect"):
                assert prio.setdefault(f["name"], f["priority"]) == f["priority"]
    # validateServingRuntimePriority: two runtimes of a namespace must not auto-select a format at one priority
    cpu, gpu = (runtimes[n]["spec"] for n in ("relserve-cpu", "relserve-gpu"))
    for a in cpu["supportedModelFormats"]:
        for b in gpu["supportedModelFormats"]:
            same = a["name"].lower() == b["name"].lower() and a.get("version") == b.get("version")
            assert not (same and a.get("autoSelect") and b.get("autoSelect") and a.get("priority") == b.get("priority"))
    assert all(f.get("autoSelect") for f in cpu["supportedModelFormats"])
    assert not any(f.get("autoSelect") for f in gpu["supportedModelFormats"]), "GPU only when asked for"


def test_cluster_runtimes_equal_the_namespaced_ones():
    cluster = {d["metadata"]["name"]: d for d in _docs(CLUSTER_RUNTIMES)}
    runtimes = _runtimes()
    assert sorted(cluster) == sorted(runtimes)
    for name, doc in cluster.items():
        assert doc["kind"] == "ClusterServingRuntime" and doc["apiVersion"] == runtimes[name]["apiVersion"]
        assert doc["spec"] == runtimes[name]["spec"], f"{name}: ClusterServingRuntime drifted from ServingRuntime"
        assert doc["metadata"] == runtimes[name]["metadata"]


def _template(container: dict, isvc_name: str) -> dict:
    """utils.go ReplacePlaceholders: the container's JSON as a Go template over the InferenceService's
    ObjectMeta. Our runtimes use {{.Name}} only; any other placeholder fails here."""
    text = json.dumps(container)
    text = text.replace("{{.Name}}", isvc_name)
    assert "{{" not in text, f"placeholder this test does not render: {text}"
    return json.loads(text)


_MERGE_KEYS = {"ports": "containerPort", "env": "name", "volumeMounts": "mountPath", "volumes": "name"}


def _smp(base: Any, patch: Any, key: str | None = None) -> Any:
    """apimachinery StrategicMergePatch as KServe's MergeContainerWithPatch / MergePodSpec use it (no
    directives): maps merge, lists with a patchMergeKey merge on it with new items appended, others replace."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for k, v in patch.items():
            out[k] = _smp(base[k], v, k) if k in base else copy.deepcopy(v)
        return out
    if isinstance(base, list) and isinstance(patch, list) and key in _MERGE_KEYS:
        mk, out = _MERGE_KEYS[key], copy.deepcopy(base)
        for item in patch:
            hit = next((i for i, b in enumerate(out) if b.get(mk) == item.get(mk)), None)
            if hit is None:
                out.append(copy.deepcopy(item))
            else:
                out[hit] = _smp(out[hit], item)
        return out
    return copy.deepcopy(patch)


_MODEL_ONLY = {"modelFormat", "runtime", "protocolVersion", "storageUri", "storage", "runtimeVersion"}
_POD_FIELDS_FROM_RUNTIME = ("nodeSelector", "affinity", "tolerations", "volumes", "imagePullSecrets", "schedulerName")


def _runtime_for(isvc: dict, runtimes: dict[str, dict]) -> dict:
    model = isvc["spec"]["predictor"]["model"]
    if "runtime" in model:
        return runtimes[model["runtime"]]
    hits = [rt for rt in runtimes.values() if _model_label(model["modelFormat"]) in _format_labels(rt, False)]
    assert hits, f"no runtime auto-selects {model['modelFormat']}"
    return hits[0]


def _effective_pod(isvc: dict, runtimes: dict[str, dict]) -> dict:
    """The predictor pod KServe builds (predictor.go buildPodSpec): runtime container + predictor.model
    (args appended, utils.go MergeRuntimeContainers), templated; the runtime's pod fields under the predictor's
    pod fields (MergePodSpec); for a pvc:// storageUri the PVC mounted read-only at /mnt/models."""
    rt = _runtime_for(isvc, runtimes)
    predictor = isvc["spec"]["predictor"]
    overlay = {k: v for k, v in predictor["model"].items() if k not in _MODEL_ONLY}
    base = next(c for c in rt["spec"]["containers"] if c["name"] == CONTAINER)
    merged = _smp(base, overlay)
    merged["args"] = [*base.get("args", []), *overlay.get("args", [])]
    merged = _template(merged, isvc["metadata"]["name"])
    pod_from_rt = {k: rt["spec"][k] for k in _POD_FIELDS_FROM_RUNTIME if k in rt["spec"]}
    pod_fields = {k: v for k, v in predictor.items() if k not in {"model", "minReplicas", "maxReplicas",
                                                                  "autoScaling", "scaleMetric", "scaleTarget",
                                                                  "scaleMetricType", "containerConcurrency"}}
    pod = _smp(pod_from_rt, pod_fields)
    uri = predictor["model"]["storageUri"]
    if uri.startswith("pvc://"):
        claim, _, sub = uri.removeprefix("pvc://").partition("/")
        pod.setdefault("volumes", []).append({"name": "kserve-pvc-source",
                                              "persistentVolumeClaim": {"claimName": claim, "readOnly": True}})
        merged.setdefault("volumeMounts", []).append({"name": "kserve-pvc-source", "mountPath": MODEL_MOUNT,
                                                      "subPath": sub, "readOnly": True})
    pod["containers"] = [merged]
    return pod


@pytest.mark.parametrize("name", list(_isvcs()))
def test_inference_service_selects_a_runtime_that_serves_its_format(name):
    isvc, runtimes = _isvcs()[name], _runtimes()
    model = isvc["spec"]["predictor"]["model"]
    rt = _runtime_for(isvc, runtimes)
    assert _model_label(model["modelFormat"]) in _format_labels(rt, "runtime" in model)
    assert model["protocolVersion"] in rt["spec"]["protocolVersions"]
    # inference_service_validation.go: an InferenceService name is a DNS-1035 label (it also names the model)
    assert re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", name) and len(name) <= 63
    assert isvc["metadata"]["annotations"]["serving.kserve.io/deploymentMode"] in ("Standard", "RawDeployment")
    # the checkpoint the example names is the default model of that format
    local = REPO / "defaults" / Path(model["storageUri"].removeprefix("pvc://")).name
    config = json.loads((local / "config.json").read_text())
    fmt = (model["modelFormat"]["name"], model["modelFormat"]["version"])
    assert config["model_type"] in FORMAT_MODEL_TYPES[fmt], (name, fmt, config["model_type"])


@pytest.mark.parametrize("name", list(_isvcs()))
@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_effective_predictor_pod_is_a_valid_deployment(name, version):
    """What KServe makes of runtime + InferenceService is a valid apps/v1 Deployment (strict)."""
    pod = _effective_pod(_isvcs()[name], _runtimes())
    deployment = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": f"{name}-predictor"},
                  "spec": {"selector": {"matchLabels": {"app": f"isvc.{name}-predictor"}},
                           "template": {"metadata": {"labels": {"app": f"isvc.{name}-predictor"}}, "spec": pod}}}
    try:
        kv.validate(deployment, version, strict=True)
    except kv.ValidationError as exc:
        pytest.fail(f"{name}: predictor Deployment invalid for Kubernetes {version}: {exc.message} at {list(exc.path)}")


def _service_ports(container: dict) -> list[dict]:
    """service_reconciler.go createDefaultSvc: first container port -> Service port 80, the others as they are;
    appProtocol kubernetes.io/h2c when the port name contains grpc or h2c."""
    out = []
    for i, p in enumerate(container["ports"]):
        grpcish = "grpc" in p["name"] or "h2c" in p["name"]
        out.append({"name": p["name"], "port": 80 if i == 0 else p["containerPort"], "target": p["containerPort"],
                    "appProtocol": "kubernetes.io/h2c" if grpcish else None})
    return out


# ------------------------------------------------------------------------------------ against the real code

def _local_model_dir(isvc: dict) -> Path:
    return REPO / "defaults" / Path(isvc["spec"]["predictor"]["model"]["storageUri"].removeprefix("pvc://")).name


def _argv(container: dict, mapping: dict[str, str]) -> list[str]:
    """The container's args with in-pod paths replaced by local ones (``mapping``: prefix -> local prefix)."""
    out = []
    for a in container["args"]:
        for prefix, local in mapping.items():
            a = a.replace(f"={prefix}", f"={local}")
        out.append(a)
    return out


def _check_console_script(container: dict) -> None:
    from relserve.service import main as cli

    command = container["command"]
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert command[0] in scripts and scripts[command[0]] == f"{cli.__name__}:main"
    assert command[1:] == ["serve"]


@pytest.mark.parametrize("name", list(_isvcs()))
def test_container_args_parse_and_load_with_the_real_cli(name, tmp_path):
    """The merged container's command + args through ``build_parser`` and ``config_from_args`` (no environment):
    ports, probes, drain budget, model name, directory and options as the manifests say."""
    from fixtures.tls import make_pki

    from relserve.service import main as cli
    from relserve.service.server import HEALTH_SERVICES
    from relserve.service._proto import inference_pb2

    isvc = _isvcs()[name]
    pod = _effective_pod(isvc, _runtimes())
    c = pod["containers"][0]
    _check_console_script(c)
    args = cli.build_parser().parse_args(c["command"][1:] + c["args"])
    assert args.model_dir == MODEL_MOUNT and args.model_name == name  # {{.Name}} rendered
    assert args.config is None, "the image's config.yaml would add the built-in default models"
    mapping = {MODEL_MOUNT: str(_local_model_dir(isvc))}
    if args.tls_cert:  # Secrets mounted in the pod -> a throwaway PKI and token file here
        pki = make_pki(tmp_path / "pki")
        tokens = tmp_path / "tokens"
        tokens.write_text("a-token\n")
        for pod_path in (args.tls_cert, args.tls_key, args.auth_token_file):
            mount = next(m for m in c["volumeMounts"] if Path(pod_path).parent == Path(m["mountPath"]))
            assert mount["readOnly"] is True
            volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
            assert volume["secret"]["defaultMode"] & 0o007 == 0, "secret files must not be world-readable"
            assert pod["securityContext"]["fsGroup"] == c["securityContext"]["runAsGroup"], "group reads the 0440 files"
        assert {_secret(pod, c, args.tls_cert), _secret(pod, c, args.tls_key), _secret(pod, c, args.auth_token_file)} \
            == {("relserve-tls", "tls.crt"), ("relserve-tls", "tls.key"), ("relserve-auth", "tokens")}
        mapping.update({args.tls_cert: str(pki.server_cert), args.tls_key: str(pki.server_key),
                        args.auth_token_file: str(tokens)})
    local = cli.build_parser().parse_args(c["command"][1:] + _argv(c, mapping))
    cfg = cli.config_from_args(local, environ={})
    assert [m.name for m in cfg.models] == [name]
    assert cfg.models[0].path == _local_model_dir(isvc)
    rt = _runtime_for(isvc, _runtimes())
    assert cfg.models[0].device == ("cuda" if rt["metadata"]["name"] == "relserve-gpu" else "auto")

    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert c["ports"][0]["containerPort"] == cfg.port, "KServe's Service and ingress route to the first port"
    # cleartext gRPC is announced as h2c; a TLS port must not be (a mesh would not pass TLS through)
    first = "tls" if cfg.tls_cert else "h2c"
    protocol = None if cfg.tls_cert else "kubernetes.io/h2c"
    assert _service_ports(c)[0] == {"name": first, "port": 80, "target": cfg.port, "appProtocol": protocol}
    assert len(c["ports"]) == len({p["containerPort"] for p in c["ports"]})
    assert ports["metrics"] == cfg.metrics_port
    assert int(rt["spec"]["annotations"]["prometheus.kserve.io/port"]) == cfg.metrics_port
    assert rt["spec"]["annotations"]["prometheus.kserve.io/path"] == "/metrics"
    probe_port = cfg.health_port if cfg.health_port is not None else cfg.port
    if cfg.health_port is not None:
        assert ports["health"] == cfg.health_port and cfg.health_host == "0.0.0.0"
        assert cfg.tls_cert is not None and cfg.auth_token_file is not None
    full_name = inference_pb2.DESCRIPTOR.services_by_name["Inference"].full_name
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):  # no readinessProbe: KServe adds a TCP one
        assert c[probe]["grpc"]["port"] == probe_port, (name, probe)
        assert c[probe]["grpc"].get("service", "") in HEALTH_SERVICES
    assert c["startupProbe"]["grpc"]["service"] == c["readinessProbe"]["grpc"]["service"] == full_name
    sleep_s = float(c["lifecycle"]["preStop"]["exec"]["command"][1])
    grace = pod.get("terminationGracePeriodSeconds", DEFAULT_GRACE_S)
    assert sleep_s + cfg.drain_timeout < grace


def _secret(pod: dict, c: dict, path: str) -> tuple[str, str]:
    mount = next(m for m in c["volumeMounts"] if Path(path).parent == Path(m["mountPath"]))
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    return volume["secret"]["secretName"], Path(path).name


@pytest.mark.parametrize("name", list(_runtimes()))
def test_runtime_pod_security_resources_and_image(name):
    rt = _runtimes()[name]
    (c,) = rt["spec"]["containers"]
    assert c["name"] == CONTAINER
    sc = c["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
    assert sc["runAsNonRoot"] is True and sc["runAsUser"] == 10001 and sc["capabilities"] == {"drop": ["ALL"]}
    writable = [m for m in c["volumeMounts"] if not m.get("readOnly")]
    assert [m["mountPath"] for m in writable] == ["/tmp"]
    assert "emptyDir" in next(v for v in rt["spec"]["volumes"] if v["name"] == writable[0]["name"])
    env = {e["name"]: e for e in c["env"]}
    assert "PYTHONPATH" not in env, "KServe's webhook refuses it (validation/env_policy.go)"
    assert env["OMP_NUM_THREADS"]["valueFrom"]["resourceFieldRef"]["containerName"] == CONTAINER
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    flavour = "cuda" if name == "relserve-gpu" else "cpu"
    assert c["image"] == f"relserve:{version}-{flavour}"
    res = c["resources"]
    assert {"cpu", "memory"} <= set(res["requests"]) and "memory" in res["limits"]
    if name == "relserve-gpu":
        assert res["limits"]["nvidia.com/gpu"] == 1
        assert rt["spec"]["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in rt["spec"]["tolerations"]
    else:
        assert "nvidia.com/gpu" not in res["limits"] and "tolerations" not in rt["spec"]


@pytest.fixture(scope="module")
def exported_gauges() -> set[str]:
    from prometheus_client import REGISTRY

    from relserve.service import metrics  # noqa: F401 - registers relserve's collectors

    return {f.name for f in REGISTRY.collect() if f.name.startswith("relserve_") and f.type == "gauge"}


@pytest.mark.parametrize("name", list(_isvcs()))
def test_autoscaling_is_what_kserve_acts_on(name, exported_gauges):
    """hpa_reconciler.go getHPAMetrics takes Resource cpu/memory metrics only (others are dropped silently);
    keda_reconciler.go turns External metrics into KEDA triggers (prometheus: serverAddress, query, threshold)."""
    isvc = _isvcs()[name]
    p = isvc["spec"]["predictor"]
    assert 1 <= p["minReplicas"] < p["maxReplicas"]
    cls = isvc["metadata"]["annotations"]["serving.kserve.io/autoscalerClass"]
    metrics = p["autoScaling"]["metrics"]
    assert metrics
    if cls == "hpa":
        for m in metrics:
            assert m["type"] == "Resource" and m["resource"]["name"] in ("cpu", "memory"), m
        cpu = next(m["resource"] for m in metrics if m["resource"]["name"] == "cpu")
        assert cpu["target"]["type"] == "Utilization" and 0 < cpu["target"]["averageUtilization"] <= 100
        requests = _effective_pod(isvc, _runtimes())["containers"][0]["resources"]["requests"]
        assert "cpu" in requests, "CPU utilisation needs a CPU request"
    else:
        assert cls == "keda"
        for m in metrics:
            assert m["type"] == "External" and m["external"]["metric"]["backend"] == "prometheus"
            query = m["external"]["metric"]["query"]
            series = set(re.findall(r"(?<![\w:])(relserve_[a-z0-9_]+)", query))
            assert series and series <= exported_gauges, f"{query} names a series relserve does not export"
            assert f'pod=~"{name}-predictor-.*"' in query, "KServe names the predictor pods <isvc>-predictor-..."
            assert float(m["external"]["target"]["value"]) > 0


# ------------------------------------------------------------------------------------ a real server

def _resolved_env(container: dict) -> dict[str, str]:
    """The container's env as the kubelet resolves it (values, and resourceFieldRef of limits.cpu rounded up)."""
    out = {}
    for e in container.get("env", []):
        if "value" in e:
            out[e["name"]] = e["value"]
            continue
        ref = e["valueFrom"]["resourceFieldRef"]
        assert ref["resource"] == "limits.cpu" and ref.get("divisor", "1") == "1", e
        out[e["name"]] = str(math.ceil(float(container["resources"]["limits"]["cpu"])))
    return out


_SINGLE_CLIENT = r"""
import json, sys
import numpy as np
import tritonclient.grpc as grpcclient
target, name, texts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
c = grpcclient.InferenceServerClient(url=target)
inp = grpcclient.InferInput("text", [len(texts)], "BYTES")
inp.set_data_from_numpy(np.array([t.encode() for t in texts], dtype=object))
r = c.infer(name, [inp], outputs=[grpcclient.InferRequestedOutput(n) for n in ("probabilities", "label")])
print(json.dumps({"live": c.is_server_live(), "ready": c.is_server_ready(),
                  "model_ready": {m: c.is_model_ready(m) for m in (name, "no-such-model")},
                  "probabilities": r.as_numpy("probabilities").tolist(),
                  "label": [b.decode() for b in r.as_numpy("label")]}))
"""


def _tritonclient_python() -> str:
    """tests/serving/test_kserve_v2.py's cached tritonclient venv (tritonclient needs protobuf<7)."""
    from serving.test_kserve_v2 import _tritonclient_python as make

    return make()


def _serve_runtime(runtime: str, isvc_name: str, model_dir: Path):
    """``relserve serve`` with the runtime's args (templated for ``isvc_name``, /mnt/models -> ``model_dir``) and
    its resolved env; ServerProcess puts --host 127.0.0.1 --port 0 --metrics-port 0 before them, which the
    runtime's args do not set."""
    from relserve.loadtest.serverproc import ServerProcess

    c = _template(_runtimes()[runtime]["spec"]["containers"][0], isvc_name)
    args = _argv(c, {MODEL_MOUNT: str(model_dir)})
    assert not {a.split("=")[0] for a in args} & {"--host", "--port", "--metrics-port"}
    return ServerProcess(args, env=_resolved_env(c), start_timeout=300)


def test_cpu_runtime_serves_a_single_checkpoint_to_tritonclient():
    """/mnt/models = one checkpoint (defaults/sentiment), named by {{.Name}}; v2 answers equal relserve.v1's."""
    import grpc

    from relserve.service._proto import inference_pb2 as pb
    from relserve.service._proto import inference_pb2_grpc as pb_grpc

    python = _tritonclient_python()
    texts = ["a warm and funny film", "dull, slow and far too long"]
    with _serve_runtime("relserve-cpu", "sentiment", REPO / "defaults" / "sentiment") as srv:
        done = subprocess.run([python, "-c", _SINGLE_CLIENT, srv.target, "sentiment", json.dumps(texts)],
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-4000:]
        got = json.loads(done.stdout)
        with grpc.insecure_channel(srv.target) as channel:
            v1 = pb_grpc.InferenceStub(channel).Classify(pb.ClassifyRequest(model="sentiment", texts=texts,
                                                                            top_k=0), timeout=60)
    assert got["live"] and got["ready"]
    assert got["model_ready"] == {"sentiment": True, "no-such-model": False}
    assert got["label"] == [r.labels[0].label for r in v1.results]
    assert len(got["probabilities"]) == 2 and all(abs(sum(row) - 1) < 1e-5 for row in got["probabilities"])
    for row, r in zip(got["probabilities"], v1.results):
        assert max(row) == pytest.approx(r.labels[0].score, abs=1e-6)


def test_cpu_runtime_serves_one_subdirectory_per_model_to_tritonclient(tmp_path):
    """/mnt/models = a repository (one sub-directory per default model, plus a PVC's lost+found): each served
    under its directory's name; tritonclient's session of tests/fixtures/tritonclient_script.py."""
    repo = tmp_path / "models"
    repo.mkdir()
    (repo / "lost+found").mkdir()
    for sub, default in (("cls", "sentiment"), ("qa", "qa"), ("tr", "translate-de-en")):
        (repo / sub).symlink_to(REPO / "defaults" / default, target_is_directory=True)
    python = _tritonclient_python()
    spec = {"cls": "cls", "qa": "qa", "tr": "tr", "texts": ["good", "bad"], "pairs": ["fine", "awful"],
            "questions": ["Where does Ann live?"], "contexts": ["Ann lives in Berlin."],
            "sources": ["Ich habe Hunger."]}
    with _serve_runtime("relserve-cpu", "my-isvc", repo) as srv:
        done = subprocess.run([python, str(REPO / "tests" / "fixtures" / "tritonclient_script.py"), srv.target,
                               json.dumps(spec)], capture_output=True, text=True, timeout=600)
        log = srv.log_text()
    assert done.returncode == 0, done.stderr[-4000:] + log[-2000:]
    got = json.loads(done.stdout)
    assert got["live"] and got["ready"]
    assert got["model_ready"] == {"cls": True, "qa": True, "tr": True, "no-such-model": False}
    assert "models: cls, qa, tr" in log
    assert got["classify"]["outputs"]["label"]["shape"] == [2]
    assert got["answer"]["outputs"]["answer"]["shape"][0] == 1
    assert got["translate"]["outputs"]["translation"]["shape"][0] == 1
    assert got["error"]["status"] == "StatusCode.INVALID_ARGUMENT"


def test_probe_service_is_not_serving_until_the_model_is_warm():
    """The runtime's startup/readiness probe asks grpc.health.v1 for relserve.v1.Inference: NOT_SERVING while
    the model warms up (KServe's default TCP probe would already pass), SERVING after."""
    import threading

    from grpc_health.v1 import health_pb2

    from fixtures.fake_serving import runner, server_config
    from fixtures.server import Running

    service = _runtimes()["relserve-cpu"]["spec"]["containers"][0]["readinessProbe"]["grpc"]["service"]
    gate = threading.Event()
    s = Running(server_config(metrics_port=None), [runner("sentiment", warm_gate=gate)])
    try:
        assert s.health_status(service) == health_pb2.HealthCheckResponse.NOT_SERVING
        gate.set()
        s.wait_serving()
        assert s.health_status(service) == health_pb2.HealthCheckResponse.SERVING
    finally:
        s.close()



_TLS_CLIENT = r"""
import json, sys
import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException
target, ca, token, question, context = sys.argv[1:6]
c = grpcclient.InferenceServerClient(url=target, ssl=True, root_certificates=ca)
auth = {"authorization": f"Bearer {token}"}
def infer(headers):
    q = grpcclient.InferInput("question", [1], "BYTES")
    q.set_data_from_numpy(np.array([question.encode()], dtype=object))
    x = grpcclient.InferInput("context", [1], "BYTES")
    x.set_data_from_numpy(np.array([context.encode()], dtype=object))
    r = c.infer("qa", [q, x], outputs=[grpcclient.InferRequestedOutput("answer")], headers=headers)
    return [b.decode() for b in r.as_numpy("answer").reshape(-1)]
out = {"ready": c.is_server_ready(), "model_ready": c.is_model_ready("qa"), "answer": infer(auth)}
try:
    infer({})
    out["no_token"] = None
except InferenceServerException as exc:
    out["no_token"] = exc.status()
print(json.dumps(out))
"""


def test_qa_example_with_tls_and_token_answers_tritonclient(tmp_path):
    """qa.yaml merged into relserve-cpu (TLS, token, health port): the server started with those args (Secrets ->
    a throwaway PKI and token file, --health-port 8081 -> a free port) answers tritonclient over TLS with the
    token, refuses it without (UNAUTHENTICATED), and its probe RPCs stay open as the kubelet needs."""
    import grpc

    from fixtures.tls import make_pki
    from relserve.loadtest.serverproc import ServerProcess
    from relserve.service._proto import inference_pb2 as pb
    from relserve.service._proto import inference_pb2_grpc as pb_grpc

    pki = make_pki(tmp_path / "pki")
    (tmp_path / "tokens").write_text("the-token\n")
    pod = _effective_pod(_isvcs()["qa"], _runtimes())
    c = pod["containers"][0]
    args = _argv(c, {MODEL_MOUNT: str(REPO / "defaults" / "qa"), "/etc/relserve-tls/tls.crt": str(pki.server_cert),
                     "/etc/relserve-tls/tls.key": str(pki.server_key),
                     "/etc/relserve-auth/tokens": str(tmp_path / "tokens")})
    assert "--health-port=8081" in args
    args = [a.replace("--health-port=8081", "--health-port=0") for a in args]
    question, context = "Where does Ann live?", "Ann lives in Berlin and works in a small bakery near the river."
    python = _tritonclient_python()
    with ServerProcess(args, env=_resolved_env(c), start_timeout=300) as srv:
        target = f"localhost:{srv.port}"  # the certificate names localhost
        done = subprocess.run([python, "-c", _TLS_CLIENT, target, str(pki.ca_cert), "the-token", question, context],
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-4000:]
        creds = grpc.ssl_channel_credentials(pki.ca_cert.read_bytes())
        with grpc.secure_channel(target, creds) as channel:
            v1 = pb_grpc.InferenceStub(channel).Answer(pb.AnswerRequest(model="qa", question=question, context=context),
                                                      metadata=[("authorization", "Bearer the-token")], timeout=60)
    got = json.loads(done.stdout)
    assert got["ready"] and got["model_ready"]
    assert got["answer"][0] == v1.answers[0].text and v1.answers[0].text.strip()
    assert got["no_token"] == "StatusCode.UNAUTHENTICATED"
