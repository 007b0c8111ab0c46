"""TRL's GRPOTrainer loss on fixed tensors, run in the TRL venv (ops/bench/setup_trl_env.sh) by
tests/algos/test_trl_losses.py: one JSON object of cases on stdin, one JSON object of results on
stdout (each case's loss and its gradient with respect to the per-token logprobs).

It calls TRL's own ``GRPOTrainer._compute_loss`` (the code TRL trains with), on a stand-in for the
trainer that holds only the attributes that method reads, and with the model's forward replaced
by the case's logprobs: the loss maths is TRL's, the inputs are the test's.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from types import SimpleNamespace
from typing import Any

import torch
from trl.trainer.grpo_trainer import GRPOTrainer


class _Accelerator:
    num_processes = 1
    sync_gradients = True

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        return x

    gather_for_metrics = gather

    def reduce(self, x: torch.Tensor, reduction: str = "sum") -> torch.Tensor:
        return x


def trl_loss(case: dict[str, Any]) -> dict[str, Any]:
    logps = torch.tensor(case["logprobs"], dtype=torch.float64, requires_grad=True)  # [B, T]
    mask = torch.tensor(case["mask"], dtype=torch.float64)
    b, t = logps.shape
    trainer = SimpleNamespace(
        loss_type=case["loss_type"], epsilon_low=case["epsilon_low"], epsilon_high=case["epsilon_high"],
        beta=case["beta"], importance_sampling_level=case.get("importance_sampling_level", "token"),
        max_completion_length=t, top_entropy_quantile=1.0, off_policy_mask_threshold=None, use_vllm=False,
        aux_loss_enabled=False, _entropy_bonus_enabled=False, current_gradient_accumulation_steps=1,
        model=SimpleNamespace(training=False),  # eval: TRL scales by no accumulation window
        accelerator=_Accelerator(), _metrics=defaultdict(lambda: defaultdict(list)),
        args=SimpleNamespace(delta=None, use_bias_correction_kl=False),
        _get_per_token_logps_and_entropies=lambda *a, **k: (logps, torch.zeros_like(logps), None),
    )
    inputs = {
        "prompt_ids": torch.zeros(b, 1, dtype=torch.long), "prompt_mask": torch.ones(b, 1, dtype=torch.long),
        "completion_ids": torch.zeros(b, t, dtype=torch.long), "completion_mask": mask,
        "advantages": torch.tensor(case["advantages"], dtype=torch.float64),
        "old_per_token_logps": torch.tensor(case["old_logprobs"], dtype=torch.float64),
        "num_items_in_batch": mask.sum(),
    }
    if case["beta"]:
        inputs["ref_per_token_logps"] = torch.tensor(case["ref_logprobs"], dtype=torch.float64)
    loss = GRPOTrainer._compute_loss(trainer, None, inputs)
    loss.backward()
    assert logps.grad is not None
    return {"loss": float(loss.detach()), "grad": logps.grad.tolist()}


def main() -> None:
    import trl

    cases = json.loads(sys.stdin.read())
    results = {name: trl_loss(case) for name, case in cases.items()}
    print(json.dumps({"trl": trl.__version__, "results": results}))


if __name__ == "__main__":
    main()
