"""Tools in OpenAI chat requests (SPEC §7): the request's ``tools`` and ``tool_choice``, the
messages a chat template renders them with, and the parsers that turn a model's output back
into OpenAI ``tool_calls``.

``[inference] tool_parser`` picks the parser: ``""`` (off: tools reach the template, the
output stays text), a parser name, or ``"auto"`` (the model's own format, read from its
chat template and ``config.json``). Where vLLM is installed every name of vLLM's tool-parser
registry is available, ``hermes`` included, and vLLM's parser does the work; without vLLM
``hermes`` is this module's own :class:`HermesParser` (the same output for the same text).

Nothing here imports torch; vLLM is imported only when a vLLM parser is made. The names vLLM
registers are read from its source without importing it (:func:`vllm_parser_names`), so the
config check stays light.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from atroposd.inference.schema import BadRequest

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from atroposd.toolparsers import (
    AUTO,
    BUILTIN_PARSERS,
    available_parser_names,
    have_vllm,
    parser_problem,
    vllm_parser_names,
)

__all__ = [
    "AUTO",
    "BUILTIN_PARSERS",
    "HermesParser",
    "ParsedOutput",
    "ToolCall",
    "ToolParser",
    "ToolParserUnavailable",
    "ToolRequest",
    "VllmParser",
    "apply_tool_calls",
    "available_parser_names",
    "detect_parser",
    "make_parser",
    "parse_tool_request",
    "parser_problem",
    "template_messages",
    "vllm_parser_names",
    "with_token_ids",
]


# The tool-call syntax a chat template shows, and the parser that reads it (first match wins).
_TEMPLATE_MARKERS = (("<tool_call>", "hermes"), ("<|python_tag|>", "llama3_json"), ("[TOOL_CALLS]", "mistral"))
# config.json model_type → parser, for templates that do not show their syntax.
_MODEL_TYPES = {
    "qwen2": "hermes",
    "qwen2_moe": "hermes",
    "qwen3": "hermes",
    "qwen3_moe": "hermes",
    "mistral": "mistral",
    "mixtral": "mistral",
}


class ToolParserUnavailable(ValueError):
    """``[inference] tool_parser`` names a parser that cannot be had here; the message says why."""


@dataclass(frozen=True)
class ToolCall:
    """One call in OpenAI's shape: ``arguments`` is a JSON string."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ParsedOutput:
    """A completion's text split into the content and the tool calls it holds."""

    content: str | None
    calls: list[ToolCall]


class ToolParser(Protocol):
    name: str

    def check(self, request: ToolRequest) -> object:
        """Validate a request's tools, once per request, before anything is generated
        (a :class:`BadRequest` naming the problem)."""

    def parse(self, text: str, request: ToolRequest) -> ParsedOutput: ...


@dataclass(frozen=True)
class ToolRequest:
    """A chat request's validated ``tools`` and ``tool_choice``."""

    tools: list[dict[str, Any]]
    choice: str | dict[str, Any]  # "none" | "auto" | "required" | {"type": "function", "function": {"name"}}

    @property
    def parse_calls(self) -> bool:
        return bool(self.tools) and self.choice != "none"


# ---------------------------------------------------------------------------- requests


