"""The callbacks under mpirun: broadcast timing, metric averaging, warmup, schedule, rank 0."""

import numpy as np
import pytest
import tensorflow as tf

import keras
import keras_ring
from keras_ring.callbacks import (
    BroadcastGlobalVariablesCallback,
    BestModelCheckpoint,
    LearningRateScheduleCallback,
    LearningRateWarmupCallback,
    MetricAverageCallback,
    average_logs,
    on_rank_zero,
)

from tests.parallel import keras_support as ks

BATCH, STEPS = 4, 3


class Probe(keras.callbacks.Callback):
    """Records what a callback later in the list sees: rates, momentum, weights, logs."""

    def __init__(self):
        super().__init__()
        self.epoch = 0
        self.rates, self.begin_momentum, self.end_momentum, self.epoch_logs = {}, {}, {}, []
        self.first_weights = self.first_optimizer_variables = None

    def _momentum(self):
        buffers = getattr(self.model.optimizer, "momentums", [])
        return [b.numpy().copy() for b in buffers]

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        if self.first_weights is None:
            self.first_weights = ks.weights(self.model)
            self.first_optimizer_variables = [v.numpy() for v in self.model.optimizer.variables]
        self.rates[self.epoch, batch] = float(self.model.optimizer.learning_rate.numpy())
        self.begin_momentum[self.epoch, batch] = self._momentum()

    def on_train_batch_end(self, batch, logs=None):
        self.end_momentum[self.epoch, batch] = self._momentum()

    def on_epoch_end(self, epoch, logs=None):
        self.epoch_logs.append(dict(logs))


class RankSpecificRestore(keras.callbacks.Callback):
    """Stands in for a checkpoint restore in on_train_begin that differs between ranks."""

    def __init__(self, rank):
        super().__init__()
        self.rank = rank

    def on_train_begin(self, logs=None):
        self.model.set_weights(ks.weights(ks.mlp(5000 + self.rank)))
        self.model.optimizer.iterations.assign(10 * self.rank + 1)


def _fit(model, optimizer, rank, size, callbacks, epochs=1, seed=0, **kwargs):
    model.compile(optimizer=optimizer, loss=ks.loss(), metrics=["accuracy"])
    x, y = ks.classification_data(size * BATCH * STEPS, seed=seed)
    return model.fit(ks.shard(x, rank, size, BATCH), ks.shard(y, rank, size, BATCH),
                     batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0,
                     callbacks=callbacks, **kwargs)


def test_broadcast_happens_before_the_first_step_and_after_a_restore(world):
    rank, size = world
    root = size - 1
    probe = Probe()
    # The restore comes after the broadcast in the list, and still loses to it: the
    # broadcast waits until every on_train_begin has run.
    callbacks = [BroadcastGlobalVariablesCallback(root), RankSpecificRestore(rank), probe]
    model = ks.mlp(ks.rank_seed(rank))
    _fit(model, keras_ring.wrap(keras.optimizers.Adam(0.01)), rank, size, callbacks)
    ks.assert_weights_close(probe.first_weights, ks.weights(ks.mlp(5000 + root)), atol=0.0)
    # Adam's slots existed at the first step and hold the root's values everywhere.
    assert len(probe.first_optimizer_variables) == 2 + 2 * len(model.trainable_variables)
    assert int(probe.first_optimizer_variables[0]) == 10 * root + 1
    ks.assert_same_on_all_ranks(probe.first_optimizer_variables + ks.weights(model))


def test_broadcast_rejects_a_root_outside_the_job(world):
    rank, size = world
    with pytest.raises(ValueError, match=f"root_rank={size} is not a rank of this job of size {size}"):
        _fit(ks.mlp(ks.rank_seed(rank)), keras_ring.wrap(keras.optimizers.SGD(0.1)), rank, size,
             [BroadcastGlobalVariablesCallback(size)])


def test_metric_average_gives_every_rank_the_average(world):
    rank, size = world
    local, after = Probe(), Probe()
    x_val, y_val = ks.classification_data(8, seed=100 + rank)  # differs per rank
    history = _fit(ks.mlp(ks.rank_seed(rank)), keras_ring.wrap(keras.optimizers.SGD(0.1)),
                   rank, size, [BroadcastGlobalVariablesCallback(0), local,
                                MetricAverageCallback(), after],
                   epochs=2, seed=rank, validation_data=(x_val, y_val))
    keys = sorted(history.history)
    assert keys == ["accuracy", "loss", "val_accuracy", "val_loss"]
    for epoch in range(2):
        mine = np.array([local.epoch_logs[epoch][k] for k in keys])
        everyone = keras_ring.allgather(tf.constant(mine[None, :]), name="test.logs").numpy()
        averaged = np.array([history.history[k][epoch] for k in keys])
        np.testing.assert_allclose(averaged, everyone.mean(axis=0), rtol=1e-12)
        assert [after.epoch_logs[epoch][k] for k in keys] == list(averaged)
    assert not np.allclose(everyone[0], everyone[-1])  # the ranks really did differ
    ks.assert_same_on_all_ranks([np.array([history.history[k] for k in keys])])


