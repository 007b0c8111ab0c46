"""An agent in a process of its own, as the agent stage's external mode runs it: the plain openai
SDK configured by the environment alone (OPENAI_BASE_URL, OPENAI_API_KEY), two turns, then the
reward posted to STREAMRL_REWARD_URL: 0.25 plus 0.5 if the second reply is the answer."""

from __future__ import annotations

import json
import os
import urllib.request

import openai

sample = json.loads(os.environ["STREAMRL_SAMPLE"])
client = openai.OpenAI(max_retries=0, timeout=60)  # base URL and key from the environment
messages = [{"role": "user", "content": sample["prompt"]}]
for _ in range(2):
    reply = client.chat.completions.create(model=sample["model"], messages=messages, max_tokens=2)
    messages += [{"role": "assistant", "content": reply.choices[0].message.content or ""},
                 {"role": "user", "content": "?"}]
reward = 0.25 + 0.5 * (messages[-2]["content"] == sample["answer"])
request = urllib.request.Request(os.environ["STREAMRL_REWARD_URL"], data=json.dumps({"reward": reward}).encode(),
                                 headers={"Authorization": f"Bearer {os.environ['OPENAI_API_KEY']}",
                                          "Content-Type": "application/json"})
with urllib.request.urlopen(request, timeout=60) as answer:
    assert json.load(answer)["trajectories"] == 1