def parse_tool_request(body: Mapping[str, Any]) -> ToolRequest | None:
    """The ``tools`` and ``tool_choice`` of a chat body, checked; None when it has no tools.

    Each tool is ``{"type": "function", "function": {"name", "description"?, "parameters"?}}``
    with a unique name; ``tool_choice`` is ``none``, ``auto``, ``required`` or a named
    function among the tools. A bad one raises :class:`BadRequest` naming the field."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is None:
        if choice not in (None, "none"):
            raise BadRequest("tool_choice needs tools: the request has no tools")
        return None
    if not isinstance(tools, list):
        raise BadRequest(
            f'tools must be a list of {{"type": "function", "function": {{...}}}} objects, got {_kind(tools)}'
        )
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, Mapping):
            raise BadRequest(f"{where} must be an object, got {_kind(tool)}")
        if tool.get("type", "function") != "function":
            raise BadRequest(f'{where}.type must be "function", got {tool.get("type")!r}')
        fn = tool.get("function")
        if not isinstance(fn, Mapping):
            raise BadRequest(f"{where}.function must be an object with a name, got {_kind(fn)}")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise BadRequest(f"{where}.function.name must be a non-empty string, got {name!r}")
        if name in seen:
            raise BadRequest(f"{where}.function.name {name!r} is given twice")
        seen.add(name)
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise BadRequest(f"{where}.function.description must be a string")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], Mapping):
            raise BadRequest(f"{where}.function.parameters must be a JSON Schema object, got {_kind(fn['parameters'])}")
        if fn.get("strict") is not None and not isinstance(fn["strict"], bool):
            raise BadRequest(f"{where}.function.strict must be true, false or null, got {_kind(fn['strict'])}")
    if choice is None:
        choice = "auto" if tools else "none"
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise BadRequest(
                f'tool_choice must be "none", "auto", "required" or '
                f'{{"type": "function", "function": {{"name": ...}}}}, got {choice!r}'
            )
        if choice == "required" and not tools:
            raise BadRequest('tool_choice = "required" needs at least one tool')
    elif isinstance(choice, Mapping):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, Mapping) else None
        if choice.get("type", "function") != "function" or not isinstance(name, str):
            raise BadRequest('tool_choice must name a function as {"type": "function", "function": {"name": ...}}')
        if name not in seen:
            raise BadRequest(f"tool_choice names the function {name!r}, which is not among tools")
        choice = {"type": "function", "function": {"name": name}}
    else:
        raise BadRequest(f"tool_choice must be a string or an object, got {_kind(choice)}")
    if body.get("parallel_tool_calls") is not None and not isinstance(body["parallel_tool_calls"], bool):
        raise BadRequest("parallel_tool_calls must be true or false")
    return ToolRequest(tools=[dict(t) for t in tools], choice=choice)


def template_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The messages as chat templates expect them: a list of text parts joined into one string,
    and each assistant tool call's ``arguments`` JSON string read into an object (what
    Hugging Face templates render; vLLM does the same). A malformed message raises
    :class:`BadRequest` naming it."""
    out: list[dict[str, Any]] = []
    for i, msg in enumerate(messages):
        m = dict(msg)
        content = m.get("content")
        if isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                if not (isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                    raise BadRequest(f'messages[{i}].content[{j}] must be a {{"type": "text", "text": ...}} part')
                parts.append(part["text"])
            m["content"] = "".join(parts)
        elif content is not None and not isinstance(content, str):
            raise BadRequest(f"messages[{i}].content must be a string, a list of text parts or null")
        calls = m.get("tool_calls")
        if calls is not None:
            if not isinstance(calls, list):
                raise BadRequest(f"messages[{i}].tool_calls must be a list")
            fixed = []
            for j, call in enumerate(calls):
                fn = call.get("function") if isinstance(call, Mapping) else None
                if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
                    raise BadRequest(
                        f'messages[{i}].tool_calls[{j}] must be {{"type": "function", '
                        '"function": {"name", "arguments"}}'
                    )
                args = fn.get("arguments", {})
                if isinstance(args, str):
                    try:
                        args = json.loads(args) if args.strip() else {}
                    except json.JSONDecodeError:
                        raise BadRequest(
                            f"messages[{i}].tool_calls[{j}].function.arguments is not valid JSON"
                        ) from None
                fixed.append({**call, "function": {**fn, "arguments": args}})
            m["tool_calls"] = fixed
        out.append(m)
    return out


def _kind(v: object) -> str:
    return {
        list: "a list",
        dict: "an object",
        str: "a string",
        bool: "a boolean",
        int: "a number",
        float: "a number",
        type(None): "null",
    }.get(type(v), type(v).__name__)


# ---------------------------------------------------------------------------- parsers


class HermesParser:
    """Hermes-format tool calls: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
    any number of them, after optional content (the format of Hermes, Qwen 2.5 and Qwen 3).
    Text that does not parse is content, not an error (as vLLM's Hermes parser answers)."""

    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"
    _CALL = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)

    def check(self, request: ToolRequest) -> None:
        """Nothing beyond :func:`parse_tool_request`'s checks."""

    def parse(self, text: str, request: ToolRequest) -> ParsedOutput:
        if self.START not in text:
            return ParsedOutput(content=text, calls=[])
        calls = []
        for closed, open_ in self._CALL.findall(text):
            try:
                obj = json.loads(closed or open_)
            except json.JSONDecodeError:
                return ParsedOutput(content=text, calls=[])
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or "arguments" not in obj:
                return ParsedOutput(content=text, calls=[])
            calls.append(ToolCall(name=obj["name"], arguments=json.dumps(obj["arguments"], ensure_ascii=False)))
        content = text[: text.find(self.START)]
        return ParsedOutput(content=content or None, calls=calls)


