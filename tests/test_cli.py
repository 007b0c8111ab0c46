"""The ``streamrl`` command line: ``validate`` prints the resolved config, config errors exit 2."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from streamrl.cli import main
from streamrl.config import load_config
from streamrl.runtime.prerun import choose_pipeline

REPO = Path(__file__).resolve().parents[1]
DIGITS = REPO / "configs" / "grpo_digits.yaml"


@pytest.fixture(autouse=True)
def _keep_sigterm_handler() -> Iterator[None]:
    """cli.main installs a SIGTERM handler (and SIGINT's default where it was ignored) for the
    process; give pytest its own back."""
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    yield
    signal.signal(signal.SIGTERM, before[0])
    signal.signal(signal.SIGINT, before[1])


def test_validate_prints_the_resolved_config(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["validate", str(DIGITS), "algo.steps=12", "resources.launch=inprocess", "algo.lr=0.0005"])
    out = capsys.readouterr().out
    assert code == 0
    body, _, pipeline_line = out.rstrip("\n").rpartition("\n")
    resolved = yaml.safe_load(body)
    assert resolved["algo"]["steps"] == 12
    assert resolved["algo"]["lr"] == pytest.approx(5e-4)
    assert resolved["resources"]["launch"] == "inprocess"
    assert resolved["algo"]["group_size"] == 8  # from the file
    assert resolved["output"]["checkpoint"] is True  # a default the file does not set
    # the printout is a complete config, with the pipeline the file's `auto` picks: loading it gives the
    # same run config
    assert load_config(resolved) == choose_pipeline(load_config(DIGITS, ["algo.steps=12", "resources.launch=inprocess",
                                                                         "algo.lr=0.0005"]))
    assert resolved["pipeline"] == "pipelines/grpo_sync.yaml"
    assert pipeline_line.startswith("# pipeline grpo_sync (")
    assert "source -> train" in pipeline_line


def test_validate_the_kl_pipeline(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["validate", str(DIGITS), "pipeline=../pipelines/grpo_kl.yaml", "algo.loss.kl_coef=0.05"])
    out = capsys.readouterr().out
    assert code == 0
    assert "source -> generate -> reference -> score -> advantage -> train" in out


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["algo.lrr=1"], "did you mean 'lr'"),
        (["algo.steps=0"], "algo.steps must be >= 1"),
        (["algo.loss.kl_coef=0.1"], "ref_logprobs"),  # the grpo pipeline has no reference stage
        (["stages.traine.workers=2"], "stages.traine"),
        (["pipeline=nope.yaml"], "no such file"),
    ],
)
def test_validate_config_errors_exit_2(overrides: list[str], expected: str,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["validate", str(DIGITS), *overrides])
    captured = capsys.readouterr()
    assert code == 2
    assert captured.out == ""
    assert captured.err.startswith("streamrl: config error: ")
    assert expected in captured.err


def test_run_with_a_config_error_exits_2_with_the_message(tmp_path: Path) -> None:
    """The real command, in its own process: nothing starts, the message names the bad key."""
    proc = subprocess.run(
        [sys.executable, "-m", "streamrl.cli", "run", str(DIGITS), "algo.lrr=1",
         f"output.run_dir={tmp_path}", "output.progress=none"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert proc.returncode == 2, proc.stderr
    assert "streamrl: config error:" in proc.stderr
    assert "unknown key 'algo.lrr' (did you mean 'lr'?)" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert list(tmp_path.iterdir()) == []  # no run dir was made for a config that never ran


@pytest.mark.timeout(180)
def test_run_prints_a_result_and_ends_promptly(tmp_path: Path) -> None:
    """``streamrl run`` as a user types it (real worker processes), with --print-result.

    The run must end once its last step is done: train_s (Go until the launcher saw every worker
    finish) stays close to the last step's time. Bug found: workers forked from the forkserver
    leave through os._exit, which can drop their final ``Finished`` message (still queued in
    ZeroMQ's I/O thread), so the launcher waits out its stop grace period (60 s, then 15 s) and
    warns that workers "did not finish": train_s ~61 s, then ~16 s, for steps that took 1 s.

    No process of the run outlives the command: once it has exited, nothing holds its output open
    (a `streamrl run ... | tee log` ends with it). Bug found: the workers' forkserver exited only
    after the command, once its own teardown of torch and transformers was done (about 1 s).

    multiprocessing leaves nothing in the temporary directory. Bug found: the command leaves without the
    interpreter's teardown, which is where multiprocessing removes the directory of the
    forkserver's socket (a /tmp/pymp-* directory per run)."""
    err_path = tmp_path / "stderr.txt"
    temp = tmp_path / "temp"
    temp.mkdir()
    with err_path.open("w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "streamrl.cli", "run", str(DIGITS), "algo.steps=3", "algo.stop_reward=null",
             f"output.run_dir={tmp_path}", "output.progress=none", "--print-result"],
            stdout=subprocess.PIPE, stderr=err, cwd=tmp_path,
            env={**os.environ, "PYTHONPATH": str(REPO), "TMPDIR": str(temp)},
        )
        try:
            returncode = proc.wait(timeout=170)  # its stdout is a few lines: no pipe fills up meanwhile
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
    assert proc.stdout is not None
    out = b""
    os.set_blocking(proc.stdout.fileno(), False)
    while True:
        try:
            chunk = os.read(proc.stdout.fileno(), 1 << 16)
        except BlockingIOError:
            pytest.fail("the command exited while another process still held its output open")
        if not chunk:
            break
        out += chunk
    proc.stdout.close()
    stderr = err_path.read_text()
    assert returncode == 0, stderr
    summary = json.loads(out.decode().strip().splitlines()[-1])
    assert summary["steps"] == 3 and summary["stop_reason"] == "completed 3 steps"
    run_dir = Path(summary["run_dir"])
    assert run_dir.parent == tmp_path and (run_dir / "checkpoint").is_dir()
    last_step_s = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])["elapsed_s"]
    assert "did not finish" not in stderr, stderr
    assert summary["train_s"] - last_step_s < 10, summary
    assert not list(temp.glob("pymp-*"))  # (torch keeps its compile cache there on purpose: torchinductor_*)


