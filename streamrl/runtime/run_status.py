"""A run's status as one JSON-able snapshot, and ``streamrl status RUN_DIR``.

The same snapshot is built two ways: live, by the launcher's status page
(:mod:`streamrl.runtime.status_page`, served as ``/api/status``), and after the fact from the
run directory's files (``config.yaml``, ``pipeline.yaml``, ``metrics.jsonl``).
``streamrl status`` asks the live page when the run directory's ``status.url`` names one that
answers, and reads the files otherwise; :func:`render_text` prints either.

Snapshot fields: ``name``, ``run_dir``, ``live`` (from a running launcher), ``state``
(starting, training, stopping, ended), ``step``, ``steps_total``, ``elapsed_s``, ``stages``
(name, workers, reads, writes, depth in the graph, busy fraction, samples_per_s, and from the
dock: ready, claimed, done; restarts), ``edges`` (from, to, columns, waiting: the samples ready
for the reading stage), ``dock`` (in flight, capacity, leases, counters), ``staleness``,
``rewards`` and ``evals`` (``[step, value]`` points, the newest :data:`MAX_POINTS`), ``last``
(the newest step row) and ``errors`` (the newest :data:`MAX_SHOWN_ERRORS`).
"""

from __future__ import annotations

import json
import math
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

STATUS_URL_FILE = "status.url"  # in the run dir while the launcher serves the page (0600: it holds the token)
TOKEN_HEADER = "X-Streamrl-Token"
MAX_POINTS = 500  # reward / eval points in a snapshot
MAX_SHOWN_ERRORS = 20
LAST_ROW_KEYS = ("reward_mean", "reward_std", "loss", "kl", "entropy", "clip_fraction", "samples_per_s",
                 "tokens_per_s", "staleness_mean", "staleness_max", "elapsed_s")


