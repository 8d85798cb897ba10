"""FSDP trainer with NVIDIA Resiliency Extension: heartbeats, async checkpoints,
in-process restart, metrics and fault injection."""
