"""What a failed fit, evaluate or predict held, its tf.data iterators among it, is freed as
the next such call starts, never by a garbage collection; in one process (size 1).

Before, the iterator lived on in a reference cycle through the error's frames until some
later full garbage collection, wherever the program was then; its destructor waits for
TensorFlow's autotune thread, which under CPU contention sleeps out its period (up to 60 s):
4 ranks on 2 cores stalled 20-40 s at a random later collective.
"""

import gc
import traceback

import numpy as np
import pytest
from tensorflow.python.data.ops import iterator_ops

import keras
import keras_ring
from keras_ring.runtime import RUNTIME


@pytest.fixture(scope="module", autouse=True)
def initialized():
    keras_ring.init()
    yield


@pytest.fixture
def no_garbage_collection():
    # The cycle this is about is freed by a full collection; one that ran by chance during
    # the test would hide it.
    gc.collect()
    gc.disable()
    yield
    gc.enable()


def _live_data_iterators() -> int:
    return sum(isinstance(o, iterator_ops.OwnedIterator) for o in gc.get_objects())


class Fails(keras.callbacks.Callback):
    """Raises the program's own error at the third batch of a fit ("batch"), an evaluate or
    a predict, or as a fit's first epoch ends ("epoch")."""

    def __init__(self, where: str):
        super().__init__()
        self.where = where

    def _fail_at(self, where, batch=2):
        if where == self.where and batch == 2:
            marker = "kept for a debugger"  # noqa: F841  the test reads it from the frame
            raise RuntimeError("the program's own error")

    def on_train_batch_end(self, batch, logs=None):
        self._fail_at("batch", batch)

    def on_epoch_end(self, epoch, logs=None):
        self._fail_at("epoch")

    def on_test_batch_end(self, batch, logs=None):
        self._fail_at("evaluate", batch)

    def on_predict_batch_end(self, batch, logs=None):
        self._fail_at("predict", batch)


def _model_and_data():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    model.compile(keras_ring.wrap(keras.optimizers.SGD(0.1)), "mse")
    return model, np.ones((64, 4), "float32"), np.zeros((64, 2), "float32")


def _assert_the_programs_frame_kept_its_locals(error: BaseException) -> None:
    frames = [frame for frame, _ in traceback.walk_tb(error.__traceback__)]
    raised_in = [f for f in frames if f.f_code.co_name == "_fail_at"]
    assert raised_in and raised_in[-1].f_locals["marker"] == "kept for a debugger"
    assert "the program's own error" in "".join(traceback.format_exception(error))


def _assert_held_not_garbage(before: int) -> None:
    # The failed call's iterators are alive, held for the next call to free, and none of
    # them is garbage a collection would destroy wherever the program happens to be.
    held = _live_data_iterators()
    gc.collect()
    assert _live_data_iterators() == held > before
    assert RUNTIME.held_after_failure


@pytest.mark.parametrize("where, steps, validation", [
    ("batch", None, False), ("epoch", None, False), ("batch", 4, False), ("epoch", None, True),
], ids=["mid-epoch", "epoch end", "steps_per_epoch", "after validation"])
def test_a_failed_fits_data_iterators_are_freed_as_the_next_call_starts(
        no_garbage_collection, where, steps, validation):
    model, x, y = _model_and_data()
    before = _live_data_iterators()
    with pytest.raises(RuntimeError, match="the program's own error") as info:
        model.fit(x, y, batch_size=8, epochs=3, steps_per_epoch=steps, verbose=0,
                  validation_data=(x, y) if validation else None, callbacks=[Fails(where)])
    _assert_the_programs_frame_kept_its_locals(info.value)
    del info  # the program lets go of the error: only what keras_ring holds stays
    _assert_held_not_garbage(before)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)  # frees them, and trains on
    assert RUNTIME.held_after_failure == []
    assert _live_data_iterators() == before


@pytest.mark.parametrize("call", ["evaluate", "predict"])
def test_a_failed_evaluate_or_predicts_data_iterator_is_freed_by_the_next_call(
        no_garbage_collection, call):
    model, x, y = _model_and_data()
    before = _live_data_iterators()
    with pytest.raises(RuntimeError, match="the program's own error") as info:
        if call == "evaluate":
            model.evaluate(x, y, batch_size=8, verbose=0, callbacks=[Fails(call)])
        else:
            model.predict(x, batch_size=8, verbose=0, callbacks=[Fails(call)])
    _assert_the_programs_frame_kept_its_locals(info.value)
    del info  # the program lets go of the error: only what keras_ring holds stays
    _assert_held_not_garbage(before)
    model.predict(x, batch_size=8, verbose=0)
    assert RUNTIME.held_after_failure == []
    assert _live_data_iterators() == before
