"""``BroadcastGlobalVariablesCallback``: every rank starts training from the root's state."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import keras

from keras_ring import _adapted_state, _keras_private, _weight_check
from keras_ring._grouping import is_variable, variable_keys
from keras_ring._local import check_variable
from keras_ring._model_optimizers import unwrapped_optimizers, unwrapped_training
from keras_ring._weight_layout import ModelLayout, label
from keras_ring.basics import size
from keras_ring.collectives import _shared_variables, broadcast_variables
from keras_ring.objects import allgather_object
from keras_ring.callbacks._arguments import check_device, check_process_set
from keras_ring.process_sets import ProcessSet, global_process_set
from keras_ring.runtime import RUNTIME


def _check_root(root_rank: Any) -> int:
    if isinstance(root_rank, bool) or not isinstance(root_rank, int) or root_rank < 0:
        raise ValueError(f"root_rank must be a non-negative int, got {root_rank!r}")
    return root_rank


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """Broadcasts the model's weights and the optimizer's variables from ``root_rank`` to all ranks.

    Ranks build their models independently, so their initial weights differ; this callback
    makes every rank continue from the root's weights and optimizer state. It broadcasts
    right before the first training step of every ``fit()`` call, after every callback's
    ``on_train_begin`` and ``on_epoch_begin`` (so also after a checkpoint that one of them
    restored, e.g. ``keras.callbacks.BackupAndRestore``), and after building the
    optimizer's variables if they did not exist yet, so no step ever runs on
    unsynchronised weights or slots. The random-seed states of the model's layers (Dropout's,
    the augmentation layers') are not broadcast: each rank keeps drawing its own.

    Args:
        root_rank: the rank whose variables everybody gets. Default 0.
        device: Horovod's placement of the broadcast; accepted (a string) and ignored.
        local_variables: a variable or a list of variables (``keras.Variable`` or
            ``tf.Variable``) that keep each rank's own value: they are not broadcast, like
            those named later with :meth:`register_local_var`. Typically the weights of
            the ``local_layers`` of a ``PartialDistributedOptimizer``.
        process_set: broadcast among these ranks only (``root_rank`` is a global rank in
            it); all by default.

    Example:

    ```python
    model.fit(x, y, callbacks=[keras_ring.callbacks.BroadcastGlobalVariablesCallback(0)])
    ```
    """

    def __init__(self, root_rank: int = 0, device: str = "", *, local_variables: Any = None,
                 process_set: ProcessSet = global_process_set) -> None:
        super().__init__()
        check_device(device, "BroadcastGlobalVariablesCallback")
        check_process_set(process_set, "BroadcastGlobalVariablesCallback")
        self.root_rank = _check_root(root_rank)
        self.process_set = process_set
        self._pending = True
        self._first_step = False  # the first step of a fit is still to be looked at
        self._local_variables: list[Any] = []
        if local_variables is None:
            local_variables = []
        elif is_variable(local_variables) or not isinstance(local_variables, Iterable):
            local_variables = [local_variables]  # one variable (variables are iterable too)
        for variable in local_variables:
            self.register_local_var(variable)

    def register_local_var(self, var: Any) -> None:
        """Leaves ``var`` out of the broadcast: each rank keeps its own value (Horovod's method)."""
        self._local_variables.append(
            check_variable(var, "BroadcastGlobalVariablesCallback: local_variables"))

    def on_train_begin(self, logs: dict | None = None) -> None:
        RUNTIME.topology("fit() with BroadcastGlobalVariablesCallback")  # init() came first
        ranks = self.process_set.members()
        if self.root_rank not in ranks:
            where = (f"this job of size {size()}" if self.process_set is global_process_set
                     else f"{self.process_set}")
            raise ValueError(f"BroadcastGlobalVariablesCallback: root_rank={self.root_rank} "
                             f"is not a rank of {where}")
        plain = unwrapped_training(self.model) if len(ranks) > 1 else None
        if plain is not None:
            # Every rank would apply its own gradients from the root's weights: apart from
            # the first step on, with exit 0 (Horovod trained on the same way).
            raise ValueError(
                f"BroadcastGlobalVariablesCallback: model '{self.model.name}' trains with "
                f"optimizers that keras_ring does not wrap ({plain}): each rank would apply "
                "its own gradients, and the ranks would train apart from the first step. "
                "Compile with keras_ring.wrap(optimizer) (Horovod's DistributedOptimizer); "
                "to train each rank alone from the root's weights on purpose, call "
                "keras_ring.broadcast_variables(model.variables, root_rank=0) before fit "
                "instead of this callback")
        self._pending = True
        self._first_step = len(ranks) > 1

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        if self._pending:
            broadcast_model(self.model, self.root_rank, local_variables=self._local_variables,
                            process_set=self.process_set)
            self._pending = False

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        if not self._first_step:
            return
        self._first_step = False
        # A custom train_step may average through a DistributedGradientTape, so its
        # optimizers are not refused before training; a first step that made no collective
        # at all averaged nothing (keras-io's GAN with wrap() forgotten), on every rank alike.
        plain = unwrapped_optimizers(self.model)
        if plain is not None and _weight_check.communicates(self.model) is False:
            raise ValueError(
                f"BroadcastGlobalVariablesCallback: the train_step of model "
                f"'{self.model.name}' averaged no gradients in its first step (it made no "
                f"keras_ring collective), and keras_ring wraps none of its optimizers "
                f"({plain}): each rank applies its own gradients, and the ranks train apart. "
                "Wrap them with keras_ring.wrap(optimizer), or take the gradients through "
                "keras_ring.DistributedGradientTape(tape); to train each rank alone from the "
                "root's weights on purpose, call keras_ring.broadcast_variables("
                "model.variables, root_rank=0) before fit instead of this callback")


def broadcast_model(model: keras.Model, root_rank: int = 0,
                    local_variables: Iterable[Any] = (),
                    process_set: ProcessSet = global_process_set) -> None:
    """Assigns the root rank's model and optimizer variables on every rank (eagerly).

    The optimizer's variables are built first when needed, so slots such as Adam's moments
    exist on every rank and are broadcast too; so are those of the optimizers the model holds
    as attributes (keras-io's GAN: ``d_optimizer``, ``g_optimizer``). ``local_variables`` are
    left out. Adapted ``Normalization`` layers then use the root's statistics (their copy is
    refreshed).

    Raises:
        ValueError: the model is not built yet (it has no variables to send); the message
            says how to build it.
    """
    unbuilt = _keras_private.unbuilt_layers(model)
    if unbuilt:
        raise ValueError(_unbuilt_message(model, unbuilt))
    optimizer = getattr(model, "optimizer", None)
    weights = list(model.weights)  # not its variables: those add the layers' random seeds
    slots: list[Any] = []
    if optimizer is not None:
        if not optimizer.built and model.trainable_variables:
            optimizer.build(model.trainable_variables)
        slots = list(optimizer.variables)
    # A resumed GAN's moments and step counts: the optimizers it holds as attributes.
    held = {name: list(o.variables) for name, o in _keras_private.held_optimizers(model)}
    local: set[int] = set()
    for variable in local_variables:
        local |= variable_keys(variable)

    def shared(variables: list) -> list:
        return [v for v in variables if not variable_keys(v) & local]

    weights, slots = shared(weights), shared(slots)
    held = {name: shared(variables) for name, variables in held.items()}
    _check_same_variables(model, len(_shared_variables(weights)), len(_shared_variables(slots)),
                          {name: len(_shared_variables(vs)) for name, vs in held.items()},
                          process_set)
    broadcast_variables(weights + slots + [v for vs in held.values() for v in vs],
                        root_rank=root_rank, process_set=process_set)
    _adapted_state.refresh(model)  # Normalization's copy of its statistics, as Keras's loader


def _built_without_call(model: keras.Model) -> bool:
    """Whether ``model.build(input_shape)`` marked the model built without running it: a
    subclassed model without a build() of its own (Keras's default build does not run
    call(); Sequential and functional models have their own), none of whose layers ran."""
    return (_keras_private.default_build(model) and model.built
            and not any(layer.built for layer in _keras_private.nested_layers(model)[1:]))


def _unbuilt_message(model: keras.Model, unbuilt: list) -> str:
    start = f"keras_ring: cannot broadcast the variables of model '{model.name}': "
    layer = f"its layer '{unbuilt[0].name}'{' (and more)' if len(unbuilt) > 1 else ''}"
    if _built_without_call(model):  # model.build(shape) of a subclassed model
        return (start + f"{layer} does not exist yet: the model was built by Keras's default "
                "build(), which marks a subclassed model built without running its call(). "
                "Call the model on one batch before fit (model(x[:1])), or give the model a "
                "build() that builds its layers")
    if model.built:  # the model ran, and its call() never reached these layers
        # Skipping them would leave each rank its own initial values wherever a custom
        # train_step builds them later, and the weight check settled before they existed.
        return (start + f"{layer} did not run when the model was built, so its variables do "
                "not exist yet (the model's call() never reaches it). If something uses it "
                "outside call() (a custom train_step), build it with the model: "
                "layer.build(input_shape) in the model's build() or __init__; if nothing uses "
                "it, remove it from the model")
    what = "it is" if unbuilt[0] is model else f"{layer} is"
    # Keras's default build() would only mark a subclassed model built (the case above).
    how = ("call it on one batch (model(x[:1])), give it a keras.Input"
           if _keras_private.default_build(model) else
           "model.build(input_shape), call it on a batch, give it a keras.Input")
    return (start + f"{what} not built yet, so some variables do not exist (Keras builds a "
            f"layer without an Input when it first runs). Build it first: {how}, or compile "
            "it with keras_ring.wrap(optimizer), which makes fit() build it before the first "
            "step")


def _check_same_variables(model: keras.Model, weights: int, slots: int, held: dict[str, int],
                          process_set: ProcessSet) -> None:
    """Every rank raises, naming the counts, where the ranks' models or optimizers differ
    (``held``: variables of each optimizer the model holds as an attribute)."""
    optimizer = type(getattr(model, "optimizer", None)).__name__
    layout = ModelLayout(model, model.trainable_weights)
    trainable = layout.tags  # which weights: ranks that froze different layers differ here
    shapes = [(tuple(w.shape), keras.backend.standardize_dtype(w.dtype)) for w in model.weights]
    counts = allgather_object((weights, slots, optimizer, trainable, sorted(held.items()),
                               shapes),
                              name="keras_ring.broadcast_counts", process_set=process_set)
    if all(c == counts[0] for c in counts):
        return
    ranks = process_set.members()
    if all(c[:4] == counts[0][:4] for c in counts):
        listed = "; ".join(f"rank {r}: " + ", ".join(f"{n} {k}" for n, k in c[4])
                           for r, c in zip(ranks, counts))
        raise ValueError(
            f"keras_ring: cannot broadcast model '{model.name}': the optimizers it holds as "
            f"attributes have different variables on different ranks ({listed}). An "
            "optimizer makes its slots at its first update, a restored one has them: build "
            "each on every rank before the broadcast (optimizer.build(sub_model."
            "trainable_variables)), or restore the checkpoint on every rank")
    odd = next(((r, c[3]) for r, c in zip(ranks, counts) if c[3] != counts[0][3]), None)
    # The same model (its weights' count, dtypes and shapes: the first two tags), trained
    # differently; the slots follow the trainable weights.
    if odd is not None and odd[1][:2] == counts[0][3][:2]:
        detail = layout.describe(counts[0][3], odd[1], ranks[0], odd[0])
        raise ValueError(
            f"keras_ring: cannot broadcast model '{model.name}': the ranks train different "
            f"sets of its weights ({detail}): a layer is frozen (trainable=False) on some "
            "ranks only. Set the layers' trainable flags alike on every rank, then compile")
    built = _first_shape_difference(model, ranks, [c[5] for c in counts])
    if built:
        raise ValueError(
            f"keras_ring: cannot broadcast model '{model.name}': the ranks built different "
            f"models ({built}). Build the model alike on every rank (the same layers, units "
            "and input shape)")
    listed = "; ".join(f"rank {r}: {c[0]} model weights, {c[1]} variables of its {c[2]}"
                       for r, c in zip(ranks, counts))
    raise ValueError(
        f"keras_ring: cannot broadcast model '{model.name}': the ranks hold different variables "
        f"({listed}). A model loaded from a legacy .h5 file comes back with an optimizer "
        "without its slots (Keras 3 restores only its iteration count and learning rate): "
        "checkpoint to .keras, or load the model on every rank alike")


def _first_shape_difference(model: keras.Model, ranks: list[int], shapes: list[list]) -> str:
    """The first weight whose shape or dtype differs from the first rank's, on the first
    rank where one does ("" where none does)."""
    for rank, theirs in zip(ranks[1:], shapes[1:]):
        if len(theirs) != len(shapes[0]):
            return (f"rank {ranks[0]}'s has {len(shapes[0])} weights, rank {rank}'s "
                    f"{len(theirs)}")
        for i, (a, b) in enumerate(zip(shapes[0], theirs)):
            if a != b:
                name = label(model.weights[i]) if i < len(model.weights) else f"#{i}"
                return (f"weight {i} ('{name}'): rank {ranks[0]} {a[0]} {a[1]}, "
                        f"rank {rank} {b[0]} {b[1]}")
    return ""