def test_evaluate_results_average_with_average_logs_as_documented(world):
    # evaluate() has no epoch end: MetricAverageCallback leaves its results per rank (Keras
    # hands callbacks a copy of what it returns); average_logs is the documented remedy.
    rank, size = world
    model = ks.mlp(ks.rank_seed(0))
    model.compile(optimizer=keras_ring.wrap(keras.optimizers.SGD(0.1)), loss=ks.loss(),
                  metrics=["accuracy"])
    x, y = ks.classification_data(8, seed=200 + rank)  # differs per rank
    mine = model.evaluate(x, y, verbose=0, return_dict=True,
                          callbacks=[MetricAverageCallback()])
    # float64, as average_logs reduces: a float32 mean of 4 ranks differs in the 8th digit.
    everyone = keras_ring.allgather(
        tf.constant([[mine["loss"], mine["accuracy"]]], tf.float64), name="test.evaluate").numpy()
    assert not np.allclose(everyone[0], everyone[-1])  # the ranks really did differ
    averaged = average_logs(dict(mine))
    np.testing.assert_allclose([averaged["loss"], averaged["accuracy"]], everyone.mean(axis=0),
                               rtol=1e-12)


def test_average_logs_takes_what_evaluate_returns_by_default(world):
    # evaluate() returns a list (or one number without metrics): average_logs(list) raised
    # "AttributeError: 'list' object has no attribute 'items'".
    rank, size = world
    mean = (size - 1) / 2
    listed = [float(rank), 2.0 * rank]
    assert average_logs(listed) is listed
    assert listed == [mean, 2 * mean]
    assert average_logs((float(rank), 1.0)) == (mean, 1.0)
    assert average_logs(float(rank)) == mean
    assert average_logs(np.float32(rank)) == mean
    with pytest.raises(TypeError, match=r"average_logs: logs must be a dict of metrics, a list "
                                        r"of them or a number .* got str 'loss'"):
        average_logs("loss")


def test_metric_average_averages_per_class_arrays_too(world):
    # F1Score(average=None) logs one value per class: an array, averaged element by element.
    rank, size = world
    logs = {"loss": float(rank), "f1": np.array([rank, 2.0 * rank, 1.0], np.float32),
            "note": "text"}
    MetricAverageCallback().on_epoch_end(0, logs)
    mean = (size - 1) / 2
    assert logs["loss"] == mean and logs["note"] == "text"
    np.testing.assert_array_equal(logs["f1"], [mean, 2 * mean, 1.0])
    with pytest.raises(keras_ring.CollectiveMismatchError, match=r"f1\[2\]"):
        MetricAverageCallback().on_epoch_end(0, {"f1": np.zeros(2 + (rank == size - 1))})


def _warmup_rate(initial, size, warmup_epochs, epoch, batch):
    e = epoch + (batch + 1) / STEPS
    if e >= warmup_epochs:
        return initial
    return initial / size * (e * (size - 1) / warmup_epochs + 1)


def test_warmup_rates_and_momentum_correction(world):
    rank, size = world
    initial = 0.05 * size
    probe = Probe()
    optimizer = keras_ring.wrap(keras.optimizers.SGD(initial, momentum=0.9))
    _fit(ks.mlp(ks.rank_seed(rank)), optimizer, rank, size,
         [BroadcastGlobalVariablesCallback(0), LearningRateWarmupCallback(warmup_epochs=2), probe],
         epochs=3)
    for (epoch, batch), rate in probe.rates.items():
        expected = _warmup_rate(initial, size, 2, epoch, batch)
        np.testing.assert_allclose(rate, expected, rtol=1e-6, err_msg=f"epoch {epoch} batch {batch}")
    assert probe.rates[0, 0] == pytest.approx(initial / size * (1 + (size - 1) / (2 * STEPS)), rel=1e-6)
    assert probe.rates[1, STEPS - 1] == np.float32(initial)  # the last warmup batch: exactly
    assert all(probe.rates[2, b] == np.float32(initial) for b in range(STEPS))
    # Momentum correction: between two batches the velocity is scaled by new / old rate.
    order = sorted(probe.rates)
    for prev, cur in zip(order, order[1:]):
        ratio = probe.rates[cur] / probe.rates[prev]
        for end, begin in zip(probe.end_momentum[prev], probe.begin_momentum[cur]):
            np.testing.assert_allclose(begin, end * ratio, rtol=1e-5, atol=1e-9)
    assert any(probe.rates[cur] != probe.rates[prev] for prev, cur in zip(order, order[1:]))


def test_warmup_ends_at_its_rate_when_one_step_runs_several_batches(world):
    """With steps_per_execution=2 the callback runs before batches 0 and 2 only, each rate
    covering its group. Set for the group's first batch, the last warmup group began before
    the warmup's end, so the rate stopped one group short of initial_lr for the rest of
    training (0.0193 for 0.02 in 14 batches)."""
    rank, size = world
    initial = 0.05 * size
    probe = Probe()
    model = ks.mlp(ks.rank_seed(rank))
    model.compile(optimizer=keras_ring.wrap(keras.optimizers.SGD(initial, momentum=0.9)),
                  loss=ks.loss(), steps_per_execution=2)
    x, y = ks.classification_data(size * BATCH * STEPS, seed=0)
    model.fit(ks.shard(x, rank, size, BATCH), ks.shard(y, rank, size, BATCH), batch_size=BATCH,
              epochs=2, shuffle=False, verbose=0,
              callbacks=[BroadcastGlobalVariablesCallback(0),
                         LearningRateWarmupCallback(warmup_epochs=1), probe])
    assert sorted(probe.rates) == [(0, 0), (0, 2), (1, 0), (1, 2)]
    np.testing.assert_allclose(probe.rates[0, 0], _warmup_rate(initial, size, 1, 0, 1), rtol=1e-6)
    assert probe.rates[0, 0] < np.float32(initial)
    assert [probe.rates[k] for k in [(0, 2), (1, 0), (1, 2)]] == [np.float32(initial)] * 3


