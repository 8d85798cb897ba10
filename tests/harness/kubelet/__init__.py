"""Process-backed nodes ("kubelet-lite"): p5.48xlarge-shaped Nodes whose pods are host processes.

One process (`python -m harness.kubelet`) plays kubelet for N nodes:

* registers the Node objects (p5.48xlarge capacity and labels), keeps them Ready and renews their
  Leases (on a heartbeat thread); a test can mark a node NotReady (heartbeats stop, Ready=False)
  and Ready again, partition it (no heartbeats, no pod status, deletions and starts held back,
  its pods' processes frozen) and heal it (catch up like a reconnecting kubelet), or make it
  refuse new pods with a kubelet waiting reason (ErrImagePull, CreateContainerConfigError...);
* for every pod the real kube-scheduler binds to one of its nodes it allocates a loopback pod IP
  (127.a.b.c), resolves the container env like kubelet, and runs each container's command+args
  as a host process tree (see `podinit`: own mount/UTS namespace, hostname, private /tmp,
  /dev/shm, /etc/hosts, volumes) inside a per-container cgroup. The image is ignored;
* reports pod status (phase, conditions, containerStatuses with exit codes, 128+N for signal N),
  and annotates running pods with `harness.local/pgid`;
* on deletionTimestamp: SIGTERM each container's main process (as a container runtime does: not
  its children), SIGKILL the cgroup after min(grace, 30 s), then deletes
  the pod with gracePeriodSeconds=0 like kubelet; processes of pods that vanish are killed;
* a tiny provisioner: StorageClass `local-shared` (default class) -> hostPath PVs in a shared dir
  (stands in for FSx, ReadWriteMany);
* DNS stand-in: per-pod hosts files (see `hostsfile`), rewritten in place on changes;
* a control API on 127.0.0.1 (HTTP JSON, client in `harness.control`) for fault injection.

Simplifications (documented for test authors): restartPolicy Always/OnFailure restart a container
in place with kubelet's back-off (at once, then 10 s doubling); init containers, probes and image
entrypoints are not supported (a container without `command` leaves its pod Pending with
CreateContainerError); a NotReady node keeps its processes running and still acts on the API;
a partitioned node freezes its pods' processes rather than keep them running cut off;
`kubectl logs` does not work (read `<run_dir>/pods/<ns>_<pod>_<container>.log`); a ClusterIP
Service name resolves to its backing pod's IP, so clients use the target port.

Design: informer threads (pods, services, PVCs) and process-exit waiters only enqueue events; a
single reconcile thread owns all state and makes every decision and API write, except the
heartbeat thread's Lease renewals and periodic node status (under `heartbeat_lock`, see `state`).

Layout: one owner, `loop.Kubelet`, built as a chain of classes, one module per part, each adding
to the one below: `state` (every record, in one place) -> `nodes` (registration, status, leases)
-> `provisioner` (StorageClass, PVC -> PV) -> `controls` (the control API's backend) -> `dns`
(hosts files, rendered by `hostsfile`) -> `podstatus` -> `runtime` (start_pod, volumes, container
plans, spawn, restarts, cleanup) -> `loop` (the main loop, event dispatch, the pod lifecycle, the
entry point).
"""

from harness.kubelet.loop import Kubelet, main

__all__ = ["Kubelet", "main"]
