"""deploy/k8s: every manifest valid against the Kubernetes API's models, and the references between them true.

Why here and not against a cluster: none is reachable where ckptless is developed
(deploy/k8s/README.md says what was not run). What can be checked offline is
checked: each document round-trips through the official ``kubernetes`` client's
model of its kind (a required field missing, a value of the wrong type, or a
field of a wrong name, which the model drops, fails), and the manifests agree
with each other and with the product: Services select pods that exist,
Secrets and keys are the documented ones, every mount has its volume, the etcd
member list matches the StatefulSet, and the agents' command lines are parsed
by ``ckptless-run``'s own parser and name the etcd Service, one job id and one
script.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from ckptless.coordinator.config import EtcdConfig
from ckptless.coordinator.keyspace import ROOT
from ckptless.launcher.admission import job_config
from ckptless.launcher.args import parse_args

from ..harness.repo import REPO

K8S = REPO / "deploy" / "k8s"
MANIFESTS = ["etcd.yaml", "etcd-auth-job.yaml", "training.yaml", "spares.yaml"]
MODEL = {("v1", "Service"): "V1Service", ("apps/v1", "StatefulSet"): "V1StatefulSet",
         ("batch/v1", "Job"): "V1Job", ("apps/v1", "Deployment"): "V1Deployment"}
POD_IP = "10.1.2.3"


def _docs() -> list[tuple[str, dict[str, Any]]]:
    return [(name, doc) for name in MANIFESTS for doc in yaml.safe_load_all((K8S / name).read_text()) if doc]


def _workloads() -> list[tuple[str, dict[str, Any]]]:
    return [(f"{d['kind']}/{d['metadata']['name']}", d) for _, d in _docs() if "template" in d.get("spec", {})]


def _pod(doc: dict[str, Any]) -> dict[str, Any]:
    return doc["spec"]["template"]


def _doc(kind: str, name: str | None = None) -> dict[str, Any]:
    """The one manifest of ``kind`` (named ``name``)."""
    return next(d for _, d in _docs() if d["kind"] == kind and (name is None or d["metadata"]["name"] == name))


def _lost(given: Any, kept: Any, path: str = "") -> list[str]:
    """Paths present in ``given`` that the model did not keep (unknown fields) or changed."""
    if isinstance(given, dict):
        out: list[str] = []
        for k, v in given.items():
            out += [f"{path}.{k}"] if not isinstance(kept, dict) or k not in kept else _lost(v, kept[k], f"{path}.{k}")
        return out
    if isinstance(given, list):
        if not isinstance(kept, list) or len(kept) != len(given):
            return [path]
        return [p for i, (a, b) in enumerate(zip(given, kept)) for p in _lost(a, b, f"{path}[{i}]")]
    return [] if given == kept else [f"{path} ({given!r} -> {kept!r})"]


def test_every_manifest_round_trips_through_the_kubernetes_models() -> None:
    client = pytest.importorskip("kubernetes.client")
    api = client.ApiClient()
    docs = _docs()
    assert {d["kind"] for _, d in docs} == {"Service", "StatefulSet", "Job", "Deployment"}
    for name, doc in docs:
        model = MODEL[(doc["apiVersion"], doc["kind"])]
        obj = api._ApiClient__deserialize(doc, model)  # raises on a missing required field or a wrong type
        lost = _lost(doc, api.sanitize_for_serialization(obj))
        assert not lost, (name, model, lost)


def test_services_select_pods_and_workloads_select_their_own_template() -> None:
    pods = {key: _pod(d).get("metadata", {}).get("labels", {}) for key, d in _workloads()}
    services = {d["metadata"]["name"]: d for _, d in _docs() if d["kind"] == "Service"}
    for name, svc in services.items():
        sel = svc["spec"]["selector"]
        assert any(sel.items() <= labels.items() for labels in pods.values()), f"Service {name} selects no pod"
    for key, d in _workloads():
        match = d["spec"].get("selector", {}).get("matchLabels")
        if match is not None:
            assert match.items() <= _pod(d)["metadata"]["labels"].items(), key
    sts = _doc("StatefulSet")
    assert services[sts["spec"]["serviceName"]]["spec"]["clusterIP"] == "None"  # headless: member DNS names
    job = _doc("Job", "ckptless-train")
    assert services[_pod(job)["spec"]["subdomain"]]["spec"]["clusterIP"] == "None"


def _documented_secrets() -> dict[str, set[str]]:
    text = (K8S / "README.md").read_text().split("<!-- k8s-secrets -->", 1)[1]
    out: dict[str, set[str]] = {}
    for row in re.findall(r"^\| `([a-z0-9-]+)` \| ([^|]+) \|", text, re.M):
        out[row[0]] = set(re.findall(r"`([^`]+)`", row[1]))
    assert out, "deploy/k8s/README.md lists no Secrets"
    return out


def test_secrets_volumes_and_mounts_are_consistent_and_documented() -> None:
    secrets = _documented_secrets()
    for key, d in _workloads():
        spec = _pod(d)["spec"]
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        claims = {c["metadata"]["name"] for c in d["spec"].get("volumeClaimTemplates", [])}
        for c in spec["containers"]:
            mounts = {m["name"]: m["mountPath"] for m in c.get("volumeMounts", [])}
            assert set(mounts) <= set(volumes) | claims, (key, set(mounts) - set(volumes) - claims)
            env = {e["name"]: e for e in c.get("env", [])}
            for e in env.values():
                ref = e.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    assert ref["key"] in secrets.get(ref["name"], set()), (key, ref)
                for used in re.findall(r"\$\(([A-Z_]+)\)", e.get("value", "")):
                    assert used in env, (key, used)
            for arg in c.get("command", []) + c.get("args", []):
                for used in re.findall(r"\$\(([A-Z_]+)\)", arg):
                    assert used in env, (key, used)
            # every file path the container names under a secret's mount is a documented key of that secret
            text = " ".join(c.get("command", []) + c.get("args", []) + [str(e.get("value", "")) for e in env.values()])
            for vname, path in mounts.items():
                secret = volumes.get(vname, {}).get("secret")
                if secret is None:
                    continue
                assert secret["secretName"] in secrets, (key, secret)
                for file in re.findall(re.escape(path) + r"/([A-Za-z0-9._-]+)", text):
                    assert file in secrets[secret["secretName"]], (key, secret["secretName"], file)


def test_etcd_member_list_matches_the_statefulset() -> None:
    sts = _doc("StatefulSet")
    name, svc, n = sts["metadata"]["name"], sts["spec"]["serviceName"], sts["spec"]["replicas"]
    args = " ".join(_pod(sts)["spec"]["containers"][0]["args"])
    cluster = re.search(r'--initial-cluster "([^"]+)"', args)
    assert cluster is not None
    assert cluster.group(1).split(",") == [f"{name}-{i}=https://{name}-{i}.{svc}:2380" for i in range(n)]
    assert "--client-cert-auth" in args and "--peer-client-cert-auth" in args  # TLS both ways


def _agent(d: dict[str, Any]) -> tuple[list[str], dict[str, str]]:
    c = _pod(d)["spec"]["containers"][0]
    assert c["command"][0] == "ckptless-run"
    argv = [a.replace("$(POD_IP)", POD_IP) for a in c["command"][1:]]
    env = {e["name"]: e.get("value", "secret") for e in c.get("env", [])}
    return argv, env


def test_agents_parse_with_ckptless_run_and_agree_on_job_etcd_and_script() -> None:
    client = _doc("Service", "ckptless-etcd-client")
    port = client["spec"]["ports"][0]["port"]
    job = _doc("Job", "ckptless-train")
    spares = _doc("Deployment")
    parsed, envs = {}, {}
    for key, d in (("training", job), ("spares", spares)):
        argv, env = _agent(d)
        cfg = parse_args(argv, environ=env)  # the product's own parser: a flag it does not know fails here
        parsed[key], envs[key] = cfg, env
        assert str(cfg.rdzv_endpoint) == f"{client['metadata']['name']}:{port}", cfg.rdzv_endpoint
        etcd = EtcdConfig.from_env(str(cfg.rdzv_endpoint), env)  # what the agent connects with
        assert etcd.secure and etcd.user == "ckptless" and etcd.cert_cert is not None
        assert cfg.local_addr == POD_IP
        gpus = int(_pod(d)["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"])
        assert cfg.nproc_per_node + cfg.spares <= gpus, key  # each worker and spare on a GPU of its own
        assert {"CKPTLESS_ETCD_CA_CERT", "CKPTLESS_ETCD_USER", "CKPTLESS_ETCD_PASSWORD"} <= set(env)
    train, spare = parsed["training"], parsed["spares"]
    assert train.max_nodes == job["spec"]["completions"] == job["spec"]["parallelism"]
    assert train.run_id == spare.run_id  # the spares serve this job
    assert (train.training_script, train.training_script_args) == (spare.training_script, spare.training_script_args)
    # every job-wide setting (launcher/admission.py): a spare node that disagrees is refused at join
    mine, theirs = job_config(train, envs["training"]), job_config(spare, envs["spares"])
    assert mine == theirs, (mine, theirs)
    assert spare.nproc_per_node == 0 and spare.spares > 0


def test_the_auth_job_grants_the_keyspace_ckptless_uses() -> None:
    auth = _doc("Job", "ckptless-etcd-auth")
    script = " ".join(_pod(auth)["spec"]["containers"][0]["args"])
    assert f"--prefix=true readwrite {ROOT}/" in script and "auth enable" in script
    user = next(e["value"] for _, d in _workloads() if d["kind"] == "Job" and d["metadata"]["name"] == "ckptless-train"
                for e in _pod(d)["spec"]["containers"][0]["env"] if e["name"] == "CKPTLESS_ETCD_USER")
    assert f'user add "{user}:' in script and f"user grant-role {user} " in script


def test_kustomization_lists_every_manifest_and_the_image() -> None:
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert sorted(kust["resources"]) == sorted(MANIFESTS) == sorted(p.name for p in K8S.glob("*.yaml")
                                                                    if p.name != "kustomization.yaml")
    image = kust["images"][0]["name"]
    for key, d in _workloads():
        for c in _pod(d)["spec"]["containers"]:
            if "etcd" not in c["image"]:
                assert c["image"].split(":")[0] == image, key


def test_the_model_check_catches_a_misspelt_field_and_a_wrong_type() -> None:
    client = pytest.importorskip("kubernetes.client")
    api = client.ApiClient()
    job = _doc("Job", "ckptless-train")
    bad = yaml.safe_load(yaml.safe_dump(job))
    _pod(bad)["spec"]["containers"][0]["imagePullPolicyy"] = "Always"
    assert _lost(bad, api.sanitize_for_serialization(api._ApiClient__deserialize(bad, "V1Job"))) == [
        ".spec.template.spec.containers[0].imagePullPolicyy"]
    bad = yaml.safe_load(yaml.safe_dump(job))
    bad["spec"]["completions"] = "two"
    with pytest.raises(Exception, match="completions"):
        api._ApiClient__deserialize(bad, "V1Job")
