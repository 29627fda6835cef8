"""The test tiers (`conftest.py` says what they are for): the markers that keep a test out of
`pytest --quick`, and the cheap reading of a file's module-level marks that lets `--quick` skip
importing a file marked as a whole."""

from __future__ import annotations

import ast
import re
from pathlib import Path

TIERS = {
    "process": "starts OS processes (nodes, servers, the CLI in a child Python, a child pytest, Ray)",
    "real_model": "loads the real default model or transformers",
    "slow": "takes more than a second or two for another reason",
}


_PYTESTMARK = re.compile(r"^pytestmark\s*=", re.MULTILINE)


def module_tiers(path: Path) -> frozenset[str]:
    """The tier markers in a test file's module-level `pytestmark`, read from its source without
    importing it: the statement that starts at column 0 with `pytestmark =`, parsed alone."""
    text = path.read_text(encoding="utf-8")
    found = _PYTESTMARK.search(text)
    if found is None:
        return frozenset()
    lines = text[found.start() :].splitlines()
    for end in range(1, len(lines) + 1):
        try:
            tree = ast.parse("\n".join(lines[:end]))
        except SyntaxError:
            continue
        names = {
            node.attr
            for node in ast.walk(tree.body[0])
            if isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Attribute)
            and node.value.attr == "mark"
        }
        return frozenset(names & TIERS.keys())
    return frozenset()
