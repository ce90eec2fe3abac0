"""The package's import graph: no cycle, and no module importing a layer above its own (issue 16).

Every `import` / `from ... import` of a vllm_delta module counts, wherever it is written (inside a
function, under TYPE_CHECKING): a deferred import is still a dependency, and the one cycle this check
was written for (`store.retain` importing `ledger`, which imports `store`) was a deferred one. The
implicit import of a module's parent package is not counted (Python initializes the parent first).

A new top-level module or subpackage gets a place in LAYERS; a subpackage's modules share its layer.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm_objects  # make check-vllm-next runs them against the newest vLLM

PACKAGE = "vllm_delta"
ROOT = Path(__file__).resolve().parent.parent / PACKAGE

# Lowest first. A module may import modules of its own layer (if that makes no cycle) or lower ones.
LAYERS: list[tuple[str, ...]] = [
    # leaves (signatures: Ed25519, what is signed; format.mapped_files: which open file mapped bytes are in)
    ("errors", "bits", "gc_pause", "mapped_writes", "signatures", "format.mapped_files"),
    ("checksums",),  # the checksum definition
    ("wire",),  # the generic dataclass <-> plain values codec, and the store's JSON documents
    ("server_api", "attribution"),  # the HTTP contract of a server: bodies (clients and plugin); attribution
    ("format.layout",),  # the version file's names: format versions, kinds, dtypes, payload keys
    ("format.arrays",),  # format 5: a tensor table and a part's rows as packed arrays
    ("format.table",),  # a header's tensor table
    ("format.header",),  # the version header
    ("format.payload_writer", "format.version_file"),  # writing a file; an opened file
    ("format.parts", "format", "codec"),  # a multi-part version read as one, the package; codecs
    ("writer", "store.records", "store.replicas"),  # building versions; commit records and replica reports
    ("store.marks", "store.signed"),  # bad-version marks and the rule that reads them; signed records
    (
        "store.fs",
        "store.cache",
        "store.retention",
        "store.polling",
        "store.record_reader",
        "store.mark_folder",
        "store.writes",
        "store.files",
        "store.objects",
    ),  # filesystem access, download cache, retention, latest(), records, marks, writing, data files, objects
    ("store.delta_store", "store"),  # DeltaStore, and the package that exports it
    ("store.ledger", "reconstruct"),  # the fleet view; replay and materialize
    ("trainer", "apply", "mirror"),  # the publishing side; the apply engine (plain tensors, no vLLM); regions
    ("integrations", "testing"),  # trainer callbacks; test fixtures
    ("vllm",),  # the vLLM plugin (the only code that sees vLLM types)
    ("cli", "demo", ""),  # entry points, and the package itself ("": vllm_delta/__init__.py)
]


def module_files(root: Path = ROOT, package: str = PACKAGE) -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = [package, *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def imports_of(module: str, path: Path, modules: Mapping[str, Path]) -> set[str]:
    """The package modules `module` imports (a `from X import name` of a submodule counts as that submodule)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module or ""
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.add(sub if sub in modules else target)
    return {m for m in found if m in modules and m != module}


def import_graph(modules: Mapping[str, Path]) -> dict[str, set[str]]:
    return {m: imports_of(m, path, modules) for m, path in modules.items()}


