"""The package graph flows one way, between the three halves and inside the engine.

Between halves: engine <- infer <- train. The engine (`tsengine` without its `train` and `infer`
subpackages) is what a server installs and runs, so it may not reach into training or evaluation, not even
lazily inside a function; the reference generator and evaluation (`tsengine.infer`) may use the engine but
not training; training may use both.

Inside the engine, the folder list is the architecture (docs/design/layout.md), and each group imports only
the groups below it:

    entrypoints (cli, llm, tune; openai/: the server)
      -> engine (the step, scheduler, runner)
        -> speculative (proposers)  -> sample (draws, the verifier)
        -> model (the target's forward, graphs, kernels), eagle3 (the head), cache (KV blocks, prefix cache)
          -> the records at the top (config, errors, sequence, sampling_params, targets, conversations)

and the server (`entrypoints/openai/`) reaches the engine only through `tsengine.engine`'s public names.
An import made only for type annotations (under `if TYPE_CHECKING:`) does not count inside the engine: it
runs nothing, and a hand-off record may name the type of a layer above it. Imports are read from the
source (every import statement, relative ones resolved), not from what happens to be imported at run
time, so an import behind a rarely taken branch counts too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import tomllib

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


def _typing_only_lines(tree: ast.AST) -> set[int]:
    """Lines of the statements under `if TYPE_CHECKING:` (or `typing.TYPE_CHECKING`)."""
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and (getattr(node.test, "id", None) == "TYPE_CHECKING"
                                         or getattr(node.test, "attr", None) == "TYPE_CHECKING"):
            for stmt in node.body:
                lines.update(range(stmt.lineno, (stmt.end_lineno or stmt.lineno) + 1))
    return lines


def _imports(module: str, path: Path, known: set[str], runtime_only: bool = False):
    """(line, imported module) for every import in the file, at any depth (`runtime_only`: except those
    under `if TYPE_CHECKING:`)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    tree = ast.parse(path.read_text(), str(path))
    skip = _typing_only_lines(tree) if runtime_only else set()
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skip:
            continue
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
    outside = {".".join(f.relative_to(REPO).with_suffix("").parts): f
               for d in ("tests", "bench") for f in sorted((REPO / d).rglob("*.py"))}
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


# The engine's groups and what each may import besides itself. "records" are the top-level modules; the
# package's own __init__ (the public API, `from tsengine import LLM`) may import any group.
RECORDS = {"config", "errors", "sequence", "sampling_params", "targets", "conversations"}
GROUPS = {
    "records": set(),
    "cache": {"records"},
    "eagle3": {"records"},
    "model": {"cache", "records"},
    "sample": {"cache", "records"},
    "speculative": {"sample", "model", "eagle3", "cache", "records"},
    "engine": {"speculative", "sample", "model", "eagle3", "cache", "records"},
    "entrypoints": {"engine", "speculative", "sample", "model", "eagle3", "cache", "records"},
}
SERVER = "tsengine.entrypoints.openai"
ENGINE_PUBLIC = "tsengine.engine"  # its __init__: the names a server may use


def _group(module: str) -> str | None:
    """The engine group of a tsengine module (None: the package itself, or train/infer)."""
    parts = module.split(".")
    if parts[0] != "tsengine" or len(parts) == 1 or parts[1] in ("train", "infer"):
        return None
    if len(parts) == 2 and parts[1] in RECORDS:
        return "records"
    if parts[1] not in GROUPS:
        raise AssertionError(f"{module}: in no group of tests/test_layers.py GROUPS (add it where it belongs)")
    return parts[1]


def _group_violations(modules: dict[str, Path]) -> list[str]:
    bad = []
    for module, path in modules.items():
        group = _group(module)
        if group is None:
            continue
        for line, target in _imports(module, path, set(modules), runtime_only=True):
            to = _group(target) if target.startswith("tsengine.") else None
            where = f"{path.relative_to(path.parents[len(module.split('.')) - 1])}:{line}"
            if to is not None and to != group and to not in GROUPS[group]:
                bad.append(f"{where} imports {target}: {group} may import {sorted(GROUPS[group])}, not {to}")
            if (module == SERVER or module.startswith(SERVER + ".")) and to is not None and to not in (
                    "records", "entrypoints") and target != ENGINE_PUBLIC:
                bad.append(f"{where} imports {target}: the server reaches the engine through `{ENGINE_PUBLIC}` "
                           f"(its public names) only")
    return bad


def test_the_engine_groups_import_downward():
    engine = {m: f for m, f in _modules().items() if _group(m) is not None}
    bad = _group_violations(engine)
    assert not bad, "imports against the engine's groups:\n" + "\n".join(bad)


def test_every_module_of_the_engine_is_in_a_group():
    """A new folder or top-level module must be placed in GROUPS, or its imports would go unchecked."""
    for module in _modules():
        _group(module)  # raises for a module in no group


def test_the_top_level_stays_small():
    """The folder list is the architecture: the records, the package's API and the groups' folders."""
    top = sorted(f.name for f in (REPO / "tsengine").glob("*.py"))
    assert len(top) <= 12, top
    assert {f.stem for f in (REPO / "tsengine").glob("*.py")} - {"__init__"} == RECORDS


def _write_package(root: Path, files: dict[str, str]) -> dict[str, Path]:
    out = {}
    for module, text in files.items():
        f = root.joinpath(*module.split(".")).with_suffix(".py")
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(text)
        out[module] = f
    return out


