"""The dataset task's options and sources beyond the basic formats: numbers as answers, chat
messages in a file, metadata choice, split options, the bounded read validation does, the jsonl
task left as it was, and a hub name with no network."""

from __future__ import annotations

import json
import random
import re
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from streamrl.tasks import PromptDatasetError, get_task
from streamrl.tasks.base import Prompt
from streamrl.tasks.dataset import CHECK_ROWS, DatasetTask, check_dataset_task
from streamrl.tasks.files import read_rows
from streamrl.tasks.registry import TaskOptionError, check_task

GSM8K = [{"question": f"Sam has {i} pens and buys 2. How many now?",
          "answer": f"{i} + 2 = <<{i}+2={i + 2}>>{i + 2}\n#### {i + 2}"} for i in range(6)]


def _jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _parquet(path: Path, rows: list[dict[str, Any]]) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def _task(path: Path | str, **options: Any) -> DatasetTask:
    task = get_task("dataset", path=str(path), reward="digits-reverse", **options)
    assert isinstance(task, DatasetTask)
    return task


def test_gsm8k_parquet_with_question_as_the_prompt(tmp_path: Path) -> None:
    task = _task(_parquet(tmp_path / "train.parquet", GSM8K), prompt_field="question")
    assert task.train_size() == 6
    assert task.prompts[2] == Prompt(GSM8K[2]["question"], GSM8K[2]["answer"], {})
    assert task.prompts[2].answer.endswith("#### 4")
    assert task.name == "dataset:train.parquet"


def test_numbers_as_answers_become_text_in_every_format(tmp_path: Path) -> None:
    rows = [{"prompt": "1+1=", "answer": 2}, {"prompt": "half of 3", "answer": 1.5}]
    parquet = _task(_parquet(tmp_path / "n.parquet", rows))
    jsonl = _task(_jsonl(tmp_path / "n.jsonl", rows))
    assert [p.answer for p in parquet.prompts] == [p.answer for p in jsonl.prompts] == ["2", "1.5"]
    # a bool is no number here: it is refused, with the file and the row
    (tmp_path / "b.json").write_text(json.dumps([{"prompt": "1=", "answer": "1"}, {"prompt": "2=", "answer": True}]))
    with pytest.raises(PromptDatasetError, match=re.escape("b.json, row 1: field 'answer' must be a string, got bool")):
        _task(tmp_path / "b.json")


def test_the_jsonl_task_still_refuses_a_number(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "p.jsonl", [{"prompt": "1=", "answer": 1}])
    with pytest.raises(PromptDatasetError, match="line 1: field 'answer' must be a string, got int 1"):
        get_task("jsonl", path=str(path), reward="digits-reverse")


def test_default_metadata_keeps_scalars_and_drops_the_rest(tmp_path: Path) -> None:
    rows = [{"prompt": "p", "answer": "a", "level": 2, "score": 0.5, "ok": True, "note": None, "src": "x",
             "tags": ["t"], "extra": {"k": 1}}]
    assert _task(_jsonl(tmp_path / "m.jsonl", rows)).prompts[0].metadata == {
        "level": 2, "score": 0.5, "ok": True, "note": None, "src": "x"}
    chosen = _task(tmp_path / "m.jsonl", metadata_fields=["level", "tags"])
    assert chosen.prompts[0].metadata == {"level": 2, "tags": ["t"]}
    with pytest.raises(PromptDatasetError, match=re.escape("m.jsonl, line 1: metadata field(s) ['nope'] are missing")):
        _task(tmp_path / "m.jsonl", metadata_fields=["nope"])


def test_a_messages_column_is_a_chat_prompt(tmp_path: Path) -> None:
    rows = [{"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}],
             "answer": "4"}]
    p = _task(_parquet(tmp_path / "chat.parquet", rows)).prompts[0]
    assert p.text == "2+2?" and p.messages == rows[0]["prompt"]
    bad = [{"prompt": [{"role": "user"}], "answer": "4"}]
    with pytest.raises(PromptDatasetError, match=re.escape("bad.jsonl, line 1: field 'prompt': message 0 must be")):
        _task(_jsonl(tmp_path / "bad.jsonl", bad))


