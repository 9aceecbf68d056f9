"""The package graph flows one way: engine <- infer <- train.

The engine (`tsengine` without its `train` and `infer` subpackages) is what a server installs and runs, so
it may not reach into training or evaluation, not even lazily inside a function; the reference generator
and evaluation (`tsengine.infer`) may use the engine but not training; training may use both. Read from
the source (every import statement, relative ones resolved), not from what happens to be imported at
run time, so an import behind a rarely taken branch counts too.
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LAYERS = {"tsengine": 0, "tsengine.infer": 1, "tsengine.train": 2}  # a layer may import its own and lower ones
LAYER_NAMES = {0: "engine", 1: "infer", 2: "train"}


def _setuptools() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]


def _modules() -> dict[str, Path]:
    """Module name -> file, through pyproject's package-dir mapping (train/ installs as tsengine.train)."""
    dirs = _setuptools()["package-dir"]
    out = {}
    for pkg, d in dirs.items():
        for f in sorted((REPO / d).rglob("*.py")):
            parts = f.relative_to(REPO / d).with_suffix("").parts
            out[".".join((pkg, *parts[:-1])) if parts[-1] == "__init__" else ".".join((pkg, *parts))] = f
    return out


def _layer(module: str) -> int:
    return max(v for root, v in LAYERS.items() if module == root or module.startswith(root + "."))


def _imports(module: str, path: Path, known: set[str]):
    """(line, imported module) for every import in the file, at any depth."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield node.lineno, a.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            for a in node.names:  # `from tsengine import train` imports the subpackage
                yield node.lineno, f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None))
              in ("import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)):
            yield node.lineno, node.args[0].value


def _violations() -> list[str]:
    modules = _modules()
    # tests/ and bench/ sit above every layer, but with the repo root on sys.path (pytest's pythonpath, a
    # script's own directory) a bare `train` or `infer` would import a second copy of a module there too
    outside = {f"{f.parent.name}.{f.stem}": f for d in ("tests", "bench") for f in sorted((REPO / d).glob("*.py"))}
    bad = []
    for module, path in {**modules, **outside}.items():
        where = f"{path.relative_to(REPO)} ({module})"
        for line, target in _imports(module, path, set(modules)):
            top = target.split(".")[0]
            if top in ("train", "infer"):
                bad.append(f"{where}:{line} imports {target!r}: the packages install as tsengine.{top}")
            elif top == "tsengine" and module in modules and _layer(target) > _layer(module):
                bad.append(f"{where}:{line} imports {target}: the {LAYER_NAMES[_layer(module)]} layer may not "
                           f"import the {LAYER_NAMES[_layer(target)]} layer")
    return bad


def test_imports_flow_one_way():
    bad = _violations()
    assert not bad, "imports against the layers (engine <- infer <- train):\n" + "\n".join(bad)


def test_every_import_form_is_read(tmp_path):
    """The check sees imports inside functions, relative ones, `from package import subpackage` and
    importlib's, so a violation cannot hide in any of them."""
    f = tmp_path / "mod.py"
    f.write_text("import os\n"
                 "def late():\n"
                 "    from tsengine.train.data import build\n"
                 "    from ..infer import reference\n"
                 "    from . import targets\n"
                 "    from tsengine import train\n"
                 "    importlib.import_module('tsengine.infer.eval')\n")
    known = {"tsengine.train", "tsengine.infer.reference", "tsengine.eagle3.targets"}
    assert [t for _, t in _imports("tsengine.eagle3.mod", f, known)] == [
        "os", "tsengine.train.data", "tsengine.infer.reference", "tsengine.eagle3.targets", "tsengine.train",
        "tsengine.infer.eval"]


def test_the_check_reads_every_layer():
    layers = {_layer(m) for m in _modules()}
    assert layers == set(LAYER_NAMES), layers


def test_every_package_is_in_the_wheel():
    """A directory with an __init__.py that pyproject's `packages` leaves out installs as nothing, which
    the editable install used in development hides."""
    st = _setuptools()
    found = {m for m, f in _modules().items() if f.name == "__init__.py"}
    assert sorted(st["packages"]) == sorted(found), (
        f"pyproject.toml [tool.setuptools] packages: missing {sorted(found - set(st['packages']))}, "
        f"not a package here {sorted(set(st['packages']) - found)}")



def _test_module_imports(tests_dir: Path) -> list[str]:
    """Every import of tests.conftest or of a tests.test_* module by a file of `tests_dir`."""
    files = {f"tests.{f.stem}": f for f in sorted(tests_dir.glob("*.py"))}
    bad = []
    for module, path in files.items():
        for line, target in _imports(module, path, set(files)):
            parts = target.split(".")
            if parts[0] == "tests" and len(parts) > 1 and (parts[1] == "conftest" or parts[1].startswith("test_")):
                bad.append(f"{path.name}:{line} imports {target}")
    return bad


def test_tests_import_no_test_module():
    """Tests share code through tests/helpers.py (plain helpers), tests/tiny.py (tiny targets) and
    tests/oracles.py (test-only oracles), and fixtures through tests/conftest.py, which pytest finds without
    an import. A test module never imports conftest or another test module: pytest imports those itself,
    under their own names, so such an import loads a second copy, and it ties one file's tests to another
    test file's code."""
    bad = _test_module_imports(REPO / "tests")
    assert not bad, ("a test module imports conftest or another test module (move what it needs to "
                     "tests/conftest.py if a fixture, tests/helpers.py or tests/oracles.py otherwise):\n"
                     + "\n".join(bad))


def test_every_test_import_form_is_read(tmp_path):
    """Absolute, `from tests import`, relative and late (in-function) imports of a test module all count;
    the helper modules do not."""
    for name in ("conftest", "test_a", "helpers", "tiny", "oracles"):
        (tmp_path / f"{name}.py").write_text("")
    (tmp_path / "test_b.py").write_text("import tests.test_a\n"
                                        "from tests.conftest import x\n"
                                        "from tests import test_a, helpers\n"
                                        "from . import conftest\n"
                                        "from .test_a import y\n"
                                        "from tests.helpers import z\n"
                                        "from tests.oracles import o\n"
                                        "from tests.tiny import make_target\n"
                                        "def late():\n"
                                        "    from tests.test_a import w\n")
    assert _test_module_imports(tmp_path) == [
        "test_b.py:1 imports tests.test_a", "test_b.py:2 imports tests.conftest", "test_b.py:3 imports tests.test_a",
        "test_b.py:4 imports tests.conftest", "test_b.py:5 imports tests.test_a", "test_b.py:10 imports tests.test_a"]
