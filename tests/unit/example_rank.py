"""One rank of an example, run as a user would run it, plus a record of its models' weights.

``python example_rank.py EXAMPLE [ARGS...]`` runs the example script (runpy, as __main__) and
then writes ``rank<R>.json`` into ``EXAMPLE_DIGEST_DIR``: a digest of every Keras model the
example made, in order, so the test can check that every rank ends with identical weights.
The examples stay as users read them; only this wrapper knows about the check.
"""

import hashlib
import json
import os
import runpy
import sys

import keras
import numpy as np

_models = []  # strong references: the example's models outlive its main()
_layer_init = keras.layers.Layer.__init__


def _remember(self, *args, **kwargs):
    _layer_init(self, *args, **kwargs)
    if not any(m is self for m in _models):  # a model's classes may each run this
        _models.append(self)


keras.layers.Layer.__init__ = _remember


def _digest(model) -> str:
    return hashlib.sha256(b"".join(np.ascontiguousarray(w).tobytes()
                                   for w in model.get_weights())).hexdigest()


def main() -> None:
    script, args = sys.argv[1], sys.argv[2:]
    sys.argv = [script, *args]
    runpy.run_path(script, run_name="__main__")
    import keras_ring

    digests = [_digest(m) for m in _models if isinstance(m, keras.Model) and m.built]
    path = os.path.join(os.environ["EXAMPLE_DIGEST_DIR"], f"rank{keras_ring.rank()}.json")
    with open(path, "w") as f:
        json.dump(digests, f)


if __name__ == "__main__":
    main()
