"""The import rule of docs/architecture.md, read from the source with ``ast`` (every ``import`` and
``from ... import``, also those inside functions):

1. layers: every unit (a folder of the package, or a module at its root) stands in one layer of :data:`LAYERS`,
   lowest first; a module imports its own unit and units of LOWER layers only (no upward import, none sideways
   to another unit of its layer);
2. no import loops: the graph of the package's modules (file -> the file it imports) has no cycle, nor has the
   graph of the scripts beside it (benchmarks/, tests/, launch/, examples/, ...: a bare ``import name`` of a
   module file of the script's own folder or of a folder such scripts put on ``sys.path``);
3. each library unit imports only what :data:`ALLOWED` names (narrower than its layer: the algorithm does not
   reach down into a concrete actor or rollout engine), and only the units above the entry points import them;
4. no private member (``_name``) of the package is used outside the module that defines it
   (:func:`private_member_uses`): what one part calls of another is public, so a dependency shows in a signature;
5. sizes: no class over :data:`MAX_CLASS_LINES` lines with the package's own base classes counted in (a class
   split into mixins is still one class), no module over :data:`MAX_FILE_LINES` lines.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "laconic_nemo"

# the layers, lowest first: a unit imports its own modules and those of the layers below it
LAYERS = (
    ("core", "data", "rewards", "runtime"),  # the mathematics, the data, the reward, process / device machinery
    ("config", "integrations"),  # the recipe schema; the plug-ins for other frameworks
    ("bridge",),  # Hugging Face <-> megatron-core weights
    ("grpo",),  # the loop, its loss, checkpoints, metrics and the actor contract
    ("rollout",),  # decode engines
    ("actors",),  # the policies
    ("plan", "tools"),  # what runs before a launch; the commands beside training (simulate, export, convert)
    ("app",),  # the entry points
    ("eval",),  # evaluation (finds a run's warm-up through the entry point's cache key)
    ("cli", "nemo_entry", "__init__"),  # the command line, the in-container alias, the package
    ("__main__",),  # ``python -m laconic_nemo``
)
LAYER = {unit: i for i, units in enumerate(LAYERS) for unit in units}

# what each library unit may import of the project (itself included); grpo.interfaces is the actor contract
ALLOWED = {
    "core": {"core"},
    "data": {"data"},
    "rewards": {"rewards"},
    "runtime": {"runtime"},
    "config": {"config", "core", "runtime.kernels"},
    "bridge": {"bridge", "runtime.kernels"},
    "grpo": {"grpo", "core", "data", "rewards", "config", "runtime"},
    "rollout": {"rollout", "bridge", "config", "grpo.interfaces"},
    "actors": {"actors", "bridge", "config", "runtime", "rollout", "grpo.interfaces"},
    # the plug-ins for other frameworks: the core's formulas and their framework, nothing else of the project
    "integrations": {"integrations", "core"},
}
# the only units that may import the entry points (laconic_nemo.app)
APP_IMPORTERS = {"app", "cli", "nemo_entry", "eval"}
MAX_CLASS_LINES = 400  # a class with its in-package bases (mixins)
MAX_FILE_LINES = 700


def unit_of(path: Path, pkg: Path = PKG) -> str:
    rel = path.relative_to(pkg)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def project_imports(path: Path, pkg: Path = PKG) -> list[tuple[int, str]]:
    """(line, name) of every project import in ``path``, the name without ``laconic_nemo.`` and, for
    ``from M import x``, with ``.x`` appended (``x`` may be a module or an object of ``M``)."""
    package = ["laconic_nemo", *path.relative_to(pkg).parts[:-1]]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[: len(package) - node.level + 1]) if node.level else ""
            module = ".".join(x for x in (base, node.module or "") if x)
            names = [f"{module}.{a.name}" for a in node.names]
        else:
            continue
        out += [(node.lineno, n[len("laconic_nemo."):]) for n in names if n.startswith("laconic_nemo.")]
    return out


def permitted(unit: str, name: str) -> bool:
    return any(name == r or name.startswith(r + ".") for r in ALLOWED[unit])


def violations(files, pkg: Path = PKG) -> list[str]:
    bad = []
    for f in files:
        unit = unit_of(f, pkg)
        for line, name in project_imports(f, pkg):
            where = f"{f.relative_to(pkg.parent)}:{line} ({unit})"
            if unit in ALLOWED and not permitted(unit, name):
                bad.append(f"{where} imports laconic_nemo.{name}")
            elif name.split(".")[0] == "app" and unit not in APP_IMPORTERS:
                bad.append(f"{where} imports the entry points: laconic_nemo.{name}")
    return bad


def module_file(name: str, pkg: Path = PKG) -> Path | None:
    """The file of the longest prefix of the dotted ``name`` that is a module or package of ``pkg``
    (``core.SHAPERS`` -> core/__init__.py, ``grpo.loss.make_grpo_loss_fn`` -> grpo/loss.py)."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        base = pkg.joinpath(*parts[:n])
        for cand in (base.with_suffix(".py"), base / "__init__.py"):
            if cand.is_file():
                return cand
    return None


