"""The deployment files: dashboard and docs name only exported metrics, the
Kubernetes manifests validate against the Kubernetes schemas and agree with
each other and with the settings tree, and the systemd unit is well formed."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry

from cachefsd.config import Settings, load_mounts, load_settings
from cachefsd.metrics import Metrics

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "cachefsd.json"
KUBERNETES = ROOT / "deploy" / "kubernetes"
SCRAPE = ROOT / "deploy" / "prometheus" / "scrape.yaml"
UNIT = ROOT / "systemd" / "cachefsd.service"
DOC_DIR = ROOT / "doc"
DOCS = (ROOT / "README.md", ROOT / "SEMANTICS.md", *sorted(DOC_DIR.glob("*.md")))
# The oldest Kubernetes release the manifests are meant for.
KUBERNETES_VERSION = "1.30.0"
METRIC_NAME = re.compile(r"\bcachefsd_[a-z0-9_]*[a-z0-9]")
# Settings that give a service its own mount namespace, from which mounts do
# not propagate to the host (systemd.exec(5), MountFlags=): with any of them
# the FUSE mount would be invisible outside the service.
MOUNT_NAMESPACE_SETTINGS = (
    "BindPaths",
    "BindReadOnlyPaths",
    "DynamicUser",
    "ExecPaths",
    "InaccessiblePaths",
    "MountFlags",
    "NoExecPaths",
    "PrivateDevices",
    "PrivateMounts",
    "PrivateTmp",
    "ProcSubset",
    "ProtectControlGroups",
    "ProtectHome",
    "ProtectKernelLogs",
    "ProtectKernelModules",
    "ProtectKernelTunables",
    "ProtectProc",
    "ProtectSystem",
    "ReadOnlyPaths",
    "ReadWritePaths",
    "RootDirectory",
    "RootImage",
    "TemporaryFileSystem",
)


# -- metric names ------------------------------------------------------------


def exported_names() -> set[str]:
    """Every series name the daemon's registry exposes, plus each
    histogram's own name (the name documentation uses for it)."""
    suffixes = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created")}
    names: set[str] = set()
    metrics = Metrics(CollectorRegistry())
    # Series the daemon adds once it knows its mounts.
    metrics.watch_residency("/mnt/data", "s3://bucket", lambda: [("train", "hot", 1)])
    metrics.for_mount("/mnt/data")
    for family in metrics.registry.collect():
        if family.type != "counter":
            names.add(family.name)
        names.update(family.name + suffix for suffix in suffixes.get(family.type, ()))
        names.update(sample.name for sample in family.samples)
    return names


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def walk(node: Any) -> Iterator[tuple[str, Any]]:
    """Every (key, value) pair in a JSON tree."""
    if isinstance(node, dict):
        for key, value in node.items():
            yield key, value
            yield from walk(value)
    elif isinstance(node, list):
        for item in node:
            yield from walk(item)


def dashboard_queries() -> list[str]:
    """The PromQL of every panel target and of the template variables."""
    board = dashboard()
    queries = [value for key, value in walk(board["panels"]) if key == "expr"]
    for variable in board["templating"]["list"]:
        if variable["type"] == "query":
            queries.append(variable["definition"])
            query = variable["query"]
            queries.append(query["query"] if isinstance(query, dict) else query)
    return queries


def panels() -> list[dict[str, Any]]:
    return [panel for panel in dashboard()["panels"] if panel["type"] != "row"]


def test_exported_names_follow_the_exposition_format() -> None:
    names = exported_names()
    assert "cachefsd_read_stall_seconds_total" in names
    assert "cachefsd_fetch_seconds_bucket" in names
    assert "cachefsd_tier_used_bytes" in names
    assert "cachefsd_read_stall_seconds" not in names  # a counter is only queryable with _total


def test_dashboard_uses_only_exported_metrics() -> None:
    used = {name for query in dashboard_queries() for name in METRIC_NAME.findall(query)}
    assert used, "no cachefsd_ metric found in the dashboard"
    assert used <= exported_names(), f"not exported by the daemon: {sorted(used - exported_names())}"


