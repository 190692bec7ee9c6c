"""The import graph of ``client/`` and ``daemon/`` keeps its shape: no circles, and the daemon's
core never reaches up into the commands.

Read from the source with :mod:`ast`, nothing imported. Every import counts, at the top of a module
or inside a function (a function-local import is still an arrow: it only moves the failure to run
time), ``import a.b`` and ``from a import b`` alike (``from a import b`` is an arrow to ``a.b`` when
that is a module, else to ``a``); relative imports are resolved. Only imports under
``if TYPE_CHECKING:`` are left out: they never run. The planted trees below show the check fails
where it should.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SOURCES = (REPO / "client", REPO / "daemon")
CORE, COMMANDS = "spotguard_daemon.core", "spotguard_daemon.commands"
BELOW_COMMANDS = (CORE, "spotguard_daemon.proctree", "spotguard_daemon.simulator")
"""What the commands stand on: none of it may import a command."""


def modules(roots: tuple[Path, ...]) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` file below ``roots`` (a package is its
    ``__init__.py``)."""
    found = {}
    for root in roots:
        for path in root.rglob("*.py"):
            parts = path.relative_to(root).with_suffix("").parts
            if any(not part.isidentifier() for part in parts):
                continue  # not importable (an egg-info folder, a script with a dash)
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _runtime_nodes(tree: ast.AST):
    """Every node of ``tree`` but those under ``if TYPE_CHECKING:``."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                todo.extend(child.orelse)
            else:
                todo.append(child)


def imports_of(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The modules among ``known`` that module ``name`` (at ``path``) imports."""

    def resolve(target: str) -> str | None:
        while target and target not in known:
            target = target.rpartition(".")[0]
        return target or None

    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in _runtime_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(resolve(alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                found.add(full if full in known else resolve(base))
    return found - {None, name}


def graph(roots: tuple[Path, ...]) -> dict[str, set[str]]:
    known = modules(roots)
    return {name: imports_of(name, path, known) for name, path in known.items()}


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's, without recursion)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def upward(edges: dict[str, set[str]]) -> list[str]:
    """Each arrow from what the commands stand on into a command, as ``a -> b``."""

    def under(name: str, package: str) -> bool:
        return name == package or name.startswith(package + ".")

    return sorted(f"{source} -> {target}" for source, targets in edges.items() for target in targets
                  if any(under(source, below) for below in BELOW_COMMANDS) and under(target, COMMANDS))


def test_client_and_daemon_have_no_import_circle():
    assert circles(graph(SOURCES)) == []


def test_the_daemon_core_never_imports_a_command():
    edges = graph(SOURCES)
    assert any(name.startswith(CORE + ".") for name in edges)  # the check looks at something
    assert upward(edges) == []


def test_the_process_helpers_are_a_leaf():
    """Both halves use :mod:`spotguard_daemon.proctree`, so it imports neither (nor spotguard)."""
    assert graph(SOURCES)["spotguard_daemon.proctree"] == set()


def _plant(root: Path, files: dict[str, str]) -> tuple[Path, ...]:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return (root,)


def test_a_planted_circle_through_a_function_local_import_is_found(tmp_path):
    roots = _plant(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a.py": "def f():\n    from pkg import b\n",
        "pkg/b.py": "from . import c\n",
        "pkg/c.py": "from pkg.a import f\n",
        "pkg/d.py": "import pkg.a\n",  # imports into the circle, is not part of it
    })
    assert circles(graph(roots)) == [["pkg.a", "pkg.b", "pkg.c"]]


def test_an_import_only_for_type_checking_is_no_circle(tmp_path):
    roots = _plant(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.b import B\n",
        "pkg/b.py": "from pkg.a import *\nclass B: ...\n",
    })
    assert circles(graph(roots)) == []
    (tmp_path / "pkg/a.py").write_text("from pkg.b import B\n")
    assert circles(graph(roots)) == [["pkg.a", "pkg.b"]]


def test_a_planted_import_from_the_core_into_a_command_is_found(tmp_path):
    roots = _plant(tmp_path, {
        "spotguard_daemon/__init__.py": "",
        "spotguard_daemon/core/__init__.py": "",
        "spotguard_daemon/core/peers.py": "def f():\n    from spotguard_daemon.commands.run import g\n",
        "spotguard_daemon/commands/__init__.py": "",
        "spotguard_daemon/commands/run.py": "from spotguard_daemon.core import peers\ndef g(): ...\n",
    })
    edges = graph(roots)
    assert upward(edges) == ["spotguard_daemon.core.peers -> spotguard_daemon.commands.run"]
    assert circles(edges) == [["spotguard_daemon.commands.run", "spotguard_daemon.core.peers"]]
