"""Keras callbacks for synchronous data-parallel training, one class per module.

Typical order: broadcast first, then metric averaging, then the learning-rate callbacks and
anything that reads metrics, with rank-0-only side effects last:

```python
callbacks = [
    keras_ring.callbacks.BroadcastGlobalVariablesCallback(0),
    keras_ring.callbacks.MetricAverageCallback(),
    keras_ring.callbacks.LearningRateWarmupCallback(warmup_epochs=3),
    keras_ring.callbacks.on_rank_zero(keras.callbacks.ModelCheckpoint("model.keras")),
]
```
"""

from keras_ring.callbacks.best_model_checkpoint import BestModelCheckpoint
from keras_ring.callbacks.broadcast_global_variables import (
    BroadcastGlobalVariablesCallback,
    broadcast_model,
)
from keras_ring.callbacks.commit_state import CommitStateCallback
from keras_ring.callbacks.learning_rate_schedule import LearningRateScheduleCallback
from keras_ring.callbacks.learning_rate_warmup import LearningRateWarmupCallback
from keras_ring.callbacks.metric_average import MetricAverageCallback, average_logs
from keras_ring.callbacks.rank_zero import on_rank_zero
from keras_ring.callbacks.update_batch_state import UpdateBatchStateCallback
from keras_ring.callbacks.update_epoch_state import UpdateEpochStateCallback

__all__ = [
    "BroadcastGlobalVariablesCallback", "MetricAverageCallback", "LearningRateWarmupCallback",
    "LearningRateScheduleCallback", "on_rank_zero", "broadcast_model", "average_logs",
    "CommitStateCallback", "UpdateBatchStateCallback", "UpdateEpochStateCallback",
    "BestModelCheckpoint",
]
