"""Elastic training: workers leave and join a running job; training goes on from the last
commit. Horovod's names, so that moving over is an import swap.

```python
import keras, keras_ring
from keras_ring import elastic

keras_ring.init()
model = make_model()
model.compile(optimizer=keras_ring.wrap(keras.optimizers.SGD(0.01)), loss="mse")
state = elastic.KerasState(model, epoch=0, batch=0)

@elastic.run
def train(state):
    model.fit(x, y, initial_epoch=state.epoch, epochs=10,
              callbacks=[elastic.CommitStateCallback(state),
                         elastic.UpdateBatchStateCallback(state),
                         elastic.UpdateEpochStateCallback(state)])

train(state)
```

Launch with ``keras-ring-run -np 3 --min-np 2 --max-np 4 --host-discovery-script ./hosts.sh
python train.py``. The pieces: ``server`` (forms each world), ``client`` (a worker's side of
it), ``driver`` (the launcher's process management), ``state`` and ``run`` (the training
side). Importing this package imports nothing heavy; the names below load on first use.
"""

from __future__ import annotations

from keras_ring._lazy_exports import lazy_exports

_EXPORTS = {
    "run": "keras_ring.elastic.run",
    "HostsUpdatedInterrupt": "keras_ring.elastic.state",
    "State": "keras_ring.elastic.state",
    "ObjectState": "keras_ring.elastic.state",
    "TensorFlowState": "keras_ring.elastic.state",
    "KerasState": "keras_ring.elastic.state",
    "TensorFlowKerasState": "keras_ring.elastic.state",
    "CommitStateCallback": "keras_ring.callbacks.commit_state",
    "UpdateBatchStateCallback": "keras_ring.callbacks.update_batch_state",
    "UpdateEpochStateCallback": "keras_ring.callbacks.update_epoch_state",
}

__all__ = list(_EXPORTS)


__getattr__, __dir__ = lazy_exports("keras_ring.elastic", _EXPORTS, globals())
