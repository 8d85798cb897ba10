"""The built-in trainer on Hugging Face causal LMs (`model.hf_path`, rtj_trainer.hfmodel): tiny
Llama, Qwen2 and Mistral configs written locally (nothing fetched), built and sharded by
rtj_trainer.parallel on one CPU rank, trained a few steps; a model built on the meta device gets
its rotary buffers computed; a directory with weights is loaded (logits equal to transformers'
own); the checkpoint exported with `python -m rtj_trainer.export` loads back with
`AutoModelForCausalLM.from_pretrained` with the same logits as the trained model."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from rtj_trainer import parallel
from rtj_trainer.carry import CarryOver
from rtj_trainer.checkpoint import Checkpointer
from rtj_trainer.config import ConfigError
from rtj_trainer.configload import build_config
from rtj_trainer.data import TokenBatches
from rtj_trainer.export import main as export_main
from rtj_trainer.statekeys import HF_CONFIG
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
)

pytestmark = pytest.mark.unit

SHAPE: dict[str, Any] = {"vocab_size": 300, "hidden_size": 64, "intermediate_size": 128,
                         "num_hidden_layers": 2, "num_attention_heads": 4,
                         "num_key_value_heads": 2, "max_position_embeddings": 128}
FAMILIES = {"llama": LlamaConfig, "qwen2": Qwen2Config, "mistral": MistralConfig}


def write_config(directory: Path, family: str = "llama", *, weights: bool = False,
                 **extra: Any) -> Path:
    config = FAMILIES[family](**{**SHAPE, **extra})
    if weights:
        torch.manual_seed(123)
        AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    else:
        config.save_pretrained(directory)
    return directory


@pytest.fixture
def one_rank() -> Iterator[None]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield None
    dist.destroy_process_group()


def config_for(path: Path, *more: str) -> Any:
    return build_config(preset="tiny", env={},
                        overrides=["train.device=cpu", f"model.hf_path={path}", *more])


def context(cfg: Any) -> parallel.DistributedContext:
    """The one-rank CPU context (the process group is the fixture's)."""
    return parallel.DistributedContext(rank=0, local_rank=0, world_size=1,
                                       device=torch.device("cpu"),
                                       mesh=torch.distributed.device_mesh.init_device_mesh(
                                           "cpu", (1,)))


def test_the_config_takes_the_models_shape_from_its_directory(tmp_path: Path) -> None:
    cfg = config_for(write_config(tmp_path))
    assert (cfg.model.vocab_size, cfg.model.num_layers, cfg.model.d_model,
            cfg.model.num_heads) == (300, 2, 64, 4)
    with pytest.raises(ConfigError, match=r"model\.hf_path: cannot read"):
        config_for(tmp_path / "missing")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ConfigError, match=r"model\.hf_path: .* lacks a causal LM.s shape"):
        config_for(tmp_path / "bad")


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_each_family_is_sharded_per_decoder_layer_and_trains(
        tmp_path: Path, family: str, one_rank: None) -> None:
    cfg = config_for(write_config(tmp_path, family), "data.batch_size=2")
    ctx = context(cfg)
    model = parallel.build_model(cfg, ctx)
    layers = [m for m in model.modules() if type(m).__name__.startswith("FSDP")]
    assert len(layers) == 2 + 1  # every decoder layer and the root
    optimizer, scheduler = parallel.build_optimizer(cfg, model)
    data = TokenBatches(cfg.data, seq_len=cfg.model.seq_len, vocab_size=cfg.model.vocab_size)
    losses = [float(parallel.train_step(model, optimizer, scheduler, data.batch(s, 0), 1.0))
              for s in range(1, 4)]
    assert all(torch.isfinite(torch.tensor(losses)))


def test_a_model_built_on_the_meta_device_gets_its_rotary_buffers(
        tmp_path: Path, one_rank: None) -> None:
    """Non-persistent buffers are in no checkpoint: a restart that builds on the meta device
    computes them again (hfmodel.restore_buffers), equal to a fresh model's."""
    cfg = config_for(write_config(tmp_path))
    fresh = dict(AutoModelForCausalLM.from_config(LlamaConfig(**SHAPE)).named_buffers())
    rebuilt = dict(parallel.build_model(cfg, context(cfg), initialise=False).named_buffers())
    assert set(rebuilt) == set(fresh) and rebuilt
    for name, buffer in rebuilt.items():
        assert torch.equal(buffer, fresh[name]), name


