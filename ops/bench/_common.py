"""Shared helpers of the benchmarks under ops/bench/: spread of repetitions, percentiles, tables, JSON line.

Every benchmark prints a human-readable table, then as its LAST line one JSON object
``{"name", "figures", "baseline", "ratio", "target"}`` (see :func:`print_json_line`).
"""

from __future__ import annotations

import json
import math
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any


def spread(values: Iterable[float]) -> dict[str, float]:
    """Median and range of repeated measurements: ``{"median", "min", "max", "n"}``."""
    vals = [float(v) for v in values]
    if not vals:
        return {"median": math.nan, "min": math.nan, "max": math.nan, "n": 0}
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals), "n": len(vals)}


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """The ``q``-quantile (0..1) of already sorted values, nearest-rank (no interpolation)."""
    if not sorted_values:
        return math.nan
    k = min(len(sorted_values) - 1, max(0, math.ceil(q * len(sorted_values)) - 1))
    return float(sorted_values[k])


def ratio(a: Mapping[str, float], b: Mapping[str, float]) -> float:
    """Ratio of two medians (nan when the denominator is 0 or missing)."""
    den = b.get("median", math.nan)
    return a.get("median", math.nan) / den if den else math.nan


def fmt_spread(s: Mapping[str, float], digits: int = 1) -> str:
    """``median [min, max]`` for a table cell."""
    return f"{s['median']:.{digits}f} [{s['min']:.{digits}f}, {s['max']:.{digits}f}]"


def print_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], out: Any = None) -> None:
    """A plain fixed-width table (columns sized to their widest cell)."""
    out = out or sys.stdout
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    for n, r in enumerate(cells):
        print("  ".join(c.rjust(w) if k else c.ljust(w) for k, (c, w) in enumerate(zip(r, widths, strict=True))), file=out)
        if n == 0:
            print("  ".join("-" * w for w in widths), file=out)


def _finite(obj: Any) -> Any:
    """JSON has no NaN/inf: they become null."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, Mapping):
        return {str(k): _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def print_json_line(
    name: str,
    figures: Mapping[str, Any],
    baseline: Mapping[str, Any],
    ratio: Mapping[str, Any],
    target: Mapping[str, Any],
    **extra: Any,
) -> None:
    """The benchmark's last output line: one JSON object, flushed."""
    obj = {"name": name, "figures": figures, "baseline": baseline, "ratio": ratio, "target": target, **extra}
    print(json.dumps(_finite(obj), separators=(",", ":"), sort_keys=False), flush=True)


def median_seconds(fn: Callable[[], object], calls: int, *, warmup: int) -> float:
    """Wall seconds of the middle one (the upper of the two middle ones for an even count) of
    ``calls`` timed calls of ``fn``, after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[calls // 2]


def checkout_env(checkout: Path) -> dict[str, str]:
    """The environment that makes a benchmark's child process import another checkout's streamrl
    (``--against``): its root first on ``PYTHONPATH``; exits naming the path when it holds none."""
    if not (checkout / "streamrl" / "__init__.py").is_file():
        raise SystemExit(f"--against {checkout}: no streamrl package there; pass a checkout's root")
    return {"PYTHONPATH": str(checkout.resolve())}


def proc_status_mib(pid: int, field: str) -> float | None:
    """A memory line of /proc/PID/status in MiB (``VmRSS``: now; ``VmHWM``: the peak so far), or None
    when the process is gone."""
    from pathlib import Path

    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) / 1024
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    return None
