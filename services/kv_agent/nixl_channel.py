"""The NIXL (UCX) channel between agents: the puller READs remote arena slots in place.

Each agent with ``nixl`` installed runs one NIXL agent. It registers no arena up front: a
puller learns the source's arena layout (``GetArena``) over gRPC and asks for a grant
(``LocatePages`` with ``nixl_grant``, mutual TLS, kv-agents only): the source pins the
pages, registers exactly their slots with NIXL and answers the NIXL metadata of those
registrations alone; the puller READs them straight into slots it reserved in its own
arena, and ``Unpin`` (or the pin lapsing) deregisters them (``grants``). The page checksums
then decide what is kept. Every NIXL call runs on one thread of its own (the library is
not async).

UCX progress is event-driven: NIXL's progress thread sleeps in ``poll()`` on the UCX
workers' event fds and wakes when there is work (or every ``PROGRESS_WAKEUP_US`` as a
safety net). The nixl Python wrapper hard-codes the poll timeout to 0, which makes that
thread spin a whole core at idle; ``_agent_with_wakeup`` builds the agent with a timeout.
A puller's own transfers also progress while it polls their state.

UCX listens on every interface by default (its TCP transport on each address). The agent
limits it to the devices the node's setting names (``OMNIFLOW_KV_NIXL_DEVICES``, as
``UCX_NET_DEVICES``), by default the interface that holds the agent's bind address
(``OMNIFLOW_HOST``; ``lo`` on 127.0.0.1): the data plane is reachable only where the gRPC
server is. UCX itself authenticates no peer; what a puller needs to READ (the NIXL
metadata, the arena address, pinned slots) is handed out only over the agents' mutual-TLS
gRPC calls to another agent, as a grant per transfer (docs/security.md).
"""

from __future__ import annotations

import asyncio
import fcntl
import ipaddress
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from omniflow.errors import DeadlineExceeded, InvalidArgument, Unavailable

log = logging.getLogger(__name__)

# The progress thread's poll() timeout when no event arrives (NIXL's listener uses 100 ms).
PROGRESS_WAKEUP_US = 100_000
_CONFIG_LOCK = threading.Lock()


def nixl_unavailable_reason() -> str | None:
    """None when ``nixl`` imports, else why not (for skips, logs and GetTransport)."""
    try:
        from nixl._api import nixl_agent  # noqa: F401
    except Exception as exc:  # ImportError, or a missing native library
        return f"nixl is not usable: {exc}"
    return None


_SIOCGIFADDR = 0x8915
_ANY = ("", "0.0.0.0", "::", "[::]")


def _ipv4_of(ifname: str) -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            raw = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", ifname.encode()[:15]))
        except OSError:  # no IPv4 address on it
            return None
    return socket.inet_ntoa(raw[20:24])


def _ipv6_of() -> dict[str, str]:
    out: dict[str, str] = {}
    try:
        lines = Path("/proc/net/if_inet6").read_text().split("\n")
    except OSError:
        return out
    for line in lines:
        f = line.split()
        if len(f) == 6:
            out[str(ipaddress.IPv6Address(bytes.fromhex(f[0])))] = f[5]
    return out


def ucx_devices(setting: str, bind_host: str) -> str | None:
    """``UCX_NET_DEVICES`` for the agent: ``setting`` when given (``all``: None, UCX's
    default of every device), else the interface holding ``bind_host`` (None when it binds
    every address). InvalidArgument when no interface holds it."""
    if setting == "all":
        return None
    if setting:
        return setting
    if bind_host in _ANY:
        return None
    try:
        addr = ipaddress.ip_address(bind_host.strip("[]"))
    except ValueError:
        addr = ipaddress.ip_address(socket.gethostbyname(bind_host))
    if addr.version == 6:
        found = _ipv6_of().get(str(addr))
    else:
        found = next((n for _, n in socket.if_nameindex() if _ipv4_of(n) == str(addr)), None)
    if found is None:
        raise InvalidArgument(
            f"no network interface holds {bind_host} (OMNIFLOW_HOST); set "
            "OMNIFLOW_KV_NIXL_DEVICES to the devices NIXL may use, or 'all'"
        )
    return found


def _agent_with_wakeup(name: str, delay_us: int = PROGRESS_WAKEUP_US) -> Any:
    """A UCX ``nixl_agent`` whose progress thread waits on events instead of spinning.

    ``nixl_agent.__init__`` sets ``pthrDelay = 0`` on the binding's config object; for the
    duration of the construction the binding's config class is replaced by a subclass that
    stores ``delay_us`` instead. Falls back to the stock agent if the binding changed shape.
    """
    import nixl._api as api
    from nixl._api import nixl_agent, nixl_agent_config

    conf = nixl_agent_config(backends=["UCX"])
    base = api.nixlBind.nixlAgentConfig
    prop = base.__dict__.get("pthrDelay")
    if not hasattr(prop, "__set__"):
        log.warning("nixl: cannot set the progress thread's poll timeout; it may spin")
        return nixl_agent(name, conf)

    def _set(cfg: Any, _value: int) -> None:
        prop.__set__(cfg, delay_us)

    patched = type("AgentConfigWithWakeup", (base,), {"pthrDelay": property(prop.__get__, _set)})
    with _CONFIG_LOCK:
        api.nixlBind.nixlAgentConfig = patched
        try:
            return nixl_agent(name, conf)
        finally:
            api.nixlBind.nixlAgentConfig = base


