"""gspo_mcore.common.http's POST on an event loop (aiohttp), for clients with many requests in flight.

The same two failures as the blocking helper, worded alike (a log reads the same whichever sent
the request): `HTTPStatusError` with the server's message, `ConnectionFailure` for no answer or a
broken one ("URLError: ..." for no connection, "IncompleteRead: ..." for a body cut short).
The answer comes back as bytes, for the caller to decode as it needs (gspo_mcore.engines.sglang.
response reads SGLang's long arrays with numpy).
"""

from __future__ import annotations

import asyncio

import aiohttp

from gspo_mcore.common.http import ConnectionFailure, HTTPStatusError, error_detail


def open_session(api_key: str | None = None) -> aiohttp.ClientSession:
    """One per client, on its loop: a connection per request (a request takes seconds; its
    connect, well under a millisecond), `api_key` as the bearer token of every request.
    Not kept alive: both engines' servers (uvicorn) close a connection idle for 5 s, and this
    loop shares rank 0's GIL with the training step, so after a long step it can take a pooled
    connection whose close it has not yet read and send on it ("Server disconnected", "Can not
    write request body"): 7 to 36 requests retried per step of the vLLM async test."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=True), headers=headers)


async def post_bytes(session: aiohttp.ClientSession, url: str, data: bytes, timeout_s: float) -> tuple[bytes, bool]:
    """POST the JSON `data` to `url`: the answer's body, and whether it is labelled JSON. `timeout_s`
    bounds connecting and each wait for more of the answer, as the blocking helper's socket timeout."""
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=timeout_s, sock_read=timeout_s)
    try:
        async with session.post(url, data=data, timeout=timeout,
                                headers={"Content-Type": "application/json"}) as response:
            try:
                raw = await response.read()
            except aiohttp.ClientPayloadError as err:  # fewer bytes than Content-Length: the server died
                if response.status < 400:
                    raise ConnectionFailure(f"IncompleteRead: {err}") from None
                raw = b""
            if response.status >= 400:
                raise HTTPStatusError(response.status, error_detail(raw) if raw else "")
            return raw, "json" in (response.headers.get("Content-Type") or "")
    except aiohttp.ClientConnectorError as err:
        raise ConnectionFailure(f"URLError: {err.os_error}") from None
    except asyncio.TimeoutError:
        raise ConnectionFailure(f"TimeoutError: no answer within {timeout_s:g} s") from None
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as err:  # disconnected, timed out, reset
        raise ConnectionFailure(f"{type(err).__name__}: {err}") from None
