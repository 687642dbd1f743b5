"""The shape of diffkit's sources, read with `ast` (nothing is imported):

- no import cycle among diffkit's modules: every import counts (at the top of a module or inside a function,
  relative or absolute), except those under `if TYPE_CHECKING:`, which never run;
- the modules stand in LAYERS (the map of the package, lowest first): a module imports only modules of its own
  layer or lower ones, so no change can close a cycle through a higher layer unnoticed;
- imports of diffkit's own modules sit at the top of a module, except where LAZY says why;
- no function (method, nested function) in diffkit/ longer than MAX_FUNCTION_LINES lines.

The checkers are tried on small made-up packages first, so that a pass means the checks can see what they
look for."""
import ast
import os

import pytest

from conftest import ROOT

PACKAGE = os.path.join(ROOT, "diffkit")
MAX_FUNCTION_LINES = 100

# The package's map, lowest layer first: what each layer holds, and its modules.
LAYERS = [
    ("words, exit codes, the metric kernels, safe file writes, the GPU's memory, progress",
     "errors describe naming host_kernel metrics_kernel metric_slots metrics_triton safefiles device_memory progress"),
    ("measuring a pair", "measure"),
    ("options", "options"),
    ("capture", "inputs capture records tensorargs capture_values capture_flow capture_fold capture_kernels"),
    ("capture files, hand-over, pairing, what-if mutations",
     "store store_io handoff align align_tuning align_layout align_graph align_state align_values align_dataflow "
     "whatif whatif_catalogue"),
    ("streaming, loading files, drawing", "stream tiers load plots figures render"),
    ("the result", "result"),
    ("locating, explaining, writing reports", "report locate rootcause diagnose modelstate"),
    ("the pipeline", "pipeline runner sources traces health rerun"),
    ("KernelBench's trials", "trials"),
    ("entry points and child processes", "processes roles outputs flags sanitize compare harden warm suite suite_ray "
                                         "testing pytest_plugin"),
    ("the command line and the package", "cli diffkit"),
]
# Imports of diffkit modules allowed inside a function, and why.
LAZY = {
    ("diffkit.metrics_kernel", "diffkit.metrics_triton"): "Triton is optional and slow to import",
    ("diffkit.pytest_plugin", "*"): "loaded into every pytest run where diffkit is installed: torch only on use",
}


# ----------------------------------------------------------------------------- reading the sources
def modules(package_dir: str) -> dict[str, str]:
    """{dotted module name: file} for every .py file under `package_dir` (a package's __init__.py is the
    package's own name)."""
    top = os.path.basename(os.path.normpath(package_dir))
    found = {}
    for folder, dirs, files in os.walk(package_dir):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(files):
            if not name.endswith(".py"):
                continue
            rel = os.path.relpath(os.path.join(folder, name), package_dir)[: -len(".py")].split(os.sep)
            if rel[-1] == "__init__":
                rel = rel[:-1]
            found[".".join([top, *rel])] = os.path.join(folder, name)
    return found


def _is_type_checking(test: ast.expr) -> bool:
    """`if TYPE_CHECKING:` or `if typing.TYPE_CHECKING:` (alone, not inside a larger condition)."""
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST):
    """Every Import/ImportFrom node that can run: all of them but those in the body of `if TYPE_CHECKING:`
    (its `else:` branch runs, so it is read)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
            continue
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))


def _targets(module: str, is_package: bool, node: ast.AST, known: dict[str, str]) -> list[str]:
    """The modules of `known` that the import `node` in `module` loads."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name in known]
    if node.level:
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        source = ".".join(base + ([node.module] if node.module else []))
    else:
        source = node.module or ""
    out = []
    for alias in node.names:
        if f"{source}.{alias.name}" in known:  # `from pkg import submodule`
            out.append(f"{source}.{alias.name}")
        elif source in known:  # `from module import name`
            out.append(source)
    return out


