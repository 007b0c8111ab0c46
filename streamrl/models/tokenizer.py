"""Character-level tokenizer built in code (no download), identical to the TRL baseline's.

One token per character, WordLevel vocabulary, decode by plain concatenation. Token ids are
fixed by ``VOCAB_TOKENS`` so that a model trained here and one trained by the baseline
(``ops/bench/trl_grpo.py``, which builds it with this function) see the same ids.
"""

from __future__ import annotations

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

# Order matters: ids are positions in this tuple (pad=0, eos=1, unk=2, "0"=3 ... "9"=12, "+"=13, "="=14).
SPECIAL_TOKENS: tuple[str, ...] = ("<pad>", "<eos>", "<unk>")
VOCAB_TOKENS: tuple[str, ...] = (*SPECIAL_TOKENS, *"0123456789", "+", "=")


class TokenizerConfigError(ValueError):
    """The requested tokenizer cannot be built (bad extra characters)."""


def check_extra_chars(extra_chars: str) -> None:
    seen: set[str] = set()
    for i, ch in enumerate(extra_chars):
        if ch in ("\n", "\r"):
            # The baseline's pre-tokenizer splits on regex "." which does not match line breaks.
            raise TokenizerConfigError(
                f"extra_chars[{i}] is a line break; the character tokenizer splits on '.' (no line breaks), "
                "remove it from extra_chars"
            )
        if ch in VOCAB_TOKENS:
            raise TokenizerConfigError(
                f"extra_chars[{i}]={ch!r} is already in the base vocabulary {list(VOCAB_TOKENS)}; remove it"
            )
        if ch in seen:
            raise TokenizerConfigError(f"extra_chars[{i}]={ch!r} appears twice; list each character once")
        seen.add(ch)


def build_char_tokenizer(extra_chars: str = "") -> PreTrainedTokenizerFast:
    """Build the character tokenizer: base vocabulary ``VOCAB_TOKENS`` then ``extra_chars`` in order.

    Base token ids never move, so ``extra_chars`` only appends ids after "=" (id 14).
    Padding side is left (as in the baseline); streamrl's engines do their own padding.
    """
    check_extra_chars(extra_chars)
    vocab = {tok: i for i, tok in enumerate((*VOCAB_TOKENS, *extra_chars))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")  # one token per character
    tok.decoder = decoders.Fuse()  # decode by plain concatenation
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        eos_token="<eos>",
        unk_token="<unk>",
        padding_side="left",
        truncation_side="left",
    )
