"""JSON over HTTP to an engine server: one request function and the two ways it fails.

`HTTPStatusError`: the server answered and refused (its status and its error message).
`ConnectionFailure`: the answer is unknown (no connection, a timeout, or a server dying
mid-answer: an `IncompleteRead`, or a JSON body cut off); callers may retry it.
A 200 whose body is not JSON and not labelled JSON (SGLang's /flush_cache answers text)
comes back as the text.

Servers reachable from other hosts run with the engine's `--api-key`. The key reaches a run through
the environment (`API_KEY_ENV`, made per job by the launch scripts; a run makes one for the
servers it starts); entry points read it once (`api_key_from_env`) and pass it to the clients,
whose every request carries it.
"""

from __future__ import annotations

import http.client
import json
import os
import urllib.error
import urllib.request

DETAIL_CHARS = 2000  # of a body that is not an error message (an HTML page); a message is quoted whole
API_KEY_ENV = "GSPO_ENGINE_API_KEY"
LEGACY_API_KEY_ENV = "GSPO_SGLANG_API_KEY"  # its name while SGLang was the only engine (job scripts may export it)


class HTTPRequestError(Exception):
    """The request did not return an answer (base of the two kinds below)."""


class HTTPStatusError(HTTPRequestError):
    def __init__(self, status: int, detail: str):
        super().__init__(f"HTTP {status}: {detail}".strip())
        self.status, self.detail = status, detail


class ConnectionFailure(HTTPRequestError):
    """No answer, or a broken one."""


def error_detail(raw: bytes) -> str:
    """The server's JSON error message, whole (SGLang's `message`, or OpenAI-style
    `error.message`), else the start of the body."""
    text = raw.decode(errors="replace")
    try:
        answer = json.loads(text)
    except ValueError:
        answer = None
    if isinstance(answer, dict):
        nested = answer.get("error")
        message = answer.get("message", nested.get("message") if isinstance(nested, dict) else None)
        if message is not None:
            return str(message)
    return text[:DETAIL_CHARS]


def api_key_from_env() -> str | None:
    """The servers' API key the launch scripts hand a run (None: servers without one)."""
    return os.environ.get(API_KEY_ENV) or os.environ.get(LEGACY_API_KEY_ENV) or None


def request_json(url: str, body: dict | None = None, timeout_s: float = 600.0, *, method: str = "POST",
                 api_key: str | None = None) -> object:
    """Send `body` as JSON (POST) or nothing (GET) to `url`, with `api_key` as the bearer token;
    the decoded JSON answer, or the text of a 200 that is not JSON."""
    data = json.dumps(body or {}).encode() if method == "POST" else None
    headers = {"Content-Type": "application/json"} if data is not None else {}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    request = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            raw = response.read()
            labelled_json = "json" in (response.headers.get("Content-Type") or "")
    except urllib.error.HTTPError as err:
        try:
            detail = error_detail(err.read())
        except (OSError, http.client.HTTPException):
            detail = ""
        raise HTTPStatusError(err.code, detail) from None
    except (urllib.error.URLError, OSError, http.client.HTTPException) as err:
        raise ConnectionFailure(f"{type(err).__name__}: {getattr(err, 'reason', err)}") from None
    try:
        return json.loads(raw)
    except ValueError as err:  # JSONDecodeError, or UnicodeDecodeError of a cut-off character
        if labelled_json:  # promised JSON: the body was cut off
            raise ConnectionFailure(f"{type(err).__name__}: {err}") from None
        return raw.decode(errors="replace")


def post_json(url: str, body: dict | None, timeout_s: float, api_key: str | None = None) -> object:
    return request_json(url, body, timeout_s, method="POST", api_key=api_key)


def get_json(url: str, timeout_s: float, api_key: str | None = None) -> object:
    return request_json(url, None, timeout_s, method="GET", api_key=api_key)
