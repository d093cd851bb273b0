"""Experiment tracking: Weights & Biases gets every scalar TensorBoard gets (offline here: no network)."""

import json
import struct

from mop.cli import main
from test_train import run

_BLOCK, _HEADER = 32768, 7  # the .wandb file: a 7-byte header, then LevelDB log blocks of protobuf records


def wandb_history(path) -> list[dict]:
    """The history records (one per logged step) of an offline run's .wandb file."""
    from wandb.proto import wandb_internal_pb2

    data, pos, pending, history = path.read_bytes(), _HEADER, b"", []
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        left = _BLOCK - pos % _BLOCK
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7]) if left >= 7 else (0, 0, 0)
        if kind == 0:  # the zero padding at a block's end
            pos += left
            continue
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a whole record, or a record's last fragment
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            if record.WhichOneof("record_type") == "history":
                history.append({item.key or "/".join(item.nested_key): _value(item) for item in record.history.item})
    return history


def _value(item):
    kind = item.WhichOneof("value")
    return getattr(item, kind) if kind not in (None, "json") else json.loads(item.value_json or item.json)


def test_wandb_logs_every_scalar_of_every_step_offline_into_the_run_directory(tmp_path):
    records = run(tmp_path, "tracked", "--log.wandb=true", "--log.wandb_name=tiny")
    files = list((tmp_path / "tracked" / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 1
    history = wandb_history(files[0])
    assert len(history) == len(records)
    for logged, record in zip(history, records):
        scalars = {k: float(v) if isinstance(v, bool) else v for k, v in record.items()
                   if k != "step" and isinstance(v, (int, float))}  # flags (skipped) as 0/1
        assert logged["_step"] == record["step"]
        assert {k: logged[k] for k in scalars} == scalars and "skipped" in scalars


def test_wandb_without_the_package_is_a_one_line_error(tmp_path, monkeypatch, capsys):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else find_spec(name, *a))
    assert main(["train", "--log.wandb=true", f"--log.run_dir={tmp_path}", "--train.steps=1"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "mop: error: log.wandb: needs the wandb package; install it with pip install 'mop[wandb]' or set "
        "--log.wandb=false"]


def test_a_resumed_run_directory_continues_its_wandb_run(tmp_path):
    from mop.metrics import WandbRun

    first = WandbRun(tmp_path, "mop", "resumed", {})
    first.log({"loss": 2.0}, 0)
    first.close()
    again = WandbRun(tmp_path, "mop", "resumed", {})
    again.log({"loss": 1.5}, 1)
    again.close()
    assert first.run.id == again.run.id == (tmp_path / "wandb" / "mop-run-id").read_text()