def import_graph(files, pkg: Path = PKG) -> dict[Path, dict[Path, int]]:
    """file -> {imported file: line of the first such import} over the project's own modules."""
    graph: dict[Path, dict[Path, int]] = {}
    for f in files:
        edges = graph.setdefault(f, {})
        for line, name in project_imports(f, pkg):
            target = module_file(name, pkg)
            if target is not None and target != f:
                edges.setdefault(target, line)
    return graph


def upward_imports(files, pkg: Path = PKG) -> list[str]:
    """Every import of a unit of the same or a higher layer than the importing module's (its own unit aside)."""
    bad = []
    for f in files:
        unit = unit_of(f, pkg)
        for line, name in project_imports(f, pkg):
            target = module_file(name, pkg)
            other = unit_of(target, pkg) if target is not None else name.split(".")[0]
            if other == unit:
                continue
            where = f"{f.relative_to(pkg.parent)}:{line} ({unit}, layer {LAYER.get(unit)})"
            if unit not in LAYER or other not in LAYER:
                bad.append(f"{where} imports laconic_nemo.{name}: a unit without a layer ({other})")
            elif LAYER[other] >= LAYER[unit]:
                way = "up" if LAYER[other] > LAYER[unit] else "sideways"
                bad.append(f"{where} imports {way}: laconic_nemo.{name} ({other}, layer {LAYER[other]})")
    return bad


def import_loops(files, pkg: Path = PKG) -> list[str]:
    """Each cycle of :func:`import_graph` (a strongly connected set of two files or more), as the files and the
    imports that tie them (``a.py:12 -> b.py``)."""
    return cycles(import_graph(files, pkg), pkg.parent)


def cycles(graph: dict[Path, dict[Path, int]], base: Path) -> list[str]:
    """Each strongly connected set of two files or more of ``graph`` (file -> {imported file: line}), named by the
    imports that tie it, paths relative to ``base``."""
    index: dict[Path, int] = {}
    low: dict[Path, int] = {}
    stack: list[Path] = []
    on_stack: set[Path] = set()
    loops: list[list[Path]] = []

    def visit(v: Path) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
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
            if len(component) > 1:
                loops.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    out = []
    for component in loops:
        members = set(component)
        ties = [f"{a.relative_to(base)}:{line} -> {b.relative_to(base)}"
                for a in component for b, line in sorted(graph[a].items()) if b in members]
        out.append(f"loop of {len(component)} files: " + "; ".join(ties))
    return out


def package_files(pkg: Path = PKG) -> list[Path]:
    return sorted(pkg.rglob("*.py"))


def test_every_module_keeps_to_the_import_rule():
    files = package_files()
    assert {unit_of(f) for f in files} >= set(ALLOWED), "a unit of the rule no longer exists: update the rule"
    assert violations(files) == []


def test_every_unit_has_a_layer_and_imports_only_below_it():
    files = package_files()
    assert {unit_of(f) for f in files} == set(LAYER), "a unit without a layer, or a layer without its unit"
    assert upward_imports(files) == []


def test_no_import_loops():
    assert import_loops(package_files()) == []


def test_the_package_root_keeps_at_most_six_modules():
    """The command line, the recipe schema and a few leaves; the rest stands in folders that say their role."""
    root = sorted(p.name for p in PKG.glob("*.py"))
    assert len(root) <= 6, root


