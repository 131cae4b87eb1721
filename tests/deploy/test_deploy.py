"""Deploy files (deploy/, .dockerignore) checked offline against Kubernetes schemas and the real server.

* Every manifest — the raw files and the rendered base / cpu / gpu overlays — is validated with
  ``kubernetes-validate`` (strict: unknown fields are errors) against the oldest Kubernetes we support
  (1.27, where native gRPC probes went GA) and the newest schema the package ships. The ServiceMonitor is
  a CRD the package cannot know; its structure is checked by hand against the Service it selects.
* Overlays are rendered by ``render()`` below, a small kustomize subset (resources, components,
  configMapGenerator with the content hash, images, strategic-merge patches merging lists by name).
  Where ``kubectl`` is installed its ``kubectl kustomize`` output must equal ours, so the renderer is
  checked against the real one; without kubectl the same manifests are validated from our rendering.
* Cross-checks against the real code: ports and drain time from ``relserve.service.config``, config files
  loaded with ``load_config``, the container command parsed by the real CLI parser, probe services from
  the proto and the server's health registration, metric names from ``relserve.service.metrics``,
  the Dockerfiles' install (a wheel with the flavour's ONNX Runtime extra) against pyproject.toml, and their
  HEALTHCHECK run against a real server.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

kubernetes_validate = pytest.importorskip(
    "kubernetes_validate", reason="kubernetes-validate is in the test extra: pip install -e '.[test]'"
)
from kubernetes_validate import utils as kv  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
K8S = DEPLOY / "k8s"
DOCKER = DEPLOY / "docker"
PROM = DEPLOY / "prometheus"
OVERLAYS = ("cpu", "gpu")
TARGETS = {"base": K8S / "base", "cpu": K8S / "overlays" / "cpu", "gpu": K8S / "overlays" / "gpu"}
DOCKERFILES = {"cpu": DOCKER / "Dockerfile.cpu", "cuda": DOCKER / "Dockerfile.cuda"}
SERVICEMONITOR = K8S / "components" / "servicemonitor" / "servicemonitor.yaml"
IMAGE_CONFIG_PATH = "/etc/relserve/config.yaml"
IMAGE_ROOT = "/opt/relserve"
K8S_VERSIONS = ("1.27.0", kv.latest_version())
CRD_KINDS = {("monitoring.coreos.com/v1", "ServiceMonitor")}


# ------------------------------------------------------------------------------------ tiny kustomize

def _load_docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _kustomize_hash(cm: dict) -> str:
    """kustomize's ConfigMap name suffix (api/hasher): sha256 of Go-json {data, kind, name}, 10 chars remapped.

    kustomize looks the name up as the single key "metadata/name", finds nothing and hashes name "" — so
    do we (test_render_equals_kubectl_kustomize holds us to kubectl's output).
    """
    obj: dict[str, Any] = {"data": cm.get("data", {}), "kind": "ConfigMap", "name": ""}
    if cm.get("binaryData"):
        obj["binaryData"] = cm["binaryData"]
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    for ch, esc in (("&", "\\u0026"), ("<", "\\u003c"), (">", "\\u003e")):  # Go's json HTML escaping
        text = text.replace(ch, esc)
    digest = hashlib.sha256(text.encode()).hexdigest()[:10]
    return digest.translate(str.maketrans({"0": "g", "1": "h", "3": "k", "a": "m", "e": "t"}))


_MERGE_KEYS = {"containers": "name", "initContainers": "name", "volumes": "name", "env": "name",
               "volumeMounts": "mountPath", "ports": "containerPort"}
_SERVICE_PORT_KEY = "port"  # a Service's ports merge on port, a container's on containerPort


def _smp(base: Any, patch: Any, key: str | None = None) -> Any:
    """Strategic merge, the part our patches use: maps merge, the lists above merge on their key (items the
    base lacks go first, in patch order, as kustomize puts them), every other list is replaced (as for fields
    without a patchMergeKey, e.g. tolerations, HPA metrics)."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for k, v in patch.items():
            if k.startswith("$") or v is None:
                raise NotImplementedError(f"patch directive {k!r}: {v!r} is beyond this renderer")
            out[k] = _smp(base[k], v, k) if k in base else copy.deepcopy(v)
        return out
    if isinstance(base, list) and isinstance(patch, list) and key in _MERGE_KEYS:
        mk = _MERGE_KEYS[key]
        if key == "ports" and not any(mk in b for b in base + patch):
            mk = _SERVICE_PORT_KEY
        out = [copy.deepcopy(b) for b in base]
        new = []
        for item in patch:
            hits = [i for i, b in enumerate(out) if b.get(mk) == item.get(mk)]
            if hits:
                out[hits[0]] = _smp(out[hits[0]], item)
            else:
                new.append(copy.deepcopy(item))
        return new + out
    return copy.deepcopy(patch)


def _id(doc: dict) -> tuple[str, str]:
    return doc["kind"], doc["metadata"]["name"]


def _build(root: Path, parent: list[dict] | None = None) -> list[dict]:
    """One kustomization; a Component works on what its ``parent`` has built so far (its patches see those)."""
    kust = yaml.safe_load((root / "kustomization.yaml").read_text())
    allowed = {"apiVersion", "kind", "resources", "components", "configMapGenerator", "images", "patches"}
    assert set(kust) <= allowed, f"{root}: render() does not implement {sorted(set(kust) - allowed)}"
    docs: list[dict] = list(parent or []) if kust.get("kind") == "Component" else []
    for entry in kust.get("resources", []):
        path = (root / entry).resolve()
        docs.extend(_build(path) if path.is_dir() else _load_docs(path))
    for entry in kust.get("components", []):
        docs = _build((root / entry).resolve(), docs)
    for gen in kust.get("configMapGenerator", []):
        assert set(gen) <= {"name", "files", "behavior"}, gen
        data = {}
        for f in gen["files"]:
            key, _, src = f.partition("=") if "=" in f else (Path(f).name, "", f)
            data[key] = (root / src).read_text()
        cm = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": gen["name"]}, "data": data}
        behavior = gen.get("behavior", "create")
        existing = [i for i, d in enumerate(docs) if _id(d) == ("ConfigMap", gen["name"])]
        assert behavior in ("create", "replace") and bool(existing) == (behavior == "replace"), gen
        if existing:
            docs[existing[0]] = cm
        else:
            docs.append(cm)
    for p in kust.get("patches", []):
        assert set(p) == {"path"}, f"only file patches targeting by kind/name are rendered: {p}"
        for patch in _load_docs(root / p["path"]):
            hits = [i for i, d in enumerate(docs) if _id(d) == _id(patch)]
            assert len(hits) == 1, f"patch {p['path']} matches {len(hits)} resources"
            docs[hits[0]] = _smp(docs[hits[0]], patch)
    for img in kust.get("images", []):
        for d in docs:
            for c in d.get("spec", {}).get("template", {}).get("spec", {}).get("containers", []):
                if re.split(r"[:@]", c["image"], maxsplit=1)[0] == img["name"]:
                    c["image"] = f"{img.get('newName', img['name'])}:{img['newTag']}"
    return docs


def render(root: Path) -> list[dict]:
    """Render a kustomization directory; generated ConfigMaps get their hash suffix, references follow."""
    docs = _build(root)
    renames = {}
    for d in docs:
        if d["kind"] == "ConfigMap":
            old = d["metadata"]["name"]
            d["metadata"]["name"] = renames[old] = f"{old}-{_kustomize_hash(d)}"
    for d in docs:
        for v in d.get("spec", {}).get("template", {}).get("spec", {}).get("volumes", []):
            if "configMap" in v:
                v["configMap"]["name"] = renames.get(v["configMap"]["name"], v["configMap"]["name"])
    return docs


@pytest.fixture(scope="module", params=list(TARGETS))
def rendered(request) -> tuple[str, list[dict]]:
    return request.param, render(TARGETS[request.param])


def _one(docs: list[dict], kind: str, name: str | None = None) -> dict:
    hits = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(hits) == 1, f"expected one {kind} {name or ''}, found {len(hits)}"
    return hits[0]


def _container(docs: list[dict]) -> dict:
    containers = _one(docs, "Deployment")["spec"]["template"]["spec"]["containers"]
    assert [c["name"] for c in containers] == ["relserve"]
    return containers[0]


def _config_yaml(docs: list[dict]) -> dict:
    dep = _one(docs, "Deployment")
    mount = next(m for m in _container(docs)["volumeMounts"] if m["mountPath"] == str(Path(IMAGE_CONFIG_PATH).parent))
    vol = next(v for v in dep["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"])
    cm = _one(docs, "ConfigMap", vol["configMap"]["name"])
    return yaml.safe_load(cm["data"][Path(IMAGE_CONFIG_PATH).name])


# ------------------------------------------------------------------------------------ the renderer

@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl not installed: render() unchecked here")
@pytest.mark.parametrize("target", list(TARGETS))
def test_render_equals_kubectl_kustomize(target):
    out = subprocess.run(["kubectl", "kustomize", str(TARGETS[target])], capture_output=True, text=True,
                         check=True, timeout=60).stdout
    theirs = {_id(d): d for d in yaml.safe_load_all(out) if d}
    ours = {_id(d): d for d in render(TARGETS[target])}
    assert sorted(ours) == sorted(theirs)
    for key in ours:
        assert ours[key] == theirs[key], f"{target}: {key} differs from kubectl kustomize"


def test_servicemonitor_component_renders_with_overlay(tmp_path):
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        # kustomize refuses absolute roots; relative ones may leave the kustomization's directory
        "resources": [os.path.relpath(TARGETS["cpu"], tmp_path)],
        "components": [os.path.relpath(SERVICEMONITOR.parent, tmp_path)],
    }))
    docs = render(tmp_path)
    _one(docs, "ServiceMonitor")
    if shutil.which("kubectl"):
        out = subprocess.run(["kubectl", "kustomize", str(tmp_path)], capture_output=True, text=True,
                             check=True, timeout=60).stdout
        assert {_id(d) for d in yaml.safe_load_all(out) if d} == {_id(d) for d in docs}


