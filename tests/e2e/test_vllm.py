"""End to end with vLLM generate workers: GRPO learns digits-max (separate and disaggregated
placements), and a killed engine (the generate worker that holds it in-process, or the engine-core
process of a disaggregated worker) stops the run naming the stage, leaving no process or file.

Runs where vLLM is installed (ops/vllm_env.sh builds that environment; .ci/run runs it).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed in this environment (ops/vllm_env.sh)")

import streamrl
from streamrl.runtime.launcher import RunFailed
from streamrl.runtime.stage import StageError
from tests.e2e.test_agents import CONFIG as CALCULATOR
from tests.e2e.test_agents import STEPS, check_the_calculator_is_learned
from tests.runtime.hygiene import descendants, live_processes, processes_with_environ, run_ipc_dirs

REPO = Path(__file__).resolve().parents[2]
VLLM = "stages.generate.options.engine=vllm"


def _learns(rewards: list[float]) -> None:
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert first < 0.2, rewards
    assert last >= 0.35 and last >= first + 0.2, rewards


@pytest.mark.timeout(500)
@pytest.mark.parametrize("config", ["grpo_digits.yaml", "grpo_digits_disaggregated.yaml", "grpo_digits_colocated.yaml"],
                         ids=["separate", "disaggregated", "colocated"])
def test_grpo_with_vllm_learns(tmp_path: Path, config: str) -> None:
    """Separate (the quickstart's pipelines/grpo_rollout.yaml, the engine in its rollout chain's generate
    link): the trainer's published snapshots go into one in-process engine. Disaggregated: 2 train
    ranks stream each version's buckets into 2 generate workers' engines (each in its own process).
    Colocated: each of the 2 train ranks streams its all-gathered buckets into the vLLM engine of its
    own process (the engine core a child process)."""
    result = streamrl.run(str(REPO / "configs" / config),
                          ["algo.steps=60", "algo.stop_reward=null", f"output.run_dir={tmp_path}",
                           "output.progress=none", VLLM])
    assert result.steps == 60
    _learns([m["reward_mean"] for m in result.metrics])
    # generate/engine_startup_s with one worker, generate/<k>/engine_startup_s with several, and
    # rollout/generate/engine_startup_s from the rollout chain's generate link
    startup = [v for k, v in result.metrics[-1].items()
               if "generate" in k.split("/")[:2] and k.endswith("/engine_startup_s")]
    assert startup and all(v > 0 for v in startup)
    _assert_nothing_left(result.run_dir)


@pytest.mark.timeout(400)
def test_the_calculator_agent_learns_on_vllm(tmp_path: Path) -> None:
    """The agent stage with vLLM behind its endpoint: the same run and checks as the built-in
    engine's (tests/e2e/test_agents.py)."""
    result = streamrl.run(str(CALCULATOR), [f"algo.steps={STEPS}", "algo.stop_reward=null", f"output.run_dir={tmp_path}",
                                            "output.progress=none", "stages.agent.options.engine=vllm"])
    assert result.steps == STEPS
    check_the_calculator_is_learned(result.metrics)
    assert result.metrics[-1]["agent/engine_startup_s"] > 0
    _assert_nothing_left(result.run_dir)


def _assert_nothing_left(run_dir: Path) -> None:
    """No process of the run (its workers; vLLM's engine cores, which inherit the run's scratch dir
    in their environment) and none of its scratch (vLLM's ipc sockets, weight files in /dev/shm)."""
    time.sleep(1)
    assert not live_processes(str(run_dir))
    dirs = run_ipc_dirs(run_dir)
    assert dirs
    for d in dirs:
        assert not processes_with_environ(str(d)), d
    assert not [d for d in dirs if d.exists()]


def _kill_at_step(tmp_path: Path, steps: int, victim: Callable[[int], int | None]) -> list[tuple[Path, int]]:
    """Once the run under ``tmp_path`` has logged ``steps`` steps, SIGKILL ``victim(pid of
    generate-0, or of rollout-0 whose chain generates)``, from a thread; the returned list gets (run
    dir, killed pid)."""
    killed: list[tuple[Path, int]] = []

    def killer() -> None:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            done = [p for p in tmp_path.glob("*/metrics.jsonl") if p.read_text().count("reward_mean") >= steps]
            if done:
                run_dir = done[0].parent
                pids = json.loads((run_dir / "logs" / "pids.json").read_text())
                pid = victim(int(pids["generate-0"] if "generate-0" in pids else pids["rollout-0"]))
                if pid is not None:
                    os.kill(pid, signal.SIGKILL)
                    killed.append((run_dir, pid))
                return
            time.sleep(0.05)

    threading.Thread(target=killer, daemon=True).start()
    return killed


def _engine_core_of(worker: int) -> int | None:
    return next((pid for pid, cmd in descendants(worker).items() if "EngineCore" in cmd), None)


@pytest.mark.timeout(300)
def test_a_killed_engine_stops_the_run_naming_the_stage_and_leaves_no_process(tmp_path: Path) -> None:
    """The separate placement's engine runs inside the worker that generates (the quickstart's
    rollout chain): SIGKILL it mid-run."""
    killed = _kill_at_step(tmp_path, 3, lambda worker: worker)
    with pytest.raises(RunFailed, match=r"stage 'rollout' worker 0 was killed by signal 9"):
        streamrl.run(str(REPO / "configs" / "grpo_digits.yaml"),
                     ["algo.steps=300", "algo.stop_reward=null", f"output.run_dir={tmp_path}", "output.progress=none",
                      "resources.max_restarts=0", VLLM])
    assert killed, "the run never reached step 3"
    _assert_nothing_left(killed[0][0])


@pytest.mark.timeout(400)
def test_a_killed_engine_core_process_stops_a_disaggregated_run(tmp_path: Path) -> None:
    """Disaggregated: each generate worker's vLLM engine core is a child process; SIGKILL worker
    0's mid-run. The worker sees vLLM's engine die, fails naming the stage, and the run stops."""
    killed = _kill_at_step(tmp_path, 2, _engine_core_of)
    with pytest.raises(StageError, match=r"stage 'generate' worker 0 failed .*VllmEngineDeadError") as failure:
        streamrl.run(str(REPO / "configs" / "grpo_digits_disaggregated.yaml"),
                     ["algo.steps=300", "algo.stop_reward=null", f"output.run_dir={tmp_path}", "output.progress=none",
                      "resources.max_restarts=0", VLLM])
    assert killed, "no engine-core process was found under generate-0 by step 2"
    assert f"engine-core process ended (pid {killed[0][1]} exit code -9)" in str(failure.value), str(failure.value)
    _assert_nothing_left(killed[0][0])
