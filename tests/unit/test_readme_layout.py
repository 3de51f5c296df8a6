"""README.md's "The pieces" section is the tree: every path it names exists, and every file of the
code directories (the engine, its backends, the scripts and the bench) is named there.

The section is one code block. A line that starts left of the description column names paths:
its text up to the first run of two spaces, comma-separated, relative to the directory (a name
ending in ``/``) it is indented under, two spaces a level. A line that starts at the description
column continues the description above it.
"""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DESCRIPTION_COLUMN = 28
#: Every file in these directories is named in the layout (``__init__.py`` aside).
CODE_DIRS = ("handlers", "handlers/llama_engine", "handlers/llama_engine/backends", "scripts", "scripts/bench")


def layout_block() -> list:
    text = (ROOT / "README.md").read_text()
    section = re.search(r"^## The pieces\n(.*?)(?=^## )", text, re.M | re.S)
    assert section, "README.md has no '## The pieces' section"
    block = re.search(r"^```\n(.*?)^```", section.group(1), re.M | re.S)
    assert block, "'The pieces' has no code block"
    return block.group(1).splitlines()


def named_paths(lines) -> list:
    """Each path the layout names, relative to the repository root, in order."""
    paths, parents = [], []  # parents: (indent, directory) of the enclosing directories
    for line in lines:
        indent = len(line) - len(line.lstrip(" "))
        if not line.strip() or indent >= DESCRIPTION_COLUMN:
            continue
        names = re.split(r" {2,}", line.strip(), maxsplit=1)[0]
        while parents and parents[-1][0] >= indent:
            parents.pop()
        base = parents[-1][1] if parents else ""
        for name in (n.strip() for n in names.split(",")):
            paths.append(base + name)
            if name.endswith("/"):
                parents.append((indent, base + name))
    return paths


def test_every_path_the_layout_names_exists():
    paths = named_paths(layout_block())
    assert len(paths) > 40, paths  # the parser read the block
    missing = [p for p in paths if not (ROOT / p).exists() or (p.endswith("/") and not (ROOT / p).is_dir())]
    assert not missing, f"README.md's 'The pieces' names paths that do not exist: {missing}"


def test_every_file_of_the_code_directories_is_named():
    named = {p.rstrip("/") for p in named_paths(layout_block())}
    unnamed = [str(path.relative_to(ROOT)) for directory in CODE_DIRS for path in sorted((ROOT / directory).iterdir())
               if path.is_file() and path.name != "__init__.py" and str(path.relative_to(ROOT)) not in named]
    assert not unnamed, f"add these to README.md's 'The pieces': {unnamed}"


def test_the_parser_nests_by_indentation():
    rows = [("top/", "a directory"), ("  a.py, b.py", "two files in it"), ("", "a continuation: not.a/path"),
            ("  sub/", "a directory in it"), ("    c.py", "a file in that"), ("  d.py", "back in top/"),
            ("e.txt", "at the root")]
    lines = [name.ljust(DESCRIPTION_COLUMN) + text for name, text in rows]
    assert named_paths(lines) == ["top/", "top/a.py", "top/b.py", "top/sub/", "top/sub/c.py", "top/d.py", "e.txt"]
