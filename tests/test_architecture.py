"""The import rule of docs/architecture.md, read from the source with ``ast`` (every ``import`` and
``from ... import``, also those inside functions): the algorithm does not reach up into the entry points
or down into a concrete actor or rollout engine."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "laconic_nemo"

# what each library unit may import of the project (itself included); grpo.interfaces is the actor contract
ALLOWED = {
    "core": {"core"},
    "data": {"data"},
    "rewards": {"rewards"},
    "faults": set(),
    "kernels": set(),
    "megatron_env": set(),
    "tokenizer_checks": set(),
    "config": {"kernels", "core"},
    "bridge": {"bridge", "kernels"},
    "grpo": {"grpo", "core", "data", "rewards", "config", "faults", "tokenizer_checks"},
    "rollout": {"rollout", "bridge", "grpo.interfaces"},
    "actors": {"actors", "bridge", "kernels", "megatron_env", "rollout", "grpo.interfaces"},
    # the plug-ins for other frameworks: the core's formulas and their framework, nothing else of the project
    "integrations": {"integrations", "core"},
}
# the only modules that may import the entry points (laconic_nemo.app)
APP_IMPORTERS = {"app", "cli", "nemo_entry", "launch_plan", "eval"}


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


def test_every_module_keeps_to_the_import_rule():
    files = sorted(PKG.rglob("*.py"))
    assert {unit_of(f) for f in files} >= set(ALLOWED), "a unit of the rule no longer exists: update the rule"
    assert violations(files) == []


@pytest.mark.parametrize("unit, source, needle", [
    ("core", "from laconic_nemo.grpo.loss import make_grpo_loss_fn\n", "(core) imports laconic_nemo.grpo.loss"),
    ("grpo", "def f():\n    from laconic_nemo.actors.megatron_core import MegatronCoreActor\n",
     "(grpo) imports laconic_nemo.actors.megatron_core"),
    ("grpo", "import laconic_nemo.app.run\n", "(grpo) imports laconic_nemo.app.run"),
    ("export", "from laconic_nemo.app.task import Task\n", "(export) imports the entry points"),
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
