"""A reward server that speaks the handshake correctly and then answers score requests wrongly.

pyzmq + msgpack only (like ops/rewards/minimal_server.py). Modes:
  garbage      score replies are bytes that are not msgpack at all
  wrong_count  one result fewer than samples
  wrong_type   every score is a string
  bad_version  refuses every protocol version offered in hello
  nil_fields   correct, but sends every optional field as nil (hello_reply, pong, score results)
  anonymous_error  answers score requests with an error that carries no request_id
  bad_utf8     score replies whose error text is not valid UTF-8
  deep         score replies nested far too deeply to decode
  many_frames  score replies of many frames
  huge_reply   score replies padded to 4 MiB (an unknown key), more than a client takes for a small batch

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
        if mode == "nil_fields":
            return {"type": "hello_reply", "version": 1, "server": None, "workers": None}
        if mode == "bad_version":
            return {
                "type": "error",
                "code": "unsupported_version",
                "message": "I only speak 7",
                "versions": [7],
            }
        return {"type": "hello_reply", "version": 1, "server": f"misbehaving-{mode}", "workers": 1}
    if kind == "ping":
        return {"type": "pong", "nonce": message["nonce"], "in_flight": None if mode == "nil_fields" else 0}
    samples = message["samples"]
    if mode == "anonymous_error":
        return {"type": "error", "code": "bad_request", "message": "cannot read that", "request_id": None}
    results = [{"id": s["id"], "score": float(len(s.get("response") or ""))} for s in samples]
    if mode == "nil_fields":
        results = [{**r, "error": None} for r in results]
    if mode == "huge_reply":
        return {
            "type": "score_reply",
            "request_id": message["request_id"],
            "results": results,
            "pad": "x" * 2**22,
        }
    if mode == "wrong_count":
        results = results[:-1]
    elif mode == "wrong_type":
        results = [{"id": r["id"], "score": "excellent"} for r in results]
    return {"type": "score_reply", "request_id": message["request_id"], "results": results}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "mode",
        choices=[
            "garbage",
            "wrong_count",
            "wrong_type",
            "bad_version",
            "nil_fields",
            "anonymous_error",
            "bad_utf8",
            "deep",
            "many_frames",
            "huge_reply",
        ],
    )
    parser.add_argument("--bind", required=True)
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))

    socket = zmq.Context().socket(zmq.ROUTER)
    socket.bind(args.bind)
    print("READY", socket.getsockopt_string(zmq.LAST_ENDPOINT), flush=True)
    while True:
        frames = socket.recv_multipart()
        try:
            message = msgpack.unpackb(frames[-1], raw=False)
            message.get("type")
        except Exception:
            continue  # what it cannot read it ignores (its misbehaviour is its mode's, not a crash)
        scoring = message.get("type") == "score"
        if args.mode == "garbage" and scoring:
            payload = b"\xc1 this is not msgpack"
        elif args.mode == "bad_utf8" and scoring:
            # {"type": "score_reply", "request_id": N, "results": [{"id": ID, "error": <invalid UTF-8>}]}
            result = b"\x82" + msgpack.packb("id") + msgpack.packb(message["samples"][0]["id"])
            result += msgpack.packb("error") + b"\xa2\xff\xfe"
            payload = b"\x83" + msgpack.packb("type") + msgpack.packb("score_reply")
            payload += msgpack.packb("request_id") + msgpack.packb(message["request_id"])
            payload += msgpack.packb("results") + b"\x91" + result
        elif args.mode == "deep" and scoring:
            payload = msgpack.packb({"type": "score_reply", "request_id": message["request_id"]})
            payload = b"\x83" + payload[1:] + msgpack.packb("results") + b"\x91" * 100_000 + b"\xc0"
        elif args.mode == "many_frames" and scoring:
            reply = msgpack.packb(reply_for("garbage", message), use_bin_type=True)
            socket.send_multipart([*frames[:-1], *([reply] * 1000)])
            continue
        else:
            try:
                payload = msgpack.packb(reply_for(args.mode, message), use_bin_type=True)
            except Exception:
                continue  # a request it cannot answer (e.g. one without its fields): no reply
        socket.send_multipart([*frames[:-1], payload])


if __name__ == "__main__":
    main()
