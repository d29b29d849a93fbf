"""``UpdateBatchStateCallback``: keeps ``state.batch`` current during ``fit``."""

from __future__ import annotations

from typing import Any

import keras


class UpdateBatchStateCallback(keras.callbacks.Callback):
    """Sets ``state.batch`` to the number of batches finished in the current epoch.

    It is 0 at every epoch's end. Keras 3's ``fit`` cannot start an epoch part-way, so after
    a change of world the interrupted epoch runs whole again (from the committed weights);
    ``state.batch`` tells a custom loop where to resume.

    Args:
        state: the ``keras_ring.elastic`` state; it needs a ``batch`` value
            (``KerasState(model, batch=0)``).

    Example:

    ```python
    callbacks = [keras_ring.elastic.UpdateBatchStateCallback(state)]
    ```
    """

    def __init__(self, state: Any) -> None:
        super().__init__()
        if not hasattr(state, "batch"):
            raise ValueError("UpdateBatchStateCallback needs a state with a 'batch' value, "
                             "e.g. keras_ring.elastic.KerasState(model, batch=0)")
        self.state = state

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self.state.batch = batch + 1

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        self.state.batch = 0
