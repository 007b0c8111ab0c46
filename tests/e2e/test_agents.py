"""The agent stage in real runs: an unmodified openai-SDK agent with a calculator tool
(streamrl.tasks.calculator:solve) answers digit sums against the live policy's endpoint, and the
policy learns to call the tool; weight updates land in the middle of sessions; a SIGKILLed agent worker is restarted and the dock's
ledger stays exact; an agent that fails ends the run with a message naming it and its sample."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

import streamrl
from streamrl.runtime.stage import StageError
from tests.runtime.hygiene import assert_run_cleaned, ipc_dirs, processes_with_files_under, wait_gone

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "agent_calc.yaml"
QUIET = ["output.progress=none", "output.tensorboard=false", "output.plot=false", "output.checkpoint=false"]


def _agent_rows(metrics: list[dict[str, Any]], name: str) -> list[float]:
    return [row[f"agent/{name}"] for row in metrics if f"agent/{name}" in row]


def _per_step_sums(metrics: list[dict[str, Any]], name: str) -> list[float]:
    """Each step's agent metric summed over the stage's workers (rows carry ``agent/<worker>/<name>``
    when it has more than one)."""
    return [sum(v for k, v in row.items() if k.startswith("agent/") and k.split("/")[-1] == name) for row in metrics]


STEPS = 60  # the learning test's steps; see check_the_calculator_is_learned


def check_the_calculator_sessions(metrics: list[dict[str, Any]], sessions: int = 64) -> None:
    """What every step of a calculator run must show, learned or not: 1-3 turns per session, the loss
    saw only sampled tokens, the agent only appended (no fork, no mixed versions, no bad request),
    rewards within the task's [0, 1]. (One-character turns cannot hold a malformed call;
    tests/agents/test_endpoint.py drives those.)"""
    turns = _agent_rows(metrics, "turns_per_trajectory")
    assert turns and all(1.0 <= t <= 3.0 for t in turns), turns
    for row in metrics:
        assert row["repeated_samples"] == 0 and row["staleness_max"] == 0
        # trained tokens: at most 3 turns x 1 sampled token per session; the tool's answers and the
        # template between the turns are in the response but masked out (loss_mask 0)
        assert 0 < row["response_tokens"] <= sessions * 3
        assert 0.0 <= row["reward_min"] <= row["reward_mean"] <= row["reward_max"] <= 1.0, row
    assert all(f == 0.0 for f in _agent_rows(metrics, "fork_rate"))  # the agent only appends: never a fork
    assert all(m == 0.0 for m in _agent_rows(metrics, "mixed_version_trajectories"))
    assert all(b == 0.0 for b in _agent_rows(metrics, "bad_requests"))
    p50, p99 = _agent_rows(metrics, "turn_latency_p50_s")[-1], _agent_rows(metrics, "turn_latency_p99_s")[-1]
    assert 0 < p50 <= p99 < 30


def check_the_calculator_is_learned(metrics: list[dict[str, Any]], sessions: int = 64) -> None:
    """What the calculator run must show (here, and on vLLM in tests/e2e/test_vllm.py): the policy
    went from hardly ever calling the tool to calling it in nearly every session and answering on a
    later turn, the reward rose, and every step passed check_the_calculator_sessions."""
    rewards = [row["reward_mean"] for row in metrics]
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert last >= first + 0.15, f"no learning: first 10 steps {first:.3f}, last 10 {last:.3f}: {rewards}"
    calls = _agent_rows(metrics, "tool_calls")
    turns = _agent_rows(metrics, "turns_per_trajectory")
    assert calls[0] < 0.25 * sessions and sum(calls[-10:]) >= 0.8 * 10 * sessions, calls
    assert sum(turns[-10:]) / 10 >= 1.8, turns
    check_the_calculator_sessions(metrics, sessions)


@pytest.mark.timeout(120)
def test_the_calculator_agent_plays_its_sessions_and_trains_only_the_sampled_tokens(tmp_path: Path) -> None:
    """The learning run below for 3 steps (configs/agent_calc.yaml as shipped: the unmodified SDK agent
    with its calculator tool, 64 sessions per step): every session's trajectory is well formed, which
    the learning run checks at each of its 60 steps. The default run's sibling of that slow test."""
    before = ipc_dirs()
    result = streamrl.run(str(CONFIG), ["algo.steps=3", "algo.stop_reward=null", f"output.run_dir={tmp_path}", *QUIET])
    assert result.steps == 3
    check_the_calculator_sessions(result.metrics)
    assert_run_cleaned(result.run_dir, os.getpid(), before)


