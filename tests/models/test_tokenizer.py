"""The character tokenizer: ids, one token per character, identical to the TRL baseline's."""

from __future__ import annotations

import types

import pytest

from streamrl.models.tokenizer import VOCAB_TOKENS, TokenizerConfigError, build_char_tokenizer


def test_ids_are_positions_in_the_vocabulary() -> None:
    tok = build_char_tokenizer()
    assert len(tok) == 15
    assert (tok.pad_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2)
    assert tok("31+5=")["input_ids"] == [6, 4, 13, 8, 14]
    assert tok("7x")["input_ids"] == [10, 2]  # unknown character -> <unk>, still one token each
    assert tok.decode([6, 13, 4, 1]) == "3+1<eos>"
    assert tok.decode([6, 13, 4, 1], skip_special_tokens=True) == "3+1"


def test_extra_chars_append_after_the_base_vocabulary() -> None:
    tok = build_char_tokenizer("ab ")
    assert tok("a 3b")["input_ids"] == [15, 17, 6, 16]
    assert tok.convert_tokens_to_ids("=") == 14  # base ids never move


@pytest.mark.parametrize(("extra", "needle"), [("aa", "twice"), ("3", "already"), ("\n", "line break")])
def test_bad_extra_chars_are_refused(extra: str, needle: str) -> None:
    with pytest.raises(TokenizerConfigError, match=needle):
        build_char_tokenizer(extra)


# The reference TRL baseline's vocabulary, recorded from its script on 2026-11-23 (compared live above
# where the script is available).
BASELINE_VOCAB = {"<pad>": 0, "<eos>": 1, "<unk>": 2, "0": 3, "1": 4, "2": 5, "3": 6, "4": 7, "5": 8, "6": 9,
                  "7": 10, "8": 11, "9": 12, "+": 13, "=": 14}


def test_same_vocabulary_as_the_baseline_recorded() -> None:
    assert build_char_tokenizer().get_vocab() == BASELINE_VOCAB
    assert list(VOCAB_TOKENS) == list(BASELINE_VOCAB)


def test_same_as_the_baseline_tokenizer(baseline: types.ModuleType) -> None:
    theirs, ours = baseline.build_tokenizer(), build_char_tokenizer()
    assert list(baseline.VOCAB_TOKENS) == list(VOCAB_TOKENS)
    assert theirs.get_vocab() == ours.get_vocab()
    for text in ["1+2+3=", "0123456789=", "9?9", ""]:
        assert theirs(text)["input_ids"] == ours(text)["input_ids"]
