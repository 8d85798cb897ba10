"""Hugging Face causal LMs as the built-in trainer's model (`model.hf_path`).

`AutoModelForCausalLM` from a local directory in Hugging Face layout: `config.json`, and
`*.safetensors` weights when present. Nothing is fetched from a hub (the directory is read with
`local_files_only`); tests write tiny configs locally. What the rest of the trainer needs of a
model, this module gives for any causal LM whose decoder layers sit in one `nn.ModuleList` (Llama,
Qwen, Mistral, Gemma and their relatives):

- `build`: the model on a device, initialised from the config with the job's seed (identical on
  every rank), or on the meta device when a checkpoint or the directory's weights will overwrite
  every parameter (a restart then allocates only this rank's shards and runs no initialisation);
- `fuse_norms`: the Llama-style RMSNorms (Llama, Mistral, Qwen2/3: the same forward) run as
  `torch.nn.functional.rms_norm`, one kernel on CUDA instead of seven element-wise ones in fp32
  (the HF model's step was 40 % slower than the GPT's of the same size on an H200, mostly there);
- `fuse_mlps` and `contiguous_rope`: the SwiGLU gate and the rotary embedding of the same
  families through `rtj_trainer.kernels` (Triton kernels on CUDA; +3.2 % against the GPT's step
  on an H100 with them, +21.7 % before them, on an H200);
- `decoder_layers`: the FSDP units (rtj_trainer.parallel shards each, then the root);
- `restore_buffers`: non-persistent buffers (rotary embeddings' `inv_freq`) are in no state dict,
  so a model built on the meta device gets them computed again, from a fresh instance of the
  module that holds them;
- `load_weights`: the directory's safetensors into the sharded model (every rank reads the files,
  memory-mapped; torch's state-dict API keeps this rank's shards).
"""

from __future__ import annotations

import functools
import inspect
import json
import logging
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from . import kernels

log = logging.getLogger(__name__)

CONFIG_FILE = "config.json"


def hf_config(path: str | Path) -> Any:
    """The directory's `PretrainedConfig`, with the KV cache off (training)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    config.use_cache = False
    return config


def has_weights(path: str | Path) -> bool:
    return any(Path(path).glob("*.safetensors"))


def build(path: str | Path, *, device: torch.device | str, seed: int | None) -> nn.Module:
    """The causal LM of `path` on `device`: initialised from its config with `seed` (the same on
    every rank), or, with `seed` None, built on `device` without initialisation (the meta
    device: the caller loads every parameter)."""
    from transformers import AutoModelForCausalLM

    config = hf_config(path)
    if seed is not None:
        torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]
            config, dtype=torch.float32)
    model.config.use_cache = False
    fuse_norms(model)
    fuse_mlps(model)
    contiguous_rope(model)
    return model  # type: ignore[no-any-return]


ROPE_FAMILIES = frozenset({"llama", "mistral", "qwen2", "qwen3"})
"""Model families whose `apply_rotary_pos_emb` is Llama's (`q * cos + rotate_half(q) * sin`)."""


def _rope_in_place_layout(original: Any) -> Any:
    def apply_rotary_pos_emb(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                             sin: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if (args or kwargs.get("unsqueeze_dim", 1) != 1 or q.dim() != 4 or q.shape[-1] % 2
                or cos.requires_grad or sin.requires_grad
                or not cos.dtype == sin.dtype == q.dtype == k.dtype):
            return original(q, k, cos, sin, *args, **kwargs)
        # q, k: (batch, heads, seq, dim) views of (batch, seq, heads, dim) projections. HF's
        # element-wise ops on those strided views ran in PyTorch's generic (non-vectorised)
        # kernels: 30 ms of a 1B model's 243 ms step on an H200. The same arithmetic on the
        # projections' own layout (rtj_trainer.kernels: one Triton kernel on CUDA), viewed back.
        c, s = cos.unsqueeze(2), sin.unsqueeze(2)
        return (kernels.rotary(q.transpose(1, 2), c, s).transpose(1, 2),
                kernels.rotary(k.transpose(1, 2), c, s).transpose(1, 2))

    apply_rotary_pos_emb.rtj_original = original  # type: ignore[attr-defined]
    return apply_rotary_pos_emb


def contiguous_rope(model: nn.Module) -> bool:
    """Llama-family models: their modeling module's `apply_rotary_pos_emb` computes in the
    projections' layout (`kernels.rotary`: fewer passes, each output rounded once instead of
    three times); once per module. Returns whether the model's module has it now."""
    import sys

    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) not in ROPE_FAMILIES:
        return False
    module = sys.modules.get(type(model).__module__)
    current = getattr(module, "apply_rotary_pos_emb", None)
    if module is None or current is None or not hasattr(module, "rotate_half"):
        return False
    if not hasattr(current, "rtj_original"):
        module.apply_rotary_pos_emb = _rope_in_place_layout(current)  # type: ignore[attr-defined]
    return True


@functools.cache
def _llama_forward_source(name: str) -> str:
    """The source of `transformers`' Llama module `name`'s forward (the reference the fused
    forwards below stand in for)."""
    from transformers.models.llama import modeling_llama

    return inspect.getsource(getattr(modeling_llama, name).forward)


