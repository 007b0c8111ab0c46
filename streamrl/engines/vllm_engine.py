"""vLLM as a rollout engine (:class:`~streamrl.engines.rollout_engine.RolloutEngine`).

One ``vllm.LLM`` per generate worker, built from a Hugging Face model directory (``model.path``,
or the tiny model saved into the run directory). What the rest of streamrl relies on:

- **In-process engine core.** ``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the engine core and its one
  worker run inside the generate worker's process. Seen on a 2-core CPU: ~4 s to start instead of
  ~40 s plus a ~19 s first batch with vLLM's separate engine process, and weight tensors reach the
  model without serialisation. The price: vLLM makes ``torch.set_num_threads`` a no-op for the
  whole process, which a process that only generates does not need. Killing this process kills
  the engine with it, so no vLLM process outlives the worker.
- **No tokenizer.** Prompts go in as token ids (``skip_tokenizer_init``), responses come back as
  ids; generation stops at the tokenizer's EOS through ``stop_token_ids`` (kept in the response,
  as the built-in engine keeps it).
- **Logprobs of what was sampled.** ``logprobs_mode="processed_logprobs"`` with ``logprobs=0``:
  the sampled token's logprob under the distribution it was drawn from, after temperature (and
  after top-k / top-p, which renormalise over the kept tokens; the built-in engine reports the
  untruncated tempered distribution instead, which is what the trainer recomputes. With top_k /
  top_p off the two agree). vLLM's default ("raw") would be before temperature.
- **Reproducible draws.** Every request gets its own seed, drawn from the stage's generator, so a
  batch generated again (restart, resume) with the same generator state gets the same tokens.
- **Weights in place.** ``load_weights`` runs vLLM's ``model_runner.reload_weights`` over the
  given (name, tensor) iterable: layer by layer, repacking for vLLM's kernels (the model's own
  ``load_weights`` fails on the CPU build, whose linear layers hold repacked weights). The
  iterable is consumed lazily, so a generator that receives buckets as they arrive feeds vLLM
  without a second full copy. The prefix cache is reset after each version: cached prompt KV of
  the old weights must not serve the new ones.
- **Sleep mode** (free the weights and KV cache while training) is not supported by vLLM on CPU;
  the colocated placement does not run vLLM (see docs/vllm.md).
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from streamrl.engines.options import VLLM_INSTALL_HINT, EngineUnavailableError, VllmOptions
from streamrl.engines.rollout import FinishReason, GenerateArgumentError, Generation

log = logging.getLogger("streamrl.engine.vllm")

SEED_RANGE = 2**62  # per-request seeds are drawn below this (vLLM seeds a torch.Generator with them)


class VllmEngineDeadError(RuntimeError):
    """vLLM's engine stopped working (its process or worker died); the message says what vLLM said."""


def configure_vllm_environment(options: VllmOptions, scratch_dir: Path, device: str) -> None:
    """vLLM reads these when it is imported and when its engine starts: set before both.

    A variable the user set already is kept (their override wins).
    """
    env = {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # in-process engine core (module docstring)
        # vLLM's ZeroMQ ipc socket files: in the run's scratch dir, removed with it, not /tmp
        "VLLM_RPC_BASE_PATH": str(scratch_dir),
        "VLLM_NO_USAGE_STATS": "1",  # no network here, and none wanted from a trainer
        "VLLM_CONFIGURE_LOGGING": "0",  # keep the worker's own logging set-up
    }
    if device == "cpu":
        env["VLLM_CPU_KVCACHE_SPACE"] = f"{options.kv_cache_gib:g}"
        if options.cpu_threads_bind is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = options.cpu_threads_bind
    for key, value in env.items():
        os.environ.setdefault(key, value)


