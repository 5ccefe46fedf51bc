"""The package's imports run one way and in no circle (docs/design.md, "Map of the house").

Every ``import`` of every module is read from its source (function-level imports too), so the
check needs no import of the package itself. Layers, bottom first: config, sampling, cache,
kernels and the other leaf modules; weights; models; speculative; checks; engine; the faces.
"""

import ast
import os

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..")

# Module prefix -> layer (the longest matching prefix wins); a module may import its own layer
# and those below it.
LAYERS = {
    "pallas_kernels": 0, "mtp_jax.config": 0, "mtp_jax.sampling": 0, "mtp_jax.cache": 0,
    "mtp_jax.kernels": 0, "mtp_jax.compile_cache": 0, "mtp_jax.home": 0,
    "mtp_jax.tokenizer": 0, "mtp_jax.errors": 0, "mtp_jax.rope": 0, "mtp_jax.config_fields": 0,
    "mtp_jax.weights": 1,
    "mtp_jax.models": 2,
    "mtp_jax.speculative": 3,
    "mtp_jax.checks": 4,
    "mtp_jax.engine": 5,
    "mtp_jax": 6, "mtp_jax.llm": 6, "mtp_jax.prompts": 6, "mtp_jax.generate": 6,
    "mtp_jax.bench": 6, "mtp_jax.tools": 6, "mtp_jax.default_model": 6,
    "mtp_jax.train": 6, "mtp_jax.train_mtp": 6,
}
NAMES = ["leaf modules", "weights", "models", "speculative", "checks", "engine", "faces"]


def _modules() -> dict[str, str]:
    out = {}
    for base in ("mtp_jax", "pallas_kernels"):
        for folder, _, files in os.walk(os.path.join(ROOT, base)):
            for f in files:
                if f.endswith(".py"):
                    path = os.path.join(folder, f)
                    name = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                    out[name[:-len(".__init__")] if name.endswith(".__init__") else name] = path
    return out


def _imports(name: str, path: str, known: set[str]) -> set[str]:
    """The package modules that ``name`` imports (``from a import b`` counts as ``a.b`` when
    that is a module)."""
    tree = ast.parse(open(path).read())
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            found.update(f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                         for a in node.names)
    out = set()
    for target in found:
        while target and target not in known:
            target = target.rpartition(".")[0]
        if target and target != name:
            out.add(target)
    return out


def _layer(name: str) -> int:
    best = max((p for p in LAYERS if name == p or name.startswith(p + ".")), key=len)
    return LAYERS[best]


@pytest.fixture(scope="module")
def graph():
    mods = _modules()
    return {m: _imports(m, p, set(mods)) for m, p in mods.items()}


def test_every_module_has_a_layer(graph):
    for m in graph:
        _layer(m)  # raises ValueError (max of nothing) for a module outside every layer


def test_nothing_imports_upward(graph):
    bad = [f"{m} ({NAMES[_layer(m)]}) imports {t} ({NAMES[_layer(t)]})"
           for m, targets in graph.items() for t in sorted(targets) if _layer(t) > _layer(m)]
    assert bad == [], "\n".join(bad)


def test_no_import_cycles(graph):
    index, low, stack, on, cycles, counter = {}, {}, [], set(), [], [0]

    def visit(v):  # Tarjan's strongly connected components
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
                cycles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert cycles == [], cycles


def test_no_module_is_too_long():
    long = {m: n for m, p in _modules().items()
            if (n := sum(1 for _ in open(p))) > 500}
    assert long == {}, f"modules over 500 lines (split them by meaning): {long}"


def test_package_and_cli_import_without_jax():
    """``import mtp_jax`` and the CLI module import neither jax nor flax (the package's names
    load on first use), so the CLI parses its flags in well under a second and a Ctrl-C
    while the engine imports is the CLI's, not a traceback; the names still resolve."""
    import subprocess
    import sys

    code = ("import sys, mtp_jax, mtp_jax.generate\n"
            "assert 'jax' not in sys.modules and 'flax' not in sys.modules, "
            "sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'flax'))[:5]\n"
            "from mtp_jax import LLM, ConfigError, load_model, LoadedModel\n"
            "assert mtp_jax.SamplingParams.__module__ == 'mtp_jax.sampling.params', "
            "mtp_jax.SamplingParams.__module__\n"
            "assert 'jax' in sys.modules\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert run.returncode == 0, run.stderr[-2000:]
