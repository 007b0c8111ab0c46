"""streamrl.models: tiny models and tokenizers built in code, HF loading, the functional forward."""

from streamrl.models.build import (
    DeviceUnavailableError,
    ModelLoadError,
    TinyModelSpec,
    build_model,
    load_model,
    resolve_device,
    save_pretrained_dir,
)
from streamrl.models.functional import (
    FunctionalCausalLM,
    FunctionalForward,
    KVCache,
    UnsupportedModelError,
    unsupported_config_reason,
    unsupported_reason,
)
from streamrl.models.tokenizer import VOCAB_TOKENS, build_char_tokenizer

__all__ = [
    "VOCAB_TOKENS",
    "DeviceUnavailableError",
    "FunctionalCausalLM",
    "FunctionalForward",
    "KVCache",
    "ModelLoadError",
    "TinyModelSpec",
    "UnsupportedModelError",
    "build_char_tokenizer",
    "build_model",
    "load_model",
    "resolve_device",
    "save_pretrained_dir",
    "unsupported_config_reason",
    "unsupported_reason",
]
