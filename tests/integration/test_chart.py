"""The Helm chart charts/rtj-operator, checked with the real helm and against the real API server.

Offline (helm only): the chart lints; it renders with default values and with namespaced RBAC; the
values schema refuses bad values by name; every key of values.yaml is in the schema and back; and
the RTJ_OPERATOR_* environment the chart gives the operator is accepted by the operator's own
settings loader (so a renamed setting cannot silently break the Deployment).

Against the cluster (session fixture `cluster`): `helm install` makes the Deployment, the
ServiceAccount and the RBAC objects; `kubectl auth can-i`, asked as the chart's ServiceAccount,
shows the operator can do what it needs and nothing more; `helm uninstall` removes it all. These
releases pin the operator pods to a node that does not exist (nothing here needs them running);
tests/e2e/test_operator_chart.py runs the chart's operator pods and jobs under them.
"""

from __future__ import annotations

import json
import subprocess
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml
from harness.cluster import Cluster
from rtj_operator.config import ENV_PREFIX, OperatorSettings, label_map, load_settings

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "rtj-operator"
GROUP = "training.resilient.dev"
# Keeps the operator pod Pending: no harness node carries this label, so nothing starts it.
NOWHERE = ["--set-string", "nodeSelector.rtj-test/never-schedule=true"]

Manifest = dict[str, Any]
MONITORING_ON = ("metrics.prometheusRule.enabled=true,metrics.grafanaDashboard.enabled=true,"
                 "metrics.trainers.podMonitor.enabled=true")
MONITORING_CRDS = REPO / "tests" / "integration" / "fixtures" / "monitoring-crds.yaml"


@pytest.fixture(scope="module")
def bin_dir() -> Path:
    """The project's kubectl and helm (hack/build-testbin.sh; returns at once when built)."""
    from harness.controlplane import ensure_binaries

    return ensure_binaries()


@pytest.fixture(scope="module")
def helm_binary(bin_dir: Path) -> Path:
    return bin_dir / "helm"


def run(argv: list[str]) -> subprocess.CompletedProcess[str]:
    """Run a command, capturing its output; never raises on a non-zero exit."""
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)


def render(helm: Path, *values: str, namespace: str = "ops") -> list[Manifest]:
    out = run([str(helm), "template", "rel", str(CHART), "--namespace", namespace, *values])
    assert out.returncode == 0, out.stderr
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


def by_kind(manifests: list[Manifest]) -> dict[str, list[Manifest]]:
    kinds: dict[str, list[Manifest]] = {}
    for manifest in manifests:
        kinds.setdefault(manifest["kind"], []).append(manifest)
    return kinds