@pytest.mark.parametrize("callback", ["warmup", "schedule"])
def test_a_rate_restored_on_the_root_only_is_every_ranks_initial_lr(world, callback):
    # Horovod's resume: the root restores its checkpoint (its rate 0.75 of the others'), the
    # broadcast comes in the first batch, after on_train_begin. Taking each rank's own rate
    # there made each rank warm up (or decay) to its own, with exit 0 and weights apart.
    rank, size = world
    restored = 0.05 * size * (0.75 if rank == 0 else 1.0)
    probe = Probe()
    made = (LearningRateWarmupCallback(warmup_epochs=2) if callback == "warmup"
            else LearningRateScheduleCallback(None, multiplier=0.5, start_epoch=1))
    model = _fit(ks.mlp(ks.rank_seed(rank)), keras_ring.wrap(keras.optimizers.SGD(restored)),
                 rank, size, [BroadcastGlobalVariablesCallback(0), made, probe], epochs=2).model
    assert made.initial_lr == pytest.approx(0.05 * size * 0.75)
    ks.assert_same_on_all_ranks(ks.weights(model) + [probe.rates[1, STEPS - 1]])


def test_warmup_refuses_a_learning_rate_schedule(world):
    rank, size = world
    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, decay_steps=10, decay_rate=0.9)
    with pytest.raises(ValueError, match="ExponentialDecay.*cannot be set"):
        _fit(ks.mlp(ks.rank_seed(rank)), keras_ring.wrap(keras.optimizers.SGD(schedule)), rank,
             size, [LearningRateWarmupCallback(warmup_epochs=1)])


def test_schedule_staircase_within_its_epoch_range(world):
    rank, size = world
    probe = Probe()
    schedule = LearningRateScheduleCallback(0.2, multiplier=0.5, start_epoch=1, end_epoch=3)
    _fit(ks.mlp(ks.rank_seed(rank)), keras_ring.wrap(keras.optimizers.SGD(0.05)), rank, size,
         [BroadcastGlobalVariablesCallback(0), schedule, probe], epochs=4)
    per_epoch = [probe.rates[e, b] for e in range(4) for b in range(STEPS)]
    expected = [0.05] * STEPS + [0.2] * STEPS + [0.1] * STEPS + [0.1] * STEPS
    np.testing.assert_allclose(per_epoch, expected, rtol=1e-6)


def test_schedule_smooth_uses_the_fractional_epoch(world):
    rank, size = world
    probe = Probe()
    schedule = LearningRateScheduleCallback(0.3, multiplier=lambda e: 1.0 / (1.0 + e),
                                            staircase=False, momentum_correction=False)
    _fit(ks.mlp(ks.rank_seed(rank)), keras_ring.wrap(keras.optimizers.SGD(0.05, momentum=0.5)),
         rank, size, [BroadcastGlobalVariablesCallback(0), schedule, probe], epochs=2)
    for (epoch, batch), rate in probe.rates.items():
        np.testing.assert_allclose(rate, 0.3 / (1.0 + epoch + batch / STEPS), rtol=1e-6)
    # Without momentum correction the velocity is left as the step left it.
    for key in probe.rates:
        if key != (0, 0):
            prev = max(k for k in probe.rates if k < key)
            for end, begin in zip(probe.end_momentum[prev], probe.begin_momentum[key]):
                np.testing.assert_array_equal(begin, end)


def test_on_rank_zero_runs_the_callback_on_rank_zero_only(world, tmp_path):
    rank, size = world
    path = tmp_path / "log.csv"
    logger = keras.callbacks.CSVLogger(str(path))
    wrapped = on_rank_zero(logger)
    assert (wrapped is logger) == (rank == 0)
    _fit(ks.mlp(ks.rank_seed(rank)), keras_ring.wrap(keras.optimizers.SGD(0.1)), rank, size,
         [BroadcastGlobalVariablesCallback(0), MetricAverageCallback(), wrapped], epochs=2)
    assert path.exists() == (rank == 0)
    if rank == 0:
        assert len(path.read_text().strip().splitlines()) == 3  # header and two epochs


class EpochSignal(keras.callbacks.Callback):
    """A metric whose best epoch differs between rank 0's own values and all ranks' mean."""

    def on_epoch_end(self, epoch, logs=None):
        logs["signal"] = float((3, 1, 2)[epoch] if keras_ring.rank() == 0 else (1, 5, 0)[epoch])


def test_best_model_checkpoint_keeps_the_best_of_the_averaged_metric_on_rank_zero(world, tmp_path):
    # Means over the ranks: epoch 1 best so far, epoch 2 worse, epoch 3 best (rank 0 alone
    # would have saved epochs 1 and 2). Only rank 0 writes.
    rank, size = world
    best = BestModelCheckpoint(monitor="signal", mode="min",
                               filepath=str(tmp_path / "best_{epoch}.keras"))
    _fit(ks.mlp(ks.rank_seed(rank)), keras_ring.wrap(keras.optimizers.SGD(0.1)), rank, size,
         [BroadcastGlobalVariablesCallback(0), EpochSignal(), MetricAverageCallback(), best],
         epochs=3)
    saved = sorted(p.name for p in tmp_path.iterdir())
    assert saved == (["best_1.keras", "best_3.keras"] if rank == 0 else [])
    if rank == 0:
        assert best.best == (2.0 + 0.0 * (size - 1)) / size  # epoch 3's mean
        restored = keras.models.load_model(tmp_path / "best_3.keras")
        assert [w.shape for w in restored.weights] == [w.shape for w in best.model.weights]


