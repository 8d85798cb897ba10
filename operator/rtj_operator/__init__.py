"""Kopf operator that runs resilient multi-node PyTorch training jobs (ResilientTrainingJob)."""
