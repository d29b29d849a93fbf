"""The unit suite's module order (conftest.py): the long modules go out to xdist's workers
first. A renamed or removed module left in LONG_MODULES would quietly go back to the end."""

from types import SimpleNamespace

from tests.unit.conftest import LONG_MODULES, ROOT, pytest_collection_modifyitems


def test_every_long_module_exists_once():
    assert len(set(LONG_MODULES)) == len(LONG_MODULES), LONG_MODULES
    missing = [name for name in LONG_MODULES if not (ROOT / "tests" / "unit" / name).is_file()]
    assert not missing, missing


def test_the_long_modules_come_first_and_each_module_keeps_its_tests_order():
    files = sorted((ROOT / "tests" / "unit").glob("test_*.py"))
    # Three tests per module, numbered in collection order, modules alphabetical (pytest's).
    items = [SimpleNamespace(path=f, index=i) for f in files for i in range(3)]
    pytest_collection_modifyitems(items)
    modules = list(dict.fromkeys(item.path.name for item in items))
    assert modules[:len(LONG_MODULES)] == list(LONG_MODULES), modules
    assert sorted(modules) == [f.name for f in files]
    for name in modules:
        assert [item.index for item in items if item.path.name == name] == [0, 1, 2], name


def test_a_run_with_other_suites_keeps_pytests_order():
    unit = sorted((ROOT / "tests" / "unit").glob("test_*.py"))[:3]
    items = [SimpleNamespace(path=ROOT / "tests" / "parallel" / "test_keras_callbacks.py"),
             *(SimpleNamespace(path=f) for f in unit)]
    before = list(items)
    pytest_collection_modifyitems(items)
    assert items == before
