# Sourced by the other scripts: creates .venv (once) with the CPU build of torch and specmesh in it.
# torch comes first and pinned, so nothing later pulls a multi-GB CUDA build.
if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
# shellcheck disable=SC1091
source .venv/bin/activate
if ! python -c "import torch" 2>/dev/null; then
    python -m pip install -q "torch==2.13.0"
fi
if [ ! -f .venv/.installed ] || [ pyproject.toml -nt .venv/.installed ]; then
    python -m pip install -q -e ".[test,train]"
    touch .venv/.installed
fi