class VllmParser:
    """A parser of vLLM's registry (``vllm.tool_parsers.ToolParserManager``), given the
    model's tokenizer, called as vLLM's chat route calls it."""

    def __init__(self, name: str, tokenizer: PreTrainedTokenizerBase) -> None:
        from vllm.tool_parsers import ToolParserManager

        self.name = name
        self._cls = ToolParserManager.get_tool_parser(name)
        self._tokenizer = tokenizer
        self._last: tuple[ToolRequest, Any] | None = None  # the request checked last, and its model
        self._cls(tokenizer)  # its constructor checks the tokenizer (some need their tokens in it)

    def check(self, request: ToolRequest) -> ChatCompletionRequest:
        """vLLM's request model of ``request``'s tools, built (and so validated) once per
        request — before anything is generated — however many choices are parsed with it."""
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        last = self._last
        if last is not None and last[0] is request:
            return last[1]
        try:
            req = ChatCompletionRequest(
                messages=[{"role": "user", "content": ""}],
                model="atroposd",
                tools=request.tools,
                tool_choice=request.choice,
            )
        except Exception as exc:  # pydantic's ValidationError, vLLM's own VLLMValidationError (not a ValueError)
            raise BadRequest(f"tools: {exc}") from None
        self._last = (request, req)
        return req

    def parse(self, text: str, request: ToolRequest) -> ParsedOutput:
        req = self.check(request)
        # A parser keeps state between calls (streaming): one instance per completion.
        info = self._cls(self._tokenizer).extract_tool_calls(text, req)
        if not info.tools_called:
            return ParsedOutput(content=text, calls=[])
        calls = [ToolCall(name=c.function.name, arguments=c.function.arguments, id=c.id) for c in info.tool_calls]
        return ParsedOutput(content=info.content or None, calls=calls)


def detect_parser(model_dir: Path | None, chat_template: str | None) -> str | None:
    """``tool_parser = "auto"``: the parser of the model's tool-call format, from the markers
    its chat template renders, else its ``config.json`` ``model_type``; None when neither
    shows one."""
    template = chat_template or ""
    for marker, name in _TEMPLATE_MARKERS:
        if marker in template:
            return name
    if model_dir is not None:
        try:
            model_type = json.loads((Path(model_dir) / "config.json").read_text()).get("model_type")
        except (OSError, ValueError):
            model_type = None
        if isinstance(model_type, str) and model_type in _MODEL_TYPES:
            return _MODEL_TYPES[model_type]
    return None