# ------------------------------------------------------------------------------------ schemas

def _manifest_files() -> list[Path]:
    files = [p for p in K8S.rglob("*.yaml") if p.name != "kustomization.yaml"]
    # config.yaml files are server configs, not manifests (checked with the real loader below).
    return sorted(p for p in files if p.name != "config.yaml")


@pytest.mark.parametrize("path", _manifest_files(), ids=lambda p: str(p.relative_to(K8S)))
def test_every_manifest_file_is_a_kubernetes_object(path):
    for doc in _load_docs(path):
        assert {"apiVersion", "kind", "metadata"} <= set(doc), path
        if (doc["apiVersion"], doc["kind"]) in CRD_KINDS:
            continue
        is_patch = "patch" in path.name
        for version in K8S_VERSIONS:
            if is_patch:  # a patch is a partial object: only its fields must be known, no required ones
                kv.validate(_complete_patch(doc), version, strict=True)
            else:
                kv.validate(doc, version, strict=True)


def _complete_patch(patch: dict) -> dict:
    """Lay a patch over the base resource it targets, so that strict validation sees a whole object."""
    base = {_id(d): d for d in render(TARGETS["base"])}
    return _smp(base[_id(patch)], patch)


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_rendered_manifests_validate(rendered, version):
    name, docs = rendered
    for doc in docs:
        if (doc["apiVersion"], doc["kind"]) in CRD_KINDS:
            continue
        try:
            kv.validate(doc, version, strict=True)
        except kv.ValidationError as exc:
            pytest.fail(f"{name}: {_id(doc)} invalid for Kubernetes {version}: {exc.message} at {list(exc.path)}")


