"""Pure ASGI middleware: request ids and API-key authentication.

Pure ASGI (not BaseHTTPMiddleware) so that streamed chunks pass straight through and a
client's disconnect reaches the response that watches for it.
"""

from __future__ import annotations

import hmac
import json
import uuid

# Routes open without the API key, as in vLLM: probes and scrapers carry no credentials.
OPEN_PATHS = frozenset({"/health", "/metrics"})


class RequestId:
    """Every request gets an id (the client's `X-Request-Id` if it sent a sane one), echoed in the
    response headers and kept in `scope["state"]["request_id"]` for logs and 500 messages."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = dict(scope.get("headers") or []).get(b"x-request-id", b"")
        request_id = given.decode("ascii", "replace") if 0 < len(given) <= 128 and given.isascii() \
            and given.replace(b"-", b"").replace(b"_", b"").isalnum() else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []),
                                                  (b"x-request-id", request_id.encode())]}
            await send(message)
        await self.app(scope, receive, send_with_id)


class ApiKeyAuth:
    """`Authorization: Bearer <key>` on every route except /health and /metrics (constant-time compare)."""

    def __init__(self, app, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        given = dict(scope.get("headers") or []).get(b"authorization", b"")
        if hmac.compare_digest(given, self.expected):
            return await self.app(scope, receive, send)
        body = json.dumps({"error": {"message": "invalid or missing API key", "type": "authentication_error",
                                     "param": None, "code": 401}}).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})