def import_graph(package_dir: str) -> dict[str, dict[str, int]]:
    """{module: {imported module: line of the first such import}} among the modules of the package."""
    known = modules(package_dir)
    graph = {}
    for module, path in known.items():
        with open(path, encoding="utf-8") as fh:
            tree = ast.parse(fh.read(), filename=path)
        edges = {}
        for node in _imports(tree):
            for target in _targets(module, path.endswith("__init__.py"), node, known):
                if target != module:
                    edges[target] = min(edges.get(target, node.lineno), node.lineno)
        graph[module] = edges
    return graph


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """One cycle (a list of modules, the first repeated at the end) for each strongly connected component of
    more than one module, found by Tarjan's algorithm (iteratively) and walked by breadth-first search."""
    index, low, on_stack, stack, components = {}, {}, set(), [], []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, {})))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(component)
    return [_cycle_through(graph, sorted(c)[0], c) for c in components]


def _cycle_through(graph, start, component) -> list[str]:
    """The shortest path start -> ... -> start inside `component`."""
    came_from, frontier = {}, [start]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(graph[node]):
                if child not in component:
                    continue
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if child not in came_from:
                    came_from[child] = node
                    following.append(child)
        frontier = following
    raise AssertionError(f"no cycle through {start} in {sorted(component)}")


def function_level_imports(package_dir: str) -> list[tuple[str, str, int]]:
    """(module, imported module, line) of every import of a package module made inside a function."""
    known = modules(package_dir)
    out = []
    for module, path in known.items():
        with open(path, encoding="utf-8") as fh:
            tree = ast.parse(fh.read(), filename=path)
        for func in ast.walk(tree):
            if isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for node in _imports(func):
                    out.extend((module, t, node.lineno) for t in _targets(module, path.endswith("__init__.py"),
                                                                              node, known) if t != module)
    return sorted(set(out))


def long_functions(package_dir: str, limit: int) -> list[tuple[str, int, str, int]]:
    """(file relative to the package's parent, line, qualified name, lines) of every function, method or nested
    function longer than `limit` lines (from its `def` line to its last line; decorators not counted)."""
    out = []
    top = os.path.dirname(os.path.normpath(package_dir))
    for path in modules(package_dir).values():
        with open(path, encoding="utf-8") as fh:
            tree = ast.parse(fh.read(), filename=path)
        stack = [(tree, "")]
        while stack:
            node, prefix = stack.pop()
            for child in ast.iter_child_nodes(node):
                name = prefix
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    name = f"{prefix}{child.name}."
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    length = child.end_lineno - child.lineno + 1
                    if length > limit:
                        out.append((os.path.relpath(path, top), child.lineno, name[:-1], length))
                stack.append((child, name))
    return sorted(out)


def _describe_cycle(graph, cycle) -> str:
    return " -> ".join(f"{a} (line {graph[a][b]})" for a, b in zip(cycle, cycle[1:])) + f" -> {cycle[-1]}"


# ----------------------------------------------------------------------------- the checks on diffkit
def test_no_import_cycle_among_diffkit_modules():
    graph = import_graph(PACKAGE)
    assert len(graph) > 10, sorted(graph)
    found = cycles(graph)
    assert not found, f"{len(found)} import cycle(s) among diffkit's modules:\n" + "\n".join(
        "  " + _describe_cycle(graph, c) for c in found)


def test_no_function_in_diffkit_is_longer_than_the_limit():
    found = long_functions(PACKAGE, MAX_FUNCTION_LINES)
    assert not found, f"{len(found)} function(s) in diffkit/ over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(
        f"  {path}:{line} {name} ({length} lines)" for path, line, name, length in found)


def test_every_module_imports_only_its_own_layer_or_lower_ones():
    graph = import_graph(PACKAGE)
    layer = {f"diffkit.{m}" if m != "diffkit" else m: i for i, (_, names) in enumerate(LAYERS) for m in names.split()}
    unplaced = sorted(set(graph) - set(layer))
    assert not unplaced, f"modules not in LAYERS (add each where it belongs): {unplaced}"
    assert not sorted(set(layer) - set(graph)), f"LAYERS names modules that are gone: {sorted(set(layer) - set(graph))}"
    upward = [f"  {m} (layer {layer[m] + 1}, {LAYERS[layer[m]][0]}) imports {t} (layer {layer[t] + 1}) at line {line}"
              for m, edges in sorted(graph.items()) for t, line in sorted(edges.items()) if layer[t] > layer[m]]
    assert not upward, "imports from a higher layer:\n" + "\n".join(upward)


