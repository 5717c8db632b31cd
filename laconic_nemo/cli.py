"""`laconic-nemo`: one entry point for every job.

Subcommands are defined next to the code they run; each module exposes
``register(subparsers)`` which adds its parser and sets ``func`` to a callable taking the parsed
arguments and returning an exit code. Modules are imported lazily so that a missing optional
dependency (vLLM, transformers, NeMo) only affects the subcommand that needs it.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# (subcommand, module that registers it, one-line help shown when the module cannot be imported)
SUBCOMMANDS = [
    ("train", "laconic_nemo.app.train_cli", "train a policy with GRPO + LACONIC from a recipe"),
    ("plan", "laconic_nemo.plan.cli", "validate a recipe for a cluster layout and print the launch commands"),
    ("export", "laconic_nemo.tools.export", "write a training checkpoint as a Hugging Face model folder"),
    ("eval", "laconic_nemo.eval.cli", "evaluate a checkpoint on the math benchmarks (paper Table 1)"),
    ("simulate", "laconic_nemo.tools.simulate", "choose eta, Lambda and pid gains on a length-response model of a run"),
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="laconic-nemo", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, module, help_text in SUBCOMMANDS:
        try:
            importlib.import_module(module).register(sub)
        except ImportError as exc:  # keep the other subcommands usable
            p = sub.add_parser(name, help=f"{help_text} (unavailable: {exc})")
            p.set_defaults(func=lambda args, exc=exc, name=name: _unavailable(name, exc))
    return parser


def _unavailable(name: str, exc: Exception) -> int:
    print(f"laconic-nemo {name}: unavailable in this environment: {exc}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
