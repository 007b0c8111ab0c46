"""streamrl: RL training of language models as a streaming dataflow over a ZeroMQ transfer dock."""

__version__ = "0.1.0"
