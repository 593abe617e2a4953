"""The layers stand alone: the packages of ``cachefsd`` import each other
without a cycle, and the read path of a local source loads no cloud SDK.

A package here is a top-level unit of ``cachefsd``: a subpackage
(``cache``, ``prefetch``) or a module (``reader``, ``fs``). Every import
statement counts, wherever it stands (inside a function or under
``TYPE_CHECKING`` too): a deferred import still makes one layer depend on the
other, and a cycle between two layers means neither can be read, tested or
replaced alone.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import cachefsd

PACKAGE = Path(cachefsd.__file__).parent
CLOUD_SDKS = ("obstore", "aiobotocore", "botocore", "boto3", "google", "azure")


def layer_of(module: str) -> str | None:
    """The top-level unit of ``cachefsd.a.b`` (``a``), None for another package's."""
    parts = module.split(".")
    return parts[1] if parts[0] == "cachefsd" and len(parts) > 1 else None


def imports(path: Path) -> Iterator[str]:
    """Every module ``path`` imports (absolute names; the package uses no relative imports)."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}: relative import"
            if node.module is not None:
                yield from (f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)


def layer_graph() -> dict[str, dict[str, set[str]]]:
    """Layer -> the layers it imports -> the files that do."""
    graph: dict[str, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
    for path in PACKAGE.rglob("*.py"):
        source = path.relative_to(PACKAGE).parts[0].removesuffix(".py")
        for module in imports(path):
            target = layer_of(module)
            if target is not None and target != source:
                graph[source][target].add(str(path.relative_to(PACKAGE.parent)))
    return graph


def cycles(graph: dict[str, dict[str, set[str]]]) -> list[list[str]]:
    """The strongly connected components of more than one layer (Tarjan)."""
    order: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(layer: str) -> None:
        order[layer] = low[layer] = len(order)
        stack.append(layer)
        for target in graph.get(layer, {}):
            if target not in order:
                visit(target)
                low[layer] = min(low[layer], low[target])
            elif target in stack:
                low[layer] = min(low[layer], order[target])
        if low[layer] == order[layer]:
            component: list[str] = []
            while not component or component[-1] != layer:
                component.append(stack.pop())
            if len(component) > 1:
                found.append(sorted(component))

    for layer in list(graph):
        if layer not in order:
            visit(layer)
    return found


def test_the_layers_import_each_other_without_a_cycle() -> None:
    graph = layer_graph()
    described = [
        "\n".join(
            f"{source} -> {target} ({', '.join(sorted(graph[source][target]))})"
            for source in component
            for target in sorted(graph[source])
            if target in component
        )
        for component in cycles(graph)
    ]
    assert not described, "import cycles between layers:\n" + "\n\n".join(described)


def test_the_workload_model_stands_below_the_cache_and_the_prefetcher() -> None:
    """The cache (its policy's clock, the replay) and the prefetcher use the
    model of the workload; it uses neither, only the jobs it is told of."""
    assert set(layer_graph()["workload"]) == {"jobs"}


def test_the_cache_stands_below_the_metrics() -> None:
    """The cache reports through ``CacheEvents``, which the metrics
    implement: importing any module of it loads neither the metrics nor
    prometheus-client."""
    code = (
        "import pkgutil, sys, importlib, cachefsd.cache as cache; "
        "names = [each.name for each in pkgutil.iter_modules(cache.__path__)]; "
        "[importlib.import_module(f'cachefsd.cache.{name}') for name in names]; "
        "print(sorted({'cachefsd.metrics', 'prometheus_client'} & set(sys.modules)))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


def test_cycles_are_found() -> None:
    graph: dict[str, dict[str, set[str]]] = {
        "a": {"b": {"a.py"}},
        "b": {"c": {"b.py"}},
        "c": {"a": {"c.py"}, "d": {"c.py"}},
    }
    assert cycles(graph) == [["a", "b", "c"]]
    del graph["c"]["a"]
    assert cycles(graph) == []


def test_reading_a_local_source_loads_no_cloud_sdk(tmp_path: Path) -> None:
    """The whole data path over a local directory, opened and read, in a
    fresh interpreter: a node that mounts local data never pays for (nor
    breaks on) an SDK it does not use."""
    source = tmp_path / "data"
    source.mkdir()
    (source / "sample.bin").write_bytes(b"x" * 70_000)
    script = f"""
import json, os, sys
from cachefsd.config import Settings
from cachefsd.engine import open_engine
import cachefsd.daemon, cachefsd.fs, cachefsd.reader, cachefsd.cache.tiered

settings = Settings(
    source={str(source)!r}, mountpoint={str(tmp_path / "mnt")!r}, cache={{"dir": {str(tmp_path / "cache")!r}}}
)
with open_engine(settings) as engine:
    info = engine.namespace.lookup("/sample.bin").info
    pieces = engine.reader.read(info, 0, info.size)
    assert sum(len(p) if isinstance(p, bytes) else p.length for p in pieces) == 70_000
    for piece in pieces:
        if not isinstance(piece, bytes):
            os.close(piece.fd)
print(json.dumps(sorted({{name.split(".")[0] for name in sys.modules}} & {set(CLOUD_SDKS)!r})))
"""
    result = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=PACKAGE.parent,  # ``-c`` imports from the working directory first: this checkout
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.splitlines()[-1]) == []
