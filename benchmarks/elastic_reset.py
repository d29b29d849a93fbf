"""How long an elastic reset takes: from a worker's death to the first training step of the
smaller world, as each survivor sees it (tests/elastic/train_worker.py under keras-ring-run,
3 workers: two on this host sharing memory, one on a named host over TCP, which dies by
SIGKILL mid-epoch). Prints one line per repetition and the range.

    python benchmarks/elastic_reset.py --repeat 3
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "elastic" / "train_worker.py"
FAKE_SSH = ROOT / "tests" / "elastic" / "fake_ssh"


def one_reset(tmp: Path) -> float:
    hosts = tmp / "hosts"
    hosts.write_text("localhost:2\nhostC:1\n")
    discover = tmp / "discover.sh"
    discover.write_text(f"#!/bin/sh\ncat {hosts}\n")
    discover.chmod(0o755)
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=str(ROOT),
               KR_DIE_ON_HOST="hostC", KR_DIE_AT="1:5", KR_EPOCHS="3")
    cmd = [str(Path(sys.executable).parent / "keras-ring-run"), "-np", "3", "--min-np", "2",
           "--max-np", "3", "--blacklist-after", "1", "--host-discovery-script", str(discover),
           "--remote-shell", str(FAKE_SSH), sys.executable, str(WORKER)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600).stdout
    death = [json.loads(m) for m in re.findall(r"\] DEATH (\{.*\})$", out, re.M)]
    resets = [json.loads(m) for m in re.findall(r"\] RESET (\{.*\})$", out, re.M)]
    resumed = [r["time"] for r in resets if r["size"] == 2]
    if len(death) != 1 or len(resumed) != 2:
        raise SystemExit(f"the job did not reset as planned:\n{out[-4000:]}")
    return max(resumed) - death[0]["time"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    times = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeat):
            times.append(one_reset(Path(tmp)))
            print(f"reset {i + 1}: death to first step of the world of 2: {times[-1]:.3f} s",
                  flush=True)
    print(f"elastic reset, {args.repeat} runs: {min(times):.3f}-{max(times):.3f} s")


if __name__ == "__main__":
    main()
