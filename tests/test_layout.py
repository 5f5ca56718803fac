"""The layout the project promises: each mechanism file can be copied alone (torch/einops/stdlib only), the
project's modules import each other without cycles, and nothing points outside the repository."""
import ast
import os
import sys

import pytest

from conftest import ROOT

pytestmark = pytest.mark.timeout(120)
MECHANISMS = ["gap.py", "tsp.py", "tag.py", "async_policy.py"]
ALLOWED_THIRD_PARTY = {"torch", "einops"}


def _imports(path: str, package: str = "") -> set[str]:
    """Dotted names of everything `path` imports, at any depth (function-level imports count too): `import a.b` gives
    a.b, `from pkg import x` gives pkg.x (x may be a submodule or a name defined in pkg: only the module list can
    tell); relative imports are resolved against `package`, the package `path` belongs to."""
    names = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # from . import x, from ..a import b: relative to this file's package
                parent = package.split(".")[: max(len(package.split(".")) - node.level + 1, 0)] if package else []
                base = ".".join(parent + ([node.module] if node.module else []))
            names |= {f"{base}.{alias.name}" if base else alias.name for alias in node.names}
    return names


@pytest.mark.parametrize("name", MECHANISMS)
def test_a_mechanism_file_imports_only_torch_einops_and_the_standard_library(name):
    tops = {n.split(".")[0] for n in _imports(os.path.join(ROOT, name))}
    others = sorted(tops - ALLOWED_THIRD_PARTY - set(sys.stdlib_module_names) - {"__future__"})
    assert not others, f"{name} imports {others}: it could not be copied into another codebase alone"


@pytest.mark.parametrize("name", MECHANISMS)
def test_a_mechanism_file_opens_with_what_where_the_invariant_departures_and_how_to_try_it(name):
    """(That each file imports and runs alone in a fresh interpreter from an empty folder is
    tests/test_mechanism_demos.py's: it runs `python FILE` there.)"""
    doc = __import__(name[:-3]).__doc__
    for part in ("Paper:", "Invariant", "Departures", "Try it"):  # what, where in the paper, invariant, ...
        assert part in doc, f"{name}'s docstring has no {part!r}"


def _is_venv(path: str) -> bool:
    """A virtualenv inside the checkout (the README's `python -m venv v`): installed packages, not the project."""
    return os.path.isfile(os.path.join(path, "pyvenv.cfg"))


def _project_modules(root: str = ROOT) -> dict[str, str]:
    """module name -> file, for every .py file of the project outside tests/."""
    modules = {}
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in ("tests", "runs", "bench_runs", "__pycache__")
                   and not _is_venv(os.path.join(folder, d))]
        for f in files:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(folder, f), root)[:-3].replace(os.sep, ".")
                modules[rel[: -len(".__init__")] if rel.endswith(".__init__") else rel] = os.path.join(folder, f)
    return modules


def _import_cycles(root: str = ROOT) -> list[list[str]]:
    """Every cycle a depth-first walk of the project's import graph meets (module -> the project modules it
    imports, at any depth of the file, with `from pkg import module` resolved to pkg.module)."""
    modules = _project_modules(root)
    graph = {}
    for name, path in modules.items():
        package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
        ancestors = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}
        deps = set()
        for imported in _imports(path, package):
            parts = imported.split(".")
            prefixes = [".".join(parts[:i]) for i in range(1, len(parts) + 1) if ".".join(parts[:i]) in modules]
            if prefixes:  # the module it names (pkg.x: the submodule, else pkg itself) and the packages run first,
                deps.add(prefixes[-1])  # except this module's own packages, already initialising when it runs
                deps |= set(prefixes[:-1]) - ancestors
        graph[name] = deps - {name}
    state, stack, cycles = {}, [], []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == "open":
                cycles.append(stack[stack.index(dep):] + [dep])
            elif dep not in state:
                visit(dep)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return cycles


def test_the_cycle_check_sees_from_package_import_module_and_function_level_imports(tmp_path):
    """Catches a cycle check that reads `from infra import rundir` as the package infra, or skips imports inside
    functions: it missed config -> infra.saved_config -> infra.rundir -> config (issue 23)."""
    (tmp_path / "infra").mkdir()
    (tmp_path / "infra" / "__init__.py").write_text('"""a package that imports nothing"""\n')
    (tmp_path / "config.py").write_text("def load():\n    from infra import saved_config\n")
    (tmp_path / "infra" / "saved_config.py").write_text("def f():\n    from . import rundir\n")
    (tmp_path / "infra" / "rundir.py").write_text("def g():\n    import config\n")
    assert _import_cycles(str(tmp_path)) == [["config", "infra.saved_config", "infra.rundir", "config"]]
    (tmp_path / "infra" / "rundir.py").write_text("import torch\nfrom infra import tracing\nfrom . import tracing\n")
    (tmp_path / "infra" / "tracing.py").write_text("import json\n")  # its own package runs first: no cycle
    assert _import_cycles(str(tmp_path)) == []
    (tmp_path / "infra" / "__init__.py").write_text("from .rundir import g\n")  # a package that uses its module
    (tmp_path / "infra" / "tracing.py").write_text("def h():\n    from infra import g\n")  # ... and back
    assert _import_cycles(str(tmp_path)) == [["infra", "infra.rundir", "infra.tracing", "infra"]]


