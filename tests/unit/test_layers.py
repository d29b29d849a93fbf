"""The package is layered bottom-up: no module imports one of a higher layer, and no imports
go round in a circle, function-level and TYPE_CHECKING imports included (read from the source,
so a circle fails here before it fails at some import order).

A new module needs a line in LAYERS: the lowest layer above everything it imports.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "keras_ring"

LAYERS = {
    # 0. Leaves, no TensorFlow: the environment, addresses, the errors of a launch,
    # keras-ring-run (its ranks' wrapper, a stdlib-only script; their output; MPICH's
    # leftovers), the op library's builder and ABI numbering.
    "keras_ring.config": 0,
    "keras_ring._lazy_exports": 0,
    "keras_ring.interfaces": 0,
    "keras_ring._errors_base": 0,
    "keras_ring._rank_wrapper": 0,
    "keras_ring._launch_output": 0,
    "keras_ring._mpich_shm": 0,
    "keras_ring.launcher": 0,
    "keras_ring._horovodrun_flags": 0,  # keras-ring-run's share of horovodrun's flags
    "keras_ring.ops.build": 0,
    "keras_ring.ops.build_cache": 0,
    "keras_ring.ops.reduce_op": 0,
    # 1. The peer table every exchange produces.
    "keras_ring.peer_table": 1,
    # 2. The exchanges that build it (Spark's is in keras_ring.spark, with its launcher).
    "keras_ring.mpi_exchange": 2,
    "keras_ring.rendezvous": 2,
    # The elastic rendezvous (a server forming each world) and a worker's side of it.
    "keras_ring.elastic": 2,  # loads its names lazily
    "keras_ring.elastic.server": 2,
    "keras_ring.elastic.client": 2,
    # 3. Which exchange runs.
    "keras_ring.bootstrap": 3,
    # The elastic launcher (it starts workers) and keras-ring-run's entry point.
    "keras_ring.elastic.driver": 3,
    "keras_ring.cli": 3,
    # 4. The op library, TensorFlow's error classes, the steps higher layers add to init().
    "keras_ring.ops": 4,
    "keras_ring.ops.__main__": 4,
    "keras_ring.ops.loader": 4,
    "keras_ring.ops.wrappers": 4,
    "keras_ring.ops.xla": 4,
    "keras_ring.errors": 4,
    "keras_ring._lifecycle": 4,
    "keras_ring._keras_private": 4,  # the version check init() runs; Keras read lazily
    # 5. The runtime and what init() configures.
    "keras_ring.gpu": 5,
    "keras_ring.threads": 5,
    "keras_ring.runtime": 5,
    # 6. The process API, the collectives, the timeline written at shutdown.
    "keras_ring.basics": 6,
    "keras_ring.collectives": 6,
    "keras_ring.objects": 6,  # Python objects over the collectives
    "keras_ring.timeline": 6,
    "keras_ring.introspection": 6,
    "keras_ring.process_sets": 6,
    "keras_ring.process_set_setup": 6,  # adds sets with collectives over the whole job
    # 7. The Keras integration.
    "keras_ring._xla": 7,
    "keras_ring.compression": 7,
    "keras_ring.scatter": 7,  # reducescatter takes a compressor, as Horovod's
    "keras_ring._bucket_tuning": 7,
    "keras_ring._buckets": 7,
    "keras_ring._overwrite": 7,
    "keras_ring._accumulation": 7,
    "keras_ring._grouping": 7,  # Horovod's groups=; which variable is which
    "keras_ring._local": 7,
    "keras_ring._weight_layout": 7,  # which weights each rank trains
    "keras_ring._weight_check": 7,
    "keras_ring._step_check": 7,
    "keras_ring._rate_check": 7,
    "keras_ring._failed_calls": 7,  # a failed fit/evaluate/predict frees its data iterators
    "keras_ring._optimizer_settings": 7,
    "keras_ring._model_config": 7,  # how each rank's model is built, beside its weights
    "keras_ring._shared_files": 7,  # files that callbacks of several ranks would write
    "keras_ring._adapted_state": 7,  # preprocessing layers' state, refreshed and compared
    "keras_ring.sync_batch_normalization": 7,
    "keras_ring.optimizer": 7,
    "keras_ring._model_optimizers": 7,  # Model.compile's hook; which optimizers are wrapped
    "keras_ring.gradient_tape": 7,
    "keras_ring.callbacks": 7,
    "keras_ring.callbacks._learning_rate": 7,
    "keras_ring.callbacks._arguments": 7,
    "keras_ring.callbacks.broadcast_global_variables": 7,
    "keras_ring.callbacks.learning_rate_schedule": 7,
    "keras_ring.callbacks.learning_rate_warmup": 7,
    "keras_ring.callbacks.metric_average": 7,
    "keras_ring.callbacks.rank_zero": 7,
    "keras_ring.callbacks.best_model_checkpoint": 7,
    "keras_ring.saving": 7,
    "keras_ring.callbacks.commit_state": 7,
    "keras_ring.callbacks.update_batch_state": 7,
    "keras_ring.callbacks.update_epoch_state": 7,
    # Elastic training's states and its run decorator.
    "keras_ring.elastic.state": 7,
    "keras_ring.elastic.run": 7,
    # 8. Launchers on top of the runtime, and the package's own namespace.
    "keras_ring.spark": 8,
    "keras_ring": 8,
}

# Run as scripts (python -I _rank_wrapper.py): they cannot import keras_ring at all.
STDLIB_ONLY = {"keras_ring._rank_wrapper"}


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _imports(module: str, path: Path, known: set[str]) -> list[tuple[int, str]]:
    """(line, imported keras_ring module) for every import statement in ``path``."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            # `from pkg import name` imports the submodule pkg.name when there is one.
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                       for a in node.names]
        else:
            continue
        found += [(node.lineno, t) for t in targets
                  if t == "keras_ring" or t.startswith("keras_ring.")]
    return found


def _graph() -> tuple[dict[str, Path], dict[str, list[tuple[int, str]]]]:
    modules = _modules()
    return modules, {m: _imports(m, p, set(modules)) for m, p in modules.items()}


def test_every_module_has_a_layer():
    modules, _ = _graph()
    missing = sorted(set(modules) - set(LAYERS))
    assert not missing, f"declare the layer of {missing} in LAYERS ({__file__})"
    gone = sorted(set(LAYERS) - set(modules))
    assert not gone, f"LAYERS names modules that no longer exist: {gone}"


def test_no_module_imports_from_a_higher_layer():
    modules, graph = _graph()
    offending = []
    for module, imports in graph.items():
        for line, target in imports:
            where = f"{modules[module].relative_to(ROOT)}:{line}"
            if target not in LAYERS:
                offending.append(f"{where}: imports {target}, which is no known module")
            elif module in STDLIB_ONLY:
                offending.append(f"{where}: imports {target}, but {module} must stay stdlib-only")
            elif LAYERS[target] > LAYERS.get(module, -1):
                offending.append(f"{where}: {module} (layer {LAYERS.get(module)}) imports "
                                 f"{target} (layer {LAYERS[target]})")
    assert not offending, "\n".join(offending)


def test_imports_go_round_in_no_circle():
    _, graph = _graph()
    edges = {m: sorted({t for _, t in imports if t != m}) for m, imports in graph.items()}
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        if module in path:
            raise AssertionError("import circle: " + " -> ".join(path[path.index(module):]
                                                                 + [module]))
        if module in done:
            return
        for target in edges.get(module, []):
            visit(target, path + [module])
        done.add(module)

    for module in sorted(edges):
        visit(module, [])
