"""The trainer's one typed configuration: the sections and their fields, validated by pydantic.

`rtj_trainer.configload.build_config` builds it from the layers (preset < file < the operator's
environment < `--set`); a bad value anywhere is one ConfigError naming the field path.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    field_validator,
    model_validator,
)

from .errors import FatalError
from .faults import Fault, FaultSpecError, parse_faults


class ConfigError(FatalError, ValueError):
    """A configuration value is missing, unknown or invalid; the message names the field path.
    Fatal: a restart reads the same configuration (rtj_trainer.errors)."""

    reason = "ConfigurationError"


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


MAX_VOCAB = 262144
"""Largest vocabulary (Gemma 3's 262,144 tokens); token files above 65,536 need uint32."""


class ModelConfig(_Section):
    """The model: the built-in GPT-style decoder of this shape, or a Hugging Face causal LM
    (`hf_path`), whose own config.json then gives the layers, widths and vocabulary."""

    num_layers: int = Field(ge=1)
    d_model: int = Field(ge=8)
    num_heads: int = Field(ge=1)
    vocab_size: int = Field(ge=2, le=MAX_VOCAB)
    seq_len: int = Field(ge=2)
    """Tokens per training sequence (also with `hf_path`)."""
    ffn_multiplier: int = Field(default=4, ge=1)
    hf_path: str | None = None
    """A local directory in Hugging Face layout (`config.json`, and `*.safetensors` weights when
    present): train that `AutoModelForCausalLM` (Llama, Qwen, Mistral, ...) instead of the GPT,
    built on the meta device and sharded per decoder layer; its weights are loaded when present
    (fine-tuning), else it is initialised from the config. Nothing is fetched from a hub."""

    @model_validator(mode="after")
    def _heads_divide_width(self) -> ModelConfig:
        if self.hf_path:
            self._take_hf_shape()
        if self.d_model % self.num_heads:
            raise ValueError(
                f"model.d_model ({self.d_model}) must be divisible by model.num_heads "
                f"({self.num_heads})"
            )
        return self

    def _take_hf_shape(self) -> None:
        """The shape fields from the Hugging Face config (layers, width, heads, vocabulary)."""
        assert self.hf_path is not None
        file = Path(self.hf_path) / "config.json"
        try:
            hf = json.loads(file.read_text())
        except OSError as exc:
            raise ValueError(f"model.hf_path: cannot read {file}: {exc.strerror}") from None
        except json.JSONDecodeError as exc:
            raise ValueError(f"model.hf_path: {file} is not JSON: {exc}") from None
        text = hf.get("text_config") if isinstance(hf.get("text_config"), dict) else hf
        try:
            shape = {"num_layers": int(text["num_hidden_layers"]),
                     "d_model": int(text["hidden_size"]),
                     "num_heads": int(text["num_attention_heads"]),
                     "vocab_size": int(text["vocab_size"])}
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"model.hf_path: {file} lacks a causal LM's shape ({exc})") from None
        if shape["vocab_size"] > MAX_VOCAB:
            raise ValueError(f"model.hf_path: vocabulary of {shape['vocab_size']} tokens is over "
                             f"{MAX_VOCAB}")
        for name, value in shape.items():
            object.__setattr__(self, name, value)


class DataConfig(_Section):
    """Where token batches come from; a batch is a pure function of (seed, step, rank)."""

    kind: Literal["synthetic", "memmap", "hf"] = "synthetic"
    path: str | None = None
    """kind=memmap: a flat token file of `dtype` (e.g. on the FSx mount); kind=hf: a `datasets`
    `save_to_disk` directory with an `input_ids` column, packed into `seq_len + 1` blocks."""
    dtype: Literal["uint16", "uint32"] = "uint16"
    """kind=memmap: the token file's integer type (uint32 for vocabularies above 65,536)."""
    batch_size: int = Field(default=4, ge=1)
    """Sequences per rank per step."""
    seed: int = 1234

    @model_validator(mode="after")
    def _memmap_needs_path(self) -> DataConfig:
        if self.kind in ("memmap", "hf") and not self.path:
            raise ValueError(f"data.path is required when data.kind is '{self.kind}'")
        return self


class OptimConfig(_Section):
    """AdamW with linear warmup then cosine decay to `min_lr_ratio * lr`."""

    lr: float = Field(default=3e-4, gt=0)
    min_lr_ratio: float = Field(default=0.1, ge=0, le=1)
    warmup_steps: int = Field(default=10, ge=0)
    weight_decay: float = Field(default=0.1, ge=0)
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = Field(default=1.0, ge=0)
    """Max global grad norm; 0 disables clipping."""


