"""Fuzz every server streamrl runs, one socket at a time, and check each survives and recovers.

    python ops/fuzz/servers.py                       # 100,000 frames per socket (~5-10 min on 2 cores)
    python ops/fuzz/servers.py --frames 2000 --targets controller,reward

Targets (each the real server, in its own process, on tcp://127.0.0.1 with a port from the OS):
``controller`` and ``warehouse`` (a ``LocalDock``), ``reward`` (``streamrl reward-server``),
``control`` and ``policy`` (the launcher's and the trainer's channels, via ``ops/fuzz/hosts.py``).

Per target: a normal request is answered (the *check*) and the server's resident memory is read
from /proc; then ``--frames`` frames from :class:`ops.fuzz.wiregen.MessageFuzzer` (mutants of
valid messages, raw bytes, a few valid messages) go out from DEALER sockets whose identity changes
every ``--rotate`` frames (so per-client state is exercised), some with extra frames of random
bytes (a message over the server's size limit goes out on a connection of its own, since libzmq
drops that connection and everything queued behind it); a few times a raw ZMTP peer declares a 1 TiB frame (``ops/fuzz/zmtp.py``: the server must
drop that connection). Replies are drained as they come. Before each identity change and at the
end, a *sentinel* request goes out on the same connection and must be answered (stats, ping, a
worker's Ready, a weights request): ZeroMQ keeps one connection's messages in order, so its answer
proves the server read and survived every frame before it. Afterwards: is the process alive, is the
check answered correctly, and where is its memory. The time per target is bounded (``--seconds``).

The last output line is one JSON object (the benchmarks' convention): per target the frames sent,
replies received, seconds, RSS before / peak / after (MiB), and whether it survived.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import secrets
import subprocess
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import torch
import zmq

if __package__ in (None, ""):  # run as a script: make `ops` and `streamrl` importable from the checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from ops.fuzz.wiregen import MessageFuzzer
from ops.fuzz.zmtp import send_oversized_frame
from streamrl.dock import protocol as dp
from streamrl.dock.launch import LocalDock
from streamrl.dock.limits import DockLimits
from streamrl.rewards import protocol as rp
from streamrl.runtime import control as cc
from streamrl.runtime import policy as pc

ALL_TARGETS = ("controller", "warehouse", "reward", "control", "policy")
CHECK_TIMEOUT_S = 10.0


@dataclass
class Target:
    name: str
    endpoint: str
    pid: int
    message_type: Any
    check: Callable[[], str | None]  # None: the normal request was answered correctly; else what was wrong
    # A request whose reply proves the server has processed everything sent before it on the same
    # connection (ZeroMQ keeps one connection's messages in order): (messages, is_its_reply).
    sentinel: Callable[[int], tuple[list[list[bytes]], Callable[[list[bytes]], bool]]]
    extra_frames: float = 0.05  # share of messages sent with extra frames of random bytes
    # the server's ZMQ_MAXMSGSIZE: libzmq drops the connection of a peer that sends more, and with it
    # every message queued behind on that connection, so the fuzzer sends such messages apart
    max_message_bytes: int = 1 << 30
    notes: dict[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------------- plumbing
def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/status").read_text().split("State:")[1].split()[0] not in ("Z", "X")
    except (FileNotFoundError, IndexError):
        return False


def _request(endpoint: str, frames: list[bytes], timeout_s: float = CHECK_TIMEOUT_S,
             want: Callable[[list[bytes]], bool] = lambda _: True) -> list[bytes] | None:
    """Send one multipart message from a fresh DEALER; the first reply ``want`` accepts, or None."""
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(endpoint)
    try:
        s.send_multipart(frames)
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            if s.poll(int(left * 1000) + 1):
                reply = s.recv_multipart()
                if want(reply):
                    return reply
        return None
    finally:
        s.close(0)


def _start_process(args: list[str], stack: contextlib.ExitStack, name: str) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen([sys.executable, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, start_new_session=True,
                            cwd=Path(__file__).resolve().parents[2])

    def stop() -> None:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        for stream in (proc.stdin, proc.stdout):
            if stream is not None:
                stream.close()

    stack.callback(stop)
    deadline = time.monotonic() + 60
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith("READY "):
            return proc, line.split()[1]
        if not line and proc.poll() is not None:
            break
    raise RuntimeError(f"{name} did not start (exit code {proc.poll()})")


# ---------------------------------------------------------------------- targets
def _field(reply: list[bytes], name: str) -> Any:
    """A field of a reply's msgpack header, or None when it is not a map that has it."""
    try:
        head = msgspec.msgpack.decode(reply[0])
    except (msgspec.DecodeError, IndexError):
        return None
    return head.get(name) if isinstance(head, dict) else None


