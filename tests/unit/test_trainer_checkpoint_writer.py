"""The shard writer: bit-exact round trips across chunk edges and threads, failures that
leave an error record and no temporary file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from checkpoint_helpers import save_checkpoint, stage
from rtj_trainer import checkpoint as ck

pytestmark = pytest.mark.unit


def test_a_shard_round_trips_tensors_and_python_values(tmp_path: Path) -> None:
    directory = save_checkpoint(tmp_path, 5)
    state = ck.read_shard(directory / ck.shard_file_name(1, 2))
    assert torch.equal(state["w"], torch.full((4, 3), 51.0))
    assert state["step"] == 5 and torch.equal(state["nested"][0], torch.arange(3))
    assert state["nested"][1]["rng"].dtype == torch.uint8


def test_a_shard_round_trips_bit_exactly_across_chunk_boundaries(tmp_path: Path) -> None:
    generator = torch.Generator().manual_seed(3)
    tensors = {"bf16": torch.randn(257, 3, generator=generator).to(torch.bfloat16),
               "fp32": torch.randn(1001, generator=generator),
               "int64": torch.randint(-(2**62), 2**62, (77,), generator=generator),
               "empty": torch.zeros(0), "scalar": torch.tensor(2.5)}
    skeleton, layout, blob = stage({**tensors, "text": "kept"})
    path = tmp_path / "shard.bin"
    ck.write_shard(str(path), str(tmp_path / "rec.json"), skeleton, layout, blob, 0, False, 0.0,
                   chunk_bytes=1000, threads=4)  # chunk edges fall inside tensors
    loaded = ck.read_shard(path)
    for key, saved in tensors.items():
        assert loaded[key].dtype == saved.dtype and loaded[key].shape == saved.shape
        as_bytes = [t.reshape(-1).view(torch.uint8).tolist() for t in (loaded[key], saved)]
        assert as_bytes[0] == as_bytes[1]
    assert loaded["text"] == "kept"


def test_an_upload_reads_every_byte_over_uneven_chunks_and_threads(tmp_path: Path) -> None:
    from rtj_trainer.checkpoint import format as shard_format

    data = torch.randint(0, 256, (10_007,), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(5))
    path = tmp_path / "blob.bin"
    path.write_bytes(b"head" + data.numpy().tobytes() + b"tail")
    for threads, chunk in ((1, 10_007), (3, 1000), (8, 333)):  # chunks that miss the end
        got = shard_format.upload(path, 4, data.numel(), torch.device("cpu"), threads=threads,
                                  chunk_bytes=chunk)
        assert got.dtype == torch.uint8 and torch.equal(got, data)
    with pytest.raises(ck.CheckpointError, match="ends before byte"):  # a file cut short
        shard_format.upload(path, 4, data.numel() + 100, torch.device("cpu"), chunk_bytes=999)


def test_a_shard_is_read_through_the_map_where_no_device_takes_it(tmp_path: Path) -> None:
    from rtj_trainer.checkpoint import format as shard_format

    directory = save_checkpoint(tmp_path, 5)
    assert not shard_format.upload_room(torch.device("cpu"), 1)
    state = ck.read_shard(directory / ck.shard_file_name(1, 2), device=torch.device("cpu"))
    assert torch.equal(state["w"], torch.full((4, 3), 51.0)) and state["w"].device.type == "cpu"


def test_a_shard_whose_device_buffer_runs_out_of_memory_is_read_through_the_map(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    from rtj_trainer.checkpoint import format as shard_format

    def no_room(*_args: object, **_kwargs: object) -> torch.Tensor:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 11.30 GiB")

    directory = save_checkpoint(tmp_path, 5)
    # the room was there when asked, then another allocation took it
    monkeypatch.setattr(shard_format, "upload_room", lambda *_: True)
    monkeypatch.setattr(shard_format, "upload", no_room)
    state = ck.read_shard(directory / ck.shard_file_name(1, 2), device=torch.device("cpu"))
    assert torch.equal(state["w"], torch.full((4, 3), 51.0)) and state["step"] == 5
    assert "read through its memory map (no room on cpu: CUDA out of memory" in caplog.text


def test_parallel_writers_produce_the_same_file_as_one(tmp_path: Path) -> None:
    skeleton, layout, blob = stage({"x": torch.randn(5000), "y": torch.arange(999)})
    for name, threads in (("one", 1), ("many", 8)):
        ck.write_shard(str(tmp_path / f"{name}.bin"), str(tmp_path / f"{name}.json"), skeleton,
                       layout, blob, 0, False, 0.0, chunk_bytes=4096, threads=threads)
    one, many = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("one", "many"))
    assert (tmp_path / "one.bin").read_bytes() == (tmp_path / "many.bin").read_bytes()
    assert one["chunks"] == many["chunks"] and len(many["chunks"]) == 1 + 7  # header + 28,032 B
    assert many["writer"]["threads"] == 8 and many["writer"]["seconds"] > 0


def test_a_failed_write_leaves_an_error_record_and_no_commit(tmp_path: Path) -> None:
    directory = tmp_path / ck.checkpoint_dir_name(5, "x")  # never created: the write fails
    ck.write_shard(str(directory / "shard.bin"), str(tmp_path / "rec.json"), {}, [],
                   torch.zeros(64, dtype=torch.uint8), 0, True, 0.0)
    assert (tmp_path / "rec.json.error").exists() and not (tmp_path / "rec.json").exists()


def test_a_write_that_fails_midway_leaves_no_temporary_file(tmp_path: Path) -> None:
    (tmp_path / "shard.bin" / "in-the-way").mkdir(parents=True)  # written, then not renamed
    skeleton, layout, blob = stage({"x": torch.arange(100)})
    ck.write_shard(str(tmp_path / "shard.bin"), str(tmp_path / "rec.json"), skeleton, layout,
                   blob, 0, True, 0.0)
    assert (tmp_path / "rec.json.error").exists() and not (tmp_path / "rec.json").exists()
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


def _direct_io_works(folder: Path) -> bool:
    import os

    probe = folder / "probe"
    probe.write_bytes(b"")
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_DIRECT))
        return True
    except (OSError, AttributeError):
        return False


def test_direct_io_writes_the_aligned_data_past_the_cache_and_the_same_bytes(
        tmp_path: Path) -> None:
    """`checkpoint.direct_io`: a shard written with O_DIRECT where the filesystem allows it
    (the header and the unaligned last slice through the page cache) is byte for byte the
    shard written without, and its checksums verify; where it does not (tmpfs), every byte goes
    through the cache and the record says none went direct."""
    import numpy as np
    from rtj_trainer.checkpoint import format as shard_format
    from rtj_trainer.checkpoint.staging import plan_layout

    generator = torch.Generator().manual_seed(9)
    # Larger than one slice (8 MiB), not a multiple of the 4 KiB alignment: the last slice
    # and the header cannot go direct.
    data = torch.randint(0, 256, ((9 << 20) + 123,), dtype=torch.uint8, generator=generator)
    blob = torch.empty(data.numel(), dtype=torch.uint8).share_memory_()  # page-aligned, as staged
    blob.copy_(data)
    layout, _ = plan_layout([data])
    written = {}
    for direct in (False, True):
        path = tmp_path / f"shard-{direct}.bin"
        record = tmp_path / f"rec-{direct}.json"
        ck.write_shard(str(path), str(record), {"t": ck.TensorSlot(0)}, layout, blob, 0, False,
                       0.0, chunk_bytes=4 << 20, threads=3, direct=direct)
        shard = ck.ShardRecord.from_json(json.loads(record.read_text()))
        assert shard_format.checksum_problems(path, shard) == []
        written[direct] = (path.read_bytes(), shard.writer["direct_bytes"])
    assert written[True][0] == written[False][0]
    assert written[False][1] == 0
    data_bytes = np.frombuffer(written[True][0], dtype=np.uint8)[-data.numel():]
    assert torch.equal(torch.from_numpy(data_bytes.copy()), data)
    if _direct_io_works(tmp_path):
        # the two whole 4 MiB chunks; the last chunk (1 MiB + 123 bytes, one slice) and the
        # header go through the cache
        assert written[True][1] == 8 << 20
    else:
        assert written[True][1] == 0


_RELEASE_CHILD = """
import hashlib, json, sys, torch
from rtj_trainer import checkpoint as ck
from rtj_trainer.checkpoint.staging import plan_layout

