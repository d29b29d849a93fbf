"""Horovod's Keras API in one process: argument checks, load_model, SyncBatchNormalization at size 1."""

import re
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import keras
import keras_ring
from keras_ring._grouping import Groups
from keras_ring.callbacks import BroadcastGlobalVariablesCallback
from keras_ring.optimizer import is_wrapped


@pytest.fixture(scope="module", autouse=True)
def initialized():
    keras_ring.init()
    yield


def _model():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(2)])


class _NoDecompress:
    @staticmethod
    def compress(tensor):
        return tensor, None


@pytest.mark.parametrize("kwargs, error, message", [
    ({"backward_passes_per_step": 0}, ValueError, "backward_passes_per_step must be an int >= 1, got 0"),
    ({"backward_passes_per_step": 2.0}, ValueError, "got 2.0"),
    ({"average_aggregated_gradients": "yes"}, TypeError, "average_aggregated_gradients must be a bool, got 'yes'"),
    ({"scale_local_gradients": 1}, TypeError, "scale_local_gradients must be a bool, got 1"),
    ({"compression": _NoDecompress}, TypeError, "decompress\\(tensor, ctx\\) -> tensor, got <class"),
])
def test_new_wrap_options_say_what_they_got(kwargs, error, message):
    with pytest.raises(error, match=message):
        keras_ring.wrap(keras.optimizers.SGD(0.1), **kwargs)
    with pytest.raises(error, match=message):
        keras_ring.DistributedGradientTape(tf.GradientTape(), **kwargs)


def test_backward_passes_need_an_optimizer_keras_can_accumulate_in():
    built = keras.optimizers.SGD(0.1)
    built.build(_model().trainable_variables)
    with pytest.raises(ValueError, match="needs an optimizer that is not built yet"):
        keras_ring.wrap(built, backward_passes_per_step=2)
    with pytest.raises(ValueError, match="has gradient_accumulation_steps=3; set only one"):
        keras_ring.wrap(keras.optimizers.SGD(0.1, gradient_accumulation_steps=3),
                        backward_passes_per_step=2)
    with pytest.raises(ValueError, match="LossScaleOptimizer: wrap its inner optimizer"):
        keras_ring.wrap(keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1)),
                        backward_passes_per_step=2)
    optimizer = keras_ring.wrap(keras.optimizers.SGD(0.1), backward_passes_per_step=4)
    assert optimizer.gradient_accumulation_steps == 4


def test_local_layers_and_variables_must_be_layers_and_variables():
    with pytest.raises(TypeError, match="local_layers must be a keras.layers.Layer .*got str"):
        keras_ring.PartialDistributedOptimizer(keras.optimizers.SGD(0.1), local_layers="dense")
    with pytest.raises(TypeError, match="must all be keras.layers.Layer instances, got builtins.int"):
        keras_ring.PartialDistributedGradientTape(tf.GradientTape(),
                                                  local_layers=[keras.layers.Dense(1), 3])
    with pytest.raises(TypeError, match="takes a tf.Variable or keras.Variable, got builtins.str"):
        BroadcastGlobalVariablesCallback(0, local_variables=["kernel"])
    with pytest.raises(TypeError, match="got builtins.float"):
        keras_ring.wrap(keras.optimizers.SGD(0.1)).register_local_var(1.0)


def test_keras_load_model_still_compiles_in_a_keras_ring_process(tmp_path):
    # The compile hook must not look like a model class's own compile to Keras, which
    # then skips compiling a loaded model and drops its optimizer.
    model = _model()
    model.compile(optimizer=keras_ring.wrap(keras.optimizers.Adam(0.01)), loss="mse")
    model.fit(np.ones((4, 4), "float32"), np.zeros((4, 2), "float32"), verbose=0)
    model.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras")
    assert loaded.compiled and type(loaded.optimizer) is keras.optimizers.Adam
    assert int(loaded.optimizer.iterations.numpy()) == 1
    assert not is_wrapped(loaded.optimizer)  # plain Keras loading leaves it plain


def test_load_model_refuses_legacy_optimizers(tmp_path):
    with pytest.raises(ValueError, match="legacy_opts=True .*Keras 3 does not have"):
        keras_ring.load_model(tmp_path / "absent.keras", legacy_opts=True)


