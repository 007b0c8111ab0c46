"""Digit tasks: same prompts and scores as the TRL baseline, scoring edge cases."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import random
import sys
import types
from pathlib import Path

import pytest

from streamrl.models.tokenizer import build_char_tokenizer
from streamrl.tasks import get_task, positional_score

# The reference baseline script is not part of the repository: STREAMRL_TRL_BASELINE names it where
# a machine has it (the comparison skips elsewhere).
_BASELINE_ENV = os.environ.get("STREAMRL_TRL_BASELINE")
BASELINE = Path(_BASELINE_ENV) if _BASELINE_ENV else None
EOS = 1
TOK = build_char_tokenizer()


def _ids(text: str) -> list[int]:
    return TOK(text)["input_ids"]


def _baseline(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    # make_dataset imports datasets.Dataset when called; a stand-in keeps the test free of that package.
    fake = types.ModuleType("datasets")
    fake.Dataset = types.SimpleNamespace(from_dict=lambda d: d)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "datasets", fake)
    assert BASELINE is not None  # the caller is skipped without it
    spec = importlib.util.spec_from_file_location("grpo_trl_baseline", BASELINE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(BASELINE is None or not BASELINE.is_file(),
                    reason="set STREAMRL_TRL_BASELINE to the reference TRL baseline script (grpo_trl.py)")
@pytest.mark.parametrize(
    ("name", "options", "trl_task", "trl_kwargs"),
    [
        ("digits-max", {}, "max", {}),
        ("digits-sum", {}, "sum", {}),
        ("digits-last", {"n_digits": 4}, "last", {"n_digits": 4}),
        ("digits-reverse", {"min_digits": 2, "max_digits": 24}, "reverse", {"n_digits": 24, "min_digits": 2}),
    ],
)
def test_prompts_and_rewards_match_the_baseline(
    name: str, options: dict, trl_task: str, trl_kwargs: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    baseline = _baseline(monkeypatch)
    theirs = baseline.make_dataset(50, 7, trl_task, **trl_kwargs)
    task = get_task(name, **options)
    ours = task.make_prompts(7, 50)
    assert [p.text for p in ours] == theirs["prompt"]
    assert [p.answer for p in ours] == theirs["answer"]
    # Scores on random completions, EOS anywhere, unknown tokens, empty ones.
    rng = random.Random(0)
    completions = [[rng.randrange(15) for _ in range(rng.randrange(0, 8))] for _ in range(50)]
    completions[0] = []
    completions[1] = [EOS]
    recorder = baseline.Recorder(TOK, trl_task)
    nonempty = [i for i, c in enumerate(completions) if c or trl_task == "reverse"]
    expected = recorder.reward_fn([], [], [completions[i] for i in nonempty], [ours[i].answer for i in nonempty])
    got = task.reward_batch(
        [ours[i].text for i in nonempty], [""] * len(nonempty), [completions[i] for i in nonempty],
        [ours[i].answer for i in nonempty], [ours[i].metadata for i in nonempty],
    )
    assert got == expected


# The reference TRL baseline's prompts, answers and scores, fingerprinted: sha256 of the JSON of
# {"prompts", "answers", "rewards"} (keys sorted) for make_dataset(50, seed 7) and the 50 completions
# below, recorded from the reference script on 2026-11-23 (the test above compares live where it is
# available). They make the check run on every machine, without the script.
BASELINE_FINGERPRINTS = {
    "digits-max": "7469333337c0151f74c2d8349bee5e47d6dcbbf590695eb5b3f5bd0dfd78c3b8",
    "digits-sum": "40c6f314610eaec81aabdff7c466d0384855410c9f0095e93d525945ca283006",
    "digits-last": "d9d2eca2f5a17fd1a507bb511e8f71de8ccfb4c0c153df82984e61077f7e8ab0",
    "digits-reverse": "e4001e0df238be4bd2d23169cbe5d6a3fdf0ae77f2cffa21f30adbb196251557",
}
TASK_OPTIONS = {"digits-max": {}, "digits-sum": {}, "digits-last": {"n_digits": 4},
                "digits-reverse": {"min_digits": 2, "max_digits": 24}}


@pytest.mark.parametrize("name", sorted(BASELINE_FINGERPRINTS))
def test_prompts_and_rewards_match_the_baseline_fingerprint(name: str) -> None:
    task = get_task(name, **TASK_OPTIONS[name])
    ours = task.make_prompts(7, 50)
    rng = random.Random(0)
    completions = [[rng.randrange(15) for _ in range(rng.randrange(0, 8))] for _ in range(50)]
    completions[0] = []
    completions[1] = [EOS]
    nonempty = [i for i, c in enumerate(completions) if c or name == "digits-reverse"]
    rewards = task.reward_batch(
        [ours[i].text for i in nonempty], [""] * len(nonempty), [completions[i] for i in nonempty],
        [ours[i].answer for i in nonempty], [ours[i].metadata for i in nonempty],
    )
    blob = json.dumps({"prompts": [p.text for p in ours], "answers": [p.answer for p in ours], "rewards": rewards},
                      sort_keys=True)
    assert hashlib.sha256(blob.encode()).hexdigest() == BASELINE_FINGERPRINTS[name]


def test_first_digit_tasks() -> None:
    task = get_task("digits-max")
    assert task.name == "digits-max"
    assert task.reward("3+5+2=", "", _ids("5"), "5") == 1.0
    assert task.reward("3+5+2=", "", [*_ids("57"), EOS], "5") == 1.0  # only the first token counts
    assert task.reward("3+5+2=", "", _ids("45"), "5") == 0.0
    assert task.reward("3+5+2=", "", [], "5") == 0.0  # empty completion
    assert task.reward("3+5+2=", "", [EOS], "5") == 0.0  # EOS first
    assert task.reward("3+5+2=", "5", [], "5") == 1.0  # text only (no ids): the first character
    assert task.reward("3+5+2=", "<eos>5", [], "5") == 0.0
    assert get_task("digits-sum").make_prompts(0, 1)[0].answer == str(sum(map(int, "6+6+0=".rstrip("=").split("+"))) % 10)


def test_reverse_partial_credit() -> None:
    task = get_task("digits-reverse", min_digits=2, max_digits=5)
    assert task.reward("123=", "", [*_ids("321"), EOS], "321") == 1.0
    assert task.reward("123=", "", _ids("321"), "321") == 1.0  # no EOS (length cut) still scores
    assert task.reward("123=", "", [*_ids("32"), EOS], "321") == pytest.approx(2 / 3)
    assert task.reward("123=", "", _ids("32100"), "321") == pytest.approx(3 / 5)  # longer completion
    assert task.reward("123=", "", [*_ids("3"), EOS, *_ids("21")], "321") == pytest.approx(1 / 3)  # cut at EOS
    assert task.reward("123=", "", [EOS], "321") == 0.0
    assert task.reward("123=", "", [], "321") == 0.0
    assert task.reward("123=", "", [*_ids("3+1"), EOS], "321") == pytest.approx(2 / 3)  # "+" is a wrong char
    assert task.reward("123=", "32<eos>9", [], "321") == pytest.approx(2 / 3)  # text fallback, cut at EOS
    assert positional_score("", "") == 0.0
    prompts = task.make_prompts(random.Random(3), 200)
    assert all(2 <= p.metadata["n_digits"] == len(p.answer) <= 5 for p in prompts)
    assert all(p.text[:-1][::-1] == p.answer and p.text.endswith("=") for p in prompts)


def test_make_prompts_seed_and_stream() -> None:
    task = get_task("digits-max")
    assert task.make_prompts(5, 4) == task.make_prompts(5, 4)
    rng = random.Random(5)
    first, second = task.make_prompts(rng, 4), task.make_prompts(rng, 4)
    assert first + second == task.make_prompts(5, 8)  # a Random continues its stream
    with pytest.raises(TypeError, match="seed"):
        task.make_prompts("5", 1)  # type: ignore[arg-type]


def test_reward_batch_checks_lengths() -> None:
    task = get_task("digits-max")
    with pytest.raises(ValueError, match="answers has 1 entries, prompts has 2"):
        task.reward_batch(["1=", "2="], ["", ""], [[3], [4]], ["0"])
