"""The API server's edge: an ASGI middleware that ``vllm serve --middleware
kvcmas_bench.serving.vllm.edge.KVCMASGuard`` loads (``kvcmas-bench serve`` adds it).

For every POST whose JSON body holds ``kv_transfer_params`` it checks them (:func:`~.guard.check`)
before vLLM sees the request: invalid metadata is answered with HTTP 400 and one line, never served;
a kvcmas request gets the prefix-cache salt of its session (:func:`~.guard.expected_salt`), whatever
``cache_salt`` the client sent, so injected K/V stays in the session's namespace. Plain requests pass
unchanged. The connector's scheduler side checks the same again (a deployment without this
middleware is still safe, see docs/serving-vllm.md); this is where a client gets a clean 400.
"""

from __future__ import annotations

import json

from .guard import Invalid, check, expected_salt

#: request bodies above this size are passed on unread (vLLM's own limits apply)
MAX_BODY = 64 << 20


def _prompt_len(body: dict) -> int | None:
    """The prompt's length where the body gives token ids (completions with a token-id prompt)."""
    p = body.get("prompt")
    if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        return len(p)
    return None


def screen(body: dict) -> dict:
    """``body`` as vLLM should see it (salted), or :class:`~.guard.Invalid`."""
    if "kv_transfer_params" not in body:
        return body
    mt = body.get("max_tokens")
    max_tokens = mt if isinstance(mt, int) and not isinstance(mt, bool) else None
    meta = check(body["kv_transfer_params"], _prompt_len(body), max_tokens)
    if meta is None:
        return body
    return {**body, "cache_salt": expected_salt(meta)}


async def _reply(send, status: int, payload: dict) -> None:
    data = json.dumps(payload).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": data})


class KVCMASGuard:
    """ASGI middleware: check and salt kvcmas requests at the edge (see the module docstring)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope.get("type") != "http" or scope.get("method") != "POST":
            return await self.app(scope, receive, send)
        chunks, size, more = [], 0, True
        while more:
            msg = await receive()
            if msg["type"] != "http.request":
                return await self.app(scope, _replay([*_msgs(chunks, True), msg], receive), send)
            chunks.append(msg.get("body", b""))
            size += len(chunks[-1])
            more = msg.get("more_body", False)
            if size > MAX_BODY and more:
                return await self.app(scope, _replay(_msgs(chunks, True), receive), send)
        body = b"".join(chunks)
        try:
            data = json.loads(body) if body else None
        except (ValueError, RecursionError):
            data = None  # vLLM answers what it cannot parse
        if isinstance(data, dict) and "kv_transfer_params" in data:
            try:
                body = json.dumps(screen(data)).encode()
            except Exception as exc:  # noqa: BLE001  (Invalid, or metadata too deep to check: one line)
                why = str(exc) if isinstance(exc, Invalid) else f"cannot be checked ({type(exc).__name__})"
                message = f"invalid kv_transfer_params: {why}"
                return await _reply(send, 400, {"error": {"message": message, "type": "BadRequestError", "code": 400}})
            headers = [(k, v) for k, v in scope.get("headers", []) if k.lower() != b"content-length"]
            scope = {**scope, "headers": headers + [(b"content-length", str(len(body)).encode())]}
        return await self.app(
            scope, _replay([{"type": "http.request", "body": body, "more_body": False}], receive), send
        )


def _msgs(chunks, more: bool):
    return [{"type": "http.request", "body": c, "more_body": more} for c in chunks]


def _replay(messages: list, then):
    """An ASGI ``receive`` that gives ``messages`` first, then the client's own (a disconnect, when
    it comes: a streaming response listens for it)."""
    pending = list(messages)

    async def receive():
        if pending:
            return pending.pop(0)
        return await then()

    return receive
