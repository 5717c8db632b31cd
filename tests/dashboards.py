"""Read back what a run sent to its dashboards, with the dashboards' own readers.

* TensorBoard: ``tensorboard.backend.event_processing.event_accumulator.EventAccumulator`` over the event
  folder, with TensorBoard's default handling of restarts (``purge_orphaned_data=True``: a SessionLog.START at
  step s drops the events at steps >= s written before it; event_accumulator.py, ``_MaybePurgeOrphanedData``).
* W&B offline runs: the run file ``run-<id>.wandb`` holds one ``wandb.proto.wandb_internal_pb2.Record`` (W&B's
  own protobuf type) per entry, framed in the leveldb log format (32 KiB blocks, each entry as checksum u32,
  length u16, type u8 FULL=1 / FIRST=2 / MIDDLE=3 / LAST=4, then the data; leveldb's doc/log_format.md) after a
  7-byte header ``:W&B``, 0xBEE1, version 0 (wandb 0.25, wandb/sdk/internal/datastore.py, lines 1-47). History
  records carry each logged value as JSON by key, the step as ``_step``.
"""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path

BLOCK = 32768
HEADER = 7


def tensorboard_scalars(logdir: str | Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar tag of the event files under ``logdir`` -> [(step, value)] in step order, as TensorBoard
    shows them."""
    from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={SCALARS: 0})  # 0: keep every event
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def tensorboard_texts(logdir: str | Path, tag: str) -> list[tuple[int, str]]:
    """The text summaries of ``tag`` -> [(step, text)], read with the accumulator TensorBoard's server uses
    (``plugin_event_accumulator``: text is a string tensor there, and restarts purge tensors too)."""
    from tensorboard.backend.event_processing.plugin_event_accumulator import TENSORS, EventAccumulator
    from tensorboard.util import tensor_util

    acc = EventAccumulator(str(logdir), size_guidance={TENSORS: 0})
    acc.Reload()
    out = []
    for e in acc.Tensors(f"{tag}/text_summary"):
        value = tensor_util.make_ndarray(e.tensor_proto)
        out.append((e.step, value.item().decode() if value.shape == () else value.flat[0].decode()))
    return out


def _leveldb_records(data: bytes) -> list[bytes]:
    """The payloads of a leveldb-log file after its header; each entry's checksum (crc32 of its type byte and its
    data, as W&B's writer computes it) is checked."""
    out, pending, pos = [], b"", HEADER
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        if left < 7:  # block trailer: zero padding
            pos += left
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0 and length == 0:  # zero-filled rest of a block
            pos += left
            continue
        chunk = data[pos + 7 : pos + 7 + length]
        if zlib.crc32(bytes([kind]) + chunk) & 0xFFFFFFFF != crc:
            raise ValueError(f"corrupt W&B record at byte {pos}")
        pos += 7 + length
        if kind == 1:
            out.append(chunk)
        elif kind == 2:
            pending = chunk
        elif kind == 3:
            pending += chunk
        elif kind == 4:
            out.append(pending + chunk)
            pending = b""
    return out


def wandb_offline_runs(root: str | Path) -> list[Path]:
    """The run files of the offline W&B runs under ``root`` (``wandb/offline-run-*/run-*.wandb``), oldest first."""
    return sorted(Path(root).glob("wandb/offline-run-*/run-*.wandb"))


def wandb_history(run_file: str | Path) -> tuple[str, list[dict]]:
    """(run id, history rows) of one W&B offline run file: each row a dict of the logged values by key, with
    ``_step``."""
    from wandb.proto import wandb_internal_pb2

    data = Path(run_file).read_bytes()
    if data[:4] != b":W&B" or struct.unpack("<H", data[4:6])[0] != 0xBEE1:
        raise ValueError(f"{run_file} is not a W&B run file")
    run_id, rows = "", []
    for payload in _leveldb_records(data):
        rec = wandb_internal_pb2.Record()
        rec.ParseFromString(payload)
        kind = rec.WhichOneof("record_type")
        if kind == "run" and rec.run.run_id:  # later run records (updates) may leave the id out
            run_id = run_id or rec.run.run_id
        elif kind == "history":
            rows.append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in rec.history.item})
    return run_id, rows
