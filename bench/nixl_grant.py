"""What a NIXL grant costs per transfer: a READ under a per-transfer grant against a READ of
an arena registered once (the layout before grants), on two NIXL (UCX) agents of this
process over loopback.

Grant, per transfer (what the source kv-agent and the puller do for one ``PullPages``
window): register the transfer's slots, take the NIXL metadata of those registrations
alone, load it at the puller, READ, deregister. Reference, in the same run: the arena
registered once and its metadata loaded once, then only the READ. The gRPC side of the
grant is the ``LocatePages`` the pull made anyway (and one ``GetTransport`` fewer per pull).
Run: ``python bench/nixl_grant.py [--pages 16] [--page-kib 2048] [--reps 200]``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time

import numpy as np

from omniflow_services.kv_agent.nixl_channel import NixlChannel, nixl_unavailable_reason


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def run(args: argparse.Namespace) -> None:
    page = args.page_kib * 1024
    slots = args.pages * 4  # the transfer's pages are spread over a larger arena
    src_arena = np.random.default_rng(0).integers(0, 256, slots * page, dtype=np.uint8)
    dst_arena = np.zeros(args.pages * page, dtype=np.uint8)
    tag = os.urandom(3).hex()
    src, dst = NixlChannel(f"src-{tag}", "lo"), NixlChannel(f"dst-{tag}", "lo")
    try:
        await dst.register(dst_arena.ctypes.data, dst_arena.nbytes)
        local = [dst_arena.ctypes.data + i * page for i in range(args.pages)]
        picks = np.random.default_rng(1)

        def remote_addrs() -> list[int]:
            chosen = picks.choice(slots, args.pages, replace=False)
            return [src_arena.ctypes.data + int(s) * page for s in chosen]

        # Reference: the whole arena registered once, its metadata loaded once.
        standing, metadata = await src.grant([src_arena.ctypes.data], src_arena.nbytes)
        name = await dst.ensure_remote(metadata)
        await dst.read(name, local, remote_addrs(), page, 10.0)  # connects: not timed
        plain: list[float] = []
        for _ in range(args.reps):
            addrs = remote_addrs()
            t = time.perf_counter()
            await dst.read(name, local, addrs, page, 10.0)
            plain.append(time.perf_counter() - t)
        await src.revoke(standing)
        granted: list[float] = []
        grant_only: list[float] = []
        for _ in range(args.reps):
            addrs = remote_addrs()
            t = time.perf_counter()
            registration, md = await src.grant(addrs, page)
            name = await dst.ensure_remote(md)
            t_read = time.perf_counter()
            await dst.read(name, local, addrs, page, 10.0)
            t_done = time.perf_counter()
            await src.revoke(registration)
            end = time.perf_counter()
            granted.append(end - t)
            grant_only.append((t_read - t) + (end - t_done))
    finally:
        await asyncio.to_thread(src.close)
        await asyncio.to_thread(dst.close)
    load = os.getloadavg()[0]
    mib = args.pages * page / 2**20
    print(f"{args.pages} pages of {args.page_kib} KiB ({mib:.1f} MiB) per transfer, "
          f"{args.reps} transfers each, load average {load:.1f}")  # fmt: skip
    print("| per transfer | p50 (ms) | p99 (ms) |")
    print("|---|---|---|")
    for label, xs in (
        ("READ, arena registered once (reference)", plain),
        ("grant + READ + revoke (ours)", granted),
        ("of which the grant (register, metadata, load, deregister)", grant_only),
    ):
        print(f"| {label} | {_pct(xs, 0.5) * 1e3:.3f} | {_pct(xs, 0.99) * 1e3:.3f} |")
    ratio = statistics.median(granted) / statistics.median(plain)
    print(f"ratio ours / reference at p50: {ratio:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--pages", type=int, default=16)
    ap.add_argument("--page-kib", type=int, default=2048, help="2 MiB: a Llama-8B page")
    ap.add_argument("--reps", type=int, default=200)
    args = ap.parse_args()
    reason = nixl_unavailable_reason()
    if reason:
        print(f"NIXL not measured: {reason}")
        return
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
