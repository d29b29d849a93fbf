"""init()'s GPU step: each rank gets the GPU of its local_rank unless the user chose, memory
growth unless the user configured GPU memory, and the op library learns where the NCCL wheel is. TensorFlow's device functions are replaced by a
small fake, since this machine has no GPU."""

import importlib
import sys
import warnings

import pytest
import tensorflow as tf

from keras_ring import gpu


class FakeConfig:
    """tf.config's device functions for a machine with `n` GPUs.

    A fake because this machine has none. The real path (TensorFlow placing ranks on real
    GPUs) is run by benchmarks/gpu_check.sh's NCCL checks only in part (they use CuPy, not
    TensorFlow); what runs for real here is the same code with zero GPUs
    (test_machines_without_gpus_and_single_processes_are_left_alone).
    """

    def __init__(self, n, initialized=False):
        self.physical = [tf.config.PhysicalDevice(f"/physical_device:GPU:{i}", "GPU") for i in range(n)]
        self.visible = list(self.physical)
        self.initialized = initialized
        self.calls = []
        self.growth = {}   # name -> bool, as set_memory_growth left it
        self.logical = {}  # name -> logical device configurations (virtual GPUs, limits)

    def list_physical_devices(self, kind):
        assert kind == "GPU"
        return list(self.physical)

    def get_visible_devices(self, kind):
        return list(self.visible)

    def set_visible_devices(self, devices, kind):
        self.calls.append(([d.name for d in devices], kind))
        if self.initialized:
            raise RuntimeError("Visible devices cannot be modified after being initialized")
        self.visible = list(devices)

    def get_memory_growth(self, device):
        return self.growth.get(device.name, False)

    def set_memory_growth(self, device, enable):
        if self.initialized:
            raise RuntimeError("Physical devices cannot be modified after being initialized")
        self.calls.append(("growth", device.name, enable))
        self.growth[device.name] = enable

    def get_logical_device_configuration(self, device):
        return self.logical.get(device.name)


@pytest.fixture
def fake(monkeypatch):
    def make(n, initialized=False):
        config = FakeConfig(n, initialized)
        for name in ("list_physical_devices", "get_visible_devices", "set_visible_devices",
                     "get_logical_device_configuration"):
            monkeypatch.setattr(tf.config, name, getattr(config, name))
        for name in ("get_memory_growth", "set_memory_growth"):
            monkeypatch.setattr(tf.config.experimental, name, getattr(config, name))
        return config

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("TF_FORCE_GPU_ALLOW_GROWTH", raising=False)
    return make


class FakeLibrary:
    """The op library's one C call that configure() makes."""

    def __init__(self):
        self.search_paths = []
        self.c = self
        self.keras_ring_nccl_set_search_path = self.search_paths.append


def test_each_rank_gets_the_gpu_of_its_local_rank(fake):
    config = fake(4)
    assert gpu.pin_to_local_gpu(local_rank=2, local_size=4, size=8) == "/physical_device:GPU:2"
    assert config.calls == [(["/physical_device:GPU:2"], "GPU")]


def test_more_local_ranks_than_gpus_share_them_round_robin(fake):
    config = fake(2)
    gpu.pin_to_local_gpu(local_rank=3, local_size=4, size=4)
    assert config.calls == [(["/physical_device:GPU:1"], "GPU")]


def test_machines_without_gpus_and_single_processes_are_left_alone(fake):
    config = fake(0)
    assert gpu.pin_to_local_gpu(0, 2, 2) is None
    config = fake(4)
    assert gpu.pin_to_local_gpu(0, 1, 1) is None
    assert config.calls == []


def test_a_choice_made_with_set_visible_devices_is_kept(fake):
    config = fake(4)
    config.visible = config.physical[3:]
    assert gpu.pin_to_local_gpu(0, 4, 4) is None
    assert config.calls == []


def test_cuda_visible_devices_is_kept_and_sharing_one_gpu_is_pointed_out(fake, monkeypatch):
    config = fake(1)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert gpu.pin_to_local_gpu(1, 4, 4) is None
    config = fake(4)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    with pytest.warns(UserWarning, match="every rank will use the first of them"):
        assert gpu.pin_to_local_gpu(1, 4, 4) is None
    assert config.calls == []


