"""Prompts as the policy sees them: plain text, or rendered through the tokenizer's chat template.

``task.chat_template: true`` renders every prompt with ``tokenizer.apply_chat_template`` (the
checkpoint's own template, e.g. Qwen's ChatML) and the generation prompt (the assistant header),
so an instruct model answers in the format it was trained on. A plain prompt becomes one user
message; ``task.system_prompt`` puts a system message first.
"""

from __future__ import annotations

from typing import Any

from streamrl.tasks.base import Prompt


class ChatTemplateError(ValueError):
    """A prompt cannot be rendered as configured (no template, or messages without a template)."""


def prompt_messages(prompt: Prompt, system_prompt: str | None) -> list[dict[str, str]]:
    """The chat messages of ``prompt``: its own, or one user message; the system prompt first
    unless the messages already start with a system message."""
    messages = list(prompt.messages) if prompt.messages else [{"role": "user", "content": prompt.text}]
    if system_prompt is not None and not (messages and messages[0].get("role") == "system"):
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


def render_prompt(prompt: Prompt, tokenizer: Any, *, chat_template: bool, system_prompt: str | None) -> str:
    """The text to tokenise (without adding special tokens: a template carries its own)."""
    if not chat_template:
        if prompt.messages:
            raise ChatTemplateError("the prompt is a list of chat messages (from the dataset's row_fn): set "
                                    "task.chat_template: true to render them with the tokenizer's chat template")
        return prompt.text
    if not getattr(tokenizer, "chat_template", None):
        raise ChatTemplateError("task.chat_template is true but the tokenizer has no chat template; use a "
                                "model.path whose tokenizer has one (an instruct model), or set task.chat_template: "
                                "false")
    text = tokenizer.apply_chat_template(prompt_messages(prompt, system_prompt), add_generation_prompt=True,
                                         tokenize=False)
    return str(text)