def operator_container(manifests: list[Manifest]) -> Manifest:
    (deployment,) = by_kind(manifests)["Deployment"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert isinstance(container, dict)
    return container


def operator_env(manifests: list[Manifest], namespace: str = "ops",
                 pod_ip: str = "10.1.2.3") -> dict[str, str]:
    """The container's environment as a kubelet resolves it: the downward API (namespace, pod IP)
    and `$(VAR)` references to earlier variables."""
    fields = {"metadata.namespace": namespace, "status.podIP": pod_ip}
    env: dict[str, str] = {}
    for entry in operator_container(manifests)["env"]:
        if "value" in entry:
            value = str(entry["value"])
            for name, known in env.items():
                value = value.replace(f"$({name})", known)
            env[entry["name"]] = value
        elif "fieldRef" in entry.get("valueFrom", {}):
            env[entry["name"]] = fields[entry["valueFrom"]["fieldRef"]["fieldPath"]]
    return env


def rules_of(role: Manifest) -> list[tuple[str, str, frozenset[str]]]:
    """(apiGroup, resource, verbs) for every group/resource pair a Role or ClusterRole grants."""
    return [
        (group, resource, frozenset(rule["verbs"]))
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
    ]


# --- offline: helm lint / template / schema ----------------------------------------------------


def test_helm_lint_passes_with_default_and_with_every_optional_part_on(helm_binary: Path) -> None:
    for extra in ([], ["--set", "rbac.clusterScoped=false,metrics.serviceMonitor.enabled=true,"
                       f"{MONITORING_ON}"]):
        out = run([str(helm_binary), "lint", "--strict", str(CHART), *extra])
        assert out.returncode == 0, out.stdout + out.stderr
        assert "0 chart(s) failed" in out.stdout


def test_default_render_is_two_leader_elected_replicas_with_probe_ports_and_locked_down_security(
    helm_binary: Path,
) -> None:
    manifests = render(helm_binary)
    kinds = by_kind(manifests)
    assert set(kinds) == {
        "ServiceAccount",
        "ClusterRole",
        "ClusterRoleBinding",
        "Role",  # the Lease, in the release namespace
        "RoleBinding",
        "Service",
        "Deployment",
        "PodDisruptionBudget",
    }
    (deployment,) = kinds["Deployment"]
    assert deployment["spec"]["replicas"] == 2
    assert deployment["spec"]["strategy"] == {
        "type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
    (budget,) = kinds["PodDisruptionBudget"]
    assert budget["spec"] == {"minAvailable": 1,
                              "selector": deployment["spec"]["selector"]}
    (lease_role,) = kinds["Role"]
    assert {(g, r, v) for g, r, v in rules_of(lease_role)} == {
        ("coordination.k8s.io", "leases", frozenset({"create"})),
        ("coordination.k8s.io", "leases", frozenset({"get", "update"})),
    }
    assert lease_role["rules"][1]["resourceNames"] == ["rel-rtj-operator"]
    pod = deployment["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "rel-rtj-operator"
    assert pod["securityContext"]["runAsNonRoot"] is True
    container = operator_container(manifests)
    # The tag defaults to the chart's appVersion.
    assert container["image"] == "ghcr.io/resilient-training/rtj-operator:0.1.0"
    assert container["command"] == ["python", "-m", "rtj_operator"]  # the image's ENTRYPOINT
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"healthz": 8080, "metrics": 9090}
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "healthz"}
    security = container["securityContext"]
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"]["drop"] == ["ALL"]
    (service,) = kinds["Service"]
    assert service["spec"]["ports"][0]["port"] == 9090
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]


def test_default_rbac_splits_framework_and_application_into_cluster_roles(
    helm_binary: Path,
) -> None:
    roles = {r["metadata"]["name"]: r for r in by_kind(render(helm_binary))["ClusterRole"]}
    assert set(roles) == {"rel-rtj-operator-framework", "rel-rtj-operator-application"}
    framework = rules_of(roles["rel-rtj-operator-framework"])
    assert ("apiextensions.k8s.io", "customresourcedefinitions", {"list", "watch"}) in [
        (g, r, set(v)) for g, r, v in framework
    ]
    assert not [r for _, r, _ in framework if "peering" in r]  # standalone: no kopf peering
    application = {(g, r): v for g, r, v in rules_of(roles["rel-rtj-operator-application"])}
    # Only the verbs kopf and the operator use (the e2e tests run jobs with exactly these).
    assert application[(GROUP, "resilienttrainingjobs")] == {
        "list", "watch", "patch", "delete",  # delete: ttlSecondsAfterFinished
    }  # fmt: skip
    assert application[(GROUP, "resilienttrainingjobs/status")] == {"patch"}
    assert application[(GROUP, "resilienttrainingjobs/finalizers")] == {"update"}
    # get: only after a create answered 409, to tell the job's own object from another's.
    assert application[("", "pods")] == {"list", "watch", "get", "create", "delete"}
    assert application[("", "services")] == {"list", "watch", "get", "create", "delete",
                                              "patch"}
    assert application[("", "persistentvolumeclaims")] == {
        "list", "watch", "get", "create", "delete", "patch"}
    assert application[("networking.k8s.io", "networkpolicies")] == {"get", "create", "update"}
    assert application[("", "events")] == {"create"}
    assert ("", "secrets") not in application
    assert application[("", "nodes")] == {"list"}  # lost nodes; read only
    # Kueue (docs/kueue.md): each queued job's Workload, fetched by name, never listed.
    assert application[("kueue.x-k8s.io", "workloads")] == {"get", "create", "patch"}
    assert application[("kueue.x-k8s.io", "workloads/status")] == {"patch"}
    assert ("kueue.x-k8s.io", "resourceflavors", frozenset({"get"})) in framework