def test_a_directory_with_weights_is_fine_tuned_from_them(tmp_path: Path,
                                                          one_rank: None) -> None:
    path = write_config(tmp_path, weights=True)
    cfg = config_for(path)
    model = parallel.build_model(cfg, context(cfg))
    reference = AutoModelForCausalLM.from_pretrained(path)
    tokens = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = parallel.forward_logits(model, tokens)
        theirs = reference(input_ids=tokens).logits
    torch.testing.assert_close(ours, theirs)


def test_an_exported_checkpoint_loads_back_with_the_trained_logits(
        tmp_path: Path, one_rank: None) -> None:
    """Train two steps, checkpoint as the trainer does (its model config kept), export with
    `python -m rtj_trainer.export`, load with transformers: the same logits."""
    path = write_config(tmp_path / "model", weights=True, tie_word_embeddings=False)
    cfg = config_for(path, f"checkpoint.dir={tmp_path / 'ckpt'}", "checkpoint.mode=sync")
    ctx = context(cfg)
    model = parallel.build_model(cfg, ctx)
    optimizer, scheduler = parallel.build_optimizer(cfg, model)
    data = TokenBatches(cfg.data, seq_len=cfg.model.seq_len, vocab_size=cfg.model.vocab_size)
    for step in (1, 2):
        parallel.train_step(model, optimizer, scheduler, data.batch(step, 0), 1.0)
    state = {**parallel.local_state(model, optimizer, scheduler),
             HF_CONFIG: json.dumps(json.loads((path / "config.json").read_text()))}
    checkpointer = Checkpointer(cfg.checkpoint, root=tmp_path / "ckpt", rank=0, world_size=1,
                                device=ctx.device, identity="a0", carry=CarryOver())
    checkpointer.save(2, state)
    checkpointer.wait_until_committed()
    checkpointer.close()
    assert export_main([str(tmp_path / "ckpt"), "--out", str(tmp_path / "hf")]) == 0
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    tokens = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(exported(input_ids=tokens).logits,
                                   parallel.forward_logits(model, tokens))