# --- the learning rates agree (keras_ring/_rate_check.py) -----------------------------------

class RankSignal(keras.callbacks.Callback):
    """Puts a metric in the epoch logs that stalls on rank 0 and improves elsewhere."""

    def on_epoch_end(self, epoch, logs=None):
        logs["signal"] = 1.0 if keras_ring.rank() == 0 else 1.0 - epoch


def _plateau_fit(rank, callbacks, epochs=4, callback_list=False):
    """ReduceLROnPlateau on a metric of this rank's own: rank 0 halves the rate after epoch 1.
    ``callback_list``: fit gets a keras.callbacks.CallbackList, which it takes as it is."""
    model = ks.mlp(ks.rank_seed(rank))
    model.compile(optimizer=keras_ring.wrap(keras.optimizers.SGD(0.05)), loss=ks.loss())
    x, y = ks.classification_data(BATCH * STEPS, seed=rank)
    plateau = keras.callbacks.ReduceLROnPlateau(monitor="signal", mode="min", factor=0.5,
                                                patience=0)
    epochs_begun = []
    probe = keras.callbacks.LambdaCallback(on_epoch_begin=lambda e, logs: epochs_begun.append(e))
    given = [BroadcastGlobalVariablesCallback(0), RankSignal(), *callbacks, plateau, probe]
    if callback_list:
        given = keras.callbacks.CallbackList(given, model=model)
    model.fit(x, y, batch_size=BATCH, epochs=epochs, verbose=0, callbacks=given)
    return model, epochs_begun


@pytest.mark.parametrize("callback_list", [False, True], ids=["list", "CallbackList"])
def test_a_rate_set_from_one_ranks_metrics_fails_every_rank_before_its_epoch_trains(
        world, callback_list):
    # Given a CallbackList, fit ran without any of keras_ring's checks: trained apart, exit 0.
    rank, size = world
    with pytest.raises(keras_ring.LearningRateMismatchError) as info:
        _plateau_fit(rank, [], callback_list=callback_list)
    message = str(info.value)
    others = ", ".join(f"rank {r} 0.05" for r in range(1, size))
    assert f"as epoch 2 begins (rank 0 0.025, {others})" in message, message
    assert "MetricAverageCallback() first" in message and info.value.rank == 1


def test_a_rate_changed_on_one_rank_in_the_last_epoch_fails_every_rank_as_fit_ends(world):
    # Rates were compared as each epoch began: a change in the last (or only) epoch met no
    # check, and fit returned weights that differed by rank, exit 0 (probe F).
    rank, size = world
    model = ks.mlp(ks.rank_seed(0))
    model.compile(optimizer=keras_ring.wrap(keras.optimizers.SGD(0.05)), loss=ks.loss())
    x, y = ks.classification_data(BATCH * STEPS, seed=rank)

    def set_rate(batch, logs):
        if rank == size - 1 and batch == 0:
            model.optimizer.learning_rate.assign(0.5)

    with pytest.raises(keras_ring.LearningRateMismatchError) as info:
        model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0,
                  callbacks=[keras.callbacks.LambdaCallback(on_train_batch_end=set_rate)])
    message = str(info.value)
    assert f"as fit ends (rank 0 0.05, rank {size - 1} 0.5)" in message, message
    assert "during the last epoch" in message and info.value.rank == size - 1, message


def test_averaged_metrics_keep_the_rates_equal_and_the_epochs_run(world):
    rank, _ = world
    model, epochs_begun = _plateau_fit(rank, [MetricAverageCallback()])
    assert epochs_begun == [0, 1, 2, 3]
    ks.assert_same_on_all_ranks(ks.weights(model) + [model.optimizer.learning_rate.numpy()])


def _fine_tuned(rank, size, epochs, first_rate=0.05, broadcast=False):
    """keras-io's fine-tuning: fit, then a lower rate for one more fit, set on rank 1 only.
    Returns the model and the second fit's steps done."""
    model = ks.mlp(ks.rank_seed(0))
    model.compile(optimizer=keras_ring.wrap(keras.optimizers.SGD(first_rate)), loss=ks.loss())
    x, y = ks.classification_data(BATCH * STEPS, seed=rank)
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    if rank == 1:
        model.optimizer.learning_rate.assign(0.01)
    steps = []
    probe = keras.callbacks.LambdaCallback(on_train_batch_end=lambda b, logs: steps.append(b))
    callbacks = [BroadcastGlobalVariablesCallback(0)] if broadcast else []
    try:
        model.fit(x, y, batch_size=BATCH, epochs=epochs, verbose=0, callbacks=callbacks + [probe])
    finally:
        assert steps == [] or broadcast  # refused before the first step
    return model, steps


@pytest.mark.parametrize("epochs", [1, 2])
def test_a_rate_set_on_one_rank_between_fits_fails_before_the_next_fit_trains(world, epochs):
    # A one-epoch fit was never compared (the first epoch waits for the broadcast callback):
    # the ranks trained apart with exit 0; with two, only after an epoch trained apart.
    rank, size = world
    with pytest.raises(keras_ring.LearningRateMismatchError) as info:
        _fine_tuned(rank, size, epochs)
    message = str(info.value)
    # Rank 0's rate and those that differ from it.
    assert "different learning rates as training begins (rank 0 0.05, rank 1 0.01)" \
        in message, message
    assert "set on some ranks only" in message and info.value.rank == 1


def test_the_broadcast_callback_makes_a_rate_set_on_one_rank_alike_before_it_is_compared(world):
    rank, size = world
    model, steps = _fine_tuned(rank, size, 1, broadcast=True)
    assert len(steps) == STEPS
    assert model.optimizer.learning_rate.numpy() == np.float32(0.05)  # the root's
    ks.assert_same_on_all_ranks(ks.weights(model))


