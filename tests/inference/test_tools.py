"""OpenAI chat with ``tools`` (SPEC §7): the tools reach the chat template, the model's calls come
back as OpenAI ``tool_calls`` through ``[inference] tool_parser``; and the exact sampled tokens
across the turns of a conversation, as the trainer receives them from the API.

The server is the real ``atroposd inference`` on loopback, serving the small model that speaks
tools (tests/models/toolmodel.py), whose byte-level BPE tokenizer can re-tokenize a sampled
sequence differently."""

from __future__ import annotations

import asyncio
import json
import random
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from atroposd.config import parse_toml
from atroposd.inference import tools
from atroposd.inference.schema import BadRequest
from tests import fuzzseed
from tests.inference.conftest import Server, start_server
from tests.models.toolmodel import PROMPT, SYSTEM, TOOL_CALL, TOOL_RESULT, TOOLS, check_round_trip
from tests.support import atroposd, config_problems, stop_process, write_config

# ---------------------------------------------------------------------------- requests and parsers

WEATHER = TOOLS[0]


@pytest.mark.parametrize(
    ("body", "names"),
    [
        ({"tools": "get_weather"}, "tools must be a list"),
        ({"tools": [42]}, "tools[0] must be an object"),
        ({"tools": [{"type": "retrieval", "function": {"name": "x"}}]}, "tools[0].type"),
        ({"tools": [{"type": "function"}]}, "tools[0].function must be an object"),
        ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools[0].function.name"),
        ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name 'get_weather' is given twice"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": "{}"}}]},
            "tools[0].function.parameters",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "strict": "yes"}}]},
            "tools[0].function.strict must be true, false or null",
        ),
        ({"tools": [WEATHER], "tool_choice": "always"}, "tool_choice must be"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
            "'get_time', which is not among tools",
        ),
        ({"tools": [WEATHER], "tool_choice": 3}, "tool_choice must be a string or an object"),
        ({"tool_choice": "auto"}, "tool_choice needs tools"),
        ({"tools": [], "tool_choice": "required"}, "needs at least one tool"),
        ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ],
)
def test_a_malformed_tool_request_is_refused_naming_the_field(body: dict[str, Any], names: str) -> None:
    with pytest.raises(BadRequest, match=None) as err:
        tools.parse_tool_request(body)
    assert names in str(err.value)


def test_tool_request_defaults_and_named_choice() -> None:
    req = tools.parse_tool_request({"tools": [WEATHER]})
    assert req is not None and req.choice == "auto" and req.parse_calls
    none = tools.parse_tool_request({"tools": [WEATHER], "tool_choice": "none"})
    assert none is not None and not none.parse_calls
    named = tools.parse_tool_request(
        {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    )
    assert named is not None and named.choice == {"type": "function", "function": {"name": "get_weather"}}
    assert tools.parse_tool_request({"messages": []}) is None


def test_hermes_parser_reads_calls_and_leaves_other_text_as_content() -> None:
    req = tools.parse_tool_request({"tools": [WEATHER]})
    assert req is not None
    p = tools.HermesParser()
    out = p.parse(
        'Let me look.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}',
        req,
    )
    assert out.content == "Let me look."
    assert [(c.name, json.loads(c.arguments)) for c in out.calls] == [
        ("get_weather", {"city": "Oslo"}),
        ("get_weather", {"city": "Rome"}),
    ]
    assert len({c.id for c in out.calls}) == 2
    assert p.parse("no call here", req) == tools.ParsedOutput(content="no call here", calls=[])
    for broken in (
        '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>',
        '<tool_call>{"name": "get_weather"}</tool_call>',
        '<tool_call>["get_weather"]</tool_call>',
    ):
        assert p.parse(broken, req) == tools.ParsedOutput(content=broken, calls=[]), broken


def random_tool_body(rng: random.Random, junk: float = 0.12) -> dict[str, Any]:
    """A chat body's ``tools``, ``tool_choice``, ``parallel_tool_calls`` and a tool-call turn in
    its messages, each part well-formed or (with probability ``junk``) a JSON value of any kind."""
    from tests.inference.test_server_types import _junk

    def maybe(valid: Any) -> Any:
        return _junk(rng) if rng.random() < junk else valid

    def function() -> Any:
        fn: dict[str, Any] = {"name": maybe(rng.choice(["get_weather", "f", "g"]))}
        for key, valid in (
            ("description", "Current weather of a city."),
            ("parameters", {"type": "object", "properties": {"city": {"type": "string"}}}),
            ("strict", rng.random() < 0.5),
        ):
            if rng.random() < 0.5:
                fn[key] = maybe(valid)
        return maybe(fn)

    body: dict[str, Any] = {}
    if rng.random() < 0.9:
        body["tools"] = maybe(
            [maybe({"type": maybe("function"), "function": function()}) for _ in range(rng.randint(0, 3))]
        )
    if rng.random() < 0.7:
        named = {"type": "function", "function": {"name": rng.choice(["get_weather", "f", "nope"])}}
        body["tool_choice"] = maybe(rng.choice(["none", "auto", "required", named]))
    if rng.random() < 0.3:
        body["parallel_tool_calls"] = maybe(rng.random() < 0.5)
    if rng.random() < 0.5:
        arguments = maybe(rng.choice(['{"city": "Oslo"}', "{", "", {"city": "Oslo"}]))
        call = maybe(
            {"id": "c", "type": "function", "function": maybe({"name": maybe("get_weather"), "arguments": arguments})}
        )
        body["messages"] = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": PROMPT},
            {"role": "assistant", "content": maybe(None), "tool_calls": maybe([call])},
            {"role": "tool", "tool_call_id": "c", "content": maybe(TOOL_RESULT)},
        ]
    return body


