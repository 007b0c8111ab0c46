"""A complete reward server written from docs/reward-protocol.md alone: pyzmq + msgpack, no streamrl.

It shows what a server in any language has to do; port it line by line. The reward is exact match
against ``metadata["answer"]`` when the sample has one, else a named pair of scores:
``{"length": len(response), "has_answer_tag": 0 or 1}``.

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
    kind = message.get("type") if isinstance(message, dict) else None
    if kind == "hello":
        common = set(message.get("versions", [])) & set(PROTOCOL_VERSIONS)
        if not common:
            return {
                "type": "error",
                "code": "unsupported_version",
                "message": "no common protocol version",
                "versions": PROTOCOL_VERSIONS,
            }
        return {"type": "hello_reply", "version": max(common), "server": "minimal-python", "workers": 1}
    if kind == "ping":
        return {"type": "pong", "nonce": message.get("nonce", 0), "in_flight": 0}
    if kind == "score":
        results = []
        for sample in message.get("samples", []):
            try:
                results.append({"id": sample["id"], "score": reward(sample)})
            except Exception as exc:  # one bad sample must not take the server down
                results.append({"id": sample.get("id"), "error": f"{type(exc).__name__}: {exc}"})
        return {"type": "score_reply", "request_id": message["request_id"], "results": results}
    request_id = message.get("request_id") if isinstance(message, dict) else None
    return {
        "type": "error",
        "code": "bad_request",
        "message": f"unknown message type {kind!r}",
        "request_id": request_id,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bind", required=True)
    args = parser.parse_args()

    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    signal.signal(signal.SIGINT, lambda *_: stopping.append(True))

    context = zmq.Context()
    socket = context.socket(zmq.ROUTER)
    socket.bind(args.bind)
    print("READY", socket.getsockopt_string(zmq.LAST_ENDPOINT), flush=True)

    poller = zmq.Poller()
    poller.register(socket, zmq.POLLIN)
    while not stopping:
        if not poller.poll(100):  # wake up regularly to notice SIGTERM
            continue
        frames = socket.recv_multipart()
        envelope, payload = frames[:-1], frames[-1]  # [client id] or [client id, b""] for REQ clients
        try:
            message = msgpack.unpackb(payload, raw=False)
            reply = handle(message)
        except Exception as exc:
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
