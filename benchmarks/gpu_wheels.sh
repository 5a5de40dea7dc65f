#!/usr/bin/env bash
# Downloads the wheels that benchmarks/gpu.sh needs and the lent GPU machine lacks.
#
#   bash benchmarks/gpu_wheels.sh [DIR]        # DIR defaults to .whl (in the repository)
#
# Run it here, where PyPI answers; the GPU machine reaches no network. Its package list
# (/work/.library/device/KINDS.md, "Python packages already there") has jax, numpy, absl-py,
# h5py, ml-dtypes, packaging, rich, psutil, nvidia-ml-py, matplotlib, scipy and
# typing-extensions, but not keras nor two of keras's needs, namex and optree, nor
# keras-tuner and kt-legacy (the tuner table; keras-tuner's other needs, grpcio, protobuf and
# requests, are there). TensorFlow is not needed (gpu_table.py runs Keras on JAX). The
# versions are those the development environment runs.
#
# Then name .whl in the device tool's `carry`; gpu.sh installs what it finds there with
# `pip install --no-index --no-deps --target /tmp/site`. About 3 MiB in all, well under the
# 64 MiB a call carries. Never commit the wheels: with the default DIR this script adds
# /.whl/ to .git/info/exclude, as /work/.library/device/README.md says.
set -euo pipefail
cd "$(dirname "$0")/.."

dir=${1:-.whl}
python=${PYTHON:-}
if [ -z "$python" ]; then
    if [ -x .venv/bin/python ]; then python=.venv/bin/python; else python=python3; fi
fi
wheels=(keras==3.15.1 namex==0.1.0 optree==0.20.0 keras-tuner==1.4.8 kt-legacy==1.0.5)

if [ "$dir" = .whl ] && [ -d .git ]; then
    mkdir -p .git/info
    grep -qxF /.whl/ .git/info/exclude 2>/dev/null || echo /.whl/ >>.git/info/exclude
fi
mkdir -p "$dir"
# The device README's recipe: CPython 3.12 on manylinux x86_64, no dependencies resolved.
"$python" -m pip download --quiet --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 \
    -d "$dir" "${wheels[@]}"

# One version of each package: two stop the whole install on the GPU machine.
duplicates=$(ls "$dir"/*.whl | xargs -n1 basename | cut -d- -f1 | tr 'A-Z-' 'a-z_' | sort | uniq -d)
if [ -n "$duplicates" ]; then
    echo "gpu_wheels.sh: more than one wheel of: $duplicates; remove the old ones from $dir" >&2
    exit 1
fi
ls -l "$dir"
du -sh "$dir"
echo "gpu_wheels.sh: name $dir in the device tool's carry; gpu.sh installs from .whl/ (or \$GPU_WHEELS)"
