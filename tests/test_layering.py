"""Imports flow one way: gateway -> {draft, target, verify} -> kernels. Walked with ast, so a stray
import anywhere in a package fails here rather than in review."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROJECT = {"gateway", "draft", "target", "verify", "kernels", "bench", "tests"}
ALLOWED = {
    "kernels": {"kernels"},
    "verify": {"verify", "draft.tree", "kernels"},
    "target": {"target", "kernels"},
    "draft": {"draft", "target", "verify.sampling", "kernels"},
    "gateway": {"gateway", "draft", "target", "verify", "kernels"},
}
# Command modules that drive the whole engine: the distillation and token-count commands sample through the
# gateway's LLM API.
COMMAND_IMPORTS = {"draft/distill.py": {"gateway.llm", "gateway.engine", "gateway.scheduler"},
                   "draft/vocab.py": {"gateway.llm"}}
STARLETTE_FILES = {"gateway/app.py", "gateway/sse.py", "gateway/protocol.py"}


def imports(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return names


def allowed(name: str, rules: set[str]) -> bool:
    return any(name == r or name.startswith(r + ".") for r in rules)


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_imports_flow_one_way(package: str) -> None:
    bad = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for name in imports(path):
            rules = ALLOWED[package] | COMMAND_IMPORTS.get(str(path.relative_to(ROOT)), set())
            if name.split(".")[0] in PROJECT and not allowed(name, rules):
                bad.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not bad, "\n".join(bad)


def test_only_the_http_layer_imports_starlette() -> None:
    bad = [str(p.relative_to(ROOT)) for pkg in ALLOWED for p in (ROOT / pkg).rglob("*.py")
           if any(n.split(".")[0] in ("starlette", "sse_starlette") for n in imports(p))
           and str(p.relative_to(ROOT)) not in STARLETTE_FILES]
    assert not bad, bad