def _stats_sentinel(n: int) -> tuple[list[list[bytes]], Callable[[list[bytes]], bool]]:
    return [[dp.encoder.encode(dp.StatsRequest(n))]], lambda r: _field(r, "req_id") == n


def start_dock(stack: contextlib.ExitStack) -> list[Target]:
    dock = stack.enter_context(LocalDock(["gen", "train"], capacity=256, n_warehouses=1, transport="tcp"))
    ctl_pid, wh_pid = dock.pids[0], dock.pids[1]
    ctl, wh = dock.controller_endpoint, dock.warehouse_endpoints[0]
    client_id = "fuzz-check-" + secrets.token_hex(8)  # unguessable: fuzzed acks cannot free our sample

    def controller_request(msg: msgspec.Struct) -> Any:
        reply = _request(ctl, [dp.encoder.encode(msg)])
        return None if reply is None else dp.reply_decoder.decode(reply[0])

    # One sample reserved and written before fuzzing; "gen" never acks it, so it must survive.
    hello = controller_request(dp.Hello(1, client_id, dp.PROTOCOL_VERSION, 3600.0))
    reserved = controller_request(dp.Reserve(2, client_id, 1))
    if not isinstance(hello, dp.HelloReply) or not isinstance(reserved, dp.Reserved):
        raise RuntimeError(f"the dock did not answer the fuzzer's set-up: {hello!r} {reserved!r}")
    index = reserved.indices[0]
    payload = torch.arange(16, dtype=torch.float32)

    def put_get(column: str) -> str | None:
        col = dp.TensorColumn(column, "float32", [[16]], [0], [0])
        ok = _request(wh, [dp.encoder.encode(dp.Put(7, [index], [col])), payload.numpy().tobytes()])
        if ok is None or not isinstance(dp.reply_decoder.decode(ok[0]), dp.Ok):
            return f"put of column {column!r} was not answered with ok: {ok!r}"
        return get(column)

    def get(column: str) -> str | None:
        got = _request(wh, [dp.encoder.encode(dp.Get(8, [index], [column]))])
        if got is None:
            return "get was not answered"
        reply = dp.reply_decoder.decode(got[0])
        if not isinstance(reply, dp.Fetched) or got[1][:64] != payload.numpy().tobytes():
            return f"get returned {reply!r} with other bytes"
        return None

    if (err := put_get("before")) is not None:
        raise RuntimeError(f"warehouse set-up failed: {err}")
    checks = {"n": 0}

    def check_controller() -> str | None:
        checks["n"] += 1
        h = controller_request(dp.Hello(10, client_id, dp.PROTOCOL_VERSION, 3600.0))
        if not isinstance(h, dp.HelloReply) or h.warehouses != [wh]:
            return f"hello answered {h!r}"
        stats = controller_request(dp.StatsRequest(11))
        if not isinstance(stats, dp.Stats) or stats.stats.get("capacity") != 256:
            return f"stats answered {stats!r}"
        return None

    def check_warehouse() -> str | None:
        checks["n"] += 1
        return get("before") or put_get(f"after{checks['n']}")

    return [
        Target("controller", ctl, ctl_pid, dp.ControllerRequest, check_controller, _stats_sentinel,
               max_message_bytes=DockLimits().max_header_bytes),
        Target("warehouse", wh, wh_pid, dp.WarehouseRequest, check_warehouse, _stats_sentinel, extra_frames=0.3,
               max_message_bytes=DockLimits().max_message_bytes),
    ]


