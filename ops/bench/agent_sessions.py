"""The agent endpoint's cost: 64 concurrent agent sessions against the same tokens generated directly.

Both sides run the agent stage's model (configs/agent_calc.yaml's tiny Qwen2 on the character
tokenizer and chat template) on the built-in engine, in this one process, for ``--turns`` turns of
at most ``--max-tokens`` sampled tokens per session:

- **endpoint**: what the agent stage does. ``--sessions`` agents written with the ``openai`` SDK
  (one ``AsyncOpenAI`` client, a session each) talk to an :class:`~streamrl.agents.endpoint.AgentEndpoint`
  over loopback HTTP; the :class:`~streamrl.agents.backend.BatchingBackend` batches their requests
  into engine calls; every turn is rendered through the chat template and checked against the
  session's tokens.
- **raw JSON**: the same requests posted with ``aiohttp`` instead of the SDK: the server's cost
  without the client library's (the SDK runs in the agent stage's process too).
- **direct** (the baseline): a generate stage's own loop over the same engine, with no HTTP, no
  JSON, no template: all sessions' token ids in one ``generate`` call per turn, each extended by
  the sampled ids and the next turn's template tokens.

Figures: sampled tokens per second (median [min, max] over ``--reps`` alternating repetitions
after one warm-up each) and per-turn latency (p50 / p99 over every turn of every session: for
the direct loop, the engine call each turn is). The ratio endpoint / direct is the endpoint's cost.

    python ops/bench/agent_sessions.py --sessions 64 --turns 4 --max-tokens 8 --reps 3
    python ops/bench/agent_sessions.py --hidden 512 --layers 8 --max-tokens 32      # a 25M model
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import yaml

from streamrl.agents.backend import BatchingBackend, OwnWeights
from streamrl.agents.endpoint import AgentEndpoint, EndpointConfig
from streamrl.engines.rollout import TorchRolloutEngine
from streamrl.models.build import build_model
from streamrl.models.spec import TinyModelSpec
from streamrl.models.tokenizer import build_char_tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import fmt_spread, percentile, print_json_line, print_table, spread

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "agent_calc.yaml"
MODEL = "streamrl-policy"


def load_policy(hidden: int | None = None, layers: int | None = None) -> tuple[Any, Any]:
    cfg = yaml.safe_load(CONFIG.read_text())
    tokenizer = build_char_tokenizer(cfg["model"]["extra_chars"])
    tokenizer.chat_template = cfg["stages"]["agent"]["options"]["chat_template"]
    spec = dict(cfg["model"]["tiny"], max_positions=256)
    if hidden:
        spec.update(hidden=hidden, intermediate=2 * hidden, heads=max(4, hidden // 64))
    if layers:
        spec.update(layers=layers)
    model = build_model(TinyModelSpec(**spec), tokenizer).eval()
    return model, tokenizer


async def endpoint_round(engine: TorchRolloutEngine, tokenizer: Any, sessions: int, turns: int, max_tokens: int,
                         seed: int, sdk: bool = True, chunk_tokens: int | None = None
                         ) -> tuple[int, float, list[float]]:
    """(sampled tokens, seconds, per-turn latencies) of ``sessions`` agents at once: openai-SDK
    agents, or (``sdk`` False) the same requests posted as raw JSON with aiohttp (the server's cost
    without the client library's)."""
    import aiohttp
    import openai

    backend = BatchingBackend(OwnWeights(engine), tokenizer.eos_token_id, seed=seed, chunk_tokens=chunk_tokens)
    async with AgentEndpoint(backend, tokenizer, EndpointConfig(model=MODEL, max_tokens=max_tokens,
                                                                max_positions=None)) as ep:
        client = openai.AsyncOpenAI(base_url=ep.url, api_key=ep.config.api_key, max_retries=0, timeout=120)
        http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=sessions))
        latencies: list[float] = []
        tokens = 0

        async def ask(i: int, messages: list[dict[str, Any]]) -> tuple[list[int], str]:
            if sdk:
                c = client.with_options(api_key=f"{ep.config.api_key}:{i}")
                reply = await c.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens)
                return reply.choices[0].model_extra["streamrl"]["token_ids"], reply.choices[0].message.content or ""
            async with http.post(f"{ep.url}/chat/completions", json={
                    "model": MODEL, "messages": messages, "max_tokens": max_tokens},
                    headers={"Authorization": f"Bearer {ep.config.api_key}:{i}"}) as resp:
                choice = (await resp.json())["choices"][0]
            return choice["streamrl"]["token_ids"], choice["message"]["content"] or ""

        async def agent(i: int) -> None:
            nonlocal tokens
            messages: list[dict[str, Any]] = [{"role": "user", "content": "1+2+3="}]
            for _ in range(turns):
                t0 = time.perf_counter()
                ids, content = await ask(i, messages)
                latencies.append(time.perf_counter() - t0)
                tokens += len(ids)
                messages += [{"role": "assistant", "content": content}, {"role": "user", "content": "?"}]

        started = time.perf_counter()
        await asyncio.gather(*(agent(i) for i in range(sessions)))
        seconds = time.perf_counter() - started
        await client.close()
        await http.close()
        assert ep.stats.forks == 0, "a benchmark session forked"
    return tokens, seconds, latencies


