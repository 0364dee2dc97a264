"""SSD tier page I/O against sequential file I/O of the same size, same directory, same
run. Ours: 256 MiB of pages written through ``SsdTier.write`` (positioned page write +
its record) and read back through ``SsdTier.read_into``, page by page (one positioned
read per page into a preallocated buffer and an xxh3_64 verification). Reference: a
sequential write and read of a plain file of the same size in 8 MiB chunks. Both writes
end with fsync, and both files are dropped from the page cache (POSIX_FADV_DONTNEED)
before reading, so reads hit the device.
Run: ``python bench/kv_ssd.py [--dir DIR]`` (DIR on the SSD to measure).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from omniflow.kv.checksum import page_checksum
from omniflow_services.kv_agent.ssd_tier import SsdFile, SsdTier

CHUNK = 8 * 2**20


def drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def ours(directory: Path, page_bytes: int, pages: int, data: np.ndarray) -> tuple[float, float]:
    path = directory / "pages.bin"
    path.unlink(missing_ok=True)
    tier = SsdTier(SsdFile.open(path, page_bytes, pages))
    sums = [page_checksum(data[i * page_bytes : (i + 1) * page_bytes]) for i in range(pages)]
    t = time.perf_counter()
    for i in range(pages):
        key = bytes(16) + i.to_bytes(16, "big")
        tier.write(key, data[i * page_bytes : (i + 1) * page_bytes], sums[i])
    tier.file.sync()
    w = time.perf_counter() - t
    drop_cache(path)
    out = np.empty(page_bytes * pages, np.uint8)
    out[:] = 0
    t = time.perf_counter()
    for i in range(pages):
        tier.read_into(
            bytes(16) + i.to_bytes(16, "big"), out[i * page_bytes : (i + 1) * page_bytes]
        )
    r = time.perf_counter() - t
    assert np.array_equal(out, data)
    tier.file.close()
    path.unlink()
    return w, r


def reference(directory: Path, data: np.ndarray) -> tuple[float, float]:
    path = directory / "plain.bin"
    mv = memoryview(data)
    t = time.perf_counter()
    fd = os.open(path, os.O_CREAT | os.O_TRUNC | os.O_WRONLY, 0o600)
    for off in range(0, len(mv), CHUNK):
        os.write(fd, mv[off : off + CHUNK])
    os.fsync(fd)
    os.close(fd)
    w = time.perf_counter() - t
    drop_cache(path)
    out = bytearray(len(mv))
    out[:] = b"\x00" * len(mv)
    omv = memoryview(out)
    t = time.perf_counter()
    fd = os.open(path, os.O_RDONLY)
    for off in range(0, len(omv), CHUNK):
        os.readv(fd, [omv[off : off + CHUNK]])
    os.close(fd)
    r = time.perf_counter() - t
    path.unlink()
    return w, r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dir", type=Path, default=None, help="directory on the SSD (default: tmp)")
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--page-kib", type=int, default=512)
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    page_bytes = a.page_kib * 1024
    pages = a.mib * 2**20 // page_bytes
    data = np.random.default_rng(0).integers(0, 256, pages * page_bytes, dtype=np.uint8)
    with tempfile.TemporaryDirectory(dir=a.dir) as tmp:
        d = Path(tmp)
        runs = [(ours(d, page_bytes, pages, data), reference(d, data)) for _ in range(a.reps)]
    size = data.nbytes / 1e9
    ow = size / statistics.median(r[0][0] for r in runs)
    orr = size / statistics.median(r[0][1] for r in runs)
    rw = size / statistics.median(r[1][0] for r in runs)
    rr = size / statistics.median(r[1][1] for r in runs)
    print(
        f"ssd tier: {pages} pages of {a.page_kib} KiB = {a.mib} MiB in {a.dir or 'tmp'}, "
        f"median of {a.reps}"
    )
    print(f"{'metric':<22}{'omniflow':>10}{'reference':>11}{'ratio':>8}   reference")
    print(f"{'write GB/s (+fsync)':<22}{ow:>10.2f}{rw:>11.2f}{ow / rw:>8.2f}   sequential write")
    print(f"{'read GB/s (verified)':<22}{orr:>10.2f}{rr:>11.2f}{orr / rr:>8.2f}   sequential read")


if __name__ == "__main__":
    main()
