"""streamrl.models: tiny models and tokenizers built in code, HF loading, the functional forward.

The names below are imported on first use (PEP 562), so ``streamrl.models.spec`` (what the run
config needs) loads without torch or transformers.
"""

from __future__ import annotations

import importlib
from typing import Any

_HOME = {
    "DeviceUnavailableError": "device", "ModelLoadError": "build", "build_model": "build", "load_model": "build",
    "resolve_device": "device", "save_pretrained_dir": "build", "TinyModelSpec": "spec",
    "FunctionalCausalLM": "functional", "FunctionalForward": "functional", "KVCache": "functional",
    "UnsupportedModelError": "functional", "unsupported_config_reason": "functional",
    "unsupported_reason": "functional", "VOCAB_TOKENS": "tokenizer", "build_char_tokenizer": "tokenizer",
}
__all__ = sorted(_HOME)


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module 'streamrl.models' has no attribute {name!r}")
    return getattr(importlib.import_module(f"streamrl.models.{home}"), name)
