#!/usr/bin/env bash
# Build (once) and install Horovod 0.28.1 against the venv's torch.
# A plain `pip install horovod` fails with CMake 4 and torch >= 2.1 (see ../shared/FACTS.md);
# this applies the known-good recipe and keeps the built wheel in a cache so the next
# install takes seconds.  Gloo on CPU; NCCL too when torch sees CUDA and the nvidia-nccl pip
# package is installed (then the wheel is cached under a separate key).
set -euo pipefail
PY="${PYTHON:-.venv/bin/python}"
CACHE="${HOROVOD_WHEEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/det_tasks/wheels}"
VERSION=0.28.1
TORCH_TAG="$("$PY" -c 'import torch; print(torch.__version__.replace("+", "_"))')"

# NCCL when torch sees CUDA and the nvidia-nccl pip package (nvidia/nccl/{include,lib}) is
# installed: the recipe FACTS.md records for the H100 machine (CUDA 13, NCCL 2.28).
NCCL_ROOT="$("$PY" - <<'PY' 2>/dev/null || true
import importlib.util, os, torch
if torch.cuda.is_available() and torch.version.cuda:
    spec = importlib.util.find_spec("nvidia.nccl")
    for root in (spec.submodule_search_locations or []) if spec else []:
        if os.path.isfile(os.path.join(root, "include", "nccl.h")):
            print(root)
            break
PY
)"
if [ -n "$NCCL_ROOT" ]; then
  BUILD=nccl
  CC_LIST="$("$PY" -c 'import torch; print(",".join(sorted({f"{a}{b}" for a, b in (torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count()))})))')"
else
  BUILD=gloo
fi
# The cache key tells the builds apart: a Gloo-only wheel is never reused where NCCL is
# wanted (the Gloo key is the one earlier versions of this script used).
WHEEL_DIR="$CACHE/horovod-$VERSION-torch-$TORCH_TAG"
if [ "$BUILD" = nccl ]; then WHEEL_DIR="$WHEEL_DIR-nccl"; fi

if "$PY" -c "import horovod.torch as h; assert '$BUILD' == 'gloo' or h.nccl_built()" 2>/dev/null
then
  echo "horovod already installed ($BUILD)"; exit 0
fi
if ! ls "$WHEEL_DIR"/horovod-*.whl >/dev/null 2>&1; then
  mkdir -p "$WHEEL_DIR"
  WRAP="$(mktemp -d)"
  trap 'rm -rf "$WRAP"' EXIT
  REAL_CXX="$(command -v g++)"
  cat > "$WRAP/g++" <<WRAPPER
#!/usr/bin/env bash
args=()
for a in "\$@"; do
  case "\$a" in
    -std=c++11|-std=c++14|-std=gnu++14|-std=gnu++11) args+=("-std=c++17") ;;
    *) args+=("\$a") ;;
  esac
done
exec "$REAL_CXX" "\${args[@]}"
WRAPPER
  chmod +x "$WRAP/g++"
  "$PY" -m pip install --quiet cmake cffi pycparser packaging wheel
  GPU_ENV=()
  if [ "$BUILD" = nccl ]; then
    # Horovod links -lnccl: give it a directory with an unversioned libnccl.so.
    mkdir -p "$WRAP/nccl-lib"
    ln -sf "$NCCL_ROOT/lib/libnccl.so.2" "$WRAP/nccl-lib/libnccl.so"
    GPU_ENV=(HOROVOD_GPU_OPERATIONS=NCCL HOROVOD_NCCL_INCLUDE="$NCCL_ROOT/include"
      HOROVOD_NCCL_LIB="$WRAP/nccl-lib" HOROVOD_NCCL_LINK=SHARED
      HOROVOD_BUILD_CUDA_CC_LIST="${CC_LIST:-90}"
      # CUDA 13's headers no longer pull these in for Horovod's sources.
      CXXFLAGS="${CXXFLAGS:-} -include string -include stdexcept")
  fi
  echo "building horovod $VERSION ($BUILD; about 12 minutes on 2 cores, 2 on 16)..."
  env CMAKE_POLICY_VERSION_MINIMUM=3.5 CXX="$WRAP/g++" \
    HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 \
    HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 HOROVOD_CPU_OPERATIONS=gloo \
    "${GPU_ENV[@]}" MAKEFLAGS="-j$(nproc)" \
    "$PY" -m pip wheel --no-build-isolation --no-deps --no-cache-dir \
      -w "$WHEEL_DIR.partial" "horovod==$VERSION"
  mv "$WHEEL_DIR.partial"/horovod-*.whl "$WHEEL_DIR"/ && rm -rf "$WHEEL_DIR.partial"
fi
"$PY" -m pip install --quiet --no-deps "$WHEEL_DIR"/horovod-*.whl
"$PY" -m pip install --quiet cloudpickle psutil pyyaml
"$(dirname "$PY")/horovodrun" --check-build