class TrainConfig(_Section):
    """The step loop."""

    steps: int = Field(default=50, ge=1)
    """Total optimizer steps of the job (resumed runs stop at the same step)."""
    seed: int = 0
    device: Literal["auto", "cpu", "cuda"] = "auto"
    mixed_precision: Literal["auto", "bf16", "fp32"] = "auto"
    """auto: bf16 compute with fp32 reduction on CUDA, fp32 on CPU."""
    log_every: int = Field(default=10, ge=1)
    log_level: Literal["CRITICAL", "FATAL", "ERROR", "WARN", "WARNING", "INFO", "DEBUG",
                       "NOTSET"] = "WARNING"
    """Python logging level (env RTJ_LOG_LEVEL). The trainer's own progress lines are always
    printed; this level is for everything else (NVRx, torch, the trainer's debug messages)."""
    dump_stacks_on_sigterm: bool = False
    """Print every thread's Python stack to stderr when the process gets SIGTERM (then die as
    usual): shows where a rank was stuck when a watchdog ends it."""
    run_dir: str | None = None
    """Where per-step losses (losses.jsonl) and job state go; default: checkpoint.dir."""
    min_step_seconds: float = Field(default=0.0, ge=0, le=60)
    """Testing and demo knob: each step of the loop takes at least this long (the rank sleeps
    out the rest, in short slices, after the step and its checkpoint), so that a CPU job of a
    few milliseconds a step lasts long enough for a test to act in the middle of it. It changes
    no number the job computes. 0: off."""


class CheckpointConfig(_Section):
    """Checkpoint policy; see rtj_trainer.checkpoint for the commit protocol."""

    dir: str = "/tmp/rtj-checkpoints"
    interval_steps: int = Field(default=10, ge=0)
    """Save every N steps; 0 disables saving (resume still loads what exists)."""
    keep: int = Field(default=2, ge=1)
    """Committed checkpoints kept; older ones are deleted after each commit."""
    mode: Literal["async", "sync"] = "async"
    verify_checksums: bool = True
    """On resume, re-hash every shard against its manifest entry (sizes are always checked)."""
    save_final: bool = True
    """Also save (synchronously wait for) a checkpoint at the last step."""
    local_dir: str | None = None
    """Also keep each rank's newest saves in this node-local folder (RAM: /dev/shm/...), and
    resume from there when every rank holds the same save and it is not older than the newest
    commit (rtj_trainer.checkpoint.local). Needs room for two shards per local rank. Off: None."""
    local_interval_steps: int = Field(default=0, ge=0)
    """Between saves, also snapshot each rank's state into `local_dir` alone every N steps (no
    write to `dir`, no commit), so that a worker killed on its node resumes from at most N steps
    back instead of `interval_steps` (when every rank holds the same snapshot, and it is newer
    than the newest commit; a replaced pod holds none, and everyone resumes from the store). A
    snapshot is skipped while the one before it is still being written. Needs `local_dir`.
    0: off."""
    snapshot_device_copy: bool = True
    """Take each snapshot as one copy into a second buffer in device memory (on the training
    stream: milliseconds for GBs on a GPU); a thread of the trainer then copies it to
    `local_dir` on a side stream while training goes on (rtj_trainer.checkpoint.snapshots), so
    a snapshot never waits for the writer process, which each save keeps busy for seconds.
    Needs free device memory of the rank's shard plus 2 GiB (checked after the first step).
    Without that room, or False: snapshots are staged like saves and written by the writer
    process, and skipped while it is busy."""
    save_device_copy: bool | None = None
    """Stage each save as a snapshot is taken (async mode, with the snapshots' device buffer):
    one copy into device memory on the training stream, then a thread copies it to the
    page-locked staging buffer on a side stream while training goes on, and the write starts
    once it is there (rtj_trainer.checkpoint.snapshots `SnapshotTaker.stage`). The step loop
    then waits for milliseconds instead of the device-to-host copy (~0.2 s for an 11.3 GB shard
    on an H100). When the snapshot thread is still busy, a save is staged the old way. None:
    on CUDA only (on CPU the device buffer is host memory: one more copy, nothing gained)."""
    direct_io: bool | None = None
    """Write each shard's data to `dir` with O_DIRECT (aligned slices; the header and the last
    slice through the page cache; where the filesystem refuses O_DIRECT, all of it as before):
    GBs of shard go to the disk once, not first into the page cache. On one H200's disk `dd`
    wrote 1.9 GB/s with O_DIRECT against 1.3 GB/s through the page cache and fsync (a save of
    11.3 GB took 8.6 s the latter way); the writer wrote 2 GiB in 1.28 s against 4.33 s on the
    CI machine's disk (docs/benchmarks.md). A resume from the store on the same node then reads
    the disk, not the cache (node-local copies and device keepers serve the fast resumes).
    None: on CUDA only (GPU ranks' shards are GBs; CPU runs keep the page cache)."""
    snapshot_bounce_mib: int = Field(default=64, ge=1, le=4096)
    """The size of each of the two page-locked buffers (pinned once per process) a snapshot's
    copy to `local_dir` goes through (CUDA); 64 and 256 MiB copied equally fast on one H200
    (bench/device/shmcopy.py, docs/benchmarks.md)."""

    @property
    def snapshots_by_thread(self) -> bool:
        """Snapshots through the device copy and the trainer's thread (rtj_trainer.checkpoint.
        snapshots), when there is room for it."""
        return bool(self.local_dir and self.local_interval_steps and self.snapshot_device_copy)

    resume_from_jobs: tuple[str, ...] = ()
    """Other jobs (`<namespace>/<name>`) whose committed checkpoints in `dir` this job may
    resume (env RTJ_CHECKPOINT_RESUME_FROM_JOBS, comma-separated, from
    `spec.checkpoint.resumeFromJobs`); any other job's are refused (ForeignCheckpointError)."""

    @field_validator("resume_from_jobs", mode="before")
    @classmethod
    def _comma_separated(cls, value: Any) -> Any:
        if isinstance(value, str):
            return tuple(item.strip() for item in value.split(",") if item.strip())
        return value

    stop_check_every_steps: int = Field(default=1, ge=1)
    """How often (in steps) the ranks agree whether one of them got SIGTERM (one all-reduce of
    two integers); a stop saves the step of the first check after the signal (rtj_trainer.stop)."""
    commit_timeout_seconds: float = Field(default=600.0, gt=0)
    """A save that still lacks a rank's record this long after rank 0 handed it to its commit
    thread is abandoned and reported, as one with an error record is (a write that failed and
    could not leave its `.error` either: EIO, ENOSPC, ESTALE, the directory gone). Later saves
    then commit; the run's last save, abandoned, fails the attempt (it restarts)."""
    stop_timeout_seconds: float = Field(default=120.0, gt=0)
    """How long a stop (rtj_trainer.stop) may take, from the signal: ft_launcher's
    `--term-timeout`, after which it SIGKILLs the worker (the launcher shim passes it to its
    workers as RTJ_TERM_TIMEOUT_SECONDS; the default is for a worker run without the shim). A
    stop waits for its checkpoint until this, less the time since the signal and a margin for
    leaving; past that it stops without it (its `committedStep` is null) instead of waiting out
    `commit_timeout_seconds` for a rank that was killed before it wrote its shard."""
    test_write_delay_seconds: float = Field(default=0.0, ge=0)
    """Testing knob: the writer sleeps this long before writing, to widen the mid-save window."""

    @model_validator(mode="after")
    def _snapshots_need_a_local_dir(self) -> CheckpointConfig:
        if self.local_interval_steps and not self.local_dir:
            raise ValueError("checkpoint.local_interval_steps: node-local snapshots need "
                             "checkpoint.local_dir (a node-local folder, e.g. /dev/shm/rtj-local)")
        return self


