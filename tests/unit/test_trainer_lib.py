"""The trainer's public library for a team's own script (rtj_trainer.lib, docs/byo.md), on one
CPU rank: `init` → `step` → `finish` checkpoints the state the script names (model, optimizer,
a stateful object, plain data) and a new run resumes it exactly; a state the library cannot save
is refused at `init`, naming why; `RtjCallback` reports a Hugging Face `Trainer`'s steps and saves.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from rtj_trainer import lib as rtj
from rtj_trainer.config import ConfigError
from rtj_trainer.stop import STOP

pytestmark = pytest.mark.unit


@pytest.fixture
def one_rank(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """One gloo rank and the pod's environment the library reads (sync checkpoints every 5
    steps into `tmp_path/ckpt`, a termination message file)."""
    monkeypatch.setenv("RTJ_CHECKPOINT_DIR", str(tmp_path / "ckpt"))
    monkeypatch.setenv("RTJ_CHECKPOINT_INTERVAL_STEPS", "5")
    monkeypatch.setenv("RTJ_CHECKPOINT_MODE", "sync")
    monkeypatch.setenv("RTJ_TERMINATION_MESSAGE_PATH", str(tmp_path / "termination-log"))
    for name in ("RTJ_METRICS_PORT", "FT_RANK_MONITOR_IPC_SOCKET", "RTJ_STOP_SIGNAL_DIR"):
        monkeypatch.delenv(name, raising=False)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield tmp_path
    STOP.disarm()
    STOP.reset()
    dist.destroy_process_group()


class Counter:
    """A stateful object of the script's (a data loader's position)."""

    def __init__(self) -> None:
        self.position = 0

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = state["position"]


def _state(seed: int) -> dict[str, object]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    return {"model": model, "optimizer": torch.optim.AdamW(model.parameters(), lr=0.1),
            "loader": Counter(), "note": "plain data"}


def _train(state: dict[str, object], run: rtj.Run, until: int) -> None:
    model, optimizer = state["model"], state["optimizer"]
    assert isinstance(model, torch.nn.Module) and isinstance(optimizer, torch.optim.Optimizer)
    for step in range(run.start_step + 1, until + 1):
        loss = model(torch.full((2, 4), float(step))).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        state["loader"].position += 1  # type: ignore[attr-defined]
        assert not run.step(step, loss)


def test_a_run_checkpoints_its_state_and_the_next_run_resumes_it_exactly(
        one_rank: Path) -> None:
    first = _state(seed=0)
    run = rtj.init(first)
    assert run.start_step == 0
    _train(first, run, until=7)
    run.finish()  # saves step 7 (the last), waits for the commit
    message = json.loads((one_rank / "termination-log").read_text())
    assert message["outcome"] == "Succeeded" and message["committedStep"] == 7
    commits = [json.loads(line)["step"] for line in
               (one_rank / "ckpt" / "commits.jsonl").read_text().splitlines()]
    assert commits == [5, 7]
    again = _state(seed=1)  # other weights, an untouched optimizer
    second = rtj.init(again)
    assert second.start_step == 7
    for a, b in zip(first["model"].parameters(), again["model"].parameters(),  # type: ignore[attr-defined]
                    strict=True):
        assert torch.equal(a, b)
    exp_avg = [s["exp_avg"] for s in again["optimizer"].state.values()]  # type: ignore[attr-defined]
    assert exp_avg and all(e.abs().sum() > 0 for e in exp_avg)
    assert again["loader"].position == 7  # type: ignore[attr-defined]
    assert again["note"] == "plain data"
    assert second.snapshot().checkpoint_committed_step == 7
    second.close()


def test_a_state_the_library_cannot_save_is_refused_at_init(one_rank: Path) -> None:
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ConfigError, match="more than one optimizer"):
        rtj.init({"model": model, "a": torch.optim.SGD(model.parameters(), lr=1),
                  "b": torch.optim.SGD(model.parameters(), lr=1)})
    with pytest.raises(ConfigError, match="name one module"):
        rtj.init({"m1": model, "m2": torch.nn.Linear(2, 2),
                  "opt": torch.optim.SGD(model.parameters(), lr=1)})
    with pytest.raises(ConfigError, match="'__rtj__' is the library's own"):
        rtj.init({"model": model, "__rtj__": 1})


def test_the_hugging_face_callback_reports_the_trainers_steps_and_saves(
        one_rank: Path) -> None:
    from datasets import Dataset
    from rtj_trainer.lib.hf import RtjCallback, last_checkpoint
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
    data = Dataset.from_dict({"input_ids": [[(i + j) % 64 for i in range(12)]
                                            for j in range(32)]})
    data = data.map(lambda row: {"labels": row["input_ids"]})
    output = one_rank / "ckpt" / "hf"
    args = TrainingArguments(output_dir=str(output), max_steps=6, per_device_train_batch_size=4,
                             save_steps=3, logging_steps=1, report_to=[], use_cpu=True,
                             disable_tqdm=True)
    callback = RtjCallback()
    trainer = Trainer(model=LlamaForCausalLM(config), args=args, train_dataset=data,
                      callbacks=[callback])
    trainer.train(resume_from_checkpoint=last_checkpoint(str(output)))
    assert callback.run is not None
    snapshot = callback.run.snapshot()
    assert snapshot.step == 6 and snapshot.checkpoint_committed_step == 6
    assert snapshot.heartbeat_timestamp > 0
    message = json.loads((one_rank / "termination-log").read_text())
    assert message["outcome"] == "Succeeded" and message["committedStep"] == 6
    assert last_checkpoint(str(output)) == str(output / "checkpoint-6")


def test_the_scripts_own_entries_come_back_on_the_host() -> None:
    """`Run._load` hands the script's own entries (plain data, stateful objects) through
    `_on_host`: a checkpoint read onto a CUDA device (format.read_shard) holds its large tensors
    there, and those entries must come back where a read from the file's map put them, the
    CPU. Here: CPU tensors stay the same objects, containers and plain data keep their shape.
    The CUDA half is tests/gpu/test_snapshots_cuda.py."""
    from rtj_trainer.lib.run import _on_host

    big, small = torch.arange(1 << 19, dtype=torch.float32), torch.tensor([3])
    tree = {"ema": big, "hist": [small, (1, "x", small)], "n": 7, "none": None}
    back = _on_host(tree)
    assert sorted(back) == ["ema", "hist", "n", "none"]
    assert back["ema"] is big and back["hist"][0] is small and back["hist"][1][2] is small
    assert isinstance(back["hist"], list) and isinstance(back["hist"][1], tuple)
    assert back["hist"][1][:2] == (1, "x") and back["n"] == 7 and back["none"] is None
