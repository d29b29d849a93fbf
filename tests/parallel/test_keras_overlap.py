"""Gradient buckets overlap backprop: a bucket's allreduce starts as soon as its gradients
exist, before backprop has computed the first layer's gradient (issue 17).

The proof is the order of events on each rank's timeline (keras_ring.timeline): a mark
recorded when the first layer's kernel gradient (the last one backprop computes) exists,
against the start of the first bucket's collective. Also: the step's graph gives the first
bucket no path from that gradient, the automatic layout is the same on every rank, and
training with it matches one process on the concatenated batch.

The overlap tests give the bucket sizes explicitly: the automatic layout does not overlap on
a host whose ranks leave no core free (as on the 2-core test machine), see _bucket_tuning.
"""

import numpy as np
import tensorflow as tf

import keras
import keras_ring
from keras_ring import _bucket_tuning, timeline
from keras_ring.ops import wrappers
from keras_ring.callbacks import BroadcastGlobalVariablesCallback

from tests.parallel import keras_support as ks

MARK = "first layer kernel gradient"
FIRST_BUCKET = "grouped_allreduce 'gradients.bucket0'"
# The first layer's weight gradient (x^T @ dy: 2048 x 512 x 1024 multiply-adds per step) is
# the last and by far the largest piece of backprop, and the last layers' gradients fill
# the first bucket (1 MiB) long before it exists.
FEATURES, WIDE, BATCH, STEPS = 2048, 1024, 512, 8
# First bucket: the last two layers (266 KB); then the second layer's 1 MiB kernel; then the
# first layer's 8 MiB kernel, alone.
BUCKETS = dict(bucket_bytes=4 << 20, first_bucket_bytes=1 << 20)


@tf.custom_gradient
def _marked(kernel):
    def grad(dy):
        return timeline.mark(dy, MARK)
    return tf.identity(kernel), grad


class MarkedDense(keras.layers.Layer):
    """A dense layer whose kernel gradient records a timeline mark when it is computed."""

    def __init__(self, units, **kwargs):
        super().__init__(**kwargs)
        self.units = units

    def build(self, input_shape):
        self.kernel = self.add_weight(shape=(input_shape[-1], self.units), name="kernel")
        self.bias = self.add_weight(shape=(self.units,), initializer="zeros", name="bias")

    def call(self, x):
        return tf.nn.relu(tf.matmul(x, _marked(tf.convert_to_tensor(self.kernel))) + self.bias)


def _model(seed):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((FEATURES,)), MarkedDense(WIDE),
        keras.layers.Dense(256, activation="relu"), keras.layers.Dense(256, activation="relu"),
        keras.layers.Dense(10),
    ])


def _data(rank):
    rng = np.random.default_rng(100 + rank)
    x = rng.standard_normal((BATCH * STEPS, FEATURES)).astype("float32")
    return x, rng.integers(0, 10, BATCH * STEPS)


def _steps(events):
    """Per train step (in order): (mark time, first bucket's start, last bucket's submission)."""
    marks = [e["done"] for e in events if e["mark"] and e["label"] == MARK]
    grads = [e for e in events if not e["mark"] and "'gradients.bucket" in e["label"]]
    firsts = [e for e in grads if e["label"] == FIRST_BUCKET]
    buckets = {e["label"] for e in grads}
    last = [e for e in grads if e["label"] == max(buckets, key=lambda b: int(b[b.index("bucket") + 6:-1]))]
    assert len(marks) == len(firsts) == len(last) == STEPS, (len(marks), len(firsts), len(last))
    return list(zip(marks, [e["started"] for e in firsts], [e["submitted"] for e in last])), buckets


def _trained_once(rank):
    """The marked model with BUCKETS, built and its step traced by one batch; and rank's data."""
    model = _model(ks.rank_seed(0))
    model.compile(optimizer=keras_ring.wrap(keras.optimizers.SGD(0.01), **BUCKETS), loss=ks.loss())
    x, y = _data(rank)
    model.fit(x[:BATCH], y[:BATCH], batch_size=BATCH, epochs=1, verbose=0)
    return model, x, y


