"""A complete reward server written from docs/reward-protocol.md alone: pyzmq + msgpack, no streamrl.

It shows what a server in any language has to do; port it line by line. The reward is exact match
against ``metadata["answer"]`` when the sample has one (the conformance suite's reference rule, like
``streamrl.rewards.builtin:exact_match``), else a named pair of scores:
``{"length": len(response), "has_answer_tag": 0 or 1}``. It passes ops/conformance/reward_server.py.

    python ops/rewards/minimal_server.py --bind tcp://127.0.0.1:5555

Prints "READY <endpoint>" once bound. Single-threaded: it scores a batch before reading the next
message, so a batch must take less than the client's heartbeat timeout (10 s by default).
"""

import argparse
import signal
import sys

import msgpack
import zmq

PROTOCOL_VERSIONS = [1]
ID_MAX = 2**63 - 1  # request ids, sample ids and nonces are ints in 0..2^63-1 (spec §2)
INT32_MAX = 2**31 - 1  # token ids are ints in 0..2^31-1, versions in 1..2^31-1 (spec §2)
MAX_METADATA_DEPTH = 32  # the metadata map itself is level 1 (spec §2)


def is_int_in(value, low, high):
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def is_id(value):
    return is_int_in(value, 0, ID_MAX)


def depth(value):
    """Levels of maps/arrays in ``value`` (a scalar is 0; map keys count too). Iterative."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, (list, tuple, dict)):
            deepest = max(deepest, level)
            children = [*item.keys(), *item.values()] if isinstance(item, dict) else item
            stack.extend((child, level + 1) for child in children)
    return deepest


def problem(message):
    """Why a request map breaks the spec (naming the field), or None. Nil means absent (§2)."""
    kind = message.get("type")
    if kind == "hello":
        versions = message.get("versions")
        if not isinstance(versions, list) or not all(is_int_in(v, 1, INT32_MAX) for v in versions):
            return "$.versions must be an array of ints in 1..2^31-1"
    elif kind == "ping":
        if not is_id(message.get("nonce")):
            return "$.nonce must be an int in 0..2^63-1"
    elif kind == "score":
        if not is_id(message.get("request_id")):
            return "$.request_id must be an int in 0..2^63-1"
        if not isinstance(message.get("samples"), list):
            return "$.samples must be an array"
        for i, sample in enumerate(message["samples"]):
            if not isinstance(sample, dict):
                return f"$.samples[{i}] must be a map"
            if not is_id(sample.get("id")):
                return f"$.samples[{i}].id must be an int in 0..2^63-1"
            for field, kind_of in (("prompt", str), ("response", str), ("metadata", dict)):
                if sample.get(field) is not None and not isinstance(sample[field], kind_of):
                    return f"$.samples[{i}].{field} must be a {kind_of.__name__}"
            for field in ("prompt_ids", "response_ids"):
                ids = sample.get(field)
                if ids is not None and not (isinstance(ids, list) and all(is_int_in(t, 0, INT32_MAX) for t in ids)):
                    return f"$.samples[{i}].{field} must be an array of ints in 0..2^31-1"
            if depth(sample.get("metadata")) > MAX_METADATA_DEPTH:
                return f"$.samples[{i}].metadata nests deeper than {MAX_METADATA_DEPTH} levels"
    else:
        return f"$.type: unknown message type {kind!r}"
    return None


def reward(sample):
    """Score one sample map; raise to report an error for just this sample."""
    response = sample.get("response")
    if response is None:
        raise ValueError("sample has no response text")
    answer = (sample.get("metadata") or {}).get("answer")
    if answer is not None:
        return 1.0 if response.strip() == str(answer).strip() else 0.0
    return {"length": float(len(response)), "has_answer_tag": 1.0 if "<answer>" in response else 0.0}


def handle(message):
    """The reply map for one request map."""
    if not isinstance(message, dict):
        return {"type": "error", "code": "bad_request", "message": "a message must be a map", "request_id": None}
    why = problem(message)
    if why is not None:
        request_id = message.get("request_id")
        return {
            "type": "error",
            "code": "bad_request",
            "message": why,
            "request_id": request_id if is_id(request_id) else None,  # echoed when readable
        }
    kind = message["type"]
    if kind == "hello":
        common = set(message["versions"]) & set(PROTOCOL_VERSIONS)
        if not common:
            return {
                "type": "error",
                "code": "unsupported_version",
                "message": "no common protocol version",
                "versions": PROTOCOL_VERSIONS,
            }
        return {"type": "hello_reply", "version": max(common), "server": "minimal-python", "workers": 1}
    if kind == "ping":
        return {"type": "pong", "nonce": message["nonce"], "in_flight": 0}
    results = []
    for sample in message["samples"]:
        try:
            results.append({"id": sample["id"], "score": reward(sample)})
        except Exception as exc:  # one bad sample must not take the server down
            results.append({"id": sample["id"], "error": f"{type(exc).__name__}: {exc}"})
    return {"type": "score_reply", "request_id": message["request_id"], "results": results}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bind", required=True)
    args = parser.parse_args()

    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    signal.signal(signal.SIGINT, lambda *_: stopping.append(True))

    context = zmq.Context()
    socket = context.socket(zmq.ROUTER)
    socket.setsockopt(zmq.MAXMSGSIZE, 256 * 2**20)  # a peer declaring more is disconnected (§9)
    socket.bind(args.bind)
    print("READY", socket.getsockopt_string(zmq.LAST_ENDPOINT), flush=True)

    poller = zmq.Poller()
    poller.register(socket, zmq.POLLIN)
    while not stopping:
        if not poller.poll(100):  # wake up regularly to notice SIGTERM
            continue
        frames = socket.recv_multipart()
        # [client id, payload] from a DEALER, [client id, b"", payload] from a REQ; nothing else.
        envelope, payload = frames[:-1], frames[-1]
        if not (len(frames) == 2 or (len(frames) == 3 and frames[1] == b"")):
            envelope, payload = frames[:1], None
        try:
            if payload is None:
                raise ValueError(f"expected one msgpack frame per message, got {len(frames) - 1}")
            reply = handle(msgpack.unpackb(payload, raw=False))
        except Exception as exc:  # undecodable: invalid msgpack or UTF-8, nested too deep, ...
            reply = {
                "type": "error",
                "code": "bad_request",
                "message": f"cannot read message: {exc}",
                "request_id": None,
            }
        socket.send_multipart([*envelope, msgpack.packb(reply, use_bin_type=True)])
    socket.close(linger=1000)  # let the last replies go out
    context.term()
    return 0


if __name__ == "__main__":
    sys.exit(main())
