"""The status snapshot's pure parts: the pipeline graph, bounded curves, JSON without NaN, the
summary of an ended run from its files, and the terminal rendering (no run needed)."""

from __future__ import annotations

import json
import math
import socket
from pathlib import Path

import yaml

from streamrl.runtime.run_status import MAX_POINTS, clean, curves, pipeline_graph, render_text, snapshot

REPO = Path(__file__).resolve().parents[2]


def _grpo_stages() -> list[dict]:
    return yaml.safe_load((REPO / "pipelines" / "grpo.yaml").read_text())["stages"]


def test_the_graph_has_a_depth_per_stage_and_an_edge_per_writer_reader_pair() -> None:
    stages = [*_grpo_stages(), {"name": "eval", "class": "x:Y"}]
    nodes, edges = pipeline_graph(stages)
    assert {n["name"]: n["depth"] for n in nodes} == {"source": 0, "generate": 1, "score": 2, "advantage": 3,
                                                       "train": 4, "eval": -1}  # eval: a side stage
    pairs = {(e["from"], e["to"]): e["columns"] for e in edges}
    assert pairs[("generate", "train")] == ["response_ids", "rollout_logprobs"]
    assert pairs[("source", "score")] == ["prompt", "answer"]
    assert ("score", "train") in pairs and not any("eval" in p for p in pairs)


def test_curves_are_bounded_and_json_has_no_nan() -> None:
    rows = [{"step": k, "reward_mean": k / 10} for k in range(1, 2 * MAX_POINTS)]
    evals = [{"step": 5, "eval/mean@4": float("nan"), "eval/pass@4": 0.5}]
    c = curves(rows, evals)
    assert len(c["rewards"]) == MAX_POINTS and c["rewards"][-1][0] == 2 * MAX_POINTS - 1
    out = clean(c)
    assert out["evals"]["mean@4"] == [[5, None]] and out["evals"]["pass@4"] == [[5, 0.5]]
    json.loads(json.dumps(out, allow_nan=False))
    assert clean({"a": [math.inf, 1.0]}) == {"a": [None, 1.0]}


def test_an_ended_run_is_summarised_from_its_files(tmp_path: Path) -> None:
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({"output": {"name": "digits"}, "algo": {"steps": 3,
                                                                                                 "max_staleness": 1}}))
    (tmp_path / "pipeline.yaml").write_text(yaml.safe_dump({"name": "grpo", "stages": _grpo_stages()}))
    rows = [{"step": k, "reward_mean": 0.1 * k, "busy/generate": 0.5, "busy/train": 0.25, "staleness_mean": 0.5,
             "staleness_max": 1, "elapsed_s": 1.5 * k} for k in (1, 2, 3)]
    rows[-1]["restarts/score-0"] = 2
    lines = [json.dumps(r) for r in rows] + [json.dumps({"step": 2, "eval/mean@4": 0.75}), '{"step": 4, "rew']
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    snap = snapshot(tmp_path)  # no status.url: from the files
    assert not snap["live"] and snap["state"] == "ended" and snap["step"] == 3 and snap["steps_total"] == 3
    by_name = {s["name"]: s for s in snap["stages"]}
    assert by_name["generate"]["busy"] == 0.5 and by_name["score"]["restarts"] == 2
    assert snap["evals"] == {"mean@4": [[2, 0.75]]} and len(snap["rewards"]) == 3
    text = render_text(snap)
    assert text.startswith("digits  ended  step 3/3")
    assert "generate -> score" in text and "50%" in text and "staleness: mean 0.50, max 1" in text
    # a status.url whose launcher is gone (killed): the files still answer
    with socket.socket() as sock:  # bound, not listening: connections to it are refused
        sock.bind(("127.0.0.1", 0))
        (tmp_path / "status.url").write_text(f"http://127.0.0.1:{sock.getsockname()[1]}/?token=x\n")
        assert snapshot(tmp_path, timeout_s=2)["state"] == "ended"