def test_row_fn_dict_with_a_numeric_answer_and_errors_name_the_row(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "g.jsonl", GSM8K)
    task = _task(path, row_fn="tests.tasks.test_dataset_options:final_number")
    assert task.prompts[1] == Prompt(GSM8K[1]["question"], "3", {"steps": 1})
    with pytest.raises(PromptDatasetError) as info:
        _task(path, row_fn="tests.tasks.test_dataset_options:fails_on_row_3")
    assert re.search(r"task\.options\.path: .*g\.jsonl, line 4: task\.options\.row_fn .* failed: KeyError", str(info.value))
    with pytest.raises(PromptDatasetError, match="must be 'module:function'"):
        _task(path, row_fn="no_colon")


def final_number(row: dict[str, Any]) -> dict[str, Any]:
    return {"prompt": row["question"], "answer": int(row["answer"].rsplit("####", 1)[1]), "steps": 1}


def fails_on_row_3(row: dict[str, Any]) -> str:
    if "3 pens" in row["question"]:
        raise KeyError("solution")
    return str(row["question"])


def test_split_options_pick_splits_only_where_there_are_some(tmp_path: Path) -> None:
    import datasets

    datasets.DatasetDict({"train": datasets.Dataset.from_list(GSM8K),
                          "validation": datasets.Dataset.from_list(GSM8K[:2])}).save_to_disk(str(tmp_path / "dd"))
    task = _task(tmp_path / "dd", split="validation", eval_split="train", prompt_field="question")
    assert task.train_size() == 2 and len(task.eval_prompts(None)) == 6
    assert task.eval_prompts(1)[0].text == GSM8K[0]["question"]  # file order, not shuffled
    assert task.eval_origins[5].endswith("dd [train], row 5") and task.eval_origins[5].startswith("task.options.eval_split")
    with pytest.raises(PromptDatasetError, match=r"has no eval split; set task\.options\.eval_path or eval_split"):
        _task(tmp_path / "dd", prompt_field="question").eval_prompts(3)
    one = _parquet(tmp_path / "train.parquet", GSM8K)
    with pytest.raises(PromptDatasetError, match=re.escape("task.options.eval_split: ") + ".*is a file.*give the split"):
        _task(one, eval_split="test", prompt_field="question")
    datasets.Dataset.from_list(GSM8K).save_to_disk(str(tmp_path / "single"))
    with pytest.raises(PromptDatasetError, match="holds one Dataset, not a DatasetDict"):
        _task(tmp_path / "single", eval_split="test", prompt_field="question")


def test_a_directory_not_from_save_to_disk_and_a_missing_path(tmp_path: Path) -> None:
    (tmp_path / "plain").mkdir()
    with pytest.raises(PromptDatasetError, match="not one written by datasets' save_to_disk"):
        _task(tmp_path / "plain")
    # a mistyped path is named as a path, not sent to the hub
    with pytest.raises(PromptDatasetError, match=re.escape(f"task.options.path: '{tmp_path}/nope.parquet' does not exist")):
        _task(tmp_path / "nope.parquet")
    with pytest.raises(PromptDatasetError, match=re.escape("task.options.eval_path: 'data/test.jsonl' does not exist")):
        _task(_jsonl(tmp_path / "p.jsonl", [{"prompt": "1=", "answer": "1"}]), eval_path="data/test.jsonl")


