"""CSRF tokens, signed flash cookies and basic auth for the dashboard's ASGI app."""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import secrets
from dataclasses import dataclass

from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = ["BasicAuth", "Credentials", "SecurityHeaders", "Signer", "parse_auth"]

CSRF_COOKIE = "skiplock_csrf"
FLASH_COOKIE = "skiplock_flash"


class Signer:
    """HMAC-SHA256 under a secret held by this process only.

    A restart makes a new secret, so tokens and flash cookies from before it no longer
    verify: a stale form answers 403 and is reloaded, which is a fair price for never
    writing a secret to disk.
    """

    def __init__(self, secret: bytes | None = None) -> None:
        self._secret = secret if secret is not None else secrets.token_bytes(32)

    def sign(self, purpose: str, value: str) -> str:
        msg = f"{purpose}\x00{value}".encode()
        return hmac.new(self._secret, msg, hashlib.sha256).hexdigest()

    def verify(self, purpose: str, value: str, signature: str) -> bool:
        return hmac.compare_digest(self.sign(purpose, value), signature)

    # -- CSRF: a signed double submit --------------------------------------------------
    #
    # The browser holds a random nonce in a SameSite=Strict cookie; each form carries the
    # nonce's signature.  Another site can make the browser send the cookie (not with
    # Strict, but an older browser might) yet can read neither it nor the page, so it
    # cannot produce the field; and without the secret nobody can forge a pair.

    @staticmethod
    def new_nonce() -> str:
        return secrets.token_urlsafe(24)

    def csrf_token(self, nonce: str) -> str:
        return self.sign("csrf", nonce)

    def csrf_ok(self, nonce: str | None, token: str | None) -> bool:
        if not nonce or not token:
            return False
        return self.verify("csrf", nonce, token)

    # -- flash messages: one message, carried across the redirect after a POST -----------

    def dump_flash(self, level: str, message: str) -> str:
        body = base64.urlsafe_b64encode(json.dumps([level, message]).encode()).decode()
        return f"{body}.{self.sign('flash', body)}"

    def load_flash(self, cookie: str | None) -> tuple[str, str] | None:
        if not cookie or "." not in cookie:
            return None
        body, _, signature = cookie.rpartition(".")
        if not self.verify("flash", body, signature):
            return None
        try:
            level, message = json.loads(base64.urlsafe_b64decode(body.encode()))
        except (ValueError, binascii.Error, TypeError):
            return None
        return str(level), str(message)


@dataclass(frozen=True)
class Credentials:
    user: str
    password: str


def parse_auth(text: str) -> Credentials:
    """``user:password`` as given to ``--auth``; ValueError names what is wrong."""
    user, sep, password = text.partition(":")
    if not sep or not user or not password:
        raise ValueError("--auth expects user:password, both non-empty")
    return Credentials(user, password)


class BasicAuth:
    """ASGI middleware: every HTTP request needs these credentials, else 401.

    Compared in constant time on the whole ``Authorization`` header, so neither the
    user name nor the password leaks through timing.
    """

    def __init__(self, app: ASGIApp, credentials: Credentials) -> None:
        self.app = app
        raw = f"{credentials.user}:{credentials.password}".encode()
        self._expected = b"Basic " + base64.b64encode(raw)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = dict(scope.get("headers") or []).get(b"authorization", b"")
        if hmac.compare_digest(given, self._expected):
            await self.app(scope, receive, send)
            return
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"www-authenticate", b'Basic realm="skiplock", charset="UTF-8"'),
                    (b"content-type", b"text/plain; charset=utf-8"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": b"authentication required\n"})


# No inline script, no framing (the buttons must not be clickjacked), nothing from
# elsewhere: the machine the dashboard runs on may have no internet anyway.
_HEADERS = [
    (
        b"content-security-policy",
        b"default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        b"frame-ancestors 'none'; form-action 'self'; base-uri 'none'",
    ),
    (b"x-frame-options", b"DENY"),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"same-origin"),
]


class SecurityHeaders:
    """ASGI middleware adding the headers above to every HTTP response."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *_HEADERS]}
            await send(message)

        await self.app(scope, receive, send_with_headers)