def test_namespaced_rbac_renders_roles_in_the_release_namespace_and_watches_only_it(
    helm_binary: Path,
) -> None:
    manifests = render(helm_binary, "--set", "rbac.clusterScoped=false", namespace="team-a")
    kinds = by_kind(manifests)
    roles = kinds["Role"]
    assert {r["metadata"]["name"] for r in roles} == {
        "rel-rtj-operator-framework",
        "rel-rtj-operator-application",
        "rel-rtj-operator-leader-election",
    }
    assert {r["metadata"]["namespace"] for r in roles + kinds["RoleBinding"]} == {"team-a"}
    # Only the read-only CRD and ResourceFlavor rules stay cluster-wide: both are cluster-scoped.
    (cluster_role,) = kinds["ClusterRole"]
    assert [r for _, r, _ in rules_of(cluster_role)] == ["customresourcedefinitions",
                                                         "resourceflavors"]
    application = next(r for r in roles if r["metadata"]["name"].endswith("-application"))
    assert "nodes" not in [r for _, r, _ in rules_of(application)]  # cluster-scoped objects
    assert operator_env(manifests, "team-a")["RTJ_OPERATOR_NAMESPACE"] == "team-a"


def test_service_monitor_is_off_by_default_and_selects_the_metrics_service_when_on(
    helm_binary: Path,
) -> None:
    assert "ServiceMonitor" not in by_kind(render(helm_binary))
    kinds = by_kind(render(helm_binary, "--set", "metrics.serviceMonitor.enabled=true"))
    (monitor,) = kinds["ServiceMonitor"]
    (service,) = kinds["Service"]
    assert monitor["spec"]["endpoints"][0]["port"] == service["spec"]["ports"][0]["name"]
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert selector.items() <= service["metadata"]["labels"].items()


