"""What a real-serving test needs whichever engine serves: completions through the ``openai``
library (engines/vllm/client.py, a subprocess of an engine environment's interpreter), the
reference a correct pair must return (``transformers`` alone, no engine), and polling.

Engine-neutral on purpose: tests/test_sglang_pair.py uses it with SGLang's environment, and
`bash dev.sh test` builds an engine's environment for a test file that imports that engine's
helpers (tools/vllm_pd.py is vLLM's), not for one that imports this.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import attrs

ROOT = Path(__file__).resolve().parent.parent
CLIENT = ROOT / "engines" / "vllm" / "client.py"


def tail(text: str, n: int = 25) -> str:
    return "\n".join(text.splitlines()[-n:])


IGNORE_EOS = {"ignore_eos": True}


@attrs.frozen
class Held:
    """A request of `Client`: its id (what `Client.cancel` names) and its answer to come."""

    id: str
    future: Future[dict[str, Any]]


class Client:
    """engines/vllm/client.py as a subprocess: completions through the ``openai`` library of the
    environment `python` runs in (vLLM's and SGLang's both carry it; the script imports nothing
    else of either engine)."""

    def __init__(self, python: Path) -> None:
        self.proc = subprocess.Popen(
            [str(python), str(CLIENT)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
        )
        self._pending: dict[str, Future[dict[str, Any]]] = {}
        self._lock = threading.Lock()
        self._ids = 0
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            answer = json.loads(line)
            with self._lock:
                future = self._pending.pop(answer["id"])
            future.set_result(answer)

    def submit(
        self,
        base_url: str,
        prompt: str | list[int],
        max_tokens: int = 16,
        *,
        headers: dict[str, str] | None = None,
        stream: bool = False,
        extra_body: dict[str, Any] | None = None,
    ) -> Future[dict[str, Any]]:
        return self._submit(
            dict(base_url=base_url, prompt=prompt, max_tokens=max_tokens, headers=headers, stream=stream),
            extra_body,
        ).future

    def hold(self, base_url: str, prompt: str, max_tokens: int) -> Held:
        """A streamed request that decodes until `cancel` (or `max_tokens`, ignoring EOS)."""
        return self._submit(dict(base_url=base_url, prompt=prompt, max_tokens=max_tokens, hold=True), IGNORE_EOS)

    def cancel(self, held: Held) -> None:
        """End a held request: the client closes its stream and vLLM aborts it."""
        self._send({"cancel": held.id})

    def _submit(self, req: dict[str, Any], extra_body: dict[str, Any] | None) -> Held:
        future: Future[dict[str, Any]] = Future()
        with self._lock:
            self._ids += 1
            rid = f"c{self._ids}"
            self._pending[rid] = future
        if extra_body:
            req["extra_body"] = extra_body
        self._send({"id": rid, **req})
        return Held(rid, future)

    def _send(self, line: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        with self._lock:
            self.proc.stdin.write(json.dumps(line) + "\n")
            self.proc.stdin.flush()

    def complete(self, base_url: str, prompt: str, max_tokens: int = 16, **kw: Any) -> dict[str, Any]:
        return self.submit(base_url, prompt, max_tokens, **kw).result(timeout=900)

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def wait_until(pred: Callable[[], bool], timeout: float, what: str, every: float = 0.2) -> float:
    """Poll ``pred`` until true; seconds waited. `TimeoutError` says what was awaited."""
    start = time.monotonic()
    while not pred():
        if time.monotonic() - start > timeout:
            raise TimeoutError(f"waited {timeout:.0f} s for {what}")
        time.sleep(every)
    return time.monotonic() - start


_REFERENCE = """
import json, sys
import torch
from transformers import AutoTokenizer, LlamaForCausalLM
model_dir, max_tokens = sys.argv[1], int(sys.argv[2])
tok = AutoTokenizer.from_pretrained(model_dir)
model = LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
def complete(ids, n):
    with torch.no_grad():
        gen = model.generate(torch.tensor([ids], dtype=torch.long), max_new_tokens=n, do_sample=False,
                             eos_token_id=None, pad_token_id=0, attention_mask=torch.ones(1, len(ids)))
    new = gen[0, len(ids):].tolist()
    return {"text": tok.decode(new, skip_special_tokens=True), "ids": new}
out = []
for item in json.loads(sys.stdin.read()):
    if isinstance(item, str):
        out.append(complete(tok(item).input_ids, max_tokens))
    else:  # a conversation: turn 1's prompt and answer length, then turn 2 as a client sends it
        ids = tok(item["prompt"]).input_ids
        first = complete(ids, item["answer_tokens"])
        then = [*ids, *first["ids"], *ids[1:1 + item["more_tokens"]]]
        out.append({"turns": [first, complete(then, max_tokens)], "turn2_ids": then})
print(json.dumps(out))
"""


@attrs.frozen
class Reference:
    """A prompt's greedy completion by ``transformers`` alone: its tokens, and their text."""

    text: str
    ids: list[int]

    def matches(self, answer: dict[str, Any]) -> bool:
        """Whether a completion (asked with ``return_token_ids``) is exactly this one. Tokens, not
        text: a byte-level tokenizer's last token may end inside a UTF-8 character, which vLLM's
        incremental detokenizer holds back and ``decode`` shows as U+FFFD."""
        return answer.get("token_ids") == self.ids


def reference_texts(prompts: list[str], max_tokens: int, *, python: Path, model: Path) -> dict[str, Reference]:
    """Each prompt's greedy completion computed by ``transformers`` alone (no engine, no KV
    transfer), EOS ignored: what any correct P/D pair must return for it. `python`: an engine
    environment's interpreter (it carries transformers); `model`: the tiny model made there."""
    found = run_reference(list(prompts), max_tokens, python=python, model=model)
    return {p: Reference(r["text"], [int(i) for i in r["ids"]]) for p, r in zip(prompts, found, strict=True)}


def run_reference(items: list[Any], max_tokens: int, *, python: Path, model: Path) -> list[dict[str, Any]]:
    """`_REFERENCE` over `items` (prompts, or conversations as `tools/vllm_pd.py` builds them)."""
    proc = subprocess.run(
        [str(python), "-c", _REFERENCE, str(model), str(max_tokens)],
        input=json.dumps(items),
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"},
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"reference run failed:\n{tail(proc.stderr)}")
    return json.loads(proc.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]
