"""Train engine on torch FSDP2 (``fully_shard``) and DTensor tensor parallelism, any HF causal LM.

The one train engine, R = 1 included (``logprobs``, ``accumulate``, ``step``, ``zero_grad``,
``set_lr``, ``pending``), over R = dp × tp ranks:

- ``fully_shard`` on every decoder layer (the classes in the model's ``_no_split_modules``) and
  on the root, over the ``dp`` dimension of a :class:`DeviceMesh` whose device type is the
  engine's device (gloo on CPU, nccl on CUDA, hccl on NPU: the same code).
- At one rank without CPU offload (``wrapped`` False) the module is trained as it is: there FSDP2
  has nothing to shard, and its per-layer gathers and reduce-scatters, which only copy at one
  rank, cost a small model's micro-batch about 40 % (docs/benchmarks.md §25). In float32 the same
  kernels run on the same full tensors, so the update is the wrapped one's bit for bit
  (``wrap_single_rank`` keeps FSDP2 there, for a side-by-side; on CUDA with torch's deterministic
  algorithms, and otherwise within the last bits its atomic-add kernels change from run to run).
  With a compute ``dtype`` each forward runs on the float32 parameters cast to it, as FSDP2's
  ``MixedPrecisionPolicy`` gathers them: the gradients flow back through the casts into the float32
  masters, bit for bit the wrapped update, on a CPU and on CUDA alike (docs/benchmarks.md §42).
- With ``tensor_parallel`` T > 1 the mesh is (dp, tp) and each layer is first
  ``parallelize_module``'d over tp (column-wise q/k/v/gate/up, row-wise o/down), giving FSDP × TP.
- The Hugging Face module's own forward runs (no functional re-implementation), so any
  architecture transformers can build trains here; only TP needs Llama-style projection names.
  Each distinct prompt of a micro-batch is computed once where the model allows it
  (:mod:`streamrl.engines.packing`; ``forward_path`` and the log say which).
- torch's AdamW over the sharded DTensor parameters: optimizer state is sharded like them.

Exact normalisation across ranks: ``accumulate`` backpropagates an unnormalised *sum* of
per-token losses (as the single-process engine) and FSDP2 reduce-scatters gradients with SUM
(its default would average over dp); ``step`` divides by the step's token / sequence count
summed over the dp ranks (all-reduced here unless the caller passes it), so R ranks give the
update one rank gives on the union of their samples, whatever the split.

Collectives: ``logprobs``, ``accumulate``, ``accumulate_padding``, ``step``, the state-dict and
checkpoint calls are collective over the mesh. Every rank must make the same calls in the same
order; a rank that ran out of micro-batches while others still have some calls
``accumulate_padding()`` (a forward+backward that adds zero gradient) once per missing one. The
tp ranks of one dp rank must pass identical micro-batches.

Precision: the sharded master weights, gradients and AdamW moments are float32; ``dtype``
bfloat16/float16 is the compute dtype of the all-gathered parameters (FSDP2's
``MixedPrecisionPolicy``), gradients are reduced in float32, and the log-softmax of the loss runs
in float32. float16 has no loss scaling here: prefer bfloat16.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Literal

import msgspec
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.distributed.tensor import DTensor
from torch.nn.utils.stateless import _reparametrize_module  # torch.func.functional_call's, as a block
from torch.utils._foreach_utils import _get_fused_kernels_supported_devices
from transformers import PreTrainedTokenizerBase

from streamrl.algos.aggregation import DENOMINATORS, denominator_of, denominator_value
from streamrl.algos.grpo import (
    LossConfig,
    loss_denominator,
    per_token_loss,
    unnormalized_loss,
    zero_at_zero_advantage,
)
from streamrl.engines.core_share import rebalance_at_layers, rebalance_for_elementwise
from streamrl.engines.packing import (
    DEFAULT_MAX_ROW_TOKENS,
    DEFAULT_SHARED_PREFIX_MIN_PADDING,
    DEFAULT_SHARED_PREFIX_MIN_WIDTH,
    ForwardPath,
    ResponseForward,
    flat_response_index,
)
from streamrl.engines.parallel import (
    ParallelConfigError,
    apply_tensor_parallel,
    build_mesh,
    decoder_layers,
    dp_mesh,
    grad_norm,
    local,
    tp_mesh,
)
from streamrl.engines.samples import (
    NothingAccumulatedError,
    StepSums,
    TrainBatchError,
    TrainSample,
    check_sample,
)
from streamrl.models.build import resolve_device, write_export_version
from streamrl.reshard.accounting import SwapReport

log = logging.getLogger("streamrl.engine.train")

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class StateOffloadedError(RuntimeError):
    """Compute or a state read was asked for while the training state is offloaded to the host."""


class FSDPOptions(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How the model is sharded and computed (validated at construction)."""

    dtype: Literal["float32", "bfloat16", "float16"] = "float32"  # compute dtype; master weights stay float32
    tensor_parallel: int = 1  # T: ranks per model replica (DTensor TP); data parallel = world / T
    activation_checkpointing: bool = False  # recompute each decoder layer in backward (transformers' own)
    cpu_offload: bool = False  # keep sharded params, grads and AdamW state on the host (FSDP2 CPUOffloadPolicy)
    # free each layer's gathered params after its forward and gather them again in its backward.
    # Also with one dp rank: FSDP2 gathers into an unsharded copy of each layer at any world size,
    # so keeping every layer gathered until backward holds a second fp32 copy of the weights at the
    # activation peak (docs/benchmarks.md §15), for one extra copy per layer per micro-batch
    reshard_after_forward: bool = True
    # compute each distinct prompt of a micro-batch once (streamrl/engines/packing.py); used only
    # where a probe at construction shows the model computes packed rows exactly
    pack_prompts: bool = True
    max_row_tokens: int = DEFAULT_MAX_ROW_TOKENS  # tokens per packed row (its mask is width^2)
    # on packed rows, attend each completion to its prompt and itself only instead of through the
    # dense width^2 mask (streamrl/engines/prefix_attention.py); used only where a probe shows it exact
    shared_prefix_attention: bool = True
    # ... in filled rows, for micro-batches whose rows, one prompt group each, would be at least this
    # wide (tokens) or pad at least this many tokens; others: one group per row and the dense mask
    shared_prefix_min_width: int = DEFAULT_SHARED_PREFIX_MIN_WIDTH
    shared_prefix_min_padding: int = DEFAULT_SHARED_PREFIX_MIN_PADDING
    # fully_shard also at one rank without CPU offload, where the engine otherwise trains the module
    # unwrapped (FSDP2 would only copy there: see the module doc)
    wrap_single_rank: bool = False

    def __post_init__(self) -> None:
        if self.tensor_parallel < 1:
            raise ValueError(f"FSDPOptions.tensor_parallel must be >= 1, got {self.tensor_parallel}")
        if self.max_row_tokens < 2:
            raise ValueError(f"FSDPOptions.max_row_tokens must be >= 2, got {self.max_row_tokens}")


