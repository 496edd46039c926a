"""The shape of the Python package: imports point down (no import cycle among moe8's modules), the
environment is read in one place (moe8._env) and only once, and no layer behaviour hangs on module-level
switches (it is in the per-model moe8.Config)."""

import ast
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[2] / "python" / "moe8"


def modules() -> dict:
    """moe8 module name -> its file, package __init__ files as the package's name."""
    out = {}
    for path in PKG.rglob("*.py"):
        parts = ("moe8", *path.relative_to(PKG).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def imports_of(name: str, path: Path, known: dict) -> set:
    """The moe8 modules `name` imports anywhere in its file (module level or inside functions)."""
    is_pkg = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in known else mod for a in node.names]
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t.split(".")[0] == "moe8" and t != name:
                found.add(t)
    return found


def cycles(graph: dict) -> list:
    """Strongly connected components of more than one node (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def import_graph() -> dict:
    known = modules()
    hubs = {m for m, p in known.items() if p.name == "__init__.py"}  # re-export hubs are left out
    return {m: imports_of(m, p, known) - hubs for m, p in known.items() if m not in hubs}


def test_no_import_cycles():
    assert cycles(import_graph()) == []


def test_the_cycle_finder_finds_cycles():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_ground_floor_imports_nothing_above_it():
    graph = import_graph()
    assert graph["moe8._env"] == set()
    assert graph["moe8._core"] <= {"moe8._env"}


def test_the_environment_is_read_only_in_moe8_env():
    readers = [
        str(p.relative_to(PKG))
        for p in PKG.rglob("*.py")
        if p.name != "_env.py" and ("os.environ" in p.read_text() or "getenv" in p.read_text())
    ]
    assert readers == []


def test_no_module_level_switches():
    """Module-level names that layers used to read as switches are gone; settings live in moe8.Config."""
    import moe8
    from moe8 import layer, ops

    for module, name in (
        (layer, "ROUTED_DOWN"),
        (layer, "CONSUME_GATE_UP"),
        (layer, "FUSED_LORA_ADD"),
        (ops, "set_eager_direct"),
        (ops, "set_index_validation"),
        (ops, "_validate"),
        (ops, "_eager"),
    ):
        assert not hasattr(module, name), f"{module.__name__}.{name}"
    cfg = moe8.Config()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.routed_down = False


def test_environment_defaults_are_read_once_at_import(tmp_path):
    code = (
        "import os, moe8; from moe8 import config; assert not config.DEFAULT.routed_down; "
        "os.environ['MOE8_ROUTED_DOWN'] = '1'; assert not moe8.Config().routed_down; print('ok')"
    )
    import moe8

    where = str(Path(moe8.__file__).resolve().parents[1])  # the moe8 these tests import (installed or not)
    env = {"MOE8_ROUTED_DOWN": "0", "PYTHONPATH": where, "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "ok", out.stderr
    env["MOE8_ROUTED_DOWN"] = "yes"
    out = subprocess.run(
        [sys.executable, "-c", "import moe8"], env=env, capture_output=True, text=True, timeout=120
    )
    assert "MOE8_ROUTED_DOWN: expected 0 or 1, got 'yes'" in out.stderr
