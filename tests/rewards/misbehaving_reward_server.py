"""A reward server that speaks the handshake correctly and then answers score requests wrongly.

pyzmq + msgpack only (like ops/rewards/minimal_server.py). Modes:
  garbage      score replies are bytes that are not msgpack at all
  wrong_count  one result fewer than samples
  wrong_type   every score is a string
  bad_version  refuses every protocol version offered in hello

    python misbehaving_reward_server.py MODE --bind tcp://127.0.0.1:0
"""

import argparse
import signal
import sys

import msgpack
import zmq


def reply_for(mode, message):
    kind = message.get("type")
    if kind == "hello":
        if mode == "bad_version":
            return {
                "type": "error",
                "code": "unsupported_version",
                "message": "I only speak 7",
                "versions": [7],
            }
        return {"type": "hello_reply", "version": 1, "server": f"misbehaving-{mode}", "workers": 1}
    if kind == "ping":
        return {"type": "pong", "nonce": message["nonce"], "in_flight": 0}
    samples = message["samples"]
    results = [{"id": s["id"], "score": float(len(s.get("response") or ""))} for s in samples]
    if mode == "wrong_count":
        results = results[:-1]
    elif mode == "wrong_type":
        results = [{"id": r["id"], "score": "excellent"} for r in results]
    return {"type": "score_reply", "request_id": message["request_id"], "results": results}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["garbage", "wrong_count", "wrong_type", "bad_version"])
    parser.add_argument("--bind", required=True)
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))

    socket = zmq.Context().socket(zmq.ROUTER)
    socket.bind(args.bind)
    print("READY", socket.getsockopt_string(zmq.LAST_ENDPOINT), flush=True)
    while True:
        frames = socket.recv_multipart()
        message = msgpack.unpackb(frames[-1], raw=False)
        if args.mode == "garbage" and message.get("type") == "score":
            payload = b"\xc1 this is not msgpack"
        else:
            payload = msgpack.packb(reply_for(args.mode, message), use_bin_type=True)
        socket.send_multipart([*frames[:-1], payload])


if __name__ == "__main__":
    main()
