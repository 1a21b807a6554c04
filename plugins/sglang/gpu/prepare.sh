#!/usr/bin/env bash
# Stage what the SGLang plugin's GPU tests need on a machine without package access (Python 3.12,
# its own torch): sglang 0.5.23's Python files (its compiled parts are not imported on these
# paths), cp312 wheels of the import-time packages, and the stub shim for sglang's CUDA-only
# imports.  Run from the repo root here; it fills .whl/ (git-ignored).  There:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl &&
#   tar xzf .whl/sglang_py.tgz -C /tmp/site && export PYTHONPATH=$PWD/.whl/shim:/tmp/site &&
#   python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . &&
#   python3 -m pytest -q plugins/sglang/tests
set -euo pipefail
mkdir -p .whl/shim
tmp=$(mktemp -d)
python3 -m pip download -q --no-deps -d "$tmp" sglang==0.5.23
(cd "$tmp" && unzip -q sglang-0.5.23-*.whl && tar czf sglang_py.tgz --exclude='__pycache__' --exclude='*.so' \
   --exclude='sglang/multimodal_gen' --exclude='sglang/test' --exclude='sglang/benchmark' sglang sglang-0.5.23.dist-info)
cp "$tmp/sglang_py.tgz" .whl/
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux1_x86_64 -d .whl \
  orjson pybase64 starlette msgspec pydantic pydantic-core annotated-types typing-inspection pyzmq IPython jedi \
  parso traitlets matplotlib-inline stack_data asttokens executing pure_eval prompt_toolkit wcwidth decorator \
  pexpect ptyprocess ipython-pygments-lexers dill gguf apache-tvm-ffi==0.1.11 compressed-tensors==0.18.0 loguru
cp "$(dirname "$0")/sitecustomize.py" .whl/shim/
rm -rf "$tmp"