@pytest.mark.slow  # 60 steps (about a minute); its 3-step sibling above runs by default
@pytest.mark.timeout(240)
def test_the_calculator_agent_learns_to_call_its_tool_and_trains_only_the_sampled_tokens(tmp_path: Path) -> None:
    """64 sessions per step, up to 3 turns each, synchronous, from a random init (seed 0)."""
    before = ipc_dirs()
    result = streamrl.run(str(CONFIG), [f"algo.steps={STEPS}", "algo.stop_reward=null", f"output.run_dir={tmp_path}",
                                        *QUIET])
    assert result.steps == STEPS
    check_the_calculator_is_learned(result.metrics)
    assert_run_cleaned(result.run_dir, os.getpid(), before)


def _steps_done(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return path.read_text().count('"reward_mean"') if path.exists() else 0


@pytest.mark.timeout(240)
@pytest.mark.parametrize("lost_sessions", ["replay", "drop"])
def test_weights_land_mid_session_and_a_killed_agent_worker_loses_nothing(tmp_path: Path, lost_sessions: str
                                                                           ) -> None:
    """One generation ahead (max_staleness 1) with weight_updates: in_session, so new versions may
    be installed while sessions run (an agent of three turns with a slow tool between them); the
    agent worker is SIGKILLed at step 4 with sessions open. The run
    finishes every step and the dock's ledger is exact. ``replay``: the restarted worker plays the dead
    one's samples again, and every sample reaches every stage exactly once. ``drop``: it takes them
    out of the run, the source (dynamic sampling) makes as many new ones, and every step still trains
    its batch of samples, none twice."""
    steps, batch = 12, 16
    run_dir = tmp_path / "run"
    killed: list[int] = []

    def kill_agent() -> None:
        deadline = time.monotonic() + 120
        while _steps_done(run_dir) < 4 and time.monotonic() < deadline:
            time.sleep(0.02)
        if time.monotonic() < deadline:
            pid = int(json.loads((run_dir / "logs" / "pids.json").read_text())["agent-0"])
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)

    killer = threading.Thread(target=kill_agent, daemon=True)
    killer.start()
    result = streamrl.run(str(CONFIG), [
        f"algo.steps={steps}", "algo.stop_reward=null", "algo.max_staleness=1", "algo.prompts_per_step=4",
        "algo.group_size=4", "stages.agent.micro_batch=16", "stages.advantage.micro_batch=16",
        "stages.train.micro_batch=16", "stages.agent.options.weight_updates=in_session",
        "stages.agent.options.rollout=tests.e2e.agent_fns:three_slow_turns", "stages.agent.options.rollout_args={}",
        "stages.agent.options.tool_parser=hermes", f"stages.agent.options.lost_sessions={lost_sessions}",
        f"algo.dynamic_sampling.enabled={str(lost_sessions == 'drop').lower()}",
        "resources.dock.lease_ttl_s=1.0", "resources.max_restarts=2", *QUIET], run_dir=run_dir)
    killer.join(5)
    assert len(killed) == 1
    assert result.steps == steps and result.restarts == {"agent-0": 1}
    stats = result.dock_statistics
    last = result.metrics[-1]
    assert all(row["repeated_samples"] == 0 for row in result.metrics)
    if lost_sessions == "replay":
        # the dead worker's sessions were played again by its successor: the micro-batch it played, and
        # the next one if its fetcher held it already
        assert 0 < last["agent/lost_sessions_replayed"] <= 2 * batch and last["agent/lost_sessions_dropped"] == 0
        assert stats["reserved_total"] == steps * batch and stats["samples_discarded"] == 0
        assert {name: c["done"] for name, c in stats["consumers"].items()} == dict.fromkeys(
            ["agent", "advantage", "train"], steps * batch)
    else:
        # the dead worker's samples (a micro-batch, two if its fetcher held the next) left the run, and only they
        dropped = last["agent/lost_sessions_dropped"]
        assert 0 < dropped <= 2 * batch and last["agent/lost_sessions_replayed"] == 0
        assert stats["samples_discarded"] == dropped
        assert all(row["samples"] == batch for row in result.metrics)  # every step still trained its batch
        # made: what was trained, what was dropped, and at most one wave made ahead that no step took
        made = stats["reserved_total"]
        assert steps * batch + dropped <= made <= steps * batch + dropped + batch, (made, dropped)
        done = {name: c["done"] for name, c in stats["consumers"].items()}
        assert done["train"] >= steps * batch + dropped and done["agent"] >= done["advantage"] >= done["train"]
    assert max(row["staleness_max"] for row in result.metrics) <= 1
    # (that versions land inside sessions in this placement is made certain, not raced, in
    # test_the_agent_stage_runs_in_every_placement[separate-in_session])
    assert not wait_gone(processes_with_files_under(run_dir), 10)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("agent", "needle"), [
    ("fails_after_one_turn", "raised ValueError: the tool server is down"),
    ("never_asks", "returned without a completion from the policy in its session"),
])
def test_an_agent_that_fails_ends_the_run_naming_it_and_its_sample(tmp_path: Path, agent: str, needle: str) -> None:
    spec = f"tests.e2e.agent_fns:{agent}"
    with pytest.raises(StageError) as failed:
        streamrl.run(str(CONFIG), ["algo.steps=2", "algo.prompts_per_step=2", "algo.group_size=2",
                                   f"stages.agent.options.rollout={spec}",
                                   f"output.run_dir={tmp_path}", *QUIET])
    message = str(failed.value)
    assert "stage 'agent' worker 0 failed" in message and f"options.rollout {spec!r} on sample" in message
    assert needle in message and "answer=" in message