def start_reward(stack: contextlib.ExitStack) -> Target:
    proc, endpoint = _start_process(
        ["-m", "streamrl.rewards.cli", "reward-server", "streamrl.tasks.rewards:digits_max",
         "--bind", "tcp://127.0.0.1:0", "--log-level", "ERROR"], stack, "reward server")

    def check() -> str | None:
        hello = _request(endpoint, [msgspec.msgpack.encode({"type": "hello", "versions": [1]})],
                         want=lambda r: msgspec.msgpack.decode(r[0]).get("type") == "hello_reply")
        if hello is None:
            return "hello was not answered with hello_reply"
        req = {"type": "score", "request_id": 99, "samples": [
            {"id": 1, "prompt": "3+5+2=", "response": "5", "metadata": {"answer": "5"}},
            {"id": 2, "prompt": "3+5+2=", "response": "2", "metadata": {"answer": "5"}}]}
        reply = _request(endpoint, [msgspec.msgpack.encode(req)],
                         want=lambda r: msgspec.msgpack.decode(r[0]).get("request_id") == 99)
        if reply is None:
            return "score was not answered"
        results = msgspec.msgpack.decode(reply[0]).get("results")
        scores = [r.get("score") for r in results or []]
        if scores != [1.0, 0.0]:
            return f"score answered {results!r}, expected scores [1.0, 0.0]"
        return None

    def sentinel(n: int) -> tuple[list[list[bytes]], Callable[[list[bytes]], bool]]:
        return [[msgspec.msgpack.encode({"type": "ping", "nonce": n})]], lambda r: _field(r, "nonce") == n

    return Target("reward", endpoint, proc.pid, rp.ClientMessage, check, sentinel, max_message_bytes=256 << 20)


def start_control(stack: contextlib.ExitStack) -> Target:
    token = secrets.token_hex(16)
    proc, endpoint = _start_process(["-m", "ops.fuzz.hosts", "control", "--token", token,
                                     "--workers", "gen:0,train:0"], stack, "control host")

    def check() -> str | None:
        s = zmq.Context.instance().socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(endpoint)
        try:
            s.send(cc.encoder.encode(cc.Starting("gen", 0, os.getpid(), token)))
            s.send(cc.encoder.encode(cc.Ready("gen", 0, os.getpid())))
            if not s.poll(int(CHECK_TIMEOUT_S * 1000)):
                return "a real worker's Starting + Ready was not answered with Go"
            cmd = cc.command_decoder.decode(s.recv())
            return None if isinstance(cmd, cc.Go) else f"answered {cmd!r} instead of Go"
        finally:
            s.close(0)

    def sentinel(n: int) -> tuple[list[list[bytes]], Callable[[list[bytes]], bool]]:
        # this socket registers as worker gen-0 and says Ready: the host answers Ready with Go
        msgs = [[cc.encoder.encode(cc.Starting("gen", 0, n, token))], [cc.encoder.encode(cc.Ready("gen", 0, n))]]
        return msgs, lambda r: _field(r, "type") == "go"

    return Target("control", endpoint, proc.pid, cc.WorkerEvent, check, sentinel,
                  max_message_bytes=cc.MAX_EVENT_BYTES)


def start_policy(stack: contextlib.ExitStack) -> Target:
    from ops.fuzz.hosts import POLICY_STATE

    proc, endpoint = _start_process(["-m", "ops.fuzz.hosts", "policy"], stack, "policy host")

    def check() -> str | None:
        req = pc.WeightsRequest(5, -1, 1, True, 1.0)
        reply = _request(endpoint, [msgspec.msgpack.encode(req)])
        if reply is None:
            return "a weights request was not answered"
        head = msgspec.msgpack.decode(reply[0], type=pc.WeightsReply)
        if head.version != 1 or head.names is None or head.weights is None:
            return f"answered {head!r}"
        from streamrl.dock.codec import decode_columns

        got: dict[str, torch.Tensor] = {}
        for names, col in zip(head.names, head.weights, strict=True):
            got.update(zip(names, decode_columns([col], reply[1:], len(names))["w"], strict=True))
        same = set(got) == set(POLICY_STATE) and all(torch.equal(got[k], v) for k, v in POLICY_STATE.items())
        return None if same else "the weights differ from the published ones"

    def sentinel(n: int) -> tuple[list[list[bytes]], Callable[[list[bytes]], bool]]:
        req = pc.WeightsRequest(n, 1, 1, False, 0.0)  # answered at once: version 1 exists
        return [[msgspec.msgpack.encode(req)]], lambda r: _field(r, "req_id") == n

    return Target("policy", endpoint, proc.pid, pc.WeightsRequest, check, sentinel,
                  max_message_bytes=pc.MAX_REQUEST_BYTES)