def test_each_group_rule_fails_on_a_violation(tmp_path):
    """Each rule, shown failing: a layer importing upward (also lazily), the server reaching past the
    engine's public names, and a record importing a group; an annotation-only import passes."""
    mods = _write_package(tmp_path, {
        "tsengine.model.attention": "def f():\n    from tsengine.engine.runner import ModelRunner\n",
        "tsengine.cache.kv_cache": "from tsengine.entrypoints.cli import main\n",
        "tsengine.entrypoints.openai.prometheus": "from tsengine.model.graphs import compiles\n"
                                                  "from tsengine.engine.core import Engine\n"
                                                  "from tsengine.engine import Engine\n"
                                                  "from tsengine.errors import UserError\n",
        "tsengine.sequence": "from tsengine.sample.sampling import sample\n",
        "tsengine.speculative.drafts": "from typing import TYPE_CHECKING\n"
                                       "if TYPE_CHECKING:\n    from tsengine.engine.scheduler import Scheduled\n",
        "tsengine.sample.verify": "from tsengine.speculative.drafts import Drafts\n",
    })
    bad = sorted(b.split(":")[0] + ": " + b.split(" imports ")[1].split(":")[0] for b in _group_violations(mods))
    assert bad == sorted([
        "tsengine/model/attention.py: tsengine.engine.runner",
        "tsengine/cache/kv_cache.py: tsengine.entrypoints.cli",
        "tsengine/entrypoints/openai/prometheus.py: tsengine.model.graphs",  # server past the engine
        "tsengine/entrypoints/openai/prometheus.py: tsengine.engine.core",  # server past the engine
        "tsengine/sequence.py: tsengine.sample.sampling",
        "tsengine/sample/verify.py: tsengine.speculative.drafts",
    ]), bad


METHOD_NAMES = {"EAGLE3", "NGRAM", "eagle3", "ngram"}


def _method_branches(path: Path) -> list[str]:
    """Where a file compares with a speculation method's name or asks a proposer what it has (`hasattr`)."""
    bad = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Compare) and any(isinstance(c, ast.Constant) and c.value in METHOD_NAMES
                                                 for c in [node.left, *node.comparators]):
            bad.append(f"{path.name}:{node.lineno} compares with a method's name")
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("hasattr", "getattr") and any(
                isinstance(a, ast.Attribute) and a.attr == "proposer" for a in node.args):
            bad.append(f"{path.name}:{node.lineno} asks the proposer what it has")
    return bad


def test_the_engine_names_no_method(tmp_path):
    """The engine and its runner drive any proposer the same way: methods are chosen in `speculative/`
    (`load_draft_model`, `build_proposer`), and what only some proposers have is an optional method of the
    `Proposer` protocol. Shown failing on the two forms it forbids."""
    bad = [b for f in sorted((REPO / "tsengine" / "engine").glob("*.py")) for b in _method_branches(f)]
    assert not bad, bad
    f = tmp_path / "runner.py"
    f.write_text("if spec.algorithm == 'EAGLE3':\n    pass\nif hasattr(self.proposer, 'policy'):\n    pass\n")
    assert _method_branches(f) == ["runner.py:1 compares with a method's name",
                                   "runner.py:3 asks the proposer what it has"]


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
    """Every import of a conftest or of a test_* module (at any folder depth) by a file of `tests_dir`."""
    files = {".".join(("tests", *f.relative_to(tests_dir).with_suffix("").parts)): f
             for f in sorted(tests_dir.rglob("*.py"))}
    bad = []
    for module, path in files.items():
        for line, target in _imports(module, path, set(files)):
            parts = target.split(".")
            if parts[0] == "tests" and any(p == "conftest" or p.startswith("test_") for p in parts[1:]):
                bad.append(f"{path.relative_to(tests_dir)}:{line} imports {target}")
    return bad


def test_tests_import_no_test_module():
    """Tests share code through tests/helpers/ (plain helpers, a module per subject), tests/tiny.py (tiny targets) and
    tests/oracles.py (test-only oracles), and fixtures through tests/conftest.py, which pytest finds without
    an import. A test module never imports conftest or another test module: pytest imports those itself,
    under their own names, so such an import loads a second copy, and it ties one file's tests to another
    test file's code."""
    bad = _test_module_imports(REPO / "tests")
    assert not bad, ("a test module imports conftest or another test module (move what it needs to "
                     "tests/conftest.py if a fixture, tests/helpers/ or tests/oracles.py otherwise):\n"
                     + "\n".join(bad))


def test_every_test_import_form_is_read(tmp_path):
    """Absolute, `from tests import`, relative and late (in-function) imports of a test module all count, in
    a test folder too; the helper modules do not."""
    for name in ("conftest", "test_a", "tiny", "oracles", "helpers/__init__", "helpers/engine", "engine/test_c"):
        (tmp_path / f"{name}.py").parent.mkdir(exist_ok=True)
        (tmp_path / f"{name}.py").write_text("")
    (tmp_path / "test_b.py").write_text("import tests.test_a\n"
                                        "from tests.conftest import x\n"
                                        "from tests import test_a, helpers\n"
                                        "from . import conftest\n"
                                        "from .test_a import y\n"
                                        "from tests.helpers.engine import z\n"
                                        "from tests.oracles import o\n"
                                        "from tests.tiny import make_target\n"
                                        "def late():\n"
                                        "    from tests.test_a import w\n"
                                        "from tests.engine.test_c import v\n")
    assert _test_module_imports(tmp_path) == [
        "test_b.py:1 imports tests.test_a", "test_b.py:2 imports tests.conftest", "test_b.py:3 imports tests.test_a",
        "test_b.py:4 imports tests.conftest", "test_b.py:5 imports tests.test_a",
        "test_b.py:11 imports tests.engine.test_c", "test_b.py:10 imports tests.test_a"]  # ast.walk: outer first