class ResiliencyConfig(_Section):
    """NVRx knobs: heartbeats (ft_launcher rank monitors) and in-process restart."""

    inprocess_restart: bool = False
    heartbeat_timeout_seconds: float = Field(default=60.0, gt=0)
    """The job's heartbeat timeout; the trainer sizes its own hang guards from it."""
    learn_timeouts_after_steps: int = Field(default=0, ge=0)
    """After this many steps of an attempt, ask NVRx to compute heartbeat timeouts from the
    observed intervals (a collective on all ranks); 0 keeps the launcher's fixed timeouts."""
    collective_timeout_seconds: float | None = None
    """Process-group timeout; default: 5 s on CPU/gloo with in-process restart (gloo cannot be
    aborted; an in-process restart cuts its connections, rtj_trainer.gloocut, and this is the
    backstop), otherwise 2 x heartbeat_timeout_seconds."""
    inprocess_max_restarts: int = Field(default=5, ge=0)
    inprocess_soft_timeout_seconds: float | None = Field(default=None, gt=0)
    """Hang guard of the in-process wrapper; default: heartbeat_timeout_seconds / 2."""
    learned_hang_timeout: bool | None = None
    """Restart a rank in place when one step outlasts the largest of the floor, `factor` x the
    median and `longest_factor` x the longest recent step, once `learn_steps` steps were timed
    (rtj_trainer.hangwatch; NVRx's soft timeout stays the backstop). Needs in-process restart.
    None: on for CUDA with in-process restart, off on CPU (shared cores: irregular steps)."""
    hang_timeout_floor_seconds: float = Field(default=2.0, gt=0)
    hang_timeout_factor: float = Field(default=5.0, ge=1)
    hang_timeout_longest_factor: float = Field(default=2.0, ge=1)
    hang_timeout_learn_steps: int = Field(default=20, ge=1)
    inprocess_startup_timeout_seconds: float | None = Field(default=None, gt=0)
    """The in-process wrapper's hang guard while an attempt starts: from entering the training
    function (process group, model, checkpoint load) to the end of its first step, whose
    one-time costs (allocator, communicator and kernel warm-up; a loaded host) block the main
    thread in C++ for longer than a step; then the soft timeout applies. Default:
    heartbeat_timeout_seconds. At or below the soft timeout: no allowance."""
    inprocess_pod_loss_timeout_seconds: float = Field(default=10.0, gt=0)
    """How long the in-process wrapper waits for a silent rank (its whole pod gone, launcher and
    monitor processes too) before it declares it lost and restarts the others in place: the
    detection floor of a pod loss with warm spares (NVRx `heartbeat_timeout`, default 30 s)."""
    inprocess_gpu_health_checks: bool = True
    """On CUDA, let the in-process wrapper chain NVRx's NVML GPU/NVLink/NIC health checks into
    every restart (a failing check ends the process, i.e. a launcher restart)."""
    spare_nodes: int = Field(default=0, ge=0)
    """Warm spares (env RTJ_SPARE_NODES, from `spec.faultTolerance.spares`): the last
    `spare_nodes` launchers' ranks start with everyone, join the in-process wrapper's world as
    inactive ranks, and take over the ranks of a lost pod in place (rtj_trainer.resiliency).
    Needs in-process restart."""
    lost_pods_file: str | None = None
    """The launcher shim's file of the operator's verdicts on lost peer pods (env
    RTJ_LOST_PODS_FILE, set by rtj_trainer.launcher for its workers). With in-process restart
    and `job.pod_uid` known, a thread applies them to the wrapper at once instead of waiting
    `inprocess_pod_loss_timeout_seconds` for the lost ranks' heartbeats (rtj_trainer.podloss).
    None: only the heartbeats tell."""


