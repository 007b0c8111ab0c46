"""Rows of a dataset, from wherever a user keeps it: JSONL, JSON or Parquet files, a Hugging Face
``datasets`` directory (``save_to_disk``), or a hub name where there is network.

Every row comes with where it is (``file, line 7`` for JSONL: 1-based lines, as an editor shows
them; ``file, row 7`` for the others: 0-based, as pandas, pyarrow and ``datasets`` index them), so
an error about it names the file and the row. ``datasets`` is imported only for a directory or a
hub name.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from itertools import islice
from pathlib import Path
from typing import Any

SUFFIXES = (".jsonl", ".json", ".parquet")

# What a hub dataset name looks like ("gsm8k", "openai/gsm8k"): anything else that is not on disk
# is a mistyped path, and is reported as one instead of being sent to the hub.
_HUB_NAME = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")

# Rows per Parquet batch when only the first rows are wanted (validation reads a bounded prefix).
_PARQUET_BATCH = 4096


class PromptDatasetError(ValueError):
    """A prompt file or row is invalid; the message says where and what to fix."""


def read_rows(source: str, split: str = "train", *, where: str = "task.options.path", config: str | None = None,
              limit: int | None = None, split_option: str | None = None) -> list[tuple[str, Any]]:
    """``(label, row)`` of the rows of ``source`` (the first ``limit`` when given): a file path, a
    ``save_to_disk`` directory (a Dataset, or a DatasetDict whose ``split`` is read) or a hub name
    (``owner/name``, with ``config``). A label is ``file, line N`` (JSONL, 1-based) or ``file, row N``
    (0-based); errors start with ``where``, the option that named the source. ``split_option``: the
    option that chose ``split`` when it must pick one (a file, or a single Dataset, has none to pick)."""
    try:
        rows = _read(source, split, where, config, limit, split_option)
    except PromptDatasetError as exc:
        message = str(exc)
        raise PromptDatasetError(message if message.startswith(where) else f"{where}: {message}") from None
    if not rows:
        raise PromptDatasetError(f"{where}: {source!r} has no rows; add some")
    return rows


def _read(source: str, split: str, where: str, config: str | None, limit: int | None,
          split_option: str | None) -> list[tuple[str, Any]]:
    path = Path(source).expanduser()
    if path.is_file() and split_option is not None:
        raise PromptDatasetError(f"{str(path)!r} is a file, which has no splits to pick {split_option}: {split!r} "
                                 "from; give the split's own file instead (eval_path for the eval rows)")
    if path.is_file():
        suffix = path.suffix.lower()
        if suffix == ".jsonl":
            return list(islice(_jsonl_rows(path), limit))
        if suffix == ".json":
            return _json_rows(path)[:limit]
        if suffix == ".parquet":
            return _parquet_rows(path, limit)
        raise PromptDatasetError(f"{str(path)!r} has the extension {path.suffix or '(none)'!r}; give a "
                                 f"{', '.join(SUFFIXES)} file or a datasets save_to_disk directory")
    if path.is_dir():
        return _disk_rows(path, split, limit, split_option)
    if path.exists():
        raise PromptDatasetError(f"{str(path)!r} is neither a file nor a directory")
    if path.suffix.lower() in SUFFIXES or not _HUB_NAME.fullmatch(source):
        raise PromptDatasetError(f"{str(path)!r} does not exist (a relative path is looked for beside the run "
                                 "config, then in the current directory); check the path")
    return _hub_rows(source, split, config, limit)


def _jsonl_rows(path: Path) -> Iterator[tuple[str, Any]]:
    try:
        with path.open(encoding="utf-8") as f:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    yield f"{path}, line {lineno}", json.loads(line)
                except json.JSONDecodeError as exc:
                    raise PromptDatasetError(f"{path}, line {lineno}: not valid JSON ({exc.msg} at column "
                                             f"{exc.colno}); each line must be one JSON object") from None
    except UnicodeDecodeError as exc:
        raise PromptDatasetError(f"{path}: not UTF-8 text (byte {exc.start}); save it as UTF-8") from None


def _json_rows(path: Path) -> list[tuple[str, Any]]:
    try:
        loaded = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise PromptDatasetError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno}, column "
                                 f"{exc.colno})") from None
    except UnicodeDecodeError as exc:
        raise PromptDatasetError(f"{path}: not UTF-8 text (byte {exc.start}); save it as UTF-8") from None
    if not isinstance(loaded, list):
        raise PromptDatasetError(f"{path}: a .json dataset must be a list of row objects at the top level ([{{...}}, ...]), "
                                 f"got a {type(loaded).__name__}; with one object per line it is a .jsonl file")
    return [(f"{path}, row {i}", row) for i, row in enumerate(loaded)]


def _parquet_rows(path: Path, limit: int | None) -> list[tuple[str, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise PromptDatasetError(f"{path}: reading Parquet needs pyarrow: pip install pyarrow") from None
    try:
        if limit is None:
            rows = pq.read_table(path).to_pylist()
        else:  # the first rows only: read batches until there are enough
            rows = []
            for batch in pq.ParquetFile(path).iter_batches(batch_size=min(limit, _PARQUET_BATCH) or 1):
                rows.extend(batch.to_pylist())
                if len(rows) >= limit:
                    break
            rows = rows[:limit]
    except Exception as exc:  # pyarrow raises ArrowInvalid, OSError, ...: name the file
        raise PromptDatasetError(f"{path}: not a readable Parquet file ({type(exc).__name__}: {exc})") from None
    return [(f"{path}, row {i}", row) for i, row in enumerate(rows)]


def _datasets_module(what: str) -> Any:
    try:
        import datasets
    except ImportError:
        raise PromptDatasetError(f"{what} needs the Hugging Face datasets package: pip install datasets") from None
    return datasets


def _disk_rows(path: Path, split: str, limit: int | None, split_option: str | None) -> list[tuple[str, Any]]:
    datasets = _datasets_module(f"the directory {str(path)!r}")
    try:
        loaded = datasets.load_from_disk(str(path))
    except FileNotFoundError as exc:
        raise PromptDatasetError(f"{str(path)!r} is a directory but not one written by datasets' save_to_disk "
                                 f"({exc}); give a .jsonl/.json/.parquet file or such a directory") from None
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise PromptDatasetError(f"{str(path)!r} has the splits {sorted(loaded)}, not {split!r}; set the split "
                                     "option (split, or eval_split for the eval rows) to one of them")
        loaded = loaded[split]
    elif split_option is not None:
        raise PromptDatasetError(f"{str(path)!r} holds one Dataset, not a DatasetDict, so it has no splits to pick "
                                 f"{split_option}: {split!r} from; save the splits as a DatasetDict, or give eval_path")
    else:
        split = ""  # a single Dataset: no split to name in the labels
    if limit is not None and limit < len(loaded):
        loaded = loaded.select(range(limit))
    label = f"{path} [{split}]" if split else str(path)
    return [(f"{label}, row {i}", row) for i, row in enumerate(loaded)]


def _hub_rows(name: str, split: str, config: str | None, limit: int | None) -> list[tuple[str, Any]]:
    datasets = _datasets_module(f"{name!r} is no local file or directory, and loading it from the hub")
    try:
        loaded = datasets.load_dataset(name, config, split=split)
    except Exception as exc:  # offline, unknown name, no such split: all end the same way for a user
        first = str(exc).splitlines()[0] if str(exc) else ""
        local_dir = f"data/{name.rsplit('/', 1)[-1]}"
        raise PromptDatasetError(
            f"{name!r} is no local file or directory (relative paths resolve against the config file's directory, "
            f"then the current one), so streamrl tried it as a Hugging Face hub dataset, which failed "
            f"({type(exc).__name__}: {first}). If it is a local path, check it; if it is a hub dataset, download it "
            f"first (`hf download {name} --repo-type dataset --local-dir {local_dir}`) and point the option at "
            "one of its .parquet/.jsonl files"
        ) from None
    if limit is not None and limit < len(loaded):
        loaded = loaded.select(range(limit))
    return [(f"{name} [{split}], row {i}", row) for i, row in enumerate(loaded)]