def test_kustomize_resources_exist_and_kinds_are_expected(rendered):
    name, docs = rendered
    kinds = sorted(_id(d) for d in docs)
    assert [k for k, _ in kinds] == ["ConfigMap", "Deployment", "HorizontalPodAutoscaler",
                                     "PodDisruptionBudget", "Service", "Service"], (name, kinds)
    assert not any(d["kind"] == "ServiceMonitor" for d in docs), "ServiceMonitor must stay optional"


def test_servicemonitor_selects_the_metrics_service():
    sm = _one(_load_docs(SERVICEMONITOR), "ServiceMonitor")
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    spec = sm["spec"]
    assert set(spec) <= {"selector", "endpoints", "namespaceSelector", "jobLabel", "targetLabels",
                         "podTargetLabels", "sampleLimit"}
    docs = render(TARGETS["cpu"])
    wanted = spec["selector"]["matchLabels"]
    services = [s for s in docs if s["kind"] == "Service"
                and all(s["metadata"].get("labels", {}).get(k) == v for k, v in wanted.items())]
    assert [s["metadata"]["name"] for s in services] == ["relserve"], "exactly one Service is scraped"
    port_names = {p["name"] for p in services[0]["spec"]["ports"]}
    cfg = _config_yaml(docs)
    for ep in spec["endpoints"]:
        assert set(ep) <= {"port", "path", "scheme", "interval", "scrapeTimeout", "honorLabels",
                           "metricRelabelings", "relabelings"}
        assert ep["port"] in port_names
        svc_port = next(p for p in services[0]["spec"]["ports"] if p["name"] == ep["port"])
        assert svc_port["port"] == cfg["metrics_port"]
        assert ep.get("path", "/metrics") == "/metrics"
        assert _duration_s(ep["scrapeTimeout"]) <= _duration_s(ep["interval"])


def _duration_s(text: str) -> float:
    m = re.fullmatch(r"(\d+)(ms|s|m)", text)
    assert m, text
    return int(m.group(1)) * {"ms": 0.001, "s": 1, "m": 60}[m.group(2)]


# ------------------------------------------------------------------------------------ real server code

@pytest.fixture(scope="module")
def server_defaults():
    from relserve.service.config import ServerConfig

    return ServerConfig()


def _load_with_real_loader(cfg: dict, tmp_path: Path):
    """Run service/config's load_config on a config whose image paths point into this repo."""
    from relserve.service.config import load_config

    cfg = copy.deepcopy(cfg)
    for m in cfg.get("models", []):
        assert m["path"].startswith(f"{IMAGE_ROOT}/defaults/"), m["path"]
        local = REPO / Path(m["path"]).relative_to(IMAGE_ROOT)
        if not local.is_dir():  # the default models are built by another step; the keys still count
            local = tmp_path / "models" / m["name"]
            local.mkdir(parents=True, exist_ok=True)
        m["path"] = str(local)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return load_config(path, defaults_dir=tmp_path / "no-defaults")


def _all_configs() -> dict[str, dict]:
    out = {t: _config_yaml(render(p)) for t, p in TARGETS.items()}
    out["image"] = yaml.safe_load((DOCKER / "config.yaml").read_text())
    return out


@pytest.mark.parametrize("which", ["base", "cpu", "gpu", "image"])
def test_config_accepted_by_real_loader(which, tmp_path, server_defaults):
    raw = _all_configs()[which]
    cfg = _load_with_real_loader(raw, tmp_path)
    assert [m.name for m in cfg.models] == [m["name"] for m in raw["models"]]
    for m, r in zip(cfg.models, raw["models"]):  # every key written is a key the loader kept
        for key, value in r.items():
            if key != "path":
                assert getattr(m, key) == value, (which, m.name, key)
    # The manifests assume the server's own defaults for these; a change in config.py must show here.
    assert (cfg.port, cfg.metrics_port) == (server_defaults.port, server_defaults.metrics_port)
    assert cfg.drain_timeout == server_defaults.drain_timeout
    if which == "gpu":
        assert {m.device for m in cfg.models} == {"cuda"}
    if which in ("base", "cpu"):
        assert {(m.device, m.dtype) for m in cfg.models} == {("cpu", "auto")}  # float32 / bfloat16 at load


