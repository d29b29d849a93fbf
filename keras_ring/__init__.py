"""keras_ring: synchronous data-parallel training for Keras 3 on TensorFlow.

Example:

```python
import keras, keras_ring
keras_ring.init()
x = keras_ring.allreduce(tf.constant([1.0, 2.0]), op=keras_ring.Sum)
```
"""

from keras_ring.basics import (
    cross_rank,
    cross_size,
    init,
    is_initialized,
    local_rank,
    local_size,
    rank,
    shutdown,
    size,
)
from keras_ring.collectives import (
    Average,
    Max,
    Min,
    Product,
    ReduceOp,
    Sum,
    allgather,
    allgather_object,
    allreduce,
    barrier,
    broadcast,
    broadcast_object,
    broadcast_variables,
    grouped_allreduce,
)
from keras_ring.errors import (
    CollectiveAbortedError,
    CollectiveArgumentError,
    CollectiveMismatchError,
    CollectiveTimeoutError,
    InitError,
    KerasRingError,
    NotInitializedError,
    PeerFailureError,
)

__version__ = "0.1.0"

__all__ = [
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size",
    "cross_rank", "cross_size", "ReduceOp", "Sum", "Average", "Min", "Max", "Product",
    "allreduce", "grouped_allreduce", "allgather", "broadcast", "broadcast_variables",
    "broadcast_object", "allgather_object", "barrier", "KerasRingError", "NotInitializedError",
    "InitError", "CollectiveMismatchError", "CollectiveArgumentError", "CollectiveTimeoutError",
    "PeerFailureError", "CollectiveAbortedError",
]

# Keras integration: wrap(optimizer), DistributedGradientTape, compression and callbacks.
from keras_ring import callbacks  # noqa: E402
from keras_ring.compression import Compression  # noqa: E402
from keras_ring.gradient_tape import DistributedGradientTape  # noqa: E402
from keras_ring.optimizer import DistributedOptimizer, wrap  # noqa: E402

__all__ += ["wrap", "DistributedOptimizer", "DistributedGradientTape", "Compression", "callbacks"]