@pytest.mark.parametrize("unit, source, needle", [
    ("core", "from laconic_nemo.grpo.loss import make_grpo_loss_fn\n", "(core) imports laconic_nemo.grpo.loss"),
    ("grpo", "def f():\n    from laconic_nemo.actors.megatron_core import MegatronCoreActor\n",
     "(grpo) imports laconic_nemo.actors.megatron_core"),
    ("grpo", "import laconic_nemo.app.run\n", "(grpo) imports laconic_nemo.app.run"),
    ("tools", "from laconic_nemo.app.task import Task\n", "(tools) imports the entry points"),
    ("rollout", "from laconic_nemo.grpo.trainer import GRPOTrainer\n", "(rollout) imports laconic_nemo.grpo.trainer"),
    ("actors", "from laconic_nemo.grpo import trainer\n", "(actors) imports laconic_nemo.grpo.trainer"),
    ("data", "from . import sampler\nfrom laconic_nemo.rewards import extract_answer\n",
     "(data) imports laconic_nemo.rewards.extract_answer"),
    ("integrations", "from laconic_nemo.grpo.trainer import GRPOTrainer\n",
     "(integrations) imports laconic_nemo.grpo.trainer"),
])
def test_the_rule_catches_a_forbidden_import(tmp_path, unit, source, needle):
    """The checker itself: a planted module of ``unit`` with a forbidden import is reported (line and module)."""
    fake = tmp_path / "laconic_nemo"
    (fake / unit).mkdir(parents=True)
    planted = fake / unit / "planted.py"
    planted.write_text(source)
    bad = violations([planted], fake)
    assert len(bad) == 1 and needle in bad[0], bad


def _plant(root: Path, files: dict[str, str]) -> list[Path]:
    out = []
    for rel, source in files.items():
        p = root / "laconic_nemo" / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(source)
        out.append(p)
    return out


@pytest.mark.parametrize("unit, target, needle", [
    ("core", "grpo.loss", "(core, layer 0) imports up: laconic_nemo.grpo.loss (grpo, layer 3)"),
    ("plan", "tools.export", "(plan, layer 6) imports sideways: laconic_nemo.tools.export (tools, layer 6)"),
    ("plan", "app.task", "(plan, layer 6) imports up: laconic_nemo.app.task (app, layer 7)"),
    ("grpo", "somewhere.x", "imports laconic_nemo.somewhere.x: a unit without a layer (somewhere)"),
])
def test_the_rule_catches_an_upward_import(tmp_path, unit, target, needle):
    """A planted import from a unit to one of a higher (or the same) layer is reported with both layers; one
    down is not."""
    module, name = target.rsplit(".", 1)
    files = _plant(tmp_path, {f"{unit}/planted.py": f"def f():\n    from laconic_nemo.{module} import {name}\n",
                              f"{module.replace('.', '/')}.py": f"{name} = 1\n",
                              "data/below.py": "X = 1\n"})
    bad = upward_imports(files, tmp_path / "laconic_nemo")
    assert len(bad) == 1 and needle in bad[0], bad
    down = _plant(tmp_path, {f"{unit}/fine.py": "from laconic_nemo.data.below import X\n"})
    if unit != "core":
        assert upward_imports(down, tmp_path / "laconic_nemo") == []


def test_the_rule_catches_an_import_loop(tmp_path):
    """Three planted files that import each other in a ring (one inside a function, one through a package's
    ``__init__``) are one loop naming each tie; a file that only imports into the ring is not part of it."""
    files = _plant(tmp_path, {
        "plan/__init__.py": "from laconic_nemo.plan.a import A\n",
        "plan/a.py": "import laconic_nemo.plan.b\nA = 1\n",
        "plan/b.py": "def f():\n    from laconic_nemo.app.c import C\n",
        "app/c.py": "from laconic_nemo.plan import A\nC = 2\n",
        "app/outside.py": "from laconic_nemo.app.c import C\n",
    })
    pkg = tmp_path / "laconic_nemo"
    loops = import_loops(files, pkg)
    assert len(loops) == 1, loops
    assert loops[0].startswith("loop of 4 files: ")
    for tie in ("laconic_nemo/plan/__init__.py:1 -> laconic_nemo/plan/a.py",
                "laconic_nemo/plan/a.py:1 -> laconic_nemo/plan/b.py",
                "laconic_nemo/plan/b.py:2 -> laconic_nemo/app/c.py",
                "laconic_nemo/app/c.py:1 -> laconic_nemo/plan/__init__.py"):
        assert tie in loops[0], (tie, loops[0])
    assert "outside" not in loops[0]
    assert import_loops([f for f in files if f.name != "b.py"], pkg) == []


