#!/usr/bin/env bash
# gpu_wheels.sh — download the wheels that an offline CUDA machine lacks for benchmarks/gpu_check.sh.
#
#   bash benchmarks/gpu_wheels.sh [DEST]              # default DEST: .whl (keep it out of git, see below)
#   bash benchmarks/gpu_wheels.sh .whl --with-wandb   # also wandb and what it needs (only for logger=wandb runs)
#
# Run it where pip can reach PyPI. It fetches, for CPython 3.12 on x86-64 Linux (GPU_WHEELS_PYTHON to change),
# with --no-deps so nothing the target machine already has is shadowed:
#   omegaconf (the version installed here, else 2.4.0) and antlr4-python3-runtime when that omegaconf needs it;
#   optuna (studies; tests/test_study.py imports it) with alembic, SQLAlchemy, Mako and colorlog, which the CUDA
#   images lack (they have numpy, packaging, pyyaml, tqdm, markupsafe, typing-extensions).
# The rest gpu_check.sh needs beyond torch (pytorch-lightning, scikit-learn, matplotlib, timm, tqdm, pyyaml, pytest,
# hypothesis) is in the usual CUDA images; gpu_check.sh names anything still missing.
# On the GPU machine, gpu_check.sh installs the wheels of GPU_CHECK_WHEELS (default .whl) into a temporary folder
# by itself when a package is missing; by hand:
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
#   export PYTHONPATH=/tmp/site:$PYTHONPATH
# Keep DEST out of version control, e.g. `echo /.whl/ >> .git/info/exclude`.
set -euo pipefail

DEST="${1:-.whl}"
WITH_WANDB=0
[[ "${2:-}" == "--with-wandb" || "${1:-}" == "--with-wandb" ]] && WITH_WANDB=1
[[ "$DEST" == "--with-wandb" ]] && DEST=.whl
PYVER="${GPU_WHEELS_PYTHON:-3.12}"
PYTHON_HERE="${PYTHON:-python3}"
mkdir -p "$DEST"

version_here() {  # the version installed here, or the fallback
    "$PYTHON_HERE" -c "import importlib.metadata as m, sys
try: print(m.version(sys.argv[1]))
except m.PackageNotFoundError: print(sys.argv[2])" "$1" "$2"
}

download() {
    "$PYTHON_HERE" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any -d "$DEST" "$@"
}

requires() {  # the Requires-Dist names of a downloaded wheel (extras left out)
    unzip -p "$1" '*/METADATA' | grep '^Requires-Dist' | grep -v 'extra ==' | sed 's/^Requires-Dist: *//; s/[ ;<>=!~(\[].*//'
}

OMEGACONF="$(version_here omegaconf 2.4.0)"
download "omegaconf==$OMEGACONF"
if requires "$DEST"/omegaconf-"$OMEGACONF"-*.whl | grep -qi '^antlr4-python3-runtime$'; then
    download "antlr4-python3-runtime==$(version_here antlr4-python3-runtime 4.9.3)"
fi

# optuna and the needs of it (and of alembic and SQLAlchemy) that the CUDA images lack
for spec in "optuna 5.0.0" "alembic 1.20.1" "sqlalchemy 2.1.9" "mako 1.4.3" "colorlog 6.12.0"; do
    set -- $spec
    download "$1==$(version_here "$1" "$2")"
done

if [[ $WITH_WANDB -eq 1 ]]; then
    # wandb and the needs of it that the CUDA images lack (they have click, protobuf, pyyaml, requests, xxhash)
    WANDB="$(version_here wandb 0.31.0)"
    download "wandb==$WANDB"
    for name in $(requires "$DEST"/wandb-"$WANDB"-*.whl); do
        case "${name,,}" in
            click|protobuf|pyyaml|requests|typing-extensions|typing_extensions|packaging|xxhash|psutil) ;;
            *) v="$(version_here "$name" "")"
               download "$name${v:+==$v}" || echo "gpu_wheels: could not fetch $name (add it by hand)" ;;
        esac
    done
    echo "gpu_wheels: wandb's own needs were fetched one level deep; run 'pip show wandb' there to check"
fi

echo "wheels in $DEST:"
ls -1 "$DEST"
