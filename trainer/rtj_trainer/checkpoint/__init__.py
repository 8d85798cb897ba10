"""Per-rank sharded checkpoints, written asynchronously by NVRx, committed atomically by a manifest.

The package, in dependency order (each module imports only those before it):

- `staging`: a nested state -> (skeleton, layout) + one flat host buffer (the stall);
- `format`: names, shard files, shard records, the manifest, digests (`FORMAT_VERSION`);
- `writer`: the shard writer that runs in NVRx's persistent worker process;
- `local`: node-local copies of each save (RAM), the fast tier of a resume;
- `lock`: one job per checkpoint directory (`.rtj-lock`, taken by rank 0 at the start);
- `store`: the checkpoint directory: validate, commit, prune (this job's directories only), the
  commit log;
- `committer`: rank 0's commit thread and the other ranks' view of its progress;
- `loading`: which checkpoint every rank resumes from (`Resumable`);
- `carried`: what a rank keeps across in-process restarts (rtj_trainer.carry): its writer, the
  training state an interrupted attempt offered, closes a restart cut short;
- `checkpointer`: `Checkpointer`, the adapter the step loop uses (save/poll/load).

Each module's docstring says why it is shaped as it is. The names below are the package's public
face.
"""

from .carried import ProcessWriter, close_interrupted, expect_offer, stage_offered
from .checkpointer import Checkpointer, CommitTimeoutError
from .committer import COMMIT_PROGRESS, CheckpointStats, CommitProgressReader, CommitWorker
from .format import (
    FORMAT_VERSION,
    MANIFEST,
    CheckpointError,
    ChunkDigest,
    Manifest,
    ShardRecord,
    checkpoint_dir_name,
    chunk_tiling_problem,
    digest_ranges,
    encode_skeleton,
    job_identity,
    read_manifest,
    read_shard,
    shard_file_name,
    shard_record_name,
    step_of,
)
from .loading import LoadedCheckpoint
from .lock import LOCK, DirectoryLock, read_holder
from .pruning import OWNER, mark_owner, prune
from .staging import (
    HostStaging,
    TensorLayout,
    TensorSlot,
    flatten_state,
    plan_layout,
    stage_to_host,
    tensor_views,
)
from .store import (
    ABANDONED,
    ResumePlan,
    commit,
    committed_checkpoints,
    failed_writes,
    is_abandoned,
    newest_valid_checkpoint,
    read_commit_log,
    read_committed,
    refuse_foreign_checkpoints,
    refuse_other_world_size,
    resume_plans,
    validation_problems,
)
from .writer import write_shard

__all__ = [
    "ABANDONED",
    "COMMIT_PROGRESS",
    "FORMAT_VERSION",
    "LOCK",
    "MANIFEST",
    "OWNER",
    "CheckpointError",
    "CheckpointStats",
    "Checkpointer",
    "ChunkDigest",
    "CommitProgressReader",
    "CommitTimeoutError",
    "CommitWorker",
    "DirectoryLock",
    "HostStaging",
    "LoadedCheckpoint",
    "Manifest",
    "ProcessWriter",
    "ResumePlan",
    "ShardRecord",
    "TensorLayout",
    "TensorSlot",
    "checkpoint_dir_name",
    "chunk_tiling_problem",
    "close_interrupted",
    "commit",
    "committed_checkpoints",
    "digest_ranges",
    "encode_skeleton",
    "expect_offer",
    "failed_writes",
    "flatten_state",
    "is_abandoned",
    "job_identity",
    "mark_owner",
    "newest_valid_checkpoint",
    "plan_layout",
    "prune",
    "read_commit_log",
    "read_committed",
    "read_holder",
    "read_manifest",
    "read_shard",
    "refuse_foreign_checkpoints",
    "refuse_other_world_size",
    "resume_plans",
    "shard_file_name",
    "shard_record_name",
    "stage_offered",
    "stage_to_host",
    "step_of",
    "tensor_views",
    "validation_problems",
    "write_shard",
]
