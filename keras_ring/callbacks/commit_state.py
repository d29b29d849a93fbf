"""``CommitStateCallback``: commits an elastic state during ``fit``."""

from __future__ import annotations

from typing import Any

import keras


class CommitStateCallback(keras.callbacks.Callback):
    """Commits ``state`` every ``batches_per_commit`` batches and at every epoch's end.

    A commit is the point a failed world goes back to and where waiting workers join (see
    ``keras_ring.elastic``). It runs right before the next batch or epoch starts (or as
    training ends), so that every callback has recorded the finished batch in the state
    (``UpdateBatchStateCallback``, ``UpdateEpochStateCallback``) whatever their order in the
    list.

    Args:
        state: the ``keras_ring.elastic`` state to commit (a ``KerasState``, say).
        batches_per_commit: how many batches between commits (a commit copies the state
            into host memory and asks whether workers wait). Default 1.

    Example:

    ```python
    model.fit(x, y, callbacks=[keras_ring.elastic.CommitStateCallback(state, 10)])
    ```
    """

    def __init__(self, state: Any, batches_per_commit: int = 1) -> None:
        super().__init__()
        if isinstance(batches_per_commit, bool) or not isinstance(batches_per_commit, int) \
                or batches_per_commit < 1:
            raise ValueError(f"batches_per_commit must be a positive int, got "
                             f"{batches_per_commit!r}")
        self.state = state
        self.batches_per_commit = batches_per_commit
        self._batches = 0
        self._pending = False

    def on_train_begin(self, logs: dict | None = None) -> None:
        # Every rank counts from the same point after every (re)start of fit.
        self._batches = 0
        self._pending = False

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self._batches += 1
        if self._batches >= self.batches_per_commit:
            self._batches = 0
            self._pending = True

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        self._batches = 0
        self._pending = True

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        self._commit_if_pending()

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self._commit_if_pending()

    def on_train_end(self, logs: dict | None = None) -> None:
        # The last epoch's commit too (as Horovod commits at every epoch's end): a failure
        # after fit goes back to the finished training, not to its last epoch's start.
        self._commit_if_pending()

    def _commit_if_pending(self) -> None:
        if self._pending:
            self._pending = False
            self.state.commit()
