"""Exact resume (issue: a days-long run survives crashes): the whole run is SIGKILLed at several
points — mid-step, mid-save — and ``streamrl run --resume`` continues it. Synchronous runs then
match an uninterrupted run bitwise, step for step; with max_staleness 1 no sample is lost or
trained twice. SIGTERM saves and stops; a fresh run refuses a directory holding a checkpoint.

Real processes throughout: the CLI in a subprocess, its dock servers and workers, SIGKILL from
here to every one of them at once."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from streamrl.runtime.checkpoints import latest_checkpoint
from streamrl.runtime.launcher import ResumeError, run
from streamrl.runtime.worker import ORPHAN_EXIT_S
from tests.runtime.hygiene import (
    descendants,
    ipc_dirs,
    leftover_ipc_dirs,
    run_ipc_dirs,
    run_processes,
    wait_gone,
)

REPO = Path(__file__).resolve().parents[2]
STEPS, EVERY = 24, 4
# what must match bitwise after a resume: everything computed from the samples and the weights
# (not timings, and not throughput)
EXACT = ["reward_mean", "reward_std", "loss", "kl", "clip_fraction", "entropy", "grad_norm", "lr",
         "response_len_mean", "response_tokens", "staleness_mean"]


def _config(tmp: Path, **algo: Any) -> Path:
    cfg = {
        "pipeline": str(REPO / "pipelines" / "grpo.yaml"),
        "seed": 3,
        "model": {"tiny": {"arch": "qwen2", "hidden": 32, "layers": 1, "heads": 2, "intermediate": 64,
                           "max_positions": 32, "seed": 0}},
        "task": {"name": "digits-max", "options": {"n_digits": 3}},
        "algo": {"steps": STEPS, "prompts_per_step": 4, "group_size": 4, "max_new_tokens": 3, "lr": 1e-3,
                 "max_staleness": 0, "lr_schedule": "cosine", "warmup_steps": 2, **algo},
        "resources": {"dock": {"lease_ttl_s": 2.0}},
        "output": {"name": "resume", "run_dir": str(tmp / "runs"), "checkpoint_every": EVERY, "keep_checkpoints": 2,
                   "progress": "lines", "tensorboard": False, "plot": False, "checkpoint": False},
        "stages": {s: {"micro_batch": 16} for s in ("generate", "score", "advantage", "train")},
    }
    path = tmp / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _rows(run_dir: Path) -> list[dict[str, Any]]:
    return [r for r in (json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines())
            if "reward_mean" in r]


def _start(config: Path, tmp: Path, *extra: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    out = (tmp / "cli.log").open("ab")
    return subprocess.Popen([sys.executable, "-m", "streamrl.cli", "run", *extra], stdout=out,
                            stderr=subprocess.STDOUT, cwd=tmp,
                            env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})})


def _kill_run_when(proc: subprocess.Popen[bytes], tmp: Path, ready: Callable[[Path], bool],
                   timeout_s: float = 120) -> Path:
    """SIGKILL the launcher and every process it started, all at once, when ``ready(run_dir)``."""
    deadline = time.monotonic() + timeout_s
    run_dir: Path | None = None
    while time.monotonic() < deadline and proc.poll() is None:
        found = list((tmp / "runs").glob("resume-*"))
        if found and ready(found[0]):
            run_dir = found[0]
            break
        time.sleep(0.01)
    assert run_dir is not None, f"not ready within {timeout_s} s (exit {proc.poll()}):\n{(tmp / 'cli.log').read_text()}"
    victims = {proc.pid, *descendants(proc.pid), *run_processes(run_dir, proc.pid)}
    for pid in victims:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(timeout=10)
    assert not wait_gone(list(victims), 10)
    return run_dir


def _resume(run_dir: Path, tmp: Path) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, "-m", "streamrl.cli", "run", "--resume", str(run_dir), "--print-result"],
                          capture_output=True, text=True, cwd=tmp, timeout=240,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _rows_done(n: int) -> Callable[[Path], bool]:
    def ready(run_dir: Path) -> bool:
        path = run_dir / "metrics.jsonl"
        return path.exists() and path.read_text().count("\n") >= n
    return ready


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """The uninterrupted run."""
    tmp = tmp_path_factory.mktemp("reference")
    result = run(_config(tmp))
    assert result.steps == STEPS
    return result.metrics


def _assert_same(rows: list[dict[str, Any]], reference: list[dict[str, Any]]) -> None:
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for got, want in zip(rows, reference, strict=True):
        assert {k: got[k] for k in EXACT} == {k: want[k] for k in EXACT}, f"step {got['step']}"


@pytest.mark.timeout(300)
def test_sigkill_mid_step_then_resume_matches_the_uninterrupted_run(tmp_path: Path,
                                                                      reference: list[dict[str, Any]]) -> None:
    before = ipc_dirs()
    config = _config(tmp_path)
    proc = _start(config, tmp_path, str(config))
    run_dir = _kill_run_when(proc, tmp_path, _rows_done(EVERY + 3))  # past the first checkpoint, mid-run
    killed_dirs = run_ipc_dirs(run_dir)  # the resumed run's specs replace the killed one's
    killed_at = len(_rows(run_dir))
    assert EVERY < killed_at < STEPS
    result = _resume(run_dir, tmp_path)
    assert result["resumed_from"] is not None and result["resumed_from"] % EVERY == 0
    assert result["resumed_from"] <= killed_at
    _assert_same(_rows(run_dir), reference)
    assert not [d for d in killed_dirs if d.exists()]  # the resumed run removed what the killed one left
    assert not leftover_ipc_dirs(before, run_dir)


@pytest.mark.slow  # second tier (pyproject.toml); its cheaper sibling in the default run: the whole run SIGKILLed mid-step above (the resume),
# tests/runtime/test_orphans.py (orphaned workers exit)
@pytest.mark.timeout(300)
def test_a_launcher_killed_alone_leaves_no_step_ahead_of_its_metrics(tmp_path: Path,
                                                                    reference: list[dict[str, Any]]) -> None:
    """Only the launcher's process group is SIGKILLed; its workers and dock servers lead their own
    sessions and outlive it. They stop within a bound and remove its ipc dirs; the trainer commits
    no checkpoint whose step has no row in metrics.jsonl (a checkpoint every step, so the kill
    always lands next to one); the resume then has every step's row once, equal to an
    uninterrupted run."""
    config = _config(tmp_path)
    with (tmp_path / "cli.log").open("ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "streamrl.cli", "run", str(config), "output.checkpoint_every=1"],
                                stdout=out, stderr=subprocess.STDOUT, cwd=tmp_path, start_new_session=True,
                                env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        deadline = time.monotonic() + 120
        run_dir = None
        while time.monotonic() < deadline and proc.poll() is None and run_dir is None:
            found = [d for d in (tmp_path / "runs").glob("resume-*") if _rows_done(6)(d)]
            run_dir = found[0] if found else None
            time.sleep(0.01)
        assert run_dir is not None, (tmp_path / "cli.log").read_text()
        started = {**descendants(proc.pid), **run_processes(run_dir, proc.pid)}
        dirs = run_ipc_dirs(run_dir)
        assert len(started) >= 7 and dirs and all(d.exists() for d in dirs), (started, dirs)
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher and its forkserver: the group it leads
        proc.wait(timeout=10)
        left = wait_gone(started, ORPHAN_EXIT_S + 10)
        assert not left, {p: started[p] for p in left}
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    steps = [r["step"] for r in _rows(run_dir)]
    assert steps == list(range(1, len(steps) + 1)) and len(steps) < STEPS
    newest = latest_checkpoint(run_dir)
    assert newest is not None
    saved = json.loads((newest / "state.json").read_text())["version"]
    assert saved <= steps[-1], f"checkpoint {saved} is ahead of the metrics (last row {steps[-1]})"
    assert not [d for d in dirs if d.exists()], "the orphans did not remove the killed launcher's ipc dirs"
    result = _resume(run_dir, tmp_path)
    assert result["resumed_from"] == saved
    _assert_same(_rows(run_dir), reference)  # every step's row exactly once


@pytest.mark.slow  # second tier (pyproject.toml); its cheaper sibling in the default run: the kill mid-step above (the resume),
# tests/runtime/test_checkpoints.py (a commit is atomic and prunes)
@pytest.mark.timeout(300)
def test_sigkill_mid_save_keeps_the_previous_checkpoint(tmp_path: Path, reference: list[dict[str, Any]]) -> None:
    config = _config(tmp_path)
    # the save of version 8 waits just before its rename: the kill lands mid-save
    proc = _start(config, tmp_path, str(config), env={"STREAMRL_TEST_PAUSE_BEFORE_COMMIT": f"{2 * EVERY}:60"})
    partial = f"checkpoints/step-{2 * EVERY:08d}.partial/state.json"
    run_dir = _kill_run_when(proc, tmp_path, lambda d: (d / partial).exists())
    assert [p.name for p in (run_dir / "checkpoints").iterdir() if not p.name.endswith(".partial")] == \
        [f"step-{EVERY:08d}"]
    result = _resume(run_dir, tmp_path)
    assert result["resumed_from"] == EVERY  # the half-written one was not used
    _assert_same(_rows(run_dir), reference)
    names = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert names == [f"step-{STEPS - EVERY:08d}", f"step-{STEPS:08d}"]  # pruned to keep_checkpoints, no .partial


@pytest.mark.slow  # second tier (pyproject.toml); its cheaper sibling in the default run: the kill mid-step above (the resume),
# tests/e2e/test_dynamic_sampling.py (a resume one version ahead)
@pytest.mark.timeout(300)
def test_async_resume_neither_loses_nor_repeats_a_sample(tmp_path: Path) -> None:
    config = _config(tmp_path, max_staleness=1)
    proc = _start(config, tmp_path, str(config))
    run_dir = _kill_run_when(proc, tmp_path, _rows_done(EVERY + 2))
    _resume(run_dir, tmp_path)
    rows = _rows(run_dir)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert all(r["repeated_samples"] == 0 for r in rows)
    final = json.loads((run_dir / "checkpoints" / f"step-{STEPS:08d}" / "state.json").read_text())
    # every key 0 .. STEPS * 16 - 1 trained, none left over above the watermark: each exactly once
    # (a repeat would have shown in repeated_samples; a loss would leave a gap below STEPS * 16)
    assert final["trained_below"] == STEPS * 16 and final["trained_extra"] == []


@pytest.mark.timeout(300)
def test_sigterm_saves_then_stops_and_a_fresh_run_refuses_the_directory(tmp_path: Path,
                                                                         reference: list[dict[str, Any]]) -> None:
    config = _config(tmp_path, steps=10_000)  # it would run for long: SIGTERM ends it
    proc = _start(config, tmp_path, str(config))
    deadline = time.monotonic() + 120
    run_dir = None
    while time.monotonic() < deadline and run_dir is None:
        found = [d for d in (tmp_path / "runs").glob("resume-*") if _rows_done(3)(d)]
        run_dir = found[0] if found else None
        time.sleep(0.05)
    assert run_dir is not None, (tmp_path / "cli.log").read_text()
    started = descendants(proc.pid)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 0, (tmp_path / "cli.log").read_text()
    assert not wait_gone(started, 15)
    saved = json.loads(sorted((run_dir / "checkpoints").glob("step-*/state.json"))[-1].read_text())
    assert saved["reason"] == "sigterm" and saved["version"] == len(_rows(run_dir))
    assert "resume" in (tmp_path / "cli.log").read_text()
    with pytest.raises(ResumeError, match="--resume"):
        run(config, run_dir=run_dir)


@pytest.mark.timeout(300)
# disaggregated is second tier (pyproject.toml); its cheaper sibling in the default run: the colocated case
@pytest.mark.parametrize("placement", ["colocated", "sync", pytest.param("disaggregated", marks=pytest.mark.slow)])
def test_resume_in_the_reshard_placements_is_exact_too(tmp_path: Path, placement: str) -> None:
    """The trainer there loads the checkpoint and hands its version to generation through the
    reshard (colocated: into its own inference weights; disaggregated: to the generate workers), or
    generates on it itself (sync: pipelines/grpo_sync.yaml, the train stage's options.rollout)."""
    overrides = ["algo.steps=6", "algo.stop_reward=null", "output.checkpoint_every=2", "output.progress=none",
                 "output.tensorboard=false", "output.plot=false", "output.checkpoint=false"]
    if placement == "sync":
        config = REPO / "configs" / "grpo_digits.yaml"
        overrides.append(f"pipeline={REPO / 'pipelines' / 'grpo_sync.yaml'}")
    else:
        config = REPO / "configs" / f"grpo_digits_{placement}.yaml"
    run_dir = tmp_path / "run"
    first = run(config, overrides, run_dir=run_dir)
    assert first.steps == 6
    shutil.rmtree(run_dir / "checkpoints" / "step-00000006")  # as if it died after step 5's rows
    again = run(config, overrides, resume=run_dir)
    assert again.resumed_from == 4 and [r["step"] for r in again.metrics] == list(range(1, 7))
    for got, want in zip(again.metrics, first.metrics, strict=True):
        assert {k: got[k] for k in EXACT} == {k: want[k] for k in EXACT}, f"step {got['step']}"
