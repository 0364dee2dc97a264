"""The kv-agent's NIXL (UCX) channel listens only where the node's setting says.

UCX opens a TCP listener on every interface by default; the agent passes the devices of
its bind address (OMNIFLOW_HOST, or OMNIFLOW_KV_NIXL_DEVICES) as UCX_NET_DEVICES. Checked
on the process's own listening sockets as the kernel lists them (/proc/net/tcp*)."""

from __future__ import annotations

import ipaddress
import os
import socket
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


@pytest.mark.skipif(nixl_unavailable_reason() is not None, reason=str(nixl_unavailable_reason()))
def test_ucx_listens_on_loopback_only() -> None:
    before = _listening()
    buf = np.zeros(1 << 16, np.uint8)
    channel = NixlChannel("bind-test", ucx_devices("", "127.0.0.1"))
    try:
        channel.register_blocking(buf.ctypes.data, buf.nbytes)
        opened = _listening() - before
        assert opened, "the NIXL agent opened no TCP listener (nothing to check)"
        assert all(ipaddress.ip_address(a).is_loopback for a in opened), opened
        assert "UCX_NET_DEVICES" not in os.environ or os.environ["UCX_NET_DEVICES"] != "lo"
    finally:
        channel.close()


@pytest.mark.skipif(nixl_unavailable_reason() is not None, reason=str(nixl_unavailable_reason()))
def test_ucx_default_listens_on_other_interfaces_too() -> None:
    """The control: without the setting UCX reaches past the loopback (what issue 20 saw)."""
    external = _external_ipv4()
    if external is None:
        pytest.skip("this machine has no non-loopback IPv4 interface")
    buf = np.zeros(1 << 16, np.uint8)
    channel = NixlChannel("bind-default", None)
    try:
        channel.register_blocking(buf.ctypes.data, buf.nbytes)
        assert external in _listening()
    finally:
        channel.close()
