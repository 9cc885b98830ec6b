"""The vector of stock vLLM compatibility: a decoder that speaks vLLM's own notifications.

    vllm_compat

Spec rules (spec/PROTOCOL.md): `HB:` + request ids renews by request id, `<request id>:<count>`
frees after `count` read-done notifications, and a lease bound to a kvlease accessor is never
renewed by an `HB:` (§4.4). Bound by tools/mutation_check.py (`vllm_heartbeat_renews_bound_lease`).
"""

from __future__ import annotations

from kvlease import encode_vllm_done, encode_vllm_heartbeat

from ._common import BASE, Recorder, only, pinner

__all__ = ["vllm_compat"]


def vllm_compat() -> Recorder:
    cfg = BASE.with_changes(vllm_compat=True)
    r = Recorder(
        "vllm_compat",
        "A stock vLLM decoder speaks 'HB:' + ','.join(request ids) and "
        "'<request id>:<count>'. The pinner renews by request id, ignores unknown ids, "
        "and frees after `count` read-done notifications. A lease bound to a kvlease accessor (here "
        "at grant) is never renewed by an `HB:`.",
        cfg,
        {"P": pinner("prefill-0", 0x5EED000D)},
        {"P": 12.0},
    )
    r.at(0.0).step("P", "grant", key="req-1")
    r.at(0.0).step("P", "grant", key="req-2")
    r.at(0.0).step("P", "grant", key="req-3")
    hb = encode_vllm_heartbeat(["req-1", "req-2", "cmpl-unknown"]).hex()
    res = r.at(3.0).step("P", "receive_vllm", hex=hb)["result"]
    assert res == {"renewed": 2}
    r.at(3.0).step("P", "grant", key="req-4", accessor="decode-0", note="bound to a kvlease accessor at grant")
    bound = encode_vllm_heartbeat(["req-4"]).hex()
    res = r.at(3.5).step("P", "receive_vllm", hex=bound, note="stock vLLM cannot renew it")["result"]
    assert res == {"renewed": 0}
    free3 = only(r.at(6.0).step("P", "handle_timeout", note="req-3 was never renewed"), "Free")
    assert free3["key"] == "req-3"
    assert only(r.at(6.5).step("P", "receive_vllm", hex=encode_vllm_done("req-1", 1).hex()), "Free")["key"] == "req-1"
    two = encode_vllm_done("req-2", 2).hex()
    assert r.at(6.75).step("P", "receive_vllm", hex=two, note="first of two readers")["outputs"] == []
    assert only(r.at(6.8).step("P", "receive_vllm", hex=two), "Free")["key"] == "req-2"
    assert r.at(7.0).step("P", "receive_vllm", hex=two, note="late: no second free")["outputs"] == []
    free4 = only(r.at(9.0).step("P", "handle_timeout", note="req-4: grant + duration"), "Free")
    assert free4["key"] == "req-4" and free4["reason"] == "expired"
    return r
