#!/usr/bin/env bash
# Install everything stepd needs to build and test on Debian 12 (run as root or with sudo).
# Idempotent. Python test tools go into .venv/ (pip), never into the system Python.
set -euo pipefail
cd "$(dirname "$0")/../.."

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive

pkgs=(
  build-essential meson ninja-build pkg-config git ca-certificates
  clang libclang-rt-14-dev
  libjansson-dev libuv1-dev libgrpc-dev libprotobuf-c-dev protobuf-c-compiler
  libucx-dev ucx-utils libpcre2-dev
  python3 python3-venv python3-pip
  libicu-dev iproute2 procps openssl systemd nghttp2-client bible-kjv-text bible-kjv util-linux
  libmicrohttpd-dev libgnutls28-dev curl libcurl4-openssl-dev
  libpython3.11
  libpng-dev libjpeg62-turbo-dev libwebp-dev libgif-dev python3-pil python3-numpy
)
# the deploy tests render the Kubernetes manifests with kubectl's kustomize: Debian's
# kubernetes-client, unless a kubectl with kustomize is there already (a packaged kubectl of
# another origin owns /usr/bin/kubectl, and the two would conflict)
if ! { command -v kubectl >/dev/null && kubectl kustomize --help >/dev/null 2>&1; }; then
  pkgs+=(kubernetes-client)
fi
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ "${#missing[@]}" -gt 0 ]; then
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# Python test tools (independent gRPC client for integration tests, template checks).
if [ ! -x .venv/bin/python ]; then
  /usr/bin/python3 -m venv .venv
fi
if ! .venv/bin/python -c 'import grpc, grpc_tools, jinja2, tokenizers, yaml, numpy, kubernetes_validate, openai, httpx, distro' 2>/dev/null; then
  # kubernetes-validate: the Kubernetes JSON schemas, offline (deploy lint); openai: the OpenAI
  # client the HTTP API is tested with; httpx (< 0.28: anthropic 0.34.2 passes proxies=) and
  # distro: what the anthropic client (below, --no-deps) needs besides openai's dependencies
  .venv/bin/pip install -q --disable-pip-version-check grpcio grpcio-tools grpcio-health-checking \
    jinja2 tokenizers pyyaml numpy kubernetes-validate openai 'httpx<0.28' distro
fi
# a real byte-level BPE tokenizer.json shipped by a PyPI package (tokenizer equality test)
if ! .venv/bin/python -c 'import importlib.util as u; assert u.find_spec("anthropic")' 2>/dev/null; then
  .venv/bin/pip install -q --disable-pip-version-check --no-deps anthropic==0.34.2
fi
# structured output: llguidance's wheel ships the grammar engine's C API (common/grammar.c opens
# .venv/lib/python3*/site-packages/llguidance/_lib.abi3.so; its Python symbols are bound from
# libpython3.11, above); jsonschema validates the constrained replies in the tests
if ! .venv/bin/python -c 'import llguidance, jsonschema' 2>/dev/null; then
  .venv/bin/pip install -q --disable-pip-version-check llguidance jsonschema
fi
