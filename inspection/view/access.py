"""Who may ask `gagpo view`: the bind address, the access token, the Host header.

- The server binds 127.0.0.1 by default. Any other address needs an access token
  (`check_bind` refuses one without); the CLI generates one when none is given.
- With a token, every request carries it: `?token=…` once (the answer sets an HttpOnly,
  SameSite=Strict cookie, so links and the pages' own requests carry it from then on), the
  cookie, or `Authorization: Bearer …`. It is compared in constant time.
- Bound to loopback, a request must name a loopback host (`localhost`, 127.x, [::1]) in
  its Host header: a web page elsewhere cannot reach the server through a DNS name that
  resolves to 127.0.0.1 (DNS rebinding). An SSH tunnel's local end is such a host.
- Requests from other sites are refused: a POST takes `application/json` only (a page
  elsewhere cannot send that without a CORS preflight, which this server never grants),
  and a POST or an /api/ request whose `Origin` names another host or port than its Host
  header, or whose `Sec-Fetch-Site` says another site sent it, is a 403. A web page open
  in the user's browser can therefore run no query against the viewer; a link to one of
  its pages still opens it. Clients that are not browsers (curl) send neither header.
- Every answer carries headers that keep the pages to their own assets (CSP `'self'`: no
  script from elsewhere, none inline), out of frames, and the token out of Referer.
"""

from __future__ import annotations

import hmac
import ipaddress
from http.cookies import SimpleCookie
from urllib.parse import parse_qs

from gagpo.schemas.errors import GagpoError

COOKIE = "gagpo_view_token"
LOOPBACK_NAMES = frozenset({"localhost", "localhost.", "ip6-localhost"})
SECURITY_HEADERS = [
    (
        b"content-security-policy",
        b"default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
        b"img-src 'self' data:; connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; "
        b"form-action 'self'",
    ),
    (b"x-content-type-options", b"nosniff"),
    (b"x-frame-options", b"DENY"),
    (b"referrer-policy", b"no-referrer"),
    (b"cache-control", b"no-store"),
]


def is_loopback(host: str) -> bool:
    """Whether `host` (an address or a name) is this machine only."""
    host = host.strip().strip("[]").lower()
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_bind(host: str, token: str | None) -> None:
    """Refuse to serve a non-loopback address without an access token."""
    if not is_loopback(host) and not token:
        raise GagpoError(
            f"--host {host} is reachable from other machines and needs an access token; "
            "accepted: --token TOKEN (or leave it out and one is generated), or --host 127.0.0.1 "
            "with an SSH tunnel (docs/inspect.md)"
        )
    if token is not None and len(token) < 16:
        raise GagpoError("--token is too short; accepted: at least 16 characters")


def _host_name(header: str) -> str:
    """The name of a Host header without its port (`[::1]:8765` → `::1`)."""
    if header.startswith("["):
        return header[1 : header.find("]")] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


class Guard:
    """ASGI middleware: the Host and token checks, and the security headers on every answer."""

    def __init__(self, app, *, token: str | None, loopback: bool) -> None:
        self.app, self.token, self.loopback = app, token, loopback

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if self.loopback and not is_loopback(_host_name(headers.get("host", ""))):
            await _refuse(
                send,
                403,
                "this server answers requests to localhost only "
                "(the Host header names another host)",
            )
            return
        refused = _other_site(scope, headers)
        if refused is not None:
            await _refuse(send, *refused)
            return
        set_cookie = False
        if self.token:
            given, in_url = _given_token(scope, headers)
            if given is None or not hmac.compare_digest(given.encode(), self.token.encode()):
                await _refuse(
                    send,
                    401,
                    "this server needs its access token: open the URL "
                    "printed when it started (…?token=…)",
                )
                return
            set_cookie = in_url and _cookie(headers) != self.token

        async def send_with_headers(message) -> None:
            if message["type"] == "http.response.start":
                extra = list(SECURITY_HEADERS)
                if set_cookie:
                    extra.append(
                        (
                            b"set-cookie",
                            f"{COOKIE}={self.token}; HttpOnly; SameSite=Strict; Path=/".encode(),
                        )
                    )
                message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)

        await self.app(scope, receive, send_with_headers)


# Sec-Fetch-Site values of a request the browser made for this server's own pages: from
# one of them, or typed in the address bar / opened from a bookmark ("none").
_OWN_SITE = frozenset({"same-origin", "none"})


def _other_site(scope, headers: dict[str, str]) -> tuple[int, str] | None:
    """(status, line) refusing a request another web site made the browser send, or None.

    Pages (GET of a page) open from anywhere, as a link should; what runs a query or
    answers data (POST, /api/…) must come from this server's own pages."""
    method = scope.get("method", "GET")
    if method not in ("GET", "HEAD") and _media_type(headers) != "application/json":
        return 415, "this endpoint takes a JSON body only; accepted: Content-Type: application/json"
    if method in ("GET", "HEAD") and not scope.get("path", "").startswith("/api/"):
        return None
    origin, own = headers.get("origin"), headers.get("host", "").lower()
    site = headers.get("sec-fetch-site")
    if (origin is not None and (not own or _origin_host(origin) != own)) or (
        site is not None and site.lower() not in _OWN_SITE
    ):
        return 403, (
            "this server answers its own pages only (the request came from another site: "
            f"Origin {(origin or '-')[:100]}, Sec-Fetch-Site {(site or '-')[:40]})"
        )
    return None


def _origin_host(origin: str) -> str:
    """The host[:port] of an Origin header ("null" and the like: none). The scheme is left
    out: behind a proxy that ends TLS the page is https and this server sees http, and no
    other server can answer on this one's host and port."""
    scheme, sep, host = origin.lower().partition("://")
    return host if sep and scheme in ("http", "https") and "/" not in host else ""


def _media_type(headers: dict[str, str]) -> str:
    return headers.get("content-type", "").split(";", 1)[0].strip().lower()


def _cookie(headers: dict[str, str]) -> str | None:
    jar = SimpleCookie()
    try:
        jar.load(headers.get("cookie", ""))
    except Exception:  # a malformed Cookie header carries no token
        return None
    return jar[COOKIE].value if COOKIE in jar else None


def _given_token(scope, headers: dict[str, str]) -> tuple[str | None, bool]:
    """The token the request carries, and whether it came in the URL."""
    query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
    if query.get("token"):
        return query["token"][0], True
    auth = headers.get("authorization", "")
    if auth.lower().startswith("bearer "):
        return auth[7:].strip(), False
    return _cookie(headers), False


async def _refuse(send, status: int, line: str) -> None:
    body = (line + "\n").encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"text/plain; charset=utf-8"),
                (b"content-length", str(len(body)).encode()),
                *SECURITY_HEADERS,
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