@pytest.mark.parametrize("setting", ["momentum", "clipnorm", "inner", "class", "schedule"])
def test_optimizers_built_apart_fail_every_rank_before_the_first_epoch_trains(world, setting):
    """Momentum, clipnorm and the like are Python numbers, not variables: no broadcast makes
    them equal, the averaged metrics stayed equal, and the ranks' weights silently went
    apart (fit returned on every rank)."""
    rank, size = world
    last = rank == size - 1
    if setting == "inner":  # a loss-scale optimizer's inner one differs
        optimizer = keras.optimizers.LossScaleOptimizer(
            keras.optimizers.Adam(0.01, beta_1=0.8 if last else 0.9))
        shown = "inner_optimizer: rank 0"
    elif setting == "class":  # named, not the settings one class has and the other lacks
        optimizer = keras.optimizers.Adam(0.05) if last else keras.optimizers.SGD(0.05)
        shown = f"; class: rank 0 'SGD', rank {size - 1} 'Adam'): "
    elif setting == "schedule":  # its rate drifts apart slowly: seen only at an epoch's end
        optimizer = keras.optimizers.SGD(keras.optimizers.schedules.ExponentialDecay(
            0.05, decay_steps=10, decay_rate=0.5 if last else 0.9))
        shown = "'config': {'decay_rate': 0.5,"  # after rank 0's schedule, whose is 0.9
    else:
        options = {"momentum": {"momentum": 0.5 if last else 0.9},
                   "clipnorm": {"clipnorm": 1.0} if last else {}}[setting]
        optimizer = keras.optimizers.SGD(0.05, **options)
        shown = {"momentum": f"momentum: rank 0 0.9, rank {size - 1} 0.5",
                 "clipnorm": f"clipnorm: rank 0 None, rank {size - 1} 1)"}[setting]
    model = ks.mlp(ks.rank_seed(rank))
    model.compile(optimizer=keras_ring.wrap(optimizer), loss=ks.loss())
    steps = []
    counter = keras.callbacks.LambdaCallback(on_train_batch_end=lambda b, logs: steps.append(b))
    x, y = ks.classification_data(BATCH * STEPS, seed=rank)
    with pytest.raises(keras_ring.OptimizerMismatchError) as info:
        model.fit(x, y, batch_size=BATCH, epochs=2, verbose=0,
                  callbacks=[BroadcastGlobalVariablesCallback(0), counter])
    message = str(info.value)
    assert "settings other than the learning rate as epoch 0 begins" in message, message
    assert shown in message and info.value.rank == size - 1, message
    assert steps == []


def test_optimizers_alike_but_for_their_names_and_rates_train(world):
    # Keras numbers unnamed optimizers as they are made; the rates are the broadcast's.
    rank, _ = world
    for _ in range(rank):
        keras.optimizers.SGD()
    model = ks.mlp(ks.rank_seed(rank))
    model.compile(optimizer=keras_ring.wrap(keras.optimizers.SGD(0.05 * (rank + 1),
                                                                 momentum=0.9)),
                  loss=ks.loss())
    x, y = ks.classification_data(BATCH * STEPS, seed=rank)
    model.fit(x, y, batch_size=BATCH, epochs=2, verbose=0,
              callbacks=[BroadcastGlobalVariablesCallback(0)])
    ks.assert_same_on_all_ranks(ks.weights(model))