def test_first_bucket_starts_before_backprop_ends(world):
    model, x, y = _trained_once(world[0])
    timeline.recorded()  # forget what came before recording
    timeline.record(True)
    try:
        model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    finally:
        timeline.record(False)
    steps, buckets = _steps(timeline.recorded())
    assert len(buckets) == 3, buckets
    for mark, first_started, last_submitted in steps:
        # The last bucket holds the marked gradient: it cannot be submitted before it exists
        # (this checks that the mark sits where it should).
        assert mark <= last_submitted
    # Overlap: the first bucket's collective started while backprop was still computing the
    # first layer's gradient. Order, not duration. Most steps must show it, not every one:
    # TensorFlow's executor does not order ready kernels, and on a loaded 2-core machine it
    # once ran the small last-layer gradients after the big matmul (1 step in 6, in CI).
    # A first bucket that waited for all gradients could start before the mark in no step.
    early = [first_started < mark for mark, first_started, _ in steps]
    assert sum(early) > len(steps) // 2, (sum(early), steps)


def _ancestors(op):
    seen, todo = set(), [op]
    while todo:
        o = todo.pop()
        for p in [t.op for t in o.inputs] + list(o.control_inputs):
            if p not in seen:
                seen.add(p)
                todo.append(p)
    return seen


def test_first_bucket_has_no_path_from_the_last_gradient(world):
    # The deterministic half of the overlap: in the traced step, nothing (data or control
    # edge) makes the first bucket's collective wait for the first layer's gradient.
    model, x, y = _trained_once(world[0])
    graph = tf.function(model.train_step).get_concrete_function(
        (tf.constant(x[:BATCH]), tf.constant(y[:BATCH]))).graph
    marks = [op for op in graph.get_operations() if op.type == "KerasRingTimelineMark"]
    buckets = sorted((op for op in graph.get_operations() if op.type == "KerasRingGroupedAllreduce"),
                     key=lambda op: int(wrappers.tensor_name(op).rsplit("bucket", 1)[1]))
    assert len(marks) == 1 and len(buckets) == 3
    assert marks[0] not in _ancestors(buckets[0])
    assert marks[0] in _ancestors(buckets[-1])


def test_automatic_layout_is_the_same_on_every_rank(world):
    measured = _bucket_tuning.MEASURED
    model = ks.mlp(ks.rank_seed(0))
    model.compile(optimizer=keras_ring.wrap(keras.optimizers.SGD(0.1)), loss=ks.loss())
    x, y = ks.classification_data(8, seed=3)
    model.fit(x, y, batch_size=4, epochs=1, verbose=0)
    plan = measured.plan(keras_ring.global_process_set)  # measured by fit already
    timings = measured.timings[0]
    gathered = keras_ring.allgather_object((plan, timings))
    assert all(g == gathered[0] for g in gathered), gathered
    if plan.overlap:
        assert plan.bucket_bytes == _bucket_tuning.choose(*_bucket_tuning.fit(timings))
        assert plan.first_bucket_bytes == _bucket_tuning.FIRST_BYTES
    else:
        assert plan == _bucket_tuning.Plan(_bucket_tuning.FALLBACK_BYTES, None, overlap=False)
    assert _bucket_tuning.MIN_BYTES <= plan.bucket_bytes <= _bucket_tuning.MAX_BYTES
    assert plan.bucket_bytes & (plan.bucket_bytes - 1) == 0


def test_fit_with_automatic_and_small_first_bucket_matches_single_process(world):
    # Training results do not depend on the bucket layout: N ranks x batch B with "auto"
    # buckets and a first bucket of 64 bytes (so the tiny model spans two buckets) equal one
    # process on batches of N*B.
    rank, size = world
    batch, steps = 4, 5
    x, y = ks.classification_data(size * batch * steps, seed=11)
    reference = ks.mlp(ks.rank_seed(0), hidden=16)
    reference.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss=ks.loss())
    reference.fit(x, y, batch_size=size * batch, epochs=2, shuffle=False, verbose=0)
    model = ks.mlp(ks.rank_seed(rank), hidden=16)
    optimizer = keras_ring.wrap(keras.optimizers.SGD(0.1, momentum=0.9), first_bucket_bytes=64)
    model.compile(optimizer=optimizer, loss=ks.loss())
    model.fit(ks.shard(x, rank, size, batch), ks.shard(y, rank, size, batch), batch_size=batch,
              epochs=2, shuffle=False, verbose=0, callbacks=[BroadcastGlobalVariablesCallback(0)])
    ks.assert_weights_close(ks.weights(model), ks.weights(reference), atol=1e-6)
    ks.assert_same_on_all_ranks(ks.weights(model))
