"""What a user brings on day one, built in the test (no downloads): a Qwen2-architecture checkpoint
with a byte-level BPE tokenizer trained from a tiny corpus and a ChatML chat template (Qwen's
format), saved with ``save_pretrained``; and GSM8K-format Parquet files (``question``, and an
``answer`` of reasoning that ends in ``#### <number>``, as openai/gsm8k ships them)."""

from __future__ import annotations

import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

# Qwen2.5's chat format (ChatML), shortened: a system turn when given, then the turns, then the
# assistant header when a generation prompt is asked for.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def gsm8k_rows(n: int, seed: int) -> list[dict[str, str]]:
    """GSM8K-shaped word problems with small answers (a random tiny model hits some by chance)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randrange(1, 5), rng.randrange(0, 5)
        rows.append({
            "question": f"Tom has {a} apples and buys {b} more. How many apples does Tom have?",
            "answer": f"Tom has {a} + {b} = <<{a}+{b}={a + b}>>{a + b} apples.\n#### {a + b}",
        })
    return rows


def write_gsm8k_parquet(path: Path, rows: list[dict[str, str]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def train_tokenizer(corpus: list[str]) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer (GPT-2/Qwen style) trained on ``corpus``, with Qwen's specials."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=["<|im_start|>"])
    fast.chat_template = CHAT_TEMPLATE
    return fast


def save_qwen2_checkpoint(path: Path, *, hidden: int = 64, layers: int = 2, seed: int = 0) -> Path:
    """A random-init Qwen2 model (a few hundred thousand parameters) and its tokenizer at ``path``."""
    corpus = [r["question"] + " " + r["answer"] for r in gsm8k_rows(200, seed=99)]
    corpus += ["The answer is \\boxed{7}.", "Please reason step by step.", "0 1 2 3 4 5 6 7 8 9 + - = ."]
    tokenizer = train_tokenizer(corpus)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=2048, tie_word_embeddings=True,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                         bos_token_id=None)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(pad_token_id=tokenizer.pad_token_id,
                                               eos_token_id=tokenizer.eos_token_id)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
