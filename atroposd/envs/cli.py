"""``atroposd env NAME``: run a built-in environment (imports nothing heavy at module level).

Settings come from, in order of precedence: flags, the ``ATROPOSD_*`` variables the daemon
exports (SPEC §3), the config's ``[[env]]`` entry (found by replica name, e.g.
``arithmetic-0``, or by name), and the built-in defaults. Exit 2 on bad usage or options.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from atroposd.exitcodes import Exit

if TYPE_CHECKING:
    from atroposd.config import Config, EnvConfig
    from atroposd.envs.arithmetic import ArithmeticTask

T = TypeVar("T")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add this child's flags to its sub-parser (`-c` is already there)."""
    parser.add_argument("builtin", metavar="NAME", help="the built-in environment (arithmetic)")
    parser.add_argument(
        "--name",
        help="component name, registered as desired_name (default: $ATROPOSD_NAME, "
        "else the [[env]] name and replica, e.g. arithmetic-0)",
    )
    parser.add_argument("--replica", type=int, help="replica index (default: $ATROPOSD_REPLICA, else 0)")
    parser.add_argument("--api-url", help="trajectory API (default: $ATROPOSD_API_URL, else from the config)")
    parser.add_argument(
        "--inference-url", help="inference server (default: $ATROPOSD_INFERENCE_URL, else from the config)"
    )
    parser.add_argument(
        "--tokenizer",
        metavar="DIR",
        help="tokenizer directory (default: $ATROPOSD_TOKENIZER, else the configured model's)",
    )
    parser.add_argument(
        "--group-size",
        type=int,
        help="completions per prompt (default: $ATROPOSD_GROUP_SIZE, else the [[env]] group_size)",
    )
    parser.add_argument("--seed", type=int, help="seed (default: $ATROPOSD_SEED, else trainer.seed + replica)")
    parser.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one of the environment's options (VALUE in TOML syntax, e.g. "
        'max_tokens=4 or operators=["+","*"]); repeatable',
    )
    parser.add_argument(
        "--eval",
        action="store_true",
        help="instead of serving: greedy exact match of every problem through the inference "
        "server, printed as one JSON object",
    )


def main(args: argparse.Namespace) -> int:
    try:
        setup = _resolve(args)
    except _Usage as exc:
        print(f"atroposd env: {exc}", file=sys.stderr)
        return Exit.USAGE
    import anyio

    from atroposd.logs import configure_logging

    configure_logging(setup["log_level"], setup["log_format"], component=setup["settings"].name)
    _warn_if_exploitable(setup["task"])
    if args.eval:
        return anyio.run(_evaluate, setup)
    from atroposd.envs.runner import EnvRunner

    return anyio.run(EnvRunner(setup["task"], setup["settings"]).run)


class _Usage(Exception):
    pass


# SPEC §8: a policy that ignores the prompt earns at most this much.
EXPLOIT_LIMIT = 0.35


def _warn_if_exploitable(task: ArithmeticTask) -> None:
    from atroposd.envs.arithmetic import prompt_ignoring_bound
    from atroposd.logs import get_logger

    bound, best = prompt_ignoring_bound(task.problems)
    if bound > EXPLOIT_LIMIT:
        get_logger("envs").warning(
            "with these options a policy that ignores the prompt can earn more than "
            f"{EXPLOIT_LIMIT}: reward alone will not show learning (watch accuracy)",
            prompt_ignoring_bound=round(bound, 4),
            answer=best,
        )


def _resolve(args: argparse.Namespace) -> dict[str, Any]:
    """Everything the environment needs, or _Usage naming the problem."""
    from atroposd.clargs import load_or_exit
    from atroposd.config import EnvConfig, check_fields
    from atroposd.envoptions import BUILTIN_ENVS, parse_options

    if args.builtin not in BUILTIN_ENVS:
        raise _Usage(f"unknown built-in environment {args.builtin!r} (known: {', '.join(BUILTIN_ENVS)})")
    cfg = load_or_exit(args)
    replica = _pick(args.replica, "ATROPOSD_REPLICA", int, 0)
    name = _pick(args.name, "ATROPOSD_NAME", str, "")
    env_cfg = _find_env(cfg.env, name, args.builtin, cfg.node_rank) or EnvConfig(
        name=args.builtin, builtin=args.builtin
    )
    if env_cfg.builtin != args.builtin:
        raise _Usage(f"[[env]] {env_cfg.name!r} is not the built-in {args.builtin!r}")
    name = name or f"{env_cfg.name}-{replica}"
    options = dict(env_cfg.options)
    options.update(_parse_option_flags(args.option))
    try:
        parsed = parse_options(args.builtin, options)
    except ValueError as exc:
        raise _Usage(f"invalid options for {name}: {exc}") from None
    group_size = _pick(args.group_size, "ATROPOSD_GROUP_SIZE", int, env_cfg.group_size)
    seed = _pick(args.seed, "ATROPOSD_SEED", int, cfg.trainer.seed + replica)
    weight = _pick(None, "ATROPOSD_WEIGHT", float, env_cfg.weight)
    env_cfg = dataclasses.replace(env_cfg, group_size=group_size, weight=weight)
    for problem in check_fields(env_cfg, "env", ["group_size", "weight"]):
        raise _Usage(f"{problem.path.removeprefix('env.').replace('_', ' ')} {problem.message}")
    tokenizer = _pick(args.tokenizer, "ATROPOSD_TOKENIZER", str, "") or _configured_tokenizer(cfg)

    from atroposd.envs.arithmetic import ArithmeticTask
    from atroposd.envs.runner import RunnerSettings
    from atroposd.envs.vocab import Vocab, VocabError

    try:
        task = ArithmeticTask(options=parsed, vocab=Vocab.load(tokenizer), seed=seed, env_name=name)
    except VocabError as exc:
        raise _Usage(str(exc)) from None
    settings = RunnerSettings(
        name=name,
        api_url=_pick(args.api_url, "ATROPOSD_API_URL", str, cfg.api_url),
        inference_url=_pick(args.inference_url, "ATROPOSD_INFERENCE_URL", str, cfg.inference_url),
        inference_urls=_inference_urls(args.inference_url, cfg),
        group_size=group_size,
        max_token_length=_pick(None, "ATROPOSD_MAX_TOKEN_LEN", int, cfg.trainer.max_token_len),
        concurrency=parsed.concurrency,
        max_batches_offpolicy=parsed.max_batches_offpolicy,
        weight=env_cfg.weight,
        api_token=cfg.api.token,
        inference_token=_inference_token(cfg),
    )
    return {
        "task": task,
        "settings": settings,
        "options": parsed,
        "vocab": task.vocab,
        "log_level": cfg.daemon.log_level,
        "log_format": cfg.daemon.log_format,
    }


