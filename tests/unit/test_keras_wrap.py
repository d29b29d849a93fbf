"""wrap(), Compression, bucket planning and DistributedGradientTape in one process (size 1)."""

import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import keras
import keras_ring
from keras_ring._bucket_tuning import (FALLBACK_BYTES, FIRST_BYTES, PROBE_BYTES, Plan, choose,
                                      fit, plan)
from keras_ring._buckets import DEFAULT_BUCKET_BYTES, plan_buckets
from keras_ring.config import Config
from keras_ring.optimizer import is_wrapped


@pytest.fixture(scope="module", autouse=True)
def initialized():
    keras_ring.init()
    yield


def _model(seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="tanh"),
                             keras.layers.Dense(2)])


def test_wrap_returns_the_optimizer_as_a_subclass_of_its_own_class():
    adam = keras.optimizers.Adam(0.003, beta_1=0.8)
    config = adam.get_config()
    wrapped = keras_ring.wrap(adam)
    assert wrapped is adam and is_wrapped(wrapped)
    assert type(wrapped) is not keras.optimizers.Adam
    assert type(wrapped).__mro__[1] is keras.optimizers.Adam
    assert wrapped.__class__ is keras.optimizers.Adam and isinstance(wrapped, keras.optimizers.Adam)
    assert set(vars(type(wrapped))) >= {"apply"}
    assert not {"apply_gradients", "get_config", "build", "update_step"} & set(vars(type(wrapped)))
    assert wrapped.get_config() == config
    assert keras.optimizers.serialize(wrapped) == keras.optimizers.serialize(
        keras.optimizers.Adam.from_config(config))
    assert keras_ring.DistributedOptimizer is keras_ring.wrap


def test_wrap_accepts_a_name():
    assert isinstance(keras_ring.wrap("sgd"), keras.optimizers.SGD)


@pytest.mark.parametrize("kwargs, error, message", [
    ({"op": keras_ring.Min}, ValueError,
     "got <ReduceOp.Min: 2> .gradients are reduced with Sum or Average only"),
    ({"op": "mean"}, ValueError, "got 'mean'"),
    ({"compression": "fp16"}, TypeError, "compression must be one of .*got 'fp16'"),
    ({"bucket_bytes": 0}, ValueError, 'bucket_bytes must be a positive int, "auto" or None.*got 0'),
    ({"bucket_bytes": 1.5}, ValueError, "got 1.5"),
    ({"bucket_bytes": "automatic"}, ValueError, "got 'automatic'"),
    ({"first_bucket_bytes": 0}, ValueError, 'first_bucket_bytes must be a positive int, "auto" or None.*got 0'),
    ({"first_bucket_bytes": "big"}, ValueError, "first_bucket_bytes.*got 'big'"),
    ({"sparse_as_dense": "yes"}, TypeError, "sparse_as_dense must be a bool, got 'yes'"),
    ({"gradient_predivide_factor": 0.0}, ValueError, "positive number, got 0.0"),
    ({"gradient_predivide_factor": 2.0, "op": keras_ring.Sum}, ValueError, "needs op=Average.*got op=Sum"),
])
def test_wrap_rejects_bad_options_and_says_what_it_got(kwargs, error, message):
    with pytest.raises(error, match=message):
        keras_ring.wrap(keras.optimizers.SGD(0.1), **kwargs)


def test_wrap_rejects_what_is_not_a_fresh_keras_optimizer():
    with pytest.raises(TypeError, match="optimizer instance, got the class Adam"):
        keras_ring.wrap(keras.optimizers.Adam)
    with pytest.raises(TypeError, match="Keras 3 optimizer.*got builtins.dict"):
        keras_ring.wrap({"lr": 0.1})
    wrapped = keras_ring.wrap(keras.optimizers.SGD(0.1))
    with pytest.raises(ValueError, match="already wrapped"):
        keras_ring.wrap(wrapped)


def test_size_one_training_is_bitwise_plain_keras():
    x = np.random.default_rng(0).normal(size=(32, 4)).astype("float32")
    y = x[:, :2] * 2.0
    results = []
    for wrap in (False, True):
        model = _model()
        optimizer = keras.optimizers.Adam(0.01)
        model.compile(optimizer=keras_ring.wrap(optimizer) if wrap else optimizer, loss="mse")
        model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
        results.append(model.get_weights())
    for a, b in zip(*results):
        np.testing.assert_array_equal(a, b)


def test_plan_buckets():
    assert plan_buckets([], 10) == []
    assert plan_buckets([4, 4, 4], 8) == [[0, 1], [2]]
    assert plan_buckets([20, 4, 4], 8) == [[0], [1, 2]]  # too big: a bucket of its own
    assert plan_buckets([4, 20, 4], 8) == [[0], [1], [2]]
    assert plan_buckets([4, 20, 4], None) == [[0, 1, 2]]
    # The first bucket has its own, smaller limit; None for the others keeps one bucket.
    assert plan_buckets([4, 4, 4, 4, 4], 12, first_bucket_bytes=4) == [[0], [1, 2, 3], [4]]
    assert plan_buckets([4, 4, 4], 8, first_bucket_bytes=100) == [[0, 1], [2]]
    assert plan_buckets([20, 4, 4], 8, first_bucket_bytes=4) == [[0], [1, 2]]
    assert plan_buckets([4, 4, 4], None, first_bucket_bytes=4) == [[0, 1, 2]]
    assert DEFAULT_BUCKET_BYTES == "auto"