# ------------------------------------------------------------------------------------------ the scripts' imports
ROOT = PKG.parent
# the folders of scripts (not the package): a script imports another by its bare name, from its own folder or from
# one of these folders (put on sys.path by the importer: benchmarks/gpu_common.py adds tests/dist, the tests add
# benchmarks/ and tests/dist)
SCRIPT_DIRS = ("benchmarks", "tests", "tests/dist", "tests/slurm", "launch", "examples", "scripts", "containers")


def script_files(root: Path = ROOT) -> list[Path]:
    return sorted(f for d in SCRIPT_DIRS if (root / d).is_dir() for f in (root / d).rglob("*.py"))


def script_graph(files, root: Path = ROOT) -> dict[Path, dict[Path, int]]:
    """file -> {script file it imports: line of the first such import}: an absolute import whose first name is a
    module file of the importing file's folder, else of one of :data:`SCRIPT_DIRS`."""
    graph: dict[Path, dict[Path, int]] = {}
    for f in files:
        edges = graph.setdefault(f, {})
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                first = name.split(".")[0]
                for folder in (f.parent, *(root / d for d in SCRIPT_DIRS)):
                    target = folder / f"{first}.py"
                    if target.is_file():
                        if target != f:
                            edges.setdefault(target, node.lineno)
                        break
    return graph


def test_no_import_loops_among_the_scripts():
    assert cycles(script_graph(script_files()), ROOT) == []


def test_the_script_rule_catches_an_import_loop(tmp_path):
    """Two planted benchmarks that import each other (one inside a function, as benchmarks/plain_decode.py imported
    gpu_step.py's shapes while gpu_step.py imported plain_decode.py) are one loop; a third that imports one of them
    is not part of it, and a name that is no script of the tree (torch) makes no edge."""
    bench = tmp_path / "benchmarks"
    bench.mkdir()
    (bench / "step.py").write_text("import torch\nfrom plain import PlainStep\n")
    (bench / "plain.py").write_text("PlainStep = 1\n\n\ndef shapes():\n    from step import SHAPES\n")
    (bench / "other.py").write_text("import step\n")
    loops = cycles(script_graph(script_files(tmp_path), tmp_path), tmp_path)
    assert loops == ["loop of 2 files: benchmarks/plain.py:5 -> benchmarks/step.py; "
                     "benchmarks/step.py:2 -> benchmarks/plain.py"], loops
    (bench / "plain.py").write_text("PlainStep = 1\n")
    assert cycles(script_graph(script_files(tmp_path), tmp_path), tmp_path) == []


# ---------------------------------------------------------------------------------------------- private members
def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_members_defined(tree: ast.AST) -> set[str]:
    """The private names a module defines: its functions, classes and variables, its classes' methods, attributes
    set on ``self`` / ``cls``, and parameters."""
    out = set()
    for n in ast.walk(tree):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            name = n.name
        elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
            name = n.id
        elif (isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store) and isinstance(n.value, ast.Name)
              and n.value.id in ("self", "cls")):
            name = n.attr
        elif isinstance(n, ast.arg):
            name = n.arg
        else:
            continue
        if _private(name):
            out.add(name)
    return out


def private_member_uses(files, pkg: Path = PKG) -> list[str]:
    """Every use of a private member of the package in a module that does not define it: ``obj._name`` read or
    written (``self._name`` too: a mixin reading its sibling's state), or ``from laconic_nemo... import _name``. A
    private name that no module of ``files`` defines (an upstream library's, such as megatron's) is outside the
    rule."""
    trees = {f: ast.parse(f.read_text(), str(f)) for f in files}
    defined = {f: private_members_defined(t) for f, t in trees.items()}
    owners: dict[str, set[Path]] = {}
    for f, names in defined.items():
        for name in names:
            owners.setdefault(name, set()).add(f)
    bad = []
    for f, tree in trees.items():
        for n in ast.walk(tree):
            if isinstance(n, ast.Attribute) and _private(n.attr):
                used = [n.attr]
            elif isinstance(n, ast.ImportFrom) and (n.module or "").startswith("laconic_nemo"):
                used = [a.name for a in n.names if _private(a.name)]
            else:
                continue
            for name in used:
                if name in owners and name not in defined[f]:
                    where = ", ".join(sorted(str(o.relative_to(pkg.parent)) for o in owners[name]))
                    bad.append(f"{f.relative_to(pkg.parent)}:{n.lineno} uses {name} (defined in {where})")
    return sorted(bad)


