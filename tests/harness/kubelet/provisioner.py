"""A tiny provisioner: StorageClass `local-shared` (the default class) -> hostPath PVs in a shared
directory (stands in for FSx for Lustre, ReadWriteMany).
"""

from __future__ import annotations

import shutil

from harness.kubeapi import ApiError, JsonObject
from harness.kubelet.nodes import NodesMixin
from harness.kubelet.state import log

PROVISIONER = "harness.local/shared"
STORAGE_CLASS = "local-shared"


class ProvisionerMixin(NodesMixin):
    """The default StorageClass and a hostPath PV for each of its PVCs."""

    def ensure_storage_class(self) -> None:
        storage_class = {
            "apiVersion": "storage.k8s.io/v1",
            "kind": "StorageClass",
            "metadata": {
                "name": STORAGE_CLASS,
                "annotations": {"storageclass.kubernetes.io/is-default-class": "true"},
            },
            "provisioner": PROVISIONER,
            "reclaimPolicy": "Delete",
            "volumeBindingMode": "Immediate",
        }
        try:
            self.api.create("/apis/storage.k8s.io/v1/storageclasses", storage_class)
        except ApiError as error:
            if error.status != 409:
                raise

    def class_is_ours(self, name: str | None) -> bool:
        if not name:
            return False
        if name == STORAGE_CLASS:
            return True
        found = self.api.get_or_none(f"/apis/storage.k8s.io/v1/storageclasses/{name}")
        return found is not None and found.get("provisioner") == PROVISIONER

    def on_pvc(self, event_type: str, pvc: JsonObject) -> None:
        meta, spec = pvc["metadata"], pvc.get("spec", {})
        uid = meta["uid"]
        if event_type == "DELETED":
            if uid in self.provisioned:
                pv_name, path = self.provisioned.pop(uid)
                self.api.delete(f"/api/v1/persistentvolumes/{pv_name}")
                shutil.rmtree(path, ignore_errors=True)
                log(f"deleted PV {pv_name} of PVC {meta['namespace']}/{meta['name']}")
            return
        if spec.get("volumeName") or uid in self.provisioned:
            return
        if pvc.get("status", {}).get("phase") != "Pending":
            return
        if not self.class_is_ours(spec.get("storageClassName")):
            return
        path = self.shared_dir / f"{meta['namespace']}-{meta['name']}-{uid[:8]}"
        path.mkdir(parents=True, exist_ok=True)
        pv_name = f"pvc-{uid}"
        pv = {
            "apiVersion": "v1",
            "kind": "PersistentVolume",
            "metadata": {
                "name": pv_name,
                "annotations": {"pv.kubernetes.io/provisioned-by": PROVISIONER},
            },
            "spec": {
                "capacity": {"storage": spec["resources"]["requests"]["storage"]},
                "accessModes": spec.get("accessModes", ["ReadWriteOnce"]),
                "persistentVolumeReclaimPolicy": "Delete",
                "storageClassName": spec["storageClassName"],
                "volumeMode": spec.get("volumeMode", "Filesystem"),
                "hostPath": {"path": str(path), "type": "DirectoryOrCreate"},
                "claimRef": {
                    "apiVersion": "v1",
                    "kind": "PersistentVolumeClaim",
                    "namespace": meta["namespace"],
                    "name": meta["name"],
                    "uid": uid,
                },
            },
        }
        try:
            self.api.create("/api/v1/persistentvolumes", pv)
        except ApiError as error:
            if error.status != 409:
                raise
        self.provisioned[uid] = (pv_name, path)
        log(f"provisioned PV {pv_name} at {path} for PVC {meta['namespace']}/{meta['name']}")
