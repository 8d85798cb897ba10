"""The wire between the operator and its trainer pods: everything both sides must spell alike.

Standard library only, with no side effects, and importing nothing of the project: both the
operator image (no torch) and every trainer process (the launcher shim, the attach client, the
training worker) import it, and a script a team brings imports it through the trainer's public
library. An import-linter contract keeps it that way; tests/unit/test_contract_operator_trainer.py
ties both sides to it.

- `env`: the variables the operator gives a trainer pod, and the ones the launcher shim gives its
  workers.
- `pod`: the pod's reserved ports, exit codes and signals.
- `ranks`: the pod endpoint's `GET /ranks` document (one record per local rank), and the metric
  names a rank's Prometheus page carries for it.
- `termination`: the termination message a trainer pod leaves, and how the operator reads it.
- `lostpods`: the operator's verdict that a peer pod is gone (`POST /lost-pods`).
"""
