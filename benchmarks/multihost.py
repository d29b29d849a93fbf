"""The allreduce table across hosts made of network namespaces (a veth link each way
through a bridge), keras_ring next to MPICH's MPI_Allreduce over the same link, one run; or,
with --bench agreement, what opening a collective costs across them (benchmarks/agreement.py:
the fast agreement against the full slot exchange, and MPI_Barrier).

Run as root: python benchmarks/multihost.py [--min-bytes N] [--max-bytes N] [--ranks-per-host K]
             [--hosts H] [--bench allreduce|agreement]

MPICH's UCX would otherwise see that both "hosts" share this machine (it identifies hosts by
machine, not by network stack) and move data through shared memory; UCX_TLS=tcp,self makes it
use the network as keras_ring must. With one rank per host every byte crosses the link; with
two, each ring also has a shared-memory hop.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.multihost.netns import NS_EXEC, Cluster  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--min-bytes", type=int, default=4096)
    parser.add_argument("--max-bytes", type=int, default=64 << 20)
    parser.add_argument("--ranks-per-host", type=int, default=1)
    parser.add_argument("--hosts", type=int, default=2)
    parser.add_argument("--bench", choices=["allreduce", "agreement"], default="allreduce")
    args = parser.parse_args()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KERAS_RING_")}
    env.update(TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=str(ROOT), UCX_TLS="tcp,self",
               UCX_NET_DEVICES="eth0")
    ppn = args.ranks_per_host
    hosts = [f"h{i}" for i in range(args.hosts)]
    script = [str(ROOT / "benchmarks" / f"{args.bench}.py")]
    if args.bench == "allreduce":
        script += ["--min-bytes", str(args.min_bytes), "--max-bytes", str(args.max_bytes)]
    with Cluster(hosts) as cluster:
        argv = [str(Path(sys.executable).parent / "mpirun"), "-launcher", "ssh",
                "-launcher-exec", str(NS_EXEC), "-hosts", ",".join(hosts),
                "-np", str(len(hosts) * ppn), "-ppn", str(ppn), sys.executable, *script]
        print(f"# {len(hosts)} hosts (network namespaces, veth + bridge) x {ppn} rank(s)",
              flush=True)
        return subprocess.run(cluster.command("h0", argv), env=cluster.env(env), cwd=ROOT,
                              timeout=1800).returncode


if __name__ == "__main__":
    sys.exit(main())
