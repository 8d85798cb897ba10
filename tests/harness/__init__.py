"""Test harness: a real local Kubernetes control plane plus process-backed p5 nodes.

`harness.cluster.Cluster` is what tests use; `python -m harness up|down|status` runs the same
cluster in the background for manual work (`make cluster-up`).
"""
