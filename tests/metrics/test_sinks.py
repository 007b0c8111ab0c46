"""Metric sinks: metrics.jsonl, TensorBoard, a Weights & Biases offline run read back from its own
``.wandb`` record log, and the writer dropping a sink that fails while JSONL goes on."""

from __future__ import annotations

import json
import logging
import math
import os
import struct
import sys
from pathlib import Path
from typing import Any

import pytest

from streamrl.config import ConfigError, WandbConfig
from streamrl.metrics.sinks import WANDB_STEP, JsonlSink, SinkUnavailable, TensorBoardSink, WandbSink
from streamrl.metrics.writer import MetricsWriter

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parents[2]

TRAIN = [{"step": s, "reward_mean": 0.1 * s, "reward_std": 0.05, "kl": 0.001 * s, "busy/train": 0.5}
         for s in range(1, 5)]
# eval rows land late: step 2's eval after step 3's training row, step 4's after everything
ROWS = [TRAIN[0], TRAIN[1], TRAIN[2], {"step": 2, "eval/accuracy": 0.25, "eval/pass@4": 0.5}, TRAIN[3],
        {"step": 4, "eval/accuracy": 0.75, "eval/pass@4": 1.0}]


def test_jsonl_sink_appends_a_line_per_row(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps({"step": 0, "note": 1}) + "\n")  # appends: an earlier line stays
    sink = JsonlSink(path)
    try:
        for k, row in enumerate(ROWS, start=1):
            sink.write(row)
            assert len(path.read_text().splitlines()) == k + 1  # line-buffered: visible before close
        sink.write({"step": 5, "loss": math.nan, "kl": -math.inf})
    finally:
        sink.close()
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert lines[1:-1] == ROWS
    assert lines[-1] == {"step": 5, "loss": None, "kl": None}


