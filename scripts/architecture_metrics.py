"""Print the package's architecture metrics: import circles, upward imports, lines per package and
the length of named functions.

Why: issue #38 measures an architecture step by these numbers, before and after; a script keeps
the counting the same both times (and tests/test_import_graph.py reuses `import_graph`).

The package is mlxspec/ plus the top-level models/, converters/ and cli/ folders, which install
as mlxspec.models, mlxspec.converters and mlxspec.cli (pyproject's package-dir).

Definitions:
- An import is any `import` or `from ... import` statement, at module level or inside a function
  (mlxspec imports torch and some of its own modules lazily), relative or absolute, that names a
  module of the package. `from pkg import name` points at `pkg.name` when that is a module, else
  at `pkg` (its __init__). Importing `a.b.c` also runs `a` and `a.b`; those implied edges are not
  counted, since every module would then sit in a circle with its package's __init__.
- An import circle is a strongly connected component of that graph with more than one module.
- An upward import: an import statement in subpackage S that names a module A of an ancestor
  package of S (A not inside S), while A itself imports S (its __init__ or a module inside it)
  directly. The ancestor's module uses the subpackage, and the subpackage reaches back up into
  it. Counted per statement: this reproduces issue #38's "6 imports that point upward" on the
  commit it reviewed (173dfef).

Usage: .venv/bin/python scripts/architecture_metrics.py [--function NAME ...] [--root DIR]
"""

import argparse
import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Folder on disk -> the package name it installs as.
PACKAGE_DIRS = {"mlxspec": "mlxspec", "models": "mlxspec.models",
                "converters": "mlxspec.converters", "cli": "mlxspec.cli"}


def package_modules(root=ROOT):
    """Module name -> source file, for every .py file of the package."""
    modules = {}
    for folder, package in PACKAGE_DIRS.items():
        for path in sorted((root / folder).rglob("*.py")):
            parts = list(path.relative_to(root / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join([package, *parts])] = path
    return modules


def is_package(path):
    return path.name == "__init__.py"


def _import_targets(node, module, path, modules):
    """The package modules one import statement points at."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
        return [_longest_module(name, modules) for name in names]
    if node.level:  # relative: from the module's own package, one level up per extra dot
        package = module if is_package(path) else module.rpartition(".")[0]
        for _ in range(node.level - 1):
            package = package.rpartition(".")[0]
        base = ".".join(p for p in (package, node.module) if p)
    else:
        base = node.module
    targets = []
    for alias in node.names:
        submodule = f"{base}.{alias.name}"
        targets.append(submodule if submodule in modules else _longest_module(base, modules))
    return targets


def _longest_module(name, modules):
    """`a.b.c` -> the longest of `a.b.c`, `a.b`, `a` that is a package module (else None)."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in modules:
            return candidate
    return None


def import_statements(root=ROOT):
    """(module, line, imported module) for every import statement naming a package module."""
    modules = package_modules(root)
    found = []
    for module, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                targets = set(_import_targets(node, module, path, modules)) - {None, module}
                found.extend((module, node.lineno, target) for target in sorted(targets))
    return sorted(found)


def import_graph(root=ROOT):
    """Module -> set of package modules it imports (module- and function-level)."""
    graph = {module: set() for module in package_modules(root)}
    for module, _, imported in import_statements(root):
        graph[module].add(imported)
    return graph


def import_circles(graph):
    """Strongly connected components with more than one module (Tarjan), each sorted, largest
    first."""
    index, low, on_stack, stack, circles = {}, {}, set(), [], []

    def visit(start):
        # Iterative Tarjan: (node, iterator over its successors) frames.
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        frames = [(start, iter(sorted(graph[start])))]
        while frames:
            node, successors = frames[-1]
            for nxt in successors:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    frames.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                frames.pop()
                if frames:
                    parent = frames[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        circles.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return sorted(circles, key=lambda c: (-len(c), c))


def _inside(module, package):
    return module == package or module.startswith(package + ".")


def upward_imports(root=ROOT):
    """(importer, line, imported) import statements: importer sits in subpackage S, imported sits
    in an ancestor package of S outside S, and imported itself imports S directly."""
    paths = package_modules(root)
    graph = import_graph(root)
    upward = []
    for importer, line, imported in import_statements(root):
        package = importer if is_package(paths[importer]) else importer.rpartition(".")[0]
        ancestor = imported.rpartition(".")[0]
        for sub in _ancestors_below(package, ancestor):
            if not _inside(imported, sub) and any(_inside(t, sub) for t in graph[imported]):
                upward.append((importer, line, imported))
                break
    return upward


def _ancestors_below(package, ancestor):
    """The packages from `package` up to, not including, `ancestor`; empty unless `ancestor`
    contains `package` strictly."""
    if package == ancestor or not _inside(package, ancestor):
        return []
    parts = package.split(".")
    depth = len(ancestor.split("."))
    return [".".join(parts[:end]) for end in range(len(parts), depth, -1)]


def lines_per_package(root=ROOT):
    """Package (a folder with an __init__.py) -> lines in its own modules, subpackages apart."""
    counts = defaultdict(int)
    for module, path in package_modules(root).items():
        package = module if is_package(path) else module.rpartition(".")[0]
        counts[package] += len(path.read_text().splitlines())
    return dict(sorted(counts.items()))


def function_lengths(name, root=ROOT):
    """(module, lines) of every function or method called `name`, decorators excluded."""
    found = []
    for module, path in package_modules(root).items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
                found.append((module, node.end_lineno - node.lineno + 1))
    return found


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--function", action="append", default=None,
                        help="function whose length to print (repeatable; default stream_generate)")
    parser.add_argument("--root", type=Path, default=ROOT,
                        help="a checkout to measure (e.g. `git archive REV | tar -x -C DIR`)")
    args = parser.parse_args()

    graph = import_graph(args.root)
    circles = import_circles(graph)
    print(f"modules: {len(graph)}, imports: {sum(map(len, graph.values()))}")
    print(f"import circles: {len(circles)}")
    for circle in circles:
        print("  " + " <-> ".join(circle))
    upward = upward_imports(args.root)
    print(f"upward imports: {len(upward)}")
    for importer, line, imported in upward:
        print(f"  {importer}:{line} -> {imported}")
    counts = lines_per_package(args.root)
    print(f"lines per package (total {sum(counts.values())}):")
    for package, lines in counts.items():
        print(f"  {package:32} {lines:6}")
    for name in args.function or ["stream_generate"]:
        for module, lines in function_lengths(name, args.root):
            print(f"function {module}.{name}: {lines} lines")


if __name__ == "__main__":
    main()