def test_no_private_member_is_used_outside_its_module():
    assert private_member_uses(package_files()) == []


def test_the_rule_catches_a_private_member_used_elsewhere(tmp_path):
    """A planted module's private function, variable and ``self`` attribute, used by another module (a call, an
    import, a mixin reading its sibling's state), are each reported; the owner's own uses and an upstream
    library's private name are not."""
    files = _plant(tmp_path, {
        "actors/owner.py": ("_LIMIT = 3\n\ndef _helper():\n    return _LIMIT\n\n"
                            "class Part:\n    def __init__(self):\n        self._state = {}\n\n"
                            "    def read(self):\n        return self._state\n"),
        "actors/user.py": ("from laconic_nemo.actors import owner\nfrom laconic_nemo.actors.owner import _LIMIT\n\n"
                           "def f(part):\n    return owner._helper(), part._state\n\n"
                           "class Sibling:\n    def g(self):\n        return self._state\n"),
        "actors/clean.py": "import torch\n\ndef h():\n    return torch._C\n",
    })
    bad = private_member_uses(files, tmp_path / "laconic_nemo")
    assert [b.split(" (")[0] for b in bad] == [
        "laconic_nemo/actors/user.py:2 uses _LIMIT", "laconic_nemo/actors/user.py:5 uses _helper",
        "laconic_nemo/actors/user.py:5 uses _state", "laconic_nemo/actors/user.py:9 uses _state"], bad
    assert all("(defined in laconic_nemo/actors/owner.py)" in b for b in bad)


# ---------------------------------------------------------------------------------------------- sizes
def class_sizes(files) -> dict[str, int]:
    """``module:Class`` -> its lines plus those of its base classes defined in ``files`` (by name, recursively):
    a class assembled from mixins counts as the one class it is."""
    classes: dict[str, tuple[int, list[str], str]] = {}
    for f in files:
        for n in ast.walk(ast.parse(f.read_text(), str(f))):
            if isinstance(n, ast.ClassDef):
                bases = [b.id if isinstance(b, ast.Name) else b.attr for b in n.bases
                         if isinstance(b, (ast.Name, ast.Attribute))]
                classes.setdefault(n.name, (n.end_lineno - n.lineno + 1, bases, f"{f.stem}:{n.name}"))

    def total(name: str, seen: frozenset) -> int:
        lines, bases, _ = classes[name]
        return lines + sum(total(b, seen | {name}) for b in bases if b in classes and b not in seen)

    return {where: total(name, frozenset()) for name, (_, _, where) in classes.items()}


def test_no_class_is_over_the_limit_with_its_mixins():
    big = {k: v for k, v in class_sizes(package_files()).items() if v > MAX_CLASS_LINES}
    assert big == {}, f"classes over {MAX_CLASS_LINES} lines (own + in-package bases): {big}"


def test_no_module_is_over_the_limit():
    big = {str(f.relative_to(PKG.parent)): n for f in package_files()
           if (n := len(f.read_text().splitlines())) > MAX_FILE_LINES}
    assert big == {}, f"modules over {MAX_FILE_LINES} lines: {big}"


def test_the_size_rule_counts_a_class_with_its_mixins(tmp_path):
    """Two planted mixins of 3 lines each and a class of 2 built on them: 8 lines; a base from outside the files
    (``object``, ``torch.nn.Module``) adds nothing."""
    files = _plant(tmp_path, {"actors/parts.py": "class A:\n    x = 1\n    y = 2\n\n\nclass B:\n    z = 3\n    w = 4\n",
                              "actors/whole.py": ("from laconic_nemo.actors.parts import A, B\n\n"
                                                  "class Whole(A, B, object):\n    pass\n")})
    sizes = class_sizes(files)
    assert sizes == {"parts:A": 3, "parts:B": 3, "whole:Whole": 8}, sizes