def check_accepted_tool_requests_parse(parser: tools.ToolParser, rng: random.Random, bodies: int = 300) -> int:
    """Random tools bodies: each is refused with BadRequest or accepted, and ``parser`` reads a
    completion holding a call against every accepted one without an error. Returns how many
    were accepted."""
    text = 'Sure.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    accepted = 0
    for _ in range(bodies):
        body = random_tool_body(rng)
        try:
            req = tools.parse_tool_request(body)
        except BadRequest:
            continue
        if req is None or not req.parse_calls:
            continue
        accepted += 1
        out = parser.parse(text, req)
        assert [(c.name, json.loads(c.arguments)) for c in out.calls] == [("get_weather", {"city": "Oslo"})], (
            fuzzseed.replay_hint(),
            body,
            out,
        )
    return accepted


def test_a_tool_request_accepted_is_parsed_without_error() -> None:
    """The parser this environment has for tool_parser = "hermes" (vLLM's where vLLM is
    installed, else our own) reads a call against every tools body the server accepts
    (fuzzseed: --fuzz-seed N replays a run)."""
    from atroposd.models.tiny import build_tokenizer

    parser = tools.make_parser("hermes", build_tokenizer(), None)
    assert parser is not None
    accepted = check_accepted_tool_requests_parse(parser, fuzzseed.rng("tool-requests"))
    assert accepted >= 10, f"only {accepted} of 300 random bodies were accepted: the fuzz checks too little"


def test_template_messages_read_arguments_and_text_parts() -> None:
    msgs = tools.template_messages(
        [
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}],
            },
        ]
    )
    assert msgs[0]["content"] == "ab"
    assert msgs[1]["tool_calls"][0]["function"]["arguments"] == {"x": 1}
    with pytest.raises(BadRequest, match=r"messages\[0\].tool_calls\[0\].function.arguments is not valid JSON"):
        tools.template_messages([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]}])
    with pytest.raises(BadRequest, match=r"messages\[0\].content\[0\]"):
        tools.template_messages([{"role": "user", "content": [{"type": "image_url"}]}])


def test_auto_detects_the_format_from_the_template_and_the_model_type(tmp_path: Path) -> None:
    assert tools.detect_parser(None, "...<tool_call>...") == "hermes"
    assert tools.detect_parser(None, "{{ '<|python_tag|>' }}") == "llama3_json"
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    assert tools.detect_parser(tmp_path, "{{ messages }}") == "hermes"
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert tools.detect_parser(tmp_path, "{{ messages }}") is None


def test_tool_parser_key_is_checked_by_config_check() -> None:
    assert parse_toml('[inference]\ntool_parser = "hermes"\n').inference.tool_parser == "hermes"
    assert parse_toml('[inference]\ntool_parser = ""\n').inference.tool_parser == ""
    if tools.have_vllm():
        problems = config_problems('[inference]\ntool_parser = "hermez"\n')
        assert any("inference.tool_parser" in p and "did you mean 'hermes'" in p for p in problems), problems
    else:
        problems = config_problems('[inference]\ntool_parser = "llama3_json"\n')
        assert any("inference.tool_parser" in p and "vLLM is not installed" in p for p in problems), problems


