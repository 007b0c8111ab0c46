"""row_fn examples for tests/tasks/test_datasets.py (imported by module:function, as a user's would be)."""

from __future__ import annotations

from typing import Any


def question_text(row: dict[str, Any]) -> str:
    return f"Q: {row['question']}\nA:"


def as_chat(row: dict[str, Any]) -> dict[str, Any]:
    return {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": row["question"]}],
            "answer": row["answer"].rsplit("####", 1)[-1].strip(), "source": "gsm8k"}


def broken(row: dict[str, Any]) -> Any:
    return 42
