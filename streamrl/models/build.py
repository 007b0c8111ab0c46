"""Build tiny models from a config, save/load Hugging Face directories, pick a device.

``build_model`` reproduces the TRL baseline's model build (``ops/bench/trl_grpo.py`` calls it)
exactly: same ``Qwen2Config`` fields, same seeding, so a run here starts from the very same
weights as the baseline run and their learning curves can be compared. ``arch: gpt2`` builds a
tiny GPT-2 (learned positions, GELU MLP, tied embeddings): an architecture outside the
Llama/Qwen2 family, which the engines run through the Hugging Face forward.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from transformers import (
    AutoModelForCausalLM,
    GenerationConfig,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    Qwen2Config,
    Qwen2ForCausalLM,
)

# re-exported: their homes are light modules (the launcher's checks import them without transformers' models)
from streamrl.models.device import DeviceUnavailableError as DeviceUnavailableError
from streamrl.models.device import resolve_device
from streamrl.models.spec import TinyModelSpec


class ModelLoadError(RuntimeError):
    """A model directory is missing or cannot be loaded; the message names the path."""


def build_model(spec: TinyModelSpec, tokenizer: PreTrainedTokenizerBase) -> PreTrainedModel:
    """A randomly initialised causal LM, seeded by ``spec.seed``, fp32 on CPU.

    The global torch RNG is left as it was (the init runs under ``fork_rng``).
    """
    tokens = dict(pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
                  use_cache=True)
    model_cls: type[PreTrainedModel]
    config: PretrainedConfig
    if spec.arch == "gpt2":
        # every dropout off, so that a training forward and a rollout forward of the same weights
        # give the same numbers
        model_cls, config = GPT2LMHeadModel, GPT2Config(
            vocab_size=len(tokenizer), n_embd=spec.hidden, n_layer=spec.layers, n_head=spec.heads,
            n_inner=spec.intermediate, n_positions=spec.max_positions, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0, summary_first_dropout=0.0, tie_word_embeddings=True, **tokens,
        )
    else:
        common = dict(
            vocab_size=len(tokenizer),
            hidden_size=spec.hidden,
            intermediate_size=spec.intermediate,
            num_hidden_layers=spec.layers,
            num_attention_heads=spec.heads,
            num_key_value_heads=spec.kv_heads or spec.heads,
            max_position_embeddings=spec.max_positions,
            tie_word_embeddings=spec.tied,
            **tokens,
        )
        model_cls, config = ((Qwen2ForCausalLM, Qwen2Config(**common)) if spec.arch == "qwen2"
                             else (LlamaForCausalLM, LlamaConfig(**common)))
    with torch.random.fork_rng(devices=[]):
        # Seed right before construction, as the baseline does: the init draws from the global RNG.
        torch.manual_seed(spec.seed)
        model = model_cls(config)
    model.generation_config = GenerationConfig(
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id
    )
    return model


def save_pretrained_dir(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None, path: str | Path) -> Path:
    """Write ``model`` (safetensors) and ``tokenizer`` to ``path`` as a from_pretrained directory."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if torch.distributed.is_available() and torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
        # transformers' save_pretrained writes weights on rank 0 only once torch.distributed is up
        # (a colocated generate worker's process is a train rank), but this directory is this
        # process's own: write the config and weights directly, tied duplicates once (as HF does)
        model.config.save_pretrained(path)
        if model.generation_config is not None:
            model.generation_config.save_pretrained(path)
        seen: set[int] = set()
        weights = {}
        for name, tensor in model.state_dict().items():
            if tensor.data_ptr() not in seen:
                seen.add(tensor.data_ptr())
                weights[name] = tensor.detach().contiguous()
        save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    else:
        model.save_pretrained(path)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    return path


def load_model(
    path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> PreTrainedModel:
    """Load a local ``save_pretrained`` directory through transformers' ``from_pretrained``.

    Never touches the network (``local_files_only``). Raises ``ModelLoadError`` naming the path
    when the directory is missing, has no ``config.json`` / weights, or fails to load.
    """
    path = Path(path)
    check_model_dir(path)
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
    except Exception as exc:  # transformers raises many kinds; name the path in one error type
        raise ModelLoadError(f"could not load model from {str(path)!r}: {type(exc).__name__}: {exc}") from exc
    return model.to(resolve_device(device))


def check_model_dir(path: str | Path) -> dict[str, Any]:
    """What ``load_model`` needs, checked without loading weights: the directory, its
    ``config.json`` (returned, parsed) and ``*.safetensors`` weights. Raises ``ModelLoadError``."""
    path = Path(path)
    if not path.is_dir():
        raise ModelLoadError(f"model directory {str(path)!r} does not exist (expected a save_pretrained directory)")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelLoadError(f"{str(path)!r} has no config.json; is it a save_pretrained directory?")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{str(config_file)!r} is not valid JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise ModelLoadError(f"{str(config_file)!r} must hold a JSON object, got {type(config).__name__}")
    if not any(path.glob("*.safetensors")) and not (path / "model.safetensors.index.json").is_file():
        raise ModelLoadError(f"{str(path)!r} has no *.safetensors weights; save it with save_pretrained")
    return config


def max_positions_of(config: dict[str, Any]) -> int | None:
    """The positions a model config advertises (``max_position_embeddings``, or the older names;
    a multimodal config keeps it under ``text_config``); None when it says none."""
    for source in (config, config.get("text_config")):
        if isinstance(source, dict):
            for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
                value = source.get(key)
                if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                    return value
    return None


#: Written into an exported policy directory beside config.json: which policy version it holds
#: (the eval stage's final evaluation reads it).
EXPORT_STATE = "streamrl_state.json"


def write_export_version(path: Path, version: int) -> None:
    """Record which policy version the exported directory ``path`` holds (beside config.json)."""
    (path / EXPORT_STATE).write_text(json.dumps({"policy_version": version}) + "\n")


def read_export_version(path: Path) -> int | None:
    """The policy version of the checkpoint at ``path``; None when there is none (the run was
    stopped from outside, or output.checkpoint is off)."""
    try:
        state: Any = json.loads((path / EXPORT_STATE).read_text())
    except (OSError, ValueError):
        return None
    version = state.get("policy_version") if isinstance(state, dict) else None
    return version if isinstance(version, int) else None