def test_trainer_scraping_is_off_by_default_and_reaches_every_rank_when_on(
    helm_binary: Path,
) -> None:
    # review-2: Prometheus could scrape no rank (the policy admitted only the operator) while
    # the dashboard queried rtj_trainer_*. A PodMonitor names every rank's container port, and
    # the operator is told which Prometheus each job's NetworkPolicy admits.
    defaults = render(helm_binary)
    assert "PodMonitor" not in by_kind(defaults)
    assert not any(k.startswith("RTJ_OPERATOR_NETWORK_POLICY_SCRAPER")
                   for k in operator_env(defaults))
    manifests = render(helm_binary, "--set", "metrics.trainers.podMonitor.enabled=true,"
                       "metrics.trainers.podMonitor.ranksPerPod=4,"
                       "metrics.trainers.prometheus.namespace=monitoring,"
                       "metrics.trainers.prometheus.podLabels.app=prometheus")
    (monitor,) = by_kind(manifests)["PodMonitor"]
    assert monitor["spec"]["selector"]["matchLabels"] == {"training.resilient.dev/role": "trainer"}
    assert monitor["spec"]["namespaceSelector"] == {"any": True}
    assert [e["port"] for e in monitor["spec"]["podMetricsEndpoints"]] == [
        f"metrics-{r}" for r in range(4)]
    # The names are the trainer container's port names.
    from rtj_operator import builders
    from rtj_operator.api.models import parse_job
    from rtj_operator.podplan import plan_for
    job = parse_job({"apiVersion": "training.resilient.dev/v1alpha1",
                     "kind": "ResilientTrainingJob",
                     "metadata": {"name": "j", "namespace": "ml", "uid": "u"},
                     "spec": {"nodes": 1, "procsPerNode": 4, "image": "i",
                              "checkpoint": {"claimName": "c"}}})
    settings = load_settings({k: v for k, v in operator_env(manifests).items()
                              if k.startswith(ENV_PREFIX)})
    pod = builders.trainer_pod(job, plan=plan_for(job, settings), node_index=0, attempt=0,
                               settings=settings)
    assert [p["name"] for p in pod["spec"]["containers"][0]["ports"]] == [
        e["port"] for e in monitor["spec"]["podMetricsEndpoints"]]
    assert (settings.network_policy_scraper_namespace,
            settings.network_policy_scraper_labels) == ("monitoring", "app=prometheus")
    policy = builders.network_policy(job, plan=plan_for(job, settings), settings=settings)
    assert policy["spec"]["ingress"][-1]["ports"] == [
        {"protocol": "TCP", "port": settings.trainer_metrics_port,
         "endPort": settings.trainer_metrics_port + 3}]
    namespaced = render(helm_binary, "--set", "metrics.trainers.podMonitor.enabled=true,"
                        "rbac.clusterScoped=false", namespace="team-a")
    (monitor,) = by_kind(namespaced)["PodMonitor"]
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": ["team-a"]}


def test_alerts_and_dashboard_are_off_by_default_and_rendered_when_on(helm_binary: Path) -> None:
    kinds = by_kind(render(helm_binary))
    assert "PrometheusRule" not in kinds and "ConfigMap" not in kinds
    kinds = by_kind(render(helm_binary, "--set", MONITORING_ON))
    (rule,) = kinds["PrometheusRule"]
    alerts = {r["alert"] for g in rule["spec"]["groups"] for r in g["rules"]}
    assert alerts == {"RTJCheckpointStale", "RTJRestartStorm", "RTJJobStuckRecovering",
                      "RTJJobStuckPending"}
    (dashboard,) = kinds["ConfigMap"]
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    panels = json.loads(dashboard["data"]["rtj-operator.json"])["panels"]
    assert len(panels) >= 8


def test_monitoring_objects_are_accepted_by_the_api_server_with_their_crds(
    cluster: Cluster, helm_binary: Path
) -> None:
    """The ServiceMonitor and PrometheusRule as rendered, checked by the real API server against
    the monitoring.coreos.com CRDs (tests/integration/fixtures), strictly (no unknown field)."""
    cluster.kubectl("apply", "--server-side", "-f", str(MONITORING_CRDS))
    for crd in ("servicemonitors", "prometheusrules", "podmonitors"):
        cluster.kubectl("wait", "--for=condition=Established", "--timeout=60s",
                        f"crd/{crd}.monitoring.coreos.com")
    namespace = cluster.create_namespace("monitoring")
    try:
        manifests = render(helm_binary, "--set", f"metrics.serviceMonitor.enabled=true,"
                           f"{MONITORING_ON}", namespace=namespace)
        wanted = [m for m in manifests
                  if m["kind"] in ("ServiceMonitor", "PrometheusRule", "ConfigMap", "PodMonitor")]
        assert sorted(m["kind"] for m in wanted) == ["ConfigMap", "PodMonitor", "PrometheusRule",
                                                     "ServiceMonitor"]
        body = "\n---\n".join(yaml.safe_dump(m) for m in wanted)
        out = cluster.kubectl("apply", "--dry-run=server", "--validate=strict", "-n", namespace,
                              "-f", "-", input=body, check=False)
        assert out.returncode == 0, out.stdout + out.stderr
        # And a rule the schema refuses is refused (the CRDs are not a rubber stamp).
        (rule,) = [m for m in wanted if m["kind"] == "PrometheusRule"]
        rule["spec"]["groups"][0]["rules"][0]["for"] = "ten minutes"
        bad = cluster.kubectl("apply", "--dry-run=server", "-n", namespace, "-f", "-",
                              input=yaml.safe_dump(rule), check=False)
        assert bad.returncode != 0 and "for" in bad.stderr, bad.stdout + bad.stderr
    finally:
        cluster.delete_namespace(namespace)


