"""``BestModelCheckpoint``: the best model so far, written by rank 0 alone."""

from __future__ import annotations

from typing import Any

import keras

from keras_ring.basics import rank


class BestModelCheckpoint(keras.callbacks.ModelCheckpoint):
    """``keras.callbacks.ModelCheckpoint`` with ``save_best_only=True`` that only rank 0 runs.

    Horovod's ``BestModelCheckpoint`` takes the same arguments, in the same order, and left
    the file path to its Spark estimator; keras_ring has no estimator, so ``filepath`` is a
    keyword argument that must be given. Put ``MetricAverageCallback`` before it, so that
    "best" is judged on the metric of all ranks, not on rank 0's shard alone. Create it after
    ``keras_ring.init()``.

    Args:
        monitor: the metric whose best value is kept (``"val_loss"`` by default).
        verbose: 1 prints a line when a model is saved.
        save_weights_only: save only the weights (``filepath`` then ends in ``.weights.h5``).
        mode: ``"auto"``, ``"min"`` or ``"max"``: which way is better.
        save_freq: ``"epoch"`` or a number of batches.
        filepath: where to save (``.keras``, or ``.weights.h5`` with weights only); may hold
            ``{epoch}`` and metric placeholders, as ``ModelCheckpoint``'s.

    Example:

    ```python
    callbacks = [keras_ring.callbacks.BroadcastGlobalVariablesCallback(0),
                 keras_ring.callbacks.MetricAverageCallback(),
                 keras_ring.callbacks.BestModelCheckpoint(filepath="best.keras")]
    ```
    """

    def __init__(self, monitor: str = "val_loss", verbose: int = 0,
                 save_weights_only: bool = False, mode: str = "auto",
                 save_freq: str | int = "epoch", *, filepath: str | None = None) -> None:
        if filepath is None:
            raise ValueError(
                "BestModelCheckpoint needs filepath=..., e.g. filepath='best.keras' (Horovod's "
                "Spark estimator set it; keras_ring has no estimator)")
        super().__init__(filepath, monitor=monitor, verbose=verbose, save_best_only=True,
                         save_weights_only=save_weights_only, mode=mode, save_freq=save_freq)
        self._writes = rank() == 0

    # ModelCheckpoint's hooks, and the train begin/end ones a Keras may give it, run on rank
    # 0 only: the other ranks would write the same files (a shared file system) and judge
    # "best" on their own shards.
    def on_train_begin(self, logs: dict | None = None) -> None:
        if self._writes:
            super().on_train_begin(logs)

    def on_train_end(self, logs: dict | None = None) -> None:
        if self._writes:
            super().on_train_end(logs)

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        if self._writes:
            super().on_epoch_begin(epoch, logs)

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if self._writes:
            super().on_epoch_end(epoch, logs)

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        if self._writes:
            super().on_train_batch_end(batch, logs)