def test_no_import_cycles():
    """Catches modules of the project that import each other (through packages and function-level imports too):
    which one finishes loading first then depends on who imported whom first."""
    cycles = _import_cycles()
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_nothing_under_infra_imports_config():
    """The arrow runs one way (docs/DESIGN.md): config.py may use infra/, infra/ never reads the options module,
    so infra/ can be reused without this project's Config. Catches an `import config` (or `from config import`)
    anywhere in infra/, function-level imports included."""
    offenders = sorted(name for name, path in _project_modules().items() if name.startswith("infra.")
                       and any(n == "config" or n.startswith("config.") for n in _imports(path, "infra")))
    assert not offenders, f"{offenders} import config.py (the command line lives in cli.py, at the top level)"


OUTSIDE = "shared" + "/"  # spelled in two parts so that this file does not match itself (or a repo-wide grep)


def test_nothing_points_outside_the_repository():
    hits = []
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in ("runs", "bench_runs", "__pycache__")
                   and not _is_venv(os.path.join(folder, d))]
        for f in files:
            if f.endswith((".py", ".md", ".sh")):
                path = os.path.join(folder, f)
                for number, line in enumerate(open(path, encoding="utf-8", errors="replace"), 1):
                    if OUTSIDE in line:
                        hits.append(f"{os.path.relpath(path, ROOT)}:{number}")
    assert not hits, hits


# --- line width, main.py's length, function length ------------------------------------------------
MAX_COLUMNS = 100
WRAPPED = ["main.py", "config.py", "fragment.py", "gap.py", "tsp.py", "tag.py", "async_policy.py", "rollout.py",
           "trainer.py", "grpo.py", "transport.py", "comm.py", "flowgrpo/batch_rewards.py",
           "flowgrpo/ema.py", "flowgrpo/presets.py"]
# issue 41: main.py writes out both ranks' loops, the colocated baseline's share and TAG's generation on
# the trainers ("about 300 lines is fine; size is secondary": one step readable without leaving main.py)
MAIN_MAX_LINES = 410
CORE = ["main.py", "fragment.py", "gap.py", "tsp.py", "tag.py", "async_policy.py", "rollout.py", "trainer.py",
        "grpo.py"]
MAX_FUNCTION_LINES = 60


def _long_lines(path: str, limit: int = MAX_COLUMNS) -> list[str]:
    """'file:line (columns)' for every line of `path` wider than `limit` columns."""
    with open(path, encoding="utf-8") as f:
        widths = [len(line.rstrip("\n")) for line in f]
    return [f"{os.path.basename(path)}:{number} ({width} columns)"
            for number, width in enumerate(widths, 1) if width > limit]


def _long_functions(path: str, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """'file:line name (lines)' for every function or method of `path` (nested ones too) longer
    than `limit` lines, from its `def` line to its last line."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    return [f"{os.path.basename(path)}:{node.lineno} {node.name} "
            f"({node.end_lineno - node.lineno + 1} lines)" for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > limit]


def test_the_layout_checks_see_a_long_line_and_a_long_function(tmp_path):
    """Catches checks that pass whatever the file: a 101-column line and a 61-line method fail."""
    path = tmp_path / "x.py"
    path.write_text("x = 1\n" + "#" * MAX_COLUMNS + "\n")
    assert _long_lines(str(path)) == []
    path.write_text("x = 1\n" + "#" * (MAX_COLUMNS + 1) + "\n")
    assert _long_lines(str(path)) == [f"x.py:2 ({MAX_COLUMNS + 1} columns)"]
    body = "".join(f"        y = {i}\n" for i in range(MAX_FUNCTION_LINES - 1))
    path.write_text(f"class A:\n    def f(self):\n{body}")  # def + 59 lines: exactly the limit
    assert _long_functions(str(path)) == []
    path.write_text(f"class A:\n    def f(self):\n{body}        y = 0\n")
    assert _long_functions(str(path)) == [f"x.py:2 f ({MAX_FUNCTION_LINES + 1} lines)"]


@pytest.mark.parametrize("name", WRAPPED)
def test_no_line_is_wider_than_100_columns(name):
    long = _long_lines(os.path.join(ROOT, name))
    assert not long, f"lines over {MAX_COLUMNS} columns: {long}"


def test_main_py_stays_at_most_its_stated_size():
    """main.py is the step read top to bottom: what grows there belongs in a mechanism, infra/ or the trainer."""
    with open(os.path.join(ROOT, "main.py"), encoding="utf-8") as f:
        lines = len(f.readlines())
    assert lines <= MAIN_MAX_LINES, f"main.py has {lines} lines (at most {MAIN_MAX_LINES})"


@pytest.mark.parametrize("name", CORE)
def test_no_core_function_is_longer_than_60_lines(name):
    long = _long_functions(os.path.join(ROOT, name))
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"
