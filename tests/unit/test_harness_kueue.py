"""Pure parts of harness.kueue: Kueue's Configuration for a harness cluster, which of its webhooks
are registered and how, and the queue objects tests set up."""

from __future__ import annotations

import base64
from pathlib import Path

import pytest
from harness.kueue import configuration, queue_manifests, webhook_configurations

pytestmark = pytest.mark.unit

# The shape of Kueue's config/components/webhook/manifests.yaml (v0.17.0), cut down: one webhook
# of one of its own kinds and one of another kind, in each configuration.
MANIFESTS = """
---
apiVersion: admissionregistration.k8s.io/v1
kind: MutatingWebhookConfiguration
metadata:
  name: mutating-webhook-configuration
webhooks:
- admissionReviewVersions: [v1]
  clientConfig:
    service: {name: webhook-service, namespace: system, path: /mutate-batch-v1-job}
  failurePolicy: Fail
  name: mjob.kb.io
  rules:
  - apiGroups: [batch]
    apiVersions: [v1]
    operations: [CREATE]
    resources: [jobs]
  sideEffects: None
- admissionReviewVersions: [v1]
  clientConfig:
    service: {name: webhook-service, namespace: system,
              path: /mutate-kueue-x-k8s-io-v1beta2-workload}
  failurePolicy: Fail
  name: mworkload.kb.io
  rules:
  - apiGroups: [kueue.x-k8s.io]
    apiVersions: [v1beta2]
    operations: [CREATE]
    resources: [workloads]
  sideEffects: None
---
apiVersion: admissionregistration.k8s.io/v1
kind: ValidatingWebhookConfiguration
metadata:
  name: validating-webhook-configuration
webhooks:
- admissionReviewVersions: [v1]
  clientConfig:
    service: {name: webhook-service, namespace: system, path: /validate--v1-pod}
  failurePolicy: Fail
  name: vpod.kb.io
  rules:
  - apiGroups: [""]
    apiVersions: [v1]
    operations: [CREATE, UPDATE]
    resources: [pods]
  sideEffects: None
- admissionReviewVersions: [v1]
  clientConfig:
    service: {name: webhook-service, namespace: system,
              path: /validate-kueue-x-k8s-io-v1beta2-workload}
  failurePolicy: Fail
  name: vworkload.kb.io
  rules:
  - apiGroups: [kueue.x-k8s.io]
    apiVersions: [v1beta2]
    operations: [CREATE, UPDATE]
    resources: [workloads, workloads/status]
  sideEffects: None
"""


def test_only_the_webhooks_of_kueues_own_kinds_are_registered_at_a_loopback_url() -> None:
    configs = webhook_configurations(MANIFESTS, base_url="https://127.0.0.1:9443",
                                     ca_bundle=b"PEM")
    assert [(c["kind"], c["metadata"]["name"]) for c in configs] == [
        ("MutatingWebhookConfiguration", "kueue-mutating-webhook-configuration"),
        ("ValidatingWebhookConfiguration", "kueue-validating-webhook-configuration"),
    ]
    hooks = [hook for config in configs for hook in config["webhooks"]]
    assert [hook["name"] for hook in hooks] == ["mworkload.kb.io", "vworkload.kb.io"]
    assert hooks[1]["clientConfig"] == {
        "url": "https://127.0.0.1:9443/validate-kueue-x-k8s-io-v1beta2-workload",
        "caBundle": base64.b64encode(b"PEM").decode(),
    }
    assert hooks[1]["failurePolicy"] == "Fail" and hooks[1]["rules"][0]["resources"] == [
        "workloads", "workloads/status"]


def test_the_configuration_binds_loopback_manages_only_labelled_jobs_and_knows_our_kind() -> None:
    config = configuration(health_port=1, metrics_port=2, webhook_port=3,
                           cert_dir=Path("/run/certs"))
    assert config["apiVersion"] == "config.kueue.x-k8s.io/v1beta2"
    assert config["health"] == {"healthProbeBindAddress": "127.0.0.1:1"}
    assert config["metrics"] == {"bindAddress": "127.0.0.1:2"}
    assert config["webhook"] == {"host": "127.0.0.1", "port": 3, "certDir": "/run/certs"}
    assert config["leaderElection"] == {"leaderElect": False}
    assert config["internalCertManagement"] == {"enable": False}
    assert config["manageJobsWithoutQueueName"] is False
    assert config["integrations"]["externalFrameworks"] == [
        "ResilientTrainingJob.v1alpha1.training.resilient.dev"]


def test_queue_manifests_cover_every_resource_of_the_quota() -> None:
    flavor, cluster_queue, local_queue = queue_manifests(
        "q", namespace="team", quota={"nvidia.com/gpu": "16", "cpu": "369"},
        node_labels={"node.kubernetes.io/instance-type": "p5.48xlarge"},
        tolerations=[{"key": "k", "operator": "Exists"}])
    assert flavor["spec"] == {"nodeLabels": {"node.kubernetes.io/instance-type": "p5.48xlarge"},
                              "tolerations": [{"key": "k", "operator": "Exists"}]}
    group = cluster_queue["spec"]["resourceGroups"][0]
    assert group["coveredResources"] == ["cpu", "nvidia.com/gpu"]
    assert group["flavors"] == [{"name": "q", "resources": [
        {"name": "cpu", "nominalQuota": "369"}, {"name": "nvidia.com/gpu", "nominalQuota": "16"}]}]
    assert local_queue["metadata"] == {"name": "q", "namespace": "team"}
    assert local_queue["spec"] == {"clusterQueue": "q"}
