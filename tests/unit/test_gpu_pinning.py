"""init()'s GPU step: each rank gets the GPU of its local_rank unless the user chose, and the
op library learns where the NCCL wheel is. TensorFlow's device functions are replaced by a
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


@pytest.fixture
def fake(monkeypatch):
    def make(n, initialized=False):
        config = FakeConfig(n, initialized)
        for name in ("list_physical_devices", "get_visible_devices", "set_visible_devices"):
            monkeypatch.setattr(tf.config, name, getattr(config, name))
        return config

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return make


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


def test_configure_on_this_cpu_machine_changes_nothing():
    from keras_ring.bootstrap import Topology
    from keras_ring.ops.loader import library

    before = tf.config.get_visible_devices()
    assert gpu.configure(library(), Topology.from_host_ids(0, ["a", "a"])) is None
    assert tf.config.get_visible_devices() == before


def test_search_path_lists_the_nccl_and_cuda_runtime_wheels(tmp_path, monkeypatch):
    for package in ("nccl", "cuda_runtime"):
        (tmp_path / "nvidia" / package / "lib").mkdir(parents=True)
        (tmp_path / "nvidia" / package / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [m for m in sys.modules if m == "nvidia" or m.startswith("nvidia.")]:
        monkeypatch.delitem(sys.modules, name)
    importlib.invalidate_caches()
    assert gpu.library_search_path().split(":") == [
        str(tmp_path / "nvidia" / "nccl" / "lib"), str(tmp_path / "nvidia" / "cuda_runtime" / "lib")]


def test_search_path_is_empty_without_the_wheels(monkeypatch):
    monkeypatch.setattr(gpu, "_LIBRARY_PACKAGES", ("keras_ring_no_such_namespace.nccl",))
    assert gpu.library_search_path() == ""
