"""``streamrl report RUN_DIR``: PNGs for what the rows carry and an index.html summary, from a
synthetic run directory and from a real tiny run; clear errors (exit 2) for what cannot be reported."""

from __future__ import annotations

import json
import logging
import math
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from streamrl.cli import main
from streamrl.metrics.report import ReportError, read_metrics, summarize, throughput, write_report

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
STEPS = 12


def _train_row(s: int) -> dict[str, Any]:
    return {"step": s, "reward_mean": min(0.9, 0.05 + 0.08 * (s - 1)), "reward_std": 0.2, "loss": -0.01 * s,
            "kl": 0.002 * s, "entropy": 2.5 - 0.1 * s, "response_len_mean": 4.0 - 0.1 * s,
            "response_tokens": 256.0 - s, "staleness_mean": 0.5 if s % 2 else 0.0, "staleness_max": 1.0 if s % 2 else 0,
            "busy/generate": 0.6, "busy/train": 0.3 + 0.01 * s, "busy/score": 0.05, "elapsed_s": 0.5 * s,
            "grad_norm": None if s == 3 else 1.0 / s}  # a non-finite value is written as null


def _synthetic_run(tmp_path: Path) -> Path:
    """12 training steps, evals at steps 4, 8 and 12 arriving one training row late, one torn line."""
    run_dir = tmp_path / "digits-20260101-000000"
    run_dir.mkdir()
    lines: list[str] = []
    for s in range(1, STEPS + 1):
        lines.append(json.dumps(_train_row(s)))
        if s in (5, 9):
            e = s - 1
            lines.append(json.dumps({"step": e, "eval/accuracy": 0.1 * e, "eval/mean@4": 0.08 * e,
                                     "eval/pass@4": min(1.0, 0.12 * e), "eval/response_len_mean": 3.0}))
        if s == 7:
            lines.append('{"step": 7, "reward_mea')  # a run killed mid-write
    lines.append(json.dumps({"step": 12, "eval/accuracy": 0.95, "eval/mean@4": 0.9, "eval/pass@4": 1.0,
                             "eval/response_len_mean": 3.5}))
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    (run_dir / "config.yaml").write_text(yaml.safe_dump({
        "pipeline": "../pipelines/grpo.yaml", "seed": 0,
        "model": {"tiny": {"hidden": 128, "layers": 2}, "dtype": "float32"},
        "task": {"name": "digits-max", "options": {"n_digits": 3}},
        "algo": {"steps": STEPS, "prompts_per_step": 8, "group_size": 8, "lr": 1e-3, "max_staleness": 1},
        "output": {"name": "digits"}}))
    return run_dir


def _assert_real_png(path: Path) -> None:
    import matplotlib.image

    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC, path
    assert len(data) > 5000, (path, len(data))  # axes, ticks and lines, not an empty canvas
    pixels = matplotlib.image.imread(path)
    assert pixels.ndim == 3 and pixels.shape[0] >= 200 and pixels.shape[1] >= 300
    assert float(pixels[..., :3].var()) > 1e-3, f"{path} is (nearly) one colour"
    # some pixels are coloured (the data lines), not only the black-and-white frame and text
    rgb = pixels[..., :3]
    assert float((rgb.max(axis=-1) - rgb.min(axis=-1)).max()) > 0.3, f"{path} has no coloured line"