def make_parser(setting: str, tokenizer: PreTrainedTokenizerBase, model_dir: Path | None) -> ToolParser | None:
    """The parser ``[inference] tool_parser = setting`` asks for (None: off, or ``auto`` found
    no format); vLLM's where vLLM is installed. Raises :class:`ToolParserUnavailable`."""
    if setting == "":
        return None
    name = setting
    if setting == AUTO:
        template = getattr(tokenizer, "chat_template", None)
        detected = detect_parser(model_dir, template if isinstance(template, str) else None)
        if detected is None:
            return None
        if detected not in BUILTIN_PARSERS and not have_vllm():
            return None  # a format only vLLM reads, and no vLLM: tools still reach the template
        name = detected
    problem = parser_problem(name)
    if problem:
        raise ToolParserUnavailable(f"inference.tool_parser: {problem}")
    if have_vllm():
        try:
            return VllmParser(name, tokenizer)
        except KeyError:
            raise ToolParserUnavailable(f"inference.tool_parser: vLLM has no tool parser named {name!r}") from None
        except ImportError as exc:
            if name not in BUILTIN_PARSERS:
                raise ToolParserUnavailable(
                    f"inference.tool_parser: vLLM's parser {name!r} cannot be imported: {exc}"
                ) from None
        except (ValueError, RuntimeError) as exc:  # the parser refuses this tokenizer
            raise ToolParserUnavailable(
                f"inference.tool_parser: vLLM's parser {name!r} cannot read this model's output: {exc}"
            ) from None
    return HermesParser()


# ---------------------------------------------------------------------------- responses


def apply_tool_calls(
    response: dict[str, Any],
    gen: Mapping[str, Any],
    parser: ToolParser,
    request: ToolRequest,
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    """Turn each chat choice whose text holds tool calls into OpenAI's shape, in place: the
    message's ``content`` (the text before the calls, or null) and ``tool_calls``, and
    ``finish_reason = "tool_calls"``. The choice's logprobs and token ids stay those of every
    sampled token."""
    for i, choice in enumerate(response["choices"]):
        text = _without_stop_token(gen["text"][i], gen["token_ids"][i], gen["finish_reasons"][i], tokenizer)
        parsed = parser.parse(text, request)
        message = choice["message"]
        if not parsed.calls:
            message["content"] = text
            continue
        message["content"] = parsed.content
        message["tool_calls"] = [c.to_openai() for c in parsed.calls]
        choice["finish_reason"] = "tool_calls"


def _without_stop_token(text: str, token_ids: Sequence[int], reason: str, tokenizer: PreTrainedTokenizerBase) -> str:
    """The text without the EOS token's own text: decoded with special tokens kept (for the
    parser), a sampled EOS would otherwise end the content (vLLM's text never holds it)."""
    eos = getattr(tokenizer, "eos_token_id", None)
    if reason != "stop" or not token_ids or eos is None or token_ids[-1] != eos:
        return text
    tail = str(tokenizer.decode([eos], skip_special_tokens=False))
    return text[: -len(tail)] if tail and text.endswith(tail) else text


def with_token_ids(response: dict[str, Any], gen: Mapping[str, Any], body: Mapping[str, Any]) -> dict[str, Any]:
    """The exact tokens, so an agent loop never re-tokenizes text (SPEC §7): with ``logprobs``
    (or ``return_token_ids``, vLLM's name for it) each choice carries ``token_ids``, every
    sampled token in order (a sampled EOS included, as in ``/generate``), and the prompt's
    ids come as ``prompt_token_ids`` — on the response for a chat completion, on each choice
    for a completion, where vLLM puts them. Fields OpenAI clients ignore."""
    want = body.get("return_token_ids")
    if want is not None and not isinstance(want, bool):
        raise BadRequest(f"return_token_ids must be true or false, got {want!r}")
    asked = body.get("logprobs")
    if not want and (asked is None or asked is False):
        return response
    prompt = list(gen.get("prompt_token_ids") or [])
    chat = response.get("object") == "chat.completion"
    if chat:
        response["prompt_token_ids"] = prompt
    for choice, ids in zip(response["choices"], gen["token_ids"], strict=True):
        choice["token_ids"] = list(ids)
        if not chat:
            choice["prompt_token_ids"] = prompt
    return response
