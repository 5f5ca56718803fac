"""The README's reader's map stays honest: each mechanism's file is at most the size the map states, and each
function it lists exists there with the line count it states. Catches a mechanism file that grew past its stated
size (the map would send a reader into 600 lines it promised as 300) and a listed function renamed, moved or
grown without the map following."""
import ast
import os
import re

from conftest import ROOT

ROW = re.compile(r"^\| (?P<term>[^|]+) \| (?P<paper>[^|]+) \| `(?P<file>[\w/]+\.py)` "
                 r"\(at most (?P<max>\d+) lines\) \| (?P<functions>[^|]+) \|$")
ENTRY = re.compile(r"`(?P<name>[\w.]+)` \((?P<lines>\d+)\)")


def readers_map() -> list[dict]:
    text = open(os.path.join(ROOT, "README.md")).read()
    section = text.split("## A reader's map", 1)[1].split("\n## ", 1)[0]
    rows = [m.groupdict() for m in map(ROW.match, section.splitlines()) if m]
    assert len(rows) >= 4, "the map lists GAP, TSP, TAG and the asynchronous policy"
    return rows


def definitions(path: str) -> dict[str, int]:
    """'name' and 'Class.name' -> lines of each top-level function, class and method in `path`."""
    found = {}
    for node in ast.parse(open(path).read()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            found[node.name] = node.end_lineno - node.lineno + 1
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    found[f"{node.name}.{item.name}"] = item.end_lineno - item.lineno + 1
    return found


def test_the_readers_map_states_true_sizes():
    for row in readers_map():
        path = os.path.join(ROOT, row["file"])
        lines = len(open(path).read().splitlines())
        assert lines <= int(row["max"]), f"{row['file']}: {lines} lines; the reader's map promises {row['max']}"
        found = definitions(path)
        entries = ENTRY.findall(row["functions"])
        assert entries, row
        for name, stated in entries:
            assert name in found, f"the reader's map names {name} in {row['file']}: not defined there"
            assert found[name] == int(stated), f"{row['file']}:{name} has {found[name]} lines; the map says {stated}"


def test_the_course_names_only_functions_that_exist():
    """Catches docs/COURSE.md and COURSE_NOTES.md sending a student to a function that does not exist (they cited
    `gap.consume` after it had gone): every `module.name` they write in code quotes is defined in that module."""
    modules = {n[:-3] for n in os.listdir(ROOT) if n.endswith(".py")}
    for doc in ("docs/COURSE.md", "docs/COURSE_NOTES.md"):
        text = open(os.path.join(ROOT, doc)).read()
        for module, name in re.findall(r"`(\w+)\.(\w+)[(`]", text):
            if module not in modules or name == "py":  # a file name, not a function
                continue
            found = definitions(os.path.join(ROOT, f"{module}.py"))
            assert name in found or f"{name} =" in open(os.path.join(ROOT, f"{module}.py")).read(), (
                f"{doc} names {module}.{name}: not defined in {module}.py")
