"""Learning-rate schedules of the trainer: transformers' schedulers over the engine's AdamW.

``algo.lr_schedule`` picks one, ``algo.warmup_steps`` ramps linearly from 0 (transformers'
convention: the first step runs at lr 0 when there is warmup), ``algo.total_steps`` (default
``algo.steps``) is where ``linear`` reaches 0 and ``cosine`` reaches ``lr * algo.min_lr_ratio``.
One ``step()`` per optimizer step, after it.
"""

from __future__ import annotations

import torch
from torch.optim.lr_scheduler import LRScheduler
from transformers import get_scheduler

from streamrl.config import AlgoConfig


def lr_scheduler(optimizer: torch.optim.Optimizer, algo: AlgoConfig) -> LRScheduler:
    """The scheduler of ``algo`` over ``optimizer`` (whose lr is the peak, ``algo.lr``)."""
    total = algo.total_steps if algo.total_steps is not None else algo.steps
    match algo.lr_schedule:
        case "constant":
            return get_scheduler("constant_with_warmup", optimizer, num_warmup_steps=algo.warmup_steps)
        case "linear":
            return get_scheduler("linear", optimizer, num_warmup_steps=algo.warmup_steps, num_training_steps=total)
        case "cosine":
            return get_scheduler("cosine_with_min_lr", optimizer, num_warmup_steps=algo.warmup_steps,
                                 num_training_steps=total,
                                 scheduler_specific_kwargs={"min_lr_rate": algo.min_lr_ratio})
    raise ValueError(f"algo.lr_schedule {algo.lr_schedule!r} is not constant, linear or cosine")
