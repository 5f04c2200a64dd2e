#!/usr/bin/env bash
# Wheels for a GPU machine that cannot reach a package registry but has python3 with a CUDA build of torch
# (a cluster's compute node, or a lent device). Run here, where pip reaches PyPI; then copy .whl/ along with
# the repository. scripts/gpu_check.sh installs them there, offline, into a folder of its own on PYTHONPATH:
# pip takes a carried wheel only for what that python lacks or holds at a version brigade's pins refuse, so
# its torch, numpy and CUDA libraries stay as they are.
#
#   scripts/gpu_wheels.sh                    # for Python 3.12 on x86-64 Linux (PYVER=3.11 for another)
#
# What is carried: brigade's runtime dependencies for a GPU run (the Hydra launcher, W&B, plotly for the
# report, rich, PyYAML) and everything they need, at the versions this repository's .venv holds (installed
# from requirements.txt: one place for the pins), and the packages of requirements-nodeps.txt (Holistic Trace
# Analysis for gpu_check.sh's step 5, installed there --no-deps as `make install` does here). Not torch, numpy, pandas or matplotlib (the GPU machine's
# python brings its own), not DeepSpeed (a DeepSpeed run needs its CUDA ops built there: install it by hand).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
PYVER=${PYVER:-3.12}
DEST=${DEST:-.whl}
[ -x "$PY" ] || { echo "no $PY: run 'make install' first (the pins are read from it)" >&2; exit 1; }

# the closure of the roots, as name==version lines, from the installed distributions' metadata
ROOTS="hydra-core omegaconf hydra-submitit-launcher submitit wandb plotly rich pyyaml"
PINS=$($PY - "$PYVER" $ROOTS <<'EOF'
import importlib.metadata as md, re, sys
from packaging.requirements import Requirement
pyver, stack, seen = sys.argv[1], sys.argv[2:], {}
while stack:
    name = re.sub(r"[-_.]+", "-", stack.pop()).lower()
    if name in seen:
        continue
    dist = md.distribution(name)
    seen[name] = dist.version
    for r in dist.requires or []:
        req = Requirement(r)
        if not req.marker or req.marker.evaluate({"extra": "", "python_version": pyver}):
            stack.append(req.name)
print("\n".join(f"{n}=={v}" for n, v in sorted(seen.items())))
EOF
)
rm -rf "$DEST" && mkdir -p "$DEST"
QUIET='is ignored: it is neither a file nor a directory'
for pin in $PINS; do
  # a binary wheel for that Python and platform; a pure-Python package published only as an sdist
  # (antlr4-python3-runtime 4.9.3, OmegaConf's parser) is built into a wheel here
  $PY -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      -d "$DEST" "$pin" >/dev/null 2>&1 \
    || $PY -m pip wheel -q --no-deps -w "$DEST" "$pin" 2>&1 | { grep -v "$QUIET" || true; }
done
# what gpu_check.sh asks pip for there: the roots at their pins (pip resolves the rest from the wheels)
for root in $ROOTS; do grep -i "^$root==" <<<"$PINS"; done >"$DEST/requirements.txt"
# requirements-nodeps.txt's pins, as they stand there (installed --no-deps: their declared dependencies are
# notebooks' and are not carried)
NODEPS=$(grep -oE '^[A-Za-z0-9_.-]+==[^ #]+' requirements-nodeps.txt)
for pin in $NODEPS; do
  $PY -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      -d "$DEST" "$pin" >/dev/null
done
printf '%s\n' $NODEPS >"$DEST/requirements-nodeps.txt"
n=$(ls "$DEST"/*.whl | wc -l)
want=$(printf '%s\n' $PINS $NODEPS | sed 's/==.*//' | tr 'A-Z_.' 'a-z--' | sort -u | wc -l)
echo "$n wheels in $DEST ($(du -sh "$DEST" | cut -f1)) for Python $PYVER: copy $DEST/ along with the repository; scripts/gpu_check.sh installs from it"
[ "$n" -eq "$want" ] || { echo "expected $want wheels" >&2; exit 1; }
