#!/usr/bin/env bash
# The wheel folder launch/gpu_check.py puts on its path (no pip on the GPU machine): what the
# trainer imports beyond torch and transformers, and vLLM 0.33's packed-tensor format.
#
#   launch/wheelhouse.sh DIR [PYTHON_VERSION]     (default: this python's, e.g. 3.12)
#
# Run it where PyPI is reachable (the GPU machine may be offline), for the GPU machine's Python
# (3.11 or 3.12: megatron-core ships compiled dataset helpers per version), then copy DIR beside
# the repository and run `python launch/gpu_check.py --wheels DIR` there. ~12 MB.
# vllm's packed_tensor.py (it imports torch only) comes from GitHub's v0.33.0 tag, checked against
# the 0.33.0 wheel's own file (sha256 below); unreachable or different, from the wheel itself
# (pip download, ~340 MB, deleted after). Environment: GSPO_PYTHON (python3), the pip it runs.
set -euo pipefail
dir=${1:?usage: launch/wheelhouse.sh DIR [PYTHON_VERSION]}
py=${GSPO_PYTHON:-python3}
version=${2:-$("$py" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')}
case $version in
    3.11 | 3.12) ;;
    *)
        echo "error: PYTHON_VERSION $version: launch/gpu_check.py runs on Python 3.11 or 3.12" >&2
        exit 2
        ;;
esac
# What the bare machine lacks (tests/test_gpu_check.py runs the check with torch and
# transformers' own dependencies alone, plus these): the versions of the project's .venv.
wheels=(megatron-core==0.16.1 tensorboard==2.20.0 protobuf==7.36.2 absl-py==2.5.1 psutil==7.2.2
        aiohttp==3.14.5 aiohappyeyeballs==2.7.1 aiosignal==1.4.0 attrs==26.1.0 frozenlist==1.8.0
        multidict==7.2.1 propcache==0.5.4 yarl==1.25.1)
packed=vllm/distributed/weight_transfer/packed_tensor.py
packed_sha256=0a3e3c13261f6653cc43b01afc2e3a4f4865c75497755b0f1e2798f2d981c326
mkdir -p "$dir"
"$py" -m pip download --quiet --no-deps --only-binary=:all: --python-version "$version" \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform any --dest "$dir" "${wheels[@]}"

sha_ok() { [[ -f $1 ]] && [[ $(sha256sum "$1" | cut -d' ' -f1) == "$packed_sha256" ]]; }
target=$dir/packed_tensor.py
curl -sfL --max-time 60 -o "$target.part" "https://raw.githubusercontent.com/vllm-project/vllm/v0.33.0/$packed" || true
if sha_ok "$target.part"; then
    mv "$target.part" "$target"
else
    rm -f "$target.part"
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' EXIT
    "$py" -m pip download --quiet --no-deps --only-binary=:all: --platform manylinux_2_28_x86_64 \
        --python-version "$version" --dest "$tmp" vllm==0.33.0
    "$py" -c 'import sys, zipfile; open(sys.argv[3], "wb").write(zipfile.ZipFile(sys.argv[1]).read(sys.argv[2]))' \
        "$(ls "$tmp"/vllm-0.33.0-*.whl)" "$packed" "$target"
    if ! sha_ok "$target"; then
        echo "error: $target: not vLLM 0.33.0's $packed (sha256 differs)" >&2
        exit 1
    fi
fi
echo "wheel folder for Python $version: $dir ($(du -sh "$dir" | cut -f1)); next: python launch/gpu_check.py --wheels $dir"