def test_default_model_dirs_exist_in_repo():
    names = {Path(m["path"]).name for c in _all_configs().values() for m in c["models"]}
    missing = [n for n in sorted(names) if not (REPO / "defaults" / n).is_dir()]
    if missing and not any(p.is_dir() for p in (REPO / "defaults").iterdir()):
        pytest.skip("defaults/ holds no models yet")
    assert not missing, f"configs name default models the image does not contain: {missing}"


def test_ports_agree_everywhere(rendered, server_defaults):
    name, docs = rendered
    cfg = _config_yaml(docs)
    grpc_port, metrics_port = server_defaults.port, server_defaults.metrics_port
    assert (cfg["port"], cfg["metrics_port"]) == (grpc_port, metrics_port)
    c = _container(docs)
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"grpc": grpc_port, "metrics": metrics_port}
    for svc in (d for d in docs if d["kind"] == "Service"):
        for p in svc["spec"]["ports"]:
            target = p["targetPort"]
            target = ports[target] if isinstance(target, str) else target
            assert target == ports[p["name"]] == p["port"], (svc["metadata"]["name"], p)
            assert p["appProtocol"] == {"grpc": "kubernetes.io/h2c", "metrics": "http"}[p["name"]]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["grpc"]["port"] == grpc_port, probe
    ann = _one(docs, "Deployment")["spec"]["template"]["metadata"]["annotations"]
    assert ann["prometheus.io/scrape"] == "true"
    assert int(ann["prometheus.io/port"]) == metrics_port
    assert ann["prometheus.io/path"] == "/metrics"
    for df in DOCKERFILES.values():
        exposed = [int(p) for line in _instructions(df, "EXPOSE") for p in line.split()]
        assert sorted(exposed) == sorted([grpc_port, metrics_port])


def test_probes_ask_services_the_server_registers(rendered):
    name, docs = rendered
    c = _container(docs)
    from relserve.service._proto import inference_pb2
    from relserve.service.server import HEALTH_SERVICES  # what InferenceServer sets in grpc.health.v1

    registered = set(HEALTH_SERVICES)
    full_name = inference_pb2.DESCRIPTOR.services_by_name["Inference"].full_name
    assert full_name in registered
    assert c["startupProbe"]["grpc"]["service"] == full_name
    assert c["readinessProbe"]["grpc"]["service"] == full_name
    assert c["livenessProbe"]["grpc"].get("service", "") == ""
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["grpc"].get("service", "") in registered, probe


def test_command_parses_with_real_cli_and_matches_image_entrypoint(rendered):
    from relserve.service import main as cli

    name, docs = rendered
    command = _container(docs)["command"]
    assert "args" not in _container(docs)
    for df in DOCKERFILES.values():
        assert _entrypoint(df) == command, f"{df.name} ENTRYPOINT differs from the Deployment command"
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert command[0] in scripts, "the command must be the console script"
    assert scripts[command[0]] == f"{cli.__name__}:main"
    args = cli.build_parser().parse_args(command[1:])
    assert Path(args.config) == Path(IMAGE_CONFIG_PATH)
    mount_dirs = {m["mountPath"] for m in _container(docs)["volumeMounts"]}
    assert str(Path(IMAGE_CONFIG_PATH).parent) in mount_dirs


def test_graceful_shutdown_budget(rendered, tmp_path):
    name, docs = rendered
    spec = _one(docs, "Deployment")["spec"]["template"]["spec"]
    cfg = _load_with_real_loader(_config_yaml(docs), tmp_path)
    pre_stop = _container(docs)["lifecycle"]["preStop"]
    if "sleep" in pre_stop:
        sleep_s = pre_stop["sleep"]["seconds"]
    else:
        cmd = pre_stop["exec"]["command"]
        assert cmd[0] in ("sleep", "/bin/sleep") and len(cmd) == 2, cmd
        sleep_s = float(cmd[1])
    assert sleep_s > 0
    assert spec["terminationGracePeriodSeconds"] > cfg.drain_timeout + sleep_s


def test_pod_security(rendered):
    name, docs = rendered
    pod = _one(docs, "Deployment")["spec"]["template"]["spec"]
    c = _container(docs)
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == 10001
    sc = c["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"] and "add" not in sc["capabilities"]
    assert sc.get("runAsUser", 10001) == 10001 and "privileged" not in sc
    writable = [m for m in c["volumeMounts"] if not m.get("readOnly")]
    assert [m["mountPath"] for m in writable] == ["/tmp"]
    vols = {v["name"]: v for v in pod["volumes"]}
    assert "emptyDir" in vols[writable[0]["name"]]
    for df in DOCKERFILES.values():
        users = _instructions(df, "USER")
        assert users and users[-1].split(":")[0] == "10001", df.name


