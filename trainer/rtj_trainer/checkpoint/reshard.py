"""Per-rank shards read at another world size, and whole tensors put back together.

A rank's shard holds its local slices of the model and optimizer state: FSDP2 shards every
parameter (and the optimizer state that follows it) along dim 0 the way `torch.chunk` splits it
(rank `r` of `W` holds rows `[r*c, min((r+1)*c, n))`, `c = ceil(n / W)`, possibly none). Each
save records which entries are such slices and their whole shape, under `SHARDING` (written by
rtj_trainer.parallel.local_state and the library's checkpoints): `{path: [whole dims]}`, a path
being the keys down to the tensor joined by `/`.

- `reshard`: this rank's state at a new world size, from the old ranks' states (the rows of each
  sliced entry it now holds, taken from the old slices that hold them; every other entry from
  the old rank 0). `needed_ranks` says which old shards that takes.
- `whole`: every sliced entry put back together (an export: rtj_trainer.export).

Pure functions of tensors and dicts: the loader (rtj_trainer.checkpoint.loading) reads the shards.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

SHARDING = "sharding"
"""The key of a state's map of sliced entries (`{path: [whole dims]}`)."""
SEPARATOR = "/"


def rows(total: int, rank: int, world_size: int) -> tuple[int, int]:
    """The rows `[begin, end)` of a dim of `total` that rank `rank` of `world_size` holds
    (`torch.chunk` semantics: the last ranks may hold none)."""
    chunk = -(-total // world_size) if total else 0
    begin = min(total, rank * chunk)
    return begin, min(total, begin + chunk)


def paths(tree: Any, prefix: tuple[str, ...] = ()) -> Iterator[tuple[str, Any]]:
    """(path, leaf) of every leaf of a nested dict/list state."""
    if isinstance(tree, Mapping):
        for key, value in tree.items():
            yield from paths(value, (*prefix, str(key)))
    elif isinstance(tree, list | tuple):
        for index, value in enumerate(tree):
            yield from paths(value, (*prefix, str(index)))
    else:
        yield SEPARATOR.join(prefix), tree


def _map(tree: Any, leaf: Callable[[str, Any], Any], prefix: tuple[str, ...] = ()) -> Any:
    if isinstance(tree, Mapping):
        return {key: _map(value, leaf, (*prefix, str(key))) for key, value in tree.items()}
    if isinstance(tree, list):
        return [_map(value, leaf, (*prefix, str(i))) for i, value in enumerate(tree)]
    if isinstance(tree, tuple):
        return tuple(_map(value, leaf, (*prefix, str(i))) for i, value in enumerate(tree))
    return leaf(SEPARATOR.join(prefix), tree)


def sharding_of(state: Mapping[str, Any]) -> dict[str, list[int]]:
    """The state's map of sliced entries ({} for a save written before it existed)."""
    found = state.get(SHARDING) or {}
    return {str(path): [int(d) for d in dims] for path, dims in found.items()}


def needed_ranks(sharding: Mapping[str, list[int]], *, old_world_size: int, rank: int,
                 world_size: int) -> list[int]:
    """The old ranks whose shards hold rows this rank needs at the new world size (rank 0 always:
    its entries that are not sliced are every rank's)."""
    needed = {0}
    for dims in sharding.values():
        begin, end = rows(dims[0], rank, world_size)
        if begin == end:
            continue
        for old in range(old_world_size):
            old_begin, old_end = rows(dims[0], old, old_world_size)
            if old_begin < end and begin < old_end:
                needed.add(old)
    return sorted(needed)


def _rows_of(path: str, dims: list[int], begin: int, end: int,
             old: Mapping[int, Mapping[str, Any]], old_world_size: int) -> torch.Tensor:
    """Rows `[begin, end)` of the whole entry `path`, from the old slices that hold them."""
    parts = []
    for rank in range(old_world_size):
        old_begin, old_end = rows(dims[0], rank, old_world_size)
        lo, hi = max(begin, old_begin), min(end, old_end)
        if lo >= hi:
            continue
        if rank not in old:
            raise ValueError(f"resharding {path}: old rank {rank}'s shard was not read")
        piece = _leaf(old[rank], path)
        parts.append(piece[lo - old_begin:hi - old_begin])
    if not parts:
        template = _leaf(old[0], path)
        empty: torch.Tensor = template.new_empty((0, *dims[1:]))
        return empty
    return torch.cat(parts) if len(parts) > 1 else parts[0].clone()


def _leaf(state: Mapping[str, Any], path: str) -> Any:
    node: Any = state
    for key in path.split(SEPARATOR):
        node = node[int(key)] if isinstance(node, list | tuple) else node[key]
    return node


def reshard(old: Mapping[int, Mapping[str, Any]], *, old_world_size: int, rank: int,
            world_size: int) -> dict[str, Any]:
    """This rank's state at `world_size`, from the old ranks' states `old` (at least
    `needed_ranks`). The structure and every entry that is not sliced are old rank 0's."""
    base = old[0]
    sharding = sharding_of(base)
    if not sharding:
        raise ValueError("the checkpoint records no sharding (written before resharding "
                         "existed): it can be resumed only at its own world size")

    def leaf(path: str, value: Any) -> Any:
        dims = sharding.get(path)
        if dims is None:
            return value
        begin, end = rows(dims[0], rank, world_size)
        return _rows_of(path, dims, begin, end, old, old_world_size)

    result: dict[str, Any] = _map(base, leaf)
    return result


def whole(states: Mapping[int, Mapping[str, Any]], *, world_size: int,
          under: str) -> dict[str, torch.Tensor]:
    """Every tensor under the top-level key `under` (e.g. the model), whole: sliced entries put
    back together from every rank's state, the others from rank 0's. Keys are the paths below
    `under`."""
    base = states[0]
    sharding = sharding_of(base)
    found: dict[str, torch.Tensor] = {}
    prefix = under + SEPARATOR
    for path, value in paths(base[under], (under,)):
        if not isinstance(value, torch.Tensor):
            continue
        dims = sharding.get(path)
        tensor = (_rows_of(path, dims, 0, dims[0], states, world_size)
                  if dims is not None else value)
        found[path.removeprefix(prefix)] = tensor
    return found