class MetricsConfig(_Section):
    """Prometheus endpoint: rank with local rank r serves on host:(port + r)."""

    host: str = "127.0.0.1"
    port: int | None = Field(default=None, ge=0, le=65535)
    """Base port; None disables the endpoint."""


class JobConfig(_Section):
    """Job identity and topology as the operator describes it (informational for the trainer)."""

    name: str = "local"
    uid: str = ""
    namespace: str = ""
    pod_name: str = ""
    pod_uid: str = ""
    """The pod's UID (env POD_UID): what the operator names when it reports a pod lost
    (rtj_trainer.podloss)."""
    pod_ip: str = ""
    node_index: int = 0
    nnodes: int = 1
    procs_per_node: int = 1
    attempt: int = Field(default=0, ge=0)


class Config(_Section):
    """Everything a run needs; `Config.model_dump()` is what the trainer logs at start."""

    model: ModelConfig
    data: DataConfig = DataConfig()
    optim: OptimConfig = OptimConfig()
    train: TrainConfig = TrainConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    resiliency: ResiliencyConfig = ResiliencyConfig()
    metrics: MetricsConfig = MetricsConfig()
    job: JobConfig = JobConfig()
    faults: str = ""
    """TRAINER_FAULTS: comma-separated STEP:RANK:KIND (see rtj_trainer.faults)."""
    fault_injection: bool = False
    """RTJ_FAULT_INJECTION: whether `faults` may fire. The operator sets it only for a job whose
    spec asks for it (`faultTolerance.faultInjection: Enabled`); train-local.sh sets it."""
    _fault_list: tuple[Fault, ...] = PrivateAttr(default=())

    @model_validator(mode="after")
    def _tokens_fit_their_type(self) -> Config:
        if (self.data.kind == "memmap" and self.data.dtype == "uint16"
                and self.model.vocab_size > 65536):
            raise ValueError(f"data.dtype: uint16 tokens cannot hold a vocabulary of "
                             f"{self.model.vocab_size} (model.vocab_size); use uint32")
        return self

    @model_validator(mode="after")
    def _parse_faults(self) -> Config:
        try:
            self._fault_list = parse_faults(self.faults)
        except FaultSpecError as exc:
            raise ValueError(f"faults: {exc}") from None
        if self._fault_list and not self.fault_injection:
            raise ValueError(
                "faults: TRAINER_FAULTS is set but fault injection is not enabled "
                "(RTJ_FAULT_INJECTION=1; in a job: faultTolerance.faultInjection: Enabled)")
        return self

    @property
    def fault_list(self) -> tuple[Fault, ...]:
        """`faults`, parsed (once, when the config was validated); empty unless enabled."""
        return self._fault_list

    @property
    def run_dir(self) -> Path:
        return Path(self.train.run_dir or self.checkpoint.dir)