def test_selectors_and_references(rendered):
    name, docs = rendered
    dep = _one(docs, "Deployment")
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    assert dep["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    for svc in (d for d in docs if d["kind"] == "Service"):
        assert svc["spec"]["selector"].items() <= pod_labels.items()
    assert _one(docs, "PodDisruptionBudget")["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    ref = _one(docs, "HorizontalPodAutoscaler")["spec"]["scaleTargetRef"]
    assert (ref["apiVersion"], ref["kind"], ref["name"]) == ("apps/v1", "Deployment", dep["metadata"]["name"])
    _config_yaml(docs)  # the config volume names a ConfigMap that is rendered with it
    env = {e["name"]: e for e in _container(docs).get("env", [])}
    if "OMP_NUM_THREADS" in env:
        assert env["OMP_NUM_THREADS"]["valueFrom"]["resourceFieldRef"]["containerName"] == _container(docs)["name"]


def test_resources_and_images(rendered):
    name, docs = rendered
    c = _container(docs)
    res = c["resources"]
    assert {"cpu", "memory"} <= set(res["requests"]) and "memory" in res["limits"]
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    repo, tag = c["image"].rsplit(":", 1)
    flavour = "cuda" if name == "gpu" else "cpu"
    assert tag == f"{version}-{flavour}", c["image"]
    pod = _one(docs, "Deployment")["spec"]["template"]["spec"]
    if name == "gpu":
        assert res["limits"]["nvidia.com/gpu"] == 1
        assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    else:
        assert "nvidia.com/gpu" not in res["limits"] and "tolerations" not in pod


# ------------------------------------------------------------------------------------ metrics names

@pytest.fixture(scope="module")
def exported_series() -> dict[str, str]:
    """Sample names relserve's /metrics can carry -> metric type, from the real metrics module."""
    from prometheus_client import REGISTRY

    from relserve.service import metrics

    fake = lambda: {"cuda:0": (1, 2, 3)}  # noqa: E731 - makes the GPU memory collector report
    metrics.add_memory_source(fake)
    try:
        families = [f for f in REGISTRY.collect() if f.name.startswith("relserve_")]
    finally:
        metrics.remove_memory_source(fake)
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
    return {f.name + s: f.type for f in families for s in suffixes[f.type]}


def test_hpa_metric_is_exported_and_adapted(rendered, exported_series):
    name, docs = rendered
    hpa = _one(docs, "HorizontalPodAutoscaler")
    kinds = {m["type"] for m in hpa["spec"]["metrics"]}
    assert kinds == {"Resource", "Pods"}
    cpu = next(m for m in hpa["spec"]["metrics"] if m["type"] == "Resource")["resource"]
    assert cpu["name"] == "cpu" and cpu["target"]["type"] == "Utilization"
    pods = next(m for m in hpa["spec"]["metrics"] if m["type"] == "Pods")["pods"]
    metric = pods["metric"]["name"]
    assert exported_series.get(metric) == "gauge", f"HPA scales on {metric}, which the server does not export"
    assert metric == "relserve_queue_depth"
    rules = yaml.safe_load((PROM / "prometheus-adapter-rules.yaml").read_text())["rules"]
    adapted = [r for r in rules if r["name"]["as"] == metric]
    assert len(adapted) == 1
    series = re.match(r"[a-zA-Z_:][a-zA-Z0-9_:]*", adapted[0]["seriesQuery"]).group(0)
    assert series in exported_series and re.fullmatch(adapted[0]["name"]["matches"], series)
    assert set(adapted[0]["resources"]["overrides"]) == {"namespace", "pod"}
    assert hpa["spec"]["minReplicas"] >= 1 and hpa["spec"]["maxReplicas"] > hpa["spec"]["minReplicas"]
    assert _one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]["resources"]["requests"]["cpu"]


def test_prometheus_rules_use_exported_metrics(exported_series):
    groups = yaml.safe_load((PROM / "rules.yaml").read_text())["groups"]
    recorded = {r["record"] for g in groups for r in g["rules"] if "record" in r}
    import grpc

    codes = {c.name for c in grpc.StatusCode}
    alerts = 0
    for g in groups:
        for r in g["rules"]:
            assert set(r) <= {"record", "alert", "expr", "for", "labels", "annotations"}, r
            expr = r["expr"]
            for name in set(re.findall(r"(?<![\w:])(relserve_[a-z0-9_]+)(?![\w:])", expr)):
                assert name in exported_series, f"{r.get('record') or r.get('alert')}: {name} is not exported"
            for name in set(re.findall(r"(?<![\w:])([a-z]+:relserve_[a-z0-9_]+:[a-z0-9_]+)(?![\w:])", expr)):
                assert name in recorded, name
            for value in re.findall(r'code=~?"([^"]+)"', expr) + re.findall(r'code!~"([^"]+)"', expr):
                assert set(value.split("|")) <= codes, value
            if "alert" in r:
                alerts += 1
                assert {"summary", "description"} <= set(r["annotations"])
                assert r["labels"]["severity"] in ("info", "warning", "critical")
    assert alerts and recorded


def test_request_code_label_is_a_status_code_name():
    """rules.yaml matches code="INTERNAL" etc.: every request is counted under the name of the StatusCode its client
    received. Each code the rules name (and the usual client errors) is provoked on a real server with fake models."""
    import collections

    import grpc
    from prometheus_client import REGISTRY

    from fixtures.fake_serving import runner, server_config
    from fixtures.server import Running
    from relserve.service._proto import inference_pb2 as pb
    from relserve.service.metrics import UNKNOWN_MODEL

    def counts() -> dict[tuple[str, str], float]:
        # summed over the other labels (task, protocol): tests run before this one in the same process may have
        # counted the same model and code under another protocol
        out: collections.Counter = collections.Counter()
        for f in REGISTRY.collect():
            for s in f.samples:
                if s.name == "relserve_requests_total":
                    out[s.labels["model"], s.labels["code"]] += s.value
        return dict(out)

    calls = [  # (model label expected, rpc, request)
        ("codes-ok", "Classify", pb.ClassifyRequest(model="codes-ok", texts=["good"])),
        ("codes-ok", "Classify", pb.ClassifyRequest(model="codes-ok", texts=[])),
        ("codes-ok", "Answer", pb.AnswerRequest(model="codes-ok", question="q", context="c")),
        (UNKNOWN_MODEL, "Classify", pb.ClassifyRequest(model="codes-nope", texts=["x"])),
        ("codes-broken", "Classify", pb.ClassifyRequest(model="codes-broken", texts=["x"])),
        ("codes-small", "Classify", pb.ClassifyRequest(model="codes-small", texts=["a", "b"])),
    ]
    s = Running(server_config(metrics_port=None), [
        runner("codes-ok"), runner("codes-broken", fail=True), runner("codes-small", config={"max_queue_size": 1}),
    ])
    try:
        s.wait_serving()
        before = counts()
        seen = collections.Counter()
        for model, rpc, request in calls:
            try:
                getattr(s.stub, rpc)(request, timeout=10)
                seen[(model, "OK")] += 1
            except grpc.RpcError as exc:
                seen[(model, exc.code().name)] += 1
    finally:
        s.close()
    assert {code for _, code in seen} == {"OK", "INVALID_ARGUMENT", "FAILED_PRECONDITION", "NOT_FOUND", "INTERNAL",
                                          "RESOURCE_EXHAUSTED"}, seen
    after = counts()
    counted = {k: after[k] - before.get(k, 0.0) for k in after if after[k] != before.get(k, 0.0)}
    assert counted == dict(seen)
    status_names = {c.name for c in grpc.StatusCode}
    assert {code for _, code in after} <= status_names


# ------------------------------------------------------------------------------------ Dockerfiles

def _logical_lines(path: Path) -> list[str]:
    lines, cur = [], ""
    for raw in path.read_text().splitlines():
        s = raw.strip()
        if not s or s.startswith("#"):
            continue
        if s.endswith("\\"):
            cur += s[:-1] + " "
            continue
        lines.append(cur + s)
        cur = ""
    return lines


def _instructions(path: Path, word: str) -> list[str]:
    return [ln.split(None, 1)[1] for ln in _logical_lines(path) if ln.split(None, 1)[0].upper() == word]


def _entrypoint(path: Path) -> list[str]:
    eps = _instructions(path, "ENTRYPOINT")
    assert eps, path
    assert eps[-1].startswith("["), "exec form, so SIGTERM reaches the server (PID 1), not a shell"
    return json.loads(eps[-1])


IMAGE_EXTRAS = {"cpu": ("onnx", "onnxruntime"), "cuda": ("onnx-gpu", "onnxruntime-gpu")}


@pytest.mark.parametrize("flavour", list(DOCKERFILES))
def test_dockerfile_installs_the_package_with_its_onnx_runtime(flavour):
    """The builder makes a regular (non-editable) install of the sources with the ONNX Runtime extra of its
    flavour (CPU: onnxruntime, CUDA: onnxruntime-gpu, never both) under the pinned versions; the runtime stage
    carries the venv only, with the wheel's default models where the image config looks for them."""
    df = DOCKERFILES[flavour]
    lines = _logical_lines(df)
    stages = [ln for ln in lines if ln.upper().startswith("FROM ")]
    assert len(stages) >= 2 and any(" AS builder" in s for s in stages) and " AS runtime" in stages[-1]
    run = " ".join(_instructions(df, "RUN"))
    args = {a.split("=", 1)[0]: a.split("=", 1)[1] for a in _instructions(df, "ARG") if "=" in a}
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    extra, ort = IMAGE_EXTRAS[flavour]
    assert args["RELSERVE_EXTRAS"] == extra
    assert 'pip install -c constraints.txt ".[${RELSERVE_EXTRAS}]"' in run
    assert " -e " not in run, "the image installs a wheel, not an editable checkout"
    extra_deps = [d.split("==")[0].strip() for d in pyproject["project"]["optional-dependencies"][extra]]
    assert ort in extra_deps and ({"onnxruntime", "onnxruntime-gpu"} - {ort}).isdisjoint(extra_deps)
    assert f"WORKDIR {IMAGE_ROOT}" in lines and "RUN python -m venv .venv" in lines
    assert f"PATH={IMAGE_ROOT}/.venv/bin:$PATH" in " ".join(_instructions(df, "ENV"))
    # torch in the image is the version pyproject pins
    torch_pin = next(d for d in pyproject["project"]["dependencies"] if d.startswith("torch=="))
    assert f"torch=={args['TORCH_VERSION']}" == torch_pin
    # the runtime stage carries the builder's venv and the config; the model paths lead into the wheel
    runtime = lines[lines.index(stages[-1]):]
    assert f"COPY --from=builder {IMAGE_ROOT} {IMAGE_ROOT}" in runtime
    assert f"COPY deploy/docker/config.yaml {IMAGE_CONFIG_PATH}" in runtime
    assert f"{IMAGE_ROOT}/defaults" in " ".join(ln for ln in runtime if ln.startswith("RUN ln -s"))
    if flavour == "cpu":
        assert stages[0].split()[1] == "${PYTHON_IMAGE}" and args["PYTHON_IMAGE"].startswith("python:3.11-slim")
        assert args["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"
    else:
        # PyPI torch 2.13 and onnxruntime-gpu 1.31 are CUDA 13 builds: a CUDA 13 cuDNN runtime base, Python 3.11
        assert re.fullmatch(r"nvidia/cuda:13\.0\.\d+-cudnn-runtime-ubuntu24\.04", args["CUDA_IMAGE"]), args
        assert args["TORCH_INDEX_URL"] == "https://pypi.org/simple" and "python3.11" in run
        assert "driver >= 580" in df.read_text()


def _healthcheck(df: Path) -> list[str]:
    (hc,) = _instructions(df, "HEALTHCHECK")
    assert " CMD [" in hc, "exec form"
    return json.loads(hc.split(" CMD ", 1)[1])


@pytest.mark.parametrize("flavour", list(DOCKERFILES))
def test_dockerfile_healthcheck_asks_grpc_health_of_a_real_server(flavour, tmp_path):
    """The HEALTHCHECK command, run here against a real ``relserve serve`` (fake models) on the image config's
    port replaced by a free one: exit 0 while SERVING, non-zero once the server is gone."""
    from fixtures.server import FakeServerProcess

    df = DOCKERFILES[flavour]
    cmd = _healthcheck(df)
    assert cmd[:2] == ["python", "-c"]
    image_port = yaml.safe_load((DOCKER / "config.yaml").read_text())["port"]
    assert f"'127.0.0.1:{image_port}'" in cmd[2]
    srv = FakeServerProcess({"m": {}}).start()  # "serving on" is logged once health says SERVING
    try:
        probe = [sys.executable, "-c", cmd[2].replace(f"127.0.0.1:{image_port}", srv.target)]
        ok = subprocess.run(probe, capture_output=True, text=True, timeout=30)
    finally:
        srv.close()
    assert ok.returncode == 0, ok.stderr
    gone = subprocess.run(probe, capture_output=True, text=True, timeout=30)
    assert gone.returncode != 0


@pytest.mark.parametrize("flavour", list(DOCKERFILES))
def test_dockerfile_copies_what_the_package_needs(flavour):
    df = DOCKERFILES[flavour]
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    needed = {"pyproject.toml", "setup.py", pyproject["project"]["readme"], "constraints.txt", "proto", "defaults"}
    needed |= {d.split("/")[0] for d in pyproject["tool"]["setuptools"]["package-dir"].values()}
    copied = set()
    for arg in _instructions(df, "COPY"):
        if arg.startswith("--from"):
            continue
        *srcs, _dest = arg.split()
        copied |= {s.rstrip("/") for s in srcs}
    assert needed <= copied, f"{df.name} does not copy {sorted(needed - copied)}"
    for src in copied:
        assert (REPO / src).exists(), f"{df.name} copies {src}, which is not in the repo"
    ignored = {ln.strip().rstrip("/") for ln in (REPO / ".dockerignore").read_text().splitlines()
               if ln.strip() and not ln.startswith("#")}
    for src in copied:
        parts = Path(src).parts
        excluded = any("/".join(parts[:i]) in ignored for i in range(1, len(parts) + 1))
        assert not excluded or f"!{src}" in ignored, f".dockerignore drops {src}"
    assert ".venv" in ignored and ".git" in ignored


def test_console_script_runs_help():
    """What the builder runs last (`relserve --help`) works with the install here."""
    exe = Path(sys.executable).parent / "relserve"  # the console script of the venv running the tests
    if not exe.exists():
        pytest.skip("relserve console script not installed here")
    out = subprocess.run([str(exe), "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    out = subprocess.run([str(exe), *shlex.split("serve --help")], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "--config" in out.stdout, out.stderr


# ------------------------------------------------------------------------------------ TLS + token component

TLS_AUTH = K8S / "components" / "tls-auth"


def _with_components(tmp_path: Path, overlay: str, *components: Path) -> Path:
    """``tmp_path`` made a kustomization: ``overlay`` with ``components`` laid over it, in that order."""
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": [os.path.relpath(TARGETS[overlay], tmp_path)],
        "components": [os.path.relpath(c, tmp_path) for c in components],
    }))
    return tmp_path


def _assert_like_kubectl_and_valid(label: str, root: Path, docs: list[dict]) -> None:
    """``docs`` (our render of ``root``) equal ``kubectl kustomize root``'s where kubectl is installed, and every
    one of them is valid (strict) for each of K8S_VERSIONS; failures name ``label``."""
    if shutil.which("kubectl"):
        out = subprocess.run(["kubectl", "kustomize", str(root)], capture_output=True, text=True, check=True,
                             timeout=60).stdout
        theirs = {_id(d): d for d in yaml.safe_load_all(out) if d}
        assert {_id(d): d for d in docs} == theirs, f"{label} differs from kubectl kustomize"
    for doc in docs:
        for version in K8S_VERSIONS:
            try:
                kv.validate(doc, version, strict=True)
            except kv.ValidationError as exc:
                pytest.fail(f"{label}: {_id(doc)} invalid for Kubernetes {version}: {exc.message} at "
                            f"{list(exc.path)}")


@pytest.fixture(scope="module", params=OVERLAYS)
def secured(request, tmp_path_factory) -> tuple[str, Path, list[dict]]:
    root = _with_components(tmp_path_factory.mktemp(f"tls-{request.param}"), request.param, TLS_AUTH)
    return request.param, root, render(root)


def test_tls_auth_component_renders_like_kubectl_and_validates(secured):
    name, root, docs = secured
    _assert_like_kubectl_and_valid(f"{name}+tls-auth", root, docs)


def _secret_file(docs: list[dict], path: str) -> tuple[str, str]:
    """(Secret name, key) of the file ``path`` in the container, from its mounts and the pod's volumes."""
    pod = _one(docs, "Deployment")["spec"]["template"]["spec"]
    mount = next(m for m in _container(docs)["volumeMounts"] if Path(path).parent == Path(m["mountPath"]))
    assert mount["readOnly"] is True
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    assert volume["secret"]["defaultMode"] & 0o007 == 0, "secret files must not be world-readable"
    return volume["secret"]["secretName"], Path(path).name


def test_tls_auth_component_passes_flags_mounts_secrets_and_probes_the_health_listener(secured, tmp_path):
    from fixtures.tls import make_pki

    from relserve.service import main as cli

    name, _root, docs = secured
    c = _container(docs)
    assert c["command"] == _entrypoint(DOCKERFILES["cpu"]), "the component adds args, the command stays the image's"
    args = cli.build_parser().parse_args(c["command"][1:] + c["args"])
    assert Path(args.config) == Path(IMAGE_CONFIG_PATH)
    assert _secret_file(docs, args.tls_cert) == ("relserve-tls", "tls.crt")  # kubernetes.io/tls Secret keys
    assert _secret_file(docs, args.tls_key) == ("relserve-tls", "tls.key")
    assert _secret_file(docs, args.auth_token_file) == ("relserve-auth", "tokens")
    # the kubelet probes the pod IP, in plaintext and without a token: every probe asks the health-only listener
    assert args.health_host == "0.0.0.0" and args.health_port
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports["health"] == args.health_port
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["grpc"]["port"] == args.health_port, probe
    # the health port is in no Service; the gRPC port is announced as TLS
    for svc in (d for d in docs if d["kind"] == "Service"):
        assert args.health_port not in {p["port"] for p in svc["spec"]["ports"]}
        grpc_port = next(p for p in svc["spec"]["ports"] if p["name"] == "grpc")
        assert grpc_port["appProtocol"] == "https" and grpc_port["targetPort"] == "grpc"
    # the server accepts the combination: the overlay's config plus the flags, files replaced by a real PKI
    pki = make_pki(tmp_path / "pki")
    tokens = tmp_path / "tokens"
    tokens.write_text("a-token\n")
    cfg = _config_yaml(docs)
    cfg.update(tls_cert=str(pki.server_cert), tls_key=str(pki.server_key), auth_token_file=str(tokens),
               health_port=args.health_port, health_host=args.health_host)
    loaded = _load_with_real_loader(cfg, tmp_path)
    assert loaded.health_port == args.health_port and loaded.tls_cert == pki.server_cert
    # still only /tmp writable
    assert [m["mountPath"] for m in c["volumeMounts"] if not m.get("readOnly")] == ["/tmp"]


@pytest.mark.parametrize("which", ["base", "cpu", "gpu"])
def test_connection_management_lets_clients_rebalance(which, tmp_path):
    """The pods recycle connections (so clients of the headless Service re-resolve and reach new pods), and
    the client settings in deploy/client keep within what the server accepts: round_robin, and keepalive
    pings no faster than keepalive_min_ping_interval (faster ones get GOAWAY too_many_pings)."""
    import json

    from relserve.service.server import connection_options

    cfg = _load_with_real_loader(_all_configs()[which], tmp_path)
    opts = dict(connection_options(cfg))
    assert 0 < opts["grpc.max_connection_age_ms"] <= 3600_000  # new pods get traffic within the hour
    assert opts["grpc.max_connection_age_grace_ms"] >= cfg.drain_timeout * 1000  # a call fits like in a drain
    client = json.loads((DEPLOY / "client" / "channel_options.json").read_text())
    assert client["grpc.keepalive_time_ms"] >= opts["grpc.http2.min_ping_interval_without_data_ms"]
    assert client["grpc.keepalive_permit_without_calls"] <= opts["grpc.keepalive_permit_without_calls"]
    service_config = json.loads((DEPLOY / "client" / "service_config.json").read_text())
    assert service_config["loadBalancingConfig"][0] == {"round_robin": {}}