def test_an_export_of_the_gpt_says_it_is_no_hugging_face_model(
        tmp_path: Path, one_rank: None, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = build_config(preset="tiny", env={}, overrides=[
        "train.device=cpu", f"checkpoint.dir={tmp_path}", "checkpoint.mode=sync"])
    ctx = context(cfg)
    model = parallel.build_model(cfg, ctx)
    optimizer, scheduler = parallel.build_optimizer(cfg, model)
    checkpointer = Checkpointer(cfg.checkpoint, root=tmp_path, rank=0, world_size=1,
                                device=ctx.device, identity="a0", carry=CarryOver())
    checkpointer.save(1, parallel.local_state(model, optimizer, scheduler))
    checkpointer.wait_until_committed()
    checkpointer.close()
    assert export_main([str(tmp_path), "--out", str(tmp_path / "hf")]) == 2
    assert "not a Hugging Face model's checkpoint" in capsys.readouterr().err


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_llama_style_norms_run_fused_with_the_same_result(dtype: torch.dtype) -> None:
    """The HF model's RMSNorms run as one `F.rms_norm` (seven fp32 element-wise kernels each
    made the HF step 40 % slower than the GPT's on an H200): same numbers as HF's forward;
    Gemma's norm (`1 + weight`) is another formula and keeps its own forward."""
    from rtj_trainer import hfmodel
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

    torch.manual_seed(0)
    x = torch.randn(3, 5, 64).to(dtype)
    for cls in (LlamaRMSNorm, Qwen2RMSNorm):
        norm = cls(64, eps=1e-5).to(dtype)
        with torch.no_grad():
            norm.weight.uniform_(0.5, 1.5)
        expected = norm(x)
        assert hfmodel.fuse_norms(norm) == 1
        assert "forward" in vars(norm)
        torch.testing.assert_close(norm(x), expected, atol=1e-2 if dtype == torch.bfloat16
                                   else 1e-6, rtol=1e-2 if dtype == torch.bfloat16 else 1e-6)
    assert hfmodel.fuse_norms(GemmaRMSNorm(64)) == 0


def test_every_decoder_norm_of_a_built_model_is_fused(tmp_path: Path) -> None:
    from rtj_trainer import hfmodel

    model = hfmodel.build(write_config(tmp_path), device="meta", seed=None)
    norms = [m for m in model.modules() if type(m).__name__.endswith("RMSNorm")]
    assert len(norms) == 2 * SHAPE["num_hidden_layers"] + 1
    assert all("forward" in vars(m) for m in norms)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_swiglu_mlps_run_fused_with_hf_values_and_gradients(tmp_path: Path, family: str) -> None:
    """Every decoder MLP of a Llama-family model computes `silu(gate) * up` through
    `kernels.swiglu` (SiLU recomputed in backward): outputs and gradients of every weight as
    HF's own MLP gives them; an MLP with another activation is left as it is."""
    from rtj_trainer import hfmodel

    config = AutoConfig.from_pretrained(write_config(tmp_path, family))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).double()
    mlps = [m for m in model.modules() if type(m).__name__.endswith("MLP")]
    assert len(mlps) == SHAPE["num_hidden_layers"]
    x = torch.randn(2, 5, SHAPE["hidden_size"], dtype=torch.float64)
    weights = torch.randn(2, 5, SHAPE["hidden_size"], dtype=torch.float64)
    expected = []
    for mlp in mlps:
        out = mlp(x)
        grads = torch.autograd.grad((out * weights).sum(), list(mlp.parameters()))
        expected.append((out, grads))
    assert hfmodel.fuse_mlps(model) == len(mlps)
    for mlp, (expected_out, expected_grads) in zip(mlps, expected, strict=True):
        assert "forward" in vars(mlp)
        out = mlp(x)
        grads = torch.autograd.grad((out * weights).sum(), list(mlp.parameters()))
        torch.testing.assert_close(out, expected_out)
        for got, want in zip(grads, expected_grads, strict=True):
            torch.testing.assert_close(got, want)
    gelu = AutoModelForCausalLM.from_config(
        AutoConfig.from_pretrained(write_config(tmp_path / "gelu", family, hidden_act="gelu")))
    assert hfmodel.fuse_mlps(gelu) == 0


def test_rotary_embeddings_are_computed_in_the_projections_layout_with_the_same_numbers(
        tmp_path: Path) -> None:
    """HF's rotary embedding ran on (batch, heads, seq, dim) views of the projections, in
    PyTorch's generic strided kernels (about 30 ms of the HF model's 243 ms step on an H200):
    the patched function computes on the projections' own layout, half by half, with the same
    values and gradients as HF's (float64: to rounding; bfloat16: within one rounding)."""
    import transformers.models.llama.modeling_llama as llama
    from rtj_trainer import hfmodel

    hfmodel.build(write_config(tmp_path), device="meta", seed=None)
    patched = llama.apply_rotary_pos_emb
    original = patched.rtj_original
    for dtype, tolerance in ((torch.float64, 1e-12), (torch.bfloat16, 2e-2)):
        torch.manual_seed(0)
        # as LlamaAttention makes them; cos and sin with unequal halves (not only rope's own)
        q = torch.randn(2, 16, 4, 8, dtype=dtype).transpose(1, 2).requires_grad_()
        k = torch.randn(2, 16, 4, 8, dtype=dtype).transpose(1, 2).requires_grad_()
        cos, sin = torch.randn(2, 16, 8, dtype=dtype), torch.randn(2, 16, 8, dtype=dtype)
        weights = torch.randn(2, 4, 16, 8, dtype=dtype)
        results = []
        for function in (patched, original):
            outputs = function(q, k, cos, sin)
            grads = torch.autograd.grad(sum((o * weights).sum() for o in outputs), (q, k))
            results.append((outputs, grads))
        (got, got_grads), (expected, expected_grads) = results
        for a, b in zip((*got, *got_grads), (*expected, *expected_grads), strict=True):
            assert a.shape == b.shape and a.dtype == b.dtype
            torch.testing.assert_close(a, b, rtol=tolerance, atol=tolerance)
        assert got[0].transpose(1, 2).is_contiguous()  # computed in the projections' layout
    assert llama.apply_rotary_pos_emb is patched  # patched once
