"""streamrl's losses against TRL's GRPOTrainer, loss type by loss type, on the same fixed tensors.

TRL's side runs its own ``GRPOTrainer._compute_loss`` in the TRL venv (tests/algos/trl_losses.py,
the venv of ops/bench/setup_trl_env.sh): live where that venv exists, and always against the
figures it gave when they were recorded (RECORDED, with the TRL version), so the comparison holds
on machines without TRL too. Each case is a padded batch [B, T] with a completion mask; streamrl
computes the same loss from the masked tokens, flat, as its trainer does. The loss and its
gradient with respect to every trained token's logprob must agree to 1e-6.

    TRL loss_type (settings)                    streamrl (algo.loss)
    grpo                                        ppo_clip, seq-mean-token-mean
    bnpo                                        ppo_clip, token-mean
    dr_grpo                                     ppo_clip, seq-mean-token-sum-norm (norm_tokens = T)
    dapo (epsilon_high 0.28)                    ppo_clip clip_high 0.28, token-mean
    cispo (epsilon_high 1.28)                   cispo clip_low 1 clip_high 0.28, token-mean
    grpo, importance_sampling_level sequence    gspo, seq-mean-token-mean
    grpo, beta 0.04 (k3 KL in the loss)         ppo_clip, kl_coef 0.04, k3, seq-mean-token-mean

Re-record after a deliberate change: ``python tests/algos/test_trl_losses.py --record`` (needs the venv).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from streamrl.algos.grpo import LossConfig, aggregate_loss, per_token_loss

HERE = Path(__file__).resolve().parent
TRL_PYTHON = Path(os.environ.get("STREAMRL_TRL_VENV", "/tmp/streamrl-trl-venv2")) / "bin" / "python"
B, T = 4, 5
LENGTHS = [5, 3, 1, 4]  # completion tokens per row; the rest of the row is padding (mask 0)

# case name -> (TRL settings, streamrl LossConfig fields)
CASES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "grpo": ({"loss_type": "grpo", "epsilon_low": 0.2, "epsilon_high": 0.2, "beta": 0.0},
             {"loss_agg": "seq-mean-token-mean"}),
    "bnpo": ({"loss_type": "bnpo", "epsilon_low": 0.2, "epsilon_high": 0.2, "beta": 0.0},
             {"loss_agg": "token-mean"}),
    "dr_grpo": ({"loss_type": "dr_grpo", "epsilon_low": 0.2, "epsilon_high": 0.2, "beta": 0.0},
                {"loss_agg": "seq-mean-token-sum-norm", "norm_tokens": T}),
    "dapo": ({"loss_type": "dapo", "epsilon_low": 0.2, "epsilon_high": 0.28, "beta": 0.0},
             {"clip_high": 0.28, "loss_agg": "token-mean"}),
    "cispo": ({"loss_type": "cispo", "epsilon_low": 0.2, "epsilon_high": 1.28, "beta": 0.0},
              {"policy_loss": "cispo", "clip_low": 1.0, "clip_high": 0.28, "loss_agg": "token-mean"}),
    "gspo": ({"loss_type": "grpo", "epsilon_low": 3e-4, "epsilon_high": 4e-4, "beta": 0.0,
              "importance_sampling_level": "sequence"},
             {"policy_loss": "gspo", "clip_low": 3e-4, "clip_high": 4e-4, "loss_agg": "seq-mean-token-mean"}),
    "grpo_kl": ({"loss_type": "grpo", "epsilon_low": 0.2, "epsilon_high": 0.2, "beta": 0.04},
                {"kl_coef": 0.04, "kl_estimator": "k3", "loss_agg": "seq-mean-token-mean"}),
}

# TRL 1.16.0's answers (tests/algos/trl_losses.py in the venv of ops/bench/setup_trl_env.sh)
RECORDED_TRL_VERSION = '1.16.0'
RECORDED: dict[str, dict[str, Any]] = {"grpo": {"loss": 0.09287213664743399, "grad": [[0.0, -0.066527230556, -0.044227361715, -0.031803325671, -0.055954871845],
        [0.068977154117, 0.0, 0.059769078322, 0.0, 0.0],
        [-0.105736848925, 0.0, 0.0, 0.0, -0.0],
        [0.0, 0.065972331157, 0.098313845557, 0.08042269954, 0.0]]},
    "bnpo": {"loss": 0.07285335522248418, "grad": [[0.0, -0.102349585471, -0.068042094947, -0.048928193339, -0.086084418222],
        [0.063671219184, 0.0, 0.055171456913, 0.0, 0.0],
        [-0.032534415054, 0.0, 0.0, 0.0, -0.0],
        [0.0, 0.081196715271, 0.12100165607, 0.098981784049, 0.0]]},
    "dr_grpo": {"loss": 0.04735468089461472, "grad": [[0.0, -0.066527230556, -0.044227361715, -0.031803325671, -0.055954871845],
        [0.04138629247, 0.0, 0.035861446993, 0.0, 0.0],
        [-0.021147369785, 0.0, 0.0, 0.0, -0.0],
        [0.0, 0.052777864926, 0.078651076446, 0.064338159632, 0.0]]},
    "dapo": {"loss": 0.06485335522248417, "grad": [[0.0, -0.102349585471, -0.068042094947, -0.048928193339, -0.086084418222],
        [0.063671219184, 0.0, 0.055171456913, 0.0, 0.0],
        [-0.032534415054, 0.0, 0.0, 0.0, -0.0],
        [0.0, 0.081196715271, 0.12100165607, 0.098981784049, 0.0]]},
    "cispo": {"loss": 0.1333183133816829, "grad": [[-0.128, -0.102349585471, -0.068042094947, -0.048928193339, -0.086084418222],
        [0.063671219184, 0.042633629691, 0.055171456913, 0.0, 0.0],
        [-0.032534415054, -0.0, -0.0, -0.0, -0.0],
        [0.0634289795, 0.081196715271, 0.108307692308, 0.098981784049, 0.0]]},
    "gspo": {"loss": 0.08948627947762389, "grad": [[-0.054688762591, -0.054688762591, -0.054688762591, -0.054688762591, -0.054688762591],
        [0.0, 0.0, 0.0, 0.0, 0.0],
        [0.0, 0.0, 0.0, 0.0, 0.0],
        [0.072005648108, 0.072005648108, 0.072005648108, 0.072005648108, 0.0]]},
    "grpo_kl": {"loss": 0.09381926616110642, "grad": [[0.00083722898, -0.066523292743, -0.045590503625, -0.032703101033, -0.055789646286],
        [0.069425702737, -0.000271830228, 0.059421128411, 0.0, 0.0],
        [-0.106712026717, 0.0, 0.0, 0.0, 0.0],
        [-0.000477316677, 0.065939799489, 0.098755175736, 0.080079092188, 0.0]]}}


def _tensors() -> dict[str, torch.Tensor]:
    """The fixed batch: logprobs near their old values (some ratios past every clip), mixed-sign
    advantages, a reference policy, padding past each row's length."""
    g = torch.Generator().manual_seed(22)
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3 - 0.1
    logprobs = old + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.3
    ref = old + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.2
    mask = (torch.arange(T)[None, :] < torch.tensor(LENGTHS)[:, None]).to(torch.float64)
    advantages = torch.tensor([1.3, -0.7, 0.4, -1.1], dtype=torch.float64)
    return {"logprobs": logprobs, "old_logprobs": old, "ref_logprobs": ref, "mask": mask, "advantages": advantages}


