"""Conformance checks for any transfer-dock implementation (docs/dock-protocol.md, protocol 3).

    python ops/conformance/dock.py --controller tcp://127.0.0.1:5555 [--consumer NAME --reads a,b]
        [--whole-groups] [--allow-close] [--max-clients N] [--timeout S]

Drives the documented protocol with raw pyzmq + msgpack only (never streamrl's client), so it
tests the page, not our code: hello, reserve, put to the owning warehouse, columns ready -> claim,
fetch, ack, release, lease expiry, stats and its long poll, one error reply per documented error code, and the
documented limits. Prints one line per check (PASS / FAIL / SKIP) and a final ``N passed, N
failed`` line; exits 0 only if nothing failed.

It writes samples, so point it at a dock started for it: the consumer it claims for should be the
dock's only consumer (otherwise freeing and end of stream cannot be checked and are skipped).
``--reads`` says the consumer's declared reads (default: fixed by this script's first claim).
``--allow-close`` also checks ``close_input`` / ``input_closed`` / end of stream, after which the
dock takes no new samples. ``--max-clients N`` (the dock's limit, if small) checks the client cap.
"""

from __future__ import annotations

import argparse
import itertools
import math
import struct
import sys
import time
import traceback
import uuid
from collections.abc import Callable
from typing import Any

import msgpack
import zmq

PROTOCOL = 3
MAX_ITEMS = 1 << 20
MAX_DEPTH = 32
ALIGN = 16


class CheckFailed(Exception):
    """One documented behaviour did not hold."""


def expect(cond: bool, what: str) -> None:
    if not cond:
        raise CheckFailed(what)


class Conn:
    """One DEALER; replies are matched to requests by req_id (never by order), as §2 requires."""

    ids = itertools.count(1)

    def __init__(self, ctx: zmq.Context, endpoint: str, timeout_s: float) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        # a DEALER whose connection the server refused has no peer, and a send would wait for one
        # forever: bounded like every wait here
        self.sock.setsockopt(zmq.SNDTIMEO, int(timeout_s * 1000))
        self.sock.connect(endpoint)
        self.timeout_s = timeout_s
        self.early: dict[int, tuple[dict[str, Any], list[bytes]]] = {}

    def send(self, header: dict[str, Any] | bytes, *frames: bytes) -> None:
        try:
            self.sock.send_multipart([header if isinstance(header, bytes) else msgpack.packb(header), *frames])
        except zmq.Again:
            raise CheckFailed(f"could not send within {self.timeout_s} s: the server took no connection (is the "
                              "endpoint right? does it require credentials, which this checker does not present?)"
                              ) from None

    def ask(self, header: dict[str, Any] | bytes, *frames: bytes, timeout_s: float | None = None,
            req_id: int | None = None) -> tuple[dict[str, Any], list[bytes]]:
        """Send and wait for the reply carrying the request's req_id (CheckFailed if none comes)."""
        rid = req_id if req_id is not None else header["req_id"]  # type: ignore[index]
        self.send(header, *frames)
        return self.wait(rid, timeout_s)

    def wait(self, rid: int, timeout_s: float | None = None) -> tuple[dict[str, Any], list[bytes]]:
        """The reply carrying ``rid`` (CheckFailed if none comes); replies to others are kept for theirs."""
        deadline = time.monotonic() + (timeout_s or self.timeout_s)
        while rid not in self.early:
            left = deadline - time.monotonic()
            if left <= 0 or not self.sock.poll(int(left * 1000) + 1):
                raise CheckFailed(f"no reply to request {rid} within {timeout_s or self.timeout_s} s")
            parts = self.sock.recv_multipart()
            reply = msgpack.unpackb(parts[0], raw=False, strict_map_key=False)
            self.early[reply.get("req_id")] = (reply, parts[1:])
        return self.early.pop(rid)

    def silent(self, header: dict[str, Any] | bytes, wait_s: float = 0.3) -> bool:
        """Send; True if no reply at all comes within ``wait_s`` (messages documented as unanswered)."""
        self.send(header)
        return not self.sock.poll(int(wait_s * 1000))

    def close(self) -> None:
        self.sock.close(0)


def rid() -> int:
    return next(Conn.ids)


def error_code(reply: dict[str, Any]) -> str | None:
    return reply.get("code") if reply.get("type") == "error" else None


def expect_error(reply: dict[str, Any], code: str) -> None:
    expect(error_code(reply) == code, f"expected error {code!r}, got {reply}")
    expect(bool(reply.get("message")), "an error reply must say what was wrong")


def returned(info: list[int]) -> int:
    """A SampleInfo array's ``returned`` (its sixth element; 0 when a controller sends five, §3)."""
    return info[5] if len(info) > 5 else 0


