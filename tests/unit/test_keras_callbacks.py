"""Callback arguments, formulas and errors in one process (size 1)."""

import numpy as np
import pytest

import keras
import keras_ring
import keras_ring.runtime
from keras_ring.callbacks import (
    BestModelCheckpoint,
    BroadcastGlobalVariablesCallback,
    LearningRateScheduleCallback,
    LearningRateWarmupCallback,
    MetricAverageCallback,
    on_rank_zero,
)
from keras_ring.callbacks._learning_rate import momentum_buffers, set_rate


@pytest.fixture(scope="module", autouse=True)
def initialized():
    keras_ring.init()
    yield


@pytest.mark.parametrize("make, message", [
    (lambda: BroadcastGlobalVariablesCallback(-1), "root_rank must be a non-negative int, got -1"),
    (lambda: BroadcastGlobalVariablesCallback("0"), "got '0'"),
    (lambda: LearningRateWarmupCallback(warmup_epochs=-1), "warmup_epochs must be a non-negative number, got -1"),
    (lambda: LearningRateWarmupCallback(initial_lr=0), "initial_lr must be a positive number, got 0"),
    (lambda: LearningRateWarmupCallback(steps_per_epoch=0), "steps_per_epoch must be a positive number, got 0"),
    (lambda: LearningRateScheduleCallback(0.1, 0.5, start_epoch=3, end_epoch=3), "end_epoch must be .* greater than start_epoch=3, got 3"),
    (lambda: LearningRateScheduleCallback(0.1, 0.5, start_epoch=-1), "start_epoch must be a non-negative number, got -1"),
    (lambda: LearningRateScheduleCallback(0.1, 0.5, start_epoch=float("nan")), "start_epoch must be a non-negative number, got nan"),
    (lambda: LearningRateScheduleCallback(0.1, 0.5, end_epoch="30"), "end_epoch must be None or a number greater than start_epoch=0, got '30'"),
    (lambda: LearningRateScheduleCallback(-0.1, 0.5), "initial_lr must be a non-negative number or None, got -0.1"),
    # Horovod's call, as its Spark example writes it: the path came from its estimator.
    (lambda: BestModelCheckpoint(monitor="val_loss", mode="auto", save_freq="epoch"),
     "BestModelCheckpoint needs filepath=..., e.g. filepath='best.keras'"),
])
def test_invalid_arguments_say_what_was_received(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_schedule_multiplier_must_be_a_number_or_function():
    with pytest.raises(TypeError, match="multiplier must be a number or a function .* got 'x'"):
        LearningRateScheduleCallback(0.1, "x")


def test_warmup_formula_at_size_one_is_constant_and_schedule_decays():
    warmup = LearningRateWarmupCallback(initial_lr=0.4, warmup_epochs=2)
    warmup._steps = 4
    assert [warmup.learning_rate_at(e, b) for e in range(2) for b in range(4)] == [0.4] * 8
    assert warmup.learning_rate_at(2, 0) is None
    schedule = LearningRateScheduleCallback(1.0, 0.1, start_epoch=2, end_epoch=4)
    assert [schedule.learning_rate_at(e) for e in range(5)] == [None, None, 1.0, pytest.approx(0.1), None]


def test_schedule_takes_float_epochs_as_horovods_examples_pass_them():
    # keras_imagenet_resnet50.py: start_epoch=args.warmup_epochs, an argparse float.
    whole = LearningRateScheduleCallback(1.0, 0.5, start_epoch=2.0, end_epoch=4.0)
    assert [whole.learning_rate_at(e) for e in range(5)] == [None, None, 1.0, 0.5, None]
    # Compared as Horovod compares: epoch >= 1.5 from epoch 2, whose factor is 0.5 ** 0.5.
    half = LearningRateScheduleCallback(1.0, 0.5, start_epoch=1.5)
    assert [half.learning_rate_at(e) for e in range(3)] == [None, None, pytest.approx(0.5 ** 0.5)]


def test_warmup_needs_steps_per_epoch_when_fit_cannot_tell():
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")

    def forever():
        while True:
            yield np.zeros((2, 2), "float32"), np.zeros((2, 1), "float32")

    with pytest.raises(ValueError, match="pass steps_per_epoch="):
        model.fit(forever(), epochs=1, verbose=0, shuffle=False,
                  callbacks=[LearningRateWarmupCallback(1)])


@pytest.mark.parametrize("make", [lambda: LearningRateWarmupCallback(None, warmup_epochs=2),
                                  lambda: LearningRateScheduleCallback(None, 0.5)],
                         ids=["warmup", "schedule"])
def test_an_elastic_job_must_give_initial_lr(make, monkeypatch):
    # Made anew in train() after a reset, the callback aimed at the committed, already warmed
    # or decayed rate: 4x too small after one reset, silently.
    monkeypatch.setattr(keras_ring.runtime.RUNTIME, "_elastic", object())  # a worker's client
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    with pytest.raises(ValueError, match="pass initial_lr in an elastic job"):
        model.fit(np.zeros((4, 2)), np.zeros((4, 1)), epochs=1, verbose=0, callbacks=[make()])


def test_momentum_correction_scales_sgd_velocity_but_not_adam_moments():
    variables = [keras.Variable(np.ones(3, "float32"))]
    sgd = keras.optimizers.SGD(0.1, momentum=0.9)
    sgd.build(variables)
    sgd.momentums[0].assign(np.array([1.0, -2.0, 4.0], "float32"))
    set_rate(sgd, 0.4, momentum_correction=True)
    np.testing.assert_allclose(sgd.momentums[0].numpy(), [4.0, -8.0, 16.0], rtol=1e-6)
    assert sgd.learning_rate.numpy() == np.float32(0.4)
    set_rate(sgd, 0.2, momentum_correction=False)
    np.testing.assert_allclose(sgd.momentums[0].numpy(), [4.0, -8.0, 16.0], rtol=1e-6)
    adam = keras.optimizers.Adam(0.1)
    adam.build(variables)
    assert momentum_buffers(adam) == []
    lso = keras.optimizers.LossScaleOptimizer(keras.optimizers.RMSprop(0.1, momentum=0.5))
    lso.build(variables)
    assert len(momentum_buffers(lso)) == 1


def test_metric_average_at_size_one_keeps_values_and_skips_non_numbers():
    logs = {"loss": 0.5, "accuracy": np.float32(0.25), "note": "text", "flag": True}
    MetricAverageCallback().on_epoch_end(0, logs)
    assert logs == {"loss": 0.5, "accuracy": 0.25, "note": "text", "flag": True}


def test_on_rank_zero_at_rank_zero_is_the_callback_itself():
    callback = keras.callbacks.History()
    assert on_rank_zero(callback) is callback
    with pytest.raises(TypeError, match="takes a keras.callbacks.Callback, got builtins.str"):
        on_rank_zero("checkpoint")


def test_warmup_announces_its_end_after_the_epochs_progress_bar(capsys):
    # As Keras's EarlyStopping does: once the epoch's progress bar is complete, never in the
    # middle of its carriage-return updates.
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras_ring.wrap(keras.optimizers.SGD(0.1)), loss="mse")
    model.fit(np.ones((32, 3)), np.ones((32, 1)), batch_size=4, epochs=2, verbose=1,
              callbacks=[LearningRateWarmupCallback(warmup_epochs=1, verbose=1)])
    out = capsys.readouterr().out
    message = "Epoch 1: finished gradual learning rate warmup to 0.1."
    assert out.count(message) == 1, out
    at = out.index(message)
    # After the epoch's last step was shown and its line ended, before the next epoch.
    assert out.index("8/8") < at < out.index("Epoch 2/2"), out
    assert out[at - 1] == "\n", out