@pytest.mark.timeout(120)
def test_an_external_process_and_a_gym_environment_are_agents_too(tmp_path: Path) -> None:
    """The two other ways to write an agent, one run each: a process pointed at the endpoint that
    posts its reward (tests/e2e/external_agent.py), and a reset/step environment the stage drives
    (tests.e2e.agent_fns:EchoEnv). Each sample's trajectory holds its 2 turns."""
    ways = {
        "external": {"rollout": "streamrl.agents.external:run_process",
                     "rollout_args": {"command": [sys.executable, str(REPO / "tests" / "e2e" / "external_agent.py")],
                                      "timeout_s": 60}},
        "gym": {"rollout": "streamrl.agents.gym:run_env",
                "rollout_args": {"env": "tests.e2e.agent_fns:EchoEnv", "max_turns": 4, "max_tokens": 2}},
    }
    for way, options in ways.items():
        cfg = yaml.safe_load(CONFIG.read_text())
        cfg["pipeline"] = str(REPO / "pipelines" / "agent.yaml")
        cfg["stages"]["agent"]["options"].update(options, tool_parser="hermes")
        # an external agent is a Python process per sample (it imports openai): 4 samples a step, not 8
        group = 2 if way == "external" else 4
        result = streamrl.run(cfg, ["algo.steps=2", "algo.prompts_per_step=2", f"algo.group_size={group}",
                                    f"output.run_dir={tmp_path / way}", *QUIET])
        assert result.steps == 2, way
        assert _agent_rows(result.metrics, "turns_per_trajectory")[-1] == 2.0, way
        for row in result.metrics:
            lowest = 0.25 if way == "external" else 0.0
            assert lowest <= row["reward_min"] <= row["reward_max"] <= lowest + 1.0, (way, row)


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("placement", "updates"), [("colocated", "between_sessions"),
                                                    ("disaggregated", "in_session"), ("separate", "in_session")])
