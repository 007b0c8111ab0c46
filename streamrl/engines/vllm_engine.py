"""vLLM as a rollout engine (:class:`~streamrl.engines.rollout_engine.RolloutEngine`).

One ``vllm.LLM`` per generate worker, built from a Hugging Face model directory (``model.path``,
or the tiny model saved into the run directory). What the rest of streamrl relies on:

- **In-process engine core.** ``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the engine core and its one
  worker run inside the generate worker's process: it starts much faster than with vLLM's
  separate engine process, and weight tensors reach the model without serialisation. The price:
  vLLM makes ``torch.set_num_threads`` a no-op for the whole process, which a process that only
  generates does not need. Killing this process kills the engine with it, so no vLLM process
  outlives the worker.
- **No tokenizer.** Prompts go in as token ids (``skip_tokenizer_init``), responses come back as
  ids; generation stops at the tokenizer's EOS through ``stop_token_ids`` (kept in the response,
  as the built-in engine keeps it).
- **Logprobs of what was sampled.** ``logprobs_mode="processed_logprobs"`` with ``logprobs=0``:
  the sampled token's logprob under the distribution it was drawn from, after temperature (and
  after top-k / top-p, which renormalise over the kept tokens; the built-in engine reports the
  untruncated tempered distribution instead, which is what the trainer recomputes. With top_k /
  top_p off the two agree). vLLM's default ("raw") would be before temperature.
- **Reproducible draws.** Every request gets its own seed, drawn from the stage's generator, so a
  batch generated again (restart, resume) with the same generator state gets the same tokens; with
  ``streams`` the seed comes from the request's (seed, first draw) pair alone, whatever else the
  call holds (a completion split over calls draws another seed per call, unlike the built-in
  engine's, whose draws follow the token index).
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
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

from streamrl.engines.options import VLLM_INSTALL_HINT, EngineUnavailableError, VllmOptions
from streamrl.engines.rollout import (
    FinishReason,
    GenerateArgumentError,
    Generation,
    check_streams,
    stream_seed,
)

log = logging.getLogger("streamrl.engine.vllm")

TRANSFER_FILE_BYTES = 64 * 2**20  # separate-process weight files: the extra shared memory of an install
SEED_RANGE = 2**62  # per-request seeds are drawn below this (vLLM seeds a torch.Generator with them)
ENGINE_WATCH_S = 0.5  # how often a separate-process engine is checked for death (vLLM notices, we unblock)


class VllmEngineDeadError(RuntimeError):
    """vLLM's engine stopped working (its process or worker died); the message says what vLLM said."""


