"""Verified math rewards on ``math-verify`` (Hugging Face's answer extraction and symbolic
equivalence, the grader the field's GSM8K / MATH recipes use).

``math_reward``: 1.0 when the response's final answer is mathematically equivalent to the gold
answer, else 0.0 (never raises: malformed LaTeX, no answer at all, a parse error all score 0.0).

- The gold answer: plain (``72``, ``0.5``, ``\\frac{1}{2}``) or GSM8K's reasoning that ends in
  ``#### 72`` (what follows the last ``####`` is the answer; thousands commas are dropped).
- The response's answer, in math-verify's order: the last ``\\boxed{...}`` first, then a stated
  final answer ("the final answer is ..."), then the last number or expression of the text. So
  ``\\boxed{9} ... 10`` answers 9, and a response without a box answers its last number.
- Equivalence is symbolic (sympy): ``\\frac{1}{2}`` = ``0.5``, ``\\sqrt{4}`` = ``2``, ``1,000`` =
  ``1000``, ``3.0`` = ``3``, ``x = 5`` = ``5`` (an equation's right-hand side), and a LaTeX gold
  percentage is its fraction (``50\\%`` = ``0.5``).

Time: math-verify bounds parsing and comparison with ``signal.alarm``, which works only in a
process's main thread; the score stage calls rewards from worker threads, so there the alarm is
off and what bounds the work is the input: only the last ``MAX_RESPONSE_CHARS`` characters of a
response are read (the final answer is at its end).
"""

from __future__ import annotations

import re
import threading
from collections.abc import Sequence
from typing import Any

from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

TIMEOUT_S = 5  # math-verify's own alarm, in the main thread only (see the module docstring)
MAX_RESPONSE_CHARS = 4000  # the tail of a response that is searched for its final answer
_EXTRACTION = (LatexExtractionConfig(), ExprExtractionConfig())
_BOXED = re.compile(r"\\boxed\s*\{\s*[^{}\s]")  # a box with something in it
_HASH_ANSWER = re.compile(r"####\s*-?[\d.,]*\d")


def _timeout() -> int | None:
    return TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


def gold_text(answer: str) -> str:
    """The gold answer's text: after GSM8K's last ``####``, thousands commas dropped; LaTeX
    without ``$`` delimiters wrapped in them (math-verify reads LaTeX between delimiters)."""
    text = answer.rsplit("####", 1)[1] if "####" in answer else answer
    text = text.strip()
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", text):
        text = text.replace(",", "")
    if "\\" in text and "$" not in text:
        text = f"${text}$"
    return text


def _parse(text: str) -> list[Any]:
    try:
        return list(parse(text, extraction_config=list(_EXTRACTION), parsing_timeout=_timeout()))
    except Exception:  # math-verify returns [] on its own errors; anything else scores 0 too
        return []


def math_reward(prompt: str = "", response: str = "", response_ids: Sequence[int] = (), answer: str = "",
                **_: Any) -> float:
    """1.0 iff the response's final answer equals ``answer`` mathematically (module docstring)."""
    gold = _parse(gold_text(str(answer)))
    if not gold:
        return 0.0  # a gold answer math-verify cannot read: no response can match it
    predicted = _parse(str(response)[-MAX_RESPONSE_CHARS:])
    if not predicted:
        return 0.0
    try:
        return 1.0 if verify(gold, predicted, timeout_seconds=_timeout()) else 0.0
    except Exception:
        return 0.0


def format_reward(prompt: str = "", response: str = "", response_ids: Sequence[int] = (), answer: str = "",
                  **_: Any) -> float:
    """1.0 when the response states its answer in a checkable form: a non-empty ``\\boxed{...}`` or
    a ``#### <number>`` line (GSM8K's); else 0.0."""
    text = str(response)[-MAX_RESPONSE_CHARS:]
    return 1.0 if _BOXED.search(text) or _HASH_ANSWER.search(text) else 0.0