# ---------------------------------------------------------------------------- through the server


@pytest.fixture(scope="module")
def tool_server(tool_model: Path) -> Iterator[Server]:
    root = Path(tempfile.mkdtemp(prefix="atpd-tools-", dir="/tmp"))
    srv = start_server(root, tool_model)
    try:
        yield srv
    finally:
        code = stop_process(srv.proc)
        shutil.rmtree(root, ignore_errors=True)
        assert code == 0, f"inference server exited {code} on SIGTERM:\n{srv.tail()}"


def _question() -> list[dict[str, Any]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": PROMPT}]


def test_tool_call_round_trip_through_the_openai_client(tool_server: Server, tool_model: Path) -> None:
    """The tools reach the template, the call comes back as tool_calls (finish_reason
    tool_calls), the client sends the call and the result back, and the model answers."""
    pytest.importorskip("openai")
    asyncio.run(check_round_trip(tool_server.url + "/v1", str(tool_model)))
    assert "hermes (HermesParser)" in tool_server.log.read_text(), "tool_parser = auto: the template's format"


@pytest.mark.parametrize(
    ("extra", "names"),
    [
        ({"tools": {"name": "get_weather"}}, "tools must be a list"),
        ({"tools": [{"type": "function", "function": {"name": 7}}]}, "tools[0].function.name"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "'nope'"),
        ({"tool_choice": "required"}, "tool_choice needs tools"),
        ({"return_token_ids": "yes"}, "return_token_ids"),
        ({"tools": [{"type": "function", "function": {"name": "f", "strict": [1]}}]}, "tools[0].function.strict"),
        (
            {"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]}]},
            "messages[0].tool_calls[0].function.arguments is not valid JSON",
        ),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content[0]"),
    ],
)
def test_malformed_tools_bodies_get_400_naming_the_field(
    tool_server: Server, extra: dict[str, Any], names: str
) -> None:
    status, body = tool_server.http("POST", "/v1/chat/completions", {"messages": _question(), "max_tokens": 2, **extra})
    assert status == 400, body
    assert names in body["error"]["message"]


def post_random_tools_bodies(url: str, rng: random.Random, count: int = 60) -> int:
    """Chat requests with random tools, tool_choice and tool-call turns to the server at ``url``:
    each is answered 200 or 400 with a message, never 500. Returns how many were answered 200."""
    import urllib.error
    import urllib.request

    answered = 0
    for _ in range(count):
        body = {
            "messages": _question(),
            "max_tokens": rng.randint(1, 4),
            "temperature": 1.0,
            **random_tool_body(rng, junk=0.06),
        }
        req = urllib.request.Request(
            url + "/v1/chat/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=120) as resp:
                status, answer = resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            status, answer = exc.code, json.loads(exc.read())
        assert status in (200, 400), (fuzzseed.replay_hint(), body, status, answer)
        if status == 400:
            assert answer["error"]["message"], body
        answered += status == 200
    return answered


def test_random_tools_bodies_are_never_a_500(tool_server: Server) -> None:
    """Random tools bodies on the torch engine: 200 or 400, never 500 (fuzzseed: --fuzz-seed N replays a run)."""
    answered = post_random_tools_bodies(tool_server.url, fuzzseed.rng("inference-tools"))
    assert answered >= 3, f"only {answered} of 60 random bodies were answered: the fuzz reaches too little"


@pytest.mark.atroposlib
def test_tool_calls_through_atroposlibs_openai_class(tool_server: Server, tool_model: Path) -> None:
    """An agent environment of the openai type calls tools as hermes-agent's do: ServerManager's
    chat_completion with tools, n = 2, beside the class's own health check (a one-token chat
    completion, answered as a probe); every choice comes back as the model's call."""
    pytest.importorskip("atroposlib")
    from atroposlib.envs.server_handling.server_baseline import APIServerConfig
    from atroposlib.envs.server_handling.server_manager import ServerManager

    from tests.inference.test_server_types import _close, _metrics

    probe = ("atroposd_inference_probes_total", (("outcome", "ok"), ("route", "chat")))
    probes_before = _metrics(tool_server)[probe]
    manager = ServerManager(
        configs=[
            APIServerConfig(
                server_type="openai",
                base_url=tool_server.url + "/v1",
                model_name=str(tool_model),
                api_key="x",
                timeout=60,
                num_requests_for_eval=0,
            )
        ]
    )

    async def run() -> Any:
        try:
            reply = await manager.chat_completion(messages=_question(), tools=TOOLS, n=2, temperature=0.0)
            for _ in range(200):  # the health check runs beside the call: until its probe was answered
                if (await asyncio.to_thread(_metrics, tool_server))[probe] > probes_before:
                    break
                await asyncio.sleep(0.05)
            else:
                raise AssertionError("the class's health check was never answered as a probe")
            return reply
        finally:
            for srv in manager.servers:
                task = getattr(srv, "check_task", None)
                if task is not None:
                    task.cancel()
                    await asyncio.gather(task, return_exceptions=True)
            await _close(manager)

    reply = asyncio.run(run())
    assert len(reply.choices) == 2
    for choice in reply.choices:
        assert choice.finish_reason == "tool_calls", choice
        calls = choice.message.tool_calls
        assert calls is not None and [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
            (TOOL_CALL["name"], TOOL_CALL["arguments"])
        ]


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_logprobs_come_with_the_exact_sampled_ids(tool_server: Server, tool_model: Path, route: str) -> None:
    """A completion or chat request with logprobs returns the sampled ids beside them: exactly
    the tokens the logprobs belong to, in the prompt's context (the server, scoring the prompt's
    ids followed by them, gives back each logprob), which re-encoding the text would not give."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tool_model))
    common = {"max_tokens": 12, "temperature": 2.0, "seed": 5, "n": 4}
    if route == "completions":
        body: dict[str, Any] = {"prompt": "Tell me about Rome.", "logprobs": 0, **common}
    else:
        body = {"messages": [{"role": "user", "content": "Tell me about Rome."}], "logprobs": True, **common}
    path = "/v1/completions" if route == "completions" else "/v1/chat/completions"
    status, out = tool_server.http("POST", path, body)
    assert status == 200, out
    assert len(out["choices"]) == 4
    retokenized = 0
    for choice in out["choices"]:
        ids = choice["token_ids"]
        if route == "completions":
            prompt = choice["prompt_token_ids"]
            assert prompt == tok.encode("Tell me about Rome.")
            assert choice["logprobs"]["token_ids"] == ids
            logprobs = choice["logprobs"]["token_logprobs"]
        else:
            prompt = out["prompt_token_ids"]
            assert prompt == list(
                tok.apply_chat_template(body["messages"], add_generation_prompt=True, tokenize=True, return_dict=False)
            )
            assert [c["token_id"] for c in choice["logprobs"]["content"]] == ids
            logprobs = [c["logprob"] for c in choice["logprobs"]["content"]]
        assert len(ids) == len(logprobs) >= 1
        retokenized += tok.encode(tok.decode(ids), add_special_tokens=False) != ids
        status, again = tool_server.http(
            "POST",
            "/generate",
            {"prompt": {"prompt_token_ids": prompt + ids}, "max_tokens": 1, "prompt_logprobs": 0, "temperature": 2.0},
        )
        assert status == 200, again
        scored = [float(again["prompt_logprobs"][len(prompt) + k][str(t)]) for k, t in enumerate(ids)]
        assert np.allclose(scored, logprobs, atol=1e-4), (scored, logprobs)
    assert retokenized, "re-encoding the sampled text gives the same tokens: the test could not see a re-tokenization"
    status, plain = tool_server.http("POST", path, {k: v for k, v in body.items() if k != "logprobs"})
    assert status == 200 and "token_ids" not in plain["choices"][0], "asked for neither: the plain OpenAI shape"
    assert "prompt_token_ids" not in plain and "prompt_token_ids" not in plain["choices"][0]


@pytest.mark.atroposlib
@pytest.mark.parametrize("server_type", ["vllm", "sglang"])
def test_three_turns_through_managed_server_reach_the_trainer_exactly(
    tool_server: Server, tool_model: Path, server_type: str, tmp_path: Path
) -> None:
    """A three-turn conversation through atroposlib's ManagedServer, as an environment runs it,
    posted to the API and taken by a trainer: the tokens the trainer trains on are exactly the
    ones sampled, each with its sampled logprob, and each in the very context it was sampled in
    (the server recomputes every one of them from the batch's tokens). Decoding and re-encoding
    the sampled text would have changed them (checked)."""
    pytest.importorskip("atroposlib")
    from atroposlib.envs.server_handling.server_baseline import APIServerConfig
    from atroposlib.envs.server_handling.server_manager import ServerManager
    from transformers import AutoTokenizer

    from atroposd.client import BatchClient
    from tests.api.conftest import start_atroposd

    tok = AutoTokenizer.from_pretrained(str(tool_model))
    manager = ServerManager(
        configs=[
            APIServerConfig(
                server_type=server_type,
                base_url=tool_server.url + "/v1",
                model_name=str(tool_model),
                tokenizer_name=str(tool_model),
                api_key="x",
                health_check=False,
                timeout=60,
            )
        ]
    )
    backend = manager.servers[0]
    sampled: list[tuple[list[int], list[float]]] = []
    answer = backend._tokens_and_logprobs_completion_wrapper

    async def recording(**kw: Any) -> Any:  # what the inference server answered, as atroposlib read it
        out = await answer(**kw)
        sampled.append((list(out[1][0]), list(out[2][0])))
        return out

    backend._tokens_and_logprobs_completion_wrapper = recording
    users = ["Tell me about Rome.", "And the sky over Oslo?", "What is the weather in Lisbon?"]

    async def converse() -> Any:
        messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
        async with manager.managed_server(tokenizer=tok) as managed:
            for turn, text in enumerate(users):
                messages.append({"role": "user", "content": text})
                reply = await managed.chat_completion(
                    messages=messages, n=1, max_tokens=12, temperature=2.0, seed=11 + turn
                )
                messages.append({"role": "assistant", "content": reply.choices[0].message.content})
            return managed.get_state()["nodes"]

    nodes = asyncio.run(converse())
    assert len(sampled) == 3 and len(nodes) == 1, "each turn extends the one conversation"
    node = nodes[0]
    assert any(tok.encode(tok.decode(ids), add_special_tokens=False) != ids for ids, _ in sampled), (
        "re-encoding the sampled text gives the same tokens: the test could not see a re-tokenization"
    )

    api = start_atroposd(tmp_path)
    try:
        with BatchClient(api.url, batch_size=1, max_token_len=256) as trainer:
            trainer.register()
            assert (
                api.api.call(
                    "POST",
                    "/scored_data",
                    {
                        "tokens": [node.tokens],
                        "masks": [node.masked_tokens],
                        "scores": [1.0],
                        "inference_logprobs": [node.logprobs],
                    },
                ).status
                == 200
            )
            batch = trainer.next_batch(timeout=30)
    finally:
        stop_process(api.proc)
    length = int(batch["lengths"][0])
    tokens, masks = batch.tokens[0, :length].tolist(), batch.masks[0, :length].tolist()
    logprobs = batch.inference_logprobs[0, :length]
    trained = [i for i, m in enumerate(masks) if m != -100]
    assert [tokens[i] for i in trained] == [t for ids, _ in sampled for t in ids], "the sampled tokens, in order"
    assert [masks[i] for i in trained] == [tokens[i] for i in trained]
    assert np.array_equal(logprobs[trained], np.array([lp for _, lps in sampled for lp in lps], dtype=np.float32))
    # Each turn's tokens are one contiguous span, and each was sampled in exactly the context
    # the batch gives it: the server, recomputing from the batch's tokens, agrees.
    spans = np.split(np.array(trained), np.where(np.diff(trained) > 1)[0] + 1)
    assert [len(s) for s in spans] == [len(ids) for ids, _ in sampled]
    status, again = tool_server.http(
        "POST",
        "/generate",
        {"prompt": {"prompt_token_ids": tokens}, "max_tokens": 1, "prompt_logprobs": 0, "temperature": 2.0},
    )
    assert status == 200, again
    recomputed = [float(again["prompt_logprobs"][i][str(tokens[i])]) for i in trained]
    assert np.allclose(recomputed, logprobs[trained], atol=1e-4), (recomputed, logprobs[trained].tolist())


def test_an_unavailable_parser_stops_the_server_with_a_usage_error(short_tmp: Path) -> None:
    """A named parser that cannot be had: the server exits 2 before it binds, naming the key."""
    name = "hermez" if tools.have_vllm() else "llama3_json"
    cfg = write_config(short_tmp / "atroposd.toml", {"inference": {"tool_parser": name}})
    result = atroposd("inference", "-c", str(cfg), timeout=60)
    assert result.returncode == 2, result.stderr
    assert "inference.tool_parser" in result.stderr and name in result.stderr, result.stderr
