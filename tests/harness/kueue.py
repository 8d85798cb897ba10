"""Real Kueue (sigs.k8s.io/kueue v0.17.0) in a harness cluster: its CRDs, its controller manager
as one more local process, and its webhooks for its own kinds.

`Kueue.start(cluster)` uses what hack/build-kueue.sh builds and caches (the binary, the CRDs and
the webhook manifest of the Kueue module), then:

- applies Kueue's CRDs (the `bases`, without the conversion webhooks kustomize would add: only
  the storage version v1beta2 is used, so the API server's `None` conversion is enough);
- signs a serving certificate for 127.0.0.1 with the cluster's CA (openssl, as the control plane
  does) and writes a `Configuration` (config.kueue.x-k8s.io/v1beta2): leader election off,
  health, metrics and webhook servers on 127.0.0.1 free ports, internal certificate management
  off, `manageJobsWithoutQueueName: false`, `integrations.frameworks: [batch/job]` (Kueue's
  default; its pod, deployment and statefulset integrations stay off) and
  `integrations.externalFrameworks: [ResilientTrainingJob.v1alpha1.training.resilient.dev]`,
  and the VisibilityOnDemand feature off (its API server would need certificates and an
  APIService);
- starts the manager under `etcoverlay.py`, which lays the metrics certificate over
  `/etc/kueue/metrics/certs` for that process alone (a path Kueue does not let one change), with
  the admin kubeconfig, logging to `<run_dir>/logs/kueue.log`;
- once it is ready (`/readyz`: its webhook server listens), registers its mutating and validating
  webhooks for the kueue.x-k8s.io kinds only (`clientConfig.url` https://127.0.0.1:<port>/<path>
  with the CA bundle). No webhook for pods or batch Jobs is registered: nothing outside Kueue's
  own kinds passes through it.

`stop()` removes the webhook configurations (so the cluster stays usable) and stops the process;
the CRDs and Kueue's objects stay. Files live under `<run_dir>/kueue/`.
"""

from __future__ import annotations

import base64
import copy
import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from harness.controlplane import REPO_ROOT, free_ports, sign_certificate
from harness.procs import ManagedProcess, wait_until

if TYPE_CHECKING:
    from harness.cluster import Cluster

BUILD_SCRIPT = REPO_ROOT / "hack" / "build-kueue.sh"
OVERLAY_SCRIPT = Path(__file__).resolve().parent / "etcoverlay.py"
KUEUE_GROUP = "kueue.x-k8s.io"
EXTERNAL_FRAMEWORKS = ("ResilientTrainingJob.v1alpha1.training.resilient.dev",)
"""Our kind, as Kueue's `integrations.externalFrameworks` names it (`Kind.version.group`)."""
WEBHOOK_CONFIGURATIONS = {
    "MutatingWebhookConfiguration": "kueue-mutating-webhook-configuration",
    "ValidatingWebhookConfiguration": "kueue-validating-webhook-configuration",
}
"""The names upstream's kustomize gives them (its namePrefix `kueue-`)."""
READY_TIMEOUT = 120.0


def ensure_kueue() -> Path:
    """The directory with `kueue`, `crds/` and `webhook-manifests.yaml`; builds them when
    missing (a cold build takes minutes; hack/build-kueue.sh shows progress)."""
    process = subprocess.Popen(
        ["bash", str(BUILD_SCRIPT)], stdout=subprocess.PIPE, stderr=None, text=True
    )
    out, _ = process.communicate()
    if process.returncode != 0:
        raise RuntimeError(f"{BUILD_SCRIPT} failed with exit code {process.returncode}")
    return Path(out.strip().splitlines()[-1])


def configuration(*, health_port: int, metrics_port: int, webhook_port: int,
                  cert_dir: Path) -> dict[str, Any]:
    """Kueue's Configuration for a harness cluster (see the module docstring)."""
    return {
        "apiVersion": "config.kueue.x-k8s.io/v1beta2",
        "kind": "Configuration",
        "namespace": "kueue-system",
        "health": {"healthProbeBindAddress": f"127.0.0.1:{health_port}"},
        "metrics": {"bindAddress": f"127.0.0.1:{metrics_port}"},
        "webhook": {"host": "127.0.0.1", "port": webhook_port, "certDir": str(cert_dir)},
        "leaderElection": {"leaderElect": False},
        "internalCertManagement": {"enable": False},
        "manageJobsWithoutQueueName": False,
        "integrations": {"frameworks": ["batch/job"],
                         "externalFrameworks": list(EXTERNAL_FRAMEWORKS)},
        "featureGates": {"VisibilityOnDemand": False},
    }