def test_ranks_that_resume_at_different_epochs_fail_before_training(world, tmp_path):
    # BackupAndRestore under on_rank_zero: rank 0 resumes at epoch 2, the others start at 0
    # and would run two more epochs' steps than it. keras_ring's error, not a lost peer.
    rank, size = world
    x, y = ks.classification_data(BATCH * STEPS, seed=rank)
    backup = keras_ring.callbacks.on_rank_zero(keras.callbacks.BackupAndRestore(str(tmp_path)))

    class Interrupt(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            if epoch == 1:
                raise KeyboardInterrupt  # as a job killed mid-training: the backup stays

    def fit(*more):
        model = ks.mlp(ks.rank_seed(rank))
        model.compile(optimizer=keras_ring.wrap(keras.optimizers.SGD(0.1)), loss=ks.loss())
        model.fit(x, y, batch_size=BATCH, epochs=4, verbose=0,
                  callbacks=[BroadcastGlobalVariablesCallback(0), backup, *more])

    with pytest.raises(KeyboardInterrupt):
        fit(Interrupt())  # rank 0 backed up epochs 0 and 1
    with pytest.raises(keras_ring.EpochMismatchError) as info:
        fit()
    message = str(info.value)
    others = ", ".join(f"rank {r} at epoch 0" for r in range(1, size))
    assert f"different epochs (rank 0 at epoch 2, {others})" in message, message
    assert "its own backup_dir" in message and info.value.rank == 1
    assert "remove every rank's backup_dir to start over" in message  # per-rank backups apart


def test_rates_that_differ_before_the_broadcast_are_not_an_error(world):
    rank, _ = world
    model = ks.mlp(ks.rank_seed(rank))
    # A rate restored on one rank only: the broadcast callback sets the root's everywhere.
    model.compile(optimizer=keras_ring.wrap(keras.optimizers.SGD(0.1 * (rank + 1))),
                  loss=ks.loss())
    x, y = ks.classification_data(BATCH * STEPS, seed=rank)
    model.fit(x, y, batch_size=BATCH, epochs=2, verbose=0,
              callbacks=(BroadcastGlobalVariablesCallback(0),))
    ks.assert_same_on_all_ranks([model.optimizer.learning_rate.numpy()])


# --- train_on_batch's rates (keras_ring._rate_check.BatchRates) ----------------------------

def _batch_loop(rank, rate, set_rate=None, calls=4):
    """A train_on_batch loop that may set the rate before each call: ``set_rate(call)``
    returns the rate to set, or None. Returns the model."""
    model = ks.mlp(0)
    model.compile(optimizer=keras_ring.wrap(keras.optimizers.SGD(rate)), loss=ks.loss())
    x, y = ks.classification_data(BATCH * calls, seed=rank)
    for call in range(calls):
        new = set_rate(call) if set_rate else None
        if new is not None:
            model.optimizer.learning_rate.assign(new)
        model.train_on_batch(x[call * BATCH:(call + 1) * BATCH], y[call * BATCH:(call + 1) * BATCH])
    return model


def test_train_on_batch_compares_the_rates_at_its_first_call(world):
    # Before, train_on_batch never compared rates: the ranks trained apart, silently.
    rank, size = world
    with pytest.raises(keras_ring.LearningRateMismatchError) as info:
        _batch_loop(rank, 0.05 if rank < size - 1 else 0.2)
    assert f"at a train_on_batch call (rank 0 0.05, rank {size - 1} 0.2)" in str(info.value)
    assert info.value.rank == size - 1


def test_a_rate_each_rank_sets_from_its_own_loss_fails_every_rank(world):
    rank, size = world
    with pytest.raises(keras_ring.LearningRateMismatchError) as info:
        _batch_loop(rank, 0.05, lambda call: 0.01 * (rank + 1) if call == 2 else None)
    message = str(info.value)
    assert "at a train_on_batch call (rank 0 0.01, rank 1 0.02" in message, message
    assert "set the rate on some ranks only" in message


def test_a_rate_set_on_one_rank_alone_fails_every_rank_naming_the_cause(world):
    # That rank compares while the others train: their collectives differ.
    rank, size = world
    with pytest.raises(keras_ring.CollectiveMismatchError) as info:
        _batch_loop(rank, 0.05, lambda call: 0.01 if call == 2 and rank == 1 else None)
    message = str(info.value)
    assert "'keras_ring.rate_check.train_on_batch'" in message, message
    assert "learning rate check of train_on_batch ran on some ranks only" in message, message


@pytest.mark.parametrize("how", ["every rank", "schedule"])
def test_rates_that_change_alike_train_on(world, how):
    rank, _ = world
    if how == "schedule":  # its rate changes at every call, from the step count
        rate = keras.optimizers.schedules.ExponentialDecay(0.1, decay_steps=1, decay_rate=0.5)
        model = _batch_loop(rank, rate)
        assert float(model.optimizer.learning_rate.numpy()) == pytest.approx(0.1 * 0.5 ** 4)
    else:
        model = _batch_loop(rank, 0.05, lambda call: 0.1 / (call + 1))
    ks.assert_same_on_all_ranks(ks.weights(model))


# --- wrap() forgotten ----------------------------------------------------------------------

def test_the_broadcast_refuses_a_model_whose_optimizer_nobody_wrapped(world):
    # Each rank applied its own gradients from the root's weights: apart, with exit 0.
    rank, size = world
    model = ks.mlp(ks.rank_seed(rank))
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss=ks.loss())
    x, y = ks.classification_data(BATCH * STEPS, seed=rank)
    steps = []
    probe = keras.callbacks.LambdaCallback(on_train_batch_end=lambda b, logs: steps.append(b))
    with pytest.raises(ValueError, match=r"optimizers that keras_ring does not wrap "
                                         r"\(optimizer: SGD\)") as info:
        model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0,
                  callbacks=[BroadcastGlobalVariablesCallback(0), probe])
    assert "keras_ring.wrap(optimizer)" in str(info.value) and steps == []


@pytest.mark.parametrize("callback", ["average", "warmup", "schedule"])
def test_a_model_compiled_again_without_wrap_warns_and_keras_ring_callbacks_refuse_it(
        world, callback):
    # keras-io's fine-tuning: fit wrapped with a frozen base, unfreeze, compile again, and
    # wrap() forgotten the second time. Under MetricAverageCallback the ranks trained apart
    # with metrics that looked as usual, exit 0.
    rank, size = world
    model = ks.mlp(ks.rank_seed(0))
    model.compile(optimizer=keras_ring.wrap(keras.optimizers.SGD(0.05)), loss=ks.loss())
    x, y = ks.classification_data(BATCH * STEPS, seed=rank)
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    with pytest.warns(UserWarning, match=f"model '{model.name}' was compiled with a "
                      r"keras_ring.wrap\(\) optimizer before and now with optimizer: Adam, "
                      f"which keras_ring does not wrap: each of the {size} ranks will train alone"):
        model.compile(optimizer=keras.optimizers.Adam(1e-3), loss=ks.loss())
    who, made = {
        "average": ("MetricAverageCallback", MetricAverageCallback),
        "warmup": ("LearningRateWarmupCallback",
                   lambda: LearningRateWarmupCallback(initial_lr=1e-3, warmup_epochs=1)),
        "schedule": ("LearningRateScheduleCallback",
                     lambda: LearningRateScheduleCallback(1e-3, multiplier=0.5)),
    }[callback]
    steps = []
    probe = keras.callbacks.LambdaCallback(on_train_batch_end=lambda b, logs: steps.append(b))
    with pytest.raises(ValueError, match=f"{who}: model '{model.name}' trains with optimizers "
                                         r"that keras_ring does not wrap \(optimizer: Adam\)"):
        model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, callbacks=[made(), probe])
    assert steps == []
    model.compile(optimizer=keras_ring.wrap(keras.optimizers.Adam(1e-3)), loss=ks.loss())
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, callbacks=[made()])
    ks.assert_same_on_all_ranks(ks.weights(model))


