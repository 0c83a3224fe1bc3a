"""The product packages have no import circles, and server/'s root holds only its three shared
modules (the rest is grouped by role: config/, deploy/, telemetry/, api/, engine/, models/,
openai/, router/). Every import counts, also one inside a function or under TYPE_CHECKING."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("server", "kvcache", "transceiver")
SERVER_ROOT_MODULES = {"__init__.py", "auth.py", "cli.py", "exit.py", "types.py"}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}


def _imports(path: Path, known: set[str]) -> set[str]:
    """Project modules `path` imports (`from a.b import c` counts a.b.c when that is a module)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in known)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module in known:
                out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in known)
    return out


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    return {name: _imports(path, known) - {name} for name, path in modules.items()}


def test_no_two_module_import_circles() -> None:
    graph = _graph()
    circles = sorted({tuple(sorted((a, b))) for a, deps in graph.items() for b in deps
                      if a in graph.get(b, ()) and not _is_package_init_pair(a, b)})
    assert circles == []


def _is_package_init_pair(a: str, b: str) -> bool:
    """A package's __init__ re-exporting from its own module is not a circle of two files' logic."""
    return a.startswith(b + ".") or b.startswith(a + ".")


def test_no_longer_import_circles_in_server() -> None:
    graph = {k: {d for d in v if d.startswith("server.")} for k, v in _graph().items() if k.startswith("server.")}
    cycle = _find_cycle(graph)
    assert cycle is None, " -> ".join(cycle or [])


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph.get(node, ())):
            if _is_package_init_pair(node, dep):
                continue
            if state.get(dep) == 1:
                return stack[stack.index(dep):] + [dep]
            if dep not in state and (found := visit(dep)) is not None:
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)) is not None:
            return found
    return None


def test_server_root_is_grouped_by_role() -> None:
    loose = {p.name for p in (ROOT / "server").glob("*.py")} - SERVER_ROOT_MODULES
    assert loose == set()


def _package_of(module: str) -> str:
    return ".".join(module.split(".")[:2])


def test_engine_engine_host_and_deploy_import_one_way() -> None:
    """deploy -> engine_host -> engine: the engine knows no host, the host no deployment."""
    order = ["server.deploy", "server.engine_host", "server.engine"]
    backwards = sorted((a, b) for a, deps in _graph().items() for b in deps
                       if _package_of(a) in order and _package_of(b) in order
                       and order.index(_package_of(b)) < order.index(_package_of(a)))
    assert backwards == []