def test_diffkit_modules_are_imported_at_the_top():
    found = [f"  {m}:{line} imports {t}" for m, t, line in function_level_imports(PACKAGE)
             if (m, t) not in LAZY and (m, "*") not in LAZY]
    assert not found, "imports of diffkit modules inside functions (move them up, or say why in LAZY):\n" + \
        "\n".join(found)


# ----------------------------------------------------------------------------- the checkers, on made-up packages
def _package(tmp_path, files: dict[str, str]) -> str:
    root = tmp_path / "pkg"
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return str(root)


def test_the_cycle_check_sees_function_level_relative_and_absolute_imports(tmp_path):
    pkg = _package(tmp_path, {
        "__init__.py": "from .a import f\n",
        "a.py": "from . import b\ndef f():\n    pass\n",
        "b.py": "import os\ndef g():\n    from .sub.c import h\n    return h\n",
        "sub/__init__.py": "",
        "sub/c.py": "def h():\n    import pkg.a\n    return pkg.a\n",
        "d.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import f\nelse:\n    import pkg.e\n",
        "e.py": "from .d import TYPE_CHECKING\n",
    })
    graph = import_graph(pkg)
    assert graph["pkg.a"] == {"pkg.b": 1} and graph["pkg.b"] == {"pkg.sub.c": 3}
    assert graph["pkg.sub.c"] == {"pkg.a": 2} and graph["pkg"] == {"pkg.a": 1}
    assert graph["pkg.d"] == {"pkg.e": 5}  # the TYPE_CHECKING import does not count, its else: branch does
    found = sorted(cycles(graph))
    assert found == [["pkg.a", "pkg.b", "pkg.sub.c", "pkg.a"], ["pkg.d", "pkg.e", "pkg.d"]]
    assert _describe_cycle(graph, found[1]) == "pkg.d (line 5) -> pkg.e (line 1) -> pkg.d"


def test_the_cycle_check_passes_a_layered_package(tmp_path):
    pkg = _package(tmp_path, {
        "__init__.py": "from . import top\n",
        "low.py": "X = 1\n",
        "mid.py": "from .low import X\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .top import Y\n",
        "top.py": "from pkg import mid, low\nY = 2\n",
    })
    graph = import_graph(pkg)
    assert graph["pkg.top"] == {"pkg.mid": 1, "pkg.low": 1}
    assert cycles(graph) == []


@pytest.mark.parametrize("length", [MAX_FUNCTION_LINES, MAX_FUNCTION_LINES + 1])
def test_the_length_check_sees_methods_and_nested_functions(tmp_path, length):
    # outer: its def line, inner's two lines, the body, the return: `length` lines (the decorator not counted)
    body = "".join(f"        x{i} = {i}\n" for i in range(length - 4))
    pkg = _package(tmp_path, {"m.py": "class C:\n    @staticmethod\n    def outer():\n        def inner():\n"
                                      f"            pass\n{body}        return inner\n"})
    found = long_functions(pkg, MAX_FUNCTION_LINES)
    assert found == ([] if length <= MAX_FUNCTION_LINES else [(os.path.join("pkg", "m.py"), 3, "C.outer", length)])
    assert long_functions(pkg, 1) == [(os.path.join("pkg", "m.py"), 3, "C.outer", length),
                                      (os.path.join("pkg", "m.py"), 4, "C.outer.inner", 2)]


def test_the_function_level_import_check_sees_nested_imports(tmp_path):
    pkg = _package(tmp_path, {"__init__.py": "", "a.py": "from . import b\n",
                              "b.py": "def f():\n    if True:\n        from .a import x\n    import os\n"})
    assert function_level_imports(pkg) == [("pkg.b", "pkg.a", 3)]
