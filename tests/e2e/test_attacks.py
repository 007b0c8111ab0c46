"""End to end, real processes: a digits run attacked from the same host while it trains finishes
with the same metrics as an undisturbed run (issue 25).

The attacker reads what a local process could reach: the run's ipc endpoints and, for the insider,
one worker's 0600 spec file (as a compromised score worker would hold it). Then, while the run
trains:

- strangers (no credentials, another run's credentials, a wrong password for a real role) send
  requests to the controller, every warehouse, the control socket and the policy channel: none is
  answered, and the servers count the refused handshakes;
- an insider holding the score stage's credentials tries what the outside tester did without any:
  claim the train stage's samples, write the advantage column before the advantage stage, put 256
  junk column names, reserve the dock's capacity, squat client slots. Each is refused with the
  documented code, and the run never notices.

The run is deterministic (max_staleness 0, same seeds), so "never notices" is checked exactly: the
learning metrics of every step equal those of the same run without the attacker. Both runs score with
tests/e2e/held_rewards.py: digits-max, which holds the attacked run's last step until the attacker is
done, so the attack always meets a live run, however fast the machine trains.
"""

from __future__ import annotations

import sys
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest
import zmq

import streamrl
from streamrl.dock import protocol as p
from streamrl.dock.client import DockClient
from streamrl.dock.errors import DockError, DockTimeout, RemoteError
from streamrl.runtime.worker import WorkerSpec
from streamrl.security import ClientAuth, RunCredentials, secure_client
from tests.e2e import held_rewards

REPO = Path(__file__).resolve().parents[2]
DIGITS = REPO / "configs" / "grpo_digits.yaml"
PIPELINE = REPO / "pipelines" / "grpo.yaml"
STEPS = 16  # the last one waits for the attacker (held_rewards): the attack can take any time
SAMPLES_PER_STEP = 64  # configs/grpo_digits.yaml: 8 prompts x 8 completions
# what the attacker must not change: every learning figure of every step
LEARNING = ("step", "reward_mean", "reward_std", "loss", "clip_fraction", "entropy")
SQUATTERS = 12  # the score role has 1 worker + 4 spare client ids (streamrl.dock.authz)
NO_ANSWER_S = 0.7  # a stranger's request is never answered; this long is the wait for one


def _run(tmp: Path) -> list[dict[str, Any]]:
    # pipelines/grpo.yaml, not the quickstart's rollout chain: the insider holds a score worker's
    # credentials, and the advantage stage's column is one it must not write
    overrides = [f"algo.steps={STEPS}", "algo.stop_reward=null", f"output.run_dir={tmp}", "output.progress=none",
                 f"pipeline={PIPELINE}", "stages.score.options={reward: 'tests.e2e.held_rewards:digits_max_held'}"]
    result = streamrl.run(str(DIGITS), overrides)
    assert result.steps == STEPS, result.stop_reason
    return [{k: row[k] for k in LEARNING} for row in result.metrics]