def test_run_with_a_pipeline_error_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: bad\nstages:\n  - name: source\n    class: streamrl.stages.source:SourceStage\n"
                   "    writes: [prompt_ids]\n  - name: train\n    class: streamrl.stages.train:TrainStage\n"
                   "    reads: [prompt_ids, advantage]\n")
    code = main(["run", str(DIGITS), f"pipeline={bad}", f"output.run_dir={tmp_path / 'runs'}",
                 "output.progress=none"])
    err = capsys.readouterr().err
    assert code == 2
    assert str(bad) in err and "'train'" in err and "'advantage'" in err
    assert not (tmp_path / "runs").exists()


def test_resume_errors_exit_2_saying_what_to_do(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run"]) == 2
    assert "CONFIG file, or --resume RUN_DIR" in capsys.readouterr().err
    assert main(["run", "--resume", str(tmp_path)]) == 2
    assert "not a run directory (no config.yaml)" in capsys.readouterr().err
    # a run directory without a checkpoint (the run saved none): say how to start afresh
    (tmp_path / "config.yaml").write_text(DIGITS.read_text().replace("pipeline: ../", f"pipeline: {DIGITS.parent.parent}/"))
    assert main(["run", "--resume", str(tmp_path), "output.progress=none"]) == 2
    err = capsys.readouterr().err
    assert "no complete checkpoint" in err and "checkpoint_every" in err


def test_usage_errors() -> None:
    with pytest.raises(SystemExit) as info:
        main(["frobnicate"])
    assert info.value.code == 2


def test_validate_reports_every_problem_with_its_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """One bad field does not hide another: a typo'd key, a wrong type and a failed range rule,
    each with the file and the line it is on."""
    bad = tmp_path / "three.yaml"
    bad.write_text("pipeline: ../pipelines/grpo.yaml\n"
                   "algo:\n"
                   "  lrr: 0.001\n"            # line 3: unknown key
                   "  steps: 0\n"              # line 4: range rule
                   "output:\n"
                   "  tensorboard: maybe\n")   # line 6: wrong type
    code = main(["validate", str(bad)])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("streamrl: config error: 3 problems:"), err
    assert f"{bad}, line 3: unknown key 'algo.lrr' (did you mean 'lr'?)" in err
    assert f"{bad}, line 4: algo.steps must be >= 1, got 0" in err
    assert f"{bad}, line 6: output.tensorboard: expected `bool`, got `str`" in err
    # the same problems, as the exception callers catch
    from streamrl.config import ConfigError, ConfigErrors

    with pytest.raises(ConfigError) as info:
        load_config(bad)
    assert isinstance(info.value, ConfigErrors)
    assert [(p.key, p.line) for p in info.value.problems] == [("algo.lrr", 3), ("algo.steps", 4),
                                                              ("output.tensorboard", 6)]


def test_a_problem_from_an_override_names_the_override(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", str(DIGITS), "algo.top_k=-1", "algo.lrr=1"]) == 2
    err = capsys.readouterr().err
    assert f"{DIGITS} + overrides: unknown key 'algo.lrr'" in err and "algo.top_k must be >= 0" in err


@pytest.mark.parametrize("argv", [["config", "--help", "algo.loss"], ["config", "help", "algo.loss"],
                                  ["config", "-h", "algo.loss"]])
def test_config_help_prints_a_section(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith("algo.loss\n")
    assert "algo.loss.kl_coef: float, default 0.0" in out
    assert "Weight of the per-token KL penalty" in out


def test_config_help_without_a_section_lists_them(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "--help"]) == 0
    out = capsys.readouterr().out
    assert "streamrl config show" in out
    for name in ("algo.loss", "resources.dock", "options.train", "stages"):
        assert f"\n  {name} " in out


def test_config_help_of_an_unknown_section_suggests_one(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "--help", "resorces"]) == 2
    assert "did you mean 'resources'" in capsys.readouterr().err
    assert main(["config", "shwo"]) == 2
    assert "did you mean 'show'" in capsys.readouterr().err


def test_config_show_prints_the_resolved_config_with_descriptions(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "show", str(DIGITS), "algo.lr=3e-4"]) == 0
    out = capsys.readouterr().out
    assert "  # AdamW peak learning rate (after warmup)\n  lr: 0.0003\n" in out
    assert load_config(yaml.safe_load(out)) == load_config(DIGITS, ["algo.lr=3e-4"])
    assert main(["config", "show"]) == 0  # no CONFIG: the defaults
    assert load_config(yaml.safe_load(capsys.readouterr().out)) == load_config({})
    assert main(["config", "show", "algo.steps=0"]) == 2
    assert "algo.steps must be >= 1" in capsys.readouterr().err
