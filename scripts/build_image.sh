#!/usr/bin/env bash
# Build the CPU image (docker/Dockerfile.cpu), here or anywhere Docker runs:
#   scripts/build_image.sh [--tag mmserve-cpu] [--base IMAGE]
# The base: --base, else python:3.11-slim-bookworm when it is present or a registry gives it, else
# mmserve-base:bookworm-<hash>, made once from Debian's packages (debootstrap; root) where no registry answers.
# Where pip reaches its packages through this machine's own settings (a find-links folder, local
# indexes, a CA bundle: `pip config list`), they are served to the build on 127.0.0.1 for the build
# stage only (the build runs with --network host); nothing of them lands in the image. A second build
# reuses the layer cache (the build stage is kept as mmserve-cpu-build). Prints the build's time and the image's size.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"

tag=mmserve-cpu base=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --tag) tag=$2; shift 2 ;;
    --base) base=$2; shift 2 ;;
    -h|--help) sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "unknown argument: $1 (see --help)" >&2; exit 2 ;;
  esac
done
command -v docker > /dev/null || { echo "build_image.sh: no docker client" >&2; exit 1; }
docker info > /dev/null 2>&1 || { echo "build_image.sh: no Docker engine answers (DOCKER_HOST=${DOCKER_HOST:-default})" >&2; exit 1; }

OFFICIAL=python:3.11-slim-bookworm
# What the Debian-built base holds: Python 3.11 with venv, its shared library (tritonserver's Python-backend
# stub loads it) and its headers (torch's inductor compiles C++ against them even under enforce_eager),
# CA certificates, and the Dockerfile's run-time packages. Its tag names the list: a new list, a new base.
DEBIAN_PACKAGES=python3.11,libpython3.11,python3.11-dev,python3.11-venv,python3-pip-whl,python3-setuptools-whl,python3-distutils,ca-certificates,libnuma1,libexpat1,zlib1g,libstdc++6,g++,curl
DEBIAN_BASE=mmserve-base:bookworm-$(echo "$DEBIAN_PACKAGES" | sha256sum | cut -c1-8)
if [[ -z $base ]]; then
  if docker image inspect "$OFFICIAL" > /dev/null 2>&1 || timeout 60 docker pull -q "$OFFICIAL" > /dev/null 2>&1; then
    base=$OFFICIAL
  else
    base=$DEBIAN_BASE
    if ! docker image inspect "$base" > /dev/null 2>&1; then
      command -v debootstrap > /dev/null || { echo "build_image.sh: no registry answers and no debootstrap (apt-get install debootstrap)" >&2; exit 1; }
      rootfs=$(mktemp -d)
      trap 'rm -rf "$rootfs"' EXIT
      echo "[build_image] no registry: making $base from Debian's packages (debootstrap, ~1 min)"
      debootstrap --variant=minbase --include="$DEBIAN_PACKAGES" bookworm "$rootfs" http://deb.debian.org/debian > "$rootfs.log" 2>&1 \
        || { tail -20 "$rootfs.log" >&2; exit 1; }
      tar -C "$rootfs" -c . | docker import -c 'CMD ["bash"]' - "$base" > /dev/null
      rm -rf "$rootfs" "$rootfs.log"
      trap - EXIT
    fi
  fi
fi

# This machine's pip settings, served to the build stage (never baked in).
build_args=()
served=$(mktemp -d)
server_pid=""
cleanup() { [[ -n $server_pid ]] && kill "$server_pid" 2> /dev/null; rm -rf "$served"; }
trap cleanup EXIT
setting() { # pip's value for $1 (environment first, then pip config), empty when unset
  local env_name="PIP_$(echo "$1" | tr '[:lower:]-' '[:upper:]_')"
  if [[ -n ${!env_name:-} ]]; then echo "${!env_name}"; return; fi
  python3 -m pip config get "global.$1" 2> /dev/null || true
}
# One port from build to build: the URLs are build arguments, and a changed one rebuilds the environment.
port=47011
if ! python3 -c 'import socket, sys; socket.socket().bind(("127.0.0.1", int(sys.argv[1])))' "$port" 2> /dev/null; then
  port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
fi
url="http://127.0.0.1:$port"
links=() indexes=()
for folder in $(setting find-links); do
  [[ -d $folder ]] && ln -s "$folder" "$served/links${#links[@]}" && links+=("$url/links${#links[@]}/")
done
for index in $(setting extra-index-url); do
  if [[ $index == file://* && -d ${index#file://} ]]; then
    # an index's pages link to its files by relative paths: serve the folder above "simple" whole
    ln -s "$(dirname "${index#file://}")" "$served/index${#indexes[@]}"
    indexes+=("$url/index${#indexes[@]}/$(basename "${index#file://}")/")
  elif [[ $index != file://* ]]; then
    indexes+=("$index")
  fi
done
cert=$(setting cert)
[[ -n $cert && -f $cert ]] && ln -s "$cert" "$served/ca.crt" && build_args+=(--build-arg "PIP_CERT_URL=$url/ca.crt")
if ((${#links[@]})); then build_args+=(--build-arg "PIP_FIND_LINKS=${links[*]}"); fi
if ((${#indexes[@]})); then build_args+=(--build-arg "PIP_EXTRA_INDEX_URL=${indexes[*]}"); fi
if ((${#build_args[@]})); then
  python3 -m http.server --bind 127.0.0.1 --directory "$served" "$port" > /dev/null 2>&1 &
  server_pid=$!
  for _ in $(seq 50); do curl -fs -o /dev/null "$url/" && break; sleep 0.1; done
  echo "[build_image] this machine's pip settings served to the build stage on $url"
fi

echo "[build_image] building $tag from $base${build_args[*]:+ (${build_args[*]})}"
started=$(date +%s)
# The build stage gets a tag of its own (mmserve-cpu-build): the layer cache of the environment outlives
# the prune below, which removes the project's dangling images (earlier builds' leftovers, GiBs each).
for target in build final; do
  if [[ $target == build ]]; then out=(--target build -t mmserve-cpu-build); else out=(-t "$tag"); fi
  docker build --network host -f docker/Dockerfile.cpu --build-arg "BASE_IMAGE=$base" "${build_args[@]}" "${out[@]}" .
done
took=$(($(date +%s) - started))
docker image prune -f --filter label=dev.mmserve.project=mmserve > /dev/null
size=$(docker image inspect -f '{{.Size}}' "$tag")
echo "[build_image] $tag built in ${took} s; $((size / 1024 / 1024)) MiB"
