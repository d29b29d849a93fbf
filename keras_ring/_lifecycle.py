"""Steps of ``init()`` and ``shutdown()`` that belong to the layers above the runtime.

The runtime and ``keras_ring.init()`` sit below the collectives, the timeline and the Keras
integration, which are built on them, so they cannot import those. ``keras_ring/__init__.py``
(which Python runs before any submodule) registers their steps here instead, and the lower
layers run whatever is registered. Registering imports nothing, so ``import keras_ring`` stays
free of TensorFlow.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from keras_ring.config import Config
    from keras_ring.ops.loader import Library
    from keras_ring.peer_table import Topology

# Run by keras_ring.init() once the runtime is up.
AFTER_INIT: list[Callable[[], None]] = []
# Run by keras_ring.wrap() for each optimizer it wraps: the Keras layer's Model.compile hook,
# which init() installs only where Keras was already imported (it sits above wrap()'s module).
AFTER_WRAP: list[Callable[[], None]] = []
# Run by keras_ring.init(process_sets=[...]) after AFTER_INIT, with that list.
ADD_PROCESS_SETS: list[Callable[[list], None]] = []
# Run by Runtime.shutdown() while the peers are still connected, with the runtime's config,
# topology and library, and whether the program is leaving with an error (then a step must
# start no collective: the peers may wait in one of the program's, and would take it for a
# mismatch instead of this rank's failure). A step that raises does not stop the others nor
# the shutdown: its error becomes a warning once the runtime is down.
BEFORE_SHUTDOWN: list[Callable[[Config, Topology, Library, bool], None]] = []