def _silent(ctx: zmq.Context, endpoint: str, auth: ClientAuth | None, frames: list[bytes]) -> bool:
    """A DEALER presenting ``auth`` sends ``frames``; True when nothing comes back."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        secure_client(sock, auth)
        sock.connect(endpoint)
        # never blocks: after a refused PLAIN handshake libzmq drops the connection for good, and a
        # DEALER without a peer would wait for one forever
        try:
            sock.send_multipart(frames, flags=zmq.NOBLOCK)
        except zmq.Again:
            return True
        return not sock.poll(int(NO_ANSWER_S * 1000))
    finally:
        sock.close(0)


class Attacker:
    def __init__(self, parent: Path) -> None:
        self.parent = parent  # the run's output.run_dir: the run writes to parent/<name>-<timestamp>/
        # the run's last step waits while this exists (held_rewards): removed when the attack is over
        self.hold = parent / "hold"
        parent.mkdir(parents=True)
        self.hold.touch()
        self.findings: dict[str, Any] = {}
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._main, daemon=True)

    def _main(self) -> None:
        try:
            spec = self._wait_for_training()
            anyio.run(self._attack, spec)
        except BaseException as exc:  # reported by the test, which joins this thread
            self.error = exc
        finally:
            self.hold.unlink()

    def stack(self) -> str:
        """Where the attacker's thread is now (for a test that finds it still running)."""
        frame = sys._current_frames().get(self.thread.ident or -1)
        return "".join(traceback.format_stack(frame)) if frame is not None else "(not running)"

    def _wait_for_training(self) -> WorkerSpec:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            for run_dir in self.parent.glob("*"):
                spec_path, metrics = run_dir / "logs" / "score-0.spec.json", run_dir / "metrics.jsonl"
                if spec_path.exists() and metrics.exists() and metrics.read_text().count("\n") >= 2:
                    return msgspec.json.decode(spec_path.read_bytes(), type=WorkerSpec)
            time.sleep(0.05)
        raise TimeoutError(f"no run under {self.parent} reached step 2 in 120 s")

    async def _attack(self, spec: WorkerSpec) -> None:
        insider = spec.auth["score"]
        async with DockClient(spec.dock_endpoint, auth=insider, request_timeout_s=10, connect_timeout_s=10,
                              client_id="attacker-0") as dock:
            warehouses = [c.link.socket.getsockopt_string(zmq.LAST_ENDPOINT) for c in dock._warehouses]
            before = await dock.server_statistics()
            self.findings["strangers"] = await anyio.to_thread.run_sync(self._strangers, spec, insider, warehouses)
            self.findings["insider"] = await self._insider(dock)
            self.findings["squat"] = await self._squat(spec.dock_endpoint, insider)
            after = await dock.server_statistics()
        self.findings["rows_when_done"] = sum(1 for _ in (Path(spec.run_dir) / "metrics.jsonl").open())
        self.findings["refused"] = {
            "controller": after["controller"]["auth"]["refused"] - before["controller"]["auth"]["refused"],
            "warehouses": [a["auth"]["refused"] - b["auth"]["refused"]
                           for a, b in zip(after["warehouses"], before["warehouses"], strict=True)],
        }

    def _strangers(self, spec: WorkerSpec, insider: ClientAuth, warehouses: list[str]) -> dict[str, bool]:
        other = RunCredentials.generate(insider.mechanism, ["stage:score"]).client("stage:score")
        kinds: dict[str, ClientAuth | None] = {"no credentials": None, "another run's credentials": other}
        if insider.mechanism == "plain":
            kinds["a wrong password"] = ClientAuth("plain", insider.role, password="guessed")
        hello = p.encoder.encode(p.Hello(1, "stranger", p.PROTOCOL_VERSION, 3600.0))
        claim = p.encoder.encode(p.Claim(2, "stranger", "train", ["prompt_ids"], 64))
        get = p.encoder.encode(p.Get(3, [0], ["prompt_ids"]))
        targets = {"controller": (spec.dock_endpoint, [hello, claim]),
                   **{f"warehouse {i}": (ep, [get]) for i, ep in enumerate(warehouses)},
                   "control": (spec.control_endpoint, [b"\x81\xa4type\xa8starting"]),
                   "policy": (spec.weights_endpoint, [b"\x81\xa4type\xa5fetch"])}
        ctx = zmq.Context()  # its own: destroyed below, whatever state its sockets are in
        cases = {f"{kind} -> {target}": (ep, auth, frames)
                 for kind, auth in kinds.items() for target, (ep, frames) in targets.items()}
        try:  # all at once: each waits NO_ANSWER_S for the answer that must not come
            with ThreadPoolExecutor(len(cases)) as pool:
                silent = {name: pool.submit(lambda c: all(_silent(ctx, c[0], c[1], [f]) for f in c[2]), case)
                          for name, case in cases.items()}
                return {name: future.result(timeout=60) for name, future in silent.items()}
        finally:
            ctx.destroy(linger=0)

    async def _insider(self, dock: DockClient) -> dict[str, str]:
        """Each move the outside tester made without credentials, made with the score stage's."""
        codes: dict[str, str] = {}

        async def attempt(name: str, move: Any) -> None:
            try:
                await move()
                codes[name] = "accepted"
            except RemoteError as exc:
                codes[name] = exc.code
            except (DockTimeout, DockError) as exc:
                codes[name] = f"{type(exc).__name__}: {exc}"

        await attempt("claim the train stage's samples",
                      lambda: dock.claim_nowait("train", ["prompt_ids", "response_ids"], 64))
        await attempt("write advantage before the advantage stage",
                      lambda: dock.put([0], {"advantage": [1e6]}))
        await attempt("put 256 junk column names",
                      lambda: dock.put([0], {f"junk{j}": [j] for j in range(256)}))
        await attempt("reserve the dock's capacity", lambda: dock.reserve_nowait(dock.capacity))
        return codes

    async def _squat(self, endpoint: str, insider: ClientAuth) -> dict[str, int]:
        """Client ids with an hour's TTL, all held open at once, until the score role's slots run out."""
        admitted = refused = 0
        async with AsyncExitStack() as held:
            for k in range(SQUATTERS):
                try:
                    await held.enter_async_context(DockClient(
                        endpoint, auth=insider, client_id=f"squat-{k}", lease_ttl_s=3600.0, request_timeout_s=5,
                        connect_timeout_s=5))
                    admitted += 1
                except RemoteError as exc:
                    assert exc.code == "too_many_clients", exc
                    refused += 1
        return {"admitted": admitted, "refused": refused}


@pytest.mark.timeout(420)
def test_an_attacked_run_trains_exactly_like_an_undisturbed_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    attacked_dir = tmp_path / "attacked"
    # inherited by the score workers of both runs; the undisturbed run has no hold file
    monkeypatch.setenv(held_rewards.HOLD_FILE, str(attacked_dir / "hold"))
    monkeypatch.setenv(held_rewards.HOLD_AFTER, str((STEPS - 1) * SAMPLES_PER_STEP))
    reference = _run(tmp_path / "undisturbed")

    attacker = Attacker(attacked_dir)
    attacker.thread.start()
    attacked = _run(attacked_dir)
    attacker.thread.join(timeout=30)  # it released the run: only its last lines can be left
    assert not attacker.thread.is_alive(), f"the attacker did not finish; it is at\n{attacker.stack()}"
    if attacker.error is not None:
        raise attacker.error

    found = attacker.findings
    assert found["rows_when_done"] < STEPS, "the attack ended after the run: it proved nothing"
    # strangers: no request on any socket was answered, and the handshakes were refused and counted
    assert found["strangers"] and all(found["strangers"].values()), found["strangers"]
    assert found["refused"]["controller"] >= 2 and all(n >= 1 for n in found["refused"]["warehouses"]), found
    # the insider: every move refused with the documented code (docs/dock-protocol.md §6.2)
    assert found["insider"] == {
        "claim the train stage's samples": "forbidden",
        "write advantage before the advantage stage": "forbidden",
        "put 256 junk column names": "unknown_column",
        "reserve the dock's capacity": "forbidden",
    }, found["insider"]
    # squatting: the score role ran out of its own slots; no other role was affected (the run went on)
    assert found["squat"]["refused"] >= 1 and found["squat"]["admitted"] <= 4, found["squat"]
    # and the run trained exactly as without the attacker
    assert attacked == reference

