"""``resources.launch: ray`` on a real Ray cluster of two simulated nodes on this machine.

``ray.cluster_utils.Cluster`` starts a head and a second raylet, each with a custom resource
(``node_a``, ``node_b``) that pins stages to it. ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` keeps
every Ray listener on 127.0.0.1 and ``RAY_TMPDIR`` keeps Ray's files in a temp dir; the run's
own sockets bind the node address Ray reports (127.0.0.1 here) with CURVE. One cluster serves
the module (start-up is ~6-15 s here).

The module is the suite's second tier (marked slow; ``python3 -m pytest -q -m slow``, .ci/run runs
it): each run on the cluster costs 30-40 s of start-up on 2 cores (a Ray worker process per host
actor, each importing torch), about 3 minutes for the module. Without a cluster,
tests/runtime/test_ray_placement.py checks what the launcher derives for Ray (process names, bundles).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import streamrl
from streamrl.runtime.launcher import RunFailed
from tests.runtime.hygiene import processes_with_files_under, wait_gone

ray = pytest.importorskip("ray")

REPO = Path(__file__).resolve().parents[2]
DIGITS = REPO / "configs" / "grpo_digits.yaml"

pytestmark = [pytest.mark.timeout(420), pytest.mark.slow]  # second tier: see the docstring


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    from ray.cluster_utils import Cluster

    saved = {k: os.environ.get(k) for k in ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "RAY_TMPDIR")}
    tmp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # short: Ray's socket paths are limited
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # every Ray listener on 127.0.0.1
    os.environ["RAY_TMPDIR"] = tmp
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 6, "resources": {"node_a": 100},
                                                       "include_dashboard": False})
    try:
        c.add_node(num_cpus=6, resources={"node_b": 100})
        c.wait_for_nodes(timeout=60)
        ray.init(address=c.address, log_to_driver=False, configure_logging=False)
        yield c
    finally:
        try:
            ray.shutdown()
            c.shutdown()
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _node_id(resource: str) -> str:
    return next(n["NodeID"] for n in ray.nodes() if n["Alive"] and resource in n["Resources"])


def _run_leftovers() -> list[str]:
    """Named actors and placement groups of streamrl runs still on the cluster."""
    actors = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith("streamrl-")]
    groups = [g["name"] for g in ray.util.placement_group_table().values()
              if g["name"].startswith("streamrl-") and g["state"] != "REMOVED"]
    return actors + groups


def _overrides(tmp_path: Path, address: str, steps: int) -> list[str]:
    pins = "{source: {node_a: 1}, score: {node_a: 1}, advantage: {node_b: 1}, train: {node_b: 1}}"
    return [
        # each stage a worker of its own (not the default rollout chain): stages pinned to either node
        f"pipeline={REPO / 'pipelines' / 'grpo.yaml'}",
        f"algo.steps={steps}", "algo.stop_reward=null", f"output.run_dir={tmp_path}", "output.progress=none",
        "resources.launch=ray", f"resources.ray.address={address}", f"resources.ray.stage_resources={pins}",
        "resources.ray.strategy=SPREAD", "stages.generate.workers=2", "stages.generate.threads=1",
        "stages.train.threads=1",
    ]


def test_grpo_learns_across_two_nodes_with_a_warehouse_each(cluster: Any, tmp_path: Path) -> None:
    steps = 40
    result = streamrl.run(str(DIGITS), _overrides(tmp_path, cluster.address, steps))
    assert result.steps == steps

    # it learns (configs/grpo_digits.yaml: chance is ~0.1)
    rewards = [m["reward_mean"] for m in result.metrics]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert last >= 0.3 and last >= first + 0.15, rewards

    # stages on both nodes, a warehouse on each
    node_a, node_b = _node_id("node_a"), _node_id("node_b")
    where = result.placement
    assert node_a[:12] in where["source-0"] and node_a[:12] in where["score-0"], where
    assert node_b[:12] in where["train-0"] and node_b[:12] in where["advantage-0"], where
    assert {where["warehouse-0"], where["warehouse-1"]} == {where["source-0"], where["train-0"]}, where

    # data locality: the source wrote every sample to its own node's warehouse; the trainer, on
    # the other node, read them from there (the samples crossed nodes)
    home = int(next(k for k, v in where.items() if k.startswith("warehouse-") and v == where["source-0"])[-1])
    stored = [w["samples_stored"] for w in result.warehouse_statistics]
    assert stored[home] > 0, result.warehouse_statistics
    ctl = result.dock_statistics
    assert ctl["reserved_per_warehouse"][home] == steps * 64 and sum(ctl["reserved_per_warehouse"]) == steps * 64, ctl
    assert ctl["claimed_remote"] >= steps * 64, ctl  # at least the trainer's claims

    # nothing of the run is left: no actor, no placement group, no process
    assert _run_leftovers() == []
    assert wait_gone(processes_with_files_under(result.run_dir), 15) == []


def test_a_lost_node_stops_the_run_naming_it(cluster: Any, tmp_path: Path) -> None:
    """The generate workers' host actors die (as when their node goes): the run stops and says
    which worker was lost on which node; nothing of the run stays."""
    import threading

    def kill_generate_hosts() -> None:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            named = [a for a in ray.util.list_named_actors(all_namespaces=True)
                     if a["name"].startswith("streamrl-") and a["name"].endswith("generate-1")]
            if named and any((tmp_path / d / "metrics.jsonl").exists() and
                             (tmp_path / d / "metrics.jsonl").read_text().count("\n") >= 2
                             for d in os.listdir(tmp_path)):
                ray.kill(ray.get_actor(named[0]["name"], namespace=named[0]["namespace"]), no_restart=True)
                return
            time.sleep(0.5)

    killer = threading.Thread(target=kill_generate_hosts, daemon=True)
    killer.start()
    with pytest.raises(RunFailed, match=r"stage 'generate' worker 1 was lost: its Ray actor on node \w+"):
        streamrl.run(str(DIGITS), _overrides(tmp_path, cluster.address, 200))
    killer.join(timeout=10)
    assert _run_leftovers() == []
    run_dir = next(tmp_path.iterdir())
    assert wait_gone(processes_with_files_under(run_dir), 15) == []


def _rows(run_dirs: list[Path]) -> list[dict[str, Any]]:
    for d in run_dirs:
        if (d / "metrics.jsonl").exists():
            return [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return []


def _diagnosis(proc: subprocess.Popen[str], run_root: Path) -> str:
    """What a failed run test shows: every thread's stack of the launcher (in its stderr) and of
    each worker (in its log), taken with SIGUSR1 while the run still runs, then the launcher's
    stderr (after SIGTERM), the last metrics row and the end of each of the run's logs."""
    if proc.poll() is None:
        for pids in run_root.glob("*/logs/pids.json"):
            # (a worker still importing, before its faulthandler is set, would die of it: the
            # run is being stopped anyway)
            for pid in json.loads(pids.read_text()).values():
                if isinstance(pid, int):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGUSR1)
        time.sleep(1.0)  # faulthandler writes at once; the launcher's stderr is read below
        proc.send_signal(signal.SIGTERM)
    try:
        _, err = proc.communicate(timeout=90)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate(timeout=10)
    parts = [f"stderr (last 12000 characters):\n{(err or '')[-12000:]}"]
    for run_dir in run_root.iterdir():
        rows = _rows([run_dir])
        parts.append(f"{len(rows)} metrics rows; the last: {rows[-1:]}")
        for log in sorted((run_dir / "logs").glob("*.log")):
            lines = log.read_text(errors="replace").splitlines()
            parts.append(f"--- {log.name} (last 40 of {len(lines)} lines)\n" + "\n".join(lines[-40:]))
    return "\n".join(parts)