@pytest.mark.parametrize(
    ("setting", "named_in_error"),
    [
        ("operator.livenessPort=not-a-port", "livenessPort"),
        ("operator.metricsPort=70000", "metricsPort"),
        ("imagee.tag=v1", "imagee"),  # a typo in a key fails instead of being ignored
        ("image.tag=latest", "/image/tag"),
    ],
)
def test_values_schema_rejects_a_bad_value_and_names_it(
    helm_binary: Path, setting: str, named_in_error: str
) -> None:
    out = run([str(helm_binary), "template", "rel", str(CHART), "--set", setting])
    assert out.returncode != 0
    assert "schema" in out.stderr and named_in_error in out.stderr, out.stderr


def _leaf_paths(values: Mapping[str, Any], prefix: str = "") -> set[str]:
    paths = set()
    for key, value in values.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            paths |= _leaf_paths(value, path + ".")
        else:
            paths.add(path)
    return paths


def _schema_paths(schema: Mapping[str, Any], prefix: str = "") -> set[str]:
    paths = set()
    for key, sub in schema.get("properties", {}).items():
        path = f"{prefix}{key}"
        if sub.get("additionalProperties") is False and "properties" in sub:
            paths |= _schema_paths(sub, path + ".")
        else:
            paths.add(path)
    return paths


def test_every_values_key_is_in_the_schema_and_every_schema_key_in_the_values() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    schema = json.loads((CHART / "values.schema.json").read_text())
    assert schema["additionalProperties"] is False
    # Free-form Kubernetes objects (resources, securityContext, ...) count as one leaf each.
    schema_paths = _schema_paths(schema) - {"global"}
    value_paths = {
        next((p for p in schema_paths if path.startswith(p + ".")), path)
        for path in _leaf_paths(values)
    }
    assert value_paths == schema_paths


def test_the_operator_accepts_the_environment_the_chart_gives_it(helm_binary: Path) -> None:
    manifests = render(
        helm_binary,
        "--set",
        "operator.reconcileIntervalSeconds=0.5,operator.watchNamespace=jobs,"
        "operator.livenessPort=18080,operator.metricsPort=19090",
    )
    env = operator_env(manifests)
    settings = load_settings({k: v for k, v in env.items() if k.startswith(ENV_PREFIX)})
    assert settings.namespace == "jobs"
    assert settings.reconcile_interval_seconds == 0.5
    assert settings.leader_election is True
    assert settings.leader_election_namespace == "ops"  # the release namespace
    assert settings.leader_election_lease_name == "rel-rtj-operator"
    # The probe and the Service reach the ports the operator really listens on, on the pod's IP.
    assert settings.liveness_endpoint() == "http://10.1.2.3:18080/healthz"
    assert (settings.metrics_host, settings.metrics_port) == ("10.1.2.3", 19090)
    ports = {p["name"]: p["containerPort"] for p in operator_container(manifests)["ports"]}
    assert ports == {"healthz": 18080, "metrics": 19090}


