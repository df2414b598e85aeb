"""The C++ tree keeps its layers (issue 34), read from the #include lines of csrc/:

- No two modules of one folder depend on each other, directly or through others of
  that folder. A module is a .h/.cc pair (or a lone .h or .cc) named by its stem; it
  depends on a module of its own folder when its .h or .cc includes that module's .h.
- Nothing outside csrc/transport/tcp/ includes transport/tcp/ except the transport
  factory (csrc/transport/make_transport.cc), the one place that builds a TCP
  transport: tcp/ and ib/ are siblings over the shared transport layer.
- The transports are siblings: transport/tcp/ and transport/ib/ include only core/,
  the shared transport layer (transport/*.h) and their own folder, and the shared
  layer includes neither (the factory aside).
- transport/transport.h, the interface the plugin and the engine use, does not pull
  in the acceptor (directly or through the headers it includes).

Pure Python: it needs no build.
"""
from __future__ import annotations

import os
import re
from typing import Dict, List, Set

from conftest import REPO

CSRC = os.path.join(REPO, "csrc")
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)
TRANSPORT_FACTORY = "transport/make_transport.cc"


def includes() -> Dict[str, List[str]]:
    """Each csrc file (path relative to csrc/) -> the project headers it includes."""
    found = {}
    for folder, _, names in os.walk(CSRC):
        for name in names:
            if name.endswith((".h", ".cc")):
                path = os.path.join(folder, name)
                with open(path, encoding="utf-8") as handle:
                    found[os.path.relpath(path, CSRC)] = INCLUDE.findall(handle.read())
    return found


def module_of(path: str) -> str:
    return os.path.splitext(path)[0]


def module_graph(files: Dict[str, List[str]]) -> Dict[str, Set[str]]:
    """module -> the modules of its own folder it includes."""
    graph: Dict[str, Set[str]] = {module_of(path): set() for path in files}
    for path, headers in files.items():
        module = module_of(path)
        for header in headers:
            target = module_of(header)
            if (target != module and target in graph
                    and os.path.dirname(target) == os.path.dirname(module)):
                graph[module].add(target)
    return graph


def cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    found: List[List[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for successor in sorted(graph[node]):
            if successor not in index:
                visit(successor)
                low[node] = min(low[node], low[successor])
            elif successor in on_stack:
                low[node] = min(low[node], index[successor])
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

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_cycle_finder_sees_an_indirect_loop():
    graph = {"core/a": {"core/b"}, "core/b": {"core/c"}, "core/c": {"core/a"}, "core/d": set()}
    assert cycles(graph) == [["core/a", "core/b", "core/c"]]
    assert cycles({"core/a": {"core/b"}, "core/b": set()}) == []


def test_no_module_cycle_inside_a_folder():
    found = cycles(module_graph(includes()))
    assert not found, "modules of one folder that include each other: " + "; ".join(
        " <-> ".join(component) for component in found)


def test_only_tcp_and_the_factory_include_tcp():
    offenders = [
        f"csrc/{path} includes {header}"
        for path, headers in sorted(includes().items())
        for header in headers
        if header.startswith("transport/tcp/")
        and not path.startswith("transport/tcp/") and path != TRANSPORT_FACTORY
    ]
    assert not offenders, "\n".join(offenders)


def test_transports_are_siblings_over_the_shared_layer():
    offenders = []
    for path, headers in sorted(includes().items()):
        if not path.startswith("transport/"):
            continue
        folder = os.path.dirname(path)
        for header in headers:
            header_folder = os.path.dirname(header)
            if folder == "transport":
                bad = header_folder.startswith("transport/") and path != TRANSPORT_FACTORY
            else:  # transport/tcp, transport/ib
                bad = header_folder not in ("core", "transport", folder)
            if bad:
                offenders.append(f"csrc/{path} includes {header}")
    assert not offenders, "\n".join(offenders)


def test_transport_interface_does_not_pull_in_the_acceptor():
    files = includes()
    seen: Set[str] = set()
    pending = ["transport/transport.h"]
    while pending:
        header = pending.pop()
        if header in seen or header not in files:
            continue
        seen.add(header)
        pending.extend(files[header])
    assert not any(os.path.basename(header) == "acceptor.h" for header in seen), sorted(seen)
