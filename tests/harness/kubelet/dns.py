"""DNS stand-in: each pod's hosts file (rendered by `hostsfile`), rewritten in place on changes.

A ClusterIP Service name resolves to its backing pod's IP, so clients use the target port.
"""

from __future__ import annotations

from harness.kubelet.controls import ControlsMixin
from harness.kubelet.hostsfile import RunningPod, ServiceEntry, render_hosts
from harness.nodestate import (
    PodRun,
)


class DnsMixin(ControlsMixin):
    """Renders and rewrites every running pod's hosts file."""

    def render_hosts_for(self, run: PodRun) -> str:
        running = []
        for other in self.runs.values():
            if not other.alive or other.kill_deadline is not None or other.vanished:
                continue
            pod = self.pod_by_uid(other.uid)
            if pod is None:  # force-deleted while its node is partitioned: not served any more
                continue
            labels = pod["metadata"].get("labels", {}) or {}
            running.append(
                RunningPod(
                    namespace=other.namespace,
                    name=other.name,
                    ip=other.ip,
                    hostname=other.hostname if other.hostname_is_explicit else None,
                    subdomain=other.subdomain,
                    labels=labels,
                )
            )
        services = [
            ServiceEntry(ns, name, svc.get("spec", {}).get("selector"))
            for (ns, name), svc in self.services.items()
        ]
        return render_hosts(
            namespace=run.namespace,
            pod_ip=run.ip,
            hostname=run.hostname,
            subdomain=run.subdomain,
            pods=running,
            services=services,
        )

    def refresh_hosts(self) -> None:
        """Rewrite changed hosts files in place (same inode: the bind mounts see the change)."""
        for run in self.runs.values():
            if not run.alive:
                continue
            text = self.render_hosts_for(run)
            if text != run.hosts_text:
                with open(run.hosts_file, "r+") as hosts:
                    hosts.write(text)
                    hosts.truncate()
                run.hosts_text = text