def test_report_of_a_synthetic_run(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                   caplog: pytest.LogCaptureFixture) -> None:
    run_dir = _synthetic_run(tmp_path)
    with caplog.at_level(logging.WARNING, logger="streamrl.metrics.report"):
        assert main(["report", str(run_dir)]) == 0
    index = run_dir / "report" / "index.html"
    assert capsys.readouterr().out.strip() == str(index)  # the path is printed for the user to open
    torn = [r.getMessage() for r in caplog.records if "line" in r.getMessage()]
    assert len(torn) == 1 and "metrics.jsonl line 9" in torn[0] and "skipped" in torn[0]

    expected = {"reward", "eval", "kl", "entropy", "response_length", "throughput", "busy", "staleness", "optimizer"}
    assert {p.stem for p in (run_dir / "report").glob("*.png")} == expected
    for name in sorted(expected):
        _assert_real_png(run_dir / "report" / f"{name}.png")

    page = index.read_text()
    srcs = re.findall(r'<img src="([^"]+)"', page)
    assert sorted(srcs) == sorted(f"{n}.png" for n in expected)  # relative: the folder can be moved or served
    text = re.sub(r"<[^>]+>", " ", page)
    assert "streamrl report: digits" in text
    assert re.search(r"final reward\s+0\.9000 \(step 12\)", text)
    assert re.search(r"best reward\s+0\.9000 \(step 12\)", text)
    assert re.search(r"final eval/accuracy\s+0\.9500 \(step 12\)", text)
    assert re.search(r"final eval/pass@4\s+1\.0000", text)
    assert re.search(r"time per step\s+0\.50 s", text) and re.search(r"total training time\s+6\.00 s", text)
    assert re.search(r"task\s+digits-max", text) and re.search(r"prompts x group\s+8 x 8", text)
    assert re.search(r"model\s+tiny \(hidden=128, layers=2\)", text)


def test_summary_and_derived_throughput(tmp_path: Path) -> None:
    rows = read_metrics(_synthetic_run(tmp_path) / "metrics.jsonl")
    train = [r for r in rows if "reward_mean" in r]
    evals = [r for r in rows if "eval/accuracy" in r]
    assert [r["step"] for r in evals] == [4, 8, 12] and len(train) == STEPS
    s = summarize(train, evals)
    assert s["final_reward"] == pytest.approx(0.9) and s["final_step"] == STEPS
    assert s["best_step"] == STEPS and s["final_eval"]["eval/accuracy"] == 0.95
    assert s["s_per_step"] == pytest.approx(0.5) and s["total_s"] == pytest.approx(6.0)
    # no samples_per_s / tokens_per_s in the rows: derived from elapsed_s gaps of 0.5 s
    tp = throughput(train, batch_size=64)
    assert tp["samples/s"][0] == list(range(1, STEPS + 1)) and tp["samples/s"][1] == pytest.approx([128.0] * STEPS)
    assert tp["tokens/s"][1] == pytest.approx([(256.0 - s) / 0.5 for s in range(1, STEPS + 1)])
    assert "samples/s" not in throughput(train, batch_size=None)  # no config: no batch size to divide
    # the rows' own figures win when present
    own = [{**r, "samples_per_s": 10.0, "tokens_per_s": 40.0} for r in train]
    assert throughput(own, 64)["samples/s"][1] == [10.0] * STEPS


