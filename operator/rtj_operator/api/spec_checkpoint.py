"""`spec.checkpoint`: the shared volume the trainers write their checkpoints to (an existing claim
or one the operator creates), where on it, how often and how many are kept, and which other jobs'
checkpoints this one may resume.
"""

from __future__ import annotations

from typing import Literal, Self

from pydantic import ConfigDict, Field, field_validator, model_validator

from rtj_operator.api.schema import ApiModel
from rtj_operator.api.spec_fields import (
    DNS_SUBDOMAIN,
    INT32_MAX,
    JobReference,
    Quantity,
    cel,
    immutable,
    same_optional,
    validations,
)

CHECKPOINT_SOURCE_RULES = (
    cel(
        "has(self.claimName) != has(self.storageClassName)",
        "checkpoint: exactly one volume source must be set: claimName (an existing PVC) or "
        "storageClassName with size (a volume the operator creates)",
        field_path=".claimName",
        reason="FieldValueInvalid",
    ),
    cel(
        "has(self.storageClassName) == has(self.size)",
        "checkpoint.size is required with checkpoint.storageClassName, and only with it",
        field_path=".size",
        reason="FieldValueRequired",
    ),
    cel(
        "!has(self.claimDeletePolicy) || has(self.storageClassName)",
        "checkpoint.claimDeletePolicy applies only to a volume the operator creates "
        "(storageClassName)",
        field_path=".claimDeletePolicy",
    ),
)


class Checkpoint(ApiModel):
    """Where and how often the trainer writes checkpoints.

    The volume is shared by every pod (ReadWriteMany, FSx for Lustre on AWS): either an existing
    claim (`claimName`) or one the operator creates from a StorageClass (`storageClassName` and
    `size`). The volume source, `mountPath` and `path` are immutable.
    """

    model_config = ConfigDict(
        json_schema_extra=validations(
            *CHECKPOINT_SOURCE_RULES,
            same_optional("claimName", "checkpoint.claimName"),
            same_optional("storageClassName", "checkpoint.storageClassName"),
            same_optional("size", "checkpoint.size"),
            same_optional("path", "checkpoint.path"),
        )
    )

    claim_name: str | None = Field(
        default=None,
        description=(
            "Name of an existing ReadWriteMany PersistentVolumeClaim in the job's namespace "
            "(for example a static FSx for Lustre volume). Exclusive with storageClassName."
        ),
        max_length=253,
        pattern=DNS_SUBDOMAIN,
    )
    storage_class_name: str | None = Field(
        default=None,
        description=(
            "StorageClass of a ReadWriteMany volume that the operator creates as the claim "
            "`<job name>-checkpoints` (for example a dynamic FSx for Lustre class). Needs size."
        ),
        max_length=253,
        pattern=DNS_SUBDOMAIN,
    )
    size: Quantity | None = Field(
        default=None,
        description="Capacity of the volume the operator creates (with storageClassName).",
    )
    claim_delete_policy: Literal["Delete", "Retain"] | None = Field(
        default=None,
        description=(
            "What happens to the claim the operator created when the job is deleted: `Delete` "
            "(the default) or `Retain`. Only with storageClassName; an existing claim is never "
            "deleted."
        ),
    )
    mount_path: str = Field(
        default="/checkpoints",
        description="Absolute path where the volume is mounted in every trainer container.",
        max_length=1024,
        pattern=r"^/([^/]+(/[^/]+)*)?$",
        json_schema_extra=immutable("checkpoint.mountPath"),
    )
    path: str | None = Field(
        default=None,
        description=(
            "Subdirectory of the volume that holds this job's checkpoints (default: "
            "`<namespace>/<name>`, so a job deleted and applied again resumes its own). A "
            "relative path without `..`; the trainer gets `<mountPath>/<path>` as "
            "RTJ_CHECKPOINT_DIR. Checkpoints another job wrote there are refused unless "
            "resumeFromJobs names that job."
        ),
        max_length=512,
        pattern=r"^[A-Za-z0-9._-]+(/[A-Za-z0-9._-]+)*$",
        json_schema_extra=validations(
            cel(
                "!self.split('/').exists(s, s == '..' || s == '.')",
                "checkpoint.path may not contain '.' or '..' segments",
            )
        ),
    )
    resume_from_jobs: list[JobReference] = Field(
        default_factory=list,
        description=(
            "Other jobs, as `<namespace>/<name>`, whose committed checkpoints in this job's "
            "checkpoint directory it may resume (for example to continue another run: set "
            "path to that run's directory and name it here). Without it, a trainer that finds "
            "another job's checkpoints fails with reason ForeignCheckpoint."
        ),
        max_length=16,
    )
    interval_steps: int = Field(
        default=100,
        description="Write a checkpoint every this many optimizer steps.",
        ge=1,
        le=INT32_MAX,
    )
    keep: int = Field(
        default=3, description="Number of newest committed checkpoints kept.", ge=1, le=100
    )
    mode: Literal["Async", "Sync"] = Field(
        default="Async",
        description=(
            "`Async` stages the state in memory and writes it in the background (short stall); "
            "`Sync` blocks the step loop until the checkpoint is committed."
        ),
    )
    stale_after_intervals: int = Field(
        default=3,
        description=(
            "Raise the `CheckpointStale` condition (and a Warning Event) when the job's step is "
            "more than this many checkpoint intervals past the newest committed checkpoint "
            "(`status.lastCheckpoint`); it clears when a commit catches up."
        ),
        ge=1,
        le=1000,
    )

    @field_validator("path")
    @classmethod
    def _no_dot_segments(cls, path: str | None) -> str | None:
        if path is not None and any(s in (".", "..") for s in path.split("/")):
            raise ValueError("checkpoint.path may not contain '.' or '..' segments")
        return path

    @model_validator(mode="after")
    def _exactly_one_source(self) -> Self:
        if (self.claim_name is None) == (self.storage_class_name is None):
            raise ValueError(CHECKPOINT_SOURCE_RULES[0]["message"])
        if (self.storage_class_name is None) != (self.size is None):
            raise ValueError(CHECKPOINT_SOURCE_RULES[1]["message"])
        if self.claim_delete_policy is not None and self.storage_class_name is None:
            raise ValueError(CHECKPOINT_SOURCE_RULES[2]["message"])
        return self

    @property
    def is_dynamic(self) -> bool:
        """Whether the operator creates (and owns) the claim."""
        return self.storage_class_name is not None

    @property
    def effective_claim_delete_policy(self) -> Literal["Delete", "Retain"]:
        return self.claim_delete_policy or "Delete"
