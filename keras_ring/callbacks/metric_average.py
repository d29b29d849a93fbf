"""``MetricAverageCallback``: every rank sees the same epoch metrics."""

from __future__ import annotations

import numbers
import zlib
from collections.abc import Mapping
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from keras_ring._model_optimizers import refuse_training_apart
from keras_ring.collectives import Average, allreduce
from keras_ring.errors import METRIC_AVERAGE
from keras_ring.callbacks._arguments import check_device, check_process_set
from keras_ring.process_sets import ProcessSet, global_process_set


def _numeric(value: Any) -> np.ndarray | None:
    """``value`` as a float64 array (shape () for a number), or None if it is no metric."""
    if isinstance(value, bool):
        return None
    if isinstance(value, numbers.Real):
        return np.asarray(float(value))
    try:
        array = np.asarray(value)
    except Exception:  # noqa: BLE001 - anything that is not array-like is not a metric
        return None
    if np.issubdtype(array.dtype, np.number) and not np.issubdtype(array.dtype, np.complexfloating):
        return array.astype(np.float64)
    return None


def _collective_name(keys: list[str]) -> str:
    # The name is compared across ranks, so ranks with different metrics fail with an
    # error showing both lists; long lists are summarised to stay within the name limit.
    name = METRIC_AVERAGE + ",".join(keys) + "]"
    if len(name) <= 120:
        return name
    return f"{METRIC_AVERAGE}{len(keys)} metrics #{zlib.crc32(','.join(keys).encode()):08x}]"


class MetricAverageCallback(keras.callbacks.Callback):
    """At each epoch's end, replaces every metric in ``logs`` by its average over the ranks.

    Each rank computes its metrics on its own shard of the data. This callback averages
    every numeric entry of the epoch logs (training metrics and ``val_`` metrics alike, numbers
    and arrays such as per-class scores) in one collective, in sorted key order, and writes
    the averages back into ``logs``.

    Ordering: Keras calls callbacks in list order with the same ``logs`` dict, and appends
    its own ``History`` and progress bar after yours. Put this callback **before** any
    callback that reads the epoch metrics (``ReduceLROnPlateau``, ``EarlyStopping``,
    ``ModelCheckpoint``, ``CSVLogger``, ...): they then see the same numbers on every rank
    and so make the same decisions. ``fit()``'s returned ``History`` holds the averages.

    ``evaluate()`` has no epoch end: given this callback it still returns this rank's own
    results (as Horovod's did; Keras hands callbacks a copy of what it returns). Average
    them yourself: ``keras_ring.callbacks.average_logs(model.evaluate(..., return_dict=True))``
    on every rank.

    The average of per-rank averages equals the global value for metrics that are means
    over samples (loss, accuracy, MAE) when every rank has the same number of samples, which
    is how data should be sharded for synchronous training. For other metrics (AUC,
    precision, recall, a maximum) it is the ranks' average of their own values, not the
    value over the whole data: compute such a metric from every rank's predictions
    (``keras_ring.allgather``) where a decision depends on it.

    Args:
        device: Horovod's placement of the averaging; accepted (a string) and ignored.
        process_set: average among these ranks only; all by default.

    Example:

    ```python
    callbacks = [keras_ring.callbacks.BroadcastGlobalVariablesCallback(0),
                 keras_ring.callbacks.MetricAverageCallback(),
                 keras.callbacks.ReduceLROnPlateau(patience=2)]
    ```
    """

    def __init__(self, device: str = "", *,
                 process_set: ProcessSet = global_process_set) -> None:
        super().__init__()
        check_device(device, "MetricAverageCallback")
        self.process_set = check_process_set(process_set, "MetricAverageCallback")

    def on_train_begin(self, logs: dict | None = None) -> None:
        refuse_training_apart(self.model, "MetricAverageCallback", self.process_set)

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if logs:
            average_logs(logs, self.process_set)


def average_logs(logs: dict | list | float,
                 process_set: ProcessSet = global_process_set) -> dict | list | float:
    """Averages the numeric entries of ``logs`` over the ranks, in place; returns it. Numbers
    stay floats; arrays (``F1Score(average=None)``'s per-class values) are averaged element
    by element and keep their shape.

    Args:
        logs: a dict of metrics (``evaluate(..., return_dict=True)``, a callback's logs), or
            what ``evaluate()`` returns by default: a list of them (averaged in place too),
            or one number (its average is returned).
        process_set: the ranks to average over (every rank of it calls this).

    Example:
        ``loss, accuracy = keras_ring.callbacks.average_logs(model.evaluate(x, y))``
    """
    if isinstance(logs, (list, tuple)):
        averaged = average_logs({str(i): v for i, v in enumerate(logs)}, process_set)
        values = [averaged[str(i)] for i in range(len(logs))]
        if isinstance(logs, tuple):
            return tuple(values)
        logs[:] = values
        return logs
    if not isinstance(logs, Mapping):
        number = _numeric(logs)
        if number is None or number.shape != ():
            raise TypeError("average_logs: logs must be a dict of metrics, a list of them or a "
                            f"number (what evaluate() returns), got {type(logs).__name__} "
                            f"{logs!r:.80}")
        return average_logs({"value": logs}, process_set)["value"]
    values = {k: _numeric(v) for k, v in logs.items()}
    keys = sorted(k for k, v in values.items() if v is not None)
    if not keys:
        return logs
    # Shapes go into the name with the keys: ranks whose arrays differ fail on every rank.
    labels = [k if values[k].shape == () else f"{k}{list(values[k].shape)}" for k in keys]
    local = tf.constant(np.concatenate([values[k].ravel() for k in keys]), dtype=tf.float64)
    averaged = allreduce(local, op=Average, name=_collective_name(labels),
                         process_set=process_set).numpy()
    start = 0
    for key in keys:
        shape = values[key].shape
        size = int(np.prod(shape))
        piece = averaged[start:start + size]
        start += size
        logs[key] = float(piece[0]) if shape == () else piece.reshape(shape)
    return logs
