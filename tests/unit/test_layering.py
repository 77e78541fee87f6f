"""The import arrows of docs/design.md ("Layering"): the import-linter contracts in .importlinter
hold, opfuse has no import circle, and service reaches no part of opfuse but frontend and errors."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("opfuse", "service", "workers", "client", "migrations")
# What service may reach of opfuse: upload checks and rule names, the report's page (pure
# rendering, .importlinter's views contract) and the model's own errors.
SERVICE_MAY_REACH = ("opfuse.frontend", "opfuse.views", "opfuse.errors")


def import_circles(graph: grimp.ImportGraph, package: str) -> list[list[str]]:
    """Each set of `package`'s modules that import one another in a circle (Tarjan's strongly
    connected components of more than one module, or a module importing itself)."""
    modules = sorted(m for m in graph.modules if m == package or m.startswith(package + "."))
    edges = {m: sorted(graph.find_modules_directly_imported_by(m)) for m in modules}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in edges:
                continue  # outside the package
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in edges[v]:
                circles.append(sorted(component))

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10 * len(modules) + 100))
    try:
        for m in modules:
            if m not in index:
                visit(m)
    finally:
        sys.setrecursionlimit(limit)
    return circles


def test_the_import_contracts_hold() -> None:
    """client imports nothing of ours (but the library API for `opfuse compile`), workers never
    service, service only opfuse.frontend and errors, opfuse nothing of ours; inside opfuse the
    stages import only those below them and no template imports another."""
    lint = Path(sys.executable).with_name("lint-imports")
    proc = subprocess.run(
        [str(lint), str(ROOT / ".importlinter"), "--no-cache"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    assert "0 broken" in proc.stdout


def test_opfuse_has_no_import_circle() -> None:
    """Every import counts, those inside functions too; only imports for type checkers (they never
    run: annotations are strings here) are left out."""
    graph = grimp.build_graph("opfuse", exclude_type_checking_imports=True)
    assert import_circles(graph, "opfuse") == []


def test_service_reaches_only_the_frontend_and_views_of_opfuse() -> None:
    """Directly or through other modules: a new opfuse package cannot slip past .importlinter's list."""
    graph = grimp.build_graph(*PACKAGES)
    reached = {
        m for m in graph.find_upstream_modules("service", as_package=True) if m.split(".")[0] == "opfuse"
    }
    allowed = {m for m in reached if any(m == p or m.startswith(p + ".") for p in SERVICE_MAY_REACH)}
    assert reached - allowed == set()
    assert "opfuse.frontend.inspect" in reached  # the upload checks: the walk sees service's imports


def test_a_circle_is_found() -> None:
    """The circle check finds a circle of two modules and one through a third."""
    graph = grimp.ImportGraph()
    for m in ("p", "p.a", "p.b", "p.c", "p.d"):
        graph.add_module(m)
    graph.add_import(importer="p.a", imported="p.b")
    graph.add_import(importer="p.b", imported="p.a")
    graph.add_import(importer="p.c", imported="p.d")
    assert import_circles(graph, "p") == [["p.a", "p.b"]]
    graph.add_import(importer="p.d", imported="p.a")
    graph.add_import(importer="p.b", imported="p.c")
    assert import_circles(graph, "p") == [["p.a", "p.b", "p.c", "p.d"]]


def test_service_and_migrations_do_not_import_each_other() -> None:
    """migrations/env.py reads service's models; service finds the migrations by path."""
    graph = grimp.build_graph(*PACKAGES)
    assert graph.chain_exists(importer="migrations", imported="service", as_packages=True)
    assert not graph.chain_exists(importer="service", imported="migrations", as_packages=True)