def test_too_late_to_pin_warns_instead_of_failing(fake):
    fake(2, initialized=True)
    with pytest.warns(UserWarning, match="call keras_ring.init\\(\\) before any TensorFlow op"):
        assert gpu.pin_to_local_gpu(1, 2, 2) is None


def test_configure_pins_and_turns_on_memory_growth_for_the_pinned_gpu_only(fake):
    from keras_ring.bootstrap import Topology

    config = fake(4)
    library = FakeLibrary()
    topology = Topology.from_host_ids(1, ["a", "a", "a", "a"])  # local_rank 1 of 4
    assert gpu.configure(library, topology) == "/physical_device:GPU:1"
    assert config.calls == [(["/physical_device:GPU:1"], "GPU"),
                            ("growth", "/physical_device:GPU:1", True)]
    assert library.search_paths == [gpu.library_search_path().encode()]


def test_a_world_of_one_keeps_tensorflows_memory_defaults(fake):
    from keras_ring.bootstrap import Topology

    config = fake(2)
    assert gpu.configure(FakeLibrary(), Topology.from_host_ids(0, ["a"])) is None
    assert config.calls == []


def test_memory_growth_also_for_gpus_the_user_chose(fake, monkeypatch):
    from keras_ring.bootstrap import Topology

    config = fake(1)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2")
    assert gpu.configure(FakeLibrary(), Topology.from_host_ids(0, ["a", "a"])) is None
    assert config.calls == [("growth", "/physical_device:GPU:0", True)]


@pytest.mark.parametrize("how", ["logical devices", "memory growth", "TF_FORCE_GPU_ALLOW_GROWTH"])
def test_memory_the_user_configured_is_left_alone(fake, monkeypatch, how):
    config = fake(2)
    first = config.physical[0].name
    if how == "logical devices":
        config.logical[first] = [tf.config.LogicalDeviceConfiguration(memory_limit=1024)]
    elif how == "memory growth":
        config.growth[first] = True
    else:
        monkeypatch.setenv("TF_FORCE_GPU_ALLOW_GROWTH", "false")
    changed = gpu.allow_memory_growth(config.physical)
    assert first not in changed
    assert ("growth", first, True) not in config.calls
    if how != "TF_FORCE_GPU_ALLOW_GROWTH":  # that one decides for every GPU
        assert changed == [config.physical[1].name]


def test_too_late_for_memory_growth_warns_instead_of_failing(fake):
    config = fake(2, initialized=True)
    with pytest.warns(UserWarning, match="memory growth could not be turned on"):
        assert gpu.allow_memory_growth(config.physical) == []


def test_configure_on_this_cpu_machine_changes_nothing():
    from keras_ring.bootstrap import Topology
    from keras_ring.ops.loader import library

    before = tf.config.get_visible_devices()
    assert gpu.configure(library(), Topology.from_host_ids(0, ["a", "a"])) is None
    assert tf.config.get_visible_devices() == before


@pytest.mark.parametrize("packages", [("nccl", "cuda_runtime"), ("nccl", "cu13")],
                         ids=["cuda12 wheels", "cuda13 wheels"])
def test_search_path_lists_the_nccl_and_cuda_runtime_wheels(tmp_path, monkeypatch, packages):
    # CUDA 12's runtime wheel is nvidia/cuda_runtime/lib; CUDA 13's wheels share nvidia/cu13/lib.
    for package in packages:
        (tmp_path / "nvidia" / package / "lib").mkdir(parents=True)
        (tmp_path / "nvidia" / package / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [m for m in sys.modules if m == "nvidia" or m.startswith("nvidia.")]:
        monkeypatch.delitem(sys.modules, name)
    importlib.invalidate_caches()
    assert gpu.library_search_path().split(":") == [
        str(tmp_path / "nvidia" / package / "lib") for package in packages]


def test_search_path_is_empty_without_the_wheels(monkeypatch):
    monkeypatch.setattr(gpu, "_LIBRARY_PACKAGES", ("keras_ring_no_such_namespace.nccl",))
    assert gpu.library_search_path() == ""