def test_the_chart_defaults_keep_the_operator_defaults_except_where_it_listens(
    helm_binary: Path,
) -> None:
    env = operator_env(render(helm_binary))
    settings = load_settings({k: v for k, v in env.items() if k.startswith(ENV_PREFIX)})
    different = {
        name
        for name in OperatorSettings.__dataclass_fields__
        if getattr(settings, name) != getattr(OperatorSettings(), name)
    }
    assert different == {"liveness_host", "liveness_port", "metrics_host", "metrics_port",
                         "network_policy_operator_namespace", "network_policy_operator_labels",
                         "leader_election", "leader_election_namespace",
                         "leader_election_lease_name"}
    # Each job's NetworkPolicy selects exactly the operator's pod: its namespace and labels.
    assert settings.network_policy is True
    assert settings.network_policy_operator_namespace == "ops"
    pod_labels = next(m for m in render(helm_binary) if m["kind"] == "Deployment")[
        "spec"]["template"]["metadata"]["labels"]
    selected = label_map(settings.network_policy_operator_labels)
    assert selected and selected.items() <= pod_labels.items()


def test_one_replica_without_leader_election_is_recreated_and_more_are_refused(
    helm_binary: Path,
) -> None:
    kinds = by_kind(render(helm_binary, "--set", "leaderElection.enabled=false,replicaCount=1"))
    (deployment,) = kinds["Deployment"]
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}
    assert "PodDisruptionBudget" not in kinds and "Role" not in kinds
    out = run([str(helm_binary), "template", "rel", str(CHART),
               "--set", "leaderElection.enabled=false"])
    assert out.returncode != 0 and "needs leaderElection.enabled" in out.stderr


# --- against the real API server -----------------------------------------------------------------


class Release:
    """One release of the chart in its own namespace, driven through the cluster's helm/kubectl."""

    def __init__(self, cluster: Cluster, namespace: str, name: str) -> None:
        self.cluster = cluster
        self.namespace = namespace
        self.name = name
        self.fullname = f"{name}-rtj-operator"
        self.service_account = f"system:serviceaccount:{namespace}:{self.fullname}"

    def install(self, *values: str) -> None:
        out = self.cluster.helm(
            "install", self.name, str(CHART), "--namespace", self.namespace, "--skip-crds",
            *NOWHERE, *values,
        )  # fmt: skip
        assert " get rtj -w" in out.stdout  # NOTES.txt tells how to watch the jobs

    def uninstall(self) -> None:
        self.cluster.helm("uninstall", self.name, "--namespace", self.namespace, "--wait")

    def can(self, verb: str, resource: str, *flags: str, namespace: str | None = None) -> bool:
        """`kubectl auth can-i`, asked as the chart's ServiceAccount (exit code 1 means no)."""
        out = self.cluster.kubectl(
            "auth", "can-i", verb, resource, "--as", self.service_account,
            "--namespace", namespace or self.namespace, *flags, check=False,
        )  # fmt: skip
        answer = out.stdout.strip()
        assert answer in ("yes", "no"), out.stdout + out.stderr
        return answer == "yes"

    def exists(self, kind: str, name: str, *, namespaced: bool = True) -> bool:
        scope = ["--namespace", self.namespace] if namespaced else []
        out = self.cluster.kubectl("get", kind, name, *scope, "--ignore-not-found", "-o", "name")
        return bool(out.stdout.strip())


@pytest.fixture
def release(cluster: Cluster) -> Iterator[Release]:
    namespace = cluster.create_namespace("chart")
    installed = Release(cluster, namespace, f"rtj{uuid.uuid4().hex[:6]}")
    try:
        yield installed
    finally:
        # Idempotent clean-up for a test that failed before its own uninstall.
        cluster.helm(
            "uninstall", installed.name, "--namespace", namespace, "--ignore-not-found",
            check=False,
        )  # fmt: skip
        cluster.delete_namespace(namespace)


