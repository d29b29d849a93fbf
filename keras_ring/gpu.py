"""GPU machines: which GPU each rank uses, and where NCCL is.

Every Horovod user wrote the same lines to give each rank its own GPU; ``init()`` does it
instead: GPU ``local_rank()`` becomes the only one TensorFlow uses in this process, unless
the user already chose (``CUDA_VISIBLE_DEVICES``, or ``tf.config.set_visible_devices`` before
``init()``). It has to happen before TensorFlow initialises its devices, i.e. before the
first TensorFlow op. On machines without GPUs nothing changes.

The op library loads NCCL and the CUDA runtime itself, at the first GPU collective; this
module only tells it where the ``nvidia-nccl-cu12`` wheel (``pip install keras-ring[cuda]``)
and the CUDA runtime wheel put them. The system's libraries are the fallback.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import warnings

from keras_ring.ops import loader

# Wheels whose ``lib`` directory holds a library the GPU collectives load.
_LIBRARY_PACKAGES = ("nvidia.nccl", "nvidia.cuda_runtime")


def library_search_path() -> str:
    """The ``lib`` directories of the installed NCCL and CUDA runtime wheels, ``:``-separated."""
    dirs: list[str] = []
    for package in _LIBRARY_PACKAGES:
        try:
            spec = importlib.util.find_spec(package)
        except (ImportError, ValueError):  # no ``nvidia`` namespace at all
            spec = None
        for location in (spec.submodule_search_locations or []) if spec else []:
            lib = os.path.join(location, "lib")
            if os.path.isdir(lib) and lib not in dirs:
                dirs.append(lib)
    return os.pathsep.join(dirs)


def nccl_version(library=None) -> str:
    """The version of the NCCL a GPU collective would use, e.g. ``"2.23.4"``.

    Raises:
        RuntimeError: with the message a GPU collective would fail with (NCCL missing or
            too old, and how to install it).
    """
    if library is None:
        library = loader.library()
    version = ctypes.c_int(0)
    err = ctypes.create_string_buffer(4096)
    rc = library.c.keras_ring_nccl_probe(
        library_search_path().encode(), ctypes.byref(version), err, len(err))
    if rc != 0:
        raise RuntimeError(err.value.decode(errors="replace"))
    code = version.value  # major*10000 + minor*100 + patch since NCCL 2.9
    return f"{code // 10000}.{code % 10000 // 100}.{code % 100}"


def pin_to_local_gpu(local_rank: int, local_size: int, size: int) -> str | None:
    """Makes GPU ``local_rank`` the only one TensorFlow uses, unless the user chose.

    Returns the physical device name it pinned to, or None when it left things alone: no GPU,
    a world of one (a single process keeps TensorFlow's defaults), the program already
    narrowed the visible GPUs, ``CUDA_VISIBLE_DEVICES`` is set, or TensorFlow already
    initialised its devices (then with a warning, since every rank may share one GPU).
    """
    import tensorflow as tf

    gpus = tf.config.list_physical_devices("GPU")
    if not gpus or size <= 1:
        return None
    if len(tf.config.get_visible_devices("GPU")) != len(gpus):
        return None  # tf.config.set_visible_devices was called before init()
    if "CUDA_VISIBLE_DEVICES" in os.environ:
        if len(gpus) > 1 and local_size > 1:
            warnings.warn(
                f"keras_ring: CUDA_VISIBLE_DEVICES={os.environ['CUDA_VISIBLE_DEVICES']} shows "
                f"{len(gpus)} GPUs to each of the {local_size} ranks on this host, and init() "
                "leaves a choice made with CUDA_VISIBLE_DEVICES alone, so every rank will use "
                "the first of them. Give each rank its own GPU (CUDA_VISIBLE_DEVICES per rank, "
                "or tf.config.set_visible_devices(gpus[keras_ring.local_rank()], 'GPU') before "
                "init()), or unset CUDA_VISIBLE_DEVICES and let init() do it.",
                stacklevel=3,
            )
        return None
    gpu = gpus[local_rank % len(gpus)]
    try:
        tf.config.set_visible_devices([gpu], "GPU")
    except RuntimeError:
        if len(gpus) > 1:
            warnings.warn(
                f"keras_ring: TensorFlow had already initialised its {len(gpus)} GPUs when init() "
                f"ran, so this rank could not be pinned to GPU {local_rank % len(gpus)} (its "
                "local_rank): call keras_ring.init() before any TensorFlow op, or pick the GPU "
                "yourself with tf.config.set_visible_devices before TensorFlow starts.",
                stacklevel=3,
            )
        return None
    return gpu.name


def configure(library, topology) -> str | None:
    """init()'s GPU step: tell the op library where NCCL is, and pin this rank's GPU."""
    library.c.keras_ring_nccl_set_search_path(library_search_path().encode())
    return pin_to_local_gpu(topology.local_rank, topology.local_size, topology.size)