class Suite:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.ctx = zmq.Context()
        self.ctl = Conn(self.ctx, args.controller, args.timeout)
        self.client_id = f"conformance-{uuid.uuid4().hex[:8]}"
        self.results: list[tuple[str, str, str]] = []
        self.warehouses: list[Conn] = []
        self.consumers: list[str] = []
        self.capacity = 0
        self.block = 1  # hello_reply.block (omitted when 1): owner(k) = (k // block) % W (§5.1)
        self.consumer = args.consumer
        self.reads: list[str] = [c for c in (args.reads or "").split(",") if c]
        self.sole = False

    # ------------------------------------------------------------------ helpers
    def hello(self, conn: Conn, client_id: str, ttl: float = 10.0) -> dict[str, Any]:
        reply, _ = conn.ask({"type": "hello", "req_id": rid(), "client_id": client_id, "protocol": PROTOCOL,
                             "lease_ttl_s": ttl})
        expect(reply.get("type") == "hello_reply", f"hello answered with {reply}")
        return reply

    def reserve(self, n: int, group_size: int = 1, client_id: str | None = None) -> dict[str, Any]:
        reply, _ = self.ctl.ask({"type": "reserve", "req_id": rid(), "client_id": client_id or self.client_id,
                                 "n": n, "group_size": group_size, "timeout_s": 10.0})
        expect(reply.get("type") == "reserved", f"reserve answered with {reply}")
        return reply

    def owner_id(self, index: int) -> int:
        return (index // self.block) % len(self.warehouses)

    def owner(self, index: int) -> Conn:
        return self.warehouses[self.owner_id(index)]

    def put_reads(self, indices: list[int], version: int = 3) -> None:
        """Put every read column of ``indices``: the first as an int64 tensor [k, k+1, k+2], the others
        as object values, each to the owning warehouse, one put per sample."""
        for k in indices:
            cols: list[dict[str, Any]] = []
            frames: list[bytes] = []
            for j, name in enumerate(self.reads):
                if j == 0:
                    cols.append({"kind": "tensor", "name": name, "dtype": "int64", "shapes": [[3]],
                                 "frames": [0], "offsets": [0]})
                    frames.append(struct.pack("<3q", k, k + 1, k + 2))
                else:
                    cols.append({"kind": "object", "name": name, "values": [{"k": k, "s": "é"}]})
            reply, _ = self.owner(k).ask({"type": "put", "req_id": rid(), "indices": [k], "columns": cols,
                                          "versions": [version], "lengths": [k % 7]}, *frames)
            expect(reply.get("type") == "ok", f"put of sample {k} answered with {reply}")

    def claim(self, n: int, min_n: int = 1, timeout_s: float = 5.0, client_id: str | None = None,
              conn: Conn | None = None, **over: Any) -> dict[str, Any]:
        msg = {"type": "claim", "req_id": rid(), "client_id": client_id or self.client_id,
               "consumer": self.consumer, "reads": self.reads, "n": n, "min_n": min_n,
               "whole_groups": self.args.whole_groups, "timeout_s": timeout_s, **over}
        reply, _ = (conn or self.ctl).ask(msg, timeout_s=timeout_s + self.args.timeout)
        return reply

    def ack(self, lease_id: int, indices: list[int] | None = None, client_id: str | None = None) -> dict[str, Any]:
        msg: dict[str, Any] = {"type": "ack", "req_id": rid(), "client_id": client_id or self.client_id,
                               "lease_id": lease_id}
        if indices is not None:
            msg["indices"] = indices
        return self.ctl.ask(msg)[0]

    def stats(self, conn: Conn | None = None) -> dict[str, Any]:
        reply, _ = (conn or self.ctl).ask({"type": "stats", "req_id": rid()})
        expect(reply.get("type") == "stats_reply", f"stats answered with {reply}")
        return reply["stats"]

    def fresh_samples(self, n: int) -> list[int]:
        """n new samples (one group of n when the consumer claims whole groups), ready to claim."""
        got = self.reserve(n, n if self.args.whole_groups else 1)
        self.put_reads(got["indices"])
        return got["indices"]

    def claim_exactly(self, want: list[int]) -> dict[str, Any]:
        reply = self.claim(len(want), min_n=len(want))
        expect(reply.get("type") == "claimed", f"claim answered with {reply}")
        got = sorted(s[0] for s in reply["samples"])
        expect(got == sorted(want), f"claimed {got}, expected the samples just made ready {sorted(want)}")
        return reply

    # ------------------------------------------------------------------ running
    def check(self, name: str, fn: Callable[[], str | None]) -> None:
        try:
            skipped = fn()
        except CheckFailed as exc:
            self.results.append((name, "FAIL", str(exc)))
        except Exception as exc:  # a crash in a check is a failed check, and the suite goes on
            self.results.append((name, "FAIL", f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=3)}"))
        else:
            self.results.append((name, "SKIP" if skipped else "PASS", skipped or ""))
        status, text = self.results[-1][1:]
        print(f"{status} {name}" + (f": {text}" if text else ""), flush=True)

    def run(self) -> int:
        self.check("hello", self.t_hello)
        if not self.warehouses:
            print("(no hello_reply: nothing else can run)")
            print("0 passed, 1 failed")
            self.ctl.close()
            self.ctx.term()
            return 1
        for name in [n for n in dir(self) if n.startswith("c_")]:
            self.check(name[4:].replace("_", " "), getattr(self, name))  # c_<order>_<name>
        self.check("close_input and end of stream", self.t_close)
        passed = sum(r[1] == "PASS" for r in self.results)
        failed = sum(r[1] == "FAIL" for r in self.results)
        skipped = sum(r[1] == "SKIP" for r in self.results)
        if skipped:
            print(f"({skipped} skipped)")
        print(f"{passed} passed, {failed} failed")
        for c in [self.ctl, *self.warehouses]:
            c.close()
        self.ctx.term()
        return 0 if failed == 0 else 1

    # ------------------------------------------------------------------ checks (run in name order)
    def t_hello(self) -> None:
        reply = self.hello(self.ctl, self.client_id)
        expect(reply["protocol"] == PROTOCOL, f"hello_reply.protocol {reply['protocol']}, expected {PROTOCOL}")
        expect(isinstance(reply["warehouses"], list) and len(reply["warehouses"]) >= 1, "no warehouse endpoints")
        expect(reply["capacity"] >= 1, "capacity must be >= 1")
        self.consumers, self.capacity = reply["consumers"], reply["capacity"]
        self.block = reply.get("block", 1)
        expect(isinstance(self.block, int) and self.block >= 1, f"hello_reply.block {self.block!r} is not >= 1")
        self.consumer = self.consumer or self.consumers[0]
        expect(self.consumer in self.consumers, f"consumer {self.consumer!r} not in {self.consumers}")
        self.sole = self.consumers == [self.consumer]
        self.reads = self.reads or ["conformance_x", "conformance_meta"]
        self.warehouses = [Conn(self.ctx, ep, self.args.timeout) for ep in reply["warehouses"]]

    def c_a_hello_requires_protocol(self) -> None:
        reply, _ = self.ctl.ask({"type": "hello", "req_id": rid(), "client_id": self.client_id})
        expect_error(reply, "malformed")  # protocol is required (§4.1)
        reply, _ = self.ctl.ask({"type": "hello", "req_id": rid(), "client_id": self.client_id, "protocol": 999})
        expect_error(reply, "protocol")

    def c_b_reserve_groups(self) -> None:
        got = self.reserve(4, 2)
        idx, groups = got["indices"], got["groups"]
        expect(len(idx) == 4 and len(set(idx)) == 4, f"reserve of 4 answered with indices {idx}")
        # each group is consecutive indices; with block 1 the whole reserve is (§5.1)
        expect(idx[1] == idx[0] + 1 and idx[3] == idx[2] + 1, f"a group's indices are not consecutive: {idx}")
        expect(self.block > 1 or idx == list(range(idx[0], idx[0] + 4)), f"indices not consecutive: {idx}")
        if self.block > 1:
            b = self.block
            expect(idx[0] // b == idx[1] // b and idx[2] // b == idx[3] // b,
                   f"a group straddles an ownership block of {b}: {idx}")
        expect(groups[0] == groups[1] and groups[2] == groups[3] and groups[1] != groups[2], f"groups {groups}")
        self.put_reads(idx)  # make them claimable, so later checks are not blocked by them
        self.drain()

    def drain(self, timeout_s: float = 0.5) -> int:
        """Claim and ack everything claimable for the consumer now; returns how many."""
        total = 0
        while True:
            reply = self.claim(1 << 10, timeout_s=timeout_s)
            if reply.get("type") != "claimed" or not reply.get("samples"):
                return total
            expect(self.ack(reply["lease_id"]).get("type") == "ok", "ack of a drained lease refused")
            total += len(reply["samples"])

    def c_c_put_claim_fetch_ack_free(self) -> None:
        before = self.stats()
        wh_before = [self.stats(w)["samples"] for w in self.warehouses]
        idx = self.fresh_samples(2)
        reply = self.claim_exactly(idx)
        for s in reply["samples"]:
            expect(len(s) >= 5, f"SampleInfo must be a 5-array, got {s}")
            index, _group, group_size, version, length = s[:5]
            expect(version == 3 and length == index % 7, f"version/length not forwarded: {s}")
            expect(group_size == (2 if self.args.whole_groups else 1), f"group_size {group_size}")
        for k in idx:
            got, frames = self.owner(k).ask({"type": "get", "req_id": rid(), "indices": [k], "columns": self.reads})
            expect(got.get("type") == "fetched" and got["indices"] == [k], f"get answered with {got}")
            col = got["columns"][0]
            expect(col["kind"] == "tensor" and col["dtype"] == "int64" and col["shapes"] == [[3]], f"column {col}")
            data = frames[col["frames"][0]][col["offsets"][0]:col["offsets"][0] + 24]
            expect(struct.unpack("<3q", data) == (k, k + 1, k + 2), f"sample {k} came back as {data!r}")
            for extra in got["columns"][1:]:
                expect(extra["values"] == [{"k": k, "s": "é"}], f"object column came back as {extra}")
        expect(self.ack(reply["lease_id"]).get("type") == "ok", "ack refused")
        expect_error(self.ack(reply["lease_id"]), "unknown_lease")
        if not self.sole:
            return
        after = self.stats()
        expect(after["samples_freed"] - before["samples_freed"] >= 2, "acked samples were not freed")
        deadline = time.monotonic() + 5
        while sum(self.stats(w)["samples"] for w in self.warehouses) > sum(wh_before):
            expect(time.monotonic() < deadline, "warehouses did not drop the freed samples' data within 5 s")
            time.sleep(0.05)

    def c_d_ack_duplicates_and_partial(self) -> None:
        idx = self.fresh_samples(2)
        reply = self.claim_exactly(idx)
        if self.args.whole_groups:
            expect(self.ack(reply["lease_id"]).get("type") == "ok", "ack refused")
            return
        expect(self.ack(reply["lease_id"], [idx[0], idx[0]]).get("type") == "ok", "ack with a repeated index")
        expect_error(self.ack(reply["lease_id"], [idx[0] + 10**9]), "bad_field")
        expect(self.ack(reply["lease_id"], [idx[1]]).get("type") == "ok", "ack of the rest")
        expect_error(self.ack(reply["lease_id"]), "unknown_lease")

    def c_d_ack_discard(self) -> None:
        before = self.stats()
        idx = self.fresh_samples(2)
        reply = self.claim_exactly(idx)
        ok, _ = self.ctl.ask({"type": "ack", "req_id": rid(), "client_id": self.client_id,
                              "lease_id": reply["lease_id"], "discard": True})
        expect(ok.get("type") == "ok", f"ack with discard answered with {ok}")
        bad, _ = self.ctl.ask({"type": "ack", "req_id": rid(), "client_id": self.client_id,
                               "lease_id": reply["lease_id"], "discard": 1})
        expect_error(bad, "malformed")  # bool fields take msgpack booleans only (§3)
        after = self.stats()
        expect(after.get("samples_discarded", 0) - before.get("samples_discarded", 0) == 2,
               f"samples_discarded went {before.get('samples_discarded')} -> {after.get('samples_discarded')}")

    def c_d_put_carries_ack(self) -> str | None:
        """§5.7: a put with ack_client and ack_lease acks its samples for the lease's consumer once
        their columns are ready; the lease is then gone (a separate ack is unknown_lease)."""
        if self.args.declared_columns:
            return "a dock with declared columns refuses the check's own column (run it against one without)"
        idx = self.fresh_samples(2)
        reply = self.claim_exactly(idx)
        before = self.stats()["consumers"][self.consumer]["done"]
        for k in idx:
            put = {"type": "put", "req_id": rid(), "indices": [k], "ack_client": self.client_id,
                   "ack_lease": reply["lease_id"],
                   "columns": [{"kind": "object", "name": "conformance_result", "values": [k]}]}
            ok, _ = self.owner(k).ask(put)
            expect(ok.get("type") == "ok", f"a put with its lease's ack was answered with {ok}")
        done = self.stats()["consumers"][self.consumer]["done"]
        expect(done - before == 2, f"a put's ack must make its samples done for the consumer: done went {before} "
                                   f"-> {done}")
        expect_error(self.ack(reply["lease_id"]), "unknown_lease")
        (k,) = self.reserve(1)["indices"]
        half, _ = self.owner(k).ask({"type": "put", "req_id": rid(), "indices": [k], "ack_lease": 1,
                                     "columns": [{"kind": "object", "name": "conformance_result", "values": [k]}]})
        expect_error(half, "bad_request")  # ack_lease without ack_client: refused, nothing stored
        self.put_reads([k])
        self.drain()
        return None

    def c_e_release_returns_samples(self) -> None:
        idx = self.fresh_samples(2)
        reply = self.claim_exactly(idx)
        expect(all(returned(s) == 0 for s in reply["samples"]), f"a first delivery has returned 0: {reply}")
        rel, _ = self.ctl.ask({"type": "release", "req_id": rid(), "client_id": self.client_id,
                               "lease_id": reply["lease_id"]})
        expect(rel.get("type") == "ok", f"release answered with {rel}")
        again = self.claim_exactly(idx)
        expect(all(returned(s) == 1 for s in again["samples"]),
               f"a released sample comes back with returned 1 (SampleInfo's sixth element): {again}")
        expect(self.ack(again["lease_id"]).get("type") == "ok", "ack after release refused")

    def c_e_one_reserve(self) -> None:
        first = self.fresh_samples(2)
        second = self.fresh_samples(2)
        reply = self.claim(4, one_reserve=True)
        expect(reply.get("type") == "claimed", f"claim answered with {reply}")
        got = sorted(s[0] for s in reply["samples"])
        expect(got == sorted(first), f"one_reserve claimed {got}: expected the first reserve's {sorted(first)} only")
        expect(self.ack(reply["lease_id"]).get("type") == "ok", "ack refused")
        rest = self.claim_exactly(second)
        expect(self.ack(rest["lease_id"]).get("type") == "ok", "ack refused")

    def c_f_lease_expiry(self) -> None:
        idx = self.fresh_samples(2)
        short = Conn(self.ctx, self.args.controller, self.args.timeout)
        try:
            cid = f"{self.client_id}-short"
            self.hello(short, cid, ttl=0.3)
            reply = self.claim(2, min_n=2, client_id=cid, conn=short)
            expect(sorted(s[0] for s in reply.get("samples", [])) == sorted(idx), f"claim answered with {reply}")
            time.sleep(0.8)  # silent past its TTL: its lease must go back to the pool
            again = self.claim_exactly(idx)
            expect(all(returned(s) == 1 for s in again["samples"]),
                   f"a sample of an expired lease comes back with returned 1 (SampleInfo's sixth element): {again}")
            expect(self.ack(again["lease_id"]).get("type") == "ok", "ack refused")
            expect_error(self.ack(reply["lease_id"], client_id=cid), "unknown_lease")
        finally:
            short.close()

    def c_g_stats(self) -> None:
        st = self.stats()
        for key in ("capacity", "in_flight", "claimed", "leases", "consumers", "samples_acked"):
            expect(key in st, f"controller stats lack {key!r}")
        for w in self.warehouses:
            ws = self.stats(w)
            for key in ("warehouse_id", "samples", "bytes_held"):
                expect(key in ws, f"warehouse stats lack {key!r}")

    def c_g_stats_long_poll(self) -> None:
        st, _ = self.ctl.ask({"type": "stats", "req_id": rid(), "watch": [self.consumer]})
        expect(st.get("type") == "stats_reply" and isinstance(st["stats"].get("watched"), int),
               f"stats with watch must carry an integer watched token (§5.9), got {st}")
        token = st["stats"]["watched"]
        t0 = time.monotonic()
        same, _ = self.ctl.ask({"type": "stats", "req_id": rid(), "watch": [self.consumer], "seen": token,
                                "timeout_s": 0.3})
        waited = time.monotonic() - t0
        expect(same.get("type") == "stats_reply" and same["stats"].get("watched") == token,
               f"a long poll nothing changed for is answered at its timeout with the same token, got {same}")
        expect(waited >= 0.25, f"a long poll with the current token was answered after {waited:.2f} s, before "
                               "its timeout_s of 0.3 s, though nothing it watches changed")
        poll = rid()
        self.ctl.send({"type": "stats", "req_id": poll, "watch": [self.consumer], "seen": token, "timeout_s": 10.0})
        idx = self.fresh_samples(2)  # reserve and put: ready counts, which are not watched
        time.sleep(0.1)
        while self.ctl.sock.poll(0):
            parts = self.ctl.sock.recv_multipart()
            reply = msgpack.unpackb(parts[0], raw=False, strict_map_key=False)
            self.ctl.early[reply.get("req_id")] = (reply, parts[1:])
        expect(poll not in self.ctl.early, "a long poll was answered by a reserve and a put, which change "
                                           "nothing it watches (§5.9)")
        t1 = time.monotonic()
        lease = self.claim_exactly(idx)  # the consumer's claimed count changes
        changed, _ = self.ctl.wait(poll, timeout_s=5.0)
        expect(changed.get("type") == "stats_reply" and changed["stats"].get("watched") != token,
               f"a claim by the watched consumer must answer its long poll with a new token, got {changed}")
        expect(time.monotonic() - t1 < 2.0, "the long poll was answered only at its timeout, not at the claim")
        expect(self.ack(lease["lease_id"]).get("type") == "ok", "ack refused")
        bad, _ = self.ctl.ask({"type": "stats", "req_id": rid(), "watch": ["conformance-nobody"]})
        expect_error(bad, "unknown_consumer")
        bad, _ = self.ctl.ask({"type": "stats", "req_id": rid(), "seen": token})
        expect_error(bad, "bad_field")
        bad, _ = self.warehouses[0].ask({"type": "stats", "req_id": rid(), "watch": [self.consumer]})
        expect_error(bad, "bad_field")

    def c_h_error_codes(self) -> None:
        reply, _ = self.ctl.ask({"type": "launch_missiles", "req_id": rid()})
        expect_error(reply, "malformed")
        reply, _ = self.ctl.ask(msgpack.packb({"type": "stats", "req_id": (r := rid())}), b"extra", req_id=r)
        expect_error(reply, "bad_frames")
        expect_error(self.claim(2, min_n=3), "bad_field")
        reply, _ = self.ctl.ask({"type": "reserve", "req_id": rid(), "client_id": self.client_id, "n": 3,
                                 "group_size": 2})
        expect_error(reply, "bad_field")
        expect_error(self.claim(1, consumer="no-such-consumer-xyz"), "unknown_consumer")
        reply, _ = self.ctl.ask({"type": "release", "req_id": rid(), "client_id": self.client_id,
                                 "lease_id": 10**15})
        expect_error(reply, "unknown_lease")
        # full: a reserve of the whole capacity cannot fit while anything is in flight
        held = self.reserve(1)
        reply, _ = self.ctl.ask({"type": "reserve", "req_id": rid(), "client_id": self.client_id,
                                 "n": self.capacity, "timeout_s": 0.0})
        expect_error(reply, "full")
        reply, _ = self.ctl.ask({"type": "reserve", "req_id": rid(), "client_id": self.client_id,
                                 "n": self.capacity, "timeout_s": 0.3})
        expect_error(reply, "timeout")
        self.put_reads(held["indices"])
        self.drain()
        got, _ = self.warehouses[0].ask({"type": "get", "req_id": rid(), "indices": [len(self.warehouses) * 10**12],
                                         "columns": ["nope"]})
        # a dock with declared columns refuses the undeclared name first (§6.2)
        expect_error(got, "unknown_column" if self.args.declared_columns else "bad_request")

    def c_i_put_owner_and_frames(self) -> None:
        idx = self.reserve(1)["indices"]
        k = idx[0]
        col = {"kind": "tensor", "name": self.reads[0], "dtype": "int64", "shapes": [[3]], "frames": [0],
               "offsets": [0]}
        put = {"type": "put", "req_id": 0, "indices": [k], "columns": [col]}
        data = struct.pack("<3q", k, k + 1, k + 2)
        if len(self.warehouses) > 1:
            wrong = self.warehouses[(self.owner_id(k) + 1) % len(self.warehouses)]
            expect_error(wrong.ask({**put, "req_id": rid()}, data)[0], "bad_request")
        # frames must be as long as the header says (up to ALIGN-1 bytes of padding per value)
        expect_error(self.owner(k).ask({**put, "req_id": rid()}, data + b"\0" * 4096)[0], "bad_request")
        expect_error(self.owner(k).ask({**put, "req_id": rid()}, data, b"unreferenced")[0], "bad_request")
        expect_error(self.owner(k).ask({**put, "req_id": rid()}, data[:-1])[0], "bad_request")
        self.put_reads(idx)  # the refused puts stored nothing: the real one succeeds
        self.drain()

    def c_j_warehouse_only_messages(self) -> None:
        idx = self.reserve(1)["indices"]
        fake = {"type": "columns_ready", "warehouse_id": self.owner_id(idx[0]), "indices": idx,
                "columns": self.reads}
        self.ctl.send(fake)  # from a client connection: refused (an error with req_id -1, or nothing)
        time.sleep(0.2)
        reply = self.claim(1, timeout_s=0.3)
        expect(not reply.get("samples"), f"columns_ready from a non-warehouse made samples claimable: {reply}")
        self.ctl.early.pop(-1, None)
        reply, _ = self.ctl.ask({"type": "warehouse_hello", "req_id": rid(), "warehouse_id": 0,
                                 "endpoint": "tcp://192.0.2.1:9", "protocol": PROTOCOL, "secret": "wrong"})
        expect_error(reply, "unauthorized")
        endpoints = self.hello(self.ctl, self.client_id)["warehouses"]
        expect("tcp://192.0.2.1:9" not in endpoints, "an unauthenticated warehouse_hello replaced a warehouse")
        self.put_reads(idx)
        self.drain()

    def c_k_limits(self) -> None:
        base = {"type": "claim", "client_id": self.client_id, "consumer": self.consumer, "reads": self.reads,
                "n": 1}
        for over in ({"n": MAX_ITEMS + 1}, {"n": 0}, {"timeout_s": math.nan}, {"timeout_s": math.inf},
                     {"timeout_s": -1.0}, {"min_version": -1}, {"client_id": "c" * 257}):
            reply, _ = self.ctl.ask({**base, **over, "req_id": rid()})
            expect_error(reply, "malformed")
        hello = msgpack.packb({"type": "hello", "req_id": (r := rid()), "client_id": "é", "protocol": PROTOCOL})
        reply, _ = self.ctl.ask(hello.replace("é".encode(), b"\xff\xfe"), req_id=r)
        expect_error(reply, "malformed")  # not UTF-8
        for ttl in (0.01, 7200.0, math.nan):  # outside [0.05, 3600]
            reply, _ = self.ctl.ask({"type": "hello", "req_id": rid(), "client_id": self.client_id,
                                     "protocol": PROTOCOL, "lease_ttl_s": ttl})
            expect_error(reply, "malformed")
        nested: Any = 0
        for _ in range(MAX_DEPTH + 1):
            nested = [nested]
        put = {"type": "put", "req_id": rid(), "indices": [0],
               "columns": [{"kind": "object", "name": "deep", "values": [nested]}]}
        expect_error(self.warehouses[0].ask(put)[0], "malformed")
        self.ctl.send(b"\x82\xa4type\xa5stats\xa6req_id" + b"\x91" * 100_000 + b"\x00")  # no readable id
        self.stats()  # still answering

    def c_l_declared_view(self) -> str | None:
        if not self.args.reads:
            return "no --reads given: the consumer's view was fixed by this script's first claim"
        expect_error(self.claim(1, reads=[*self.reads, "conformance_not_declared"], timeout_s=0.0), "bad_field")
        expect_error(self.claim(1, whole_groups=not self.args.whole_groups, timeout_s=0.0), "bad_field")
        return None

    def c_m_client_cap(self) -> str | None:
        cap = self.args.max_clients
        if not cap:
            return "no --max-clients given"
        conn = Conn(self.ctx, self.args.controller, self.args.timeout)
        try:
            refused = None
            for k in range(cap + 1):
                reply, _ = conn.ask({"type": "hello", "req_id": rid(), "client_id": f"{self.client_id}-cap{k}",
                                     "protocol": PROTOCOL, "lease_ttl_s": 0.2})
                if error_code(reply) == "too_many_clients":
                    refused = reply
                    break
            expect(refused is not None, f"{cap + 1} new client ids were all accepted (limit {cap})")
            deadline = time.monotonic() + 5  # idle clients are forgotten after their TTL
            while time.monotonic() < deadline:
                reply, _ = conn.ask({"type": "hello", "req_id": rid(), "client_id": f"{self.client_id}-late",
                                     "protocol": PROTOCOL, "lease_ttl_s": 0.2})
                if reply.get("type") == "hello_reply":
                    return None
                time.sleep(0.2)
            raise CheckFailed("idle clients were never forgotten: a new client is still refused")
        finally:
            conn.close()

    def c_n_declared_columns(self) -> str | None:
        if not self.args.declared_columns:
            return "no --declared-columns given: the dock was started without a pipeline's column names"
        k = self.reserve(1)["indices"][0]
        junk = [{"kind": "object", "name": f"conformance_junk{j}", "values": [j]} for j in range(256)]
        reply, _ = self.owner(k).ask({"type": "put", "req_id": rid(), "indices": [k], "columns": junk})
        expect_error(reply, "unknown_column")
        expect("conformance_junk0" in reply.get("message", ""), f"unknown_column does not name the column: {reply}")
        expect("conformance_junk0" not in self.stats()["columns"], "an undeclared column reached the controller")
        self.put_reads([k])  # nothing was stored: the declared columns still go in
        self.drain()
        return None

    def c_n_wire_edges(self) -> str | None:
        """The edges of §2 and §4.0: an object value of depth exactly MAX_DEPTH is stored (33 is
        malformed: limits); a req_id that is not an int in [0, 2^63 - 1] (negative, 2^63, a float,
        a bool) is dropped unanswered; a REQ-style empty delimiter frame is dropped unanswered; an
        index of 2^63 or a bool count is malformed, answered with the request's req_id."""
        if self.args.declared_columns:
            return "a dock with declared columns refuses the check's own column (run it against one without)"
        (k,) = self.reserve(1)["indices"]
        nested: Any = 0
        for _ in range(MAX_DEPTH):  # a scalar is depth 0, [0] depth 1, ...: this one is depth 32
            nested = [nested]
        put = {"type": "put", "req_id": rid(), "indices": [k],
               "columns": [{"kind": "object", "name": "conformance_deep", "values": [nested]}]}
        reply, _ = self.owner(k).ask(put)
        expect(reply.get("type") == "ok", f"a value nested exactly {MAX_DEPTH} deep was answered with {reply}")
        got, _ = self.owner(k).ask({"type": "get", "req_id": rid(), "indices": [k], "columns": ["conformance_deep"]})
        expect(got.get("type") == "fetched" and got["columns"][0]["values"] == [nested],
               f"the {MAX_DEPTH}-deep value came back as {got!r:.200}")
        self.put_reads([k])
        self.drain()
        quiet = Conn(self.ctx, self.args.controller, self.args.timeout)
        try:
            for bad in (-1, 2**63, 1.5, True):
                expect(quiet.silent({"type": "stats", "req_id": bad}), f"a stats with req_id {bad!r} was answered")
            quiet.sock.send_multipart([b"", msgpack.packb({"type": "stats", "req_id": rid()})])
            expect(not quiet.sock.poll(300), "a message after an empty delimiter frame (a REQ socket) was answered")
        finally:
            quiet.close()
        got, _ = self.warehouses[0].ask({"type": "get", "req_id": rid(), "indices": [2**63], "columns": self.reads})
        expect_error(got, "malformed")
        reply, _ = self.ctl.ask({"type": "reserve", "req_id": rid(), "client_id": self.client_id, "n": True})
        expect_error(reply, "malformed")
        self.stats()  # still answering
        return None

    def c_o_any_frame_layout(self) -> str | None:
        """§5.2: a receiver accepts any layout that passes the checks, here two tensors of one
        sample packed in one frame at aligned offsets 0 and 32, as streamrl's encoder packs them."""
        if self.args.declared_columns:
            return "a dock with declared columns refuses the check's own column (run it against one without)"
        (k,) = self.reserve(1)["indices"]
        first = {"kind": "tensor", "name": self.reads[0], "dtype": "int64", "shapes": [[3]], "frames": [0],
                 "offsets": [0]}
        packed = {"kind": "tensor", "name": "conformance_packed", "dtype": "int64", "shapes": [[2]], "frames": [0],
                  "offsets": [32]}
        objects = [{"kind": "object", "name": name, "values": [{"k": k, "s": "é"}]} for name in self.reads[1:]]
        frame = struct.pack("<3q", k, k + 1, k + 2) + b"\0" * 8 + struct.pack("<2q", -k, 7)  # 48 bytes
        reply, _ = self.owner(k).ask({"type": "put", "req_id": rid(), "indices": [k],
                                      "columns": [first, packed, *objects], "versions": [3], "lengths": [k % 7]},
                                     frame)
        expect(reply.get("type") == "ok", f"a put of two tensors in one pack frame was answered with {reply}")
        got, frames = self.owner(k).ask({"type": "get", "req_id": rid(), "indices": [k],
                                         "columns": [self.reads[0], "conformance_packed"]})
        expect(got.get("type") == "fetched", f"get answered with {got}")
        values = []
        for col, size in zip(got["columns"], (24, 16), strict=True):
            start = col["offsets"][0]
            values.append(frames[col["frames"][0]][start:start + size])
        expect(struct.unpack("<3q", values[0]) == (k, k + 1, k + 2) and struct.unpack("<2q", values[1]) == (-k, 7),
               f"the packed tensors came back as {values}")
        self.drain()
        return None

    def t_close(self) -> str | None:
        if not self.args.allow_close:
            return "needs --allow-close (the dock takes no new samples afterwards)"
        if not self.sole:
            return f"consumer {self.consumer!r} is not the dock's only consumer ({self.consumers})"
        reply, _ = self.ctl.ask({"type": "close_input", "req_id": rid(), "client_id": self.client_id})
        expect(reply.get("type") == "ok", f"close_input answered with {reply}")
        reply, _ = self.ctl.ask({"type": "reserve", "req_id": rid(), "client_id": self.client_id, "n": 1})
        expect_error(reply, "input_closed")
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            reply = self.claim(1 << 10, timeout_s=0.5)
            if reply.get("end"):
                expect(not reply.get("samples"), "end with samples")
                return None
            if reply.get("samples"):
                self.ack(reply["lease_id"])
        raise CheckFailed("no claimed{end: true} within 10 s of close_input")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--controller", required=True, help="the dock controller's endpoint")
    ap.add_argument("--consumer", default="", help="consumer to claim for (default: the first in hello_reply)")
    ap.add_argument("--reads", default="", help="the consumer's declared reads, comma-separated")
    ap.add_argument("--whole-groups", action="store_true", help="the consumer is declared with whole_groups")
    ap.add_argument("--allow-close", action="store_true", help="also check close_input (ends the dock's input)")
    ap.add_argument("--declared-columns", action="store_true", help="the dock was started with a pipeline's "
                    "column names (a policy): check that others are refused (unknown_column)")
    ap.add_argument("--max-clients", type=int, default=0, help="the dock's client limit, to check it (small only)")
    ap.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for any one reply")
    return Suite(ap.parse_args(argv)).run()


if __name__ == "__main__":
    sys.exit(main())
