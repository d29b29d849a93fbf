"""One rank of a 2-rank allreduce of more than 2 GiB (2**31 + 16 uint8 elements: more bytes
and more elements than an int32 counts) through the ring, shm or TCP as the job says.

The input is made inside the graph and nothing else holds it, so the kernel reduces it in
place: one such buffer per rank, about 2 GiB. A transfer cut short at 2**31 bytes (or a count
that wrapped) leaves a rank's own value (1 or 2) where the sum, 3, belongs. Prints
``RESULT min max size`` of the result.
"""

import tensorflow as tf

import keras_ring as kr

N = 2**31 + 16


def main() -> None:
    kr.init()

    @tf.function
    def reduced():
        x = tf.fill([N], tf.constant(kr.rank() + 1, tf.uint8))  # rank r contributes r+1
        y = kr.allreduce(x, op=kr.Sum, name="over_2gib")
        return tf.reduce_min(y), tf.reduce_max(y), tf.size(y, out_type=tf.int64)

    low, high, size = (int(v) for v in reduced())
    print(f"RESULT {low} {high} {size}", flush=True)


if __name__ == "__main__":
    main()
