"""The README's code blocks, for the tests that run them (test_readme.py; the TRL snippet in
integrations/test_trl.py, against that module's server). Imported by name (tests/ is on sys.path).

A snippet runs as written, with a few named substitutions (a path under /data becomes a temporary
directory, a bucket becomes the test's S3 server): each substitution must match, so an edit of the
README that a test no longer understands fails loudly instead of running something else.
"""

from __future__ import annotations

import ast
import contextlib
import io
import os
import re
from dataclasses import dataclass
from typing import Any

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")


@dataclass(frozen=True)
class Snippet:
    lang: str
    line: int  # of the opening fence, 1-based
    code: str

    @property
    def first(self) -> str:
        return self.code.lstrip().splitlines()[0]


def snippets(lang: str, path: str = README) -> list[Snippet]:
    """Every fenced block of `lang` in the file, in order."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    out = []
    for m in re.finditer(r"^```(\w*)\n(.*?)^```", text, flags=re.S | re.M):
        if m.group(1) == lang:
            out.append(Snippet(lang, text.count("\n", 0, m.start()) + 1, m.group(2)))
    return out


def one_snippet(lang: str, marker: str, path: str = README) -> Snippet:
    """The one block of `lang` that contains `marker`."""
    found = [s for s in snippets(lang, path) if marker in s.code]
    assert len(found) == 1, f"{len(found)} {lang} blocks of {path} contain {marker!r}"
    return found[0]


def substitute(code: str, substitutions: dict[str, str]) -> str:
    for old, new in substitutions.items():
        assert old in code, f"the README snippet no longer contains {old!r}:\n{code}"
        code = code.replace(old, new)
    return code


@dataclass
class Ran:
    namespace: dict[str, Any]
    stdout: str
    value: Any  # the value of the snippet's last statement when it is an expression, else None


def run_python(snippet: Snippet, namespace: dict[str, Any], substitutions: dict[str, str] | None = None) -> Ran:
    """Execute the snippet (after `substitutions`) in `namespace`; what it printed, and the value of its
    last statement if that is an expression (what a reader sees as the snippet's result)."""
    code = substitute(snippet.code, substitutions or {})
    tree = ast.parse(code, filename=f"README.md:{snippet.line}")
    last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(tree, f"README.md:{snippet.line}", "exec"), namespace)
        value = None
        if last is not None:
            value = eval(compile(ast.Expression(last.value), f"README.md:{snippet.line}", "eval"), namespace)
    return Ran(namespace, out.getvalue(), value)
