"""deploy/k8s/sparseps.yaml without a cluster (none runs here): every object against the
Kubernetes API's schema as Debian's python3-kubernetes models it (types, required fields, and no
field the API does not know: a misspelt key would be dropped silently by a cluster), and the job
they describe against sparseps itself (the ConfigMap's config read by the daemon, the daemons'
command lines run through sh as the pods would, ranks and sizes that agree). Run by ctest with
Debian's python3 -m pytest."""
import os
import pathlib
import re
import subprocess

import pytest
import yaml

from conftest import ROOT, cannot_run

BUILD = pathlib.Path(os.environ.get("SPARSEPS_BUILD_DIR", ROOT / "build"))
MANIFEST = ROOT / "deploy" / "k8s" / "sparseps.yaml"
DAEMONS = {"scheduler": BUILD / "scheduler" / "sparseps-scheduler",
           "server": BUILD / "server" / "sparseps-server",
           "worker": BUILD / "worker" / "sparseps-worker"}


def objects():
    return {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(MANIFEST.read_text())}


def pod_spec(obj):
    return obj["spec"]["template"]["spec"]


def test_every_object_matches_the_api_schema():
    try:
        from kubernetes import client
    except ImportError:
        cannot_run("python3-kubernetes is not installed (deploy/install-deps.sh installs it)")
    api = client.ApiClient()
    for (kind, name), obj in objects().items():
        version = obj["apiVersion"].split("/")[-1].capitalize()
        model = api._ApiClient__deserialize(obj, f"{version}{kind}")  # raises on a wrong type
        back = api.sanitize_for_serialization(model)
        # What the model dropped is a key the API does not have.
        assert back == obj, f"{kind}/{name}: the API keeps only {back}"


def test_the_objects_describe_one_consistent_job():
    o = objects()
    config = yaml.safe_load(o[("ConfigMap", "sparseps-job")]["data"]["job.yaml"])
    cluster = config["cluster"]
    service = o[("Service", "sparseps-scheduler")]
    assert cluster["scheduler_host"] == service["metadata"]["name"]
    assert service["spec"]["ports"][0]["port"] == cluster["scheduler_port"]
    scheduler = o[("Job", "sparseps-scheduler")]
    labels = scheduler["spec"]["template"]["metadata"]["labels"]
    assert all(labels.get(k) == v for k, v in service["spec"]["selector"].items())
    servers = o[("StatefulSet", "sparseps-server")]
    assert servers["spec"]["replicas"] == cluster["num_servers"]
    assert servers["spec"]["serviceName"] == "sparseps-server"
    assert o[("Service", "sparseps-server")]["spec"]["clusterIP"] == "None"
    workers = o[("Job", "sparseps-worker")]["spec"]
    assert workers["completionMode"] == "Indexed"
    assert workers["completions"] == workers["parallelism"] == cluster["num_workers"]
    for obj in (scheduler, servers, o[("Job", "sparseps-worker")]):
        mounts = {m["name"]: m["mountPath"] for m in pod_spec(obj)["containers"][0]["volumeMounts"]}
        assert mounts["job"] == "/etc/sparseps" and mounts["run"] == config["run"]["dir"]
        volumes = {v["name"]: v for v in pod_spec(obj)["volumes"]}
        assert volumes["job"]["configMap"]["name"] == "sparseps-job"


@pytest.mark.parametrize("role,name,pod_env,rank", [
    ("scheduler", ("Job", "sparseps-scheduler"), {}, None),
    ("server", ("StatefulSet", "sparseps-server"), {"HOSTNAME": "sparseps-server-1"}, "1"),
    ("worker", ("Job", "sparseps-worker"), {"JOB_COMPLETION_INDEX": "1"}, "1"),
])
def test_each_daemon_takes_its_command_line(role, name, pod_env, rank, tmp_path):
    """The container's command, run through sh as the pod would (its environment: the pod's IP,
    the name or completion index), with the daemon from this build and --get instead of
    starting: the config parses, the rank and the announced address are the pod's."""
    if not DAEMONS[role].exists():
        pytest.skip(f"{DAEMONS[role]} is not built")
    o = objects()
    job = tmp_path / "job.yaml"
    job.write_text(o[("ConfigMap", "sparseps-job")]["data"]["job.yaml"])
    container = pod_spec(o[name])["containers"][0]
    assert container["command"][:2] == ["sh", "-c"]
    script = container["command"][2]
    assert re.match(rf"exec sparseps-{role} ", script), script
    script = (script.replace(f"sparseps-{role}", str(DAEMONS[role]), 1)
              .replace("/etc/sparseps/job.yaml", str(job))
              + " --get node.host --get node.rank --get cluster.num_workers")
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["SPARSEPS_BIND_HOST"] == "0.0.0.0"
    r = subprocess.run(["sh", "-c", script], capture_output=True, text=True, timeout=60,
                       env={"PATH": os.environ["PATH"], "POD_IP": "10.244.1.7",
                            "SPARSEPS_BIND_HOST": "0.0.0.0", **pod_env})
    assert r.returncode == 0, r.stderr
    host, node_rank, workers = r.stdout.split()
    assert host == "10.244.1.7"
    assert node_rank == (rank or "-1")
    assert int(workers) == 2
