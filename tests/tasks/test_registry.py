"""Task registry and JSONL prompt datasets: lookups, options, row validation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from streamrl.tasks import (
    DatasetTask,
    Prompt,
    PromptDatasetError,
    TaskOptionError,
    UnknownTaskError,
    get_task,
    load_prompts_jsonl,
    register_task,
    task_names,
)


def test_unknown_task_suggests_close_names() -> None:
    with pytest.raises(UnknownTaskError, match="did you mean 'digits-max'"):
        get_task("digit-max")
    with pytest.raises(UnknownTaskError, match="known tasks: dataset, digits-calc, digits-last"):
        get_task("zzz")


def test_bad_option_lists_the_accepted_ones() -> None:
    with pytest.raises(TaskOptionError, match=r"accepted options: \['min_digits', 'max_digits', 'tokenizer'\]"):
        get_task("digits-reverse", n_digits=3)
    with pytest.raises(ValueError, match="min_digits <= max_digits"):
        get_task("digits-reverse", min_digits=5, max_digits=2)


def test_register_task() -> None:
    register_task("test-constant", lambda: DatasetTask("test-constant", [Prompt("a", "b")], lambda *a, **k: 0.5))
    assert "test-constant" in task_names()
    assert get_task("test-constant").reward("a", "x", [], "b") == 0.5
    with pytest.raises(ValueError, match="already registered"):
        register_task("test-constant", lambda: None)  # type: ignore[arg-type,return-value]


def _write(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


def test_jsonl_rows_and_metadata(tmp_path: Path) -> None:
    f = _write(tmp_path / "p.jsonl", [
        json.dumps({"prompt": "12=", "answer": "21", "level": 1}),
        "",
        json.dumps({"prompt": "345=", "answer": "543"}),
    ])
    rows = load_prompts_jsonl(f)
    assert rows == [Prompt("12=", "21", {"level": 1}), Prompt("345=", "543", {})]


def reward_len(prompt: str, response: str, response_ids: list[int], answer: str, **metadata: object) -> float:
    return float(len(response) + int(metadata.get("level", 0)))  # type: ignore[call-overload]


def test_jsonl_task_with_builtin_or_imported_reward(tmp_path: Path) -> None:
    f = _write(tmp_path / "p.jsonl", [json.dumps({"prompt": f"{i}{i}=", "answer": f"{i}{i}", "level": i})
                                      for i in range(5)])
    task = get_task("jsonl", path=str(f), reward="digits-reverse")
    assert task.name == "jsonl:p.jsonl"
    assert task.reward("11=", "", [4, 4, 1], "11") == 1.0  # "11" + EOS under the char tokenizer
    seen = task.make_prompts(0, 10)
    assert sorted(p.text for p in seen[:5]) == sorted(f"{i}{i}=" for i in range(5))  # one epoch = every row once
    assert sorted(p.text for p in seen[5:]) == sorted(f"{i}{i}=" for i in range(5))
    mine = get_task("jsonl", path=str(f), reward=f"{__name__}:reward_len")
    assert mine.reward_batch(["11="], ["abc"], [[]], ["11"], [{"level": 2}]) == [5.0]
    with pytest.raises(TaskOptionError, match="no callable 'nope'"):
        get_task("jsonl", path=str(f), reward=f"{__name__}:nope")


@pytest.mark.parametrize(
    ("line", "needle"),
    [
        ('{"prompt": "1=", "answer": "1"', "line 2: not valid JSON"),
        ('["1=", "1"]', "line 2: a row must be a JSON object"),
        ('{"answer": "1"}', "line 2: field 'prompt' is missing"),
        ('{"prompt": "", "answer": "1"}', "line 2: field 'prompt' must be a non-empty string"),
        ('{"prompt": "1="}', "line 2: field 'answer' is missing"),
        ('{"prompt": "1=", "answer": 1}', "line 2: field 'answer' must be a string, got int 1"),
        ('{"prompt": "1=", "answer": "1", "response": "x"}', "line 2: field 'response' is reserved"),
    ],
)
def test_jsonl_errors_name_file_line_and_field(tmp_path: Path, line: str, needle: str) -> None:
    f = _write(tmp_path / "bad.jsonl", [json.dumps({"prompt": "0=", "answer": "0"}), line])
    with pytest.raises(PromptDatasetError) as info:
        load_prompts_jsonl(f)
    assert str(f) in str(info.value) and needle in str(info.value)


def test_jsonl_missing_or_empty_file(tmp_path: Path) -> None:
    with pytest.raises(PromptDatasetError, match="does not exist"):
        load_prompts_jsonl(tmp_path / "none.jsonl")
    with pytest.raises(PromptDatasetError, match="has no rows"):
        load_prompts_jsonl(_write(tmp_path / "empty.jsonl", [""]))