class VllmRolloutEngine:
    """A ``vllm.LLM`` behind the rollout-engine interface (see the module docstring)."""

    name = "vllm"

    def __init__(
        self, model_dir: str | Path, *, eos_token_id: int, dtype: str, max_model_len: int, seed: int,
        options: VllmOptions, scratch_dir: str | Path, device: str = "cpu",
    ) -> None:
        """``scratch_dir``: a directory this engine owns (vLLM's ipc files; a caller may have saved
        the model there) and removes on ``close``."""
        scratch = self.scratch_dir = Path(scratch_dir)
        scratch.mkdir(parents=True, exist_ok=True)
        configure_vllm_environment(options, scratch, device)
        started = time.perf_counter()
        try:
            import vllm
        except ImportError as exc:
            raise EngineUnavailableError(f"engine: vllm, but `import vllm` failed ({exc}); {VLLM_INSTALL_HINT}"
                                         ) from exc
        self._vllm = vllm
        self.eos_token_id = int(eos_token_id)
        self.max_model_len = max_model_len
        kwargs: dict[str, Any] = {}
        if device != "cpu":
            kwargs["gpu_memory_utilization"] = options.gpu_memory_utilization
        self.llm = vllm.LLM(
            model=str(model_dir), skip_tokenizer_init=True, dtype=dtype, seed=seed, max_model_len=max_model_len,
            enforce_eager=options.enforce_eager, tensor_parallel_size=options.tensor_parallel_size,
            logprobs_mode="processed_logprobs", **kwargs,
        )
        self.startup_s = time.perf_counter() - started
        self.versions_loaded = 0
        self._closed = False
        log.info("vLLM %s engine ready in %.1f s (%s, %s, max_model_len %d)", vllm.__version__, self.startup_s,
                 model_dir, dtype, max_model_len)

    @property
    def generator_device(self) -> torch.device:
        return torch.device("cpu")  # only per-request seeds are drawn from it

    def generate(
        self, prompts: list[Tensor], *, max_new_tokens: int, temperature: float = 1.0, top_p: float = 1.0,
        top_k: int = 0, generator: torch.Generator | None = None,
    ) -> list[Generation]:
        if not prompts:
            raise GenerateArgumentError("prompts is empty; pass at least one 1-D int64 tensor of token ids")
        if max_new_tokens < 1:
            raise GenerateArgumentError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if not temperature > 0.0:
            raise GenerateArgumentError(f"temperature must be > 0, got {temperature} (use top_k=1 for greedy)")
        longest = max(int(p.numel()) for p in prompts)
        if longest + max_new_tokens > self.max_model_len:
            raise GenerateArgumentError(f"a prompt of {longest} tokens + max_new_tokens={max_new_tokens} exceeds the "
                                        f"engine's max_model_len {self.max_model_len}")
        vllm = self._vllm
        base = int(torch.randint(0, SEED_RANGE, (1,), generator=generator).item())
        params = [
            vllm.SamplingParams(
                n=1, max_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k if top_k > 0 else 0,
                logprobs=0, stop_token_ids=[self.eos_token_id], seed=(base + i) % SEED_RANGE, detokenize=False,
            )
            for i in range(len(prompts))
        ]
        requests = [{"prompt_token_ids": [int(t) for t in p.tolist()]} for p in prompts]
        try:
            outputs = self.llm.generate(requests, params, use_tqdm=False)  # type: ignore[arg-type]
        except Exception as exc:  # vLLM's EngineDeadError and friends: name the engine, keep vLLM's words
            raise VllmEngineDeadError(f"vLLM failed to generate: {type(exc).__name__}: {exc}") from exc
        return [self._generation(out.outputs[0]) for out in outputs]

    def _generation(self, completion: Any) -> Generation:
        ids = list(completion.token_ids)
        logprobs = [float(step[token].logprob) for step, token in zip(completion.logprobs, ids, strict=True)]
        finish: FinishReason = "eos" if ids and ids[-1] == self.eos_token_id else "length"
        return Generation(torch.tensor(ids, dtype=torch.int64), torch.tensor(logprobs, dtype=torch.float32), finish)

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> None:
        """Install a new version in place; ``weights`` is consumed once, lazily (module docstring)."""
        self.llm.collective_rpc(_reload_weights, args=(weights,))
        # cached prompt KV blocks were computed with the old weights
        self.llm.reset_prefix_cache()
        self.versions_loaded += 1

    def close(self) -> None:
        """Shut vLLM's engine core down (its worker, its sockets) explicitly; idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            core = getattr(self.llm.llm_engine, "engine_core", None)
            if core is not None:
                core.shutdown()
        finally:
            shutil.rmtree(self.scratch_dir, ignore_errors=True)


def _reload_weights(worker: Any, weights: Iterable[tuple[str, Tensor]]) -> int:
    """Runs on vLLM's worker (this process: the engine core is in-process)."""
    worker.model_runner.reload_weights(weights_iterator=iter(weights))
    return 0
