#!/usr/bin/env bash
# What a GPU machine without a package index needs beside its own torch and transformers
# (`make gpu-carry`): this venv's versions of the project's other dependencies as Python 3.12
# x86_64 wheels, and DeepSpeed's package (it ships no wheel; its ops build on the GPU machine, as
# FusedAdam did on an H100). Written to .gpu-carry/ (ignored by git); there, before `make gpu-checks`:
#
#   eval "$(bash .gpu-carry/install.sh)"    # installs the wheels, sets PYTHONPATH and DS_ACCELERATOR
set -eu
PY=${PY:-.venv/bin/python}
OUT=${OUT:-.gpu-carry}
rm -rf "$OUT" && mkdir -p "$OUT/wheels" "$OUT/site"
# what the project imports and an image with torch, transformers and the scientific stack lacks
NAMES="pydantic pydantic_core annotated-types typing-inspection math-verify latex2sympy2_extended
  antlr4-python3-runtime datasets dill multiprocess hjson"
pins=$($PY -m pip freeze | grep -iE "^($(echo $NAMES | tr ' ' '|' | sed 's/[-_]/[-_]/g'))==" || true)
$PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
  -d "$OUT/wheels" $pins
site=$($PY -c "import importlib.util as u, os; print(os.path.dirname(os.path.dirname(u.find_spec('deepspeed').origin)))")
cp -r "$site"/deepspeed "$site"/deepspeed-*.dist-info "$OUT/site/"
find "$OUT/site" -name __pycache__ -prune -exec rm -rf {} +
cat >"$OUT/install.sh" <<'INSTALL'
#!/usr/bin/env bash
# DS_ACCELERATOR: the package was installed on a CPU machine and would otherwise pick the CPU
python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/gpu-carry "$(dirname "$0")"/wheels/*.whl
echo "export PYTHONPATH=$PWD:/tmp/gpu-carry:$PWD/.gpu-carry/site DS_ACCELERATOR=cuda"
INSTALL
chmod +x "$OUT/install.sh"
du -sh "$OUT"; ls "$OUT/wheels"
