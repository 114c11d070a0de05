"""Imports point down (kernels and layers below the engine, the engine below the server),
and the engine is layout-blind.
Read from the source (every import, function-level ones included), so a lazy import that
breaks the layering fails here too."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "agent_infer"


def _modules(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names |= {f"{node.module}.{a.name}" for a in node.names}
    return names


def _imports_any(path: Path, prefixes: tuple[str, ...]) -> list[str]:
    return sorted(n for n in _imports(path) if any(n == p or n.startswith(p + ".") for p in prefixes))


def test_lower_layers_import_nothing_from_the_engine():
    offenders = {}
    for package in ("kernels", "layers", "attention", "kvcache", "distributed", "loader", "models", "quantization"):
        for path in _modules(package):
            bad = _imports_any(path, ("agent_infer.engine", "agent_infer.server", "agent_infer.bench", "agent_infer.cli"))
            if bad:
                offenders[str(path.relative_to(ROOT))] = bad
    assert not offenders, offenders


def test_kernels_are_pure_tensor_functions():
    offenders = {}
    for path in _modules("kernels"):
        bad = _imports_any(path, ("agent_infer.layers", "agent_infer.attention", "agent_infer.models",
                                  "agent_infer.kvcache", "agent_infer.distributed", "agent_infer.loader"))
        if bad:
            offenders[str(path.relative_to(ROOT))] = bad
    assert not offenders, offenders


def test_server_and_bench_do_not_import_the_command_line():
    """agent_infer/cli.py imports server/ and bench/ to register their commands; they take
    the shared flags from agent_infer/arguments.py, so no cycle."""
    offenders = {str(p.relative_to(ROOT)): _imports_any(p, ("agent_infer.cli",))
                 for package in ("server", "bench") for p in _modules(package)}
    assert not {k: v for k, v in offenders.items() if v}, offenders
    assert not _imports_any(ROOT / "arguments.py", ("agent_infer.cli", "agent_infer.server", "agent_infer.bench"))


def test_the_engine_is_layout_blind():
    """engine/ never names a K/V pair, KV heads or a head dimension: cache layouts belong to
    the model's attention layers and their backends."""
    banned = {"k_cache", "v_cache", "kv_cache", "num_kv_heads", "kv_heads", "head_dim", "num_heads"}
    found = {}
    for path in _modules("engine"):
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Name):
                names.add(node.id)
            elif isinstance(node, ast.Attribute):
                names.add(node.attr)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
            elif isinstance(node, ast.keyword) and node.arg:
                names.add(node.arg)
        if names & banned:
            found[str(path.relative_to(ROOT))] = sorted(names & banned)
    assert not found, found


def _module_graph() -> dict[str, set[str]]:
    """agent_infer module -> the agent_infer modules it imports (at any level of the
    file, annotations-only imports included)."""
    names = {}
    for path in ROOT.rglob("*.py"):
        parts = ("agent_infer",) + path.relative_to(ROOT).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {}
    for name, path in names.items():
        deps = set()
        for imported in _imports(path):
            while imported and imported not in names:
                imported = imported.rpartition(".")[0]  # `from pkg.mod import attr` -> pkg.mod
            if imported and imported != name:
                deps.add(imported)
        graph[name] = deps
    return graph


def test_no_import_cycles():
    """No module reaches itself through imports: lower layers take what they need of
    higher ones as protocols (engine/warmup.py's engine, structured/constraints.py's
    sequence), not imports."""
    graph = _module_graph()
    cycles = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                cycles.append(path[path.index(dep):] + [dep])
            elif dep not in state:
                visit(dep, path + [dep])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)
