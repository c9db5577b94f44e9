"""What the API's routes share about HTTP: JSON responses, gzip'ed as run-api does (level 0 to a
client on this host, 1 to a remote one), and the checks the guard makes of every request (bearer
token, JSON media type, requests a web page makes a browser send)."""

from __future__ import annotations

import asyncio
import hmac
import zlib

import orjson
from aiohttp import web

from atroposd.api.schema import Group, dumps, group_to_json
from atroposd.net import is_loopback

__all__ = [
    "GZIP_MIN_BYTES",
    "accepts_gzip",
    "batch_body",
    "encode",
    "from_a_web_page",
    "gzip",
    "is_json",
    "json_plain",
    "json_reply",
    "send",
    "token_ok",
]

GZIP_MIN_BYTES = 1000  # upstream's GZipMiddleware minimum_size
THREAD_MIN_BYTES = 256 << 10  # compress bigger responses off the event loop


def token_ok(header: str, token: str) -> bool:
    try:
        given = header.encode("utf-8")
    except UnicodeError:  # undecodable bytes in the header: not our token
        return False
    return hmac.compare_digest(given, f"Bearer {token}".encode())


def is_json(mimetype: str) -> bool:
    mimetype = mimetype.lower()
    return mimetype == "application/json" or (mimetype.startswith("application/") and mimetype.endswith("+json"))


def from_a_web_page(request: web.Request) -> bool:
    """A browser marks what a page makes it fetch (Fetch Metadata; Origin on cross-site
    requests); no API client sends these headers."""
    site = request.headers.get("Sec-Fetch-Site")
    if site is not None and site.lower() not in ("same-origin", "none"):
        return True
    origin = request.headers.get("Origin")
    if origin is None or origin == "null":
        return origin == "null"
    host = origin.split("://", 1)[-1].split("/", 1)[0]
    return host.lower() != (request.headers.get("Host") or "").lower()


def batch_body(batch: list[Group]) -> bytes:
    return dumps({"batch": [group_to_json(g) for g in batch]})


def accepts_gzip(request: web.Request) -> bool:
    return "gzip" in request.headers.get("Accept-Encoding", "").lower()


def json_plain(obj: object, *, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(body=orjson.dumps(obj), status=status, content_type="application/json", headers=headers)


async def json_reply(request: web.Request, obj: object) -> web.StreamResponse:
    return await send(request, dumps(obj))


async def send(request: web.Request, body: bytes) -> web.Response:
    body, headers = await encode(request, body)
    return web.Response(body=body, headers=headers)


async def encode(request: web.Request, body: bytes) -> tuple[bytes, dict[str, str]]:
    """The JSON body, gzip'ed when large and the client accepts it."""
    headers = {"Content-Type": "application/json"}
    if len(body) >= GZIP_MIN_BYTES and accepts_gzip(request):
        level = 0 if is_loopback(request.remote) else 1
        if len(body) >= THREAD_MIN_BYTES and level > 0:
            body = await asyncio.to_thread(gzip, body, level)
        else:
            body = gzip(body, level)
        headers["Content-Encoding"] = "gzip"
    return body, headers


def gzip(body: bytes, level: int = 1) -> bytes:
    c = zlib.compressobj(level, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    return c.compress(body) + c.flush()
