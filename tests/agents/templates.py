"""Chat templates of three model families, on a byte-level BPE tokenizer built in the test (no
downloads): Qwen2.5 (ChatML, Hermes tool calls), Llama 3 (header tokens, JSON tool calls, tool
results as ``ipython``) and Qwen3 (ChatML that drops an assistant turn's ``<think>`` block once a
later user turn exists: a template that rewrites history). Shortened from the originals; what a
session depends on (turn markers, how a tool call and a tool result are written, the rewrite) is
as they have it."""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

QWEN25 = (
    "{%- if tools %}{{- '<|im_start|>system\\nYou may call tools:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + tool | tojson }}{%- endfor %}{{- '\\n</tools><|im_end|>\\n' }}{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}{{- '<|im_start|>assistant\\n' + (m.content or '') }}"
    "{%- for tc in m.tool_calls or [] %}{%- set f = tc.function if tc.function is defined else tc %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + f.name + '\", \"arguments\": ' }}"
    "{{- f.arguments if f.arguments is string else f.arguments | tojson }}{{- '}\\n</tool_call>' }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif m.role == 'tool' %}{{- '<|im_start|>user\\n<tool_response>\\n' + m.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

LLAMA3 = (
    "{{- '<|begin_of_text|>' }}"
    "{%- if tools %}{{- '<|start_header_id|>system<|end_header_id|>\\n\\nTools:' }}"
    "{%- for tool in tools %}{{- ' ' + tool | tojson }}{%- endfor %}{{- '<|eot_id|>' }}{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- for tc in m.tool_calls %}{%- set f = tc.function if tc.function is defined else tc %}"
    "{{- '{\"name\": \"' + f.name + '\", \"parameters\": ' }}"
    "{{- f.arguments if f.arguments is string else f.arguments | tojson }}{{- '}' }}"
    "{%- endfor %}{{- '<|eot_id|>' }}"
    "{%- elif m.role == 'tool' %}{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + m.content + '<|eot_id|>' }}"
    "{%- else %}{{- '<|start_header_id|>' + m.role + '<|end_header_id|>\\n\\n' + (m.content or '') + '<|eot_id|>' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)

QWEN3 = (
    "{%- set ns = namespace(last_user=-1) %}"
    "{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}{%- set c = m.content or '' %}"
    "{%- if loop.index0 < ns.last_user and '</think>' in c %}{%- set c = c.split('</think>')[-1].lstrip('\\n') %}"
    "{%- endif %}{{- '<|im_start|>assistant\\n' + c + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>",
           "<|end_header_id|>", "<|eot_id|>", "<|python_tag|>"]
CORPUS = [
    "What is 12 + 30? Let me add. The answer is 42.",
    '<tool_call>\n{"name": "add", "arguments": {"a": 12, "b": 30}}\n</tool_call>',
    '{"name": "add", "parameters": {"a": 12, "b": 30}}',
    "<tool_response>\n42\n</tool_response> <think>\nhmm, add them\n</think>\n\nYou may call tools: Tools:",
    '{"type": "function", "function": {"name": "add", "description": "Add two numbers"}}',
]


def tokenizer(template: str, eos: str) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer (merges across characters, as real ones do) with ``template``."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 20, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, pad_token="<|endoftext|>",
                                   additional_special_tokens=[s for s in SPECIAL if s not in (eos, "<|endoftext|>")])
    fast.chat_template = template
    return fast
