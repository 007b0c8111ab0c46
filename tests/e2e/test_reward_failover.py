"""A GRPO run scored by two real reward-server processes, one SIGKILLed mid-run: the run completes,
every sample got exactly one reward (the dock's columns are write-once: a second reward would fail
the run), and metrics.jsonl shows the lost server and the retries."""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path

import streamrl
from tests.rewards.conftest import Servers

STEPS = 14


def test_sigkill_of_one_of_two_reward_servers_costs_no_sample(tmp_path: Path) -> None:
    servers = Servers()
    try:
        a = servers.reward_server("tests.e2e.slow_rewards:digits_max_slow", "--workers", "2")
        b = servers.reward_server("tests.e2e.slow_rewards:digits_max_slow", "--workers", "2")
        run_dir = tmp_path / "run"
        cfg = {
            "pipeline": str(Path(__file__).resolve().parents[2] / "pipelines" / "grpo.yaml"),
            "algo": {"steps": STEPS, "stop_reward": None},
            "resources": {"launch": "inprocess"},
            "stages": {"score": {"micro_batch": 8, "options": {
                "backend": "zmq", "endpoints": [a.endpoint, b.endpoint], "timeout_s": 5.0}}},
            "output": {"run_dir": str(tmp_path), "progress": "none", "tensorboard": False, "plot": False,
                       "checkpoint": False},
        }
        outcome: dict[str, object] = {}

        def run() -> None:
            try:
                outcome["result"] = streamrl.run(cfg, run_dir=run_dir)
            except BaseException as exc:  # surfaced below
                outcome["error"] = exc

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        metrics = run_dir / "metrics.jsonl"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < 3):
            time.sleep(0.05)
        assert metrics.exists(), "the run made no progress"
        a.signal(signal.SIGKILL)  # mid-run, batches in flight on it
        thread.join(timeout=180)
        assert not thread.is_alive(), "the run did not finish after the reward server died"
        assert "error" not in outcome, outcome.get("error")
        result = outcome["result"]
        assert result.steps == STEPS  # type: ignore[attr-defined]
        rows = [json.loads(line) for line in metrics.read_text().splitlines()]
        last = rows[-1]
        # each optimizer step trained on a full batch of scored samples, after the kill too
        assert len(rows) == STEPS and all(r["reward_mean"] is not None for r in rows)
        # the kill was noticed: the connection drop (always), and the batches it had in flight, if the
        # kill landed while it was scoring (most runs; it may also land between two batches)
        noticed = sum(last.get(f"score/server0/{k}", 0) for k in ("lost", "disconnects")) + last.get("score/retries", 0)
        assert noticed >= 1, {k: v for k, v in last.items() if k.startswith("score/")}
    finally:
        servers.stop_all()