def trl_cases() -> dict[str, dict[str, Any]]:
    data = {k: v.tolist() for k, v in _tensors().items()}
    return {name: {**settings, **data} for name, (settings, _) in CASES.items()}


def streamrl_loss(name: str) -> dict[str, Any]:
    """The case as streamrl's trainer computes it: masked tokens only, flat, the advantage repeated."""
    x = _tensors()
    keep = x["mask"].bool()
    logprobs = x["logprobs"].clone().requires_grad_(True)
    seq_index = torch.arange(B)[:, None].expand(B, T)[keep]
    advantages = x["advantages"][:, None].expand(B, T)[keep]
    config = LossConfig(**CASES[name][1])
    ref = x["ref_logprobs"][keep] if config.kl_coef > 0 else None
    per_token, _ = per_token_loss(logprobs[keep], advantages, config, seq_index=seq_index,
                                  old_logprobs=x["old_logprobs"][keep], ref_logprobs=ref)
    loss = aggregate_loss(per_token, seq_index, B, config.loss_agg, config.norm_tokens or 1)
    loss.backward()
    assert logprobs.grad is not None
    return {"loss": float(loss.detach()), "grad": logprobs.grad.tolist()}


def run_trl() -> dict[str, Any]:
    proc = subprocess.run([str(TRL_PYTHON), str(HERE / "trl_losses.py")], input=json.dumps(trl_cases()),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _assert_close(ours: dict[str, Any], theirs: dict[str, Any], name: str) -> None:
    assert ours["loss"] == pytest.approx(theirs["loss"], abs=1e-6), name
    got, want = torch.tensor(ours["grad"]), torch.tensor(theirs["grad"])
    mask = _tensors()["mask"].bool()
    torch.testing.assert_close(got[mask], want[mask], atol=1e-6, rtol=0, msg=name)


@pytest.mark.parametrize("name", list(CASES))
def test_each_loss_type_matches_the_recorded_trl_figures(name: str) -> None:
    assert RECORDED, "no recorded TRL figures: python tests/algos/test_trl_losses.py --record"
    _assert_close(streamrl_loss(name), RECORDED[name], name)


@pytest.mark.skipif(not TRL_PYTHON.is_file(), reason="the TRL venv (ops/bench/setup_trl_env.sh) is absent")
def test_each_loss_type_matches_trl_live() -> None:
    got = run_trl()
    for name in CASES:
        _assert_close(streamrl_loss(name), got["results"][name], name)


def _record() -> None:
    """Write TRL's current answers into RECORDED above (run by hand, with the venv)."""
    got = run_trl()
    path = Path(__file__)
    text = path.read_text()
    head, _, rest = text.partition("RECORDED_TRL_VERSION = ")
    _, _, tail = rest.partition("\n\n\ndef _tensors")
    rounded = {name: {"loss": r["loss"], "grad": [[round(v, 12) for v in row] for row in r["grad"]]}
               for name, r in got["results"].items()}
    body = json.dumps(rounded, indent=None).replace("], [", "],\n        [").replace('}, "', '},\n    "')
    path.write_text(f"{head}RECORDED_TRL_VERSION = {got['trl']!r}\nRECORDED: dict[str, dict[str, Any]] = {body}"
                    f"\n\n\ndef _tensors{tail}")
    print(f"recorded TRL {got['trl']} figures for {sorted(got['results'])}")


if __name__ == "__main__":
    if sys.argv[1:] == ["--record"]:
        _record()