def test_sync_batch_norm_is_batch_norm_in_a_world_of_one():
    x = np.random.default_rng(0).normal(3.0, 2.0, size=(8, 5)).astype("float32")
    sync, plain = keras_ring.SyncBatchNormalization(), keras.layers.BatchNormalization()
    np.testing.assert_array_equal(sync(x, training=True), plain(x, training=True))
    np.testing.assert_array_equal(sync.moving_variance, plain.moving_variance)


_LOAD_SYNC_BN = """
import os, sys
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
{imports}
keras.models.load_model(sys.argv[1])
print("LOADED")
"""


@pytest.mark.parametrize("imports", [
    "import keras, keras_ring",
    "import keras, keras_ring; keras_ring.init()",
    "import keras_ring; import keras; keras_ring.init()",
], ids=["keras-then-keras-ring", "and-init", "keras-ring-then-keras-then-init"])
def test_keras_load_model_finds_sync_batch_norm_without_its_name_being_touched(tmp_path,
                                                                              imports):
    # The layer is a lazy export: Keras knew it only once keras_ring.SyncBatchNormalization
    # was looked up, so plain load_model failed in a program that only trains with it.
    inputs = keras.Input((4,))
    model = keras.Model(inputs, keras.layers.Dense(1)(keras_ring.SyncBatchNormalization()(inputs)))
    model.save(tmp_path / "sync_bn.keras")
    done = subprocess.run([sys.executable, "-c", _LOAD_SYNC_BN.format(imports=imports),
                           str(tmp_path / "sync_bn.keras")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "LOADED" in done.stdout, done.stderr[-2000:]


def test_load_model_of_a_mixed_precision_model_communicates_in_the_loss_scale_optimizer(tmp_path):
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model = _model()
        model.compile(optimizer=keras_ring.wrap(keras.optimizers.SGD(0.1)), loss="mse")
        model.fit(np.ones((4, 4), "float32"), np.zeros((4, 2), "float32"), verbose=0)
        model.save(tmp_path / "mixed.keras")
        loaded = keras_ring.load_model(tmp_path / "mixed.keras")
    finally:
        keras.mixed_precision.set_global_policy("float32")
    outer = loaded.optimizer
    assert isinstance(outer, keras.optimizers.LossScaleOptimizer)
    assert is_wrapped(outer) and is_wrapped(outer.inner_optimizer)
    assert int(outer.iterations.numpy()) == 1


def test_tape_gradient_takes_horovods_use_generic_names():
    variable = tf.Variable([1.0, 2.0])
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(variable * variable)
    grads = keras_ring.DistributedGradientTape(tape).gradient(loss, [variable],
                                                              use_generic_names=True)
    np.testing.assert_array_equal(grads[0].numpy(), [2.0, 4.0])
    # Horovod's positional form: gradient(target, sources, output_gradients, use_generic_names).
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(variable * variable)
    grads = keras_ring.DistributedGradientTape(tape).gradient(loss, [variable], None, True)
    np.testing.assert_array_equal(grads[0].numpy(), [2.0, 4.0])


def test_horovods_optimizer_and_tape_arguments_are_taken():
    model = _model()
    optimizer = keras_ring.DistributedOptimizer(
        keras.optimizers.SGD(0.1), name="DistributedSGD", device_dense="/gpu:0",
        device_sparse="/cpu:0", num_groups=2)
    state = optimizer.__dict__["_keras_ring_state"].options
    assert state.name == "DistributedSGD" and state.groups.count == 2
    assert keras_ring.wrap(keras.optimizers.SGD(0.1)).__dict__["_keras_ring_state"].options.name == "gradients"
    tape = keras_ring.DistributedGradientTape(
        tf.GradientTape(), device_dense="", device_sparse="",
        groups=[[model.layers[0].kernel, model.layers[1].kernel]])
    assert len(tape._options.groups.lists) == 1


def _bad_groups():
    model = _model()
    kernel = model.layers[0].kernel
    return [
        ({"groups": 0}, ValueError, "groups must be a positive int .*got 0"),
        ({"groups": True}, TypeError, "groups must be a positive int or a list of lists of variables, got builtins.bool"),
        ({"groups": "dense"}, TypeError, "got builtins.str: 'dense'"),
        ({"groups": [kernel]}, TypeError, "each entry of groups must be a list of variables, got .*Variable"),
        ({"groups": [[kernel, 3]]}, TypeError, "groups must hold tf.Variable or keras.Variable objects, got builtins.int: 3"),
        ({"groups": [[kernel], [kernel.value]]}, ValueError, "variable 'sequential.*/kernel.*' is in more than one group"),
        ({"num_groups": -1}, ValueError, "num_groups must be a non-negative int .*got -1"),
        ({"groups": 2, "bucket_bytes": 1024}, ValueError, "groups and bucket_bytes/first_bucket_bytes .*got Groups\\(2\\), bucket_bytes=1024"),
        ({"num_groups": 2, "first_bucket_bytes": None}, ValueError, "got Groups\\(2\\), bucket_bytes='auto', first_bucket_bytes=None"),
    ]


@pytest.mark.parametrize("case", range(len(_bad_groups())))
def test_bad_groups_say_what_they_got(case):
    kwargs, error, message = _bad_groups()[case]
    with pytest.raises(error, match=message):
        keras_ring.wrap(keras.optimizers.SGD(0.1), **kwargs)
    with pytest.raises(error, match=message):
        keras_ring.DistributedGradientTape(tf.GradientTape(), **kwargs)


def test_optimizer_name_must_be_a_str_and_empty_is_the_default():
    with pytest.raises(TypeError, match="name must be a str or None, got 3"):
        keras_ring.DistributedOptimizer(keras.optimizers.SGD(0.1), name=3)
    optimizer = keras_ring.DistributedOptimizer(keras.optimizers.SGD(0.1), name="")
    assert optimizer.__dict__["_keras_ring_state"].options.name == "gradients"


def test_groups_win_over_num_groups_with_a_warning_as_in_horovod():
    with pytest.warns(UserWarning, match="num_groups=3 is ignored: groups is given"):
        optimizer = keras_ring.wrap(keras.optimizers.SGD(0.1), groups=np.int64(2), num_groups=3)
    assert optimizer.__dict__["_keras_ring_state"].options.groups.count == 2


def test_a_count_of_groups_splits_as_horovod_does_last_variables_first():
    # Horovod splits 5 gradients in variable order into [0, 1], [2, 3], [4]; they are sent
    # in reverse variable order (wire position p is variable 4 - p), the last group first.
    assert Groups(count=3).plan(5, None, "t") == [[0], [1, 2], [3, 4]]
    assert Groups(count=1).plan(3, None, "t") == [[0, 1, 2]]
    assert Groups(count=4).plan(2, None, "t") == [[0], [1]]  # no empty collectives
    assert Groups(count=2).plan(0, None, "t") == []


def test_listed_groups_travel_together_and_the_rest_alone():
    a, b, c, d = (tf.Variable([float(i)]) for i in range(4))
    keras_var = keras.Variable([1.0])
    groups = Groups.create("t", [[a, c], [keras_var.value]], 0)
    # Wire order d, c, b, a, keras_var: {c, a} issued where its first member is.
    assert groups.plan(5, [d, c, b, a, keras_var], "t") == [[0], [1, 3], [2], [4]]
    with pytest.raises(ValueError, match="groups lists variables, but the variables of these "
                                         "gradients are not known yet"):
        groups.plan(2, None, "t")
    assert repr(Groups(count=3)) == "Groups(3)"


@pytest.mark.parametrize("name, instead", [
    ("Adasum", "use keras_ring.Average"),
    ("start_timeline", "KERAS_RING_TIMELINE=path"),
    ("stop_timeline", "keras_ring.timeline.record(False)"),
])
def test_horovods_names_that_keras_ring_lacks_say_what_to_use(name, instead):
    with pytest.raises(AttributeError, match=f"no attribute '{name}': .*{re.escape(instead)}"):
        getattr(keras_ring, name)
    with pytest.raises(AttributeError, match=r"no attribute 'no_such_name'$"):
        keras_ring.no_such_name


def test_options_given_by_position_are_refused_naming_them():
    # Horovod's Keras API takes name second: TypeError "wrap() takes 1 positional argument".
    with pytest.raises(TypeError, match=r"DistributedOptimizer\) takes the optimizer by "
                                        r"position .* 1 more positional argument\(s\) \('opt'\)"):
        keras_ring.DistributedOptimizer(keras.optimizers.SGD(0.1), "opt")