def test_automatic_bucket_size_rule():
    # fixed cost at most a tenth of a bucket's time: bytes >= 9 * fixed / per_byte, rounded
    # up to a power of two within [1 MiB, 64 MiB]
    assert choose(100e-6, 1 / 1e9) == 1 << 20  # 0.9 MB
    assert choose(200e-6, 1 / 1e9) == 2 << 20  # 1.8 MB
    assert choose(1e-3, 1 / 1e9) == 16 << 20  # 9 MB
    assert choose(1.0, 1 / 1e9) == 64 << 20
    assert choose(-1e-6, 1 / 1e9) == 1 << 20  # a fit below zero: no fixed cost
    assert choose(1e-4, 0.0) == FALLBACK_BYTES  # the large probe no slower: noise
    # Where backprop leaves some rank no core, no overlap: one large bucket, no first one.
    assert plan(100e-6, 1 / 1e9, cores_busy=True) == Plan(FALLBACK_BYTES, None, overlap=False)
    assert plan(200e-6, 1 / 1e9, cores_busy=False) == Plan(2 << 20, FIRST_BYTES, overlap=True)
    small, large = PROBE_BYTES
    fixed, per_byte = fit([50e-6 + small * 1e-9, 50e-6 + large * 1e-9])
    assert abs(fixed - 50e-6) < 1e-9 and abs(per_byte - 1e-9) < 1e-15


def test_bucket_bytes_from_the_environment(monkeypatch):
    for raw, expected in [("", None), ("auto", None), (" AUTO ", None), ("4096", 4096)]:
        monkeypatch.setenv("KERAS_RING_BUCKET_BYTES", raw)
        assert Config.from_env().bucket_bytes == expected
    for raw in ("0", "-5", "1.5", "big"):
        monkeypatch.setenv("KERAS_RING_BUCKET_BYTES", raw)
        with pytest.raises(ValueError, match="KERAS_RING_BUCKET_BYTES"):
            Config.from_env()


def test_compression_narrows_only_wide_floats():
    fp16, bf16, none = (keras_ring.Compression.fp16, keras_ring.Compression.bf16,
                        keras_ring.Compression.none)
    assert fp16.wire_dtype_for(tf.float32) == tf.float16
    assert fp16.wire_dtype_for(tf.float64) == tf.float16
    assert bf16.wire_dtype_for(tf.float32) == tf.bfloat16
    assert fp16.wire_dtype_for(tf.int32) == tf.int32
    assert bf16.wire_dtype_for(tf.float16) == tf.float16
    assert none.wire_dtype_for(tf.float64) == tf.float64
    x = tf.constant([1.0, 2.5], tf.float64)
    # Horovod's compressor shape: compress -> (wire tensor, context), decompress(wire, context).
    wire, ctx = fp16.compress(x)
    assert wire.dtype == tf.float16 and ctx == tf.float64
    back = fp16.decompress(wire, ctx)
    assert back.dtype == tf.float64 and back.numpy().tolist() == [1.0, 2.5]
    same, ctx = none.compress(x)
    assert same is x and none.decompress(same, ctx) is x
    assert repr(bf16) == "keras_ring.Compression.bf16"


def test_distributed_gradient_tape_keeps_structure_and_delegates():
    v = tf.Variable([1.0, 2.0])
    w = tf.Variable(3.0)
    unused = tf.Variable(0.0)
    c = tf.constant(2.0)
    with keras_ring.DistributedGradientTape(tf.GradientTape(persistent=True)) as tape:
        tape.watch(c)
        loss = tf.reduce_sum(v * v) * w * c
    grads = tape.gradient(loss, {"v": v, "pair": (w, unused), "c": c})
    np.testing.assert_allclose(grads["v"].numpy(), [12.0, 24.0])
    assert grads["pair"][0].numpy() == 10.0 and grads["pair"][1] is None
    assert grads["c"].numpy() == 15.0
    assert isinstance(tape.tape, tf.GradientTape)
    with pytest.raises(TypeError, match="wraps a tf.GradientTape, got builtins.str"):
        keras_ring.DistributedGradientTape("tape")
    with pytest.raises(ValueError, match="op must be"):
        keras_ring.DistributedGradientTape(tf.GradientTape(), op=keras_ring.Max)


@pytest.fixture
def fresh_warning(monkeypatch):
    """The XLA warning is once per process; each test here wants to see it."""
    from keras_ring import _xla

    monkeypatch.setattr(_xla, "_warned", False)


def test_jit_compile_is_turned_off_for_wrapped_optimizers_only(fresh_warning):
    model = _model()
    with pytest.warns(UserWarning, match="turning XLA off .*jit_compile=True"):
        model.compile(optimizer=keras_ring.wrap(keras.optimizers.SGD(0.1)), loss="mse",
                      jit_compile=True)
    assert model.jit_compile is False
    plain = _model()
    plain.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", jit_compile=True)
    assert plain.jit_compile is True