class NixlChannel:
    """One NIXL agent (UCX backend) for this process."""

    def __init__(self, name: str, devices: str | None = None) -> None:
        """``devices``: UCX_NET_DEVICES for this agent (None: UCX's default, every one)."""
        self.name = name
        self.devices = devices
        self._exec = ThreadPoolExecutor(1, thread_name_prefix="nixl")
        with _CONFIG_LOCK:
            # UCX reads its configuration from the environment when the agent is made.
            before = os.environ.get("UCX_NET_DEVICES")
            if devices is None:
                os.environ.pop("UCX_NET_DEVICES", None)
            else:
                os.environ["UCX_NET_DEVICES"] = devices
        try:
            self._agent: Any = _agent_with_wakeup(name)
        finally:
            with _CONFIG_LOCK:
                if before is None:
                    os.environ.pop("UCX_NET_DEVICES", None)
                else:
                    os.environ["UCX_NET_DEVICES"] = before
        log.info("nixl %s: UCX devices %s", name, devices or "all")
        self._registered: list[Any] = []

    async def _call(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._exec, fn, *args)

    def register_sync(self, address: int, nbytes: int) -> None:
        """Register a DRAM region (an arena mapping) with the UCX backend."""
        descs = self._agent.register_memory([(address, nbytes, 0, "")], "DRAM")
        self._registered.append(descs)
        log.info("nixl %s: registered %d bytes at %#x", self.name, nbytes, address)

    async def register(self, address: int, nbytes: int) -> None:
        """``register_sync`` from the event loop."""
        await self._call(self.register_sync, address, nbytes)

    def register_blocking(self, address: int, nbytes: int) -> None:
        """``register_sync`` from synchronous code (any thread but the NIXL one)."""
        self._exec.submit(self.register_sync, address, nbytes).result(timeout=30)

    def _grant(self, addresses: Sequence[int], nbytes: int) -> tuple[Any, bytes]:
        descs = self._agent.register_memory([(a, nbytes, 0, "") for a in addresses], "DRAM")
        try:
            # Connection info and these registrations only: nothing else of this agent.
            metadata = bytes(self._agent.get_partial_agent_metadata(descs, True))
        except BaseException:
            self._agent.deregister_memory(descs)
            raise
        return descs, metadata

    async def grant(self, addresses: Sequence[int], nbytes: int) -> tuple[Any, bytes]:
        """Register ``nbytes`` at each address for one transfer; returns the registration
        (for ``revoke``) and the NIXL metadata that covers these regions alone."""
        return await self._call(self._grant, list(addresses), nbytes)

    async def revoke(self, registration: Any) -> None:
        """Deregister a grant's regions (NIXL refuses transfers that name them from now)."""
        await self._call(self._agent.deregister_memory, registration)

    async def metadata(self) -> bytes:
        """This agent's metadata, including every region registered so far."""
        return bytes(await self._call(self._agent.get_agent_metadata))

    def _ensure_remote(self, metadata: bytes) -> str:
        # A grant's metadata for an agent already loaded adds its regions (~10 us); the
        # connection is made once, with the first (~0.1 s).
        name = self._agent.add_remote_agent(metadata)
        return name.decode() if isinstance(name, bytes) else str(name)

    async def ensure_remote(self, metadata: bytes) -> str:
        """Load a remote agent's metadata (a grant's regions); returns its name."""
        return await self._call(self._ensure_remote, metadata)

    async def read(
        self,
        remote: str,
        local: Sequence[int],
        remote_addrs: Sequence[int],
        nbytes: int,
        timeout_s: float,
    ) -> None:
        """READ ``nbytes`` at each remote address into the local address at the same index."""
        if not local:
            return
        a = self._agent

        def _read() -> None:  # on the NIXL thread
            ldescs = a.get_xfer_descs([(addr, nbytes, 0) for addr in local], "DRAM")
            rdescs = a.get_xfer_descs([(addr, nbytes, 0) for addr in remote_addrs], "DRAM")
            handle = a.initialize_xfer("READ", ldescs, rdescs, remote)
            try:
                state = a.transfer(handle)
                end = time.monotonic() + timeout_s
                while state == "PROC":
                    if time.monotonic() > end:
                        raise DeadlineExceeded(f"nixl read from {remote} not done in {timeout_s}s")
                    time.sleep(0.0001)
                    state = a.check_xfer_state(handle)
                if state != "DONE":
                    raise Unavailable(f"nixl read from {remote} failed ({state})")
            finally:
                a.release_xfer_handle(handle)

        await self._call(_read)

    def close(self) -> None:
        def _close() -> None:
            for descs in self._registered:
                try:
                    self._agent.deregister_memory(descs)
                except Exception as exc:  # shutting down anyway
                    log.debug("nixl deregister failed: %s", exc)
            self._registered.clear()

        self._exec.submit(_close).result(timeout=10)
        self._exec.shutdown(wait=True)