def test_dashboard_covers_the_signals_users_watch() -> None:
    queries = "\n".join(dashboard_queries())
    for needed in (
        "cachefsd_served_bytes_total",
        "histogram_quantile(0.99, sum by (le, kind) (rate(cachefsd_fetch_seconds_bucket",
        "rate(cachefsd_read_stall_seconds_total",
        "cachefsd_prefetch_used_bytes_total",
        "cachefsd_prefetch_issued_bytes_total",
        "cachefsd_prefetch_wasted_bytes_total",
        "cachefsd_tier_used_bytes",
        "cachefsd_tier_capacity_bytes",
        "cachefsd_cache_evictions_total",
        "cachefsd_cache_promotions_total",
        "cachefsd_cache_demotions_total",
        "rate(cachefsd_job_data_wait_seconds_total",
        "rate(cachefsd_job_step_seconds_total",
        "cachefsd_staged_bytes",
        "rate(cachefsd_upload_bytes_total",
        "cachefsd_uploads_in_flight",
        'rate(cachefsd_uploads_total{node=~"$node", result="failed"}',
        "cachefsd_upload_oldest_pending_seconds",
        "histogram_quantile(0.99, sum by (le, node, mount) (rate(cachefsd_upload_seconds_bucket",
    ):
        assert needed in queries, needed
    assert any(panel["type"] == "heatmap" for panel in panels())


def test_dashboard_shows_write_metrics_per_mount() -> None:
    """A node's writable mounts upload to different buckets: summed
    together, one failing bucket would hide behind another's throughput."""
    writes = [query for query in dashboard_queries() if re.search(r"cachefsd_(staged|upload)", query)]
    assert len(writes) >= 6
    for query in writes:
        assert re.search(r"by \([^)]*\bmount\b", query), query


