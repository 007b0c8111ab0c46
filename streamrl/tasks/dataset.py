"""Prompt datasets, and a task that serves them with a chosen reward.

The ``dataset`` task reads JSONL, JSON and Parquet files, ``datasets`` directories and hub
names (:mod:`streamrl.tasks.files`); ``jsonl`` reads JSONL files only, with stricter fields. A
row gives the prompt (``prompt_field``: text, or a list of chat messages), the reference answer
(``answer_field``: a string) and metadata handed to the reward function as keyword arguments;
or a ``row_fn`` maps it to those. Errors name the file, the row (or line) and the field.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import msgspec

from streamrl.tasks.base import RESERVED_FIELDS, BatchRewardMixin, Prompt, RewardFn, TaskOptionError, as_rng
from streamrl.tasks.files import PromptDatasetError, read_rows


def _row_to_prompt(row: object, where: str, prompt_field: str = "prompt", answer_field: str = "answer",
                   metadata_fields: list[str] | None = None, *, numbers_as_text: bool = False) -> Prompt:
    """A row as a Prompt: ``prompt_field`` (a non-empty string, or a list of chat messages),
    ``answer_field`` (a string; with ``numbers_as_text`` an int or float becomes its text) and the
    metadata (``metadata_fields``, or every other field whose value is a plain scalar)."""
    if not isinstance(row, dict):
        raise PromptDatasetError(f"{where}: a row must be a JSON object, got {type(row).__name__}; write "
                                 f'{{"{prompt_field}": "...", "{answer_field}": "..."}}')
    if prompt_field not in row:
        raise PromptDatasetError(f"{where}: field {prompt_field!r} is missing (each row needs {prompt_field!r} and "
                                 f"{answer_field!r}; the fields are {sorted(row)[:12]}: set prompt_field)")
    prompt, messages = row[prompt_field], None
    if isinstance(prompt, list):
        messages = _messages(prompt, f"{where}: field {prompt_field!r}")
        users = [m["content"] for m in messages if m["role"] == "user"]
        prompt = users[-1] if users else messages[-1]["content"]
    if not isinstance(prompt, str) or not prompt:
        raise PromptDatasetError(f"{where}: field {prompt_field!r} must be a non-empty string (or a list of chat "
                                 f"messages), got {type(prompt).__name__} {prompt!r}; write the prompt text in quotes")
    if answer_field not in row:
        raise PromptDatasetError(f"{where}: field {answer_field!r} is missing (use \"\" when the reward needs none; "
                                 "or set answer_field)")
    answer = row[answer_field]
    # the jsonl task refuses a number (its text is ambiguous: "01" read as 1); the dataset task takes
    # Parquet/datasets columns typed int or float as they are. A whole float is written as an int:
    # one float in a column makes pyarrow store every answer as a double (2 -> 2.0)
    if numbers_as_text and isinstance(answer, int | float) and not isinstance(answer, bool):
        answer = str(int(answer)) if isinstance(answer, float) and answer.is_integer() else str(answer)
    if not isinstance(answer, str):
        raise PromptDatasetError(
            f"{where}: field {answer_field!r} must be a string, got {type(answer).__name__} {answer!r}; "
            f"write it quoted, e.g. \"{answer}\""
        )
    if metadata_fields is None:
        metadata = {k: v for k, v in row.items() if k not in (prompt_field, answer_field)
                    and (v is None or isinstance(v, str | int | float | bool))}
    else:
        missing = [k for k in metadata_fields if k not in row]
        if missing:
            raise PromptDatasetError(f"{where}: metadata field(s) {missing} are missing (metadata_fields names them)")
        metadata = {k: row[k] for k in metadata_fields}
    clash = sorted(RESERVED_FIELDS & metadata.keys())
    if clash:
        raise PromptDatasetError(
            f"{where}: field {clash[0]!r} is reserved for the reward function's own arguments; rename it"
        )
    return Prompt(prompt, answer, metadata, messages)


def _messages(value: list[Any], where: str) -> list[dict[str, str]]:
    out = []
    for i, m in enumerate(value):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise PromptDatasetError(f"{where}: message {i} must be {{\"role\": \"...\", \"content\": \"...\"}} "
                                     f"with string values, got {m!r}")
        out.append({"role": m["role"], "content": m["content"]})
    if not out:
        raise PromptDatasetError(f"{where}: the list of chat messages is empty")
    return out


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
    """Prompts from a fixed list (a dataset's train split), scored by a given reward function.

    ``make_prompts`` walks the rows in a shuffled order, reshuffling at each epoch; the order
    depends only on the rng stream (``shuffle=False``: file order, every epoch). ``eval`` is the
    eval split, if any (the eval stage reads it).
    """

    def __init__(self, name: str, prompts: Sequence[Prompt], reward_fn: RewardFn, *,
                 eval_prompts: Sequence[Prompt] = (), shuffle: bool = True,
                 origins: Sequence[str] = (), eval_origins: Sequence[str] = ()) -> None:
        """``origins`` / ``eval_origins``: where each prompt was read (``file, row N``), for
        messages about it (validation of lengths, for one)."""
        if not prompts:
            raise PromptDatasetError(f"task {name!r} has no prompts")
        self.name = name
        self.prompts = list(prompts)
        self.eval = list(eval_prompts)
        self.origins = list(origins) or [f"row {i}" for i in range(len(self.prompts))]
        self.eval_origins = list(eval_origins) or [f"eval row {i}" for i in range(len(self.eval))]
        self.reward_fn = reward_fn
        self.shuffle = shuffle
        self._order: list[int] = []

    def train_size(self) -> int:
        """Rows of the train split (``algo.epochs`` counts passes over them)."""
        return len(self.prompts)

    def has_eval_split(self) -> bool:
        return bool(self.eval)

    def eval_prompts(self, limit: int | None = None) -> list[Prompt]:
        """The first ``limit`` rows of the eval split (all with None), in file order."""
        if not self.eval:
            raise PromptDatasetError(f"task {self.name!r} has no eval split; set task.options.eval_path or eval_split")
        return self.eval[:limit]

    def make_prompts(self, rng: random.Random | int, n: int) -> list[Prompt]:
        rng = as_rng(rng)
        out = []
        for _ in range(n):
            if not self._order:
                self._order = list(range(len(self.prompts)))
                if self.shuffle:
                    rng.shuffle(self._order)
                self._order.reverse()  # popped from the end: file order when not shuffled
            out.append(self.prompts[self._order.pop()])
        return out

    def reward(
        self, prompt: str, response: str, response_ids: Sequence[int], answer: str, **metadata: Any
    ) -> float | dict[str, float]:
        # a map of named scores stays a map: the score stage turns it into the one reward
        result = self.reward_fn(prompt, response, response_ids, answer, **metadata)
        return result if isinstance(result, dict) else float(result)


def load_row_fn(spec: str) -> Callable[[dict[str, Any]], Any]:
    """The ``row_fn`` option: a ``module:function`` mapping a row to a prompt."""
    from streamrl.runtime.pipeline import import_object

    try:
        return import_object(spec, "task.options.row_fn", form="module:function", must_call=True)  # type: ignore[no-any-return]
    except ValueError as exc:
        raise PromptDatasetError(str(exc)) from None


class DatasetOptions(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """How rows become prompts (``task.options`` of the ``dataset`` task, but ``reward``)."""

    prompt_field: str = "prompt"
    answer_field: str = "answer"
    metadata_fields: list[str] | None = None  # None: every other field with a plain scalar value
    row_fn: str | None = None  # "module:function": row dict -> prompt text, or {prompt, answer, ...}


def read_prompts(source: str, split: str, options: DatasetOptions, *, where: str, config: str | None = None,
                 limit: int | None = None, split_option: str | None = None) -> list[tuple[str, Prompt]]:
    """``(origin, Prompt)`` of the rows of ``source`` (the first ``limit`` when given); an origin is
    ``<where>: <file>, row N`` (``line N`` for JSONL), what messages about the row start with."""
    row_fn = load_row_fn(options.row_fn) if options.row_fn else None
    out = []
    for label, row in read_rows(source, split, where=where, config=config, limit=limit, split_option=split_option):
        at = f"{where}: {label}"
        if row_fn is not None:
            try:
                mapped = row_fn(dict(row) if isinstance(row, dict) else row)
            except Exception as exc:  # the user's code: any error, reported with the row it failed on
                raise PromptDatasetError(f"{at}: task.options.row_fn {options.row_fn!r} failed: "
                                         f"{type(exc).__name__}: {exc}") from None
            if isinstance(mapped, str):  # just the prompt: the answer still comes from answer_field
                if not isinstance(row, dict):
                    raise PromptDatasetError(f"{at}: a row must be an object with the field {options.answer_field!r} "
                                             f"when row_fn returns only the prompt, got {type(row).__name__}")
                row = {**row, options.prompt_field: mapped}
            elif isinstance(mapped, dict):
                out.append((at, _row_to_prompt(mapped, f"{at} (as row_fn returned it)", numbers_as_text=True)))
                continue
            else:
                raise PromptDatasetError(f"{at}: task.options.row_fn {options.row_fn!r} must return a prompt string "
                                         "or a dict {'prompt': str | [{'role': ..., 'content': ...}], 'answer': str, "
                                         f"...}}, got {type(mapped).__name__}")
        out.append((at, _row_to_prompt(row, at, options.prompt_field, options.answer_field, options.metadata_fields,
                                       numbers_as_text=True)))
    return out


def dataset_task(
    path: str,
    reward: str | dict[str, float] | RewardFn,
    *,
    split: str = "train",
    config: str | None = None,
    eval_path: str | None = None,
    eval_split: str | None = None,
    prompt_field: str = "prompt",
    answer_field: str = "answer",
    metadata_fields: list[str] | None = None,
    row_fn: str | None = None,
    shuffle: bool = True,
    name: str | None = None,
) -> DatasetTask:
    """The ``dataset`` task: prompts from ``path`` (a .jsonl / .json / .parquet file, a
    ``save_to_disk`` directory or a hub name, with its ``config``) and its ``split``; the eval rows
    from ``eval_path`` (a file; of a DatasetDict or hub name its ``eval_split``, default ``test``),
    or, with ``eval_split`` alone, that split of ``path``. ``reward`` goes to
    :func:`streamrl.tasks.registry.load_reward_fn` as given (a name, weights, or "module:function")."""
    return _dataset_task(path, reward, split=split, config=config, eval_path=eval_path, eval_split=eval_split,
                         prompt_field=prompt_field, answer_field=answer_field, metadata_fields=metadata_fields,
                         row_fn=row_fn, shuffle=shuffle, name=name)


def check_dataset_task(**options: Any) -> DatasetTask:
    """The ``dataset`` task as validation builds it before a run: every option checked, but only the
    first CHECK_ROWS rows of each split read (the source stage reads the rest, with the same messages)."""
    return _dataset_task(**options, limit=CHECK_ROWS)


def _dataset_task(path: str, reward: str | dict[str, float] | RewardFn, *, split: str = "train",
                  config: str | None = None, eval_path: str | None = None, eval_split: str | None = None,
                  prompt_field: str = "prompt", answer_field: str = "answer",
                  metadata_fields: list[str] | None = None, row_fn: str | None = None, shuffle: bool = True,
                  name: str | None = None, limit: int | None = None) -> DatasetTask:
    from streamrl.tasks.registry import load_reward_fn

    for option, value in (("path", path), ("split", split), ("config", config), ("eval_path", eval_path),
                          ("eval_split", eval_split), ("name", name)):
        if value is not None and (not isinstance(value, str) or not value):
            raise TaskOptionError(f"task 'dataset': option {option} must be a non-empty string, got {value!r}")
    if not isinstance(shuffle, bool):
        raise TaskOptionError(f"task 'dataset': option shuffle must be true or false, got {shuffle!r}")
    try:
        options = msgspec.convert({"prompt_field": prompt_field, "answer_field": answer_field,
                                   "metadata_fields": metadata_fields, "row_fn": row_fn}, DatasetOptions)
    except msgspec.ValidationError as exc:  # e.g. "Expected `str`, got `int` - at `$.prompt_field`"
        raise TaskOptionError(f"task 'dataset': {str(exc).replace('$.', 'task.options.')}") from None
    reward_fn = reward if callable(reward) else load_reward_fn(reward)
    # a split other than the default must exist to be picked: a file has none ("split: test" is a mistake)
    train = read_prompts(path, split, options, where="task.options.path", config=config, limit=limit,
                         split_option="split" if split != "train" else None)
    evals: list[tuple[str, Prompt]] = []
    if eval_path is not None or eval_split is not None:
        source = eval_path if eval_path is not None else path
        where = "task.options.eval_path" if eval_path is not None else "task.options.eval_split"
        evals = read_prompts(source, eval_split or "test", options, where=where, config=config, limit=limit,
                             split_option="eval_split" if eval_path is None else None)
    return DatasetTask(name or f"dataset:{Path(path).name}", [p for _, p in train], reward_fn,
                       eval_prompts=[p for _, p in evals], shuffle=shuffle,
                       origins=[at for at, _ in train], eval_origins=[at for at, _ in evals])
