#!/usr/bin/env python3
"""The disk's read rate by request shape: O_DIRECT reads of the given files with T threads of
B MiB requests each (the shapes of the disk tier's `ReadShape`), next to one thread of 64 MiB
(what `dd bs=64M iflag=direct` does). Each shape reads a different stretch of the files, so
that no shape finds what another read in a cache below the file system.

Usage: python3 scripts/disk_probe.py OUT.json GB_PER_SHAPE FILE... (shapes from $SHAPES,
default "1x64 4x8 8x8 4x32 8x16 16x8"). Prints one line per shape.
"""
import json
import mmap
import os
import sys
import threading
import time

out_path, gb = sys.argv[1], float(sys.argv[2])
files = [(f, os.path.getsize(f)) for f in sys.argv[3:]]
shapes = [tuple(int(v) for v in s.split("x")) for s in os.environ.get("SHAPES", "1x64 4x8 8x8 4x32 8x16 16x8").split()]
total = sum(n for _, n in files)
per_shape = int(gb * 1e9)
cursor = 0  # where the next shape starts, in the files' concatenation


def pieces(start, length, piece):
    """(file, offset, length) requests covering [start, start+length) of the concatenation."""
    out, pos, end = [], start, start + length
    for path, n in files:
        lo, hi = (max(pos, 0) + 4095) // 4096 * 4096, min(end, n)  # O_DIRECT: aligned offsets
        off = lo
        while off < hi:
            take = min(piece, hi - off)
            take -= take % 4096
            if take == 0:
                break
            out.append((path, off, take))
            off += take
        pos -= n
        end -= n
        if end <= 0:
            break
    return out


results = []
for threads, mib in shapes:
    piece = mib << 20
    start = cursor % max(total - per_shape, 1) // 4096 * 4096
    cursor += per_shape
    reqs = pieces(start, per_shape, piece)
    fds = {p: os.open(p, os.O_RDONLY | os.O_DIRECT) for p in {r[0] for r in reqs}}
    lock, done = threading.Lock(), [0]

    def work():
        buf = mmap.mmap(-1, piece)  # page-aligned, as O_DIRECT wants
        while True:
            with lock:
                if not reqs:
                    return
                path, off, n = reqs.pop(0)
            got = os.preadv(fds[path], [memoryview(buf)[:n]], off)
            with lock:
                done[0] += got

    t0 = time.perf_counter()
    ts = [threading.Thread(target=work) for _ in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    dt = time.perf_counter() - t0
    for fd in fds.values():
        os.close(fd)
    r = dict(threads=threads, piece_mib=mib, bytes=done[0], seconds=dt, gbps=done[0] / dt / 1e9)
    print(json.dumps(r), flush=True)
    results.append(r)
json.dump(dict(benchmark="disk_probe", command=" ".join(sys.argv), shapes=os.environ.get("SHAPES"),
               machine=os.uname().nodename, date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
               commit=os.environ.get("COMMIT"), files=[f for f, _ in files], results=results),
          open(out_path, "w"), indent=1)
