"""init() gives each rank its share of the cores for TensorFlow's intra-op pool."""

import os

import tensorflow as tf

import keras_ring as kr
from keras_ring import threads


def _expected_intra_op_threads() -> int:
    """What init() must have set, from the environment this job runs in (the get_* value
    0 means TensorFlow chooses)."""
    requested = os.environ.get("KERAS_RING_INTRA_OP_THREADS", "").strip()
    if requested:
        return int(requested)  # 0: left to TensorFlow
    if "TF_NUM_INTRAOP_THREADS" in os.environ or kr.local_size() == 1:
        return 0  # TensorFlow reads its own variable; a rank alone on its host needs no share
    return max(1, threads.available_cores() // kr.local_size())


def test_intra_op_threads_default_to_a_share_of_the_cores(world):
    assert tf.config.threading.get_intra_op_parallelism_threads() == _expected_intra_op_threads()
