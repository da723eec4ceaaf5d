"""Code-completion prompts from the documented functions of pure-Python wheels (`prompts.code_wheels`).

Chat data holds little code, and a drafter learns what it reads: on code, answers repeat the prompt
(the function's signature and docstring) and continue it in the library's idioms. Each public function
with a docstring becomes a request shaped like a served code completion (the stub in a fenced block,
"complete it") whose original answer is the function as its authors wrote it, so it trains for the
price of extraction (`generate.original_answers_share`) or is answered by the target. The wheels are
downloaded by name and version from the package index and read as zips, never installed or imported;
benchmarks (HumanEval) stay evaluation-only.
"""

from __future__ import annotations

import ast
import hashlib
import zipfile
from pathlib import Path
from typing import Any

CODE_REQUEST = "Complete the following Python function.\n\n```python\n{stub}```"
MIN_LINES, MAX_LINES = 5, 60  # a function worth completing, short enough for one answer


class CodePromptError(ValueError):
    """A code wheel that cannot be read (bad input)."""


def _first_line(node: ast.FunctionDef) -> int:
    """0-based index of the function's first line, its decorators included."""
    return min([d.lineno for d in node.decorator_list] + [node.lineno]) - 1


def function_stub(lines: list[str], node: ast.FunctionDef) -> str:
    """The function's decorators, signature and docstring: what a completion request shows."""
    doc_end = node.body[0].end_lineno  # the docstring is the body's first statement
    return "\n".join(lines[_first_line(node) : doc_end]) + "\n"


def function_source(lines: list[str], node: ast.FunctionDef) -> str:
    return "\n".join(lines[_first_line(node) : node.end_lineno]) + "\n"


def documented_functions(source: str) -> list[ast.FunctionDef]:
    """Module-level public functions with a docstring and a body beyond it, MIN_LINES..MAX_LINES long."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    found = []
    for node in tree.body:
        if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
            continue
        if ast.get_docstring(node) is None or len(node.body) < 2:
            continue
        if MIN_LINES <= (node.end_lineno or node.lineno) - node.lineno + 1 <= MAX_LINES:  # None: no positions
            found.append(node)
    return found


def wheel_code_prompts(wheel: str | Path) -> list[dict[str, Any]]:
    """Every documented function of a wheel's modules (tests left out) as a prompt record with its
    original answer: {"id", "messages": [request], "conversation": [request, answer], "source": "code"}."""
    records = []
    try:
        with zipfile.ZipFile(wheel) as zf:
            names = sorted(n for n in zf.namelist() if n.endswith(".py") and "test" not in n.lower())
            for name in names:
                source = zf.read(name).decode("utf-8", errors="replace")
                lines = source.splitlines()
                for node in documented_functions(source):
                    request = {
                        "role": "user",
                        "content": CODE_REQUEST.format(stub=function_stub(lines, node)),
                    }
                    answer = {"role": "assistant", "content": f"```python\n{function_source(lines, node)}```"}
                    records.append({
                        "id": f"code:{Path(str(wheel)).name}:{name}:{node.name}",
                        "messages": [request],
                        "conversation": [request, answer],
                    })  # fmt: skip
    except (zipfile.BadZipFile, OSError) as err:
        raise CodePromptError(f"{wheel}: not a readable wheel ({err})") from err
    return records


def _rank(seed: int, pid: str) -> bytes:
    return hashlib.sha256(f"code/{seed}/{pid}".encode()).digest()


def code_prompts(wheels: list[str | Path], count: int, seed: int) -> list[dict[str, Any]]:
    """`count` code prompts drawn from the wheels' functions (a seeded choice, the same for the same
    wheels), in a stable order. Asking for more than there are is an error naming how many there are."""
    pool = [r for wheel in wheels for r in wheel_code_prompts(wheel)]
    if count > len(pool):
        raise CodePromptError(
            f"prompts.code_prompts: {count} asked, but the code wheels hold {len(pool)} documented functions"
        )
    return sorted(pool, key=lambda r: _rank(seed, r["id"]))[:count]