class TapeAveraged(keras.Model):
    """Horovod's TF2 way inside Keras: a DistributedGradientTape and a plain optimizer."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = self.compute_loss(x=x, y=y, y_pred=self(x, training=True))
        tape = keras_ring.DistributedGradientTape(
            tape, backward_passes_per_step=getattr(self, "passes", 1))
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply(grads, self.trainable_variables)
        return {"loss": loss}


@pytest.mark.parametrize("passes, run_eagerly", [(1, False), (2, False), (2, True)])
def test_a_custom_step_that_averages_through_its_tape_is_not_refused(world, passes,
                                                                       run_eagerly):
    # Run eagerly, a first pass that only adds up its gradients makes no collective.
    rank, _ = world
    keras.utils.set_random_seed(ks.rank_seed(rank))
    inputs = keras.Input((ks.FEATURES,))
    model = TapeAveraged(inputs, keras.layers.Dense(ks.CLASSES)(inputs))
    model.passes = passes
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss=ks.loss(), run_eagerly=run_eagerly)
    x, y = ks.classification_data(BATCH * STEPS, seed=rank)
    model.fit(x, y, batch_size=BATCH, epochs=2, verbose=0,
              callbacks=[BroadcastGlobalVariablesCallback(0)])
    ks.assert_same_on_all_ranks(ks.weights(model))


class PlainTape(keras.Model):
    """keras-io's custom train_step, ported without wrap() or a DistributedGradientTape."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = self.compute_loss(x=x, y=y, y_pred=self(x, training=True))
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply(grads, self.trainable_variables)
        return {"loss": loss}


@pytest.mark.parametrize("run_eagerly", [False, True])
def test_the_broadcast_refuses_a_custom_step_that_averages_nothing(world, run_eagerly):
    # Each rank applied its own gradients from the root's weights: apart, with exit 0.
    rank, _ = world
    keras.utils.set_random_seed(ks.rank_seed(rank))
    inputs = keras.Input((ks.FEATURES,))
    model = PlainTape(inputs, keras.layers.Dense(ks.CLASSES)(inputs))
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss=ks.loss(), run_eagerly=run_eagerly)
    x, y = ks.classification_data(BATCH * STEPS, seed=rank)
    steps = []
    probe = keras.callbacks.LambdaCallback(on_train_batch_end=lambda b, logs: steps.append(b))
    with pytest.raises(ValueError, match=r"averaged no gradients in its first step .* wraps "
                                         r"none of its optimizers \(optimizer: SGD\)"):
        model.fit(x, y, batch_size=BATCH, epochs=2, verbose=0,
                  callbacks=[BroadcastGlobalVariablesCallback(0), probe])
    assert steps == []  # the callback raised at the end of the first step


# --- a model that keeps its optimizers as attributes (keras-io's GAN) ----------------------

LATENT = 4


class TwoOptimizerGAN(keras.Model):
    """keras-io's GAN in small: compile() gives Keras no optimizer (so model.optimizer is
    its default RMSprop, which train_step never applies) and keeps two as attributes."""

    def __init__(self, seed):
        super().__init__()
        keras.utils.set_random_seed(seed)
        self.discriminator = keras.Sequential([keras.Input((ks.FEATURES,)), keras.layers.Dense(1)])
        self.generator = keras.Sequential([keras.Input((LATENT,)),
                                           keras.layers.Dense(ks.FEATURES)])

    def compile(self, d_optimizer, g_optimizer):
        super().compile()
        self.d_optimizer, self.g_optimizer = d_optimizer, g_optimizer
        self.loss_fn = keras.losses.BinaryCrossentropy(from_logits=True)

    def train_step(self, data):
        real, noise = data
        ones, zeros = tf.ones((tf.shape(real)[0], 1)), tf.zeros((tf.shape(real)[0], 1))
        with tf.GradientTape() as tape:
            fake = self.discriminator(self.generator(noise))
            d_loss = self.loss_fn(ones, fake) + self.loss_fn(zeros, self.discriminator(real))
        weights = self.discriminator.trainable_weights
        self.d_optimizer.apply_gradients(zip(tape.gradient(d_loss, weights), weights))
        with tf.GradientTape() as tape:
            g_loss = self.loss_fn(zeros, self.discriminator(self.generator(noise)))
        weights = self.generator.trainable_weights
        self.g_optimizer.apply_gradients(zip(tape.gradient(g_loss, weights), weights))
        return {"d_loss": d_loss, "g_loss": g_loss}


class AttributeRates(keras.callbacks.Callback):
    """Records the rate each batch of the GAN's two optimizers and its unused compiled one."""

    def __init__(self):
        super().__init__()
        self.epoch, self.rates = 0, {}

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        self.rates[self.epoch, batch] = tuple(
            float(o.learning_rate.numpy())
            for o in (self.model.d_optimizer, self.model.g_optimizer, self.model.optimizer))