def test_jit_compile_auto_on_a_gpu_machine_is_turned_off_once(fresh_warning, monkeypatch):
    # What Keras decides for jit_compile="auto" when it sees a GPU.
    monkeypatch.setattr(keras.Model, "_resolve_auto_jit_compile", lambda self: True, raising=False)
    with pytest.warns(UserWarning, match="Keras picks XLA on GPU machines when jit_compile='auto'") as record:
        for _ in range(2):
            model = _model()
            model.compile(optimizer=keras_ring.wrap(keras.optimizers.SGD(0.1)), loss="mse")
            assert model.jit_compile is False
    assert len([w for w in record if "XLA" in str(w.message)]) == 1
    model.fit(np.zeros((4, 4), "float32"), np.zeros((4, 2), "float32"), verbose=0)


def test_the_first_compile_of_a_fresh_process_sees_the_wrapped_optimizer(clean_env):
    # `model.compile(optimizer=keras_ring.wrap(...))` resolves compile before wrap runs: in a
    # process where nothing was wrapped yet, the compile hook must already be in place.
    code = ("import numpy as np, keras, keras_ring\n"
            "keras_ring.init()\n"
            "m = keras.Sequential([keras.layers.Dense(4), keras.layers.Dense(2)])\n"
            "m.compile(optimizer=keras_ring.wrap(keras.optimizers.SGD(0.1)), loss='mse',"
            " jit_compile=True)\n"
            "m.fit(np.ones((8, 3)), np.ones((8, 2)), epochs=1, verbose=0,"
            " callbacks=[keras_ring.callbacks.BroadcastGlobalVariablesCallback(0)])\n"
            "print('RESULT', m.jit_compile, len(m.variables))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=clean_env, timeout=300)
    assert "RESULT False 4" in out.stdout, out.stdout + out.stderr[-3000:]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64", "int8",
                                   "int32", "int64"])
def test_weight_fingerprints_ignore_summation_order_and_see_one_changed_bit(dtype):
    from keras_ring._weight_check import fingerprint

    rng = np.random.default_rng(3)
    values = tf.cast(tf.constant(rng.normal(size=(64, 33)) * 100), dtype)
    flat = tf.reshape(values, [-1])
    shuffled = tf.gather(flat, rng.permutation(flat.shape[0]))
    assert int(fingerprint(values)) == int(fingerprint(shuffled))
    # One element's lowest bit flipped (as a differently initialised weight differs, only less).
    width = {2: tf.uint16, 4: tf.uint32, 8: tf.uint64}.get(values.dtype.size, tf.uint8)
    bits = tf.bitcast(flat, width).numpy().copy()
    bits[100] ^= 1
    changed = tf.bitcast(tf.constant(bits), values.dtype)
    assert int(fingerprint(changed)) != int(fingerprint(values))


def test_fit_runs_through_the_weight_checking_wrapper():
    model = _model(seed=5)
    model.compile(optimizer=keras_ring.wrap(keras.optimizers.SGD(0.1)), loss="mse")
    model.fit(np.ones((8, 4)), np.ones((8, 2)), batch_size=2, epochs=1, verbose=0)
    # The training function is keras_ring's wrapper around Keras's own.
    assert hasattr(model.train_function, "_keras_ring_checked")
    # Whatever Keras's own function offers (a tf.function's function_spec, which Keras 3.5's
    # TensorBoard callback looks for) is reachable through it.
    inner = model.train_function._keras_ring_checked
    public = [a for a in dir(inner) if not a.startswith("_")]
    assert all(hasattr(model.train_function, a) for a in public)
    inner.offered_by_keras = "spec"
    assert model.train_function.offered_by_keras == "spec"


class _NoCall(keras.Model):
    """keras-io's VAE shape: sub-models and a train_step, no call."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner


def test_unbuilt_layers_leave_out_models_that_have_no_call():
    from keras_ring._keras_private import has_call, unbuilt_layers

    built = _NoCall(_model())
    assert not built.built and not has_call(built) and has_call(built.inner)
    assert unbuilt_layers(built) == []  # nothing could build it; its layers are built
    lazy = keras.Sequential([keras.layers.Dense(2, name="lazy_dense")], name="lazy")
    assert [layer.name for layer in unbuilt_layers(_NoCall(lazy))] == ["lazy", "lazy_dense"]
    assert unbuilt_layers(lazy)[0] is lazy


def test_seed_states_are_told_apart_from_weights():
    from keras_ring._keras_private import is_seed_state

    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dropout(0.5),
                              keras.layers.BatchNormalization()])
    seeds = [v for v in model.variables if is_seed_state(v)]
    assert seeds == [model.layers[1].seed_generator.state]
    assert not any(is_seed_state(v) for v in model.weights)  # moving statistics included
    assert not is_seed_state(tf.Variable([1, 2], name="seed_generator_state", trainable=False))