@contextlib.contextmanager
def targets(names: list[str]) -> Iterator[list[Target]]:
    """Start the named targets; everything started is stopped on exit."""
    with contextlib.ExitStack() as stack:
        out: list[Target] = []
        if "controller" in names or "warehouse" in names:
            out += [t for t in start_dock(stack) if t.name in names]
        if "reward" in names:
            out.append(start_reward(stack))
        if "control" in names:
            out.append(start_control(stack))
        if "policy" in names:
            out.append(start_policy(stack))
        yield out


# ---------------------------------------------------------------------- fuzzing
def fuzz(target: Target, frames: int, seconds: float, seed: int, rotate: int = 250,
         oversized: int = 3) -> dict[str, Any]:
    """Send ``frames`` fuzz frames (or stop after ``seconds``) and report what happened."""
    rng = random.Random(seed)
    gen = MessageFuzzer(target.message_type, rng)
    pre = target.check()
    rss_before = rss_mib(target.pid)
    rss_peak = rss_before
    ctx = zmq.Context.instance()
    sock: zmq.Socket[bytes] | None = None
    sent = replies = blocked = 0
    t0 = time.monotonic()
    host, port = target.endpoint.removeprefix("tcp://").rsplit(":", 1)
    oversized_closed: list[bool] = []
    recent: deque[list[bytes]] = deque(maxlen=200)  # to replay a crash: the last frames before it
    next_sentinel = 1_000_000
    oversized_apart = 0
    unprocessed = False  # a sentinel went unanswered: the server stalled (or died) on what came before
    crashed_with: str | None = None
    try:
        while sent < frames and time.monotonic() - t0 < seconds:
            if sock is None or sent % rotate == 0:
                if sock is not None:
                    got, n_replies = _await_sentinel(target, sock, next_sentinel, t0 + seconds)
                    replies += n_replies
                    next_sentinel += 1
                    sock.close(0)
                    if not got:
                        unprocessed = True
                        break
                sock = ctx.socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.IDENTITY, rng.randbytes(rng.randrange(1, 32)).replace(b"\x00", b"\x01"))
                sock.connect(target.endpoint)
            msg = [gen.frame()]
            if rng.random() < target.extra_frames:
                msg += [rng.randbytes(rng.choice([0, 3, 16, 4096, 65_539])) for _ in range(rng.randrange(1, 4))]
            recent.append(msg)
            if max(len(f) for f in msg) > target.max_message_bytes:
                # over the server's limit: on a connection of its own, which libzmq will drop
                _send_apart(ctx, target.endpoint, msg)
                oversized_apart += 1
                sent += 1
                continue
            while True:
                try:
                    sock.send_multipart(msg, flags=zmq.NOBLOCK)
                    break
                except zmq.Again:  # the server is behind: drain replies, wait for room
                    blocked += 1
                    replies += _drain(sock)
                    if not sock.poll(1000, zmq.POLLOUT) and time.monotonic() - t0 > seconds:
                        break
            sent += 1
            if sent % 100 == 0:
                replies += _drain(sock)
            if sent % 500 == 0:
                if not alive(target.pid):
                    crashed_with = _save_crash(target.name, list(recent))
                    break
                rss_peak = max(rss_peak, rss_mib(target.pid))
            if oversized and sent % max(1, frames // (oversized + 1)) == 0 and len(oversized_closed) < oversized:
                try:
                    oversized_closed.append(send_oversized_frame(host, int(port), 1 << 40, timeout_s=3.0))
                except OSError:
                    oversized_closed.append(False)  # could not even connect: the server is gone
        if sock is not None and not unprocessed:
            got, n_replies = _await_sentinel(target, sock, next_sentinel, t0 + seconds)
            replies += n_replies
            unprocessed = not got
    finally:
        if sock is not None:
            sock.close(0)
    elapsed = time.monotonic() - t0
    survived = alive(target.pid)
    if not survived and crashed_with is None:
        crashed_with = _save_crash(target.name, list(recent))
    post = target.check() if survived else "the process is gone"
    time.sleep(0.5)
    rss_after = rss_mib(target.pid) if survived else float("nan")
    return {
        "target": target.name, "frames": sent, "seconds": round(elapsed, 1), "frames_per_s": round(sent / elapsed),
        "replies": replies, "send_blocked": blocked, "alive": survived,
        "all_processed": not unprocessed, "over_limit_sent_apart": oversized_apart,
        "check_before": pre or "ok", "check_after": post or "ok",
        "oversized_frames_refused": f"{sum(oversized_closed)}/{len(oversized_closed)}",
        "crash_frames": crashed_with,
        "rss_mib": {"before": round(rss_before, 1), "peak": round(max(rss_peak, rss_after), 1),
                    "after": round(rss_after, 1)},
    }


def _await_sentinel(target: Target, sock: zmq.Socket[bytes], n: int, deadline: float) -> tuple[bool, int]:
    """Send the target's sentinel on ``sock`` and wait for its reply (draining the others): True once
    the server has processed every frame sent on ``sock`` before it. Returns (answered, replies)."""
    messages, is_reply = target.sentinel(n)
    replies = 0
    end = max(deadline, time.monotonic() + 30.0)  # a backlog may still be in the server's queue
    for m in messages:
        while True:  # the send queue may be full of fuzz frames the server has not read yet
            try:
                sock.send_multipart(m, flags=zmq.NOBLOCK)
                break
            except zmq.Again:
                replies += _drain(sock)
                if time.monotonic() > end or not alive(target.pid):
                    return False, replies
                sock.poll(200, zmq.POLLOUT)
    while time.monotonic() < end:
        if not sock.poll(200):
            if not alive(target.pid):
                return False, replies
            continue
        reply = sock.recv_multipart()
        replies += 1
        if is_reply(reply):
            return True, replies
    return False, replies


def _send_apart(ctx: zmq.Context[Any], endpoint: str, msg: list[bytes]) -> None:
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 1000)  # let it go out before the socket is gone
    s.connect(endpoint)
    s.send_multipart(msg)
    s.close()