def test_a_hub_name_offline_says_streamrl_tried_the_hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Offline mode and an empty cache come from tests/tasks/conftest.py (set in the libraries'
    constants too, which they read at import)."""
    monkeypatch.chdir(tmp_path)  # "openai/gsm8k" is no local path here
    t0 = time.monotonic()
    with pytest.raises(PromptDatasetError) as info:
        _task("openai/gsm8k", config="main", prompt_field="question")
    message = str(info.value)
    assert message.startswith("task.options.path: 'openai/gsm8k' is no local file or directory")
    assert "tried it as a Hugging Face hub dataset" in message and "download it first" in message
    assert "hf download openai/gsm8k --repo-type dataset" in message
    assert "OfflineModeIsEnabled" in message  # refused by offline mode, not by a network that timed out
    assert time.monotonic() - t0 < 10


def test_options_with_wrong_types_name_the_option(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "p.jsonl", [{"prompt": "1=", "answer": "1"}])
    with pytest.raises(TaskOptionError, match="option shuffle must be true or false"):
        _task(path, shuffle="yes")
    with pytest.raises(TaskOptionError, match=re.escape("task.options.prompt_field")):
        _task(path, prompt_field=3)
    with pytest.raises(TaskOptionError, match="option split must be a non-empty string"):
        _task(path, split="")
    with pytest.raises(TaskOptionError, match="unexpected keyword argument 'prompt_column'"):
        _task(path, prompt_column="q")


def test_validation_reads_a_bounded_prefix_and_the_run_reads_all(tmp_path: Path) -> None:
    rows = [{"prompt": f"{i}=", "answer": str(i)} for i in range(CHECK_ROWS + 5)]
    rows.append({"prompt": 7, "answer": "7"})  # beyond the bound: the run's loader reports it
    path = _parquet(tmp_path / "big.parquet", rows[:-1])
    checked = check_dataset_task(path=str(path), reward="digits-reverse")
    assert checked.train_size() == CHECK_ROWS
    assert _task(path).train_size() == CHECK_ROWS + 5
    bad = _jsonl(tmp_path / "big.jsonl", rows)
    task = check_task("dataset", {"path": str(bad), "reward": "digits-reverse"})
    assert isinstance(task, DatasetTask) and task.train_size() == CHECK_ROWS
    with pytest.raises(PromptDatasetError, match=f"big.jsonl, line {CHECK_ROWS + 6}: field 'prompt'"):
        _task(bad)
    assert len(read_rows(str(path), limit=3)) == 3


def test_shuffled_epochs_depend_only_on_the_seed(tmp_path: Path) -> None:
    rows = [{"prompt": f"{i}=", "answer": str(i)} for i in range(7)]
    path = _parquet(tmp_path / "p.parquet", rows)
    a = [p.text for p in _task(path).make_prompts(random.Random(3), 21)]
    b = [p.text for p in _task(path).make_prompts(random.Random(3), 21)]
    c = [p.text for p in _task(path).make_prompts(random.Random(4), 21)]
    assert a == b and a != c
    for epoch in range(3):  # every row once per epoch, however the batches split it
        assert sorted(a[7 * epoch:7 * epoch + 7]) == sorted(r["prompt"] for r in rows)
    # the order does not depend on how many prompts each step asks for
    task, rng = _task(path), random.Random(3)
    assert [p.text for n in (2, 5, 3, 11) for p in task.make_prompts(rng, n)] == a


def test_dataset_paths_resolve_against_the_config_file_then_stay_hub_names(tmp_path: Path) -> None:
    from streamrl.config import load_config, task_options

    conf = tmp_path / "conf"
    (conf / "data").mkdir(parents=True)
    (conf / "data" / "train.jsonl").write_text('{"prompt": "1=", "answer": "1"}\n')
    (conf / "c.yaml").write_text("task:\n  name: dataset\n  options: {path: data/train.jsonl, eval_path: openai/gsm8k, "
                                 "reward: math}\n")
    options = task_options(load_config(conf / "c.yaml"))
    assert options["path"] == str(conf / "data" / "train.jsonl")  # found beside the config, whatever the cwd
    assert options["eval_path"] == "openai/gsm8k"  # no such file: left as given, a hub name
