#!/usr/bin/env bash
# Download the wheels the GPU image lacks (bench/gpu/wheels.txt) into .whl/ at the repo root, for a device run
# with carry: [".whl"]. The recipe of the device README: python 3.12, manylinux x86_64, binary only, no deps.
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-python3}
mkdir -p .whl
# .whl/ is git-ignored (.gitignore): it travels to the device only when a run carries it.
mapfile -t wanted < <(sed -e 's/#.*//' -e 's/[[:space:]]//g' bench/gpu/wheels.txt | grep -v '^$')
platforms=()
# pip matches manylinux_2_N exactly: the usual N, and 31/34/35 that some Rust-built wheels (llguidance) carry.
for tag in manylinux_2_28 manylinux_2_27 manylinux_2_17 manylinux2014 manylinux1 manylinux_2_24 manylinux_2_31 \
    manylinux_2_34 manylinux_2_35; do
    platforms+=(--platform "${tag}_x86_64")
done
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d .whl "${wanted[@]}"
# Only the listed versions: a stale second version, or a package no longer listed, would travel too (and two
# versions of one package stop the whole install on the device).
keep=()
for spec in "${wanted[@]}"; do
    name=${spec%%==*}
    keep+=(".whl/${name//-/_}-${spec#*==}-")
done
for f in .whl/*.whl; do
    listed=0
    for prefix in "${keep[@]}"; do [[ $f == "$prefix"* ]] && listed=1; done
    if ((!listed)); then rm -v "$f"; fi
done
ls -l .whl
du -ch .whl/*.whl | tail -1