def _save_crash(name: str, messages: list[list[bytes]]) -> str:
    """The last messages sent before a server died, as msgpack (a list of lists of bytes), to replay."""
    fd, path = tempfile.mkstemp(prefix=f"fuzz-crash-{name}-", suffix=".msgpack")
    with os.fdopen(fd, "wb") as f:
        f.write(msgspec.msgpack.encode(messages))
    return path


def _drain(sock: zmq.Socket[bytes]) -> int:
    n = 0
    while True:
        try:
            sock.recv_multipart(flags=zmq.NOBLOCK)
        except zmq.Again:
            return n
        n += 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--frames", type=int, default=100_000, help="frames per socket (default 100,000)")
    ap.add_argument("--seconds", type=float, default=300.0, help="time limit per socket (default 300)")
    ap.add_argument("--targets", default=",".join(ALL_TARGETS), help=f"comma-separated, of {ALL_TARGETS}")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    names = [n for n in args.targets.split(",") if n]
    unknown = sorted(set(names) - set(ALL_TARGETS))
    if unknown:
        ap.error(f"unknown targets {unknown}; choose from {ALL_TARGETS}")
    torch.set_num_threads(1)
    results = []
    with targets(names) as started:
        for k, target in enumerate(started):
            print(f"fuzzing {target.name} at {target.endpoint} (pid {target.pid}) ...", flush=True)
            res = fuzz(target, args.frames, args.seconds, args.seed + k)
            results.append(res)
            print(f"  {res['frames']} frames in {res['seconds']} s ({res['frames_per_s']}/s), "
                  f"{res['replies']} replies; alive={res['alive']} all processed={res['all_processed']} "
                  f"check={res['check_after']}; oversized "
                  f"refused {res['oversized_frames_refused']}; RSS MiB {res['rss_mib']}", flush=True)
    ok = all(r["alive"] and r["all_processed"] and r["check_after"] == "ok" for r in results)
    print(json.dumps({"name": "fuzz_servers", "figures": {r["target"]: r for r in results}, "baseline": None,
                      "ratio": None, "target": "every server alive and answering after >= 100,000 frames",
                      "ok": ok}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
