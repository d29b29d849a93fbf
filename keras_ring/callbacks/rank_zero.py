"""``on_rank_zero``: a callback that only rank 0 runs (checkpoints, TensorBoard, CSV logs)."""

from __future__ import annotations

import keras

from keras_ring.basics import rank


class _OnOtherRanks(keras.callbacks.Callback):
    """Stands in for a rank-0-only callback on the other ranks: does nothing."""

    def __init__(self, callback: keras.callbacks.Callback) -> None:
        super().__init__()
        self.callback_name = type(callback).__name__

    def __repr__(self) -> str:
        return f"<on_rank_zero({self.callback_name}): inactive on rank {rank()}>"


def on_rank_zero(callback: keras.callbacks.Callback) -> keras.callbacks.Callback:
    """Returns ``callback`` on rank 0 and a callback that does nothing on the other ranks.

    For callbacks with side effects that one rank should have: writing checkpoints,
    TensorBoard logs or CSV files. Never use it for callbacks that change training
    (``EarlyStopping``, ``ReduceLROnPlateau``, learning-rate schedules): every rank must make
    the same decisions, so those run on all ranks, after ``MetricAverageCallback``. Call it
    after ``keras_ring.init()``.

    Args:
        callback: a ``keras.callbacks.Callback``.

    Example:

    ```python
    callbacks = [keras_ring.callbacks.MetricAverageCallback(),
                 keras_ring.callbacks.on_rank_zero(keras.callbacks.ModelCheckpoint("ckpt.keras"))]
    ```
    """
    if not isinstance(callback, keras.callbacks.Callback):
        raise TypeError("on_rank_zero takes a keras.callbacks.Callback, got "
                        f"{type(callback).__module__}.{type(callback).__qualname__}")
    return callback if rank() == 0 else _OnOtherRanks(callback)
