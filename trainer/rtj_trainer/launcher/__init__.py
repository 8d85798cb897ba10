"""The launcher shim: what runs in the ft_launcher process of every trainer pod.

Imported only by that process (`python -m rtj_trainer.launcher <ft_launcher arguments>`, the
container command the operator gives every trainer pod; trainer/scripts/train-local.sh runs it
too), never by a training worker. It wraps NVRx's ft_launcher (`shim`; the NVRx patches
themselves are in rtj_trainer.nvrx.launcher), serves the pod's liveness endpoint and takes the
operator's verdicts on lost peer pods (`podmetrics`, `verdicts`), and keeps the pool of warm
worker processes (`warmpool`; the warm workers themselves are rtj_trainer.warm). It never imports
the worker's packages (model, training loop, checkpointer): an import-linter contract says so.
"""
