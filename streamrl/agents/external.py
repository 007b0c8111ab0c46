"""The second way to write an agent: any process pointed at the endpoint.

``options.rollout: streamrl.agents.external:run_process`` with ``rollout_args: {command: [...]}``
starts ``command`` once per sample, with the session's address in its environment, the names any
OpenAI SDK reads by itself:

- ``OPENAI_BASE_URL``: the endpoint (``http://127.0.0.1:PORT/v1``);
- ``OPENAI_API_KEY``: the run's key and the session, ``<key>:<session>``;
- ``STREAMRL_SESSION``: the session id; ``STREAMRL_SAMPLE``: the sample, a JSON object (the
  columns the stage reads, and ``model``);
- ``STREAMRL_REWARD_URL``: where it ends the session, ``POST {"reward": float}`` with the same
  ``Authorization: Bearer`` key (docs/agents.md).

The process may be in any language. The sample's reward is the one it posts; a process that exits
without posting one, exits non-zero, or outlives ``timeout_s`` fails the stage (its output's last
lines in the message). The process's working directory is the stage worker's.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

import anyio

OUTPUT_TAIL = 2000  # characters of the process's output quoted when it fails


class ExternalAgentError(RuntimeError):
    """An external agent process failed (exit status, timeout, no reward posted)."""


async def run_process(client: Any, sample: dict[str, Any], command: Sequence[str], timeout_s: float = 300.0,
                      env: dict[str, str] | None = None) -> None:
    """Run ``command`` for ``sample``'s session; returns None: the reward is the one it posted."""
    if not command or not all(isinstance(c, str) for c in command):
        raise ExternalAgentError(f"rollout_args.command must be a non-empty list of strings, got {command!r}")
    key = str(client.api_key)
    session = key.partition(":")[2]
    base = str(client.base_url).rstrip("/")
    environment = {**os.environ, **(env or {}),
                   "OPENAI_BASE_URL": base, "OPENAI_API_KEY": key, "STREAMRL_SESSION": session,
                   "STREAMRL_SAMPLE": json.dumps(sample, default=str),
                   "STREAMRL_REWARD_URL": f"{base.removesuffix('/v1')}/rl/sessions/{session}/reward"}
    try:
        with anyio.fail_after(timeout_s):
            done = await anyio.run_process(list(command), env=environment, check=False)
    except TimeoutError:
        raise ExternalAgentError(f"{command[0]!r} ran over rollout_args.timeout_s={timeout_s:g} s") from None
    if done.returncode != 0:
        tail = (done.stdout + done.stderr).decode(errors="replace")[-OUTPUT_TAIL:]
        raise ExternalAgentError(f"{command[0]!r} exited with status {done.returncode}; its output ends:\n{tail}")
    return None
