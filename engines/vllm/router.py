"""The real-serving suite's router: a disaggregated-prefill proxy in front of `vllm serve` pairs.

For each ``POST /v1/completions`` it sends the request to a prefill server with ``max_tokens=1``
and ``kv_transfer_params={"do_remote_decode": true, ...}``, then the original request to a decode
server with the ``kv_transfer_params`` the prefill returned (where kvlease's ticket rides), and
answers with the decode server's response (streamed when the client streams). This is what every
vLLM P/D router does (vLLM's own example proxy, llm-d, production gateways); the project ships its
own because vLLM's example proxy is in vLLM's source tree, not in the wheel the suite installs,
and because the suite must choose the P and D of each request to build mixed fleets: the headers
``x-kvlease-prefill`` and ``x-kvlease-decode`` name them (round robin otherwise). It forwards
``kv_transfer_params`` as JSON it does not interpret, as routers do: a request that carries some
(a conversation's next turn, with what the previous turn's decoder answered) hands them to the
prefill server instead of the plain remote-decode request (bidirectional KV transfer: P reads the
decoder's blocks back). Push mode (``NixlPushConnector``) needs nothing else: D gets P's
coordinates in the ``kv_transfer_params`` P returned, registers its blocks, and P writes them.

    python engines/vllm/router.py --port 8000 --prefill p=http://127.0.0.1:8100 \\
        --decode d=http://127.0.0.1:8200

Runs in the vLLM environment (aiohttp). ``GET /health`` answers once every backend does.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import logging
import uuid
from typing import Any

import aiohttp
from aiohttp import web

log = logging.getLogger("kvlease.router")

PREFILL_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


class Router:
    def __init__(self, prefills: dict[str, str], decodes: dict[str, str]) -> None:
        self.prefills, self.decodes = prefills, decodes
        self._next_p = itertools.cycle(sorted(prefills))
        self._next_d = itertools.cycle(sorted(decodes))
        self.session: aiohttp.ClientSession | None = None

    def pick(self, request: web.Request) -> tuple[str, str]:
        p = request.headers.get("x-kvlease-prefill") or next(self._next_p)
        d = request.headers.get("x-kvlease-decode") or next(self._next_d)
        if p not in self.prefills or d not in self.decodes:
            raise web.HTTPBadRequest(text=f"unknown route {p!r} -> {d!r}")
        return p, d

    async def start(self, app: web.Application) -> None:
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900))

    async def stop(self, app: web.Application) -> None:
        if self.session is not None:
            await self.session.close()

    async def health(self, request: web.Request) -> web.Response:
        assert self.session is not None
        for url in [*self.prefills.values(), *self.decodes.values()]:
            try:
                async with self.session.get(url + "/health", timeout=aiohttp.ClientTimeout(total=5)) as r:
                    if r.status != 200:
                        return web.Response(status=503, text=f"{url} answered {r.status}")
            except (aiohttp.ClientError, TimeoutError) as e:
                return web.Response(status=503, text=f"{url}: {e!r}")
        return web.json_response({"ok": True})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        assert self.session is not None
        body: dict[str, Any] = await request.json()
        p_name, d_name = self.pick(request)
        rid = request.headers.get("x-request-id") or str(uuid.uuid4())
        headers = {"X-Request-Id": rid}
        prefill = copy.deepcopy(body)
        # A conversation's next turn carries what the last decoder's answer returned (its blocks,
        # which the producer reads back under bidirectional KV transfer): P gets those as they
        # are; a first turn gets the plain remote-decode request.
        turn = body.get("kv_transfer_params")
        prefill.update(max_tokens=1, stream=False, kv_transfer_params=turn or dict(PREFILL_PARAMS))
        for key in ("min_tokens", "stream_options", "max_completion_tokens"):
            prefill.pop(key, None)
        async with self.session.post(self.prefills[p_name] + "/v1/completions", json=prefill, headers=headers) as r:
            answer = await r.read()
            if r.status != 200:
                log.warning("prefill %s on %s answered %d", rid, p_name, r.status)
                return web.Response(status=r.status, body=answer, content_type="application/json")
            kv_params = json.loads(answer).get("kv_transfer_params")
        log.info("%s: prefill on %s, decode on %s, kv_transfer_params=%s", rid, p_name, d_name, kv_params)
        decode = copy.deepcopy(body)
        decode["kv_transfer_params"] = kv_params
        async with self.session.post(self.decodes[d_name] + "/v1/completions", json=decode, headers=headers) as r:
            if not body.get("stream"):
                return web.Response(status=r.status, body=await r.read(), content_type="application/json")
            out = web.StreamResponse(status=r.status, headers={"Content-Type": "text/event-stream"})
            await out.prepare(request)
            async for chunk in r.content.iter_any():
                await out.write(chunk)
            await out.write_eof()
            return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--prefill", action="append", default=[], metavar="NAME=URL", required=True)
    ap.add_argument("--decode", action="append", default=[], metavar="NAME=URL", required=True)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s router %(message)s")
    router = Router(
        dict(s.split("=", 1) for s in args.prefill),
        dict(s.split("=", 1) for s in args.decode),
    )
    app = web.Application()
    app.on_startup.append(router.start)
    app.on_cleanup.append(router.stop)
    app.add_routes([web.get("/health", router.health), web.post("/v1/completions", router.completions)])
    web.run_app(app, host=args.host, port=args.port, print=None, access_log=None)


if __name__ == "__main__":
    main()