def direct_round(engine: TorchRolloutEngine, tokenizer: Any, sessions: int, turns: int, max_tokens: int,
                 seed: int) -> tuple[int, float, list[float]]:
    """The same turns as one generate call per turn over every session's token ids."""
    generator = torch.Generator().manual_seed(seed)
    render = tokenizer.apply_chat_template
    first = tokenizer.encode(render([{"role": "user", "content": "1+2+3="}], add_generation_prompt=True,
                                    tokenize=False), add_special_tokens=False)
    between = tokenizer.encode("|u:?|a:", add_special_tokens=False)  # the template after a reply (its EOS sampled)
    prompts = [list(first) for _ in range(sessions)]
    latencies: list[float] = []
    tokens = 0
    started = time.perf_counter()
    for _ in range(turns):
        t0 = time.perf_counter()
        gens = engine.generate([torch.tensor(p) for p in prompts], max_new_tokens=max_tokens, temperature=1.0,
                               top_p=1.0, top_k=0, generator=generator)
        latencies += [time.perf_counter() - t0] * sessions  # every session waited for the whole call
        for p, g in zip(prompts, gens, strict=True):
            ids = g.response_ids.tolist()
            tokens += len(ids)
            p += ids + (between if ids and ids[-1] == tokenizer.eos_token_id else [tokenizer.eos_token_id, *between])
    return tokens, time.perf_counter() - started, latencies


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sessions", type=int, default=64)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2, help="torch threads (the agent stage's worker has 2)")
    ap.add_argument("--hidden", type=int, default=None, help="a larger model than the config's (hidden size)")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--chunk-tokens", type=int, default=None,
                    help="the backend's continuous batching (the agent stage's options.chunk_tokens); default: off")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = load_policy(args.hidden, args.layers)
    params = sum(p.numel() for p in model.parameters())
    engine = TorchRolloutEngine(model, tokenizer.eos_token_id, tokenizer.pad_token_id, "cpu")
    figures: dict[str, list[float]] = {"endpoint_tok_s": [], "raw_tok_s": [], "direct_tok_s": []}
    lat: dict[str, list[float]] = {"endpoint": [], "raw": [], "direct": []}
    load = [os.getloadavg()[0]]
    shape = (args.sessions, args.turns, args.max_tokens)
    asyncio.run(endpoint_round(engine, tokenizer, *shape, seed=99, chunk_tokens=args.chunk_tokens))  # warm-up: imports, first HTTP connections
    direct_round(engine, tokenizer, *shape, seed=99)
    for rep in range(args.reps):
        tok, sec, l_ep = asyncio.run(endpoint_round(engine, tokenizer, *shape, seed=rep, chunk_tokens=args.chunk_tokens))
        figures["endpoint_tok_s"].append(tok / sec)
        lat["endpoint"] += l_ep
        tok, sec, l_raw = asyncio.run(endpoint_round(engine, tokenizer, *shape, seed=rep, sdk=False,
                                                         chunk_tokens=args.chunk_tokens))
        figures["raw_tok_s"].append(tok / sec)
        lat["raw"] += l_raw
        tok, sec, l_d = direct_round(engine, tokenizer, *shape, seed=rep)
        figures["direct_tok_s"].append(tok / sec)
        lat["direct"] += l_d
        load.append(os.getloadavg()[0])
    ep, raw, d = spread(figures["endpoint_tok_s"]), spread(figures["raw_tok_s"]), spread(figures["direct_tok_s"])
    p = {k: (percentile(sorted(v), 0.5), percentile(sorted(v), 0.99)) for k, v in lat.items()}
    print(f"{params / 1e6:.1f}M parameters, {args.sessions} sessions x {args.turns} turns x <= {args.max_tokens} tokens, "
          f"{args.reps} reps, "
          f"load {min(load):.2f}-{max(load):.2f}")
    print_table(["path", "sampled tokens/s", "turn p50 ms", "turn p99 ms"], [
        ["endpoint (openai SDK, HTTP)", fmt_spread(ep), f"{p['endpoint'][0] * 1e3:.1f}", f"{p['endpoint'][1] * 1e3:.1f}"],
        ["endpoint (raw JSON, aiohttp)", fmt_spread(raw), f"{p['raw'][0] * 1e3:.1f}", f"{p['raw'][1] * 1e3:.1f}"],
        ["direct (generate per turn)", fmt_spread(d), f"{p['direct'][0] * 1e3:.1f}", f"{p['direct'][1] * 1e3:.1f}"],
    ])
    print_json_line(
        "agent_sessions",
        {"tok_s": ep, "turn_p50_ms": p["endpoint"][0] * 1e3, "turn_p99_ms": p["endpoint"][1] * 1e3},
        {"tok_s": d, "turn_p50_ms": p["direct"][0] * 1e3, "turn_p99_ms": p["direct"][1] * 1e3},
        {"tok_s": ep["median"] / d["median"] if d["median"] else float("nan"),
         "raw_tok_s": raw["median"] / d["median"] if d["median"] else float("nan")},
        {"tok_s": ">= 0.8 (the endpoint costs at most 20 % of generation throughput)"},
        raw_http={"tok_s": raw, "turn_p50_ms": p["raw"][0] * 1e3, "turn_p99_ms": p["raw"][1] * 1e3},
        shape={"params_m": round(params / 1e6, 1), "chunk_tokens": args.chunk_tokens, "sessions": args.sessions, "turns": args.turns, "max_tokens": args.max_tokens},
        load=[min(load), max(load)],
    )


if __name__ == "__main__":
    main()