def test_a_killed_worker_is_restarted_and_sigterm_stops_every_actor(cluster: Any, tmp_path: Path) -> None:
    """``streamrl run`` on the cluster. A generate worker's process is SIGKILLed (its host actor
    lives on): the host starts it again and training goes on (the restart policy of local runs).
    Then SIGTERM: the run exits, and no actor, placement group or process of the run remains."""
    # the killed worker's leased samples go back to the dock after lease_ttl_s (30 s by default): 2 s
    # here, so the step after the restart comes as soon as the restarted worker is up. A stall
    # (no step for stall_timeout_s) stops the run with the stuck workers' stacks, which the
    # failure below shows.
    args = [str(DIGITS), *_overrides(tmp_path, cluster.address, 200), "resources.dock.lease_ttl_s=2.0",
            "resources.stall_timeout_s=90"]
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    proc = subprocess.Popen([sys.executable, "-m", "streamrl.cli", "run", *args], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    def wait_for(what: str, ok: Any, timeout_s: float = 240) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and proc.poll() is None:
            if ok():
                return
            time.sleep(0.3)
        code = proc.poll()
        raise AssertionError(f"{what}: not within {timeout_s} s (exit code {code})\n{_diagnosis(proc, tmp_path)}")

    try:
        wait_for("two steps", lambda: len(_rows(list(tmp_path.iterdir()))) >= 2)
        run_dir = next(tmp_path.iterdir())
        os.kill(json.loads((run_dir / "logs" / "pids.json").read_text())["generate-0"], signal.SIGKILL)
        wait_for("a step after the restart", lambda: any(r.get("restarts/generate-0") == 1 for r in _rows([run_dir])))
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    assert proc.returncode in (0, 1, 130), err[-3000:]
    assert _run_leftovers() == [], err[-3000:]
    assert wait_gone(processes_with_files_under(run_dir), 15) == []


def test_disaggregated_placement_sends_weights_across_nodes(cluster: Any, tmp_path: Path) -> None:
    """Two train ranks on node_b, generation on node_a: the torch.distributed world forms through
    the launcher's store (no shared filesystem, no hand-set port) and every version's weights go
    from one node to the other."""
    config = REPO / "configs" / "grpo_digits_disaggregated.yaml"
    steps = 4
    result = streamrl.run(str(config), [
        f"algo.steps={steps}", "algo.stop_reward=null", f"output.run_dir={tmp_path}", "output.progress=none",
        "resources.launch=ray", f"resources.ray.address={cluster.address}",
        "resources.ray.stage_resources={train: {node_b: 1}, generate: {node_a: 1}}",
    ])
    assert result.steps == steps
    node_a, node_b = _node_id("node_a")[:12], _node_id("node_b")[:12]
    assert all(node_b in v for k, v in result.placement.items() if k.startswith("train-")), result.placement
    assert all(node_a in v for k, v in result.placement.items() if k.startswith("generate-")), result.placement
    # generation used every new version: the weights crossed nodes each step
    assert max(m["staleness_max"] for m in result.metrics) == 0
    assert _run_leftovers() == []
    assert wait_gone(processes_with_files_under(result.run_dir), 15) == []


def test_an_address_that_cannot_be_joined_fails_in_time_and_sigterm_ends_the_join(tmp_path: Path) -> None:
    """``resources.ray.address`` at a local port nothing listens on (ray.init would retry it
    without end): the run fails within ``resources.ray.connect_timeout_s`` naming the key and the
    one-host fix; and a SIGTERM during a long join ends the process at once (a thread blocked in
    ray.init kept it alive after its 'interrupted' message). Both runs go at once: they only wait."""
    import socket

    with socket.socket() as s:  # a port from the OS, closed again: nothing listens on it
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"}
    env["PYTHONPATH"] = str(REPO)

    def start(name: str, timeout_s: float) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [sys.executable, "-u", "-m", "streamrl.cli", "run", str(DIGITS), "resources.launch=ray",
             f"resources.ray.address={address}", f"resources.ray.connect_timeout_s={timeout_s}",
             f"output.run_dir={tmp_path / name}", "output.progress=lines"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=tmp_path)

    failing, interrupted = start("failing", 5), start("interrupted", 600)
    try:
        # the run dir line comes just before the join begins
        out = ""
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and "run dir" not in out and interrupted.poll() is None:
            out += interrupted.stdout.readline()  # type: ignore[union-attr]
        assert "run dir" in out, out
        time.sleep(3)  # well inside ray.init
        t0 = time.monotonic()
        interrupted.send_signal(signal.SIGTERM)
        rest, _ = interrupted.communicate(timeout=30)
        took = time.monotonic() - t0
        text, _ = failing.communicate(timeout=120)
    finally:
        for p in (failing, interrupted):
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
    assert interrupted.returncode == 130, out + rest
    assert took < 10, f"SIGTERM during the join took {took:.1f} s to end the process"
    assert failing.returncode == 2, text
    assert "could not join the Ray cluster at resources.ray.address=" in text and address in text, text
    assert "connect_timeout_s=5 s" in text and "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0" in text, text
    assert "Traceback" not in text + rest
