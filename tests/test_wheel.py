"""A built wheel is a working install: it ships the recipes (base.yaml and the named recipes) as package data."""

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_wheel_install_loads_a_recipe_by_name(tmp_path):
    pytest.importorskip("setuptools")
    wheels, target, elsewhere = tmp_path / "wheels", tmp_path / "site", tmp_path / "elsewhere"
    elsewhere.mkdir()
    src = tmp_path / "src"  # a clean copy: an in-tree build/ folder could hold files of an older build
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("laconic_nemo", "recipes"):
        shutil.copytree(ROOT / name, src / name, symlinks=True, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheels),
                    str(src)], check=True, capture_output=True, text=True)
    (wheel,) = wheels.glob("laconic_nemo-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {"laconic_nemo/recipes/base.yaml", "laconic_nemo/recipes/tiny_cpu.yaml"} <= names
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
                   check=True, capture_output=True, text=True)
    code = ("import laconic_nemo, laconic_nemo.config as c\n"
            "cfg = c.load_config('tiny_cpu', ['run.num_steps=3'])\n"
            "print(laconic_nemo.__file__); print(c.base_config_path()); print(cfg.laconic.budget, cfg.run.num_steps)\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=elsewhere, capture_output=True, text=True,
                          env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr
    module, base, values = proc.stdout.split("\n")[:3]
    assert module.startswith(str(target)) and base.startswith(str(target))  # the installed copy, not the repo
    from laconic_nemo.config import load_config

    assert values == f"{load_config(ROOT / 'recipes' / 'tiny_cpu.yaml').laconic.budget} 3"  # the repo's recipe
