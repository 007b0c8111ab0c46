"""``streamrl report RUN_DIR``: plots and a one-page summary of a finished (or running) run.

Reads ``<run dir>/metrics.jsonl`` (training rows, and eval rows: a ``step`` and ``eval/...`` names,
possibly written after later training rows) and ``config.yaml``, and writes ``<run dir>/report/``:
one PNG per family of figures the rows carry (reward, eval, KL, entropy, response length,
throughput, busy fraction per stage, staleness, optimizer) and ``index.html`` showing them with
the run's config highlights and headline numbers. A plot whose keys no row has is left out.
"""

from __future__ import annotations

import html
import json
import logging
import math
import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

log = logging.getLogger("streamrl.metrics.report")

Row = dict[str, Any]
Series = tuple[list[float], list[float]]  # (steps, values), sorted by step


class ReportError(ValueError):
    """The run directory cannot be reported on; the message names the path and what to do."""


@dataclass
class Report:
    out_dir: Path
    index: Path  # report/index.html
    plots: dict[str, Path] = field(default_factory=dict)  # figure name -> PNG
    summary: dict[str, Any] = field(default_factory=dict)  # the headline numbers shown on the page


# --------------------------------------------------------------------------- reading


def read_metrics(path: Path) -> list[Row]:
    """Every JSON object line of ``metrics.jsonl`` that has a ``step``; corrupt lines (a run killed
    mid-write, a hand edit) are skipped with a warning naming the line."""
    if not path.is_file():
        raise ReportError(f"{path}: no such file; a run writes metrics.jsonl into its run directory "
                          "(streamrl run ...): pass that directory")
    rows: list[Row] = []
    with path.open(encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                log.warning("%s line %d: not JSON (%s); skipped", path, lineno, exc.msg)
                continue
            if not isinstance(row, dict) or not isinstance(row.get("step"), int | float):
                log.warning("%s line %d: not a metrics row (no numeric 'step'); skipped", path, lineno)
                continue
            rows.append(row)
    if not rows:
        raise ReportError(f"{path}: no metric rows (empty, or every line corrupt); did the run finish a step?")
    return rows


def read_config(run_dir: Path) -> dict[str, Any]:
    """The run's resolved ``config.yaml`` as plain data; ``{}`` (with a warning) when absent or unreadable,
    since the plots need only the metrics."""
    from streamrl.config import YamlLoader

    path = run_dir / "config.yaml"
    if not path.is_file():
        log.warning("%s: missing; the summary leaves out the config", path)
        return {}
    try:
        cfg = yaml.load(path.read_text(), Loader=YamlLoader)  # a SafeLoader (YAML 1.2 floats)
    except yaml.YAMLError as exc:
        log.warning("%s: not YAML (%s); the summary leaves out the config", path, exc)
        return {}
    return cfg if isinstance(cfg, dict) else {}


def is_eval(row: Row) -> bool:
    return any(k.startswith("eval/") for k in row) and "reward_mean" not in row


def _num(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        return None
    return float(v)


def series(rows: Iterable[Row], key: str) -> Series:
    """(steps, values) of ``key`` over the rows that carry a finite value, sorted by step (eval rows
    can land after later training rows); a step seen twice keeps its last value."""
    by_step: dict[float, float] = {}
    for r in rows:
        v = _num(r.get(key))
        if v is not None:
            by_step[float(r["step"])] = v
    steps = sorted(by_step)
    return steps, [by_step[s] for s in steps]


def _keys(rows: Iterable[Row]) -> list[str]:
    seen: dict[str, None] = {}
    for r in rows:
        seen.update(dict.fromkeys(r))
    return list(seen)


# --------------------------------------------------------------------------- plotting


def import_plotting() -> bool:
    """Import what drawing a figure takes (matplotlib's Figure and Agg canvas: most of a second of
    CPU) ahead of the first figure; False when matplotlib is missing. The launcher calls it while
    it waits for the workers' forkserver, so the reward curve at the end of a run costs only its
    drawing."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: F401
        from matplotlib.figure import Figure  # noqa: F401
    except ImportError:
        return False
    return True


def _figure(n_axes: int = 1) -> Any:
    # Figure + Agg canvas directly: no pyplot, so no global backend switch and no state shared with
    # a caller's own plots (the launcher calls this from a running process)
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4, 3.6 * n_axes if n_axes > 1 else 3.6), dpi=100)
    FigureCanvasAgg(fig)
    return fig


def _finish(fig: Any, ax: Any, path: Path, title: str, ylabel: str) -> Path:
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="best", fontsize="small")
    fig.tight_layout()
    fig.savefig(path)
    return path


def _lines(path: Path, title: str, ylabel: str, lines: dict[str, Series], marker: str = "") -> Path | None:
    lines = {label: s for label, s in lines.items() if s[0]}
    if not lines:
        return None
    fig = _figure()
    ax = fig.add_subplot()
    for label, (xs, ys) in lines.items():
        # a lone point (one eval, one step) draws no line: a marker keeps it visible
        # eval points are sparse (every eval.every steps): markers show where they were taken
        dots = marker or ("o" if len(xs) == 1 or label.startswith("eval/") else "")
        ax.plot(xs, ys, marker=dots, markersize=4, label=label)
    return _finish(fig, ax, path, title, ylabel)


def reward_band(train: list[Row]) -> tuple[list[float], list[float], list[float]]:
    """(steps, low, high): mean ± std of each step's reward, clipped to the range its rewards took.

    A ±std band of a bounded reward runs past its bounds (a mean of 0.95 with std 0.22 on 0/1
    rewards would reach 1.17), so each step's band stays within that step's ``reward_min`` /
    ``reward_max``. Rows without them (runs from before the trainer recorded them) are clipped to
    the range the other rows recorded, and left as they are when no row has one."""
    steps, mean = series(train, "reward_mean")
    std = dict(zip(*series(train, "reward_std"), strict=True))
    lo_by = dict(zip(*series(train, "reward_min"), strict=True))
    hi_by = dict(zip(*series(train, "reward_max"), strict=True))
    run_lo = min(lo_by.values(), default=-math.inf)
    run_hi = max(hi_by.values(), default=math.inf)
    low, high = [], []
    for s, m in zip(steps, mean, strict=True):
        d = std.get(s, 0.0)
        lo, hi = lo_by.get(s, run_lo), hi_by.get(s, run_hi)
        low.append(min(max(m - d, lo), m))  # the band always holds the mean itself
        high.append(max(min(m + d, hi), m))
    return steps, low, high


def plot_reward(rows: list[Row], path: Path, title: str = "") -> Path | None:
    """Mean reward per step with a ±std band (clipped to the step's reward range, see
    :func:`reward_band`); None when no row has a reward or matplotlib is missing (this is also the
    launcher's ``reward_curve.png``)."""
    train = [r for r in rows if not is_eval(r)]
    steps, mean = series(train, "reward_mean")
    if not steps:
        return None
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        log.warning("%s skipped: pip install matplotlib", path.name)
        return None
    _, low, high = reward_band(train)
    fig = _figure()
    ax = fig.add_subplot()
    ax.plot(steps, mean, color="tab:blue", marker="o" if len(steps) == 1 else "", label="mean reward")
    ax.fill_between(steps, low, high, color="tab:blue", alpha=0.15, label="± std (within min..max)")
    return _finish(fig, ax, path, title or "reward per step", "reward")


def throughput(train: list[Row], batch_size: int | None) -> dict[str, Series]:
    """samples/s and tokens/s per step: the rows' own figures when they have them, otherwise derived
    from the gaps between consecutive ``elapsed_s`` (samples need the config's batch size, tokens
    the rows' ``response_tokens``)."""
    out: dict[str, Series] = {}
    for key, label in (("samples_per_s", "samples/s"), ("tokens_per_s", "tokens/s")):
        if series(train, key)[0]:
            out[label] = series(train, key)
    if len(out) == 2:
        return out
    steps, elapsed = series(train, "elapsed_s")
    tok = dict(zip(*series(train, "response_tokens"), strict=True))
    derived: dict[str, Series] = {"samples/s": ([], []), "tokens/s": ([], [])}
    prev = 0.0  # elapsed_s counts from the start of training, so step 1's gap is its own value
    for s, e in zip(steps, elapsed, strict=True):
        dt = e - prev
        prev = e
        if dt <= 0:
            continue
        if batch_size:
            derived["samples/s"][0].append(s)
            derived["samples/s"][1].append(batch_size / dt)
        if s in tok:
            derived["tokens/s"][0].append(s)
            derived["tokens/s"][1].append(tok[s] / dt)
    for label, sr in derived.items():
        if label not in out and sr[0]:
            out[label] = sr
    return out


def _plot_throughput(path: Path, lines: dict[str, Series]) -> Path | None:
    if not lines:
        return None
    # samples and tokens differ by the response length: one axis each keeps both readable
    fig = _figure(len(lines))
    axes = [fig.add_subplot(len(lines), 1, k + 1) for k in range(len(lines))]
    for ax, (label, (xs, ys)) in zip(axes, lines.items(), strict=True):
        ax.plot(xs, ys, marker="o" if len(xs) == 1 else "", markersize=4, color="tab:green")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].set_title("throughput per step")
    axes[-1].set_xlabel("optimizer step")
    fig.tight_layout()
    fig.savefig(path)
    return path


def _busy(train: list[Row], keys: list[str]) -> dict[str, Series]:
    # the legend carries each stage's whole-run mean: per-step fractions swing between 0 and 1 as
    # stages take turns, the mean is the figure that says which stage is the bottleneck
    out = {}
    for k in keys:
        if k.startswith("busy/"):
            xs, ys = series(train, k)
            if xs:
                out[f"{k.removeprefix('busy/')} (mean {statistics.fmean(ys):.2f})"] = (xs, ys)
    return out


# --------------------------------------------------------------------------- summary


def _dig(cfg: dict[str, Any], dotted: str) -> Any:
    node: Any = cfg
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, dict):
        return ", ".join(f"{k}={_fmt(x)}" for k, x in v.items() if x is not None)
    if isinstance(v, list):
        return ", ".join(_fmt(x) for x in v)
    return str(v)


def _fmt_s(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.2f} s" if seconds < 10 else f"{seconds:.1f} s"
    m, s = divmod(round(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def config_highlights(cfg: dict[str, Any]) -> dict[str, str]:
    """The few config fields a reader of the report wants first."""
    out: dict[str, str] = {}
    model = _dig(cfg, "model.path") or (f"tiny ({_fmt(_dig(cfg, 'model.tiny'))})" if _dig(cfg, "model.tiny") else None)
    fields = {
        "model": model,
        "dtype": _dig(cfg, "model.dtype"),
        "task": _dig(cfg, "task.name"),
        "task options": _dig(cfg, "task.options") or None,
        "pipeline": cfg.get("pipeline"),
        "steps": _dig(cfg, "algo.steps"),
        "prompts x group": (f"{_dig(cfg, 'algo.prompts_per_step')} x {_dig(cfg, 'algo.group_size')}"
                            if _dig(cfg, "algo.prompts_per_step") is not None else None),
        "lr": _dig(cfg, "algo.lr"),
        "loss": _dig(cfg, "algo.loss"),
        "max staleness": _dig(cfg, "algo.max_staleness"),
        "launch": _dig(cfg, "resources.launch"),
        "seed": cfg.get("seed"),
    }
    for name, v in fields.items():
        if v is not None and v != "":
            out[name] = _fmt(v)
    return out


def summarize(train: list[Row], evals: list[Row]) -> dict[str, Any]:
    """Headline numbers: final and best reward, final eval scores, time per step, total time."""
    out: dict[str, Any] = {"steps": len({r["step"] for r in train}), "eval_rows": len(evals)}
    steps, rewards = series(train, "reward_mean")
    if rewards:
        out["final_reward"] = rewards[-1]
        out["final_step"] = int(steps[-1])
        best = max(range(len(rewards)), key=rewards.__getitem__)
        out["best_reward"] = rewards[best]
        out["best_step"] = int(steps[best])
    if evals:
        last = max(evals, key=lambda r: r["step"])
        out["eval_step"] = int(last["step"])
        out["final_eval"] = {k: v for k, v in last.items() if k.startswith("eval/") and _num(v) is not None}
    xs, elapsed = series(train, "elapsed_s")
    if elapsed:
        out["total_s"] = elapsed[-1]  # elapsed_s counts training time: start-up is not in the rows
        out["s_per_step"] = elapsed[-1] / len(xs)
    else:
        _, st = series(train, "step_time_s")
        if st:
            out["s_per_step"] = statistics.fmean(st)
            out["total_s"] = sum(st)
    return out


def _html(run_dir: Path, cfg: dict[str, Any], summary: dict[str, Any], plots: dict[str, Path]) -> str:
    name = cfg.get("output", {}).get("name") if isinstance(cfg.get("output"), dict) else None
    title = f"streamrl report: {name or run_dir.name}"
    e = html.escape
    rows: list[tuple[str, str]] = [("run directory", str(run_dir.resolve())), ("steps logged", str(summary["steps"]))]
    if "final_reward" in summary:
        rows.append(("final reward", f"{summary['final_reward']:.4f} (step {summary['final_step']})"))
        rows.append(("best reward", f"{summary['best_reward']:.4f} (step {summary['best_step']})"))
    for k, v in summary.get("final_eval", {}).items():
        rows.append((f"final {k}", f"{v:.4f} (step {summary['eval_step']})"))
    if "s_per_step" in summary:
        rows.append(("time per step", _fmt_s(summary["s_per_step"])))
        rows.append(("total training time", _fmt_s(summary["total_s"])))
    table = "\n".join(f"<tr><th>{e(k)}</th><td>{e(v)}</td></tr>" for k, v in rows)
    cfg_table = "\n".join(f"<tr><th>{e(k)}</th><td>{e(v)}</td></tr>" for k, v in config_highlights(cfg).items())
    figs = "\n".join(f'<figure><img src="{e(p.name)}" alt="{e(n)}"><figcaption>{e(n)}</figcaption></figure>'
                     for n, p in plots.items())
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{e(title)}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em auto; max-width: 70em; color: #222; }}
table {{ border-collapse: collapse; margin-bottom: 1.5em; }}
th, td {{ text-align: left; padding: 0.2em 1em 0.2em 0; vertical-align: top; }}
th {{ font-weight: 600; color: #555; }}
.figs {{ display: flex; flex-wrap: wrap; gap: 1em; }}
figure {{ margin: 0; }} img {{ max-width: 100%; width: 32em; }}
figcaption {{ font-size: small; color: #666; }}
</style></head><body>
<h1>{e(title)}</h1>
<h2>Results</h2>
<table>
{table}
</table>
<h2>Config</h2>
<table>
{cfg_table or '<tr><td>(no config.yaml)</td></tr>'}
</table>
<h2>Plots</h2>
<div class="figs">
{figs}
</div>
</body></html>
"""


# --------------------------------------------------------------------------- entry point


def write_report(run_dir: str | Path, out_dir: str | Path | None = None) -> Report:
    """Plots and ``index.html`` for ``run_dir`` into ``out_dir`` (default ``<run_dir>/report``)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ReportError(f"{run_dir}: no such run directory; pass a directory made by `streamrl run` "
                          "(runs/<name>-<timestamp>)")
    rows = read_metrics(run_dir / "metrics.jsonl")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ReportError("streamrl report draws with matplotlib: pip install matplotlib") from None
    cfg = read_config(run_dir)
    out = Path(out_dir) if out_dir is not None else run_dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    train = [r for r in rows if not is_eval(r)]
    evals = [r for r in rows if is_eval(r)]
    train_keys, eval_keys = _keys(train), _keys(evals)
    batch = _dig(cfg, "algo.prompts_per_step"), _dig(cfg, "algo.group_size")
    batch_size = batch[0] * batch[1] if all(isinstance(b, int) for b in batch) else None

    length_eval = [k for k in eval_keys if k.startswith("eval/") and ("len" in k or "token" in k)]
    score_eval = [k for k in eval_keys if k.startswith("eval/") and k not in length_eval]
    staleness = [k for k in train_keys if "staleness" in k]
    optim = [k for k in ("loss", "grad_norm", "clip_fraction") if k in train_keys]
    figures: dict[str, Any] = {
        "reward": lambda p: plot_reward(train, p, title="reward per step (mean ± std)"),
        "eval": lambda p: _lines(p, "eval scores", "score", {k: series(evals, k) for k in score_eval}, marker="o"),
        "kl": lambda p: _lines(p, "KL to the reference policy", "KL", {"kl": series(train, "kl")}),
        "entropy": lambda p: _lines(p, "policy entropy", "nats / token", {"entropy": series(train, "entropy")}),
        "response_length": lambda p: _lines(p, "response length", "tokens", {
            "train": series(train, "response_len_mean"), **{k: series(evals, k) for k in length_eval}}),
        "throughput": lambda p: _plot_throughput(p, throughput(train, batch_size)),
        "busy": lambda p: _lines(p, "busy fraction per stage", "fraction of wall time", _busy(train, train_keys)),
        "staleness": lambda p: _lines(p, "staleness (policy versions behind)", "versions",
                                      {k: series(train, k) for k in staleness}),
        "optimizer": lambda p: _lines(p, "optimizer", "value", {k: series(train, k) for k in optim}),
    }
    plots: dict[str, Path] = {}
    for name, draw in figures.items():
        path = out / f"{name}.png"
        if draw(path) is not None:
            plots[name] = path
        elif path.exists():
            path.unlink()  # left from an earlier report of a run that had these keys then
    summary = summarize(train, evals)
    index = out / "index.html"
    index.write_text(_html(run_dir, cfg, summary, plots), encoding="utf-8")
    return Report(out_dir=out, index=index, plots=plots, summary=summary)
