"""How many intra-op threads onnxruntime-genai's CPU session really runs at its default.

onnxruntime documents its default intra-op pool as sized from the machine's cores, but what a given
guest gets depends on how onnxruntime reads that machine. A CPU comparison that leaves the peer at
its default must know the count it compared against. This counts the OS threads a process gains
from loading one package with onnxruntime-genai, once at the default and once per pinned count
(`session_options.intra_op_num_threads` in a copy of genai_config.json), each in a fresh process:
the pinned count whose gain equals the default's is the default.

    python -m bench.genai_threads [--package DIR] [--pin 1,2,4]

Without --package it uses the pulled default int4 package (pulled and built on first use).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path


def os_threads() -> int:
    return len(os.listdir(f"/proc/{os.getpid()}/task"))


def count_in_this_process(package: Path) -> int:
    """The OS threads loading `package` adds to this process."""
    import onnxruntime_genai as og

    before = os_threads()
    model = og.Model(str(package))
    added = os_threads() - before
    del model
    return added


def count_in_child(package: Path) -> int:
    out = subprocess.run(
        [sys.executable, "-m", "bench.genai_threads", "--child", str(package)],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return int(out.stdout.strip())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--package", type=Path, help="default: the pulled default int4 package")
    parser.add_argument("--pin", default="1,2", help="intra-op thread counts to compare with the default")
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(count_in_this_process(args.child))
        return
    if not sys.platform.startswith("linux"):
        parser.error("counts threads through /proc: Linux only")
    from bench.cpu_decode import pull, with_genai_threads

    package = args.package or pull("int4")
    print(f"package {package}; cpus {os.cpu_count()}, usable {len(os.sched_getaffinity(0))}")
    default = count_in_child(package)
    print(f"onnxruntime default: +{default} OS threads")
    with tempfile.TemporaryDirectory() as tmp:
        for threads in (int(n) for n in args.pin.split(",")):
            pinned = with_genai_threads(package, Path(tmp) / f"pin{threads}", threads)
            added = count_in_child(pinned)
            same = "  <- the default's count" if added == default else ""
            print(f"intra_op_num_threads={threads}: +{added} OS threads{same}")


if __name__ == "__main__":
    main()