def test_dashboard_is_per_node_on_a_chosen_datasource() -> None:
    board = dashboard()
    assert [item["name"] for item in board["__inputs"]] == ["DS_PROMETHEUS"]
    variables = {variable["name"]: variable for variable in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    assert variables["node"]["multi"]
    assert variables["node"]["includeAll"]
    ids = [panel["id"] for panel in board["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in panels():
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}", panel["title"]
            assert 'node=~"$node"' in target["expr"], panel["title"]


@pytest.mark.parametrize("doc", DOCS, ids=lambda path: path.name)
def test_docs_name_only_exported_metrics(doc: Path) -> None:
    named = set(METRIC_NAME.findall(doc.read_text()))
    assert named <= exported_names(), (
        f"{doc.name} names unexported metrics: {sorted(named - exported_names())}"
    )


def test_deployment_doc_names_existing_files() -> None:
    page = (DOC_DIR / "deployment.md").read_text()
    paths = set(re.findall(r"`((?:deploy|systemd)/[^`\s]+)`", page))
    assert paths
    missing = sorted(path for path in paths if not (ROOT / path).exists())
    assert not missing, missing


# -- Kubernetes --------------------------------------------------------------


def manifests() -> list[tuple[str, dict[str, Any]]]:
    documents = []
    for path in sorted(KUBERNETES.glob("*.yaml")):
        for document in yaml.safe_load_all(path.read_text()):
            if document:
                documents.append((path.name, document))
    return documents


def resource(kind: str, name: str | None = None) -> dict[str, Any]:
    found = [doc for _, doc in manifests() if doc["kind"] == kind and name in (None, doc["metadata"]["name"])]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def container(pod_spec: dict[str, Any], name: str) -> dict[str, Any]:
    return next(c for c in pod_spec["containers"] if c["name"] == name)


def daemon_spec() -> dict[str, Any]:
    return resource("DaemonSet", "cachefsd")["spec"]["template"]["spec"]


def daemon_env() -> dict[str, str]:
    return {item["name"]: item["value"] for item in container(daemon_spec(), "cachefsd")["env"]}


# Custom resources have no schema among Kubernetes' own (the ServiceMonitor
# is checked by test_servicemonitor_selects_the_service).
CUSTOM_API_GROUPS = ("monitoring.coreos.com/",)


@pytest.mark.parametrize(
    "document",
    [
        pytest.param(doc, id=f"{name}:{doc['kind']}")
        for name, doc in manifests()
        if not doc["apiVersion"].startswith(CUSTOM_API_GROUPS)
    ],
)
def test_manifest_validates_against_the_kubernetes_schema(document: dict[str, Any]) -> None:
    """Strict: an unknown or misspelt field fails too. The schemas ship with
    kubernetes-validate, so this needs no cluster and no network."""
    import kubernetes_validate  # noqa: PLC0415 - only this test needs it

    problem = None
    try:
        kubernetes_validate.validate(document, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as exc:  # its repr holds the whole schema
        problem = f"{'.'.join(str(part) for part in exc.path)}: {exc.message}"
    if problem:
        pytest.fail(f"{document['kind']} {document['metadata']['name']}: {problem}", pytrace=False)


def test_manifests_include_the_expected_resources() -> None:
    kinds = sorted(doc["kind"] for _, doc in manifests())
    assert kinds == sorted(
        [
            "ConfigMap",
            "DaemonSet",
            "Namespace",
            "NetworkPolicy",
            "Pod",
            "Service",
            "ServiceAccount",
            "ServiceMonitor",
        ]
    )


def test_servicemonitor_selects_the_service() -> None:
    monitor = resource("ServiceMonitor")
    service = resource("Service", "cachefsd-metrics")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["namespace"] == service["metadata"]["namespace"]
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert selector.items() <= service["metadata"]["labels"].items()
    assert service["metadata"]["namespace"] in monitor["spec"]["namespaceSelector"]["matchNames"]
    port_names = {port["name"] for port in service["spec"]["ports"]}
    for endpoint in monitor["spec"]["endpoints"]:
        assert endpoint["port"] in port_names
        assert endpoint.get("path", "/metrics") == "/metrics"
        assert any(item["targetLabel"] == "node" for item in endpoint["relabelings"])


def test_service_reaches_the_daemons_metrics_port() -> None:
    service = resource("Service", "cachefsd-metrics")["spec"]
    template = resource("DaemonSet", "cachefsd")["spec"]["template"]
    assert service["clusterIP"] == "None", "headless: one scrape target per node"
    assert service["selector"].items() <= template["metadata"]["labels"].items()
    ports = {port["name"]: port["containerPort"] for port in container(template["spec"], "cachefsd")["ports"]}
    for port in service["ports"]:
        assert ports[port["targetPort"]] == port["port"]


@pytest.fixture(name="daemon_mounts")
def fixture_daemon_mounts(tmp_path: Path) -> list[Settings]:
    """The DaemonSet's mounts, loaded as its daemon loads them: the
    ConfigMap's TOML and the container's environment."""
    config = tmp_path / "cachefsd.toml"
    config.write_text(resource("ConfigMap", "cachefsd-config")["data"]["cachefsd.toml"])
    return load_mounts(config, {}, environ=daemon_env())


@pytest.fixture(name="daemon_settings")
def fixture_daemon_settings(daemon_mounts: list[Settings]) -> Settings:
    return daemon_mounts[0]


def daemon_mountpoints() -> list[Path]:
    return [Path(path) for path in daemon_env()["MOUNTPOINTS"].split()]


def test_daemonset_creates_probes_and_reads_every_mount_of_its_config(daemon_mounts: list[Settings]) -> None:
    assert len(daemon_mounts) > 1, "the example shows a node's several datasets on one cache"
    assert [settings.mountpoint for settings in daemon_mounts] == daemon_mountpoints()
    script = " ".join(container(daemon_spec(), "cachefsd")["args"])
    assert "for mountpoint in $MOUNTPOINTS" in script
    probe = " ".join(container(daemon_spec(), "cachefsd")["readinessProbe"]["exec"]["command"])
    assert "for m in $MOUNTPOINTS" in probe


def test_daemonset_settings_are_valid_and_match_the_volumes(daemon_settings: Settings) -> None:
    settings = daemon_settings
    spec = daemon_spec()
    daemon = container(spec, "cachefsd")
    mounts = {mount["name"]: mount for mount in daemon["volumeMounts"]}
    volumes = {volume["name"]: volume for volume in spec["volumes"]}
    # Metrics on the container port, reachable from outside the pod.
    host, _, port = settings.metrics.addr.rpartition(":")
    assert host == "0.0.0.0"
    assert {"name": "metrics", "containerPort": int(port), "protocol": "TCP"} in daemon["ports"]
    # Training pods run as other users.
    assert settings.fuse.allow_other
    # Every cache directory is on a hostPath volume, so the cache outlives the pod.
    host_mounts = [mounts[name]["mountPath"] for name, volume in volumes.items() if "hostPath" in volume]
    cache_dirs = [settings.cache.dir] + [tier.dir for _, tier in settings.cache.tiers()]
    for directory in cache_dirs:
        assert any(directory.is_relative_to(path) for path in host_mounts), directory
    # The config file the command names is the ConfigMap's.
    assert mounts["config"]["mountPath"] == "/etc/cachefsd"
    assert volumes["config"]["configMap"]["name"] == "cachefsd-config"


def test_daemonset_mounts_on_the_node_and_unmounts_on_sigterm() -> None:
    spec = daemon_spec()
    daemon = container(spec, "cachefsd")
    script = " ".join(daemon["command"] + daemon["args"])
    assert "exec cachefsd mount" in script, "exec: cachefsd must be the process that gets SIGTERM"
    assert "--foreground" in script
    assert "--config /etc/cachefsd/cachefsd.toml" in script
    assert daemon["securityContext"]["privileged"] is True
    assert spec["terminationGracePeriodSeconds"] >= 30
    assert daemon["resources"]["requests"]
    assert daemon["resources"]["limits"]
    shared = [mount for mount in daemon["volumeMounts"] if mount.get("mountPropagation") == "Bidirectional"]
    assert len(shared) == 1
    assert all(mountpoint.parent == Path(shared[0]["mountPath"]) for mountpoint in daemon_mountpoints())


def test_training_pod_reads_the_mount_with_host_to_container_propagation() -> None:
    daemon_volumes = {volume["name"]: volume for volume in daemon_spec()["volumes"]}
    shared = next(
        mount
        for mount in container(daemon_spec(), "cachefsd")["volumeMounts"]
        if mount.get("mountPropagation") == "Bidirectional"
    )
    node_path = Path(daemon_volumes[shared["name"]]["hostPath"]["path"])
    # The daemon's first mountpoint, as a path on the node.
    mountpoint = node_path / daemon_mountpoints()[0].relative_to(shared["mountPath"])

    pod = resource("Pod")["spec"]
    volumes = {volume["name"]: volume for volume in pod["volumes"]}
    train = container(pod, "train")
    reads = [mount for mount in train["volumeMounts"] if "hostPath" in volumes[mount["name"]]]
    assert len(reads) == 1
    mount = reads[0]
    assert mount["mountPropagation"] == "HostToContainer"
    assert mount["readOnly"] is True
    assert Path(volumes[mount["name"]]["hostPath"]["path"]) == node_path
    in_pod = Path(mount["mountPath"]) / mountpoint.relative_to(node_path)
    assert str(in_pod) in train["command"], "the training command reads the dataset through the mount"
    wait = " ".join(pod["initContainers"][0]["command"])
    assert f" {in_pod} fuse.cachefsd " in wait
    assert pod["nodeSelector"] == daemon_spec()["nodeSelector"]


def test_networkpolicy_admits_only_the_metrics_port(daemon_settings: Settings) -> None:
    policy = resource("NetworkPolicy")["spec"]
    assert policy["policyTypes"] == ["Ingress"]
    port = int(daemon_settings.metrics.addr.rpartition(":")[2])
    assert [p["port"] for rule in policy["ingress"] for p in rule["ports"]] == [port]


# -- Prometheus --------------------------------------------------------------


def test_scrape_config_labels_every_target_with_its_node() -> None:
    jobs = yaml.safe_load(SCRAPE.read_text())["scrape_configs"]
    names = [job["job_name"] for job in jobs]
    assert len(names) == len(set(names))
    namespace = resource("Namespace")["metadata"]["name"]
    for job in jobs:
        assert job.get("metrics_path", "/metrics") == "/metrics"
        assert any(rule.get("target_label") == "node" for rule in job["relabel_configs"]), job["job_name"]
        for discovery in job.get("kubernetes_sd_configs", []):
            assert discovery["namespaces"]["names"] == [namespace]
    host_regex = next(
        rule["regex"] for rule in jobs[0]["relabel_configs"] if rule.get("target_label") == "node"
    )
    match = re.fullmatch(host_regex, "gpu-node-1.example.internal:9468")
    assert match is not None
    assert match.group(1) == "gpu-node-1.example.internal"


# -- systemd -----------------------------------------------------------------


def unit_entries() -> dict[str, list[tuple[str, str]]]:
    """Sections of the unit file, each a list of (key, value), repeats kept."""
    sections: dict[str, list[tuple[str, str]]] = {}
    current = None
    for raw in UNIT.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            current = line[1:-1]
            sections.setdefault(current, [])
            continue
        assert current is not None, f"{line!r} outside a section"
        assert not line.endswith("\\"), "keep each setting on one line"
        key, sep, value = line.partition("=")
        assert sep, f"not a key=value line: {line!r}"
        sections[current].append((key.strip(), value.strip()))
    return sections


def unit_values(section: str, key: str) -> list[str]:
    return [value for name, value in unit_entries()[section] if name == key]


def test_unit_is_a_notify_service_that_mounts_its_configs_mounts_in_the_foreground() -> None:
    assert unit_values("Service", "Type") == ["notify"]
    assert unit_values("Service", "NotifyAccess") == ["main"]
    assert unit_values("Service", "Restart") == ["on-failure"]
    assert unit_values("Service", "EnvironmentFile") == ["-/etc/cachefsd/cachefsd.env"]
    [exec_start] = unit_values("Service", "ExecStart")
    words = exec_start.split()
    assert Path(words[0]).name == "cachefsd"
    assert words[1] == "mount"
    assert "--foreground" in words
    assert words[words.index("--config") + 1] == "/etc/cachefsd/cachefsd.toml"
    # A crashed daemon's mounts are detached before a start and after a stop.
    cleanup = f"{words[0]} unmount --config /etc/cachefsd/cachefsd.toml"
    assert unit_values("Service", "ExecStartPre") == [f"-+{cleanup}"]
    assert unit_values("Service", "ExecStopPost") == [f"-+{cleanup}"]
    assert unit_values("Install", "WantedBy") == ["multi-user.target"]


def test_unit_hardening_still_allows_fuse() -> None:
    assert unit_values("Service", "DeviceAllow") == ["/dev/fuse rwm"]
    assert unit_values("Service", "DevicePolicy") == ["closed"]
    assert "CAP_SYS_ADMIN" in unit_values("Service", "CapabilityBoundingSet")[0].split()
    filters = " ".join(unit_values("Service", "SystemCallFilter")).split()
    assert "@mount" in filters
    assert unit_values("Service", "NoNewPrivileges") == ["yes"]
    present = sorted({key for key, _ in unit_entries()["Service"]} & set(MOUNT_NAMESPACE_SETTINGS))
    assert not present, f"{present} would hide the FUSE mount from the host (private mount namespace)"


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_systemd_analyze_verify(tmp_path: Path) -> None:
    # verify checks that ExecStart's program exists: point it at the one
    # installed with this package instead of /usr/local/bin.
    installed = shutil.which("cachefsd") or str(Path(sys.executable).parent / "cachefsd")
    assert Path(installed).exists()
    [exec_start] = unit_values("Service", "ExecStart")
    text = UNIT.read_text().replace(exec_start.split()[0], installed)
    unit = tmp_path / UNIT.name
    unit.write_text(text)
    result = subprocess.run(
        ["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60, check=False
    )
    # verify exits 0 on unknown keys and bad values; it only warns about them.
    problems = [line for line in (result.stdout + result.stderr).splitlines() if UNIT.name in line]
    assert result.returncode == 0, result.stderr
    assert not problems, "\n".join(problems)


def test_the_configuration_example_is_valid(tmp_path: Path) -> None:
    """Users copy it whole."""
    page = (DOC_DIR / "configuration.md").read_text()
    start = page.index("```toml\n") + len("```toml\n")
    config = tmp_path / "cachefsd.toml"
    config.write_text(page[start : page.index("```", start)])
    required = {"source": "s3://bucket", "mountpoint": str(tmp_path / "mnt")}
    settings = load_settings(config, required, environ={})
    assert settings.cache.hot is not None
    assert settings.cache.warm is not None


def test_the_mounts_example_is_valid(tmp_path: Path) -> None:
    page = (DOC_DIR / "configuration.md").read_text()
    section = page[page.index("## One daemon, many mounts") :]
    start = section.index("```toml\n") + len("```toml\n")
    config = tmp_path / "node.toml"
    config.write_text(section[start : section.index("```", start)])
    mounts = load_mounts(config, {}, environ={})
    assert [settings.mountpoint for settings in mounts] == [Path("/mnt/imagenet"), Path("/mnt/c4")]
    assert mounts[1].prefetch.lookahead == 8 << 30