def _fit_gan(rank, size, rates, callbacks, epochs):
    gan = TwoOptimizerGAN(ks.rank_seed(rank))
    gan.compile(*(keras_ring.wrap(keras.optimizers.SGD(rate, momentum=0.9)) for rate in rates))
    x, _ = ks.classification_data(size * BATCH * STEPS, seed=0)
    noise = np.random.default_rng(1).normal(size=(len(x), LATENT)).astype("float32")
    probe = AttributeRates()
    history = gan.fit(ks.shard(x, rank, size, BATCH), ks.shard(noise, rank, size, BATCH),
                      batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0,
                      callbacks=[BroadcastGlobalVariablesCallback(0), *callbacks, probe])
    assert type(gan.optimizer).__name__ == "RMSprop"  # compile()'s own, unasked
    ks.assert_same_on_all_ranks(ks.weights(gan))
    return history.history, probe.rates


def test_warmup_warms_each_optimizer_a_gan_keeps_to_its_own_rate(world):
    # Only model.optimizer (the RMSprop nothing applies) was warmed up: the GAN's optimizers
    # kept their full rates from the first step, and the logs showed RMSprop's 0.001.
    rank, size = world
    d_rate, g_rate = 0.05 * size, 0.03 * size
    warmup = LearningRateWarmupCallback(warmup_epochs=2)
    logs, rates = _fit_gan(rank, size, (d_rate, g_rate), [warmup], epochs=3)
    assert warmup.initial_lr == {"d_optimizer": pytest.approx(d_rate),
                                 "g_optimizer": pytest.approx(g_rate)}
    for (epoch, batch), (d, g, unused) in rates.items():
        where = f"epoch {epoch} batch {batch}"
        expected = [_warmup_rate(initial, size, 2, epoch, batch) for initial in (d_rate, g_rate)]
        np.testing.assert_allclose([d, g], expected, rtol=1e-6, err_msg=where)
        assert unused == np.float32(0.001), where
    assert rates[0, 0][0] < d_rate  # warmed up, each to its own rate exactly
    assert rates[1, STEPS - 1][:2] == (np.float32(d_rate), np.float32(g_rate))
    assert "learning_rate" not in logs  # one key per optimizer, none for the unused one
    with pytest.raises(ValueError, match="needs initial_lr=, the rate of one optimizer"):
        warmup.learning_rate_at(0, 0)  # whose? (a TypeError, dict times float, before)
    assert warmup.learning_rate_at(0, STEPS - 1, initial_lr=d_rate) is not None
    ends = [rates[e, STEPS - 1] for e in range(3)]
    np.testing.assert_allclose(logs["d_optimizer_learning_rate"], [d for d, _, _ in ends])
    np.testing.assert_allclose(logs["g_optimizer_learning_rate"], [g for _, g, _ in ends])


@pytest.mark.parametrize("initial_lr", [None, {"d_optimizer": 0.2, "g_optimizer": 0.1}],
                         ids=["own rates", "a rate each"])
def test_a_schedule_scales_each_optimizer_a_gan_keeps_by_its_own_rate(world, initial_lr):
    rank, size = world
    schedule = LearningRateScheduleCallback(initial_lr, multiplier=0.5, start_epoch=1, end_epoch=3)
    logs, rates = _fit_gan(rank, size, (0.2, 0.1), [schedule], epochs=4)
    factors = [1.0, 1.0, 0.5, 0.5]  # before its range: the optimizers' own; after: the last
    for (epoch, batch), (d, g, unused) in rates.items():
        np.testing.assert_allclose([d, g], [0.2 * factors[epoch], 0.1 * factors[epoch]], 1e-6,
                                   err_msg=f"epoch {epoch} batch {batch}")
        assert unused == np.float32(0.001)
    assert "learning_rate" not in logs
    np.testing.assert_allclose(logs["d_optimizer_learning_rate"], [0.2 * f for f in factors], 1e-6)
    np.testing.assert_allclose(logs["g_optimizer_learning_rate"], [0.1 * f for f in factors], 1e-6)


@pytest.mark.parametrize("callback, message", [
    (lambda: LearningRateWarmupCallback(initial_lr=0.1, warmup_epochs=1),
     r"initial_lr=0.1 is one rate, but TwoOptimizerGAN trains with optimizers of different "
     r"rates \(d_optimizer: 0.1, g_optimizer: 0.05\)"),
    (lambda: LearningRateScheduleCallback(0.1, multiplier=0.5),
     r"initial_lr=0.1 is one rate, .*\(d_optimizer: 0.1, g_optimizer: 0.05\)"),
    (lambda: LearningRateScheduleCallback({"d_optimizer": 0.1, "optimizer": 0.05}, 0.5),
     r"initial_lr names \['d_optimizer', 'optimizer'\], but TwoOptimizerGAN trains with the "
     r"optimizers \['d_optimizer', 'g_optimizer'\]"),
    (lambda: LearningRateWarmupCallback(initial_lr=0.1, warmup_epochs=1),
     r"initial_lr=0.1 is one rate, .*\(d_optimizer: 0.1, g_optimizer: 0.05\)"),
], ids=["warmup", "schedule", "names", "root_only"])
def test_one_initial_lr_for_a_gans_optimizers_of_different_rates_is_refused(
        world, callback, message, request):
    # One number cannot be the initial rate of both: each would be warmed up or scheduled
    # to it (or, before, neither: only the unused RMSprop). "root_only": the rates differ on
    # the root alone (a checkpoint restored there): every rank must refuse, not rank 0 alone.
    rank, size = world
    root_only = request.node.callspec.id == "root_only"
    rates = (0.1, 0.05) if not root_only or rank == 0 else (0.1, 0.1)
    with pytest.raises(ValueError, match=message):
        _fit_gan(rank, size, rates, [callback()], epochs=1)
