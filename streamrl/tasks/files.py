"""Rows of a dataset, from wherever a user keeps it: JSONL, JSON or Parquet files, a Hugging Face
``datasets`` directory (``save_to_disk``), or a hub name where there is network.

Every row comes with where it is (``file, line 7`` for JSONL: 1-based lines, as an editor shows
them; ``file, row 7`` for the others: 0-based, as pandas, pyarrow and ``datasets`` index them), so
an error about it names the file and the row. ``datasets`` is imported only for a directory or a
hub name.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

SUFFIXES = (".jsonl", ".json", ".parquet")


class PromptDatasetError(ValueError):
    """A prompt file or row is invalid; the message says where and what to fix."""


def read_rows(source: str, split: str = "train", *, where: str = "task.options.path") -> list[tuple[str, Any]]:
    """``(where, row)`` of every row of ``source``: a file path, a ``save_to_disk`` directory (a
    Dataset, or a DatasetDict whose ``split`` is read) or a hub name (``owner/name``)."""
    path = Path(source).expanduser()
    if path.is_file():
        suffix = path.suffix.lower()
        if suffix == ".jsonl":
            rows = list(_jsonl_rows(path))
        elif suffix == ".json":
            rows = _json_rows(path)
        elif suffix == ".parquet":
            rows = _parquet_rows(path)
        else:
            raise PromptDatasetError(f"{where}: {str(path)!r} has the extension {path.suffix or '(none)'!r}; give a "
                                   f"{', '.join(SUFFIXES)} file or a datasets save_to_disk directory")
    elif path.is_dir():
        rows = _disk_rows(path, split, where)
    elif path.exists():
        raise PromptDatasetError(f"{where}: {str(path)!r} is neither a file nor a directory")
    else:
        rows = _hub_rows(source, split, where)
    if not rows:
        raise PromptDatasetError(f"{where}: {source!r} has no rows; add some")
    return rows


def _jsonl_rows(path: Path) -> Iterator[tuple[str, Any]]:
    try:
        with path.open(encoding="utf-8") as f:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    yield f"{path}, line {lineno}", json.loads(line)
                except json.JSONDecodeError as exc:
                    raise PromptDatasetError(f"{path}, line {lineno}: not valid JSON ({exc.msg} at column {exc.colno}); "
                                           "each line must be one JSON object") from None
    except UnicodeDecodeError as exc:
        raise PromptDatasetError(f"{path}: not UTF-8 text (byte {exc.start}); save it as UTF-8") from None


def _json_rows(path: Path) -> list[tuple[str, Any]]:
    try:
        loaded = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise PromptDatasetError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno}, column {exc.colno})") from None
    except UnicodeDecodeError as exc:
        raise PromptDatasetError(f"{path}: not UTF-8 text (byte {exc.start}); save it as UTF-8") from None
    if not isinstance(loaded, list):
        raise PromptDatasetError(f"{path}: a .json dataset must be a list of row objects ([{{...}}, ...]), got a "
                               f"{type(loaded).__name__}; one object per line is a .jsonl file")
    return [(f"{path}, row {i}", row) for i, row in enumerate(loaded)]


def _parquet_rows(path: Path) -> list[tuple[str, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise PromptDatasetError(f"{path}: reading Parquet needs pyarrow: pip install pyarrow") from None
    try:
        table = pq.read_table(path)
    except Exception as exc:  # pyarrow raises ArrowInvalid, OSError, ...: name the file
        raise PromptDatasetError(f"{path}: not a readable Parquet file ({type(exc).__name__}: {exc})") from None
    return [(f"{path}, row {i}", row) for i, row in enumerate(table.to_pylist())]


def _datasets_module(what: str) -> Any:
    try:
        import datasets
    except ImportError:
        raise PromptDatasetError(f"{what} needs the Hugging Face datasets package: pip install datasets") from None
    return datasets


def _disk_rows(path: Path, split: str, where: str) -> list[tuple[str, Any]]:
    datasets = _datasets_module(f"{where}: the directory {str(path)!r}")
    try:
        loaded = datasets.load_from_disk(str(path))
    except FileNotFoundError as exc:
        raise PromptDatasetError(f"{where}: {str(path)!r} is a directory but not one written by datasets' "
                               f"save_to_disk ({exc}); give a .jsonl/.json/.parquet file or such a directory") from None
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise PromptDatasetError(f"{where}: {str(path)!r} has the splits {sorted(loaded)}, not {split!r}; set the "
                                   "split option to one of them")
        loaded = loaded[split]
    label = f"{path} [{split}]"
    return [(f"{label}, row {i}", row) for i, row in enumerate(loaded)]


def _hub_rows(name: str, split: str, where: str) -> list[tuple[str, Any]]:
    datasets = _datasets_module(f"{where}: {name!r} is no local file or directory, and loading it from the hub")
    try:
        loaded = datasets.load_dataset(name, split=split)
    except Exception as exc:  # offline, unknown name, no such split: all end the same way for a user
        raise PromptDatasetError(
            f"{where}: {name!r} is no local file or directory, and loading it from the Hugging Face hub failed "
            f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); download it first (e.g. "
            f"`huggingface-cli download {name} --repo-type dataset --local-dir data/...`) and point the option at "
            "the .parquet/.jsonl file"
        ) from None
    return [(f"{name} [{split}], row {i}", row) for i, row in enumerate(loaded)]
