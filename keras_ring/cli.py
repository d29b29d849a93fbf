"""``keras-ring-run``: a job through mpirun (``keras_ring.launcher``), or an elastic job
(``keras_ring.elastic.driver``) when ``--min-np``/``--max-np``/``--host-discovery-script``
are given."""

from __future__ import annotations

import os
import sys

from keras_ring import launcher
from keras_ring.elastic.driver import ElasticDriver, ElasticOptions


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``keras-ring-run``; returns the job's exit code."""
    argv = sys.argv[1:] if argv is None else argv
    args = launcher.parse_args(argv)
    if not args.elastic:
        return launcher.run(args)
    # Workers inherit the driver's environment (remote ones get its KERAS_RING_* variables).
    os.environ.update(args.horovodrun.env)
    options = ElasticOptions(
        np=args.np, min_np=args.min_np, max_np=args.max_np,
        discovery_script=args.host_discovery_script, command=args.command,
        discovery_interval=args.discovery_interval, blacklist_after=args.blacklist_after,
        remote_shell=args.remote_shell, rendezvous_address=args.rendezvous_address)
    return ElasticDriver(options).run()


if __name__ == "__main__":
    sys.exit(main())
