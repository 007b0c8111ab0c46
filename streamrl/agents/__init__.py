"""Agentic multi-turn RL: the pieces an OpenAI-compatible endpoint on the live policy stands on.

- :mod:`streamrl.agents.tool_calls`: tool calls in a model's text, one parser per model family's
  format, registered by name (or ``module:function``); a malformed call is reported, never raised.
- :mod:`streamrl.agents.trajectory`: a session's tokens kept exactly as the policy saw and sampled
  them, extended turn by turn, forked when a request's conversation does not extend them.
"""
