"""The layout the project promises: each mechanism file can be copied alone (torch/einops/stdlib only), the
project's modules import each other without cycles, and nothing points outside the repository."""
import ast
import os
import shutil
import subprocess
import sys

import pytest

from conftest import ROOT

pytestmark = pytest.mark.timeout(120)
MECHANISMS = ["gap.py", "tsp.py", "tag.py", "tcss.py"]
ALLOWED_THIRD_PARTY = {"torch", "einops"}


def _imports(path: str) -> set[str]:
    """Top-level names of every module `path` imports (at any depth: lazy imports count too)."""
    names = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


@pytest.mark.parametrize("name", MECHANISMS)
def test_a_mechanism_file_imports_only_torch_einops_and_the_standard_library(name):
    tops = {n.split(".")[0] for n in _imports(os.path.join(ROOT, name))}
    others = sorted(tops - ALLOWED_THIRD_PARTY - set(sys.stdlib_module_names) - {"__future__"})
    assert not others, f"{name} imports {others}: it could not be copied into another codebase alone"


@pytest.mark.parametrize("name", MECHANISMS)
def test_a_mechanism_file_imports_alone_in_a_fresh_interpreter(name, tmp_path):
    shutil.copy(os.path.join(ROOT, name), tmp_path / name)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    module = name[:-3]
    proc = subprocess.run([sys.executable, "-c", f"import {module}; print({module}.__doc__.splitlines()[0])"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = __import__(module).__doc__
    for part in ("Paper:", "Invariant", "Departures", "Try it"):  # what, where in the paper, invariant, ...
        assert part in doc, f"{name}'s docstring has no {part!r}"


def _is_venv(path: str) -> bool:
    """A virtualenv inside the checkout (the README's `python -m venv v`): installed packages, not the project."""
    return os.path.isfile(os.path.join(path, "pyvenv.cfg"))


def _project_modules() -> dict[str, str]:
    """module name -> file, for every .py file of the project outside tests/."""
    modules = {}
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in ("tests", "runs", "bench_runs", "__pycache__")
                   and not _is_venv(os.path.join(folder, d))]
        for f in files:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(folder, f), ROOT)[:-3].replace(os.sep, ".")
                modules[rel[: -len(".__init__")] if rel.endswith(".__init__") else rel] = os.path.join(folder, f)
    return modules


def test_no_import_cycles():
    modules = _project_modules()
    graph = {}
    for name, path in modules.items():
        deps = set()
        for imported in _imports(path):
            parts = imported.split(".")  # `from infra import rundir` shows as infra; resolve to the longest match
            deps |= {".".join(parts[:i]) for i in range(len(parts), 0, -1) if ".".join(parts[:i]) in modules}
        package = name.rsplit(".", 1)[0] if "." in name else None
        graph[name] = deps - {name, package}
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
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


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
