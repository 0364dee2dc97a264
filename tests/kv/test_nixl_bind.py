"""The kv-agent's NIXL (UCX) channel listens only where the node's setting says.

UCX opens a TCP listener on every interface by default; the agent passes the devices of
its bind address (OMNIFLOW_HOST, or OMNIFLOW_KV_NIXL_DEVICES) as UCX_NET_DEVICES. Checked
on the process's own listening sockets as the kernel lists them (/proc/net/tcp*)."""

from __future__ import annotations

import ipaddress
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from omniflow.errors import InvalidArgument
from omniflow_services.kv_agent.nixl_channel import (
    NixlChannel,
    nixl_unavailable_reason,
    ucx_devices,
)


def _listening() -> set[str]:
    """The addresses this process listens on over TCP (IPv4 and IPv6)."""
    inodes = set()
    for fd in Path("/proc/self/fd").iterdir():
        try:
            link = os.readlink(fd)
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    out = set()
    for table, v6 in (("/proc/self/net/tcp", False), ("/proc/self/net/tcp6", True)):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if f[3] != "0A" or f[9] not in inodes:  # 0A: LISTEN
                continue
            raw = bytes.fromhex(f[1].split(":")[0])
            if v6:
                words = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
                out.add(str(ipaddress.IPv6Address(words)))
            else:
                out.add(str(ipaddress.IPv4Address(raw[::-1])))
    return out


def _external_ipv4() -> str | None:
    for _, name in socket.if_nameindex():
        from omniflow_services.kv_agent.nixl_channel import _ipv4_of

        addr = _ipv4_of(name)
        if addr and not addr.startswith("127."):
            return addr
    return None


def test_devices_follow_the_bind_address() -> None:
    assert ucx_devices("", "127.0.0.1") == "lo"
    assert ucx_devices("", "0.0.0.0") is None
    assert ucx_devices("all", "127.0.0.1") is None
    assert ucx_devices("eth9,mlx5_0:1", "127.0.0.1") == "eth9,mlx5_0:1"
    with pytest.raises(InvalidArgument, match="OMNIFLOW_KV_NIXL_DEVICES"):
        ucx_devices("", "198.18.255.254")  # held by no interface here


def _fresh_agent_listeners(devices: str | None) -> set[str]:
    """The TCP addresses a NIXL agent opens, in a process of its own: UCX opens its
    listener once per process, so an agent made earlier in this test session (other kv
    tests) would hide it from a before/after comparison here."""
    out = subprocess.run(
        [sys.executable, __file__, json.dumps(devices)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


@pytest.mark.skipif(nixl_unavailable_reason() is not None, reason=str(nixl_unavailable_reason()))
def test_ucx_listens_on_loopback_only() -> None:
    opened = _fresh_agent_listeners(ucx_devices("", "127.0.0.1"))
    assert opened, "the NIXL agent opened no TCP listener (nothing to check)"
    assert all(ipaddress.ip_address(a).is_loopback for a in opened), opened


@pytest.mark.skipif(nixl_unavailable_reason() is not None, reason=str(nixl_unavailable_reason()))
def test_ucx_default_listens_on_other_interfaces_too() -> None:
    """The control: without the setting UCX reaches past the loopback (what issue 20 saw)."""
    external = _external_ipv4()
    if external is None:
        pytest.skip("this machine has no non-loopback IPv4 interface")
    assert external in _fresh_agent_listeners(None)


if __name__ == "__main__":  # the agent of _fresh_agent_listeners
    before = _listening()
    buf = np.zeros(1 << 16, np.uint8)
    channel = NixlChannel("bind-test", json.loads(sys.argv[1]))
    channel.register_blocking(buf.ctypes.data, buf.nbytes)
    print(json.dumps(sorted(_listening() - before)), flush=True)
    channel.close()
    os._exit(0)  # NIXL's own teardown at interpreter exit can crash on some machines