def test_only_the_plots_whose_keys_exist(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": s, "reward_mean": 0.1 * s, "kl": 0.01 * s}) + "\n" for s in range(1, 6)))
    report = write_report(run_dir)  # no config.yaml: the summary leaves the config out
    assert set(report.plots) == {"reward", "kl"}
    assert {p.name for p in report.out_dir.glob("*.png")} == {"reward.png", "kl.png"}
    assert "(no config.yaml)" in report.index.read_text()
    assert math.isclose(report.summary["final_reward"], 0.5)


def test_report_of_a_real_tiny_run(tmp_path: Path) -> None:
    from streamrl.runtime.launcher import run

    result = run(str(REPO / "configs" / "grpo_digits.yaml"),
                 ["algo.steps=3", "algo.stop_reward=null", "resources.launch=inprocess", "output.progress=none",
                  "output.checkpoint=false", "output.tensorboard=false"], run_dir=tmp_path / "run")
    assert result.steps == 3 and (result.run_dir / "reward_curve.png").read_bytes()[:8] == PNG_MAGIC
    report = write_report(result.run_dir)
    assert {"reward", "kl", "entropy", "throughput", "busy", "staleness"} <= set(report.plots)
    for path in report.plots.values():
        assert path.read_bytes()[:8] == PNG_MAGIC and path.stat().st_size > 5000
    _assert_real_png(report.plots["reward"])
    assert report.summary["final_reward"] == pytest.approx(result.final_reward)
    page = re.sub(r"<[^>]+>", " ", report.index.read_text())
    assert re.search(rf"final reward\s+{result.final_reward:.4f} \(step 3\)", page)
    assert re.search(r"task\s+digits-max", page) and re.search(r"steps\s+3\b", page)


@pytest.mark.parametrize("case", ["missing dir", "no metrics", "empty metrics", "all corrupt"])
def test_cli_errors_exit_2_with_a_clear_message(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                case: str) -> None:
    run_dir = tmp_path / "run"
    if case != "missing dir":
        run_dir.mkdir()
    if case == "empty metrics":
        (run_dir / "metrics.jsonl").write_text("\n")
    if case == "all corrupt":
        (run_dir / "metrics.jsonl").write_text('{"step": 1, "rew\n[1, 2]\n')
    assert main(["report", str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("streamrl: report: ") and str(run_dir) in err
    expected = {"missing dir": "no such run directory", "no metrics": "metrics.jsonl: no such file",
                "empty metrics": "no metric rows", "all corrupt": "no metric rows"}[case]
    assert expected in err
    assert not (run_dir / "report").exists()
    with pytest.raises(ReportError, match=re.escape(expected)):
        write_report(run_dir)


def test_the_reward_band_stays_within_the_rewards_range() -> None:
    """mean ± std of 0/1 rewards runs past 1 near the top: each step's band is clipped to the range
    its rewards took (reward_min / reward_max), rows without one to the range the others recorded."""
    from streamrl.metrics.report import reward_band

    rows = [
        {"step": 1, "reward_mean": 0.95, "reward_std": 0.22, "reward_min": 0.0, "reward_max": 1.0},
        {"step": 2, "reward_mean": 0.05, "reward_std": 0.22, "reward_min": 0.0, "reward_max": 1.0},
        {"step": 3, "reward_mean": 1.0, "reward_std": 0.0, "reward_min": 1.0, "reward_max": 1.0},
        {"step": 4, "reward_mean": 0.5, "reward_std": 0.1, "reward_min": 0.4, "reward_max": 0.55},
        {"step": 5, "reward_mean": 0.9, "reward_std": 0.3},  # an older row: the run's recorded range
        {"step": 6, "reward_mean": 0.5, "reward_std": 0.1},  # well inside: unchanged
    ]
    steps, low, high = reward_band(rows)
    assert steps == [1, 2, 3, 4, 5, 6]
    assert low == pytest.approx([0.73, 0.0, 1.0, 0.4, 0.6, 0.4])
    assert high == pytest.approx([1.0, 0.27, 1.0, 0.55, 1.0, 0.6])
    # no row with a range (a run from before they were recorded): mean ± std as it is
    _, low, high = reward_band([{"step": 1, "reward_mean": 0.9, "reward_std": 0.3}])
    assert (low, high) == (pytest.approx([0.6]), pytest.approx([1.2]))


@pytest.mark.parametrize("installed", [True, False])
def test_import_plotting_loads_what_drawing_takes_or_says_matplotlib_is_missing(installed: bool) -> None:
    """What the launcher calls while it waits for the forkserver: afterwards drawing imports nothing more."""
    hide = "" if installed else "sys.modules['matplotlib'] = None  # as if not installed\n"
    code = (f"import sys\n{hide}"
            "from streamrl.metrics.report import import_plotting\n"
            "assert 'matplotlib.figure' not in sys.modules\n"
            f"assert import_plotting() is {installed}\n"
            f"assert ({{'matplotlib.figure', 'matplotlib.backends.backend_agg'}} <= set(sys.modules)) is {installed}\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
