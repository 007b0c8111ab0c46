"""Chat-template prompts: what render_prompt hands the tokenizer, rendered by transformers itself
(a real PreTrainedTokenizerFast with a small Jinja template set in the test)."""

from __future__ import annotations

import pytest
from transformers import PreTrainedTokenizerFast

from streamrl.models.tokenizer import build_char_tokenizer
from streamrl.tasks.base import Prompt
from streamrl.tasks.chat import ChatTemplateError, prompt_messages, render_prompt

# ChatML-like, small: every turn as <role>content|, then the assistant header for generation.
TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}|{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


@pytest.fixture
def tokenizer() -> PreTrainedTokenizerFast:
    tok = build_char_tokenizer()
    tok.chat_template = TEMPLATE
    return tok


def test_plain_prompt_without_the_template_is_its_text(tokenizer: PreTrainedTokenizerFast) -> None:
    p = Prompt("12+3=", "15")
    assert render_prompt(p, tokenizer, chat_template=False, system_prompt=None) == "12+3="
    # the system prompt belongs to the chat template: without one the text is as written
    assert render_prompt(p, tokenizer, chat_template=False, system_prompt="Be brief.") == "12+3="


def test_a_plain_prompt_becomes_one_user_turn_and_the_generation_prompt(tokenizer: PreTrainedTokenizerFast) -> None:
    p = Prompt("12+3=", "15")
    assert render_prompt(p, tokenizer, chat_template=True, system_prompt=None) == "<user>12+3=|<assistant>"
    assert (render_prompt(p, tokenizer, chat_template=True, system_prompt="Be brief.")
            == "<system>Be brief.|<user>12+3=|<assistant>")


def test_messages_are_rendered_and_keep_their_own_system_turn(tokenizer: PreTrainedTokenizerFast) -> None:
    turns = [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"},
             {"role": "user", "content": "2+2="}]
    p = Prompt("2+2=", "4", messages=turns)
    assert (render_prompt(p, tokenizer, chat_template=True, system_prompt="S.")
            == "<system>S.|<user>1+1=|<assistant>2|<user>2+2=|<assistant>")
    own = Prompt("2+2=", "4", messages=[{"role": "system", "content": "Mine."}, *turns[2:]])
    assert render_prompt(own, tokenizer, chat_template=True, system_prompt="S.") == "<system>Mine.|<user>2+2=|<assistant>"
    assert prompt_messages(own, "S.") == own.messages  # not prepended twice
    assert p.messages == turns  # the prompt's own list is left as it was


def test_the_rendered_text_tokenises_without_extra_specials(tokenizer: PreTrainedTokenizerFast) -> None:
    """What the source stage does with it: encode without add_special_tokens (the template has its own)."""
    text = render_prompt(Prompt("12=", "21"), tokenizer, chat_template=True, system_prompt=None)
    assert tokenizer.encode(text, add_special_tokens=False) == tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(tokenizer.encode("12=", add_special_tokens=False)) == "12="


def test_messages_without_the_template_say_to_turn_it_on(tokenizer: PreTrainedTokenizerFast) -> None:
    p = Prompt("2+2=", "4", messages=[{"role": "user", "content": "2+2="}])
    with pytest.raises(ChatTemplateError, match=r"set task\.chat_template: true"):
        render_prompt(p, tokenizer, chat_template=False, system_prompt=None)


def test_a_tokenizer_without_a_template_names_the_options() -> None:
    bare = build_char_tokenizer()
    assert not bare.chat_template
    with pytest.raises(ChatTemplateError) as info:
        render_prompt(Prompt("1=", "1"), bare, chat_template=True, system_prompt=None)
    assert "task.chat_template" in str(info.value) and "model.path" in str(info.value)