def mapped_kib(address):
    # Rss of this process's mapping that holds `address` (/proc/self/smaps)
    inside = False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and ":" not in head:
            low, high = (int(x, 16) for x in head.split("-"))
            inside = low <= address < high
        elif inside and head == "Rss:":
            return int(line.split()[1])
    raise SystemExit("no mapping holds the blob")

out, snapshot_dir, n = sys.argv[1], sys.argv[2], 24 << 20
def fill(blob):
    seed = torch.Generator().manual_seed(3)
    blob.copy_(torch.randint(0, 256, (n,), dtype=torch.uint8, generator=seed))
blob = torch.empty(n, dtype=torch.uint8).share_memory_()
fill(blob)
before = hashlib.sha256(blob.numpy().tobytes()).hexdigest()
layout, _ = plan_layout([blob])
rows = {"touched_kib": mapped_kib(blob.data_ptr())}
ck.write_shard(out + "/shard.bin", out + "/rec.json", {"t": ck.TensorSlot(0)}, layout, blob, 0,
               True, 0.0, chunk_bytes=4 << 20, threads=3,
               local_copy=(snapshot_dir, 5, "a0-l0-i0-1"))
rows["after_write_kib"] = mapped_kib(blob.data_ptr())
blob[:4096].fill_(1)  # touched again: the next write releases it again
ck.writer.write_snapshot(snapshot_dir, 6, "a0-l0-i0-1", {"t": ck.TensorSlot(0)}, layout, blob, True)
rows["after_snapshot_kib"] = mapped_kib(blob.data_ptr())
rows["written_again"] = hashlib.sha256(blob.numpy().tobytes()).hexdigest() != before
fill(blob)
rows["same_after_release"] = hashlib.sha256(blob.numpy().tobytes()).hexdigest() == before
tail = open(out + "/shard.bin", "rb").read()[-n:]
rows["shard_tail"] = hashlib.sha256(tail).hexdigest() == before
print(json.dumps(rows))
"""


def test_the_writer_process_keeps_no_map_of_the_shared_staging_buffer_it_wrote(
        tmp_path: Path) -> None:
    """In the writer process (`in_worker`), each written slice of a shared staging buffer is
    released from the process's page tables (madvise DONTNEED), so a SIGKILLed trainer's writer
    exits without tearing down a map of GBs (issue #32's SIGKILL restart); the buffer's bytes are
    untouched (shared memory: the trainer's map and the data stay) and the shard is whole."""
    import subprocess
    import sys

    child = subprocess.run([sys.executable, "-c", _RELEASE_CHILD, str(tmp_path),
                            str(tmp_path / "local")], capture_output=True, text=True, timeout=120)
    assert child.returncode == 0, child.stderr
    rows = json.loads(child.stdout.strip().splitlines()[-1])
    assert rows["touched_kib"] >= 24 << 10  # all 24 MiB mapped before the write
    assert rows["after_write_kib"] <= 8  # a page's rounding at most
    assert rows["after_snapshot_kib"] <= 8
    assert rows["written_again"] and rows["same_after_release"] and rows["shard_tail"]
    shard = ck.ShardRecord.from_json(json.loads((tmp_path / "rec.json").read_text()))
    from rtj_trainer.checkpoint import format as shard_format
    assert shard_format.checksum_problems(tmp_path / "shard.bin", shard) == []
