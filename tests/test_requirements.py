"""requirements.txt holds what the default run and the tests import; requirements-extras.txt the optional
integrations (issue 41 item 7). Catches a package the code starts importing without listing it (a fresh
virtualenv, .ci/run, fails on it) and a listed package nothing imports any more (imageio was one)."""
import ast
import os
import re
import sys

from conftest import ROOT

# importable name -> distribution name, where they differ
DISTRIBUTION = {"PIL": "pillow", "xdist": "pytest-xdist"}  # import name -> the distribution that provides it
# installed by a listed package (transformers / diffusers require them): imported directly, not pinned here
TRANSITIVE = {"huggingface_hub", "tokenizers", "packaging"}
# listed, never imported by name: the real pipelines' tokenizers (T5's sentencepiece and its protobuf) and
# diffusers' big-model loading (accelerate)
LOADED_BY_OTHERS = {"sentencepiece", "protobuf", "accelerate"}


def listed(name: str) -> set[str]:
    lines = open(os.path.join(ROOT, name)).read().splitlines()
    return {re.split(r"[=<>\[ #]", line.strip())[0].lower() for line in lines if line.strip() and line[0] != "#"}


def third_party_imports() -> dict[str, set[str]]:
    """top-level module -> the project files (outside tests/inject) that import it, stdlib and local ones left out."""
    local = {n[:-3] for n in os.listdir(ROOT) if n.endswith(".py")} | {
        n for n in os.listdir(ROOT) if os.path.isfile(os.path.join(ROOT, n, "__init__.py"))}
    local |= {n[:-3] for n in os.listdir(os.path.join(ROOT, "tests")) if n.endswith(".py")}
    local |= {n[:-3] for n in os.listdir(os.path.join(ROOT, "tests", "inject")) if n.endswith(".py")}
    found: dict[str, set[str]] = {}
    for root, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d != "__pycache__"]
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(root, name)
            for node in ast.walk(ast.parse(open(path).read())):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                         [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else [])
                for module in names:
                    top = module.split(".")[0]
                    if top not in sys.stdlib_module_names and top not in local:
                        found.setdefault(DISTRIBUTION.get(top, top).lower(), set()).add(os.path.relpath(path, ROOT))
    return found


def test_every_imported_package_is_listed_and_every_listed_one_is_used():
    required, extras = listed("requirements.txt"), listed("requirements-extras.txt")
    imported = third_party_imports()
    missing = {m: sorted(files) for m, files in imported.items() if m not in required | extras | TRANSITIVE}
    assert not missing, f"imported but in neither requirements file: {missing}"
    unused = (required | extras) - set(imported) - LOADED_BY_OTHERS - {"pytest-timeout", "pytest-xdist"}
    assert not unused, f"listed but imported nowhere: {sorted(unused)}"
    assert not required & extras, required & extras
    # the optional integrations are imported lazily, behind their flags: no module-level import outside tests
    for package in extras:
        for path in imported.get(package, ()):
            assert path.startswith("tests") or f"import {package}" not in _module_level(path), (package, path)


def _module_level(path: str) -> str:
    tree = ast.parse(open(os.path.join(ROOT, path)).read())
    return "\n".join(ast.unparse(n) for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom)))
