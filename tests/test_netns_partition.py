"""Two "hosts" in network namespaces joined by a veth pair; a real partition by link down.

The namespaces, the veth pair and the private addresses (10.231.0.1/24 for the pinner host,
10.231.0.2/24 for the accessor host) are created for this test only and deleted afterwards,
even on failure; no traffic leaves them. Skipped, with the reason, where the kernel or the
privileges refuse namespaces.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Iterator

import pytest

pytest.importorskip("zmq")

from _proc_helpers import TEST_LEASE, spawn_pair

from kvlease import LeaseConfig

CFG = LeaseConfig(**TEST_LEASE)
SLACK = 0.75
P_ADDR, D_ADDR = "10.231.0.1", "10.231.0.2"

pytestmark = pytest.mark.slow


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=20)


@pytest.fixture
def two_hosts() -> Iterator[tuple[str, str, str]]:
    if shutil.which("ip") is None:
        pytest.skip("iproute2 (`ip`) is not installed")
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root (CAP_NET_ADMIN)")
    tag = str(os.getpid())[-6:]
    ns_p, ns_d = f"kvl-p{tag}", f"kvl-d{tag}"
    veth_p, veth_d = f"kvlp{tag}", f"kvld{tag}"
    created: list[str] = []
    try:
        for ns in (ns_p, ns_d):
            _ip("netns", "add", ns)
            created.append(ns)
        _ip("link", "add", veth_p, "type", "veth", "peer", "name", veth_d)
        _ip("link", "set", veth_p, "netns", ns_p)
        _ip("link", "set", veth_d, "netns", ns_d)
        for ns, dev, addr in ((ns_p, veth_p, P_ADDR), (ns_d, veth_d, D_ADDR)):
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
    except (subprocess.CalledProcessError, OSError) as exc:
        for ns in created:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=20)
        err = getattr(exc, "stderr", "") or str(exc)
        pytest.skip(f"the kernel refused network namespaces / veth: {err.strip()}")
    try:
        yield ns_p, ns_d, veth_p
    finally:
        for ns in created:  # deleting a namespace destroys its end of the veth pair
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=20)


def test_partition_expires_and_frees_then_heal_serves_new_requests(two_hosts: tuple[str, str, str]) -> None:
    ns_p, ns_d, veth_p = two_hosts
    p, d = spawn_pair(pinner_bind=f"tcp://{P_ADDR}:0", accessor_bind=f"tcp://{D_ADDR}:0", netns=(ns_p, ns_d))
    try:
        assert p.address.startswith(f"tcp://{P_ADDR}:")
        g = p.request("grant", "ticket", key="part", size=4096, fill=0x21)
        d.request("track", "tracked", key="part", ticket=g["ticket"], address=g["address"])
        p.wait_for(lambda e: e["ev"] == "hb" and e["count"] >= 3, 10)

        _ip("-n", ns_p, "link", "set", veth_p, "down")  # the partition
        cut = time.monotonic()
        free = p.wait_for(lambda e: e["ev"] == "Free" and e["key"] == "part", 15)
        lost = d.wait_for(lambda e: e["ev"] == "LeaseLost" and e["key"] == "part", 15)
        last_hb = max(e["t"] for e in p.find(lambda e: e["ev"] == "hb"))
        bound = CFG.lease_extension + CFG.heartbeat_interval + SLACK
        print(
            f"\npartition: pinner freed {free['t'] - last_hb:.3f} s after the last heartbeat (bound "
            f"{bound:.3f} s); accessor reported lost {lost['t'] - cut:.3f} s after the cut ({lost['reason']})"
        )
        assert free["reason"] == "expired"
        assert free["t"] - last_hb <= bound
        assert lost["t"] - cut <= CFG.kv_lease_duration + SLACK
        assert not d.find(lambda e: e["ev"] == "AccessCompleted")

        _ip("-n", ns_p, "link", "set", veth_p, "up")  # heal
        g2 = p.request("grant", "ticket", key="after", size=4096, fill=0x42)
        d.request("track", "tracked", key="after", ticket=g2["ticket"], address=g2["address"])
        deadline = time.monotonic() + 20
        while True:
            r = d.request("read", "access", key="after", size=4096)
            if r["allowed"] or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert r["allowed"], r
        done = d.wait_for(
            lambda e: (
                e["ev"] in ("AccessCompleted", "AccessStale", "TransferFailed", "LeaseLost") and e["key"] == "after"
            ),
            20,
        )
        assert done["ev"] == "AccessCompleted", done
        assert done["values"] == [0x42]
        print(f"heal: new request served {done['t'] - cut:.3f} s after the cut")
    finally:
        p.close()
        d.close()
