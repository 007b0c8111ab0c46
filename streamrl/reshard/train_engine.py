"""A minimal sharded train engine that really trains in the training layout of :mod:`layout`.

Storage: every rank keeps only its padded dim-0 shard of its TP chunk of every parameter
(:mod:`shards`), and the AdamW moments are allocated by a stock ``torch.optim.AdamW`` over those
shards, so optimizer state is sharded exactly alike.

A step: all-gather each parameter over the data-parallel group (giving this rank's TP chunk),
run the Hugging Face module with those tensors (``torch.func.functional_call``; P > 1 adds
Megatron's f/g operators as hooks: all-reduce after the row-parallel ``o_proj``/``down_proj``
in forward, all-reduce of the input gradient of the column-parallel attention/MLP inputs in
backward), backward, reduce-scatter the gradients over the data-parallel group (mean), clip by
the global norm across the whole train group, and step AdamW on the shards.

Simplification (documented in docs/reshard.md): the engine gathers all parameters for a step
instead of prefetching layer by layer as FSDP2 does; the *stored* state is sharded, which is
what the reshard and the swap act on. FSDP2/Megatron engines can sit behind the same two entry
points the reshard uses: :meth:`local_shards` and the swap.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from streamrl.reshard.accounting import SwapReport
from streamrl.reshard.collectives import all_gather_flat, reduce_scatter_flat
from streamrl.reshard.groups import TrainGroups
from streamrl.reshard.layout import LayoutError
from streamrl.reshard.shards import copy_rect, shard_tensor, source_blocks
from streamrl.reshard.spec import ModelShardingSpec, full_rect
from streamrl.reshard.swap import TrainStateSwap

LossFn = Callable[[torch.Tensor, Mapping[str, torch.Tensor]], torch.Tensor]


class TrainStateOffloadedError(RuntimeError):
    """A training step was asked for while the training state is swapped out to the host."""


@dataclass(frozen=True)
class AdamWConfig:
    lr: float = 1e-3  # learning rate per optimizer step
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0  # decoupled (AdamW) decay per step, relative
    max_grad_norm: float | None = 1.0  # global L2 norm over the whole model; None disables clipping


@dataclass(frozen=True)
class StepStats:
    step: int  # optimizer steps taken so far
    grad_norm: float  # global gradient norm before clipping


class _CopyToTensorParallel(torch.autograd.Function):
    """Megatron's f: identity forward, all-reduce of the gradient backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTensorParallel(torch.autograd.Function):
    """Megatron's g: all-reduce forward (sum of row-parallel partials), identity backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        out = x.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _GatherFromTensorParallel(torch.autograd.Function):
    """All-gather along the last dim forward (vocab-parallel logits), keep the local part backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        size, rank = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        return grad.chunk(size, dim=-1)[rank].contiguous(), None


