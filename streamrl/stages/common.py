"""What several built-in stages build the same way: the policy model, its tokenizer, the task."""

from __future__ import annotations

from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from streamrl.config import RunConfig, resolve_path
from streamrl.models.build import build_model, load_model
from streamrl.models.tokenizer import build_char_tokenizer
from streamrl.tasks.base import Task
from streamrl.tasks.registry import get_task


def build_tokenizer(cfg: RunConfig) -> PreTrainedTokenizerBase:
    if cfg.model.path is not None:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(resolve_path(cfg, cfg.model.path)))
    return build_char_tokenizer(cfg.model.extra_chars)


def build_policy(cfg: RunConfig, device: str) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The initial policy (version 0): every stage that needs it builds the identical model."""
    tokenizer = build_tokenizer(cfg)
    if cfg.model.path is not None:
        model = load_model(str(resolve_path(cfg, cfg.model.path)), dtype=torch.float32, device=device)
    else:
        model = build_model(cfg.model.tiny, tokenizer).to(device)
    return model, tokenizer


def build_task(cfg: RunConfig, tokenizer: PreTrainedTokenizerBase | None = None) -> Task:
    options: dict[str, Any] = dict(cfg.task.options)
    if cfg.task.name.startswith("digits") and tokenizer is not None:
        options.setdefault("tokenizer", tokenizer)
    return get_task(cfg.task.name, **options)