def configure_vllm_environment(options: VllmOptions, scratch_dir: Path, device: str,
                               separate_process: bool) -> dict[str, str | None]:
    """vLLM reads these when it is imported and when its engine starts: set before both. Returns
    the previous values, which ``restore_environment`` puts back when the engine closes.

    A variable the user set already is kept (their override wins), except three this engine
    depends on: the engine-process choice (its weight path differs), the spawn method, and the ipc
    directory, which is this engine's own scratch dir (removed at close: a value left from an
    earlier engine in this process, inherited by child processes, would name a removed directory).
    """
    owned = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1" if separate_process else "0",
             # vLLM's ZeroMQ ipc socket files: in the engine's scratch dir, removed with it, not /tmp
             "VLLM_RPC_BASE_PATH": str(scratch_dir)}
    if separate_process:
        # spawn, not fork: a forked engine would inherit this process's torch.distributed state
        owned["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
    defaults = {
        "VLLM_NO_USAGE_STATS": "1",  # no network here, and none wanted from a trainer
        "VLLM_CONFIGURE_LOGGING": "0",  # keep the worker's own logging set-up
    }
    if device == "cpu":
        defaults["VLLM_CPU_KVCACHE_SPACE"] = f"{options.kv_cache_gib:g}"
        if options.cpu_threads_bind is not None:
            defaults["VLLM_CPU_OMP_THREADS_BIND"] = options.cpu_threads_bind
    previous = {key: os.environ.get(key) for key in (*owned, *defaults)}
    os.environ.update(owned)
    for key, value in defaults.items():
        os.environ.setdefault(key, value)
    # vLLM freezes its view of the environment once an engine has started in this process
    # (vllm.envs.enable_envs_cache): unfreeze it so a second engine reads its own values.
    envs = sys.modules.get("vllm.envs")
    if envs is not None and hasattr(envs, "disable_envs_cache"):
        envs.disable_envs_cache()
    return previous


def restore_environment(previous: dict[str, str | None]) -> None:
    for key, value in previous.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@contextmanager
def temp_files_in(directory: Path) -> Iterator[None]:
    """Python's temp dir is ``directory`` inside the block, for this process and for the processes it
    starts. vLLM's engine start-up makes torch.distributed's rendezvous file with
    ``tempfile.gettempdir()`` (``vllm_dist_<uuid>``, in the engine-core process); in the engine's
    scratch dir it goes with that dir, which the run removes even after a SIGKILL. In /tmp a killed
    engine leaves it behind (the FileStore removes it only when its last client closes cleanly).

    The process's own temp dir is looked up first, so that what it caches stays the real one after
    the block (``tempfile`` caches the first lookup for the life of the process).
    """
    tempfile.gettempdir()
    previous_dir, previous_env = tempfile.tempdir, os.environ.get("TMPDIR")
    tempfile.tempdir = str(directory)
    os.environ["TMPDIR"] = str(directory)  # a spawned engine core computes its own from this
    try:
        yield
    finally:
        tempfile.tempdir = previous_dir
        restore_environment({"TMPDIR": previous_env})


class VllmRolloutEngine:
    """A ``vllm.LLM`` behind the rollout-engine interface (see the module docstring)."""

    name = "vllm"
    load_weights_is_local = False  # an RPC to the engine core, which may be another process

    def __init__(
        self, model_dir: str | Path, *, eos_token_id: int | None, dtype: str, max_model_len: int, seed: int,
        options: VllmOptions, scratch_dir: str | Path, device: str = "cpu", separate_process: bool = False,
        transfer_root: Path | None = None, sleep_mode: bool = False,
    ) -> None:
        """``scratch_dir``: a directory this engine owns (vLLM's ipc files; a caller may have saved
        the model there) and removes on ``close``.

        ``separate_process``: vLLM's engine core in a process of its own, for a process that holds
        a torch.distributed world already (the disaggregated placement's generate workers): vLLM's
        worker initialises torch.distributed's default group, and a process has only one. Weights
        then cross over as safetensors files in shared memory, a bucket at a time, in a directory
        made under ``transfer_root`` (default /dev/shm, else the system temp dir).

        ``sleep_mode``: ``sleep()`` frees the engine's device memory (weights and KV cache: vLLM's
        level-2 sleep; the next install writes every weight anyway) and ``wake_up()`` takes it
        back, for an engine that shares its device with a trainer (colocated). vLLM refuses sleep
        mode on CPU, so there it stays off and both are no-ops. Not run here (no accelerator).
        """
        scratch = self.scratch_dir = Path(scratch_dir)
        scratch.mkdir(parents=True, exist_ok=True)
        self.transfer_dir: Path | None = None
        if separate_process:
            shm = Path("/dev/shm")
            root = transfer_root or (shm if shm.is_dir() else None)
            self.transfer_dir = Path(tempfile.mkdtemp(prefix="srl-vllm-w-", dir=root))
        self.sleep_mode = sleep_mode and device != "cpu"  # vLLM refuses sleep mode on CPU
        self.asleep = False
        self._previous_env = configure_vllm_environment(options, scratch, device, separate_process)
        started = time.perf_counter()
        try:
            import vllm

            self._vllm = vllm
            kwargs: dict[str, Any] = {}
            if device != "cpu":
                kwargs["gpu_memory_utilization"] = options.gpu_memory_utilization
                kwargs["enable_sleep_mode"] = sleep_mode
            with temp_files_in(scratch):
                self.llm = vllm.LLM(
                    model=str(model_dir), skip_tokenizer_init=True, dtype=dtype, seed=seed, max_model_len=max_model_len,
                    enforce_eager=options.enforce_eager, tensor_parallel_size=options.tensor_parallel_size,
                    logprobs_mode="processed_logprobs", worker_extension_cls=f"{__name__}.WeightLoadingExtension",
                    **kwargs,
                )
        except BaseException as exc:
            self._remove_scratch()
            if isinstance(exc, ImportError):
                raise EngineUnavailableError(
                    f"engine: vllm, but `import vllm` failed ({exc}); {VLLM_INSTALL_HINT}") from exc
            raise
        self.eos_token_id = eos_token_id  # None: no stop token (fixed-length generation, benchmarks)
        self.max_model_len = max_model_len
        self.startup_s = time.perf_counter() - started
        self.versions_loaded = 0
        self._closed = False
        if separate_process:
            threading.Thread(target=self._watch_engine_core, name="streamrl-vllm-engine-watch", daemon=True).start()
        log.info("vLLM %s engine ready in %.1f s (%s, %s, max_model_len %d)", vllm.__version__, self.startup_s,
                 model_dir, dtype, max_model_len)

    @property
    def generator_device(self) -> torch.device:
        return torch.device("cpu")  # only per-request seeds are drawn from it

    def generate(
        self, prompts: list[Tensor], *, max_new_tokens: int, temperature: float = 1.0, top_p: float = 1.0,
        top_k: int = 0, generator: torch.Generator | None = None, streams: Sequence[tuple[int, int]] | None = None,
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
        checked = None if streams is None else check_streams(streams, len(prompts))
        vllm = self._vllm
        if checked is None:
            base = int(torch.randint(0, SEED_RANGE, (1,), generator=generator).item())
            seeds = [(base + i) % SEED_RANGE for i in range(len(prompts))]
        else:  # a request's seed from its stream alone (a completion continued in another call gets another)
            seeds = [stream_seed(seed, first) % SEED_RANGE for seed, first in checked]
        params = [
            vllm.SamplingParams(
                n=1, max_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k if top_k > 0 else 0,
                logprobs=0, stop_token_ids=[] if self.eos_token_id is None else [self.eos_token_id], seed=seed,
                detokenize=False,
            )
            for seed in seeds
        ]
        requests = [{"prompt_token_ids": [int(t) for t in p.tolist()]} for p in prompts]
        try:
            outputs = self.llm.generate(requests, params, use_tqdm=False)  # type: ignore[arg-type]
        except Exception as exc:  # vLLM's EngineDeadError and friends: name the engine, keep vLLM's words
            raise VllmEngineDeadError(f"vLLM failed to generate: {type(exc).__name__}: {exc}"
                                      + (f"; {self._core_exit()}" if self._engine_dead() else "")) from exc
        return [self._generation(out.outputs[0]) for out in outputs]

    def _generation(self, completion: Any) -> Generation:
        ids = list(completion.token_ids)
        logprobs = [float(step[token].logprob) for step, token in zip(completion.logprobs, ids, strict=True)]
        finish: FinishReason = "eos" if ids and self.eos_token_id is not None and ids[-1] == self.eos_token_id else "length"
        return Generation(torch.tensor(ids, dtype=torch.int64), torch.tensor(logprobs, dtype=torch.float32), finish)

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> None:
        """Install a new version in place; ``weights`` is consumed once, lazily (module docstring)."""
        try:
            if self.transfer_dir is None:
                self.llm.collective_rpc("streamrl_reload", args=(weights,))
            else:
                self._load_across_processes(weights)
            # cached prompt KV blocks were computed with the old weights (inside the try: the engine
            # core may die here too, and this call then raises vLLM's EngineDeadError)
            self.llm.reset_prefix_cache()
        except Exception as exc:
            if self._engine_dead():
                raise VllmEngineDeadError(f"vLLM failed to install weights: {type(exc).__name__}: {exc}; "
                                          f"{self._core_exit()}") from exc
            raise
        self.versions_loaded += 1

    def _load_across_processes(self, weights: Iterable[tuple[str, Tensor]]) -> None:
        """The separate-process path: the tensors go into safetensors files in shared memory of at
        most ``TRANSFER_FILE_BYTES`` each, which the engine's worker loads (mmap) into vLLM's
        layer-by-layer reload, then each file is deleted. Extra memory: one file."""
        assert self.transfer_dir is not None
        self.llm.collective_rpc("streamrl_begin_reload")
        try:
            batch: dict[str, Tensor] = {}
            size = 0
            for name, tensor in weights:
                batch[name] = tensor.detach().to("cpu").contiguous()
                size += tensor.numel() * tensor.element_size()
                if size >= TRANSFER_FILE_BYTES:
                    self._send_file(batch)
                    batch, size = {}, 0
            if batch:
                self._send_file(batch)
        finally:
            self.llm.collective_rpc("streamrl_finish_reload")

    def _send_file(self, tensors: dict[str, Tensor]) -> None:
        assert self.transfer_dir is not None
        path = self.transfer_dir / f"weights-{self.versions_loaded}.safetensors"
        save_file(tensors, str(path))
        try:
            self.llm.collective_rpc("streamrl_load_file", args=(str(path),))
        finally:
            path.unlink(missing_ok=True)

    def sleep(self) -> None:
        """Free device memory for a colocated trainer's phase; a no-op without sleep mode (CPU)."""
        if self.sleep_mode and not self.asleep:
            self.llm.sleep(level=2)
            self.asleep = True

    def wake_up(self) -> None:
        """Take the memory back before the next install; a no-op without sleep mode (CPU)."""
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False

    def _core_client(self) -> Any:
        return getattr(self.llm.llm_engine, "engine_core", None)

    def _engine_dead(self) -> bool:
        resources = getattr(self._core_client(), "resources", None)
        return bool(getattr(resources, "engine_dead", False))

    def _core_exit(self) -> str:
        """What became of the engine-core process(es), for the error message."""
        manager = getattr(getattr(self._core_client(), "resources", None), "engine_manager", None)
        procs = getattr(manager, "processes", [])
        codes = ", ".join(f"pid {p.pid} exit code {p.exitcode}" for p in procs)
        return f"vLLM's engine-core process ended ({codes or 'exit code unknown'})"

    def _watch_engine_core(self) -> None:
        """Unblock a call that waits on a dead engine core (separate-process mode).

        vLLM's client notices the engine-core process die (its monitor thread sets
        ``resources.engine_dead`` and shuts the client down), but with vllm 0.32's synchronous
        client a ``generate`` already waiting for outputs, or a ``collective_rpc`` waiting for its
        reply, then waits forever: the output thread exits without queueing an error. This thread
        puts vLLM's own ``EngineDeadError`` where those calls wait, so they raise instead.
        """
        from vllm.v1.engine.exceptions import EngineDeadError

        while not self._closed:
            if self._engine_dead():
                if self._closed:  # our own close() marks the engine dead too
                    return
                client = self._core_client()
                error = EngineDeadError()
                queue = getattr(client, "outputs_queue", None)
                if queue is not None:
                    queue.put_nowait(error)
                for future in list(getattr(client, "utility_results", {}).values()):
                    if not future.done():
                        future.set_exception(error)
                log.error("%s", self._core_exit())
                return
            time.sleep(ENGINE_WATCH_S)

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
            self._remove_scratch()

    def _remove_scratch(self) -> None:
        shutil.rmtree(self.scratch_dir, ignore_errors=True)
        if self.transfer_dir is not None:
            shutil.rmtree(self.transfer_dir, ignore_errors=True)
        restore_environment(self._previous_env)


class WeightLoadingExtension:
    """Mixed into vLLM's worker class (``worker_extension_cls``): called by name through
    ``collective_rpc``, which a separate engine process accepts without pickling code. In-process,
    arguments arrive as they are (a lazy iterable of tensors); across processes, as file paths."""

    model_runner: Any

    def streamrl_reload(self, weights: Iterable[tuple[str, Tensor]]) -> int:
        """In-process engine core: the whole version through vLLM's ``reload_weights``."""
        self.model_runner.reload_weights(weights_iterator=iter(weights))
        return 0

    def streamrl_begin_reload(self) -> int:
        """``reload_weights`` split in three so its weights can arrive over several calls: layers are
        processed (repacked) as soon as all their tensors are in, whichever call brings them."""
        from vllm.model_executor.model_loader.reload.layerwise import initialize_layerwise_reload

        initialize_layerwise_reload(self.model_runner.get_model())
        return 0

    def streamrl_load_file(self, path: str) -> int:
        with safe_open(path, "pt") as f:
            names = list(f.keys())
            self.model_runner.get_model().load_weights((name, f.get_tensor(name)) for name in names)
        return len(names)

    def streamrl_finish_reload(self) -> int:
        from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

        runner = self.model_runner
        finalize_layerwise_reload(runner.get_model(), runner.vllm_config.model_config)
        return 0
