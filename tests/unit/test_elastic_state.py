"""Elastic states and callbacks in one process (a world of one): what a commit keeps, what a
restore brings back, how the callbacks count. Jobs that really change worlds are in
tests/elastic and tests/multihost."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_ring
from keras_ring import elastic

STEPS = 6


@pytest.fixture(scope="module", autouse=True)
def runtime():
    keras_ring.init()
    yield
    keras_ring.shutdown()


def make_model() -> keras.Model:
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer=keras_ring.wrap(keras.optimizers.Adam(0.1)), loss="mse")
    return model


def data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(STEPS * 4, 3)).astype("float32"), rng.normal(
        size=(STEPS * 4, 2)).astype("float32")


def test_a_restore_brings_back_the_last_commit_whatever_the_callbacks_order():
    model = make_model()
    state = elastic.KerasState(model, epoch=0, batch=0)
    x, y = data()
    # Commit first in the list: it still commits what the later callbacks recorded.
    model.fit(x, y, batch_size=4, epochs=2, verbose=0, shuffle=False,
              callbacks=[elastic.CommitStateCallback(state),
                         elastic.UpdateBatchStateCallback(state),
                         elastic.UpdateEpochStateCallback(state)])
    assert (state.epoch, state.batch) == (2, 0)
    weights = [w.copy() for w in model.get_weights()]
    slots = [v.numpy().copy() for v in model.optimizer.variables]
    model.set_weights([np.zeros_like(w) for w in weights])
    state.epoch = 99
    state.restore()
    # The last commit ran as training ended, after the last epoch was recorded (as Horovod
    # commits at each epoch's end): nothing of the finished training is lost.
    assert (state.epoch, state.batch) == (2, 0)
    for now, then in zip(model.get_weights(), weights):
        np.testing.assert_array_equal(now, then)
    for variable, then in zip(model.optimizer.variables, slots):
        np.testing.assert_array_equal(variable.numpy(), then)


def test_batches_per_commit_spaces_the_commits():
    model = make_model()
    state = elastic.KerasState(model, epoch=0, batch=0)
    x, y = data()
    committed = []
    commit = state.commit
    state.commit = lambda: (committed.append(state.batch), commit())
    model.fit(x, y, batch_size=4, epochs=1, verbose=0, shuffle=False,
              callbacks=[elastic.CommitStateCallback(state, batches_per_commit=4),
                         elastic.UpdateBatchStateCallback(state)])
    # Before batch 5 (index 4), before batch 9, ..., and as training ends (the epoch's end).
    assert committed == list(range(4, STEPS, 4)) + [0]


class StopAfterOne(keras.callbacks.Callback):
    """Ends fit after its first epoch, as a change of world would."""

    def on_epoch_end(self, epoch, logs=None):
        self.model.stop_training = True


@pytest.mark.parametrize("style", ["initial_epoch", "epochs_left"])
def test_the_epoch_counts_across_fit_calls_in_both_styles(style):
    model = make_model()
    state = elastic.KerasState(model, epoch=0, batch=0)
    x, y = data()
    for _ in range(2):  # as after a reset: fit again from state.epoch
        arguments = ({"initial_epoch": state.epoch, "epochs": 3} if style == "initial_epoch"
                     else {"epochs": 3 - state.epoch})
        model.fit(x, y, batch_size=4, verbose=0, steps_per_epoch=2,
                  callbacks=[elastic.UpdateEpochStateCallback(state), StopAfterOne()],
                  **arguments)
    assert state.epoch == 2  # each fit ran one epoch (then stopped), counted across calls


def test_horovods_tensorflow_keras_state_is_the_keras_state():
    model = make_model()
    state = elastic.TensorFlowKerasState(model, model.optimizer, backend=None, epoch=3)
    state.commit()
    before = model.get_weights()
    model.layers[0].kernel.assign(model.layers[0].kernel + 1.0)
    state.epoch = 4
    state.restore()
    assert state.epoch == 3 and isinstance(state, elastic.KerasState)
    for now, then in zip(model.get_weights(), before):
        np.testing.assert_array_equal(now, then)


def test_object_and_tensorflow_states_commit_and_restore():
    v = tf.Variable([1.0, 2.0])
    state = elastic.TensorFlowState([v], step=0, history=[])
    state.step = 5
    state.history.append("a")
    v.assign([3.0, 4.0])
    state.commit()
    state.step = 9
    state.history.append("b")
    v.assign([0.0, 0.0])
    state.restore()
    assert state.step == 5 and state.history == ["a"]
    np.testing.assert_array_equal(v.numpy(), [3.0, 4.0])


def test_run_calls_the_function_once_outside_an_elastic_job():
    state = elastic.ObjectState(calls=0)

    @elastic.run
    def train(state, increment):
        state.calls += increment
        return state.calls

    assert train(state, 2) == 2


def test_run_refuses_a_first_argument_that_is_no_state():
    @elastic.run
    def train(state):
        return state

    with pytest.raises(TypeError, match="must be a keras_ring.elastic State, got dict"):
        train({"epoch": 0})


def test_the_callbacks_say_which_value_they_need():
    state = elastic.ObjectState(epoch=0)
    with pytest.raises(ValueError, match="needs a state with a 'batch' value"):
        elastic.UpdateBatchStateCallback(state)
    with pytest.raises(ValueError, match="batches_per_commit must be a positive int, got 0"):
        elastic.CommitStateCallback(state, batches_per_commit=0)
