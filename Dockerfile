# syntax=docker/dockerfile:1
# Two images from one file (docs/deploy.md):
#   docker build --target api    -t opfuse-api .      # API server + migrations; no torch, no CUDA
#   docker build --target worker -t opfuse-worker .   # GPU worker: CUDA runtime, torch, triton
# Both run as the unprivileged user `opfuse` (uid 10001) with `opfuse` (client/cli.py) as entrypoint:
#   api:    opfuse serve --no-worker          (and `python -m service migrate` once per release)
#   worker: opfuse worker --api URL --key-file FILE --gpu N

ARG CUDA_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# -- api: the slim image of the HTTP API (DESIGN.md: the service never imports torch or triton) ----
FROM ${PYTHON_IMAGE} AS api
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    OPFUSE_HOME=/var/lib/opfuse \
    OPFUSE_HOST=0.0.0.0 \
    OPFUSE_PORT=8000
WORKDIR /opt/opfuse
COPY pyproject.toml README.md ./
# The pinned dependencies of pyproject.toml, less the compiler's (torch, triton, onnxruntime, ...).
RUN python - > /tmp/requirements.txt <<'PY'
import tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
compiler_only = {"torch", "triton", "onnxruntime", "onnxscript", "onnx-ir"}
for requirement in project["dependencies"] + project["optional-dependencies"]["service"]:
    if requirement.split("=")[0].split("[")[0].strip() not in compiler_only:
        print(requirement)
PY
RUN pip install -r /tmp/requirements.txt
COPY opfuse ./opfuse
COPY service ./service
COPY migrations ./migrations
COPY client ./client
COPY workers ./workers
RUN pip install --no-deps . \
    && useradd --system --uid 10001 --home-dir /var/lib/opfuse --create-home opfuse
USER opfuse
WORKDIR /var/lib/opfuse
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=3s --start-period=30s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/readyz', timeout=2)"]
ENTRYPOINT ["opfuse"]
CMD ["serve", "--no-worker"]

# -- worker: CUDA runtime, the whole library; one container per GPU --------------------------------
FROM ${CUDA_IMAGE} AS worker
ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH \
    OPFUSE_HOME=/var/lib/opfuse
# A C compiler and Python headers: Triton builds its launcher stubs on first use.
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev build-essential ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv
WORKDIR /opt/opfuse
COPY pyproject.toml README.md ./
COPY opfuse ./opfuse
COPY service ./service
COPY migrations ./migrations
COPY client ./client
COPY workers ./workers
RUN pip install . \
    && useradd --system --uid 10001 --home-dir /var/lib/opfuse --create-home opfuse
USER opfuse
WORKDIR /var/lib/opfuse
ENV TRITON_CACHE_DIR=/var/lib/opfuse/.triton
ENTRYPOINT ["opfuse"]
CMD ["worker"]