def _adamw_kernel(device: torch.device, tensor_parallel: int) -> dict[str, bool]:
    """AdamW's implementation: the fused kernel where torch has one, else foreach (per-parameter under TP).

    Every op of the foreach path on DTensors goes through DTensor's dispatcher, which dominates
    the optimizer step of a small model; the fused kernel is several times faster there. The fused
    kernel also takes the TP mix of (dp, tp)- and dp-meshed DTensors, which foreach refuses
    ("got mixed torch.Tensor and DTensor").
    """
    if device.type in _get_fused_kernels_supported_devices():
        return {"fused": True}
    return {"foreach": False} if tensor_parallel > 1 else {}


class FSDPTrainEngine:
    """Trains a Hugging Face causal LM sharded with FSDP2 (× DTensor TP) over a device mesh.

    ``model`` must be identical on every rank (same seed or same checkpoint) and hold float32
    weights (cast here otherwise: they become the master copy). The module is sharded in place:
    afterwards its parameters are DTensors (unless ``wrapped`` is False: one rank, see the module
    doc) and the engine owns it.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        weight_decay: float = 0.0,
        eps: float = 1e-8,
        max_grad_norm: float | None = 1.0,
        device: str | torch.device = "auto",
        options: FSDPOptions = FSDPOptions(),
        mesh: DeviceMesh | None = None,
    ) -> None:
        """AdamW hyper-parameters as torch's; ``max_grad_norm`` None = no clipping.

        ``mesh``: a 1-D ``(dp,)`` or 2-D ``(dp, tp)`` mesh with those names; None builds one over
        the whole default process group (which must be initialised, a world of 1 included).
        """
        if not lr > 0.0:
            raise ValueError(f"lr must be > 0, got {lr}")
        if max_grad_norm is not None and not max_grad_norm > 0.0:
            raise ValueError(f"max_grad_norm must be > 0 or None, got {max_grad_norm}")
        self.device = resolve_device(device)
        if self.device.type != "cpu" and self.device.index is not None:
            # FSDP2 and DeviceMesh use the *current* accelerator; make it the one asked for.
            getattr(torch, self.device.type).set_device(self.device)
        self.options = options
        self.mesh = mesh if mesh is not None else build_mesh(self.device.type, options.tensor_parallel)
        if self.mesh.ndim > 2 or (self.mesh.ndim == 2 and self.mesh.mesh_dim_names != ("dp", "tp")):
            raise ParallelConfigError(
                f"mesh must be 1-D (dp,) or 2-D with mesh_dim_names ('dp', 'tp'), got {self.mesh.ndim}-D "
                f"{self.mesh.mesh_dim_names}; build it with streamrl.engines.parallel.build_mesh"
            )
        if self.mesh.device_type != self.device.type:
            raise ParallelConfigError(
                f"the mesh is on {self.mesh.device_type!r} but the engine's device is {str(self.device)!r}"
            )
        self.dp_mesh = dp_mesh(self.mesh)
        self.tp_mesh = tp_mesh(self.mesh)
        tp = 1 if self.tp_mesh is None else self.tp_mesh.size()
        if tp != options.tensor_parallel:
            raise ParallelConfigError(f"the mesh has tp={tp} but options.tensor_parallel={options.tensor_parallel}")
        self.dp_size = self.dp_mesh.size()
        self.dp_rank = self.dp_mesh.get_local_rank()
        self.max_grad_norm = max_grad_norm
        self.compute_dtype = DTYPES[options.dtype]
        self.master_dtype = torch.float32  # sharded parameters, gradients and AdamW moments
        if any(p.dtype != torch.float32 for p in model.parameters()):
            model = model.to(torch.float32)  # the sharded copy is the optimizer's master: keep it float32
        self.model = model
        # before sharding: the probe's two tiny forwards run on the plain module, no collective
        self.forward = ResponseForward(model.to(self.device), self.device, pack_prompts=options.pack_prompts,
                                       max_row_tokens=options.max_row_tokens,
                                       shared_prefix=options.shared_prefix_attention,
                                       shared_prefix_min_width=options.shared_prefix_min_width,
                                       shared_prefix_min_padding=options.shared_prefix_min_padding)
        log.info("train forward: %s (%s)", self.forward.path, self.forward.why)
        # FSDP2 only where it has something to do: shards to hold (more than one rank) or the state
        # to keep on the host. A compute dtype at one rank is a cast per forward (_in_compute_dtype),
        # exact and faster than FSDP2's mixed precision on a CPU and on CUDA (docs/benchmarks.md §42)
        self.wrapped = self.mesh.size() > 1 or options.wrap_single_rank or options.cpu_offload
        # every forward computes on the module's own parameters as they are (unwrapped, float32): a
        # rollout engine on the module then samples the policy it trains, with no copy
        self.forwards_on_its_parameters = not self.wrapped and self.compute_dtype == torch.float32
        if self.wrapped:
            self._shard(model)
        else:
            self._prepare_unwrapped(model)
            log.info("train engine: one rank in %s over float32 weights, the module unwrapped (FSDP2 would only "
                     "copy here)", options.dtype)
        self.params = [p for p in model.parameters() if p.requires_grad]
        if not self.params:
            raise ValueError("the model has no trainable parameters (requires_grad is False everywhere)")
        self._local_elements = sum(local(p.data).numel() for p in self.params)  # what the optimizer step sweeps
        self.optimizer = torch.optim.AdamW(
            self.params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, **_adamw_kernel(self.device, tp),
        )
        self.steps = 0  # optimizer steps taken = policy version of the current weights
        self._sums = StepSums()
        self._on_host = False

    def _enable_activation_checkpointing(self, model: nn.Module) -> None:
        if not getattr(model, "supports_gradient_checkpointing", False):
            raise ParallelConfigError(
                f"{type(model).__name__} does not support activation checkpointing "
                "(transformers' supports_gradient_checkpointing is False); set activation_checkpointing=False"
            )
        # Non-reentrant, the form FSDP2 supports: the reentrant one runs a nested backward per
        # layer and needs inputs that require grad.
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    def _prepare_unwrapped(self, model: nn.Module) -> None:
        if self.options.activation_checkpointing:
            self._enable_activation_checkpointing(model)
        rebalance_at_layers(decoder_layers(model))  # as _shard: the host's cores, layer by layer

    def _shard(self, model: nn.Module) -> None:
        options = self.options
        layers = decoder_layers(model)
        if self.tp_mesh is not None:
            apply_tensor_parallel(layers, self.tp_mesh)
        if options.activation_checkpointing:
            self._enable_activation_checkpointing(model)
        mp = MixedPrecisionPolicy()
        if self.compute_dtype != torch.float32:
            mp = MixedPrecisionPolicy(param_dtype=self.compute_dtype, reduce_dtype=torch.float32)
        offload: OffloadPolicy = CPUOffloadPolicy(pin_memory=self.device.type != "cpu") if options.cpu_offload \
            else OffloadPolicy()
        rebalance_at_layers(layers)  # a run's share of the host's cores, layer by layer (core_share.py)
        for layer in layers:
            fully_shard(layer, mesh=self.dp_mesh, mp_policy=mp, offload_policy=offload,
                        reshard_after_forward=options.reshard_after_forward)
        fully_shard(model, mesh=self.dp_mesh, mp_policy=mp, offload_policy=offload)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                # SUM, not FSDP2's default mean over dp: the backward holds unnormalised sums and
                # ``step`` divides by the global count, which already includes every dp rank.
                # Forcing plain SUM comms also avoids PREMUL_SUM, which gloo does not have.
                module.set_gradient_divide_factor(1.0)
                module.set_force_sum_reduction_for_comms(True)

    # --- forward ------------------------------------------------------------------------------
    @property
    def forward_path(self) -> ForwardPath:
        """"packed" (shared prompts computed once) or "padded" (see streamrl/engines/packing.py)."""
        return self.forward.path

    def check_on_device(self) -> None:
        """Raise StateOffloadedError while the state is offloaded (compute would read host memory)."""
        if self._on_host:
            raise StateOffloadedError(
                "the training state is offloaded to the host (inference phase); call reload_state() first"
            )

    def _response_logprobs(
        self, prompt_ids: Sequence[Tensor], response_ids: Sequence[Tensor], temperature: float, entropy: bool,
        entropy_grad: bool = False,
    ) -> tuple[Tensor, Tensor | None, Tensor]:
        """Logprobs [N] (float32) of every response token (flat, sample order), entropy [N] or None, seq_index [N].
        ``entropy_grad``: the entropy keeps its graph (an entropy bonus trains on it).

        The module's own forward (so FSDP2's hooks run) on shared-prompt rows or right-padded rows
        (``forward_path``, streamrl/engines/packing.py); the last response token is never an input.
        Logits are computed only from the earliest position that predicts a response token on
        (``logits_to_keep``) where the model supports it.
        """
        with self._in_compute_dtype():
            logp, logp_all = self.forward.logprobs(prompt_ids, response_ids, temperature)
        ent = None
        if entropy_grad:
            ent = -(logp_all.exp() * logp_all).sum(-1)
        elif entropy:
            with torch.no_grad():
                ent = -(logp_all.exp() * logp_all).sum(-1)
        seq_index, _ = flat_response_index(response_ids, self.device)
        return logp, ent, seq_index

    @contextlib.contextmanager
    def _in_compute_dtype(self) -> Iterator[None]:
        """Unwrapped with a compute dtype: the module's forwards inside the block run on its float32
        parameters cast to it (what FSDP2's MixedPrecisionPolicy computes on), recorded by autograd,
        so each gradient comes back through its cast as float32 into the parameter's ``.grad``.
        Wrapped, or in float32: nothing to do (FSDP2 casts as it gathers). The casts live until the
        backward, as FSDP2's gathered copies do without ``reshard_after_forward``: half the float32
        weights' bytes more at the activation peak (bfloat16)."""
        if self.wrapped or self.forwards_on_its_parameters:
            yield
            return
        casts = {name: p.to(self.compute_dtype) for name, p in self.model.named_parameters()}
        with _reparametrize_module(self.model, casts, tie_weights=True):
            yield

    @torch.no_grad()
    def logprobs(
        self, prompt_ids: Sequence[Tensor], response_ids: Sequence[Tensor], temperature: float = 1.0
    ) -> list[Tensor]:
        """Per-sample logprobs [R_i] (float32, CPU) of the response tokens, no gradient (collective).

        A rank with nothing to score passes empty lists: it still runs a one-token forward, for
        the other ranks' all-gathers, and gets ``[]``.
        """
        self.check_on_device()
        if len(prompt_ids) != len(response_ids):
            raise TrainBatchError(f"{len(prompt_ids)} prompts but {len(response_ids)} responses")
        for i, (p, r) in enumerate(zip(prompt_ids, response_ids, strict=True)):
            check_sample(i, TrainSample(p, r, 0.0))
        was_training = self.model.training
        self.model.eval()
        try:
            if not prompt_ids:
                self.model(input_ids=torch.zeros((1, 1), dtype=torch.int64, device=self.device), use_cache=False)
                return []
            logp, _, _ = self._response_logprobs(prompt_ids, response_ids, temperature, entropy=False)
        finally:
            self.model.train(was_training)
            self._reshard()
        return list(logp.cpu().split([r.numel() for r in response_ids]))

    # --- training -----------------------------------------------------------------------------
    def accumulate(self, batch: Sequence[TrainSample], loss_config: LossConfig) -> dict[str, float]:
        """Forward + backward of this rank's micro-batch; gradients are summed until ``step`` (collective).

        Samples with advantage exactly 0 are only counted when ``kl_coef`` is 0 (their gradient is
        exactly zero, which makes uniform-reward GRPO groups free); but a micro-batch made only of them still runs a zero-gradient
        forward/backward, since the other ranks' FSDP collectives wait for this rank's.
        Returns this micro-batch's statistics (loss normalised within it, for display only).
        """
        self.check_on_device()
        if not batch:
            raise TrainBatchError("empty micro-batch; a rank with nothing left calls accumulate_padding()")
        for i, s in enumerate(batch):
            check_sample(i, s)
        if self._sums.mode not in (None, loss_config.loss_agg):
            raise ValueError(
                f"loss_agg changed within one optimizer step ({self._sums.mode!r} -> {loss_config.loss_agg!r})"
            )
        for field in ("old_logprobs", "rollout_logprobs", "ref_logprobs"):
            present = [getattr(s, field) is not None for s in batch]
            if any(present) and not all(present):
                raise TrainBatchError(f"{field} is given for some samples of the micro-batch but not all")
        sums = self._sums
        sums.mode = loss_config.loss_agg
        sums.micro_batches += 1
        all_tokens = sum(s.trained_tokens() for s in batch)  # loss_mask 0-tokens are not in the loss
        all_seqs = len(batch)
        norm_tokens = loss_config.norm_tokens or 1
        if sums.norm_tokens not in (None, norm_tokens):
            raise ValueError(f"norm_tokens changed within one optimizer step ({sums.norm_tokens} -> {norm_tokens})")
        sums.norm_tokens = norm_tokens
        local_denominator = max(loss_denominator(loss_config.loss_agg, all_tokens, all_seqs, norm_tokens), 1)
        if zero_at_zero_advantage(loss_config):
            # A zero advantage gives an exactly zero loss and gradient (built-in loss, no KL term): count only.
            active = [s for s in batch if s.has_signal()]
            sums.skipped_tokens += all_tokens - sum(s.trained_tokens() for s in active)
            sums.skipped_sequences += all_seqs - len(active)
            if not active:
                self._zero_backward()
                return {"loss": 0.0, "tokens": float(all_tokens), "sequences": float(all_seqs),
                        "skipped_sequences": float(all_seqs)}
            batch = active
        device = self.device
        self.model.train()
        logp, entropy, seq_index = self._response_logprobs(
            [s.prompt_ids for s in batch], [s.response_ids for s in batch], loss_config.temperature,
            entropy=loss_config.compute_entropy or loss_config.entropy_coef > 0,
            entropy_grad=loss_config.entropy_coef > 0,
        )
        # Only the tokens the policy sampled are trained (loss_mask 1): the others are dropped here,
        # so the loss, its denominators and every statistic count trained tokens only.
        keep: Tensor | None = None
        if any(s.loss_mask is not None for s in batch):
            keep = torch.cat([s.loss_mask.to(torch.bool) if s.loss_mask is not None
                              else torch.ones(s.response_ids.numel(), dtype=torch.bool) for s in batch]).to(device)
            logp, seq_index = logp[keep], seq_index[keep]
            entropy = entropy[keep] if entropy is not None else None
        n_tokens, n_seqs = logp.numel(), len(batch)

        def column(name: str) -> Tensor | None:
            if getattr(batch[0], name) is None:
                return None
            values = torch.cat([getattr(s, name) for s in batch]).to(device=device, dtype=torch.float32)
            return values if keep is None else values[keep]

        advantages = torch.cat([s.token_advantages() for s in batch]).to(device)
        advantages = advantages if keep is None else advantages[keep]
        per_token, stats = per_token_loss(
            logp, advantages, loss_config, seq_index=seq_index, entropy=entropy, old_logprobs=column("old_logprobs"),
            rollout_logprobs=column("rollout_logprobs"), ref_logprobs=column("ref_logprobs"),
        )
        loss_sum = unnormalized_loss(per_token, seq_index, n_seqs, loss_config.loss_agg)
        loss_sum.backward()

        loss_value = float(loss_sum.detach())
        sums.loss += loss_value
        sums.tokens += n_tokens
        sums.sequences += n_seqs
        sums.clipped += float(stats["clipped"].sum())
        sums.approx_kl += float(stats["approx_kl"].sum())
        if entropy is not None:
            sums.entropy += float(entropy.detach().sum())
        if "kl" in stats:
            sums.kl += float(stats["kl"].sum())
            sums.kl_tokens += n_tokens
        if "is_weight" in stats:
            sums.is_weight += float(stats["is_weight"].sum())
            sums.is_tokens += n_tokens
        out = {
            "loss": loss_value / local_denominator,
            "tokens": float(all_tokens),
            "sequences": float(all_seqs),
            "skipped_sequences": float(all_seqs - n_seqs),
            "clip_fraction": float(stats["clipped"].mean()) if n_tokens else 0.0,
        }
        if entropy is not None and n_tokens:
            out["entropy"] = float(entropy.detach().mean())
        return out

    def _reshard(self) -> None:
        """Free the gathered parameters a no-grad forward left behind.

        Without a backward nothing reshards them (FSDP2 keeps the root's, and with
        ``reshard_after_forward`` False every layer's, gathered until the backward), and while
        gathered the module's parameters are plain full tensors, not the sharded DTensors
        ``local_shards``, ``full_state_dict`` and the optimizer read.
        """
        for module in self.model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()

    def accumulate_padding(self) -> None:
        """A forward+backward adding zero gradient, matching another rank's extra micro-batch (collective).

        Counts nothing: the step's denominators are those of the real samples.
        """
        self.check_on_device()
        self._zero_backward()

    def _zero_backward(self) -> None:
        # One token through the whole module keeps this rank's all-gathers and reduce-scatters in
        # step with the others'; multiplying by 0 makes its gradient contribution exactly zero.
        self.model.train()
        ids = torch.zeros((1, 1), dtype=torch.int64, device=self.device)
        logits = self.model(input_ids=ids, use_cache=False).logits
        (logits.float().sum() * 0.0).backward()

    def pending(self) -> dict[str, int]:
        """This rank's tokens, sequences and micro-batches since the last step (skipped ones included)."""
        s = self._sums
        return {"tokens": s.tokens + s.skipped_tokens, "sequences": s.sequences + s.skipped_sequences,
                "micro_batches": s.micro_batches}

    def _reduced_sums(self) -> list[float]:
        """The step's running sums added over the dp ranks (tp ranks share their dp rank's samples).

        Then the summed norm_tokens of the ranks that accumulated, and last the count of dp ranks
        per loss aggregation mode: a rank that only padded knows no mode or norm_tokens of its own
        and takes the others' (every accumulating rank has the step's LossConfig).
        """
        s = self._sums
        # the step's denominator kind, one count per kind: every aggregation (a user's too) has one
        kind = denominator_of(s.mode) if s.mode is not None else None
        modes = [1.0 if kind == k else 0.0 for k in DENOMINATORS]
        values = [s.loss, s.tokens, s.sequences, s.skipped_tokens, s.skipped_sequences, s.micro_batches,
                  s.clipped, s.approx_kl, s.entropy, s.kl, s.kl_tokens, s.is_weight, s.is_tokens,
                  float(s.norm_tokens or 0), *modes]
        t = torch.tensor(values, dtype=torch.float64, device=self.mesh.device_type)
        if self.dp_size > 1:
            dist.all_reduce(t, group=self.dp_mesh.get_group())
        return t.tolist()

    def step(self, *, global_tokens: int | None = None, global_sequences: int | None = None) -> dict[str, float]:
        """Normalise the summed gradients, clip, AdamW step, zero gradients (collective).

        The denominators are the step's token / sequence counts over all dp ranks: all-reduced
        here from each rank's ``pending()``, or ``global_tokens`` / ``global_sequences`` when the
        caller knows them (each dp rank's samples counted once, not once per tp rank). The
        returned statistics are the global ones, equal on every rank. A rank that only called
        ``accumulate_padding`` this step takes part like the others.
        """
        self.check_on_device()
        rebalance_for_elementwise(self._local_elements)  # its threads for what follows (core_share.py)
        reduced = self._reduced_sums()
        (loss, tokens, seqs, skipped_tokens, skipped_seqs, micro_batches, clipped, approx_kl, entropy, kl,
         kl_tokens, is_weight, is_tokens, norm_tokens_sum) = reduced[:14]
        # The decision below is taken from all-reduced values, so every rank raises alike and
        # none is left waiting in the next collective.
        modes = [kind for kind, count in zip(DENOMINATORS, reduced[14:], strict=True) if count > 0]
        if not modes:
            raise NothingAccumulatedError(
                f"step() called before any accumulate() since the last step (on all {self.dp_size} dp ranks)"
            )
        if len(modes) > 1:
            self.zero_grad()
            raise ValueError(
                f"the dp ranks accumulated with loss aggregations of different denominators {modes} in one step; "
                "every rank must use the step's LossConfig (the step's gradients were dropped)"
            )
        mode = modes[0]
        all_tokens = int(tokens + skipped_tokens) if global_tokens is None else global_tokens
        all_seqs = int(seqs + skipped_seqs) if global_sequences is None else global_sequences
        # seq-mean-token-sum-norm's constant: the step's LossConfig's, from the ranks that accumulated
        norm_tokens = max(round(norm_tokens_sum / sum(reduced[14:])), 1)
        denominator = denominator_value(mode, all_tokens, all_seqs, norm_tokens)
        grads = [local(p.grad) for p in self.params if p.grad is not None]
        if denominator > 0 and grads:
            torch._foreach_div_(grads, float(denominator))
        norm = grad_norm(self.params, self.mesh)
        if self.max_grad_norm is not None:
            # torch's clip_grad_norm_ rule (the single-process engine's), on the local pieces
            coef = min(self.max_grad_norm / (norm + 1e-6), 1.0)
            if coef < 1.0 and grads:
                torch._foreach_mul_(grads, coef)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps += 1
        stats = {
            "step": float(self.steps),
            "loss": loss / max(denominator, 1),
            "grad_norm": norm,
            "lr": float(self.optimizer.param_groups[0]["lr"]),
            "tokens": tokens + skipped_tokens,
            "sequences": seqs + skipped_seqs,
            "skipped_sequences": skipped_seqs,
            "micro_batches": micro_batches,
            "clip_fraction": clipped / max(tokens, 1),
            "approx_kl": approx_kl / max(tokens, 1),
            "entropy": entropy / max(tokens, 1),
        }
        if kl_tokens:
            stats["kl"] = kl / kl_tokens
        if is_tokens:
            stats["is_weight"] = is_weight / is_tokens
        self._sums = StepSums()
        return stats

    def zero_grad(self) -> None:
        """Drop accumulated gradients and counts without stepping (local; no collective)."""
        self.optimizer.zero_grad(set_to_none=True)
        self._sums = StepSums()

    def set_lr(self, lr: float) -> None:
        """Change the learning rate of every parameter group (schedules live outside)."""
        if not lr > 0.0:
            raise ValueError(f"lr must be > 0, got {lr}")
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    # --- weights ------------------------------------------------------------------------------
    def local_shards(self) -> dict[str, Tensor]:
        """This rank's pieces of every parameter (DTensor ``to_local()``; the reshard's input). Read only.

        Names are the model's parameter names; each piece is this rank's dim-0 FSDP shard of its
        TP slice (unpadded: the last ranks' pieces can be shorter or empty). The DTensor itself
        (``dict(model.named_parameters())[name]``) gives its mesh and placements. Unwrapped (one
        rank), each piece is the whole parameter.
        """
        self.check_on_device()
        return {name: local(p.data) for name, p in self.model.named_parameters()}

    def memory_bytes(self) -> dict[str, int]:
        """Bytes this rank holds for parameters, gradients and AdamW moments (its shards; local).

        The all-gathered layer being computed and activations are transient and not counted
        (``ops/bench/fsdp_engine.py`` reports these bytes per rank).
        """
        def size(tensors: list[Tensor]) -> int:
            return sum(t.numel() * t.element_size() for t in tensors)

        moments = [local(v) for state in self.optimizer.state.values() for v in state.values()
                   if isinstance(v, Tensor) and v.dim() > 0]
        return {"parameters": size([local(p.data) for p in self.params]),
                "gradients": size([local(p.grad) for p in self.params if p.grad is not None]),
                "optimizer": size(moments)}

    def full_state_dict(self, *, all_ranks: bool = False, copy: bool = True) -> dict[str, Tensor]:
        """The full float32 parameters and buffers on the host (collective), owned by the caller.

        Rank 0 only by default (the other ranks get ``{}``: a full copy per rank is wasted host
        memory on a real model); ``all_ranks=True`` returns it everywhere.

        Buffer lifetime: the tensors are fresh copies, never views of the live parameters, so a
        caller may keep serving them while the next steps update the model in place. With
        ``copy=False`` they are the gathered tensors as they come, on the training device: views of
        the live parameters where one rank holds them whole, for a caller that copies them itself
        before the next step (the policy publisher's snapshot).
        """
        self.check_on_device()
        keep = all_ranks or self.is_first_rank
        out: dict[str, Tensor] = {}
        for name, t in self.model.state_dict().items():
            if isinstance(t, DTensor):
                # a mesh of one holds the whole tensor locally: skip full_tensor()'s DTensor dispatch,
                # which costs a small model a large share of its training step
                t = t.to_local() if t.device_mesh.size() == 1 else t.full_tensor()  # collective
            if keep:
                # copy=True: never a view of the live parameters (at one rank, to_local() is one)
                out[name] = t.detach().to("cpu", copy=True) if copy else t.detach()
        return out

    def export_pretrained(
        self, path: str | Path, tokenizer: PreTrainedTokenizerBase | None = None, *,
        dtype: torch.dtype | None = None,
    ) -> Path:
        """Write the full policy as a ``save_pretrained`` directory (safetensors) from rank 0 (collective).

        ``dtype`` casts the floating weights (e.g. bfloat16 for serving); None keeps float32.
        """
        path = Path(path)
        state = self.full_state_dict()
        if self.is_first_rank:
            if dtype is not None:
                state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
            path.mkdir(parents=True, exist_ok=True)
            self.model.save_pretrained(path, state_dict=state)  # type: ignore[operator]
            if dtype is not None:
                # save_pretrained records the live (float32) module's dtype; from_pretrained(dtype="auto")
                # must load what the files hold.
                config_file = path / "config.json"
                config = json.loads(config_file.read_text())
                config["dtype"] = str(dtype).removeprefix("torch.")
                config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
            if tokenizer is not None:
                tokenizer.save_pretrained(path)
            write_export_version(path, self.steps)  # the policy version these weights are
        self.barrier()  # nobody reads the directory before rank 0 has written it
        return path

    @property
    def is_first_rank(self) -> bool:
        """This rank is the mesh's first (the one that keeps gathered state and writes files); not
        necessarily world rank 0 where the world holds more than the train ranks."""
        return self.mesh.get_rank() == int(self.mesh.mesh.flatten()[0])

    def barrier(self) -> None:
        """Wait for every rank of the mesh (not the whole world: in the disaggregated placement the
        world also holds the generation workers, which take no part in training collectives)."""
        for dim in range(self.mesh.ndim):
            if self.mesh.size(dim) > 1:
                dist.barrier(group=self.mesh.get_group(dim))

    # --- offload ------------------------------------------------------------------------------
    @property
    def state_on_host(self) -> bool:
        return self._on_host

    def _state_tensors(self) -> list[Tensor]:
        tensors = [local(p.data) for p in self.params]
        tensors += [local(p.grad) for p in self.params if p.grad is not None]
        for state in self.optimizer.state.values():
            tensors += [local(v) for v in state.values() if isinstance(v, Tensor) and v.dim() > 0]
        return tensors

    def offload_state(self) -> SwapReport:
        """Move the sharded parameters, gradients and AdamW moments to host memory (local, blocking).

        ``module.to`` is FSDP2's supported way (it re-registers its sharded parameters, keeping the
        Parameter objects AdamW holds). Copies are non-blocking and synchronised once per
        direction; a non-blocking device-to-host copy lands in page-locked memory (torch pins the
        output), so the way back is asynchronous too. With ``cpu_offload`` the state already
        lives on the host, and on a CPU device there is no other memory: nothing moves (0 bytes).
        """
        if self._on_host:
            raise StateOffloadedError("the training state is already offloaded; call reload_state() first")
        report = self._move(torch.device("cpu"), "to_host")
        self._on_host = True
        return report

    def reload_state(self) -> SwapReport:
        """Bring the training state back to the engine's device (local, blocking)."""
        if not self._on_host:
            raise StateOffloadedError("the training state is on the device already; offload_state() first")
        report = self._move(self.device, "to_device")
        self._on_host = False
        return report

    def _move(self, target: torch.device, direction: str) -> SwapReport:
        t0 = time.perf_counter()
        tensors = self._state_tensors()
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        if self.options.cpu_offload or self.device.type == "cpu":
            # Nothing to move: the state already lives in host memory.
            return SwapReport(direction, 0, 0, time.perf_counter() - t0, False)
        non_blocking = True
        self.model.to(target, non_blocking=non_blocking)  # parameters and their gradients
        for state in self.optimizer.state.values():
            for key, value in state.items():
                # AdamW's ``step`` is a host scalar unless capturable: it stays put.
                if isinstance(value, Tensor) and value.dim() > 0:
                    state[key] = value.to(target, non_blocking=non_blocking)
        getattr(torch, self.device.type).synchronize()
        return SwapReport(direction, len(tensors), nbytes, time.perf_counter() - t0, False)
