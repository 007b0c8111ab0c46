"""The dataset task: every file format a user brings gives the same prompts; bad rows are named."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from streamrl.tasks import PromptDatasetError, get_task
from streamrl.tasks.base import Prompt
from streamrl.tasks.chat import ChatTemplateError, render_prompt
from streamrl.tasks.dataset import DatasetTask
from streamrl.tasks.registry import TaskOptionError

ROWS = [{"question": f"What is {i} + 1?", "answer": f"{i} + 1 = {i + 1}\n#### {i + 1}", "level": i % 3}
        for i in range(10)]


def write(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    match path.suffix:
        case ".jsonl":
            path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        case ".json":
            path.write_text(json.dumps(rows))
        case ".parquet":
            pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def gsm8k(path: str | Path, **options: object) -> DatasetTask:
    task = get_task("dataset", path=str(path), reward="math", prompt_field="question", **options)
    assert isinstance(task, DatasetTask)
    return task


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".parquet", "disk", "diskdict"])
def test_every_format_gives_the_same_prompts(tmp_path: Path, suffix: str) -> None:
    if suffix.startswith("disk"):
        import datasets

        ds = datasets.Dataset.from_list(ROWS)
        target = tmp_path / "saved"
        (datasets.DatasetDict({"train": ds, "test": ds.select(range(3))}) if suffix == "diskdict" else ds).save_to_disk(
            str(target))
    else:
        target = write(tmp_path / f"gsm8k{suffix}", ROWS)
    task = gsm8k(target)
    assert task.train_size() == 10
    assert task.prompts[3] == Prompt("What is 3 + 1?", "3 + 1 = 4\n#### 4", {"level": 0})
    assert not task.has_eval_split()


def test_eval_split_from_a_file_or_from_a_split_of_the_same_directory(tmp_path: Path) -> None:
    train, test = write(tmp_path / "train.parquet", ROWS), write(tmp_path / "test.parquet", ROWS[:4])
    task = gsm8k(train, eval_path=str(test))
    assert task.has_eval_split() and [p.text for p in task.eval_prompts(2)] == [r["question"] for r in ROWS[:2]]
    import datasets

    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS),
                          "test": datasets.Dataset.from_list(ROWS[7:])}).save_to_disk(str(tmp_path / "dd"))
    task = gsm8k(tmp_path / "dd", eval_split="test")
    assert task.train_size() == 10 and len(task.eval_prompts(None)) == 3
    with pytest.raises(PromptDatasetError, match=re.escape("has the splits ['test', 'train'], not 'dev'")):
        gsm8k(tmp_path / "dd", eval_split="dev")


def test_row_fn_gives_text_or_chat_messages_and_metadata_fields_choose(tmp_path: Path) -> None:
    path = write(tmp_path / "g.jsonl", ROWS)
    text = gsm8k(path, row_fn="tests.tasks.dataset_rows:question_text", metadata_fields=[])
    assert text.prompts[0] == Prompt("Q: What is 0 + 1?\nA:", ROWS[0]["answer"], {})
    chat = gsm8k(path, row_fn="tests.tasks.dataset_rows:as_chat")
    p = chat.prompts[5]
    assert p.text == "What is 5 + 1?" and p.answer == "6" and p.metadata == {"source": "gsm8k"}
    assert p.messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 5 + 1?"}]
    with pytest.raises(PromptDatasetError, match="must return a prompt string or a dict"):
        gsm8k(path, row_fn="tests.tasks.dataset_rows:broken")
    with pytest.raises(PromptDatasetError, match="has no callable 'nope'"):
        gsm8k(path, row_fn="tests.tasks.dataset_rows:nope")


def test_each_epoch_visits_every_row_once_in_a_seeded_order(tmp_path: Path) -> None:
    path = write(tmp_path / "g.parquet", ROWS)
    orders = []
    for _ in range(2):
        task = gsm8k(path)
        rng = random.Random(7)
        orders.append([p.text for p in task.make_prompts(rng, 20)])
    assert orders[0] == orders[1]  # the same seed, the same order
    first, second = orders[0][:10], orders[0][10:]
    assert sorted(first) == sorted(second) == sorted(r["question"] for r in ROWS)  # each epoch: every row once
    assert first != second  # reshuffled per epoch
    plain = gsm8k(path, shuffle=False)
    assert [p.text for p in plain.make_prompts(random.Random(7), 12)] == [r["question"] for r in ROWS + ROWS[:2]]


@pytest.mark.parametrize(
    ("name", "content", "needle"),
    [
        ("bad.jsonl", '{"question": "1?", "answer": "1"}\n{"question": "2?"\n', "bad.jsonl, line 2: not valid JSON"),
        ("bad.jsonl", '{"question": "1?", "answer": "1"}\n{"answer": "2"}\n',
         "bad.jsonl, line 2: field 'question' is missing"),
        ("bad.json", '[{"question": "1?", "answer": "1"}, {"question": "", "answer": "2"}]',
         "bad.json, row 1: field 'question' must be a non-empty string"),
        ("bad.json", '{"question": "1?"}', "a .json dataset must be a list of row objects"),
        ("bad.jsonl", '{"question": "1?", "answer": true}\n', "line 1: field 'answer' must be a string, got bool True"),
        ("empty.jsonl", "\n", "has no rows"),
        ("rows.csv", "question,answer\n", "has the extension '.csv'"),
        ("bad.parquet", "not parquet", "not a readable Parquet file"),
    ],
)
def test_bad_files_and_rows_name_the_file_and_row(tmp_path: Path, name: str, content: str, needle: str) -> None:
    (tmp_path / name).write_text(content)
    with pytest.raises(PromptDatasetError, match=re.escape(needle)):
        gsm8k(tmp_path / name)


def test_a_parquet_row_with_a_missing_value_is_named_by_row(tmp_path: Path) -> None:
    path = write(tmp_path / "g.parquet", [*ROWS[:4], {"question": None, "answer": "3", "level": 1}])
    with pytest.raises(PromptDatasetError, match=re.escape("g.parquet, row 4: field 'question' must be a non-empty")):
        gsm8k(path)


def test_a_hub_name_without_network_says_to_download(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # an empty cache: nothing to find offline
    with pytest.raises(PromptDatasetError, match="hf download nobody/no-such-dataset"):
        gsm8k("nobody/no-such-dataset")


def test_reward_option_is_checked(tmp_path: Path) -> None:
    path = write(tmp_path / "g.jsonl", ROWS)
    with pytest.raises(TaskOptionError, match="did you mean 'math'"):
        get_task("dataset", path=str(path), reward="maht", prompt_field="question")


class TemplateTokenizer:
    """What render_prompt needs of a tokenizer: the attribute and transformers' own rendering."""

    def __init__(self, template: str | None) -> None:
        from transformers import PreTrainedTokenizerFast

        from streamrl.models.tokenizer import build_char_tokenizer

        self.tok: PreTrainedTokenizerFast = build_char_tokenizer()
        self.tok.chat_template = template
        self.chat_template = template

    def apply_chat_template(self, *args: object, **kwargs: object) -> object:
        return self.tok.apply_chat_template(*args, **kwargs)


TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}<a>{% endif %}"


def test_chat_template_rendering_with_and_without_a_system_prompt() -> None:
    tok = TemplateTokenizer(TEMPLATE)
    p = Prompt("2+2?", "4")
    assert render_prompt(p, tok, chat_template=False, system_prompt="x") == "2+2?"
    assert render_prompt(p, tok, chat_template=True, system_prompt=None) == "<user>2+2?\n<a>"
    assert render_prompt(p, tok, chat_template=True, system_prompt="Box it.") == "<system>Box it.\n<user>2+2?\n<a>"
    own = Prompt("2+2?", "4", messages=[{"role": "system", "content": "Mine."}, {"role": "user", "content": "2+2?"}])
    assert render_prompt(own, tok, chat_template=True, system_prompt="Box it.") == "<system>Mine.\n<user>2+2?\n<a>"
    with pytest.raises(ChatTemplateError, match=re.escape("set task.chat_template: true")):
        render_prompt(own, tok, chat_template=False, system_prompt=None)
    with pytest.raises(ChatTemplateError, match="the tokenizer has no chat template"):
        render_prompt(p, TemplateTokenizer(None), chat_template=True, system_prompt=None)