def test_tensorboard_sink_holds_train_and_late_eval_scalars(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    sink = TensorBoardSink(tmp_path / "tb")
    for row in ROWS:
        sink.write(row)
    sink.write({"step": 5, "reward_mean": math.nan, "kl": 0.5})  # a non-finite value is left out, not plotted
    sink.close()
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert set(acc.Tags()["scalars"]) == {"reward_mean", "reward_std", "kl", "busy/train", "eval/accuracy",
                                          "eval/pass@4"}
    assert [(e.step, round(e.value, 5)) for e in acc.Scalars("reward_mean")] == [(1, 0.1), (2, 0.2), (3, 0.3),
                                                                                 (4, 0.4)]
    assert [(e.step, e.value) for e in acc.Scalars("eval/accuracy")] == [(2, 0.25), (4, 0.75)]
    assert [e.step for e in acc.Scalars("kl")] == [1, 2, 3, 4, 5]


# --------------------------------------------------------------------------- W&B offline


def read_wandb_run(run_dir: Path) -> list[Any]:
    """The records of the one offline run under ``run_dir/wandb``, parsed with wandb's own protobufs.

    A ``.wandb`` file is wandb's transaction log: a 7-byte header (``:W&B``, magic 0xBEE1, version),
    then 32 KiB blocks of LevelDB-log chunks (crc32c, length, type: 1 full, 2 first, 3 middle,
    4 last), each record a serialized ``wandb_internal_pb2.Record``; the ``wandb sync`` uploader
    reads the same file."""
    from wandb.proto import wandb_internal_pb2

    files = list((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 1, files
    data = files[0].read_bytes()
    ident, magic, version = struct.unpack("<4sHB", data[:7])
    assert (ident, magic, version) == (b":W&B", 0xBEE1, 0)
    block = 32768
    records: list[Any] = []
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a chunk header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:  # zero padding to the end of the block
            pos += left
            continue
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            rec = wandb_internal_pb2.Record()
            rec.ParseFromString(pending)
            records.append(rec)
    return records


def history(records: list[Any]) -> list[dict[str, Any]]:
    return [{item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
            for r in records if r.WhichOneof("record_type") == "history"]


def _wandb_children() -> list[str]:
    """wandb's service (``wandb-core``) processes started by this test process."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue  # exited meanwhile
        comm = text[text.index("(") + 1:text.rindex(")")]
        ppid = int(text[text.rindex(")") + 2:].split()[1])
        if ppid == os.getpid() and "wandb" in comm:
            found.append(f"{stat.parent.name} {comm}")
    return found


@pytest.fixture
def wandb_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """No network, nothing written outside tmp_path, no git probing, silent; wandb torn down after."""
    wandb = pytest.importorskip("wandb")
    for var in ("WANDB_API_KEY", "WANDB_BASE_URL", "WANDB_ENTITY", "WANDB_PROJECT", "WANDB_RUN_ID"):
        monkeypatch.delenv(var, raising=False)
    home = tmp_path / "wandb-home"
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DISABLE_GIT", "true")
    monkeypatch.setenv("WANDB_DISABLE_CODE", "true")
    monkeypatch.setenv("WANDB__DISABLE_STATS", "true")  # settings.x_disable_stats: no hardware sampler to wait for
    monkeypatch.setenv("WANDB_DIR", str(home))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(home / "config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(home / "cache"))
    monkeypatch.setenv("WANDB_DATA_DIR", str(home / "data"))
    yield wandb
    wandb.teardown()  # stops the service process; finish() alone leaves it for the next run
    assert not _wandb_children()


def test_wandb_offline_run_holds_train_and_out_of_order_eval_rows(tmp_path: Path, wandb_offline: Any) -> None:
    run_dir = tmp_path / "grpo-20260101-000000"
    run_dir.mkdir()
    writer = MetricsWriter(run_dir, tensorboard=False,
                           wandb=WandbConfig(mode="offline", project="streamrl-test", group="g", tags=["ci", "tiny"]),
                           run_config={"algo": {"lr": 0.001, "steps": 4}, "task": {"name": "digits-max"}})
    assert set(writer.sinks) == {"jsonl", "wandb"}
    for row in ROWS:
        writer.write(row)
    writer.close()
    assert [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()] == ROWS
    wandb_offline.teardown()
    assert not _wandb_children()

    records = read_wandb_run(run_dir)
    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    assert run.display_name == run_dir.name and run.project == "streamrl-test" and run.run_group == "g"
    assert list(run.tags) == ["ci", "tiny"]
    config = {u.key: json.loads(u.value_json) for u in run.config.update}
    assert config["algo"] == {"lr": 0.001, "steps": 4} and config["task"] == {"name": "digits-max"}
    # every metric is plotted against trainer/step, so rows for earlier steps are accepted
    metrics = {(m.name or m.glob_name): m.step_metric for r in records if r.WhichOneof("record_type") == "metric"
               for m in [r.metric]}
    assert metrics == {WANDB_STEP: "", "*": WANDB_STEP}
    logged = [{k: v for k, v in h.items() if not k.startswith("_")} for h in history(records)]
    expected = [{WANDB_STEP: r["step"], **{k: v for k, v in r.items() if k != "step"}} for r in ROWS]
    assert len(logged) == len(expected)
    for got, want in zip(logged, expected, strict=True):
        assert got.keys() == want.keys() and all(math.isclose(got[k], want[k]) for k in want), (got, want)
    assert any(r.WhichOneof("record_type") == "exit" for r in records)  # finish() closed the run


def test_a_run_with_output_wandb_offline_logs_every_step(tmp_path: Path, wandb_offline: Any) -> None:
    from streamrl.runtime.launcher import run

    result = run(str(REPO / "configs" / "grpo_digits.yaml"),
                 ["algo.steps=3", "algo.stop_reward=null", "resources.launch=inprocess", "output.progress=none",
                  "output.checkpoint=false", "output.plot=false", "output.tensorboard=false",
                  "output.wandb={mode: offline, tags: [e2e]}"], run_dir=tmp_path / "run")
    assert result.steps == 3
    wandb_offline.teardown()
    records = read_wandb_run(tmp_path / "run")
    run_rec = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    config = {u.key: json.loads(u.value_json) for u in run_rec.config.update}
    assert config["algo"]["steps"] == 3 and config["task"]["name"] == "digits-max"  # the resolved run config
    rewards = [(h[WANDB_STEP], h["reward_mean"]) for h in history(records) if "reward_mean" in h]
    assert rewards == [(m["step"], pytest.approx(m["reward_mean"])) for m in result.metrics]


def test_wandb_missing_is_a_config_error_naming_the_fix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # what `import wandb` meets when it is not installed
    with pytest.raises(SinkUnavailable, match=r"pip install wandb.*output\.wandb") as info:
        WandbSink(tmp_path, WandbConfig(mode="offline"))
    assert isinstance(info.value, ConfigError)  # so `streamrl run` reports it as a config error, exit 2
    with pytest.raises(SinkUnavailable):
        MetricsWriter(tmp_path, tensorboard=False, wandb=WandbConfig(mode="offline"))


# --------------------------------------------------------------------------- failing sinks


class _BrokenSink:
    """Works for ``ok_writes`` rows, then fails like a sink whose backend died."""

    def __init__(self, ok_writes: int) -> None:
        self.left = ok_writes
        self.closed = False

    def write(self, row: dict[str, Any]) -> None:
        if self.left == 0:
            raise ConnectionError("service process went away")
        self.left -= 1

    def close(self) -> None:
        self.closed = True


def test_a_failing_sink_is_dropped_once_and_jsonl_goes_on(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    writer = MetricsWriter(tmp_path, tensorboard=True)
    broken = _BrokenSink(ok_writes=2)
    writer.sinks["broken"] = broken
    with caplog.at_level(logging.WARNING, logger="streamrl.metrics"):
        for row in ROWS:
            writer.write(row)
    writer.close()
    warnings = [r.getMessage() for r in caplog.records if "broken" in r.getMessage()]
    assert len(warnings) == 1 and "ConnectionError" in warnings[0] and "dropped" in warnings[0]
    assert broken.closed and writer.sinks == {}
    assert [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == ROWS
    assert writer.rows == ROWS
    acc = EventAccumulator(str(tmp_path / "tensorboard"))  # the other sinks kept every row
    acc.Reload()
    assert [e.step for e in acc.Scalars("eval/accuracy")] == [2, 4]
