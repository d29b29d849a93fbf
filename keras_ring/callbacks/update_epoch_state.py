"""``UpdateEpochStateCallback``: keeps ``state.epoch`` current during ``fit``."""

from __future__ import annotations

from typing import Any

import keras


class UpdateEpochStateCallback(keras.callbacks.Callback):
    """Sets ``state.epoch`` to the number of epochs finished, counted across worlds.

    Pass ``initial_epoch=state.epoch`` to ``fit`` (Keras then numbers epochs from there), or
    ``epochs=total - state.epoch`` (Keras numbers from 0): both count right, because the
    first epoch of each ``fit`` call is taken to be ``state.epoch``.

    Args:
        state: the ``keras_ring.elastic`` state; it needs an ``epoch`` value
            (``KerasState(model, epoch=0)``).

    Example:

    ```python
    model.fit(x, y, initial_epoch=state.epoch, epochs=10,
              callbacks=[keras_ring.elastic.UpdateEpochStateCallback(state)])
    ```
    """

    def __init__(self, state: Any) -> None:
        super().__init__()
        if not hasattr(state, "epoch"):
            raise ValueError("UpdateEpochStateCallback needs a state with an 'epoch' value, "
                             "e.g. keras_ring.elastic.KerasState(model, epoch=0)")
        self.state = state
        self._offset: int | None = None

    def on_train_begin(self, logs: dict | None = None) -> None:
        self._offset = None

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        if self._offset is None:
            self._offset = self.state.epoch - epoch

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        self.state.epoch = epoch + (self._offset or 0) + 1