def _has_forward_of(module: nn.Module, name: str) -> bool:
    """The module's forward is Llama's `name`'s, character for character."""
    forward = getattr(type(module), "forward", None)
    if forward is None:
        return False
    try:
        return inspect.getsource(forward) == _llama_forward_source(name)
    except (OSError, TypeError):
        return False


def _replace_forwards(model: nn.Module, wanted: Callable[[nn.Module], bool],
                      forward: Callable[..., torch.Tensor]) -> int:
    """`forward` bound as the forward of every module of `model` that is `wanted`; how many."""
    replaced = 0
    for module in model.modules():
        if wanted(module):
            module.forward = types.MethodType(forward, module)  # type: ignore[method-assign]
            replaced += 1
    return replaced


def _is_llama_norm(module: nn.Module) -> bool:
    """The module's forward is LlamaRMSNorm's, character for character (Gemma's `1 + weight`
    norm, for one, is not)."""
    return hasattr(module, "variance_epsilon") and _has_forward_of(module, "LlamaRMSNorm")


def _fused_rms_norm(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    weight: torch.Tensor = self.weight  # type: ignore[assignment]
    eps: float = self.variance_epsilon  # type: ignore[assignment]
    if weight.dtype != hidden_states.dtype:  # no mixed-precision cast: HF's own arithmetic
        return type(self).forward(self, hidden_states)  # type: ignore[no-any-return]
    return F.rms_norm(hidden_states, (hidden_states.shape[-1],), weight, eps)


def fuse_norms(model: nn.Module) -> int:
    """Run every Llama-style RMSNorm of `model` as `F.rms_norm` (computed in fp32 inside, like
    HF's, rounded once instead of twice); returns how many."""
    return _replace_forwards(model, _is_llama_norm, _fused_rms_norm)


def _is_llama_swiglu_mlp(module: nn.Module) -> bool:
    """The module's forward is LlamaMLP's, character for character (Mistral's and Qwen2/3's
    are), and its activation is SiLU."""
    config = getattr(module, "config", None)
    return (getattr(config, "hidden_act", None) in ("silu", "swish")
            and _has_forward_of(module, "LlamaMLP"))


def _fused_mlp(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    gate = self.gate_proj(x)  # type: ignore[operator]
    up = self.up_proj(x)  # type: ignore[operator]
    return self.down_proj(kernels.swiglu(gate, up))  # type: ignore[operator, no-any-return]


def fuse_mlps(model: nn.Module) -> int:
    """Run every Llama-style SwiGLU MLP's `silu(gate) * up` as `kernels.swiglu` (one kernel
    each way on CUDA; the SiLU recomputed in backward, not kept); returns how many."""
    return _replace_forwards(model, _is_llama_swiglu_mlp, _fused_mlp)


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The model's decoder layers (one FSDP unit each): the ModuleList whose length is the
    config's `num_hidden_layers`."""
    config = getattr(model, "config", None)
    text = getattr(config, "text_config", None) or config
    count = getattr(text, "num_hidden_layers", None)
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) == count:
            return module
    raise ValueError(f"model.hf_path: no list of {count} decoder layers in "
                     f"{type(model).__name__}")


def restore_buffers(model: nn.Module, device: torch.device) -> int:
    """Compute the non-persistent buffers of a model that was built on the meta device and moved
    with `to_empty` (their memory holds garbage): each module that holds one is built again
    from its config, on the CPU, and its buffers copied over. Returns how many were restored."""
    restored = 0
    for module in model.modules():
        names = [n for n in getattr(module, "_non_persistent_buffers_set", ()) if
                 getattr(module, n, None) is not None]
        if not names:
            continue
        config = getattr(module, "config", None)
        if config is None:
            raise ValueError(f"model.hf_path: {type(module).__name__} holds non-persistent "
                             f"buffers {names} and no config to compute them from")
        with torch.device("cpu"):
            fresh = type(module)(config)
        for name in names:
            getattr(module, name).copy_(getattr(fresh, name).to(device))
            restored += 1
    return restored


def load_weights(model: nn.Module, path: str | Path) -> None:
    """The directory's safetensors weights into `model` (sharded or not): every parameter and
    persistent buffer must be there, but for the ones tied to another (an untied copy of the
    input embeddings is not stored)."""
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    state: dict[str, torch.Tensor] = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        state.update(load_file(str(file)))
    expected = set(model.state_dict())
    tied = _tied_keys(model)
    missing = sorted(expected - set(state) - tied)
    if missing:
        raise ValueError(f"model.hf_path: the weights in {path} lack {missing[:5]}"
                         f"{' and more' if len(missing) > 5 else ''}")
    set_model_state_dict(model, {k: v for k, v in state.items() if k in expected},
                         options=StateDictOptions(full_state_dict=True, strict=False))


def _tied_keys(model: nn.Module) -> set[str]:
    """Parameter names that share their tensor with an earlier name (tied embeddings)."""
    seen: dict[int, str] = {}
    tied = set()
    for name, param in model.named_parameters(remove_duplicate=False):
        key = id(param)
        if key in seen:
            tied.add(name)
        else:
            seen[key] = name
    return tied


def config_dict(path: str | Path) -> dict[str, Any]:
    """The directory's config.json, as the checkpoint keeps it (for `rtj_trainer.export`)."""
    data: dict[str, Any] = json.loads((Path(path) / CONFIG_FILE).read_text())
    return data
