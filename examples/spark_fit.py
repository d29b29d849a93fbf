"""The quickstart's data-parallel ``model.fit``, launched through Spark instead of mpirun.

Run it on a local Spark with 2 ranks (needs ``pip install keras-ring[spark]`` and Java 17+;
everything runs offline, the data is generated with a fixed seed):

    python examples/spark_fit.py
    python examples/spark_fit.py --master 'local[4]' --num-proc 4

On a cluster, submit it like any PySpark program (each rank is one barrier-mode task; the
cluster needs ``--num-proc`` free task slots at once):

    spark-submit --master yarn examples/spark_fit.py --master '' --num-proc 8

``keras_ring.spark.run(train, ...)`` starts ``train`` in every task with keras_ring already
initialized and returns each rank's return value in rank order. ``MetricAverageCallback``
averages the epoch metrics over the ranks, so every rank returns the same history.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import keras_fit  # noqa: E402 - the quickstart's data and model, next to this file


def train(epochs: int, batch_size: int, samples: int) -> dict[str, list[float]]:
    """One rank's training (runs inside a Spark task); returns the averaged epoch metrics."""
    import keras
    import keras_ring

    rank, size = keras_ring.rank(), keras_ring.size()
    # Every rank generates the same data and keeps its own, equally long, shard.
    x_train, y_train = keras_fit.make_data(samples // size * size, seed=0)
    x_val, y_val = keras_fit.make_data(2048 // size * size, seed=1)
    x_train, y_train = x_train[rank::size], y_train[rank::size]
    x_val, y_val = x_val[rank::size], y_val[rank::size]

    keras.utils.set_random_seed(rank)  # different on purpose: the broadcast equalizes them
    model = keras_fit.build_model()
    model.compile(optimizer=keras_ring.wrap(keras.optimizers.Adam(1e-3 * size)),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    history = model.fit(
        x_train, y_train, batch_size=batch_size, epochs=epochs,
        validation_data=(x_val, y_val), verbose=0,
        callbacks=[keras_ring.callbacks.BroadcastGlobalVariablesCallback(0),
                   keras_ring.callbacks.MetricAverageCallback()])
    return {name: [float(v) for v in values] for name, values in history.history.items()}


def train_on_spark(num_proc: int | None = None, epochs: int = 4, batch_size: int = 64,
                   samples: int = 8192) -> list[dict[str, list[float]]]:
    """Runs ``train`` as a keras_ring job in the active Spark; every rank's history."""
    import keras_ring.spark
    from pyspark import cloudpickle

    # Ship the quickstart module's code with the function: executors need not have this file.
    cloudpickle.register_pickle_by_value(keras_fit)
    return keras_ring.spark.run(train, kwargs=dict(epochs=epochs, batch_size=batch_size,
                                                   samples=samples), num_proc=num_proc)


def local_spark(master: str):
    """A Spark session for this example: offline, on loopback, workers on this Python."""
    # Spark starts its Python workers with PYSPARK_PYTHON, "python3" by default.
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    builder = SparkSession.builder.appName("keras_ring spark_fit")
    if master:
        builder = builder.master(master)
    if master.startswith("local"):
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")  # nothing leaves this machine
        builder = (builder.config("spark.driver.host", "127.0.0.1")
                   .config("spark.driver.bindAddress", "127.0.0.1"))
    return (builder.config("spark.ui.enabled", "false")
            .config("spark.ui.showConsoleProgress", "false")
            .config("spark.sql.shuffle.partitions", "2").getOrCreate())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--master", default="local[2]",
                        help="Spark master ('' keeps spark-submit's)")
    parser.add_argument("--num-proc", type=int, default=None,
                        help="ranks (default: Spark's default parallelism)")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=64, help="per rank")
    parser.add_argument("--samples", type=int, default=8192, help="training samples in total")
    args = parser.parse_args()

    spark = local_spark(args.master)
    spark.sparkContext.setLogLevel("ERROR")
    try:
        histories = train_on_spark(args.num_proc, args.epochs, args.batch_size, args.samples)
    finally:
        spark.stop()
    for name, values in histories[0].items():
        print(f"{name:>14}: " + " ".join(f"{v:.3f}" for v in values))
    same = all(np.allclose(list(h.values()), list(histories[0].values())) for h in histories)
    print(f"metrics averaged over {len(histories)} ranks (identical on every rank: {same})")
    print(f"final val_accuracy: {histories[0]['val_accuracy'][-1]:.2f}")


if __name__ == "__main__":
    main()