def webhook_configurations(manifests: str, *, base_url: str,
                           ca_bundle: bytes) -> list[dict[str, Any]]:
    """Kueue's webhook configurations (config/components/webhook/manifests.yaml) reduced to the
    webhooks of its own kinds, each calling `base_url` + its path, trusting `ca_bundle` (PEM)."""
    result = []
    for document in yaml.safe_load_all(manifests):
        if not document or document.get("kind") not in WEBHOOK_CONFIGURATIONS:
            continue
        kept = []
        for hook in document.get("webhooks") or []:
            groups = {g for rule in hook.get("rules") or [] for g in rule.get("apiGroups") or []}
            if groups != {KUEUE_GROUP}:
                continue
            hook = copy.deepcopy(hook)
            path = hook["clientConfig"]["service"]["path"]
            hook["clientConfig"] = {"url": f"{base_url}{path}",
                                    "caBundle": base64.b64encode(ca_bundle).decode()}
            kept.append(hook)
        result.append({
            "apiVersion": document["apiVersion"],
            "kind": document["kind"],
            "metadata": {"name": WEBHOOK_CONFIGURATIONS[document["kind"]]},
            "webhooks": kept,
        })
    return result


class Kueue:
    """Kueue's controller manager running against one harness cluster."""

    def __init__(self, cluster: Cluster, process: ManagedProcess, directory: Path,
                 health_port: int) -> None:
        self.cluster = cluster
        self.process = process
        self.directory = directory
        self.health_port = health_port

    @classmethod
    def start(cls, cluster: Cluster, build_dir: Path | None = None) -> Kueue:
        """Apply the CRDs, start the manager, wait until it is ready, register its webhooks."""
        build = build_dir or ensure_kueue()
        directory = cluster.run_dir / "kueue"
        shutil.rmtree(directory, ignore_errors=True)
        cert_dir = directory / "certs"
        metrics_dir = directory / "etc" / "kueue" / "metrics" / "certs"
        cert_dir.mkdir(parents=True)
        metrics_dir.mkdir(parents=True)
        pki = cluster.control_plane.pki
        sign_certificate(
            pki, "kueue", "/CN=kueue-webhook",
            "subjectAltName=IP:127.0.0.1,DNS:localhost\n"
            "keyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\n",
        )
        for target in (cert_dir, metrics_dir):
            shutil.copy(pki / "kueue.crt", target / "tls.crt")
            shutil.copy(pki / "kueue.key", target / "tls.key")
        cluster.apply_crds(build / "crds")
        health, metrics, webhook = free_ports(3)
        config = directory / "config.yaml"
        config.write_text(yaml.safe_dump(configuration(
            health_port=health, metrics_port=metrics, webhook_port=webhook, cert_dir=cert_dir)))
        process = ManagedProcess(
            "kueue",
            [sys.executable, "-S", str(OVERLAY_SCRIPT), str(directory / "etc"), "--",
             str(build / "kueue"), f"--config={config}", "--zap-log-level=2"],
            cluster.run_dir / "logs" / "kueue.log",
            env={**cluster.env(), "KUBECONFIG": str(cluster.kubeconfig)},
            death_signal=signal.SIGTERM,
        )
        kueue = cls(cluster, process, directory, health)
        try:
            wait_until(kueue.ready, READY_TIMEOUT, "kueue /readyz", interval=0.5,
                       processes=[process])
            manifests = (build / "webhook-manifests.yaml").read_text()
            for item in webhook_configurations(manifests, base_url=f"https://127.0.0.1:{webhook}",
                                               ca_bundle=(pki / "ca.crt").read_bytes()):
                cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", "-",
                                input=json.dumps(item))
        except BaseException:
            kueue.stop()
            raise
        return kueue

    def ready(self) -> bool:
        import urllib.request

        with urllib.request.urlopen(f"http://127.0.0.1:{self.health_port}/readyz",
                                    timeout=5) as response:
            return bool(response.status == 200)

    def log(self) -> str:
        return self.process.log_file.read_text(errors="replace")

    def stop(self) -> None:
        """Unregister the webhooks, then stop the manager; never raises."""
        for kind, name in WEBHOOK_CONFIGURATIONS.items():
            try:
                self.cluster.kubectl("delete", kind.lower(), name, "--ignore-not-found",
                                     check=False, timeout=30)
            except Exception:
                pass
        try:
            self.process.stop(timeout=10)
        except Exception:
            pass


def queue_manifests(name: str, *, namespace: str, quota: dict[str, str],
                    node_labels: dict[str, str],
                    tolerations: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """A ResourceFlavor, a ClusterQueue with `quota` of it (every resource named covered) and a
    LocalQueue in `namespace`, all named `name`: what a cluster admin sets up for a team."""
    flavor_spec: dict[str, Any] = {"nodeLabels": node_labels}
    if tolerations:
        flavor_spec["tolerations"] = tolerations
    api_version = f"{KUEUE_GROUP}/v1beta2"
    return [
        {"apiVersion": api_version, "kind": "ResourceFlavor", "metadata": {"name": name},
         "spec": flavor_spec},
        {"apiVersion": api_version, "kind": "ClusterQueue", "metadata": {"name": name},
         "spec": {"namespaceSelector": {}, "resourceGroups": [{
             "coveredResources": sorted(quota),
             "flavors": [{"name": name, "resources": [
                 {"name": resource, "nominalQuota": amount}
                 for resource, amount in sorted(quota.items())]}]}]}},
        {"apiVersion": api_version, "kind": "LocalQueue",
         "metadata": {"name": name, "namespace": namespace},
         "spec": {"clusterQueue": name}},
    ]
