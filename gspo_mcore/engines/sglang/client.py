"""SGLang's `/generate` for the generation client (gspo_mcore.engines.client): token ids in, the
response's tokens, log-probs, weight-version spans and routed experts out (parsed from the raw
bytes by gspo_mcore.engines.sglang.response)."""

from __future__ import annotations

import dataclasses
import json
import uuid

from gspo_mcore.engines.client import Aborted, EngineClient, RetryableError
from gspo_mcore.engines.sglang.response import decode_generate_body, parse_generate_response
from gspo_mcore.common.errors import RequestRefused
from gspo_mcore.common.http import ConnectionFailure, HTTPRequestError, HTTPStatusError, post_json
from gspo_mcore.common.http_async import post_bytes
from gspo_mcore.batch.rollout import Rollout


class SGLangClient(EngineClient):
    name = "sglang-client"

    def abort_all(self, url: str) -> None:
        try:
            post_json(f"{url}/abort_request", {"rid": "", "abort_all": True}, 10, self.api_key)
        except HTTPRequestError:
            pass  # a server already gone has nothing in flight

    async def request(self, url: str, index, prompt_ids: list[int], sampling_params: dict,
                      weight_version: str | None, oldest_version: int | None) -> Rollout:
        # Our own request id (one per attempt: SGLang refuses a duplicate in flight), so a response
        # can be found in the server's log (Rollout.origin).
        rid = uuid.uuid4().hex
        body = {"input_ids": prompt_ids, "sampling_params": sampling_params, "return_logprob": True,
                "logprob_start_len": -1, "rid": rid}
        if self.routing_shape is not None:
            body["return_routed_experts"] = True
        payload = await self._post(url, body)
        meta = payload.get("meta_info", {})
        if (meta.get("finish_reason") or {}).get("type") == "abort":
            raise Aborted(int(meta.get("completion_tokens") or 0))
        rollout = parse_generate_response(f"{index}", prompt_ids, payload, self.vocab_size, weight_version,
                                          self.routing_shape, oldest_version)
        origin = (f"{url} rid={rid} retractions={meta.get('num_retractions', '?')} "
                  f"cached_tokens={meta.get('cached_tokens', '?')}")
        return dataclasses.replace(rollout, origin=(origin,))

    async def _post(self, url: str, body: dict) -> dict:
        try:
            raw, labelled_json = await post_bytes(self.loop_thread.session, f"{url}/generate",
                                                  json.dumps(body).encode(), self.request_timeout_s)
        except HTTPStatusError as err:
            if err.status >= 500:
                raise RetryableError(f"HTTP {err.status}") from None
            raise RequestRefused(f"server {url} refused the request: {err}") from None
        except ConnectionFailure as err:  # includes a server dying mid-answer
            raise RetryableError(str(err)) from None
        try:
            answer = decode_generate_body(raw)
        except ValueError as err:  # JSONDecodeError, or UnicodeDecodeError of a cut-off character
            if labelled_json:  # promised JSON: the body was cut off, as a broken connection
                raise RetryableError(f"{type(err).__name__}: {err}") from None
            answer = raw.decode(errors="replace")
        if not isinstance(answer, dict):  # a text answer
            raise RetryableError(f"not a /generate answer: {str(answer)[:100]!r}")
        return answer