def test_the_agent_stage_runs_in_every_placement(tmp_path: Path, placement: str, updates: str) -> None:
    """The agent stage takes its versions from the placement's weight source, as the generate stage
    does: colocated, its endpoint samples on the inference weights the train stage of its process
    reshards in (between_sessions: a micro-batch's sessions keep one version, the train phase waits
    for them); disaggregated, on the versions the train group sends it, and separate, on those its
    background task fetches from the trainer's publisher as they are published (in_session: one
    that comes during a session goes in between two engine calls: two agent workers play half a
    step each, and tests.e2e.agent_fns:three_turns_across_a_train_step makes a version land inside
    sessions for certain). One generation ahead."""
    steps, batch = 6, 16
    before = ipc_dirs()
    run_dir, marks = tmp_path / "run", tmp_path / "marks"
    marks.mkdir()
    if updates == "between_sessions":
        agent = ["stages.agent.options.rollout=tests.e2e.agent_fns:three_slow_turns"]
    else:
        agent = ["stages.agent.options.rollout=tests.e2e.agent_fns:three_turns_across_a_train_step",
                 "stages.agent.options.rollout_args=" + json.dumps(
                     {"run_dir": str(run_dir), "marks": str(marks), "steps": steps, "batch": batch})]
    result = streamrl.run(str(CONFIG), [
        f"pipeline={REPO / 'pipelines' / ('agent.yaml' if placement == 'separate' else f'agent_{placement}.yaml')}",
        f"algo.steps={steps}", "algo.stop_reward=null",
        "algo.max_staleness=1", "algo.prompts_per_step=4", "algo.group_size=4", "stages.advantage.micro_batch=16",
        *(["stages.agent.micro_batch=8", "stages.train.micro_batch=8"] if placement == "colocated" else
          ["stages.agent.workers=2", "stages.agent.micro_batch=8", "stages.train.micro_batch=16"]),
        f"stages.agent.options.weight_updates={updates}", *agent, "stages.agent.options.tool_parser=hermes", *QUIET],
        run_dir=run_dir)
    assert result.steps == steps
    stats = result.dock_statistics
    assert stats["reserved_total"] == steps * batch
    done = {name: c["done"] for name, c in stats["consumers"].items()}
    # every rank of the train group acks its last micro-batch before the run stops (the worker shields the ack
    # that precedes a StopRun: the Stop another rank's StopRun brings used to cancel it and release the lease)
    assert done == dict.fromkeys(["agent", "advantage", "train"], steps * batch)
    # each step trained the whole batch, none twice (the train group's counts, all-reduced over its ranks)
    assert [row["samples"] for row in result.metrics] == [batch] * steps
    assert all(row["repeated_samples"] == 0 for row in result.metrics)
    assert max(row["staleness_max"] for row in result.metrics) <= 1
    turns = [v for row in result.metrics for k, v in row.items() if k.endswith("/turns_per_trajectory")]
    assert turns and all(t == 3.0 for t in turns)
    if updates == "between_sessions":
        # every token of a trajectory from one version (each row: every worker's last micro-batch)
        assert _per_step_sums(result.metrics, "mixed_version_trajectories") == [0.0] * steps
    else:
        # versions landed inside sessions, in every step after the first (the agent's holds make it
        # certain, not a race): the replies' policy_version, as the agent saw them
        sessions = [json.loads(line) for line in (marks / "sessions.jsonl").read_text().splitlines()]
        assert len(sessions) == steps * batch
        assert all(s["versions"] == sorted(s["versions"]) for s in sessions)  # a session never goes back
        spanning = {s["step"] for s in sessions if s["versions"][0] < s["versions"][-1]}
        assert spanning == set(range(1, steps)), sessions
    assert_run_cleaned(result.run_dir, os.getpid(), before)
