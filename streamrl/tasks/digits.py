"""Synthetic digit tasks, identical to the TRL baseline's (``ops/bench/trl_grpo.py`` trains on these).

Same prompt generator (``make_dataset``: one ``random.Random(seed)`` stream) and same scoring
(``Recorder.reward_fn``) so learning curves compare one to one.

- ``digits-max``     "3+5+2=" -> "5": the largest digit. Learnable from random init.
- ``digits-last``    "3+5+2=" -> "2": the last digit.
- ``digits-sum``     "3+5+2=" -> "0": the last digit of the sum. A known trap: from a random init
                     RL almost never gets a signal the policy can climb (reward stays ~0.1, chance),
                     because the answer depends on all digits jointly. Kept as a negative control.
- ``digits-reverse`` "58310=" -> "01385": the digits reversed; variable lengths (partial credit).

For the first-digit tasks the reward is 1.0 iff the FIRST generated token is the right digit.
For reverse it is (positions right) / max(len(answer), len(completion)), the completion cut
at EOS, a non-digit token counting as a wrong character.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Any

from transformers import PreTrainedTokenizerBase

from streamrl.tasks.base import BatchRewardMixin, Prompt, TaskOptionError, as_rng, int_option

DIGITS = "0123456789"
EOS_TEXT = "<eos>"


def positional_score(chars: str, answer: str) -> float:
    """Fraction of positions right, over the longer of the two strings (partial credit)."""
    n = max(len(chars), len(answer))
    if n == 0:
        return 0.0
    return sum(1 for a, b in zip(chars, answer, strict=False) if a == b) / n


class _DigitsTask(BatchRewardMixin):
    """Shared parts: the token-id -> digit map and batch scoring."""

    name = "digits"

    def __init__(self, tokenizer: PreTrainedTokenizerBase | None = None) -> None:
        if tokenizer is None:
            from streamrl.models.tokenizer import build_char_tokenizer

            tokenizer = build_char_tokenizer()
        ids = tokenizer.convert_tokens_to_ids(list(DIGITS))
        if tokenizer.unk_token_id is not None and tokenizer.unk_token_id in ids:
            raise ValueError(f"task {self.name!r}: the tokenizer has no single-character digit tokens")
        self.digit_of: dict[int, str] = dict(zip(ids, DIGITS, strict=True))
        self.eos_token_id: int | None = tokenizer.eos_token_id

    def completion_chars(self, response: str, response_ids: Sequence[int]) -> str:
        """The completion as characters, cut at EOS; token ids win over text when given."""
        if len(response_ids) == 0:
            return response.split(EOS_TEXT, 1)[0]
        chars = []
        for t in response_ids:
            if t == self.eos_token_id:
                break
            chars.append(self.digit_of.get(int(t), "?"))
        return "".join(chars)


class FirstDigitTask(_DigitsTask):
    """Prompt "a+b+c=" (``n_digits`` digits); reward 1.0 iff the first generated token is the answer."""

    def __init__(
        self,
        name: str,
        answer_of: Callable[[list[int]], int],
        n_digits: int = 3,
        tokenizer: PreTrainedTokenizerBase | None = None,
    ) -> None:
        int_option(name, "n_digits", n_digits, 1)
        self.name = name
        super().__init__(tokenizer)
        self.answer_of = answer_of
        self.n_digits = n_digits

    def max_prompt_text(self) -> str:
        """A prompt as long as any this task makes (for the positions check before a run)."""
        return "+".join("9" * self.n_digits) + "="

    def make_prompts(self, rng: random.Random | int, n: int) -> list[Prompt]:
        rng = as_rng(rng)
        out = []
        for _ in range(n):
            d = [rng.randrange(10) for _ in range(self.n_digits)]
            out.append(Prompt("+".join(map(str, d)) + "=", str(self.answer_of(d))))
        return out

    def reward(
        self, prompt: str, response: str, response_ids: Sequence[int], answer: str, **metadata: Any
    ) -> float:
        if len(response_ids) > 0:
            first = self.digit_of.get(int(response_ids[0]))
        else:
            first = response[:1] if response and not response.startswith(EOS_TEXT) else None
        return 1.0 if first == answer else 0.0


class DigitsReverseTask(_DigitsTask):
    """Prompt: ``min_digits``..``max_digits`` random digits then "="; answer: the digits reversed."""

    name = "digits-reverse"

    def __init__(
        self, min_digits: int = 2, max_digits: int = 8, tokenizer: PreTrainedTokenizerBase | None = None
    ) -> None:
        int_option("digits-reverse", "min_digits", min_digits, 1)
        int_option("digits-reverse", "max_digits", max_digits, 1)
        if not min_digits <= max_digits:
            raise TaskOptionError(
                f"task 'digits-reverse': need 1 <= min_digits <= max_digits, got {min_digits}..{max_digits}; "
                "raise max_digits or lower min_digits"
            )
        super().__init__(tokenizer)
        self.min_digits = min_digits
        self.max_digits = max_digits

    def max_prompt_text(self) -> str:
        """A prompt as long as any this task makes (for the positions check before a run)."""
        return "9" * self.max_digits + "="

    def make_prompts(self, rng: random.Random | int, n: int) -> list[Prompt]:
        rng = as_rng(rng)
        out = []
        for _ in range(n):
            k = rng.randint(self.min_digits, self.max_digits)
            d = "".join(str(rng.randrange(10)) for _ in range(k))
            out.append(Prompt(d + "=", d[::-1], {"n_digits": k}))
        return out

    def reward(
        self, prompt: str, response: str, response_ids: Sequence[int], answer: str, **metadata: Any
    ) -> float:
        return positional_score(self.completion_chars(response, response_ids), answer)


def digits_max(n_digits: int = 3, tokenizer: PreTrainedTokenizerBase | None = None) -> FirstDigitTask:
    return FirstDigitTask("digits-max", max, n_digits, tokenizer)


def digits_last(n_digits: int = 3, tokenizer: PreTrainedTokenizerBase | None = None) -> FirstDigitTask:
    return FirstDigitTask("digits-last", lambda d: d[-1], n_digits, tokenizer)


def digits_sum(n_digits: int = 3, tokenizer: PreTrainedTokenizerBase | None = None) -> FirstDigitTask:
    return FirstDigitTask("digits-sum", lambda d: sum(d) % 10, n_digits, tokenizer)


def digits_reverse(
    min_digits: int = 2, max_digits: int = 8, tokenizer: PreTrainedTokenizerBase | None = None
) -> DigitsReverseTask:
    return DigitsReverseTask(min_digits, max_digits, tokenizer)