def test_the_rate_each_epoch_ended_with_is_in_the_logs():
    # The recipe of LearningRateScheduleCallback's docstring: a step at epoch 2 (a function,
    # not a float: a float decays every epoch). After a one-epoch warmup at size one.
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras_ring.wrap(keras.optimizers.SGD(0.4)), loss="mse")
    history = model.fit(np.ones((8, 3)), np.ones((8, 1)), batch_size=4, epochs=4, verbose=0,
                        callbacks=[LearningRateWarmupCallback(warmup_epochs=1),
                                   LearningRateScheduleCallback(0.4, 1.0, 1, end_epoch=2),
                                   LearningRateScheduleCallback(0.4, lambda e: 1e-1, 2)])
    assert history.history["learning_rate"] == pytest.approx([0.4, 0.4, 0.04, 0.04])


def test_horovods_device_argument_is_accepted_and_ignored():
    # hvd.callbacks.BroadcastGlobalVariablesCallback(0, device='') and MetricAverageCallback(
    # '/cpu:0'), Horovod's placement of their ops.
    assert BroadcastGlobalVariablesCallback(0, "").root_rank == 0
    assert BroadcastGlobalVariablesCallback(0, device="/cpu:0").root_rank == 0
    average = MetricAverageCallback("/cpu:0")
    logs = {"loss": 0.5}
    average.on_epoch_end(0, logs)
    assert logs == {"loss": 0.5}


@pytest.mark.parametrize("make, error, message", [
    # A process set in device's place (keras_ring's old order): refused now, not at epoch end.
    (lambda: MetricAverageCallback(keras_ring.global_process_set), TypeError,
     "MetricAverageCallback: device is Horovod's placement string .* pass process_set= by keyword"),
    (lambda: MetricAverageCallback(process_set=[0, 1]), TypeError,
     "MetricAverageCallback: process_set must be a keras_ring.ProcessSet, got list"),
    (lambda: BroadcastGlobalVariablesCallback(0, process_set="all"), TypeError,
     "BroadcastGlobalVariablesCallback: process_set must be a keras_ring.ProcessSet, got str"),
])
def test_callback_arguments_of_the_wrong_kind_fail_when_made(make, error, message):
    with pytest.raises(error, match=message):
        make()


def test_optimizer_settings_compare_by_value_and_never_fail_to_be_read():
    # fit's epoch check compares digests of the settings: equal values of other types (a
    # user's 1 for 1.0, NumPy's float64) must not differ there, and an optimizer whose
    # get_config raises must still give every rank something to send.
    from keras_ring import _optimizer_settings as settings

    def digest(optimizer):
        return settings.digest(settings.settings(optimizer))

    assert digest(keras.optimizers.SGD(0.1, clipnorm=1)) == digest(
        keras.optimizers.SGD(0.5, clipnorm=1.0, name="other"))  # rate and name left out
    assert digest(keras.optimizers.SGD(momentum=np.float64(0.9))) == digest(
        keras.optimizers.SGD(momentum=0.9))
    assert digest(keras.optimizers.SGD(momentum=0.9)) != digest(keras.optimizers.SGD(momentum=0.5))
    # Messages show a whole number as the program wrote it, not as 8.0.
    assert repr(settings.canonical({"units": np.float32(8.0), "bias": -0.0, "rate": 0.5})) == (
        "{'bias': 0, 'rate': 0.5, 'units': 8}")

    class Unreadable(keras.optimizers.SGD):
        def get_config(self):
            raise RuntimeError("no config")

    assert settings.settings(Unreadable()) == "no get_config (RuntimeError)"