def pipeline_graph(stages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Stages (dicts with name, workers, reads, writes) as graph nodes with a ``depth`` (0: reads
    nothing; else one more than the deepest stage it reads from) and edges: writer -> reader,
    with the columns that flow along it. A side stage (no reads, no writes) has depth -1."""
    writer = {col: s["name"] for s in stages for col in s.get("writes", [])}
    edges: dict[tuple[str, str], list[str]] = {}
    for s in stages:
        for col in s.get("reads", []):
            if col in writer:
                edges.setdefault((writer[col], s["name"]), []).append(col)
    depth: dict[str, int] = {}

    def visit(name: str, seen: tuple[str, ...] = ()) -> int:
        if name not in depth:
            ups = [a for (a, b) in edges if b == name and a not in seen]
            depth[name] = 1 + max((visit(a, (*seen, name)) for a in ups), default=-1)
        return depth[name]

    nodes = []
    for s in stages:
        side = not s.get("reads") and not s.get("writes")
        nodes.append({"name": s["name"], "workers": int(s.get("workers", 1)), "reads": list(s.get("reads", [])),
                      "writes": list(s.get("writes", [])), "depth": -1 if side else visit(s["name"])})
    return nodes, [{"from": a, "to": b, "columns": cols, "waiting": None} for (a, b), cols in edges.items()]


def clean(value: Any) -> Any:
    """JSON without NaN or infinities (a browser's JSON.parse refuses them): those become null."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [clean(v) for v in value]
    return value


def curves(train_rows: list[dict[str, Any]], eval_rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The reward curve and each eval metric's curve (mean@k, pass@k), newest MAX_POINTS points."""
    rewards = [[r["step"], r["reward_mean"]] for r in train_rows[-MAX_POINTS:] if "reward_mean" in r]
    evals: dict[str, list[list[Any]]] = {}
    for r in eval_rows:
        for k, v in r.items():
            if k.startswith("eval/") and "@" in k:
                evals.setdefault(k[len("eval/"):], []).append([r["step"], v])
    return {"rewards": rewards, "evals": {k: v[-MAX_POINTS:] for k, v in evals.items()}}


def last_row(row: dict[str, Any]) -> dict[str, Any]:
    return {k: row[k] for k in LAST_ROW_KEYS if k in row}


def _read_rows(path: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    train: list[dict[str, Any]] = []
    evals: list[dict[str, Any]] = []
    if not path.is_file():
        return train, evals
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int):
            (evals if any(k.startswith("eval/") for k in row) else train).append(row)
    return train, evals


def snapshot_from_files(run_dir: str | Path) -> dict[str, Any]:
    """What the run directory says of a run that no launcher serves (ended, killed, or not begun)."""
    import yaml

    rd = Path(run_dir)
    if not (rd / "config.yaml").is_file():
        raise FileNotFoundError(f"{rd} is not a run directory (no config.yaml)")
    cfg = yaml.safe_load((rd / "config.yaml").read_text()) or {}
    pipe = yaml.safe_load((rd / "pipeline.yaml").read_text()) if (rd / "pipeline.yaml").is_file() else {}
    stage_defs = [s for s in (pipe or {}).get("stages", []) if isinstance(s, dict) and "name" in s]
    for s in stage_defs:  # the config's per-stage overrides (workers) apply to the pipeline file
        over = (cfg.get("stages") or {}).get(s["name"]) or {}
        if isinstance(over, dict) and "workers" in over:
            s["workers"] = over["workers"]
    train, evals = _read_rows(rd / "metrics.jsonl")
    last = train[-1] if train else {}
    stages, edges = pipeline_graph(stage_defs)
    for s in stages:
        s["busy"] = last.get(f"busy/{s['name']}")
        s["restarts"] = sum(v for k, v in last.items() if k.startswith(f"restarts/{s['name']}-"))
    return clean({
        "name": (cfg.get("output") or {}).get("name", rd.name), "run_dir": str(rd), "live": False,
        "state": "ended", "step": last.get("step", 0), "steps_total": (cfg.get("algo") or {}).get("steps"),
        "elapsed_s": last.get("elapsed_s"), "stages": stages, "edges": edges, "dock": None,
        "staleness": {"mean": last.get("staleness_mean"), "max": last.get("staleness_max"),
                      "limit": (cfg.get("algo") or {}).get("max_staleness")},
        **curves(train, evals), "last": last_row(last), "errors": [],
    })


def read_status_url(run_dir: str | Path) -> str | None:
    path = Path(run_dir) / STATUS_URL_FILE
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


def fetch_live(url: str, timeout_s: float = 3.0) -> dict[str, Any]:
    """The live snapshot from a status page's URL (as written to ``status.url``, token included)."""
    from urllib.parse import parse_qs, urlsplit

    parts = urlsplit(url)
    token = parse_qs(parts.query).get("token", [""])[0]
    req = urllib.request.Request(f"{parts.scheme}://{parts.netloc}/api/status", headers={TOKEN_HEADER: token})
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        return json.loads(resp.read())


def snapshot(run_dir: str | Path, timeout_s: float = 3.0) -> dict[str, Any]:
    """The live snapshot if the run's launcher serves one, else what its files say."""
    url = read_status_url(run_dir)
    if url is not None:
        try:
            return fetch_live(url, timeout_s)
        except (OSError, urllib.error.URLError, ValueError):
            pass  # a launcher that was killed left its status.url behind: read the files
    return snapshot_from_files(run_dir)


def _num(v: Any, fmt: str = "{:.3f}") -> str:
    return "-" if v is None else fmt.format(v)


def _spark(points: list[list[Any]], width: int = 40) -> str:
    ys = [p[1] for p in points if p[1] is not None][-width:]
    if not ys:
        return ""
    lo, hi = min(ys), max(ys)
    bars = "▁▂▃▄▅▆▇█"
    return "".join(bars[int((y - lo) / (hi - lo) * 7) if hi > lo else 0] for y in ys)


def render_text(snap: dict[str, Any]) -> str:
    """A terminal rendering of a snapshot: header, pipeline edges, stages, dock, curves, errors."""
    out = []
    total = snap.get("steps_total")
    out.append(f"{snap.get('name')}  {snap.get('state')}{' (live)' if snap.get('live') else ''}  "
               f"step {snap.get('step')}/{total if total is not None else '?'}  "
               f"elapsed {_num(snap.get('elapsed_s'), '{:.1f}')} s  {snap.get('run_dir')}")
    if snap.get("stop_reason"):
        out.append(f"stop reason: {snap['stop_reason']}")
    out.append("")
    out.append("pipeline (samples waiting on each edge):")
    for e in snap.get("edges", []):
        waiting = "-" if e.get("waiting") is None else str(e["waiting"])
        out.append(f"  {e['from']:>12} -> {e['to']:<12} waiting {waiting:>6}   [{', '.join(e['columns'])}]")
    out.append("")
    out.append(f"  {'stage':<12} {'workers':>7} {'busy':>6} {'samples/s':>10} {'in work':>8} {'ready':>6} "
               f"{'done':>8} {'restarts':>8}")
    for s in snap.get("stages", []):
        busy = "-" if s.get("busy") is None else f"{100 * s['busy']:.0f}%"
        out.append(f"  {s['name']:<12} {s['workers']:>7} {busy:>6} {_num(s.get('samples_per_s'), '{:.1f}'):>10} "
                   f"{_num(s.get('claimed'), '{}'):>8} {_num(s.get('ready'), '{}'):>6} "
                   f"{_num(s.get('done'), '{}'):>8} {s.get('restarts', 0):>8}")
    dock = snap.get("dock")
    if dock:
        out.append("")
        out.append(f"dock: {dock.get('in_flight')}/{dock.get('capacity')} samples in flight, "
                   f"{dock.get('leases')} leases ({dock.get('claimed')} samples claimed), "
                   f"{dock.get('leases_expired')} leases expired, {dock.get('dropped_stale')} dropped as stale")
    st = snap.get("staleness") or {}
    out.append(f"staleness: mean {_num(st.get('mean'), '{:.2f}')}, max {_num(st.get('max'), '{:g}')} "
               f"(algo.max_staleness {st.get('limit')})")
    last = snap.get("last") or {}
    if last:
        out.append("last step: " + ", ".join(f"{k} {v:.4g}" for k, v in last.items() if v is not None))
    rewards = snap.get("rewards") or []
    if rewards:
        out.append(f"reward: {_spark(rewards)}  {rewards[-1][1]:.3f} at step {rewards[-1][0]}")
    for k, pts in (snap.get("evals") or {}).items():
        out.append(f"eval {k}: {_spark(pts)}  {_num(pts[-1][1])} at version {pts[-1][0]}")
    errors = snap.get("errors") or []
    if errors:
        out.append("")
        out.append("last errors:")
        for e in errors[-MAX_SHOWN_ERRORS:]:
            when = time.strftime("%H:%M:%S", time.localtime(e.get("time", 0)))
            first = str(e.get("text", "")).splitlines()[0] if e.get("text") else ""
            out.append(f"  {when} {e.get('kind')}: {first[:200]}")
    return "\n".join(out)
