"""Tests run by `make test-oldest` with the oldest supported TensorFlow + Keras pair."""
