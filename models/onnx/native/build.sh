#!/usr/bin/env bash
# Build models/onnx/native/build/librelserve_onnx_ops.so (the com.relserve custom-op kernels).
#
# The onnxruntime wheel ships no C headers. Debian trixie's libonnxruntime-dev carries the API-21 headers
# (ORT 1.21), which the 1.31 runtime accepts (its API is backwards compatible). We download that one .deb
# with a private apt configuration (a trixie source list under build/apt, nothing in /etc is changed) and
# unpack it with dpkg-deb. Needs apt-get, dpkg-deb and a C++17 compiler; no root for the build itself.
# The library does not link libonnxruntime: it gets the API from ORT when registered.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
build="$here/build"
apt_dir="$build/apt"
hdr="$build/headers/usr/include/onnxruntime"
mkdir -p "$build"
if [ ! -f "$hdr/onnxruntime_cxx_api.h" ]; then
  mkdir -p "$apt_dir/lists/partial" "$apt_dir/cache/archives/partial"
  echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian trixie main" \
    > "$apt_dir/trixie.list"
  opts=(-o "Dir::Etc::SourceList=$apt_dir/trixie.list" -o "Dir::Etc::SourceParts=/dev/null"
        -o "Dir::State::Lists=$apt_dir/lists" -o "Dir::Cache=$apt_dir/cache" -o "APT::Get::List-Cleanup=0"
        -o "APT::Sandbox::User=root" -qq)
  apt-get "${opts[@]}" update
  (cd "$apt_dir" && apt-get "${opts[@]}" download libonnxruntime-dev)
  dpkg-deb -x "$apt_dir"/libonnxruntime-dev_*.deb "$build/headers"
fi
${CXX:-g++} -std=c++17 -O3 -march=native -fPIC -shared -fvisibility=hidden \
  -I"$hdr" "$here/relserve_ops.cc" -o "$build/librelserve_onnx_ops.so.tmp"
mv "$build/librelserve_onnx_ops.so.tmp" "$build/librelserve_onnx_ops.so"
echo "built $build/librelserve_onnx_ops.so"
