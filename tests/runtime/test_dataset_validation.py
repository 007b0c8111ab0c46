"""Validation before a run (``load_pipeline(load_config(...))``) of the dataset task: its rows,
their lengths after the chat template (train and eval split), and chat_template's need for a
model.path tokenizer; each a ConfigError naming the option, the file and the row."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from streamrl.config import ConfigError, load_config
from streamrl.runtime.prerun import load_pipeline

GRPO = Path(__file__).resolve().parents[2] / "pipelines" / "grpo.yaml"
POSITIONS = 64
# every turn as <role>content|, then the assistant header: 9 characters for a user turn + header
TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}|{% endfor %}"
            "{% if add_generation_prompt %}<a>{% endif %}")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny save_pretrained directory (64 positions) whose character tokenizer has a chat template."""
    from streamrl.models.build import TinyModelSpec, build_model, save_pretrained_dir
    from streamrl.models.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer("<>|.abcdefghijklmnopqrstuvwxyzA")  # the template's characters: one token each
    model = build_model(TinyModelSpec(hidden=16, layers=1, heads=2, intermediate=32, max_positions=POSITIONS), tok)
    tok.chat_template = TEMPLATE
    return save_pretrained_dir(model, tok, tmp_path_factory.mktemp("model") / "tiny")


