"""The header of every benchmark JSON that the CPU scripts here write (cpu_default_bench.py,
cpu_gguf_vs_llamacpp.py, wall_time_ab.py): the benchmark's name, the commit of this checkout
(with `-dirty` when tracked files differ from it), the command, the machine and the date, as
BENCHMARKS.md asks of every figure. Imported by the scripts beside it (their directory is on
`sys.path` when they run as `python3 scripts/NAME.py`).

    doc = bench_record.header("cpu_default_model", cores=2, load_average_at_start=load)
    doc.update(records=...)

Two builds timed against each other (wall_time_ab.py, moe_cpu_ab.py) alternate through
`alternate` and write their record with `write_ab`.
"""
import datetime
import json
import os
import platform
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def commit():
    """This checkout's commit (12 hex digits), `-dirty` when tracked files differ from it."""
    def git(*args):
        return subprocess.run(["git", "-C", REPO, *args], capture_output=True, text=True).stdout.strip()
    dirty = git("status", "--porcelain", "--untracked-files=no") != ""
    return git("rev-parse", "--short=12", "HEAD") + ("-dirty" if dirty else "")


def cpu_name():
    """The CPU's model name from /proc/cpuinfo, else what `platform` knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def header(benchmark, cores=None, **machine):
    """The record's common fields; `machine` adds to the machine's (load averages, ...)."""
    return {
        "benchmark": benchmark,
        "commit": commit(),
        "command": "python3 " + " ".join(sys.argv),
        "machine": {"cpu": cpu_name(), "cores": cores or os.cpu_count(), "gpu": None, **machine},
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }


def alternate(rounds, old, new, run):
    """`run(binary)` for the old and the new build, `rounds` times, the first of each pair
    swapped every round (so that a host whose speed drifts weighs on both):
    `{"old": [results], "new": [results]}`."""
    results = {"old": [], "new": []}
    for i in range(rounds):
        pairs = [("old", old), ("new", new)]
        for name, binary in pairs if i % 2 == 0 else pairs[::-1]:
            results[name].append(run(binary))
    return results


def write_ab(out, benchmark, load_at_start, fields):
    """An A/B's record at `out`: the header (with the load averages at its start and now) and
    `fields`."""
    with open(out, "w") as f:
        doc = header(benchmark, load_average_at_start=load_at_start,
                     load_average_at_end=os.getloadavg())
        json.dump({**doc, **fields}, f, indent=1)
