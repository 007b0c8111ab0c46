"""``resources.launch: ray`` against local processes: the same GRPO run, set-up and training time.

A Ray cluster of two simulated nodes on this machine (``ray.cluster_utils.Cluster``, every Ray
listener on 127.0.0.1), the run of ``tests/e2e/test_ray.py`` (configs/grpo_digits.yaml, source and
score pinned to one node, advantage and train to the other, two generate workers spread; dock
over tcp with CURVE, a warehouse per node) against the same config with the local launcher
(``processes``: ipc, plaintext, workers forked from a preloaded forkserver). Repetitions
alternate. Figures: set-up (launch to every worker ready), training (Go to the end) and the
final rewards, which must be equal (the run is deterministic; Ray changes nothing it computes).

    python3 ops/bench/ray_launch.py [--steps 40] [--reps 3]      # ~1 min per repetition on 2 cores
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import fmt_spread, print_json_line, print_table, ratio, spread

REPO = Path(__file__).resolve().parents[2]
PINS = "{source: {node_a: 1}, score: {node_a: 1}, advantage: {node_b: 1}, train: {node_b: 1}}"


def _run(steps: int, run_dir: str, ray_address: str | None) -> dict[str, Any]:
    import streamrl

    overrides = [f"pipeline={REPO / 'pipelines' / 'grpo.yaml'}",  # as tests/e2e/test_ray.py: every stage apart
                 f"algo.steps={steps}", "algo.stop_reward=null", f"output.run_dir={run_dir}", "output.progress=none",
                 "stages.generate.workers=2", "stages.generate.threads=1", "stages.train.threads=1"]
    if ray_address is not None:
        overrides += ["resources.launch=ray", f"resources.ray.address={ray_address}",
                      f"resources.ray.stage_resources={PINS}", "resources.ray.strategy=SPREAD"]
    r = streamrl.run(str(REPO / "configs" / "grpo_digits.yaml"), overrides)
    rewards = [m["reward_mean"] for m in r.metrics]
    return {"setup_s": r.setup_s, "train_s": r.train_s, "total_s": r.total_s, "last5": sum(rewards[-5:]) / 5,
            "claimed_remote": r.dock_statistics.get("claimed_remote", 0)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args(argv)

    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # every Ray listener on 127.0.0.1
    tmp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
    os.environ["RAY_TMPDIR"] = tmp
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 6, "resources": {"node_a": 100},
                                                             "include_dashboard": False})
    runs: dict[str, list[dict[str, Any]]] = {"ray": [], "processes": []}
    try:
        cluster.add_node(num_cpus=6, resources={"node_b": 100})
        cluster.wait_for_nodes(timeout=60)
        ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
        for rep in range(args.reps):
            order = ["ray", "processes"] if rep % 2 == 0 else ["processes", "ray"]
            for kind in order:
                address = cluster.address if kind == "ray" else None
                runs[kind].append(_run(args.steps, f"{tmp}/runs-{kind}-{rep}", address))
                print(f"rep {rep} {kind}: " + ", ".join(f"{k} {v:.3f}" for k, v in runs[kind][-1].items()), flush=True)
    finally:
        try:
            ray.shutdown()
            cluster.shutdown()
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    figs = {kind: {k: spread(r[k] for r in rs) for k in ("setup_s", "train_s", "total_s")} for kind, rs in runs.items()}
    same = all(a["last5"] == b["last5"] for a, b in zip(runs["ray"], runs["processes"], strict=True))
    print_table(["", "ray (2 simulated nodes, CURVE)", "processes (local)", "ray / processes"], [
        [k, fmt_spread(figs["ray"][k], 2), fmt_spread(figs["processes"][k], 2), f"{ratio(figs['ray'][k], figs['processes'][k]):.2f}"]
        for k in ("setup_s", "train_s", "total_s")
    ])
    print(f"final rewards equal run by run: {same}; samples claimed across nodes per Ray run: "
          f"{[r['claimed_remote'] for r in runs['ray']]}")
    print_json_line(
        "ray_launch", figures=figs["ray"], baseline=figs["processes"],
        ratio={k: ratio(figs["ray"][k], figs["processes"][k]) for k in ("setup_s", "train_s", "total_s")},
        target={"train_s_ratio_at_most": 1.5, "same_rewards": True}, same_rewards=same, steps=args.steps,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