def _inference_token(cfg: Config) -> str:
    """The inference servers' bearer token: ``$ATROPOSD_INFERENCE_TOKEN`` (from the daemon), else
    the config's (``[inference] token_file``, or derived from the cluster token)."""
    from atroposd.config import INFERENCE_TOKEN_ENV

    try:
        return os.environ.get(INFERENCE_TOKEN_ENV, "").strip() or str(cfg.inference_token())
    except ValueError as exc:  # TokenError, ClusterError
        raise _Usage(str(exc)) from None


def _find_env(envs: list[EnvConfig], name: str, builtin: str, node_rank: int = 0) -> EnvConfig | None:
    """The [[env]] whose replica (or own) name is ``name``; without a name, the first of this builtin."""
    for e in envs:
        if name and (name == e.name or name in e.replica_names(node_rank)):
            return e
    if not name:
        return next((e for e in envs if e.builtin == builtin), None)
    return None


def _inference_urls(flag: str | None, cfg: Config) -> tuple[str, ...]:
    """Every inference replica this environment may use: ``--inference-url`` alone when given,
    else $ATROPOSD_INFERENCE_URLS (comma-separated, from the daemon), else $ATROPOSD_INFERENCE_URL
    alone, else the config's replicas."""
    if flag:
        return (flag,)
    listed = [u.strip() for u in os.environ.get("ATROPOSD_INFERENCE_URLS", "").split(",") if u.strip()]
    if listed:
        return tuple(listed)
    single = os.environ.get("ATROPOSD_INFERENCE_URL")
    return (single,) if single else tuple(cfg.inference_urls)


def _pick(flag: T | None, variable: str, kind: Callable[[str], T], default: T) -> T:
    if flag is not None:
        return flag
    raw = os.environ.get(variable)
    if raw is None or raw == "":
        return default
    try:
        return kind(raw)
    except ValueError:
        raise _Usage(f"${variable} must be {getattr(kind, '__name__', kind)}, got {raw!r}") from None


def _parse_option_flags(items: list[str]) -> dict[str, Any]:
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - exercised only on 3.10
        import tomli as tomllib

    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise _Usage(f"--option {item!r}: expected KEY=VALUE")
        try:
            out[key.strip()] = tomllib.loads(f"v = {value}")["v"]
        except tomllib.TOMLDecodeError:
            raise _Usage(f"--option {item!r}: VALUE must be in TOML syntax (a string needs quotes)") from None
    return out


def _configured_tokenizer(cfg: Config) -> str:
    from atroposd.models.resolve import ModelError, resolve_tokenizer

    try:
        return str(resolve_tokenizer(cfg))
    except ModelError as exc:
        raise _Usage(str(exc)) from None


async def _evaluate(setup: dict[str, Any]) -> int:
    import aiohttp
    import orjson

    from atroposd.envs.arithmetic import all_problems, evaluate_via_server
    from atroposd.envs.generate import GenerateError, InferenceClient

    options = setup["options"]
    async with aiohttp.ClientSession() as session:
        infer = InferenceClient(
            session,
            setup["settings"].inference_urls or setup["settings"].inference_url,
            token=setup["settings"].inference_token,
        )
        try:
            result = await evaluate_via_server(
                infer, setup["vocab"], all_problems(options), max_tokens=options.max_tokens
            )
        except GenerateError as exc:
            print(f"atroposd env: {exc}", file=sys.stderr)
            return Exit.RUNTIME
    sys.stdout.write(orjson.dumps(result.as_dict()).decode() + "\n")
    return Exit.OK
