#!/usr/bin/env bash
# Wheels for an offline GPU host that already has PyTorch (CUDA build, with its triton) on CPython 3.12, x86-64 Linux:
# what such a host lacks for the megatron-core path of laconic-nemo, downloaded here (where the package index is
# reachable) into OUT_DIR (default .whl, git-ignored). Needs no GPU and no Python 3.12 here.
#
#   bash scripts/gpu_wheelhouse.sh [OUT_DIR]
#
# megatron-core: the release pyproject's `megatron` extra pins for Python >= 3.12 (MCORE_VERSION overrides it), as
# PyPI's cp312 wheel; the script fails unless the wheel it got is that release for cp312. Beside it the pure-Python
# wheels the project imports on that path (omegaconf and its antlr4 runtime, math-verify and latex2sympy2_extended)
# and packaging (megatron-core 0.19 needs >= 24.2). Where ../shared/gpu holds the GPU check harness (check.sh,
# smoke.sh, yardstick_decode.py; GPU_HARNESS names another folder), it is copied in to travel with the wheels.
# On the host, from the project root:
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
#   export PYTHONPATH=/tmp/site:$PWD      # the project itself runs from its source tree
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-.whl}
pinned=$(sed -n "s/.*\"megatron-core==\([0-9.]*\); python_version >= '3.12'\".*/\1/p" pyproject.toml)
MCORE=${MCORE_VERSION:-$pinned}
[ -n "$MCORE" ] || { echo "gpu_wheelhouse: no megatron-core pin for python_version >= '3.12' in pyproject.toml" >&2; exit 2; }
PURE=(omegaconf==2.4.0 antlr4-python3-runtime==4.13.2 math-verify==0.9.0 latex2sympy2_extended==1.11.0
      "packaging>=24.2")
CP312=(--only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 --platform manylinux_2_28_x86_64
       --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)

mkdir -p "$OUT"
rm -f "$OUT"/megatron_core-*.whl
python3 -m pip download -q --no-deps "${CP312[@]}" -d "$OUT" "megatron-core==$MCORE"
# the wheel must be the pinned release, built for CPython 3.12 (a py3-none or another ABI would not be it)
wheel=$(ls "$OUT"/megatron_core-*.whl)
case "$(basename "$wheel")" in
  "megatron_core-$MCORE-cp312-cp312-"*manylinux*x86_64*.whl) ;;
  *) echo "gpu_wheelhouse: got $(basename "$wheel"), not megatron-core $MCORE for cp312" >&2; exit 3 ;;
esac
python3 -m pip download -q --no-deps "${CP312[@]}" -d "$OUT" "${PURE[@]}"
harness=${GPU_HARNESS:-../shared/gpu}
for f in check.sh smoke.sh yardstick_decode.py; do
  if [ -f "$harness/$f" ]; then cp "$harness/$f" "$OUT/" && chmod u+w "$OUT/$f"; fi
done
echo "megatron-core wheel: $(basename "$wheel")"
ls -la "$OUT"
du -sh "$OUT"
