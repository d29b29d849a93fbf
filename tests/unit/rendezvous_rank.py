"""One rank of a job launched without MPI (test_rendezvous.py starts N of these).

``python rendezvous_rank.py collectives``: ``keras_ring.init()`` through the environment
rendezvous, then collectives checked against numpy references computed locally (every rank
can generate every rank's input); prints ``RESULT {json}``. Needs ``RENDEZVOUS_TEST_DIR``.

``python rendezvous_rank.py init``: only ``init()``; prints ``ERROR {json}`` with the
exception and the seconds it took, or ``RESULT {json}``.

``python rendezvous_rank.py until_failure``: prints ``FORMED`` once ``init()`` returned, then
runs allreduces until one fails (``ERROR {json}``), for at most 150 s (then ``RESULT``).
"""

import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import tensorflow as tf

import keras_ring as kr
from tests.reference import assert_same, rank_input, reduce_reference

OPS = {"Sum": kr.Sum, "Average": kr.Average, "Min": kr.Min, "Max": kr.Max, "Product": kr.Product}


def check_collectives(rank: int, size: int) -> int:
    checked = 0
    for dtype in (tf.float32, tf.int64, tf.bfloat16):
        for name, op in OPS.items():
            inputs = [rank_input(dtype, (7, 5), r, seed=11, op=name) for r in range(size)]
            out = kr.allreduce(tf.constant(inputs[rank]), op=op, name=f"{dtype.name}.{name}")
            assert_same(out.numpy(), reduce_reference(inputs, name, dtype))
            checked += 1
    # Many ring segments (the test sets KERAS_RING_SEGMENT_BYTES small).
    big = [np.arange(200_000, dtype=np.float32) % 97 * (r + 1) for r in range(size)]
    out = kr.allreduce(tf.constant(big[rank]), op=kr.Sum, name="big")
    np.testing.assert_array_equal(out.numpy(), np.sum(big, axis=0))
    # Groups whose ring chunks span tensor boundaries, odd sizes, several dtypes: the
    # shapes that once came back as garbage on shm+TCP rings.
    groups = [[(tf.float32, (4,)), (tf.float32, (40000,))],
              [(tf.int32, (4,)), (tf.int32, (262144,))],
              [(tf.float64, (3, 7)), (tf.float64, (1001,)), (tf.float64, (5,))],
              [(tf.bfloat16, (17,)), (tf.bfloat16, (3000,))],
              [(tf.int8, (1,)), (tf.int8, (61,)), (tf.int8, (70001,))]]
    for g, group in enumerate(groups):
        inputs = [[rank_input(dt, shape, r, seed=100 + g * 10 + i, op="Sum")
                   for i, (dt, shape) in enumerate(group)] for r in range(size)]
        outs = kr.grouped_allreduce([tf.constant(t) for t in inputs[rank]], op=kr.Sum,
                                    name=f"group{g}")
        for i, (dt, _) in enumerate(group):
            assert_same(outs[i].numpy(), reduce_reference([inp[i] for inp in inputs], "Sum", dt))
        checked += 1
    # Rows differ by rank: allgatherv.
    rows = [np.full((r + 1, 3), r, dtype=np.int32) for r in range(size)]
    out = kr.allgather(tf.constant(rows[rank]), name="rows")
    np.testing.assert_array_equal(out.numpy(), np.concatenate(rows))
    for root in (0, size - 1):
        data = [rank_input(tf.float64, (4,), r, seed=5) for r in range(size)]
        out = kr.broadcast(tf.constant(data[rank]), root_rank=root, name=f"bcast.{root}")
        np.testing.assert_array_equal(out.numpy(), data[root])
    assert kr.allgather_object(rank) == list(range(size))
    kr.barrier()
    return checked + 2 + 2 + 1


def main() -> None:
    mode = sys.argv[1]
    start = time.monotonic()
    try:
        kr.init()
    except Exception as e:  # noqa: BLE001 - the test inspects whatever came out
        print("ERROR " + json.dumps({"rank": int(os.environ["KERAS_RING_RANK"]),
                                     "type": type(e).__name__, "message": str(e),
                                     "seconds": time.monotonic() - start}), flush=True)
        sys.exit(3)
    result = {"rank": kr.rank(), "size": kr.size(), "local_rank": kr.local_rank(),
              "local_size": kr.local_size(), "cross_rank": kr.cross_rank(),
              "cross_size": kr.cross_size()}
    if mode == "collectives":
        result["checked"] = check_collectives(kr.rank(), kr.size())
        wait_for_everyone(kr.rank(), kr.size())
    if mode == "until_failure":
        print("FORMED", flush=True)
        deadline = time.monotonic() + 150
        while time.monotonic() < deadline:
            try:
                kr.allreduce(tf.ones([1000]), name="step")
            except Exception as e:  # noqa: BLE001 - the test inspects it
                print("ERROR " + json.dumps({"rank": kr.rank(), "type": type(e).__name__,
                                             "message": str(e)}), flush=True)
                sys.exit(4)
    kr.shutdown()
    print("RESULT " + json.dumps(result), flush=True)


def wait_for_everyone(rank: int, size: int) -> None:
    """An out-of-band barrier (files in RENDEZVOUS_TEST_DIR) before shutdown().

    Shutting down while a peer may still be finishing the last collective is a runtime
    matter tested elsewhere; this test is about the bootstrap, so every rank leaves only once
    all have finished (as keras_ring.spark does with Spark's own barrier).
    """
    folder = Path(os.environ["RENDEZVOUS_TEST_DIR"])
    (folder / f"done.{rank}").touch()
    deadline = time.monotonic() + 120
    while len(list(folder.glob("done.*"))) < size:
        if time.monotonic() > deadline:
            raise TimeoutError("the other ranks did not finish within 120 s")
        time.sleep(0.05)


if __name__ == "__main__":
    main()
