"""Prompt datasets from JSONL files, and a task that serves them with a chosen reward.

One row per line: ``{"prompt": "...", "answer": "...", <metadata fields>...}``. ``prompt`` is a
non-empty string, ``answer`` a string; every other field is metadata handed to the reward
function as keyword arguments. Errors name the file, the line and the field.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from streamrl.tasks.base import RESERVED_FIELDS, BatchRewardMixin, Prompt, RewardFn, as_rng


class PromptDatasetError(ValueError):
    """A prompt file or row is invalid; the message says where and what to fix."""


def _row_to_prompt(row: object, where: str) -> Prompt:
    if not isinstance(row, dict):
        raise PromptDatasetError(f"{where}: a row must be a JSON object, got {type(row).__name__}; write "
                                 '{"prompt": "...", "answer": "..."}')
    if "prompt" not in row:
        raise PromptDatasetError(f"{where}: field 'prompt' is missing (each row needs \"prompt\" and \"answer\")")
    prompt = row["prompt"]
    if not isinstance(prompt, str) or not prompt:
        raise PromptDatasetError(f"{where}: field 'prompt' must be a non-empty string, got "
                                 f"{type(prompt).__name__} {prompt!r}; write the prompt text in quotes")
    if "answer" not in row:
        raise PromptDatasetError(f"{where}: field 'answer' is missing (use \"\" when the reward needs none)")
    answer = row["answer"]
    if not isinstance(answer, str):
        raise PromptDatasetError(
            f"{where}: field 'answer' must be a string, got {type(answer).__name__} {answer!r}; "
            f"write it quoted, e.g. \"{answer}\""
        )
    metadata = {k: v for k, v in row.items() if k not in ("prompt", "answer")}
    clash = sorted(RESERVED_FIELDS & metadata.keys())
    if clash:
        raise PromptDatasetError(
            f"{where}: field {clash[0]!r} is reserved for the reward function's own arguments; rename it"
        )
    return Prompt(prompt, answer, metadata)


# What validation reads of a prompt file before a run: all of it up to this size, else the first
# CHECK_ROWS rows (the rest is checked when the source stage loads it, with the same messages).
CHECK_BYTES = 4 * 2**20
CHECK_ROWS = 20_000


def iter_prompts_jsonl(path: str | Path, max_rows: int | None = None) -> Iterator[tuple[int, Prompt]]:
    """``(line number, Prompt)`` of each row of a JSONL prompt file (1-based lines; blank lines are
    skipped), validated as they are read; stops after ``max_rows`` rows when given."""
    path = Path(path)
    if not path.exists():
        raise PromptDatasetError(f"prompt file {str(path)!r} does not exist; check task.options.path")
    if not path.is_file():
        raise PromptDatasetError(f"prompt file {str(path)!r} is not a file; task.options.path must name a "
                                 ".jsonl file")
    rows = 0
    try:
        with path.open(encoding="utf-8") as f:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                if max_rows is not None and rows >= max_rows:
                    return
                where = f"{path}, line {lineno}"
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise PromptDatasetError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno}); each line "
                                             'must be one JSON object like {"prompt": "...", "answer": "..."}') from None
                rows += 1
                yield lineno, _row_to_prompt(row, where)
    except UnicodeDecodeError as exc:
        raise PromptDatasetError(f"prompt file {str(path)!r} is not UTF-8 text (byte {exc.start}); save it as "
                                 "UTF-8") from None
    except OSError as exc:
        raise PromptDatasetError(f"prompt file {str(path)!r} cannot be read: {exc}") from None
    if rows == 0:
        raise PromptDatasetError(f"prompt file {str(path)!r} has no rows; add one JSON object per line")


def load_prompts_jsonl(path: str | Path) -> list[Prompt]:
    """Read and validate every row of a JSONL prompt file (blank lines are skipped)."""
    return [prompt for _, prompt in iter_prompts_jsonl(path)]


def check_prompts_jsonl(path: str | Path, max_bytes: int = CHECK_BYTES,
                        max_rows: int = CHECK_ROWS) -> tuple[list[tuple[int, Prompt]], bool]:
    """The rows validation checks before a run, bounded in cost: every row of a file up to
    ``max_bytes``, else the first ``max_rows``. Returns ``(rows, whole file checked)``."""
    p = Path(path)
    small = p.is_file() and p.stat().st_size <= max_bytes
    rows = list(iter_prompts_jsonl(p, None if small else max_rows))
    return rows, small


class DatasetTask(BatchRewardMixin):
    """Prompts from a fixed list (e.g. a JSONL file), scored by a given reward function.

    ``make_prompts`` walks the rows in a shuffled order, reshuffling at each epoch; the order
    depends only on the rng stream.
    """

    def __init__(self, name: str, prompts: Sequence[Prompt], reward_fn: RewardFn) -> None:
        if not prompts:
            raise PromptDatasetError(f"task {name!r} has no prompts")
        self.name = name
        self.prompts = list(prompts)
        self.reward_fn = reward_fn
        self._order: list[int] = []

    def make_prompts(self, rng: random.Random | int, n: int) -> list[Prompt]:
        rng = as_rng(rng)
        out = []
        for _ in range(n):
            if not self._order:
                self._order = list(range(len(self.prompts)))
                rng.shuffle(self._order)
            out.append(self.prompts[self._order.pop()])
        return out

    def reward(
        self, prompt: str, response: str, response_ids: Sequence[int], answer: str, **metadata: Any
    ) -> float:
        return float(self.reward_fn(prompt, response, response_ids, answer, **metadata))
