"""Package names that import their module on first use (PEP 562), so that importing a package
(``keras_ring``, ``keras_ring.elastic``) stays cheap: no TensorFlow until a name is used."""

from __future__ import annotations

import importlib
from typing import Any, Callable


def lazy_exports(package: str, exports: dict[str, str], namespace: dict[str, Any],
                 submodules: tuple[str, ...] = (), absent: dict[str, str] | None = None
                 ) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """A package's ``__getattr__`` and ``__dir__`` for ``exports`` (name -> defining module).

    A name in ``submodules`` is the module itself; any other is the module's attribute of the
    same name. The first lookup stores the value in ``namespace`` (the package's globals), so
    later lookups skip ``__getattr__``. A name in ``absent`` (a name users bring from
    elsewhere, say Horovod) raises an AttributeError that says what to use instead.
    """

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            instead = f": {absent[name]}" if absent and name in absent else ""
            raise AttributeError(f"module '{package}' has no attribute {name!r}{instead}")
        imported = importlib.import_module(module)
        value = imported if name in submodules else getattr(imported, name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(exports))

    return __getattr__, __dir__
