"""gpu_check's failure paths on a GPU, each a fresh job of NP ranks started by the driver:

- kill:   the last rank is killed (SIGKILL) while every rank runs allreduces back to back.
          The others must fail promptly (well before the timeout), refuse later calls, and
          shut down and exit cleanly.
- stall:  the last rank's input is held back on its GPU (a spinning kernel ahead of it on its
          stream), so every rank's NCCL allreduce waits inside NCCL. All must end with a
          timeout at the runtime's deadline (the communicators aborted), refuse later calls,
          and shut down and exit cleanly.
- reinit: shutdown, then init again in the same processes: a new communicator works.

At one rank (one GPU, an NCCL that cannot put two ranks on it) kill has no survivor and is
left out; stall and reinit mean the same with the stalled rank alone.

Ranks write what they saw to <shared>/fault.<scenario>.<rank>.json; judge() decides. The
pure parts (judge) are unit-tested in tests/unit/test_gpu_check.py.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import numpy as np

SCENARIOS = ("kill", "stall", "reinit")
TIMEOUT = {"kill": 30.0, "stall": 10.0, "reinit": 30.0}  # KERAS_RING_TIMEOUT_SECONDS per job
FATAL_CODES = {4, 10, 13, 14}
SHUTDOWN_LIMIT_S = 15.0


def victim(n: int) -> int:
    return n - 1


def scenarios(n: int) -> tuple[str, ...]:
    """The scenarios a job of n ranks can run: kill needs a rank that survives."""
    if n < 1:
        return ()
    return SCENARIOS if n >= 2 else tuple(name for name in SCENARIOS if name != "kill")


def judge(name: str, n: int, codes: list[int], results: dict[int, dict]) -> list[str]:
    """What went wrong in scenario `name`, from every rank's exit code and report."""
    problems = []
    timeout = TIMEOUT[name]
    for rank in range(n):
        code, result = codes[rank], results.get(rank)
        if name == "kill" and rank == victim(n):
            if code != -signal.SIGKILL:
                problems.append(f"rank {rank} (killed) exited with {code}")
            continue
        if code != 0:
            problems.append(f"rank {rank} exited with {code}, not cleanly")
        if result is None:
            problems.append(f"rank {rank} reported nothing")
            continue
        if name == "reinit":
            if result.get("values") != [float(n)] * 2 or result.get("communicators") != 1:
                problems.append(f"rank {rank}: after init again {result}")
            continue
        failed = result.get("code", 0)
        if failed not in FATAL_CODES:
            problems.append(f"rank {rank}: the collective ended with code {failed}: {result.get('error')}")
        elif name == "stall" and failed != 4:
            problems.append(f"rank {rank}: expected a timeout (4), got {failed}: {result.get('error')}")
        took = result.get("failed_call_s", 1e9)
        if name == "kill" and took > timeout / 2:
            problems.append(f"rank {rank}: the dead peer was noticed after {took:.1f} s, not promptly")
        if name == "stall" and not timeout * 0.9 <= took <= timeout + 10:
            problems.append(f"rank {rank}: the stalled collective ended after {took:.1f} s "
                            f"(timeout {timeout:.0f} s)")
        if result.get("later_code", 0) == 0:
            problems.append(f"rank {rank}: a later collective was not refused")
        if result.get("shutdown_s", 1e9) > SHUTDOWN_LIMIT_S:
            problems.append(f"rank {rank}: shutdown took {result.get('shutdown_s'):.1f} s")
    return problems


def _spin(cp, device: int, seconds: float, stream) -> None:
    """Keeps `stream` busy on the GPU for about `seconds` (one thread spinning on clock64)."""
    kernel = cp.RawKernel(r'''
extern "C" __global__ void kr_spin(long long cycles) {
  long long start = clock64();
  while (clock64() - start < cycles) {}
}''', "kr_spin")
    try:
        hz = cp.cuda.runtime.deviceGetAttribute(13, device) * 1000  # cudaDevAttrClockRate, kHz
    except Exception:  # noqa: BLE001 (an attribute CUDA may retire): assume a fast clock
        hz = 2_000_000_000
    kernel((1,), (1,), (np.int64(seconds * hz),), stream=stream)


def _fail_and_after(gc, core, run) -> dict:
    """Runs `run` until it fails; then one more call, then shutdown, all timed."""
    result: dict = {"code": 0}
    for _ in range(1_000_000):
        start = time.perf_counter()
        try:
            run()
        except gc.CollectiveError as e:
            result = {"code": e.code, "error": str(e)[:600],
                      "failed_call_s": time.perf_counter() - start}
            break
    try:
        run()
        result["later_code"] = 0
    except gc.CollectiveError as e:
        result["later_code"], result["later_error"] = e.code, str(e)[:300]
    start = time.perf_counter()
    core.shutdown()
    result["shutdown_s"] = time.perf_counter() - start
    return result


def run_scenario(gc, cp, name: str, rank: int, n: int, device: int, connect) -> dict:
    """One rank's part; `connect(generation, timeout)` returns an initialized gc.Core."""
    core = connect(0, TIMEOUT[name])
    x = cp.ones(1 << 20, cp.float32)
    y = cp.empty_like(x)
    core.allreduce(x, y, "float32", "Sum", device)  # the communicator exists from here on
    core.barrier()
    if name == "kill":
        if rank == victim(n):
            threading.Timer(0.5, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
        return _fail_and_after(gc, core, lambda: core.allreduce(x, y, "float32", "Sum", device))
    if name == "stall":
        stream = cp.cuda.Stream(non_blocking=True)
        if rank == victim(n):
            _spin(cp, device, TIMEOUT[name] + 5, stream)
        return _fail_and_after(
            gc, core, lambda: core.allreduce(x, y, "float32", "Sum", device, stream.ptr))
    values = []
    for generation in (1, 2):
        if generation == 2:
            core = connect(1, TIMEOUT[name])
        one = cp.ones(1, cp.float32)
        core.allreduce(one, one, "float32", "Sum", device)
        values.append(float(one[0]))
        communicators = core.objects()[1]
        core.shutdown()
    return {"code": 0, "values": values, "communicators": communicators}


def report(shared: str, name: str, rank: int, result: dict) -> None:
    path = Path(shared, f"fault.{name}.{rank}.json")
    path.write_text(json.dumps(result))


def collect(shared: str, name: str, n: int) -> dict[int, dict]:
    results = {}
    for rank in range(n):
        path = Path(shared, f"fault.{name}.{rank}.json")
        if path.exists():
            results[rank] = json.loads(path.read_text())
    return results


def run_all(args, spawn) -> int:
    """Every scenario as a job of its own (`spawn(args, name)` starts it), judged from outside."""
    left_out = [name for name in SCENARIOS if name not in scenarios(args.spawn)]
    if left_out:
        print(f"# fault scenario(s) {', '.join(left_out)} need 2 ranks, got {args.spawn}: "
              "not run", flush=True)
    summary, failed = {}, 0
    for name in scenarios(args.spawn):
        started = time.perf_counter()
        codes = spawn(args, name)
        if codes is None:
            problems = [f"the job ran past {args.timeout} s"]
        else:
            problems = judge(name, args.spawn, codes, collect(args.shared, name, args.spawn))
        took = time.perf_counter() - started
        print(f"# fault {name}: {'ok' if not problems else 'FAILED'} ({took:.1f} s)"
              + "".join(f"\n#   {p}" for p in problems), flush=True)
        summary[name] = {"problems": problems, "seconds": took}
        failed += bool(problems)
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    return 1 if failed else 4 if left_out else 0  # 4: incomplete, never a pass
