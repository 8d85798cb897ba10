"""Per-pod /etc/hosts files: the harness's stand-in for cluster DNS.

There is no CoreDNS on process-backed nodes, so each pod gets its own hosts file, bind-mounted
over /etc/hosts inside the pod's mount namespace, listing the names Kubernetes DNS would serve:

* a pod with `spec.hostname` + `spec.subdomain` in a namespace that has a Service named like the
  subdomain: `<hostname>.<subdomain>.<ns>.svc.cluster.local`, `.<ns>.svc`, `.<ns>`, and (same
  namespace only) `<hostname>.<subdomain>`;
* every Service with a selector: `<svc>.<ns>.svc.cluster.local`, `.<ns>.svc`, `<svc>.<ns>` and
  (same namespace only) `<svc>` resolve to the pod IP of each Running pod the selector matches.
  There is no kube-proxy: a ClusterIP Service resolves to its backing pod's IP, so clients must
  connect to the *target* port, i.e. Service port must equal targetPort.

Rendering is pure; the node harness rewrites the files in place when pods or Services change.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

CLUSTER_DOMAIN = "cluster.local"

_PREAMBLE = """\
# Kubernetes-managed hosts file (written by the test harness; stands in for cluster DNS).
127.0.0.1\tlocalhost
::1\tlocalhost ip6-localhost ip6-loopback
fe00::0\tip6-localnet
fe00::0\tip6-mcastprefix
fe00::1\tip6-allnodes
fe00::2\tip6-allrouters
"""


@dataclass(frozen=True)
class RunningPod:
    """What DNS needs to know about a pod that is Running on a harness node."""

    namespace: str
    name: str
    ip: str
    hostname: str | None = None
    subdomain: str | None = None
    labels: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class ServiceEntry:
    """What DNS needs to know about a Service."""

    namespace: str
    name: str
    selector: Mapping[str, str] | None


def selector_matches(selector: Mapping[str, str], labels: Mapping[str, str]) -> bool:
    """Service selectors are equality-based: every key must be present with the same value."""
    return all(labels.get(key) == value for key, value in selector.items())


def _qualified(first: str, namespace: str, viewer_namespace: str) -> list[str]:
    names = [
        f"{first}.{namespace}.svc.{CLUSTER_DOMAIN}",
        f"{first}.{namespace}.svc",
        f"{first}.{namespace}",
    ]
    if namespace == viewer_namespace:
        names.append(first)
    return names


def dns_lines(
    viewer_namespace: str, pods: Iterable[RunningPod], services: Iterable[ServiceEntry]
) -> list[str]:
    """The DNS stand-in lines as seen from a pod in `viewer_namespace`, sorted for stability."""
    pods = sorted(pods, key=lambda p: (p.namespace, p.name))
    services = sorted(services, key=lambda s: (s.namespace, s.name))
    service_names = {(s.namespace, s.name) for s in services}
    lines: list[str] = []
    for pod in pods:
        if pod.hostname and pod.subdomain and (pod.namespace, pod.subdomain) in service_names:
            first = f"{pod.hostname}.{pod.subdomain}"
            lines.append(
                f"{pod.ip}\t" + " ".join(_qualified(first, pod.namespace, viewer_namespace))
            )
    for service in services:
        if not service.selector:
            continue
        for pod in pods:
            if pod.namespace == service.namespace and selector_matches(
                service.selector, pod.labels
            ):
                names = _qualified(service.name, service.namespace, viewer_namespace)
                lines.append(f"{pod.ip}\t" + " ".join(names))
    return lines


def render_hosts(
    *,
    namespace: str,
    pod_ip: str,
    hostname: str,
    subdomain: str | None,
    pods: Iterable[RunningPod],
    services: Iterable[ServiceEntry],
) -> str:
    """The full hosts file of one pod: kubelet's managed part, then the DNS stand-in."""
    own_names = [hostname]
    if subdomain:
        own_names.insert(0, f"{hostname}.{subdomain}.{namespace}.svc.{CLUSTER_DOMAIN}")
    text = _PREAMBLE + f"{pod_ip}\t{' '.join(own_names)}\n"
    extra = dns_lines(namespace, pods, services)
    if extra:
        text += "# DNS stand-in: headless-Service pod names and Service names -> pod IPs\n"
        text += "\n".join(extra) + "\n"
    return text