def find_cycles(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (or a module importing itself)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan; the package is small enough for recursion
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
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
            if len(component) > 1 or v in graph.get(v, ()):
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def layer_of(module: str, layers: list[tuple[str, ...]] = LAYERS, package: str = PACKAGE) -> int | None:
    """The layer of the longest LAYERS entry that names the module or a package above it."""
    rel = module[len(package) + 1 :] if module != package else ""
    best: tuple[int, int] | None = None  # (length of the entry, layer)
    for level, names in enumerate(layers):
        for name in names:
            if rel == name or (name and rel.startswith(name + ".")):
                if best is None or len(name) > best[0]:
                    best = (len(name), level)
    return None if best is None else best[1]


def upward_imports(
    graph: Mapping[str, Iterable[str]], layers: list[tuple[str, ...]] = LAYERS, package: str = PACKAGE
) -> list[str]:
    out = []
    for m, targets in sorted(graph.items()):
        for t in sorted(targets):
            lm, lt = layer_of(m, layers, package), layer_of(t, layers, package)
            if lm is not None and lt is not None and lt > lm:
                out.append(f"{m} (layer {lm}) imports {t} (layer {lt})")
    return out


def test_every_module_has_a_layer():
    unplaced = [m for m in module_files() if layer_of(m) is None]
    assert not unplaced, f"give these modules a place in LAYERS: {unplaced}"


def test_the_package_has_no_import_cycle():
    cycles = find_cycles(import_graph(module_files()))
    assert not cycles, f"import cycles: {cycles}"


def test_no_module_imports_a_higher_layer():
    upward = upward_imports(import_graph(module_files()))
    assert not upward, "upward imports:\n" + "\n".join(upward)


def test_the_store_never_imports_the_ledger():
    graph = import_graph(module_files())
    for m in ("vllm_delta.store", "vllm_delta.store.delta_store", "vllm_delta.store.retention"):
        assert "vllm_delta.store.ledger" not in graph[m]


def test_the_api_server_never_imports_the_workers_or_the_apply_engine():
    """The API process drives the workers over RPC only (vllm/shared/rpc.py): nothing of the worker side
    (vllm/worker/) nor the apply engine (apply/) runs or is imported there."""
    graph = import_graph(module_files())
    forbidden = (f"{PACKAGE}.vllm.worker", f"{PACKAGE}.apply")
    found = [
        f"{m} imports {t}"
        for m, targets in sorted(graph.items())
        if m.startswith(f"{PACKAGE}.vllm.api_server")
        for t in sorted(targets)
        if any(t == f or t.startswith(f + ".") for f in forbidden)
    ]
    assert not found, "the API server reaches past RPC:\n" + "\n".join(found)


def test_the_checks_find_what_they_look_for(tmp_path):
    """The checker itself, on a package written here: a deferred import that closes a cycle, and a
    leaf that imports a higher layer, are both found."""
    pkg = tmp_path / "toy"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "low.py").write_text("def f():\n    from .high import g\n")
    (pkg / "high.py").write_text("from . import low\nfrom .sub import deep\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "deep.py").write_text("from ..low import f\nimport toy.high\n")
    modules = module_files(pkg, "toy")
    graph = import_graph(modules)
    assert graph["toy.low"] == {"toy.high"} and graph["toy.high"] == {"toy.low", "toy.sub.deep"}
    assert graph["toy.sub.deep"] == {"toy.low", "toy.high"}
    assert find_cycles(graph) == [["toy.high", "toy.low", "toy.sub.deep"]]
    layers = [("low",), ("sub",), ("high", "")]
    assert layer_of("toy.sub.deep", layers, "toy") == 1 and layer_of("toy", layers, "toy") == 2
    assert upward_imports(graph, layers, "toy") == [
        "toy.low (layer 0) imports toy.high (layer 2)",
        "toy.sub.deep (layer 1) imports toy.high (layer 2)",
    ]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


# The house's sizes (issue 23, issue 37): a room that outgrows them has taken a second job.
MODULE_LINES = 600  # no module of the package or of benchmarks/ over this many lines
FUNCTION_LINES = 80  # no function over this many lines (decorators and docstring included) but Triton kernels
SERVICE_LINES = 300  # vllm/api_server/service.py: the request flow only
STORE_LINES = 300  # store/delta_store.py: what needs several of the store's collaborators (issue 37)
API_SERVER_CLASS_LINES = 250  # no class in vllm/api_server over this many lines
BENCHMARKS = ROOT.parent / "benchmarks"


def is_triton_kernel(node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """`@triton.jit` (or `@jit`, `@triton.jit(...)`, under `@triton.autotune`...): a kernel is one launch, whose
    body cannot call a Python helper, so its length is the kernel's, not a sign of a second job."""
    for deco in node.decorator_list:
        target = deco.func if isinstance(deco, ast.Call) else deco
        if ast.unparse(target) in ("triton.jit", "jit"):
            return True
    return False


def oversized(root: Path, benchmarks: Path | None = None) -> list[str]:
    """Every module over MODULE_LINES, every function over FUNCTION_LINES (Triton kernels exempt), of the
    package at `root` and of `benchmarks`; service.py over SERVICE_LINES; api_server classes over
    API_SERVER_CLASS_LINES. Paths relative to the folder above `root`."""
    found = []
    top = root.parent
    paths = sorted(root.rglob("*.py")) + (sorted(benchmarks.rglob("*.py")) if benchmarks else [])
    for path in paths:
        text = path.read_text()
        where = path.relative_to(top)
        if (n := len(text.splitlines())) > MODULE_LINES:
            found.append(f"{where}: {n} lines > {MODULE_LINES}")
        for node in ast.walk(ast.parse(text, str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not is_triton_kernel(node):
                start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                if (n := node.end_lineno - start + 1) > FUNCTION_LINES:  # type: ignore[operator]
                    found.append(f"{where}:{node.lineno}: function {node.name} {n} lines > {FUNCTION_LINES}")
    for room, limit in (
        (("vllm", "api_server", "service.py"), SERVICE_LINES),
        (("store", "delta_store.py"), STORE_LINES),
    ):
        path = root.joinpath(*room)
        if path.exists() and (n := len(path.read_text().splitlines())) > limit:
            found.append(f"{path.relative_to(top)}: {n} lines > {limit}")
    for path in sorted((root / "vllm" / "api_server").glob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef) and (n := node.end_lineno - node.lineno + 1) > API_SERVER_CLASS_LINES:  # type: ignore[operator]
                found.append(f"{path.relative_to(top)}: class {node.name} {n} lines > {API_SERVER_CLASS_LINES}")
    return found


def test_rooms_stay_their_size():
    assert oversized(ROOT, BENCHMARKS) == []


def test_the_size_check_finds_an_oversized_room(tmp_path):
    pkg, bench = tmp_path / "pkg", tmp_path / "benchmarks"
    (pkg / "codec").mkdir(parents=True)
    (pkg / "vllm" / "api_server").mkdir(parents=True)
    bench.mkdir()
    (pkg / "codec" / "big.py").write_text("x = 1\n" * 601)
    (pkg / "ok.py").write_text("x = 1\n" * 600)
    body = "    x = 1\n" * 250
    (pkg / "vllm" / "api_server" / "service.py").write_text(f"class Service:\n{body}" + "y = 2\n" * 50)
    (pkg / "store").mkdir()
    (pkg / "store" / "delta_store.py").write_text("x = 1\n" * 301)

    def function(head: str, body_lines: int, indent: str = "") -> str:
        return f"{indent}{head}\n" + f"{indent}    x = 1\n" * body_lines

    (bench / "run.py").write_text(
        function("def fits():", 79)  # lines 1-80: 80 lines, at the limit
        + function("@decorated\ndef long():", 79)  # lines 81-161: 81 with its decorator
        + "class C:\n"  # line 162
        + function("async def method(self):", 80, "    ")  # lines 163-243: a method, 81 lines
        + function("@triton.jit\ndef kernel():", 90)  # a Triton kernel: exempt
        + function("@triton.autotune(configs=[])\n@triton.jit(do_not_specialize=['n'])\ndef tuned():", 90)
    )
    assert oversized(pkg, bench) == [
        "pkg/codec/big.py: 601 lines > 600",
        "benchmarks/run.py:82: function long 81 lines > 80",
        "benchmarks/run.py:163: function method 81 lines > 80",
        "pkg/vllm/api_server/service.py: 301 lines > 300",
        "pkg/store/delta_store.py: 301 lines > 300",
        "pkg/vllm/api_server/service.py: class Service 251 lines > 250",
    ]
