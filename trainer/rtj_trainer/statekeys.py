"""The keys of the trainer's checkpointed state (`Trainer.state_dict`) and of its run folder's
files, shared by the trainer and the checkpoint export (rtj_trainer.export)."""

from __future__ import annotations

STEP = "step"
"""The last completed step."""
DATA = "data"
"""Where the data stream stands: `{NEXT_STEP: ..., FINGERPRINT: ..., CONSUMED: ...}`."""
RNG = "rng"
MONITOR = "monitor"
"""The NVRx rank monitor's state (learned timeouts)."""
PRODUCTIVE_SECONDS = "productive_seconds"
"""Wall seconds of the steps up to this checkpoint (the productive-seconds counter resumes here)."""
STEP_COMPLETED_AT = "step_completed_at"
"""When the step first completed (a resume counts the seconds since then as lost)."""
LOSS = "loss"
"""The loss of the last completed step (the summary's `final_loss` of an attempt that resumes at
the last step and runs none)."""
HF_CONFIG = "hf_config"
"""With `model.hf_path`: the model's config.json (text), so that an export of the checkpoint is a
complete Hugging Face directory (rtj_trainer.export)."""
NEXT_STEP = "next_step"
FINGERPRINT = "fingerprint"
CONSUMED = "consumed"
"""Blocks of a kind=hf stream read by the whole job (TokenBatches.consumed)."""
LOSSES_FILE = "losses.jsonl"
