"""The metrics table of docs/observability.md as key patterns, for tests over a real run's rows."""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "observability.md"
NUMBER = {"k", "worker"}  # placeholders that stand for a number; any other stands for one name


def _pattern(key: str) -> re.Pattern[str]:
    parts = re.split(r"(<[a-z_]+>)", key)
    out = "".join((r"\d+" if p[1:-1] in NUMBER else r"[^/]+") if p.startswith("<") else re.escape(p)
                  for p in parts)
    return re.compile(out)


def documented_patterns(doc: Path = DOC) -> list[re.Pattern[str]]:
    """Every key in the first column of the tables under ``## Metrics``."""
    text = doc.read_text(encoding="utf-8")
    section = text.split("\n## Metrics\n", 1)[1].split("\n## ", 1)[0]
    keys = [k for line in section.splitlines() if line.startswith("| `")
            for k in re.findall(r"`([^`]+)`", line.split("|")[1])]
    assert keys, f"no metrics table in {doc}"
    return [_pattern(k) for k in keys]


def undocumented(keys: Iterable[str]) -> list[str]:
    """The keys no pattern of the table matches. A stage figure of a stage with several workers,
    ``<stage>/<worker>/<name>``, is looked up as ``<stage>/<name>``, and so is a chain link's,
    ``<stage>/<link>/<name>``."""
    patterns = documented_patterns()
    missing = []
    for key in sorted(set(keys)):
        plain = re.sub(r"^([^/]+)/\d+/", r"\1/", key)
        unlinked = re.sub(r"^([^/]+)/[^/]+/", r"\1/", plain)
        if not any(p.fullmatch(k) for p in patterns for k in (key, plain, unlinked)):
            missing.append(key)
    return missing
