"""``python -m keras_ring.ops``: (re)builds the op library for the installed TensorFlow."""

import sys

from keras_ring.ops.build import main

sys.exit(main())
