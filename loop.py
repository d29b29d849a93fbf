# Custom loop with DistributedGradientTape; compare 2-rank vs 1-process on concatenated batch.
import sys, os, numpy as np, keras, tensorflow as tf
mode = sys.argv[1]; T = sys.argv[2]
if mode == "dist":
    import keras_ring as hvd; hvd.init(); rank, size = hvd.rank(), hvd.size()
else: rank, size = 0, 1
NR = int(os.environ.get("NR", "2")); B = 6; steps = 5
r = np.random.default_rng(0)
ids = r.integers(0, 12, size=(B * NR * steps, 3)); y = r.normal(size=(B * NR * steps, 2)).astype("float32")
keras.utils.set_random_seed(3)
i = keras.Input((3,), dtype="int32"); h = keras.layers.Embedding(12, 4)(i); h = keras.layers.Flatten()(h)
m = keras.Model(i, keras.layers.Dense(2)(h))
opt = keras.optimizers.Adam(0.05) if T != "sgd" else keras.optimizers.SGD(0.1)
@tf.function
def step(xb, yb, first):
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(m(xb, training=True) - yb))
    if mode == "dist":
        kw = {}
        if T == "dense": kw["sparse_as_dense"] = True
        if T == "fp16": kw["compression"] = hvd.Compression.fp16
        if T == "predivide": kw["gradient_predivide_factor"] = 2.0
        tape = hvd.DistributedGradientTape(tape, **kw)
    g = tape.gradient(loss, m.trainable_variables)
    opt.apply_gradients(zip(g, m.trainable_variables))
    if mode == "dist" and first:
        hvd.broadcast_variables(m.variables, root_rank=0)
        hvd.broadcast_variables(opt.variables, root_rank=0)
    return loss
for s in range(steps):
    if mode == "dist":
        sl = slice(s * B * NR + rank * B, s * B * NR + (rank + 1) * B)
    else:
        sl = slice(s * B * NR, (s + 1) * B * NR)
    step(tf.constant(ids[sl]), tf.constant(y[sl]), tf.constant(s == 0))
W = [np.asarray(v) for v in m.trainable_weights]
if mode == "ref":
    np.savez(f"/tmp/hunt/loopref_{T}_{NR}.npz", *W); print("REF done")
else:
    ref = np.load(f"/tmp/hunt/loopref_{T}_{NR}.npz")
    d = max(float(np.max(np.abs(ref[f"arr_{k}"] - w))) for k, w in enumerate(W))
    same = hvd.allgather_object(b"".join(w.tobytes() for w in W))
    print("DIST", T, "rank", rank, "maxdiff", d, "identical", all(s_ == same[0] for s_ in same), flush=True)
