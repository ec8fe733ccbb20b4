# Sourced by the other scripts: creates .venv (once) with the CPU build of torch and specmesh in it.
# torch comes first, pinned to its CPU build (the +cpu wheel: from a local wheel or index where pip
# has one, else from PyTorch's CPU index), so nothing later pulls a multi-GB CUDA build. A torch
# already importable (a GPU image's own build) is kept.
TORCH_VERSION="2.13.0"
TORCH_CPU_INDEX="https://download.pytorch.org/whl/cpu"
if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
# shellcheck disable=SC1091
source .venv/bin/activate
if ! python -c "import torch" 2>/dev/null; then
    if [ "$(uname -s)" = "Darwin" ]; then  # macOS wheels are CPU builds, without a +cpu tag
        python -m pip install -q "torch==$TORCH_VERSION"
    elif ! python -m pip install -q "torch==$TORCH_VERSION+cpu" 2>/dev/null; then
        python -m pip install -q "torch==$TORCH_VERSION+cpu" --extra-index-url "$TORCH_CPU_INDEX"
    fi
fi
if [ ! -f .venv/.installed ] || [ pyproject.toml -nt .venv/.installed ]; then
    python -m pip install -q -e ".[test,train]"
    touch .venv/.installed
fi
