"""Builds a tiny Qwen2-architecture model and tokenizer in a local directory.

No model hub is reachable from Gyre's test and demo machines, so tests and the demo build
their model here: a byte-level BPE tokenizer trained with ``tokenizers`` on a short built-in
text, with Qwen2's pre-tokenization (wrapped in ``PreTrainedTokenizerFast`` with a ChatML
chat template that renders tools and tool calls the way Qwen2.5 does), and a randomly
initialised Qwen2 causal LM (hidden 128, 2 layers, 4 heads / 2 KV heads, bf16, ~0.46M
parameters, an embedding row per token) from a seed. Its weights start wider than
transformers' default (``initializer_range`` 0.1, not 0.02): the warm start
(:mod:`apps.model.warmstart`) then learns to copy what a tool returned within a hundred
steps instead of many hundreds. The directory loads with ``AutoTokenizer`` /
``AutoModelForCausalLM`` and with vLLM, exactly like a downloaded checkpoint. The build is
deterministic for a seed.

    python -m apps.model.tiny OUT_DIR [--seed 0]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

# ChatML with tools, in the layout Qwen2.5 (and vLLM's Hermes tool parser) use: the tools
# are listed in the system turn, an assistant's tool calls are
# <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>, and tool results come back
# in a user turn as <tool_response>...</tool_response>. Without tools it is plain ChatML.
CHATML_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\n\n' }}{%- endif %}"
    "{{- '# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>' }}"
    "{%- for tool in tools %}{{- '\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n\' }}'
    "{%- elif messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' and loop.first %}"
    "{%- elif message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\n' }}{%- if message['content'] %}{{- message['content'] }}{%- endif %}"
    "{%- for tool_call in message['tool_calls'] or [] %}"
    "{%- if not loop.first or message['content'] %}{{- '\n' }}{%- endif %}"
    "{%- set f = tool_call['function'] if tool_call['function'] is defined else tool_call %}"
    "{{- '<tool_call>\n{\"name\": \"' + f['name'] + '\", "
    "\"arguments\": ' + (f['arguments'] | tojson) + '}\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\n<tool_response>\n' + message['content'] + '\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

QWEN2_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
"""transformers' ``models/qwen2/tokenization_qwen2.py`` ``PRETOKENIZE_REGEX``."""

# Text the tokenizer's merges are learned from: chat roles, the tool schemas and tool calls
# of the example task (apps/harness/env.py) and its file names, so agent transcripts
# tokenize compactly (a prompt with the tools is ~280 tokens, a tool call ~26). Numbers stay
# digit by digit, as Qwen2 splits them.
_FILES = ("notes.txt", "todo.txt", "data.txt", "log.txt", "config.txt", "answer.txt")
_KEYS = ("secret", "count", "value", "code", "port")


def _schema(name: str, description: str, arg: str | None) -> str:
    params: dict[str, Any] = {"type": "object", "properties": {}}
    if arg:
        params = {"type": "object", "properties": {arg: {"type": "string"}}, "required": [arg]}
    return json.dumps(
        {"type": "function", "function": {"name": name, "description": description, "parameters": params}}
    )


def _call(name: str, arguments: dict[str, str]) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(arguments)}}}\n</tool_call>\n'


_CORPUS = (
    """
system user assistant tool You are a helpful coding agent working in a repository.
You are an agent with tools. Use a tool. Find the secret number and write it.
Use the tools to read, write and list files, then answer. The task is done when the file
contains the answer. call read_file write_file list_files run_tests submit done ok error
The quick brown fox jumps over the lazy dog. 0 1 2 3 4 5 6 7 8 9 10 11 12 42 100 256 512
def main(): return 0  import os  print("hello world")  README.md  main.py  test_main.py
Observation: the command finished with exit code 0. Thought: I should check the file.
Action: read_file path=notes.txt Answer: the value is 7. reward step turn episode group
13 21 34 55 64 77 89 99 128 1000 2048 4096 365 24 60 7 3 9
# Tools You may call one or more functions to assist with the user query. You are provided with
function signatures within <tools></tools> XML tags:
For each function call, return a json object with function name and arguments within
<tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call>
<tool_response>
error: no file files: ok
</tool_response>
"""
    + "\n".join(
        [
            _schema("list_files", "List the files.", None),
            _schema("read_file", "Read a file.", "path"),
            _schema("write_file", "Write the answer.", "text"),
        ]
    )
    + "\n"
    + "".join(
        f"Files: {json.dumps([f, g])}\n"
        + _call("read_file", {"path": f})
        + f"{k}={n}\n"
        + _call("write_file", {"text": str(n)})
        for i, n in enumerate(range(10, 100, 3))
        for f, g, k in [(_FILES[i % 5], _FILES[(i + 1) % 5], _KEYS[i % 5])]
    )
    + _call("list_files", {})
) * 4

DEFAULT_CONFIG = {
    "vocab_size": 1024,
    "hidden_size": 128,
    "intermediate_size": 352,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 32768,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "initializer_range": 0.1,
}


def build_tokenizer(out_dir: Path, vocab_size: int = 1024):  # -> PreTrainedTokenizerFast
    """Trains the byte-level BPE tokenizer and saves it (tokenizer.json + config)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    # Qwen2's pre-tokenization (digits one by one, a letter run may take one leading
    # symbol): a model directory with config.json loads as ``Qwen2Tokenizer`` (transformers
    # picks it by model type, in the router and in vLLM alike), which rebuilds the tokenizer
    # from the vocabulary and merges with exactly this pre-tokenizer and normalizer. Merges
    # learned under another split would be partly unusable there.
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS.splitlines(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        additional_special_tokens=["<|im_start|>"],
    )
    fast.chat_template = CHATML_TEMPLATE
    fast.save_pretrained(str(out_dir))
    return fast


def build_tiny_model(out_dir: str | Path, seed: int = 0, **overrides: object) -> Path:
    """Writes tokenizer + model to ``out_dir`` (created); returns the path. Idempotent: an
    existing complete build with the same seed and config is kept (found before torch and
    transformers are imported: ~5 s of every demo's start)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg_values: dict[str, Any] = {**DEFAULT_CONFIG, **overrides}
    stamp = {"seed": seed, "config": cfg_values, "builder": 4}  # 4: Qwen2 pre-tokenizer, task corpus, init
    stamp_path = out / "gyre_tiny.json"
    if stamp_path.exists() and (out / "model.safetensors").exists():
        if json.loads(stamp_path.read_text()) == stamp:
            return out

    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    tokenizer = build_tokenizer(out, vocab_size=int(cfg_values["vocab_size"]))
    eos_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    pad_id = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    # The embedding has a row per token the tokenizer holds (its merges may stop short of
    # the requested vocab_size): a sampler never draws an id that decodes to nothing.
    config = Qwen2Config(  # type: ignore[call-arg]  # torch_dtype: the key vLLM reads in config.json
        **{**cfg_values, "vocab_size": len(tokenizer)},
        bos_token_id=pad_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        torch_dtype="bfloat16",
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).to(torch.bfloat16)  # type: ignore[arg-type]  # transformers types `to` oddly
    model.generation_config = GenerationConfig(eos_token_id=eos_id, pad_token_id=pad_id, do_sample=False)
    model.save_pretrained(str(out), safe_serialization=True)
    stamp_path.write_text(json.dumps(stamp))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    path = build_tiny_model(args.out_dir, seed=args.seed)
    print(path)


if __name__ == "__main__":
    main()
