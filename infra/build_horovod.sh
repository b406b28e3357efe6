#!/usr/bin/env bash
# Build (once) and install Horovod 0.28.1 against the venv's torch.
# A plain `pip install horovod` fails with CMake 4 and torch >= 2.1 (see ../shared/FACTS.md);
# this applies the known-good recipe and keeps the built wheel in a cache so the next
# install takes seconds.  Gloo on CPU; NCCL too when CUDA and nvidia-nccl are present.
set -euo pipefail
PY="${PYTHON:-.venv/bin/python}"
CACHE="${HOROVOD_WHEEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/det_tasks/wheels}"
VERSION=0.28.1
TORCH_TAG="$("$PY" -c 'import torch; print(torch.__version__.replace("+", "_"))')"
WHEEL_DIR="$CACHE/horovod-$VERSION-torch-$TORCH_TAG"

if "$PY" -c 'import horovod.torch' 2>/dev/null; then
  echo "horovod already installed"; exit 0
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
  echo "building horovod $VERSION (about 12 minutes on 2 cores)..."
  env CMAKE_POLICY_VERSION_MINIMUM=3.5 CXX="$WRAP/g++" \
    HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 \
    HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 HOROVOD_CPU_OPERATIONS=gloo \
    MAKEFLAGS="-j$(nproc)" \
    "$PY" -m pip wheel --no-build-isolation --no-deps --no-cache-dir \
      -w "$WHEEL_DIR.partial" "horovod==$VERSION"
  mv "$WHEEL_DIR.partial"/horovod-*.whl "$WHEEL_DIR"/ && rm -rf "$WHEEL_DIR.partial"
fi
"$PY" -m pip install --quiet --no-deps "$WHEEL_DIR"/horovod-*.whl
"$PY" -m pip install --quiet cloudpickle psutil pyyaml
"$(dirname "$PY")/horovodrun" --check-build
