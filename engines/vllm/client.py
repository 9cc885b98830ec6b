"""The real-serving suite's client: OpenAI completions through the `openai` library, as a user's.

Runs in the vLLM environment (which carries `openai`) as a subprocess of the suite, the
benchmark or the demo, and serves requests given as JSON lines on stdin, each on a thread of its
own, answering with one JSON line each on stdout::

    {"id": "v1", "base_url": "http://127.0.0.1:8000/v1", "prompt": "...", "max_tokens": 16,
     "headers": {"x-kvlease-decode": "d"}, "stream": false, "extra_body": {...}}
    -> {"id": "v1", "status": 200, "text": "...", "error": null, "elapsed": 1.2, "ttft": 0.4}

``status`` is the HTTP status (0 when no answer came), ``ttft`` the time to the first streamed
token (streamed requests only), ``token_ids`` and ``prompt_token_ids`` the completion's and the
prompt's tokens when the request asked vLLM for them (``"extra_body": {"return_token_ids": true}``),
``kv_transfer_params`` what the server's answer carried (multi-turn: the next turn's producer reads
the decoder's blocks with them). ``prompt`` is text or token ids. Greedy (``temperature=0``) always.

A request with ``"hold": true`` is streamed and runs until the server ends it or a line
``{"cancel": "v1"}`` arrives; the client then closes the stream, which makes vLLM abort the
request (it frees the sequence slot at once). Its answer says ``"cancelled": true``. The suite's
fillers are such requests: they keep a decoder's slots busy for exactly as long as a scenario
needs, whatever the machine's decode speed.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import openai

_write = threading.Lock()
_clients: dict[str, openai.OpenAI] = {}
#: Held requests by id: set to end the request (its stream is closed at the next chunk).
_cancel: dict[str, threading.Event] = {}


def client(base_url: str) -> openai.OpenAI:
    with _write:
        if base_url not in _clients:
            _clients[base_url] = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=900.0)
        return _clients[base_url]


def complete(req: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"id": req["id"], "status": 0, "text": None, "token_ids": None, "error": None, "ttft": None}
    start = time.monotonic()
    kwargs: dict[str, Any] = dict(
        model=req.get("model", "tiny"),
        prompt=req["prompt"],
        max_tokens=req.get("max_tokens", 16),
        temperature=0.0,
        extra_headers=req.get("headers") or None,
        extra_body=req.get("extra_body") or None,
    )
    try:
        if req.get("hold"):
            cancel = _cancel[req["id"]]
            stream = client(req["base_url"]).completions.create(stream=True, **kwargs)
            out.update(status=200, text="", cancelled=False)
            with stream:
                for chunk in stream:
                    out["text"] += "".join(c.text for c in chunk.choices)
                    if cancel.is_set():
                        out["cancelled"] = True
                        break
        elif req.get("stream"):
            parts = []
            for chunk in client(req["base_url"]).completions.create(stream=True, **kwargs):
                if out["ttft"] is None:
                    out["ttft"] = time.monotonic() - start
                parts.extend(c.text for c in chunk.choices)
            out.update(status=200, text="".join(parts))
        else:
            answer = client(req["base_url"]).completions.create(**kwargs)
            choice = answer.choices[0]
            extra = choice.model_extra or {}
            out.update(
                status=200,
                text=choice.text,
                token_ids=extra.get("token_ids"),
                prompt_token_ids=extra.get("prompt_token_ids"),
                kv_transfer_params=(answer.model_extra or {}).get("kv_transfer_params"),
            )
    except openai.APIStatusError as e:
        out.update(status=e.status_code, error=str(e)[:500])
    except openai.APIError as e:
        out.update(error=f"{type(e).__name__}: {e}"[:500])
    out["elapsed"] = time.monotonic() - start
    return out


def answer(req: dict[str, Any]) -> None:
    try:
        line = json.dumps(complete(req))
    finally:
        _cancel.pop(req["id"], None)
    with _write:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


def main() -> None:
    with ThreadPoolExecutor(max_workers=64) as pool:
        for line in sys.stdin:
            if not line.strip():
                continue
            req = json.loads(line)
            if "cancel" in req:
                if (event := _cancel.get(req["cancel"])) is not None:
                    event.set()
                continue
            if req.get("hold"):
                _cancel[req["id"]] = threading.Event()
            pool.submit(answer, req)


if __name__ == "__main__":
    main()
