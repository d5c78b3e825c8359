"""The slow tier names only what exists: a renamed test or file would silently fall into the fast loop (or, for\nconftest.LONG, start late under xdist and straggle)."""
import ast
import os

import conftest

HERE = os.path.dirname(os.path.abspath(__file__))


def _test_functions(filename: str) -> set[str]:
    with open(os.path.join(HERE, filename)) as f:
        tree = ast.parse(f.read())
    return {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
            and n.name.startswith("test_")}


def test_every_slow_file_and_test_exists():
    for filename in conftest.SLOW_FILES | set(conftest.SLOW_TESTS):
        assert os.path.isfile(os.path.join(HERE, filename)), f"conftest names a missing file {filename}"
    for filename, names in conftest.SLOW_TESTS.items():
        missing = names - _test_functions(filename)
        assert not missing, f"conftest.SLOW_TESTS names tests {filename} no longer has: {sorted(missing)}"
        assert filename not in conftest.SLOW_FILES, f"{filename} is slow as a whole and by name"


def test_every_long_test_exists():
    for filename, names in conftest.LONG.items():
        assert os.path.isfile(os.path.join(HERE, filename)), f"conftest.LONG names a missing file {filename}"
        missing = names - _test_functions(filename)
        assert not missing, f"conftest.LONG names tests {filename} no longer has: {sorted(missing)}"
