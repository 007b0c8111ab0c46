"""The live status page of a real digits run, loaded in headless Chromium; ``streamrl status``.

One ``streamrl run`` (a subprocess, as a user starts it) serves every test of this module; it
trains until the last test stops it with SIGTERM. The page is loaded with
``chromium --headless --dump-dom`` (the DOM after the page's script ran) and ``--screenshot``;
the screenshot is kept under ``$STREAMRL_TEST_ARTIFACTS`` (default: the test's tmp dir). The
Chromium tests skip only where no chromium binary is installed (``apt-get install chromium``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from streamrl.runtime.run_status import STATUS_URL_FILE, fetch_live
from tests.runtime.hygiene import descendants, live_processes, processes_with_files_under, wait_gone

REPO = Path(__file__).resolve().parents[2]
DIGITS = REPO / "configs" / "grpo_digits.yaml"
# pipelines/grpo.yaml rather than the quickstart's rollout chain: each stage apart, the graph has more to draw
PIPELINE = REPO / "pipelines" / "grpo.yaml"
STAGES = ["source", "generate", "score", "advantage", "train"]
CHROMIUM = next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="no chromium binary on PATH to load the status page "
                                                              "in (Debian: apt-get install chromium)")


class LiveRun:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.log = root / "out.txt"
        with self.log.open("w") as sink:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "streamrl.cli", "run", str(DIGITS), f"pipeline={PIPELINE}", "algo.steps=100000",
                 "algo.stop_reward=null", f"output.run_dir={root / 'runs'}", "output.progress=lines",
                 "output.tensorboard=false", "output.plot=false", "output.checkpoint=false"],
                stdout=sink, stderr=subprocess.STDOUT, cwd=root, env={**os.environ, "PYTHONPATH": str(REPO)})
        self.started: dict[int, str] = {}
        self.exit_code: int | None = None
        deadline = time.monotonic() + 120
        self.url = ""
        while time.monotonic() < deadline and self.proc.poll() is None and not self.url:
            found = list((root / "runs").glob(f"*/{STATUS_URL_FILE}"))
            self.url = found[0].read_text().strip() if found else ""
            time.sleep(0.2)
        assert self.url, f"no {STATUS_URL_FILE} within 120 s (exit code {self.proc.poll()}):\n{self.log.read_text()}"
        self.run_dir = found[0].parent
        self.wait_step(1, 120)
        self.started = descendants(self.proc.pid)

    def base(self) -> str:
        parts = urlsplit(self.url)
        return f"{parts.scheme}://{parts.netloc}"

    def step(self) -> int:
        return int(fetch_live(self.url)["step"])

    def wait_step(self, at_least: int, timeout_s: float) -> int:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log.read_text()
            step = self.step()
            if step >= at_least:
                return step
            time.sleep(0.2)
        raise AssertionError(f"no step {at_least} within {timeout_s} s:\n{self.log.read_text()}")

    def stop(self) -> int:
        """SIGTERM (no checkpoints configured: stop at once, as Ctrl-C), then SIGKILL if it lingers."""
        if self.exit_code is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.exit_code = self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.exit_code = self.proc.wait(timeout=10)
        return self.exit_code


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveRun]:
    run = LiveRun(tmp_path_factory.mktemp("status_page"))
    try:
        yield run
    finally:
        run.stop()
        assert not wait_gone(run.started, 15), run.started


def chromium(url: str, *args: str, timeout_s: float = 60.0) -> str:
    """Chromium, headless, on ``url`` with a throwaway profile; its stdout. Its whole process
    group is killed afterwards, and none of its processes may remain."""
    assert CHROMIUM is not None
    with tempfile.TemporaryDirectory(prefix="srl-chromium-") as profile:
        cmd = [CHROMIUM, "--headless", "--disable-gpu", "--no-first-run", "--no-default-browser-check",
               "--hide-scrollbars", f"--user-data-dir={profile}", "--virtual-time-budget=2000", *args, url]
        if os.geteuid() == 0:
            cmd.insert(1, "--no-sandbox")  # Chromium refuses to run as root with its sandbox
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
        try:
            out, err = proc.communicate(timeout=timeout_s)
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # helpers (zygote, utility processes) share its group
            except ProcessLookupError:
                pass
            proc.communicate()
        assert not wait_gone(list(live_processes(profile)), 10), live_processes(profile)
    assert proc.returncode == 0, err[-3000:]
    return out


def dom_numbers(dom: str) -> dict[str, float]:
    step = re.search(r'id="step">(\d+)<', dom)
    rates = [float(x) for x in re.findall(r">([\d.]+) samples/s<", dom)]
    assert step is not None, dom[:2000]
    return {"step": int(step.group(1)), "max_rate": max(rates, default=0.0)}


@needs_chromium
@pytest.mark.timeout(240)
def test_the_page_shows_the_graph_and_live_numbers(live: LiveRun) -> None:
    first = chromium(live.url, "--dump-dom")
    for stage in STAGES:  # the graph: one node per stage, edges between them
        assert f'data-stage="{stage}"' in first, first[:3000]
    assert 'class="edge" data-from="generate" data-to="score"' in first
    assert 'class="edge" data-from="advantage" data-to="train"' in first
    seen = dom_numbers(first)
    assert seen["step"] >= 1
    assert "training" in first and "reward_mean" in first
    # a later load shows the run moved on
    live.wait_step(seen["step"] + 2, 60)
    second = dom_numbers(chromium(live.url, "--dump-dom"))
    assert second["step"] > seen["step"], (seen, second)
    assert second["max_rate"] > 0  # samples/s of the stages, from their busy reports


@needs_chromium
@pytest.mark.timeout(120)
def test_a_screenshot_of_the_page(live: LiveRun, tmp_path: Path) -> None:
    out_dir = Path(os.environ.get("STREAMRL_TEST_ARTIFACTS") or tmp_path)
    out_dir.mkdir(parents=True, exist_ok=True)
    shot = out_dir / "status_page.png"
    chromium(live.url, f"--screenshot={shot}", "--window-size=1000,1100")
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    print(f"status page screenshot: {shot}")


def _get(url: str, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=10) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


@pytest.mark.timeout(60)
def test_without_the_token_nothing_is_served(live: LiveRun) -> None:
    token = live.url.split("token=", 1)[1]
    for path in ("/", "/api/status"):
        code, body = _get(live.base() + path)
        assert code == 401 and b"reward" not in body and str(live.run_dir).encode() not in body
        code, body = _get(live.base() + path, {"X-Streamrl-Token": "x" * len(token)})
        assert code == 403 and b"reward" not in body
        code, body = _get(f"{live.base()}{path}?token=wrong")
        assert code == 403
    code, body = _get(live.base() + "/api/status", {"X-Streamrl-Token": token})
    assert code == 200 and json.loads(body)["live"] is True
    code, _ = _get(live.base() + "/api/status", {"Authorization": f"Bearer {token}"})
    assert code == 200
    # the URL file holds the token: only its owner may read it
    assert stat.S_IMODE((live.run_dir / STATUS_URL_FILE).stat().st_mode) == 0o600
    assert live.base().startswith("http://127.0.0.1:")


def _status(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "streamrl.cli", "status", *args], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)})


@pytest.mark.timeout(180)
def test_streamrl_status_live_then_from_the_files(live: LiveRun) -> None:
    snap = json.loads(_status(str(live.run_dir), "--json").stdout)
    assert snap["live"] and snap["state"] == "training" and snap["step"] >= 1
    assert [s["name"] for s in snap["stages"]] == STAGES
    assert {(e["from"], e["to"]) for e in snap["edges"]} >= {("source", "generate"), ("generate", "score"),
                                                             ("score", "advantage"), ("advantage", "train")}
    assert all(isinstance(e["waiting"], int) for e in snap["edges"])  # from the dock controller
    assert snap["dock"]["capacity"] == 128 and snap["rewards"]
    text = _status(str(live.run_dir)).stdout
    assert "training (live)" in text and "generate -> score" in text

    # once the run is over: the page is gone, and the files tell the story
    assert live.stop() == 130, live.log.read_text()
    assert not (live.run_dir / STATUS_URL_FILE).exists()
    assert not processes_with_files_under(live.run_dir)
    done = _status(str(live.run_dir))
    assert done.returncode == 0, done.stderr
    rows = (live.run_dir / "metrics.jsonl").read_text().splitlines()
    assert f"ended  step {json.loads(rows[-1])['step']}/100000" in done.stdout, done.stdout
    assert "(live)" not in done.stdout and "busy" in done.stdout
