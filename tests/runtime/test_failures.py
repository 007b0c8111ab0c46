"""A stage that fails or a worker that dies ends the run with an error that says where; nothing is left over."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

import streamrl
from streamrl.runtime.launcher import RunFailed
from streamrl.runtime.stage import StageError
from tests.runtime.hygiene import assert_run_cleaned, ipc_dirs, only_run_dir


def _pipeline(tmp_path: Path, double_options: dict[str, Any], double_workers: int = 1,
              writes: str = "[y]") -> Path:
    path = tmp_path / "pipe.yaml"
    path.write_text(f"""
name: fail
stages:
  - name: source
    class: tests.runtime.user_stages:CountingSource
    writes: [x, tag]
    options: {{n: 16, group_size: 4}}
  - name: double
    class: tests.runtime.user_stages:Doubler
    reads: [x]
    writes: {writes}
    workers: {double_workers}
    micro_batch: 4
    options: {json.dumps(double_options)}
  - name: sink
    class: tests.runtime.user_stages:Recorder
    reads: [y, tag]
""")
    return path


def _config(tmp_path: Path, pipeline: Path, launch: str) -> dict[str, Any]:
    return {
        "pipeline": str(pipeline),
        "algo": {"steps": 1, "prompts_per_step": 4, "group_size": 4},
        "resources": {"launch": launch, "start_timeout_s": 60},
        "output": {"run_dir": str(tmp_path / "runs"), "progress": "none", "name": "fail"},
    }


def _batches(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "double-batches.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.timeout(90)
def test_a_failing_stage_stops_the_run_naming_stage_worker_and_samples(tmp_path: Path,
                                                                      importable_tests: None) -> None:
    before = ipc_dirs()
    with pytest.raises(StageError) as info:
        streamrl.run(_config(tmp_path, _pipeline(tmp_path, {"fail_on": [6]}), "processes"))
    err = info.value
    run_dir = only_run_dir(tmp_path / "runs")
    failed = next(b for b in _batches(run_dir) if 6 in b["x"])  # what the stage held when it raised
    assert err.stage == "double" and err.worker == 0
    assert err.indices == failed["indices"]
    assert str(err).startswith(f"stage 'double' worker 0 failed on samples {failed['indices']}")
    assert "user stage refuses x in [6]" in str(err)  # the stage's own message reaches the user
    assert failed["pid"] != os.getpid()  # it really ran in a worker process
    assert_run_cleaned(run_dir, os.getpid(), before)


@pytest.mark.timeout(60)
def test_a_failing_stage_in_process_mode(tmp_path: Path) -> None:
    with pytest.raises(StageError) as info:
        streamrl.run(_config(tmp_path, _pipeline(tmp_path, {"fail_on": [9]}), "inprocess"))
    run_dir = only_run_dir(tmp_path / "runs")
    failed = next(b for b in _batches(run_dir) if 9 in b["x"])
    assert (info.value.stage, info.value.worker, info.value.indices) == ("double", 0, failed["indices"])
    assert "user stage refuses x in [9]" in str(info.value)


@pytest.mark.timeout(60)
def test_the_stage_error_leads_with_the_stage_exception(tmp_path: Path) -> None:
    """The first line of the error says what the stage raised. (Bug found: run_worker formats the
    anyio task group's ExceptionGroup, so the line read 'ExceptionGroup: unhandled errors in a
    TaskGroup (1 sub-exception)' and the stage's exception showed only in the traceback tail.)"""
    with pytest.raises(StageError) as info:
        streamrl.run(_config(tmp_path, _pipeline(tmp_path, {"fail_on": [1]}), "inprocess"))
    first_line = str(info.value).splitlines()[0]
    assert "ValueError: user stage refuses x in [1]" in first_line


@pytest.mark.timeout(60)
def test_process_returning_the_wrong_columns(tmp_path: Path) -> None:
    with pytest.raises(StageError) as info:
        streamrl.run(_config(tmp_path, _pipeline(tmp_path, {}, writes="[y, z]"), "inprocess"))
    msg = str(info.value)
    assert info.value.stage == "double"
    assert "must return exactly the columns in writes=['y', 'z']" in msg and "missing ['z']" in msg


@pytest.mark.timeout(90)
@pytest.mark.parametrize(("how", "death"), [("exit", "exited with code 3"), ("kill", "was killed by signal 9")])
def test_a_worker_process_that_dies_fails_the_run(tmp_path: Path, importable_tests: None, how: str,
                                                   death: str) -> None:
    before = ipc_dirs()
    with pytest.raises(RunFailed) as info:
        streamrl.run(_config(tmp_path, _pipeline(tmp_path, {"die_on": [10], "how": how}, double_workers=2),
                             "processes"))
    run_dir = only_run_dir(tmp_path / "runs")
    dead = next(b for b in _batches(run_dir) if 10 in b["x"])
    msg = str(info.value)
    assert f"stage 'double' worker {dead['worker']} {death}" in msg
    assert str(run_dir / "logs" / f"double-{dead['worker']}.log") in msg
    assert not os.path.exists(f"/proc/{dead['pid']}") or Path(f"/proc/{dead['pid']}/stat").read_text().split()[2] == "Z"
    # every other process of the run (the other workers, the dock) was stopped
    assert_run_cleaned(run_dir, os.getpid(), before)


@pytest.mark.timeout(90)
def test_a_worker_that_crashes_in_native_code_leaves_its_python_stack_in_its_log(
        tmp_path: Path, importable_tests: None) -> None:
    """(Seen on a GPU: a worker killed by SIGSEGV inside a collective left nothing in its log but its
    last INFO line; faulthandler now writes every thread's stack there before the process dies.)"""
    with pytest.raises(RunFailed, match="was killed by signal 11") as info:
        streamrl.run(_config(tmp_path, _pipeline(tmp_path, {"die_on": [10], "how": "segv"}), "processes"))
    run_dir = only_run_dir(tmp_path / "runs")
    log = (run_dir / "logs" / "double-0.log").read_text()
    assert str(run_dir / "logs" / "double-0.log") in str(info.value)
    assert "Fatal Python error: Segmentation fault" in log and "user_stages.py" in log and "in process" in log
    # and the error itself carries that stack: CI keeps a failed test's output, not its run dirs
    assert "its log ends with:\nFatal Python error: Segmentation fault" in str(info.value)
    assert "in process" in str(info.value)


@pytest.mark.timeout(90)
def test_a_crash_is_reported_before_the_error_it_caused_in_a_peer(tmp_path: Path, importable_tests: None) -> None:
    """Worker 0 crashes in native code; worker 1, as the other rank of a collective, then fails on the
    broken connection. (Seen in CI: a train rank's SIGSEGV in gloo reached the user as the other
    rank's 'Connection reset by peer', a stage error, which auto_resume does not retry.) The run's
    error is the crash, resumable, with the crashed worker's stack and the peer's error after it."""
    before = ipc_dirs()
    with pytest.raises(RunFailed) as info:
        streamrl.run(_config(tmp_path, _pipeline(tmp_path, {"crash_worker": 0}, double_workers=2), "processes"))
    msg = str(info.value)
    assert msg.startswith("stage 'double' worker 0 was killed by signal 11"), msg
    assert "Fatal Python error: Segmentation fault" in msg
    assert "then stage 'double' worker 1 failed on samples" in msg and "Connection reset by peer" in msg
    assert info.value.resumable
    assert_run_cleaned(only_run_dir(tmp_path / "runs"), os.getpid(), before)