def install_tensor_parallel_hooks(
    model: nn.Module, num_layers: int, group: dist.ProcessGroup, vocab_rows: int
) -> None:
    """Turn a Llama-style HF module with TP-sliced weights into a correct TP forward/backward.

    vocab_rows: rows of the vocab-parallel embedding / lm_head on this rank (vocab // P).
    """
    tp_rank = dist.get_rank(group)
    vocab_start = tp_rank * vocab_rows
    masks: dict[str, torch.Tensor] = {}

    def embed_ids(module: nn.Module, args: tuple) -> tuple:
        # vocab-parallel lookup: ids outside this rank's rows read row 0 and are zeroed after
        ids = args[0]
        masks["owned"] = (ids >= vocab_start) & (ids < vocab_start + vocab_rows)
        return ((ids - vocab_start).clamp(0, vocab_rows - 1), *args[1:])

    def embed_sum(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        output = output * masks.pop("owned").unsqueeze(-1).to(output.dtype)
        return _ReduceFromTensorParallel.apply(output, group)

    def lm_head_input(module: nn.Module, args: tuple) -> tuple:
        return (_CopyToTensorParallel.apply(args[0], group), *args[1:])

    def lm_head_gather(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        return _GatherFromTensorParallel.apply(output, group)

    def copy_args(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if "hidden_states" in kwargs:
            kwargs["hidden_states"] = _CopyToTensorParallel.apply(kwargs["hidden_states"], group)
        else:
            args = (_CopyToTensorParallel.apply(args[0], group), *args[1:])
        return args, kwargs

    def reduce_output(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        return _ReduceFromTensorParallel.apply(output, group)

    for i in range(num_layers):
        prefix = f"model.layers.{i}."
        model.get_submodule(prefix + "self_attn").register_forward_pre_hook(copy_args, with_kwargs=True)
        model.get_submodule(prefix + "self_attn.o_proj").register_forward_hook(reduce_output)
        model.get_submodule(prefix + "mlp").register_forward_pre_hook(copy_args, with_kwargs=True)
        model.get_submodule(prefix + "mlp.down_proj").register_forward_hook(reduce_output)
    embed = model.get_submodule("model.embed_tokens")
    if getattr(embed, "padding_idx", None) is not None:
        raise LayoutError(
            "train tensor_parallel > 1 needs an embedding without padding_idx (the vocab-parallel lookup "
            "shifts ids); build the model with pad_token_id=None"
        )
    embed.register_forward_pre_hook(embed_ids)
    embed.register_forward_hook(embed_sum)
    lm_head = model.get_submodule("lm_head")
    lm_head.register_forward_pre_hook(lm_head_input)
    lm_head.register_forward_hook(lm_head_gather)


class ShardedTrainEngine:
    """Trains a Hugging Face Llama-style causal LM in a sharded training layout.

    ``model`` must be built identically on every train rank (same seed or same checkpoint): the
    engine copies out this rank's shards and frees the module's full parameters, keeping the
    module only as the forward's code (and its buffers, e.g. rotary frequencies).
    """

    def __init__(
        self,
        model: nn.Module,
        spec: ModelShardingSpec,
        groups: TrainGroups,
        *,
        optimizer: AdamWConfig = AdamWConfig(),
        device: torch.device | str = "cpu",
    ) -> None:
        self.spec, self.groups, self.layout = spec, groups, groups.layout
        self.device = torch.device(device)
        spec.check_train_layout(self.layout)
        if self.layout.tensor_parallel > 1 and spec.model_type == "llama" and spec.attention_bias:
            raise LayoutError("train tensor_parallel > 1 with a row-parallel o_proj bias is not supported")
        named = dict(model.named_parameters())
        if set(named) != set(spec.names):
            extra, missing = sorted(set(named) - set(spec.names)), sorted(set(spec.names) - set(named))
            raise LayoutError(
                f"the model's parameters do not match the {spec.model_type} sharding spec: "
                f"unexpected {extra[:3]}, missing {missing[:3]}"
            )
        dtypes = {p.dtype for p in named.values()}
        if len(dtypes) != 1:
            raise LayoutError(
                f"all parameters must share one dtype to be bucketed, got {sorted(map(str, dtypes))}"
            )
        self.dtype = dtypes.pop()
        self.shards: dict[str, nn.Parameter] = {}
        for p in spec.params:
            shard = shard_tensor(named[p.name].detach(), p, self.layout, groups.rank)
            self.shards[p.name] = nn.Parameter(shard.to(self.device))
        for param in named.values():  # the module keeps no full copy; functional_call supplies tensors
            param.data = torch.empty(0, dtype=self.dtype)
        self.model = model.to(self.device)
        if groups.tp_group is not None:
            install_tensor_parallel_hooks(
                self.model,
                spec.num_layers,
                groups.tp_group,
                spec.vocab_size // self.layout.tensor_parallel,
            )
        self.optim_config = optimizer
        self.optimizer = torch.optim.AdamW(
            list(self.shards.values()),
            lr=optimizer.lr,
            betas=optimizer.betas,
            eps=optimizer.eps,
            weight_decay=optimizer.weight_decay,
        )
        self.swap = TrainStateSwap(list(self.shards.values()), self.optimizer, self.device)
        self.steps = 0

    # -- state ----------------------------------------------------------------------------------
    def local_shards(self) -> dict[str, torch.Tensor]:
        """This rank's parameter shards (the reshard's input). Do not write to them."""
        self._check_on_device()
        return {name: p.data for name, p in self.shards.items()}

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The full parameters, gathered over the train group (collective; tests and checkpoints)."""
        self._check_on_device()
        R = self.layout.world_size
        out: dict[str, torch.Tensor] = {}
        for p in self.spec.params:
            shard = self.shards[p.name].data
            gathered = torch.empty(R * shard.numel(), dtype=shard.dtype, device=shard.device)
            if self.groups.group is not None:
                all_gather_flat(gathered, shard.reshape(-1), group=self.groups.group)
            else:
                gathered.copy_(shard.reshape(-1))
            views = [
                (b.rect, gathered[r * shard.numel() : (r + 1) * shard.numel()].view(b.local_shape))
                for r, b in source_blocks(p, self.layout)
            ]
            full = torch.empty(p.shape, dtype=shard.dtype, device=shard.device)
            copy_rect(full, (0,) * len(p.shape), full_rect(p.shape), views)
            out[p.name] = full
        return out

    @property
    def state_on_host(self) -> bool:
        return self.swap.on_host

    def offload_state(self) -> SwapReport:
        """Move parameters, gradients and optimizer moments to host memory (blocking)."""
        return self.swap.to_host()

    def reload_state(self) -> SwapReport:
        """Bring the training state back to the device (blocking)."""
        return self.swap.to_device()

    def _check_on_device(self) -> None:
        if self.swap.on_host:
            raise TrainStateOffloadedError(
                "the training state is swapped out to the host (inference phase); reload_state() or "
                "`await policy.to_training()` first"
            )

    # -- compute --------------------------------------------------------------------------------
    def _gather_params(self, requires_grad: bool) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """(tensors for the forward, padded leaves whose .grad the backward fills), per parameter.

        With several data-parallel ranks all shards travel in *one* flat all-gather (FSDP's flat
        parameter): one collective per micro-batch instead of one per parameter, which on gloo
        and small models is what the step's time was made of (measured: ~40 ms of ~45 ms for the
        2-layer test model with 2 ranks).
        """
        dp_group, dp = self.groups.dp_group, self.layout.data_parallel
        forward: dict[str, torch.Tensor] = {}
        leaves: dict[str, torch.Tensor] = {}
        gathered: torch.Tensor | None = None
        if dp_group is not None:
            local = torch.cat([self.shards[p.name].data.reshape(-1) for p in self.spec.params])
            gathered = torch.empty((dp, local.numel()), dtype=local.dtype, device=local.device)
            all_gather_flat(gathered.view(-1), local, group=dp_group)
            del local
        offset = 0
        for p in self.spec.params:
            shard = self.shards[p.name].data
            if gathered is not None:
                n = shard.numel()
                # rank r's shard is row r's [offset, offset + n): stacked, they are the padded chunk
                padded = gathered[:, offset : offset + n].reshape(dp * shard.shape[0], *shard.shape[1:])
                offset += n
            else:
                padded = shard.detach()
            padded.requires_grad_(requires_grad)
            rows = p.shape[0] // self.layout.tensor_parallel if p.train_tp_dim == 0 else p.shape[0]
            leaves[p.name] = padded
            forward[p.name] = padded[:rows]
        return forward, leaves

    def _reduce_scatter_grads(self, leaves: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Each shard's gradient: the data-parallel mean of the leaves' gradients, rows of this rank.

        One flat reduce-scatter, laid out like the gather: row r of the input holds every
        parameter's rows for rank r, so the output is this rank's shards back to back.
        """
        dp_group, dp = self.groups.dp_group, self.layout.data_parallel
        grads: dict[str, torch.Tensor] = {}
        for name, leaf in leaves.items():
            assert leaf.grad is not None, f"{name} got no gradient"
        if dp_group is None:
            return {name: leaf.grad for name, leaf in leaves.items()}  # type: ignore[misc]
        sizes = [self.shards[p.name].numel() for p in self.spec.params]
        flat = torch.empty((dp, sum(sizes)), dtype=self.dtype, device=self.device)
        offset = 0
        for p, n in zip(self.spec.params, sizes, strict=True):
            flat[:, offset : offset + n] = leaves[p.name].grad.view(dp, n)  # type: ignore[union-attr]
            offset += n
        mine = torch.empty(sum(sizes), dtype=self.dtype, device=self.device)
        reduce_scatter_flat(mine, flat.view(-1), group=dp_group)
        mine.div_(dp)
        offset = 0
        for p, n in zip(self.spec.params, sizes, strict=True):
            grads[p.name] = mine[offset : offset + n].view(self.shards[p.name].shape)
            offset += n
        return grads

    def _run(self, params: Mapping[str, torch.Tensor], batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        kwargs: dict[str, Any] = {"input_ids": batch["input_ids"].to(self.device), "use_cache": False}
        if "attention_mask" in batch:
            kwargs["attention_mask"] = batch["attention_mask"].to(self.device)
        output = torch.func.functional_call(self.model, dict(params), args=(), kwargs=kwargs)
        return output.logits

    @torch.no_grad()
    def logits(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Forward only (collective over the train group's dp/tp groups)."""
        self._check_on_device()
        forward, _ = self._gather_params(requires_grad=False)
        return self._run(forward, batch)

    def forward_backward(
        self, batch: Mapping[str, torch.Tensor], loss_fn: LossFn, *, loss_scale: float = 1.0
    ) -> float:
        """Accumulate this micro-batch's gradient into the sharded grads; returns the dp-mean loss.

        ``batch`` is this data-parallel rank's micro-batch (the TP ranks of one dp rank must pass
        the same one). ``loss_scale`` multiplies the loss (e.g. 1 / micro-batches per step).
        """
        self._check_on_device()
        forward, leaves = self._gather_params(requires_grad=True)
        loss = loss_fn(self._run(forward, batch), batch)
        (loss * loss_scale).backward()
        dp_group, dp = self.groups.dp_group, self.layout.data_parallel
        for name, grad in self._reduce_scatter_grads(leaves).items():
            shard = self.shards[name]
            if shard.grad is None:
                shard.grad = grad  # with dp > 1 a view of this micro-batch's fresh reduce-scatter output
            else:
                shard.grad.add_(grad)
        value = loss.detach().reshape(1).clone()
        if dp_group is not None:
            dist.all_reduce(value, group=dp_group)
            value.div_(dp)
        return float(value.item())

    def optimizer_step(self, *, grad_scale: float = 1.0) -> StepStats:
        """Scale the accumulated gradients, clip by the global norm, AdamW step on the shards, zero the grads.

        ``grad_scale`` is for normalising a sum accumulated before the normaliser was known (a
        trainer that runs each micro-batch as it arrives learns the step's token count at the end).
        """
        self._check_on_device()
        if grad_scale != 1.0:
            for p in self.shards.values():
                if p.grad is not None:
                    p.grad.mul_(grad_scale)
        norm = self._global_grad_norm()
        max_norm = self.optim_config.max_grad_norm
        if max_norm is not None:
            coef = min(1.0, max_norm / (norm + 1e-6))
            if coef < 1.0:
                for p in self.shards.values():
                    if p.grad is not None:
                        p.grad.mul_(coef)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps += 1
        return StepStats(self.steps, norm)

    def train_step(self, batch: Mapping[str, torch.Tensor], loss_fn: LossFn) -> float:
        loss = self.forward_backward(batch, loss_fn)
        self.optimizer_step()
        return loss

    def _global_grad_norm(self) -> float:
        P = self.layout.tensor_parallel
        total = torch.zeros(1, dtype=torch.float64, device=self.device)
        for p in self.spec.params:
            grad = self.shards[p.name].grad
            if grad is None:
                continue
            sq = grad.double().pow(2).sum()
            # a TP-replicated parameter's shard is held identically by all P TP ranks: count it once
            total += sq if p.train_tp_dim is not None else sq / P
        if self.groups.group is not None:
            dist.all_reduce(total, group=self.groups.group)
        return float(total.sqrt().item())