def _config(tmp: Path, options: dict[str, Any], **over: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {"pipeline": str(GRPO), "output": {"run_dir": str(tmp / "runs"), "progress": "none"},
                           "task": {"name": "dataset", "options": {"reward": "digits-reverse", **options}},
                           "algo": {"max_new_tokens": 8}}
    for key, value in over.items():
        section = copy.deepcopy(cfg.get(key, {}))
        section.update(value)
        cfg[key] = section
    return cfg


def _parquet(path: Path, rows: list[dict[str, Any]]) -> str:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def _validate(cfg: dict[str, Any]) -> None:
    load_pipeline(load_config(cfg))


def _error(cfg: dict[str, Any]) -> str:
    with pytest.raises(ConfigError) as info:
        _validate(cfg)
    return str(info.value)


ROWS = [{"question": f"{i}{i}=", "answer": str(i)} for i in range(5)]


def test_a_good_dataset_config_validates(tmp_path: Path, model_dir: Path) -> None:
    train = _parquet(tmp_path / "train.parquet", ROWS)
    _validate(_config(tmp_path, {"path": train, "prompt_field": "question", "eval_path": train}))
    _validate(_config(tmp_path, {"path": train, "prompt_field": "question"}, model={"path": str(model_dir)},
                      task={"chat_template": True, "system_prompt": "Add."}))


def test_a_bad_row_names_the_option_the_file_and_the_row(tmp_path: Path) -> None:
    path = _parquet(tmp_path / "train.parquet", [*ROWS, {"question": "9=", "answer": None}])
    message = _error(_config(tmp_path, {"path": path, "prompt_field": "question"}))
    assert message.startswith(f"run config: task.options.path: {path}, row 5: field 'answer' must be a string")
    eval_file = tmp_path / "test.jsonl"
    eval_file.write_text(json.dumps({"question": "1="}) + "\n")
    message = _error(_config(tmp_path, {"path": _parquet(tmp_path / "ok.parquet", ROWS), "prompt_field": "question",
                                        "eval_path": str(eval_file)}))
    assert message.startswith(f"run config: task.options.eval_path: {eval_file}, line 1: field 'answer' is missing")


def test_chat_template_needs_a_model_path_tokenizer(tmp_path: Path) -> None:
    path = _parquet(tmp_path / "train.parquet", ROWS)
    message = _error(_config(tmp_path, {"path": path, "prompt_field": "question"}, task={"chat_template": True}))
    assert "task.chat_template: true needs a tokenizer with a chat template" in message
    assert "built-in character tokenizer" in message and "model.path" in message


def test_prompt_lengths_count_the_chat_template_and_the_eval_split(tmp_path: Path, model_dir: Path) -> None:
    # 40 characters: 48 with max_new_tokens 8 fits 64 positions as text, not with the template and
    # a system prompt ("<system>Add.|" + "<user>" + "|<a>" = 23 more)
    long = [{"question": "1" * 39 + "=", "answer": "1"}]
    train = _parquet(tmp_path / "train.parquet", ROWS + long)
    plain = _config(tmp_path, {"path": train, "prompt_field": "question"}, model={"path": str(model_dir)})
    _validate(plain)
    chat = _config(tmp_path, {"path": train, "prompt_field": "question"}, model={"path": str(model_dir)},
                   task={"chat_template": True, "system_prompt": "Add."})
    message = _error(chat)
    assert message.startswith(f"run config: task.options.path: {train}, row 5: the prompt is 63 tokens with the "
                              "chat template; with algo.max_new_tokens=8 that is 71 > the model's 64 positions")
    assert "lower algo.max_new_tokens to 1 or less" in message
    short = _parquet(tmp_path / "short.parquet", ROWS)
    evals = _parquet(tmp_path / "eval.parquet", ROWS[:2] + long)
    message = _error(_config(tmp_path, {"path": short, "prompt_field": "question", "eval_path": evals},
                             model={"path": str(model_dir)}, task={"chat_template": True, "system_prompt": "Add."}))
    assert message.startswith(f"run config: task.options.eval_path: {evals}, row 2: the prompt is 63 tokens")


def test_chat_messages_need_the_template_turned_on(tmp_path: Path, model_dir: Path) -> None:
    rows = [{"prompt": [{"role": "user", "content": "12="}], "answer": "21"}]
    path = _parquet(tmp_path / "chat.parquet", rows)
    message = _error(_config(tmp_path, {"path": path}, model={"path": str(model_dir)}))
    assert message.startswith(f"run config: task.options.path: {path}, row 0: the prompt is a list of chat messages")
    assert "set task.chat_template: true" in message
    _validate(_config(tmp_path, {"path": path}, model={"path": str(model_dir)}, task={"chat_template": True}))


def test_unknown_characters_for_the_built_in_tokenizer_are_named(tmp_path: Path) -> None:
    path = _parquet(tmp_path / "train.parquet", [*ROWS, {"question": "what is 1+1?", "answer": "2"}])
    message = _error(_config(tmp_path, {"path": path, "prompt_field": "question"}))
    assert message.startswith(f"run config: task.options.path: {path}, row 5: the prompt has characters")
    assert "model.extra_chars" in message


def test_a_row_fn_that_cannot_be_imported_names_the_option(tmp_path: Path) -> None:
    path = _parquet(tmp_path / "train.parquet", ROWS)
    message = _error(_config(tmp_path, {"path": path, "row_fn": "no_such_module_xyz:f"}))
    assert message.startswith("run config: task.options.row_fn 'no_such_module_xyz:f': cannot import module")


def test_a_missing_model_and_a_missing_dataset_are_reported_together(tmp_path: Path) -> None:
    """A first run of a recipe before anything was downloaded: both problems at once, each with its
    key, and the model's hint naming the path as a --local-dir rather than as a hub id to fetch."""
    from streamrl.runtime.prerun import resolve_run_length

    cfg = load_config({"pipeline": str(GRPO), "model": {"path": "models/not-downloaded"},
                       "algo": {"epochs": 1, "group_size": 2},
                       "task": {"name": "dataset", "options": {"path": str(tmp_path / "data" / "train.parquet"),
                                                               "reward": "digits-reverse"}}})
    with pytest.raises(ConfigError) as info:
        load_pipeline(resolve_run_length(cfg))
    message = str(info.value)
    assert message.startswith("2 problems:"), message
    assert "model.path 'models/not-downloaded'" in message and "--local-dir models/not-downloaded" in message
    assert "task.options.path" in message and "train.parquet" in message and "does not exist" in message