def test_helm_install_grants_exactly_what_the_operator_needs_and_uninstall_removes_it(
    release: Release,
) -> None:
    release.install()
    full = release.fullname
    namespaced = [("deployment", full), ("serviceaccount", full), ("service", f"{full}-metrics")]
    cluster_wide = [
        ("clusterrole", f"{full}-framework"),
        ("clusterrole", f"{full}-application"),
        ("clusterrolebinding", f"{full}-framework"),
        ("clusterrolebinding", f"{full}-application"),
    ]
    for kind, name in namespaced:
        assert release.exists(kind, name), f"{kind}/{name} missing after install"
    for kind, name in cluster_wide:
        assert release.exists(kind, name, namespaced=False), f"{kind}/{name} missing"

    jobs = f"resilienttrainingjobs.{GROUP}"
    assert release.can("create", "pods")
    assert release.can("delete", "pods")
    assert release.can("watch", jobs)
    assert release.can("patch", jobs, "--subresource=status")
    assert release.can("delete", jobs)  # a finished job after ttlSecondsAfterFinished
    assert release.can("create", "persistentvolumeclaims")
    assert release.can("create", "events")
    assert release.can("create", "pods", namespace="default")  # cluster-scoped: every namespace
    assert not release.can("delete", "nodes")
    assert release.can("list", "nodes")  # is a pod's node lost?
    assert not release.can("get", "secrets")
    assert not release.can("patch", "pods")
    assert release.can("get", "pods")  # only after a create answered 409 (whose pod is it?)
    assert release.can("update", f"leases.coordination.k8s.io/{full}")
    assert not release.can("update", "leases.coordination.k8s.io/other")
    assert not release.can("delete", "customresourcedefinitions.apiextensions.k8s.io")
    # Only the verbs the code uses (review S3): kopf patches (never updates) the jobs and their
    # status; the children are listed and watched by label, never fetched one by one.
    assert not release.can("update", jobs)
    assert not release.can("update", jobs, "--subresource=status")
    assert release.can("update", jobs, "--subresource=finalizers")  # blockOwnerDeletion
    for kind in ("pods", "services", "persistentvolumeclaims"):
        assert release.can("list", kind) and release.can("watch", kind)
        assert release.can("get", kind), kind  # after a 409 only: whose object holds the name
        assert not release.can("update", kind), kind
    assert release.can("create", "networkpolicies.networking.k8s.io")
    assert release.can("update", "networkpolicies.networking.k8s.io")  # rendered again (F7)
    assert not release.can("delete", "networkpolicies.networking.k8s.io")  # the GC removes it

    release.uninstall()
    for kind, name in namespaced:
        assert not release.exists(kind, name), f"{kind}/{name} left after uninstall"
    for kind, name in cluster_wide:
        assert not release.exists(kind, name, namespaced=False), f"{kind}/{name} left"
    assert not release.can("create", "pods")


def test_namespaced_install_lets_the_operator_act_only_in_its_own_namespace(
    release: Release,
) -> None:
    release.install("--set", "rbac.clusterScoped=false")
    assert release.exists("role", f"{release.fullname}-application")
    assert release.can("create", "pods")
    assert release.can("patch", f"resilienttrainingjobs.{GROUP}", "--subresource=status")
    assert not release.can("create", "pods", namespace="default")
    assert not release.can("list", f"resilienttrainingjobs.{GROUP}", namespace="default")
    release.uninstall()
    assert not release.exists("role", f"{release.fullname}-application")


def test_the_network_policy_switch_reaches_the_operator_and_its_rbac(helm_binary: Path) -> None:
    def netpol_rules(manifests: list[Manifest]) -> list[Any]:
        role = next(m for m in manifests
                    if m["kind"] == "ClusterRole" and m["metadata"]["name"].endswith("application"))
        return [r for r in role["rules"] if "networkpolicies" in r["resources"]]

    on = render(helm_binary)
    assert netpol_rules(on) == [{"apiGroups": ["networking.k8s.io"],
                                 "resources": ["networkpolicies"],
                                 "verbs": ["get", "create", "update"]}]
    off = render(helm_binary, "--set", "operator.networkPolicy=false")
    assert netpol_rules(off) == []
    env = operator_env(off)
    assert load_settings({k: v for k, v in env.items()
                          if k.startswith(ENV_PREFIX)}).network_policy is False
