"""Read an offline W&B run folder back (for tests): history rows from ``run-*.wandb`` and logged tables.

The ``.wandb`` file is a LevelDB-style log: a 7-byte header (``:W&B``, magic, version), then 32 KiB blocks of
records, each with a 7-byte header (CRC32C 4, length 2 little-endian, type 1: full/first/middle/last) whose
payloads join into serialised ``wandb.proto.Record`` messages.
"""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path
from typing import Any, Iterator

BLOCK = 32768
HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def _payloads(data: bytes) -> Iterator[bytes]:
    if data[:4] != b":W&B":
        raise ValueError("not a W&B run file (missing :W&B header)")
    position, pending = HEADER, b""
    while position + HEADER <= len(data):
        left_in_block = BLOCK - position % BLOCK
        if left_in_block < HEADER:  # block trailer padding
            position += left_in_block
            continue
        length, kind = struct.unpack("<HB", data[position + 4:position + 7])
        payload = data[position + HEADER:position + HEADER + length]
        position += HEADER + length
        if kind == 0 and length == 0:
            continue
        if kind == FULL:
            yield payload
        elif kind == FIRST:
            pending = payload
        elif kind == MIDDLE:
            pending += payload
        elif kind == LAST:
            yield pending + payload
            pending = b""


def records(run_dir: Path, timeout: float = 30.0) -> list[Any]:
    """Every record of an offline run, once the run's ``exit`` record is on disk.

    W&B's service process writes the file asynchronously: right after ``run.finish()`` returns, the file may
    still miss its records (seen as a rare failure of the tests that read it), so this waits for ``exit``.
    """
    from wandb.proto import wandb_internal_pb2 as pb

    deadline = time.monotonic() + timeout
    while True:
        [store] = list(Path(run_dir).glob("run-*.wandb"))
        found = []
        try:
            for payload in _payloads(store.read_bytes()):
                record = pb.Record()
                record.ParseFromString(payload)
                found.append(record)
        except Exception:  # noqa: BLE001 - a record half-written right now: read again
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
            continue
        if any(r.WhichOneof("record_type") == "exit" for r in found) or time.monotonic() > deadline:
            return found
        time.sleep(0.2)


def history(run_dir: Path) -> list[dict[str, Any]]:
    """Every ``run.log`` call of an offline run, as ``{key: value}`` (values JSON-decoded)."""
    rows = []
    for record in records(run_dir):
        if record.WhichOneof("record_type") == "history":
            rows.append({(item.key or "/".join(item.nested_key)): json.loads(item.value_json)
                         for item in record.history.item})
    return rows


def table(run_dir: Path, key_prefix: str) -> dict[str, Any]:
    """The JSON of the logged ``wandb.Table`` whose media file starts with ``key_prefix``."""
    [path] = list((Path(run_dir) / "files" / "media" / "table").glob(f"{key_prefix}_*.table.json"))
    return json.loads(path.read_text())


def offline_run(save_dir: Path) -> Path:
    """The single offline run folder under ``save_dir/wandb``."""
    [run] = list((Path(save_dir) / "wandb").glob("offline-run-*"))
    return run


def run_record(run_dir: Path) -> dict[str, Any]:
    """The run's own record: ``id``, ``display_name``, ``group``, ``job_type``, ``config`` (``{key: value}``) and
    ``start_time`` (seconds since the epoch, with its fraction: folder names hold whole seconds only)."""
    for record in records(run_dir):
        if record.WhichOneof("record_type") == "run":
            run = record.run
            config = {item.key: json.loads(item.value_json) for item in run.config.update}
            return {"id": run.run_id, "display_name": run.display_name, "group": run.run_group,
                    "job_type": run.job_type, "config": config,
                    "start_time": run.start_time.seconds + run.start_time.nanos / 1e9}
    raise ValueError(f"no run record in {run_dir}")


def artifacts(run_dir: Path) -> list[dict[str, Any]]:
    """The artifacts an offline run logged: ``name``, ``type`` and ``files`` (``{path in the artifact: digest}``,
    the digest being the base64 MD5 of the file's bytes, as W&B's manifest records it)."""
    found = []
    for record in records(run_dir):
        if record.WhichOneof("record_type") == "artifact":
            artifact = record.artifact
            found.append({"name": artifact.name, "type": artifact.type,
                          "files": {entry.path: entry.digest for entry in artifact.manifest.contents}})
    return found
