"""GPU machines: which GPU each rank uses, and where NCCL is.

Every Horovod user wrote the same lines to give each rank its own GPU; ``init()`` does it
instead: GPU ``local_rank()`` becomes the only one TensorFlow uses in this process, unless
the user already chose (``CUDA_VISIBLE_DEVICES``, or ``tf.config.set_visible_devices`` before
``init()``). It also turns on memory growth for the GPUs the process uses, unless the user
configured their memory: TensorFlow otherwise reserves nearly all of a GPU at its first op,
and NCCL needs memory of its own when it sets up a communicator and (NCCL >= 2.22, which
connects peers lazily) at the first collective. Both have to happen before TensorFlow
initialises its devices, i.e. before the first TensorFlow op. On machines without GPUs
nothing changes.

The op library loads NCCL and the CUDA runtime itself, at the first GPU collective; this
module only tells it where the NCCL wheel (``pip install keras-ring[cuda]`` brings
``nvidia-nccl-cu12``; ``nvidia-nccl-cu13`` for CUDA 13) and the CUDA runtime wheel put them.
The system's libraries are the fallback.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import warnings

from keras_ring.ops import loader

# Wheels whose ``lib`` directory holds a library the GPU collectives load: CUDA 12's wheels
# have one package per library, CUDA 13's put them all in ``nvidia/cu13/lib``.
_LIBRARY_PACKAGES = ("nvidia.nccl", "nvidia.cuda_runtime", "nvidia.cu13")


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


def _memory_configured(tf, gpu) -> bool:
    """Whether the program already chose how TensorFlow takes this GPU's memory."""
    if os.environ.get("TF_FORCE_GPU_ALLOW_GROWTH"):
        return True
    if tf.config.get_logical_device_configuration(gpu):  # virtual devices / a memory limit
        return True
    return bool(tf.config.experimental.get_memory_growth(gpu))


def allow_memory_growth(gpus) -> list[str]:
    """Turns on memory growth for `gpus` whose memory the program left alone.

    Returns the names of the GPUs it changed. When TensorFlow already initialised its GPUs it
    changes nothing and warns: NCCL may then find too little memory to set up.
    """
    import tensorflow as tf

    changed = []
    for gpu in gpus:
        if _memory_configured(tf, gpu):
            continue
        try:
            tf.config.experimental.set_memory_growth(gpu, True)
        except RuntimeError:
            warnings.warn(
                "keras_ring: TensorFlow had already initialised its GPUs when init() ran, so "
                "memory growth could not be turned on: TensorFlow may hold nearly all GPU "
                "memory and leave NCCL too little for its communicators. Call "
                "keras_ring.init() before any TensorFlow op, or configure GPU memory yourself "
                "(tf.config.experimental.set_memory_growth).",
                stacklevel=3,
            )
            break
        changed.append(gpu.name)
    return changed


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
    """init()'s GPU step: tell the op library where NCCL is, pin this rank's GPU and let
    TensorFlow take its memory as it goes (a world of one keeps TensorFlow's defaults)."""
    library.c.keras_ring_nccl_set_search_path(library_search_path().encode())
    pinned = pin_to_local_gpu(topology.local_rank, topology.local_size, topology.size)
    if topology.size > 1:
        import tensorflow as tf

        allow_memory_growth(tf.config.get_visible_devices("GPU"))
    return pinned
