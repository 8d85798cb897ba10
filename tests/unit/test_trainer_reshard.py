"""Per-rank shards read at another world size (rtj_trainer.checkpoint.reshard): FSDP2 slices
every sharded entry along dim 0 as `torch.chunk` does, each save records the whole shapes under
SHARDING, and `reshard` / `whole` must give exactly the slices a fresh FSDP2 at the new world
size would hold, or the whole tensors, from the old ranks' slices. `parallel.sharding` is what
writes that map, checked here on a real FSDP2 state."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from rtj_trainer import parallel
from rtj_trainer.checkpoint.reshard import SHARDING, needed_ranks, reshard, rows, whole

pytestmark = pytest.mark.unit

OLD_WORLD = 2
WHOLE = {
    "model/w": torch.arange(18, dtype=torch.float32).reshape(6, 3),
    "model/b": torch.arange(5, dtype=torch.float32) + 100,  # 5 rows: not divisible by 2 or 3
    "model/e": torch.arange(4, dtype=torch.float32).reshape(1, 4) + 200,  # rank 1 holds none
    "optimizer/state/w/exp_avg": torch.arange(18, dtype=torch.float64).reshape(6, 3) / 7,
}
"""The sliced entries, whole, by path (keys joined by `/`, as parallel.sharding writes them)."""


def _slice(tensor: torch.Tensor, world_size: int, rank: int) -> torch.Tensor:
    """Rank `rank`'s slice as FSDP2 holds it: `torch.chunk(tensor, world_size)[rank]`, or no
    rows where torch.chunk gives fewer chunks than ranks."""
    chunks = torch.chunk(tensor, world_size)
    return chunks[rank] if rank < len(chunks) else tensor[tensor.shape[0]:]


def _old_state(rank: int) -> dict[str, Any]:
    """Old rank `rank`'s checkpoint state at OLD_WORLD ranks: its slices, a replicated tensor
    and plain data (which differ per rank here only to show whose are kept: rank 0's)."""
    part = {path: _slice(t, OLD_WORLD, rank) for path, t in WHOLE.items()}
    return {
        "model": {"w": part["model/w"], "b": part["model/b"], "e": part["model/e"],
                  "buffer": torch.full((2,), float(rank))},
        "optimizer": {
            "state": {"w": {"exp_avg": part["optimizer/state/w/exp_avg"],
                            "step": torch.tensor(10.0 + rank)}},
            "param_groups": [{"lr": 0.1 + rank, "params": ["w", "b", "e"]}],
        },
        "scheduler": {"last_epoch": 10 + rank},
        "step": 10 + rank,
        SHARDING: {path: list(t.shape) for path, t in WHOLE.items()},
    }


OLD = {rank: _old_state(rank) for rank in range(OLD_WORLD)}


def _get(state: dict[str, Any], path: str) -> Any:
    node: Any = state
    for key in path.split("/"):
        node = node[key]
    return node


def test_rows_follow_torch_chunk() -> None:
    """For every dim of 0 to 12 rows over 1 to 6 ranks, `rows` gives each rank exactly the rows
    torch.chunk gives it, an empty range to the ranks past torch.chunk's last chunk, and
    nothing at all of an empty dim."""
    for total in range(13):
        for world_size in range(1, 7):
            chunks = torch.chunk(torch.arange(total), world_size)
            begin = 0
            for rank in range(world_size):
                size = len(chunks[rank]) if rank < len(chunks) else 0
                assert rows(total, rank, world_size) == (begin, begin + size), (
                    total, rank, world_size)
                begin += size
            assert begin == total


def test_rows_of_a_last_rank_with_none_and_of_an_empty_dim() -> None:
    """4 rows over 3 ranks: chunks of 2, the third rank holds none (as torch.chunk, which gives
    two chunks only); 0 rows: every rank holds the empty range at 0."""
    assert [rows(4, r, 3) for r in range(3)] == [(0, 2), (2, 4), (4, 4)]
    assert [rows(0, r, 2) for r in range(2)] == [(0, 0), (0, 0)]
    assert [rows(1, r, 2) for r in range(2)] == [(0, 1), (1, 1)]


@pytest.mark.parametrize("new_world", [3, 1])
def test_reshard_gives_each_new_rank_its_torch_chunk_slice_and_rank_0s_other_entries(
        new_world: int) -> None:
    """Every sliced entry of new rank r' is exactly torch.chunk(whole, W')[r'] (with its dtype
    and trailing dims, none for a rank past the last chunk); every other entry, tensor or plain
    data, is old rank 0's; the result records the same whole shapes, so it can be resharded
    again."""
    for rank in range(new_world):
        state = reshard(OLD, old_world_size=OLD_WORLD, rank=rank, world_size=new_world)
        for path, tensor in WHOLE.items():
            got, expected = _get(state, path), _slice(tensor, new_world, rank)
            assert got.dtype == expected.dtype and got.shape == expected.shape, path
            assert torch.equal(got, expected), (path, rank)
        assert torch.equal(state["model"]["buffer"], OLD[0]["model"]["buffer"])
        assert torch.equal(state["optimizer"]["state"]["w"]["step"], torch.tensor(10.0))
        assert state["optimizer"]["param_groups"] == OLD[0]["optimizer"]["param_groups"]
        assert state["scheduler"] == {"last_epoch": 10} and state["step"] == 10
        assert state[SHARDING] == OLD[0][SHARDING]


def test_reshard_back_to_the_old_world_size_gives_the_old_slices() -> None:
    """Resharding W -> W' -> W is the identity on every sliced entry."""
    middle = {r: reshard(OLD, old_world_size=OLD_WORLD, rank=r, world_size=3) for r in range(3)}
    for rank in range(OLD_WORLD):
        back = reshard(middle, old_world_size=3, rank=rank, world_size=OLD_WORLD)
        for path in WHOLE:
            assert torch.equal(_get(back, path), _get(OLD[rank], path)), (path, rank)


@pytest.mark.parametrize(("new_world", "expected"), [
    (3, [[0], [0, 1], [0, 1]]),
    (1, [[0, 1]]),
    (2, [[0], [0, 1]]),
])
def test_needed_ranks_name_the_old_ranks_holding_the_new_ranks_rows_and_rank_0(
        new_world: int, expected: list[list[int]]) -> None:
    """New rank 0 of 3 needs only old rank 0's rows; ranks 1 and 2 need old rank 1's (rank 2
    only those: rank 0 is named because its unsliced entries are every rank's). And those old
    shards are enough: resharding from them alone gives the same state."""
    sharding = OLD[0][SHARDING]
    got = [needed_ranks(sharding, old_world_size=OLD_WORLD, rank=r, world_size=new_world)
           for r in range(new_world)]
    assert got == expected
    for rank, needed in enumerate(got):
        few = reshard({r: OLD[r] for r in needed}, old_world_size=OLD_WORLD, rank=rank,
                      world_size=new_world)
        for path, tensor in WHOLE.items():
            assert torch.equal(_get(few, path), _slice(tensor, new_world, rank))


def test_reshard_refuses_when_a_needed_old_shard_was_not_read() -> None:
    """Rows held only by an old rank missing from `old` are an error naming that rank, never
    a silently short tensor."""
    with pytest.raises(ValueError, match="old rank 1's shard was not read"):
        reshard({0: OLD[0]}, old_world_size=OLD_WORLD, rank=0, world_size=1)


def test_whole_puts_the_model_back_together() -> None:
    """`whole(under="model")`: every model tensor whole (sliced ones concatenated from every
    rank, the others rank 0's), keyed by the path below `model`; nothing of the optimizer."""
    model = whole(OLD, world_size=OLD_WORLD, under="model")
    assert set(model) == {"w", "b", "e", "buffer"}
    for name in ("w", "b", "e"):
        assert torch.equal(model[name], WHOLE[f"model/{name}"]), name
    assert torch.equal(model["buffer"], torch.zeros(2))


@pytest.mark.parametrize("sharding", [None, {}])
def test_a_state_without_sharding_cannot_be_resharded(sharding: dict[str, Any] | None) -> None:
    """A save written before SHARDING existed (or with none recorded) is refused with a
    ValueError that says it resumes only at its own world size."""
    old = {}
    for rank, state in OLD.items():
        old[rank] = {k: v for k, v in state.items() if k != SHARDING}
        if sharding is not None:
            old[rank][SHARDING] = sharding
    with pytest.raises(ValueError, match="records no sharding"):
        reshard(old, old_world_size=OLD_WORLD, rank=0, world_size=1)


@pytest.fixture
def one_rank_group() -> Iterator[None]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_sharding_of_a_real_fsdp2_state_maps_parameter_paths_to_whole_shapes(
        one_rank_group: None) -> None:
    """On a `fully_shard`ed Linear(4, 3) after one AdamW step, `parallel.sharding` lists the
    parameters and their Adam moments (DTensors sharded on dim 0) with their whole shapes, by
    the paths reshard reads, and nothing else (not Adam's replicated `step`)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    assert parallel.sharding(model_sd, "model") == {"model/weight": [3, 4], "model/bias": [3]}
    assert parallel.sharding(optim_sd, "optimizer") == {
        "optimizer/state/weight/exp_avg": [3, 4], "optimizer/state/weight/exp_avg_sq": [3, 4],
        "optimizer/state/bias/exp_avg": [3], "optimizer/state/bias/exp_avg_sq": [3]}
