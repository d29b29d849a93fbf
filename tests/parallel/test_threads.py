"""init() gives each rank its share of the cores for TensorFlow's intra-op pool."""

import os

import tensorflow as tf

import keras_ring as kr
from keras_ring import threads


def test_intra_op_threads_default_to_a_share_of_the_cores(world):
    rank, size = world
    expected = max(1, threads.available_cores() // kr.local_size())
    if os.environ.get("KERAS_RING_INTRA_OP_THREADS") or "TF_NUM_INTRAOP_THREADS" in os.environ:
        expected = tf.config.threading.get_intra_op_parallelism_threads()
    assert tf.config.threading.get_intra_op_parallelism_threads() == expected
