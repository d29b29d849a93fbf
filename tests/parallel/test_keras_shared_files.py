"""A ModelCheckpoint or CSVLogger given to fit on every rank with one path: the ranks would
write one file and corrupt it (probe N: "Bad CRC-32" in .keras checkpoints, exit 0). fit must
fail on every rank before anything is written into them, naming the ranks and the path;
paths of each rank's own, on_rank_zero and BestModelCheckpoint train
(keras_ring._shared_files)."""

import os
import shutil
import tempfile

import numpy as np
import pytest

import keras
import keras_ring
from keras_ring.callbacks import (BestModelCheckpoint, BroadcastGlobalVariablesCallback,
                                  on_rank_zero)

from tests.parallel import keras_support as ks


@pytest.fixture
def shared_dir():
    """One directory for every rank (rank 0's, as a shared file system would give)."""
    path = keras_ring.broadcast_object(tempfile.mkdtemp() if keras_ring.rank() == 0 else None)
    yield path
    keras_ring.allgather_object(0)  # every rank is done with it
    if keras_ring.rank() == 0:
        shutil.rmtree(path, ignore_errors=True)


def _fit(callbacks: list) -> keras.Model:
    rank = keras_ring.rank()
    model = ks.mlp(0)
    model.compile(optimizer=keras_ring.wrap(keras.optimizers.SGD(0.1)), loss=ks.loss())
    x, y = ks.classification_data(32, seed=rank)
    model.fit(x, y, batch_size=8, epochs=2, verbose=0, validation_data=(x, y),
              callbacks=[BroadcastGlobalVariablesCallback(0), *callbacks])
    return model


@pytest.mark.parametrize("make, name", [
    (lambda d: keras.callbacks.ModelCheckpoint(os.path.join(d, "ckpt-{epoch}.keras")),
     "ckpt-{epoch}.keras"),
    (lambda d: keras.callbacks.CSVLogger(os.path.join(d, "log.csv")), "log.csv"),
])
def test_one_path_written_by_every_rank_fails_every_rank_before_writing(shared_dir, make, name):
    size = keras_ring.size()
    with pytest.raises(ValueError, match="ranks " + ", ".join(map(str, range(size)))
                       + r" would all write .*" + name.replace("{", r"\{").replace("}", r"\}")):
        _fit([make(shared_dir)])
    # Nothing in them (CSVLogger opens its file as training begins, before the check).
    written = [f for f in os.listdir(shared_dir) if os.path.getsize(os.path.join(shared_dir, f))]
    assert written == []


def test_a_shared_log_beside_checkpoints_of_each_ranks_own_fails_naming_the_log(shared_dir):
    rank = keras_ring.rank()
    own = keras.callbacks.ModelCheckpoint(os.path.join(shared_dir, f"rank{rank}.keras"))
    with pytest.raises(ValueError, match=r"would all write .*log\.csv \(a CSVLogger"):
        _fit([own, keras.callbacks.CSVLogger(os.path.join(shared_dir, "log.csv"))])


def test_one_backup_directory_for_every_rank_fails_advising_one_of_each_ranks_own(shared_dir):
    with pytest.raises(ValueError, match=r"a BackupAndRestore .* backup directory of its own"):
        _fit([keras.callbacks.BackupAndRestore(os.path.join(shared_dir, "backup"))])


def test_paths_of_each_ranks_own_train(shared_dir):
    rank = keras_ring.rank()
    path = os.path.join(shared_dir, f"rank{rank}-{{epoch}}.keras")
    ks.assert_same_on_all_ranks(ks.weights(_fit([keras.callbacks.ModelCheckpoint(path)])))
    assert os.path.exists(path.format(epoch=2))


def test_rank_zero_alone_writes_with_on_rank_zero_and_best_model_checkpoint(shared_dir):
    _fit([on_rank_zero(keras.callbacks.ModelCheckpoint(os.path.join(shared_dir, "a.keras"))),
          BestModelCheckpoint(filepath=os.path.join(shared_dir, "best.keras"))])
    keras_ring.allgather_object(0)  # rank 0 has written
    assert sorted(os.listdir(shared_dir)) == ["a.keras", "best.keras"]
