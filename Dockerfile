# One image for every role; the command picks it: `llmgw gateway | engine | telemetry | accounting`.
#
#   docker build -t llmgw .                                   # torch CPU wheel (default)
#   docker build -t llmgw:cuda --build-arg TORCH_VARIANT=cu128 .   # torch CUDA wheel, for GPU engines
#
# TORCH_VARIANT names a wheel index on download.pytorch.org (cpu, cu126, cu128, ...). The torch version is
# the one pyproject.toml pins, read from it at build time, so there is one place to change it.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# --- builder: a venv with the project and its dependencies -------------------------------------------------
FROM ${PYTHON_IMAGE} AS builder
ARG TORCH_VARIANT=cpu
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/${TORCH_VARIANT}
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_PROGRESS_BAR=off
WORKDIR /src
RUN python -m venv /opt/llmgw
COPY pyproject.toml README.md ./
# torch first, from the variant's own index: PyPI's Linux torch wheel is the CUDA build (several GB), and a
# mixed index would let pip pick either. `pip install .` below then finds the pin already satisfied.
RUN TORCH_PIN="$(python -c 'import re, tomllib; deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]; print(next(d for d in deps if re.match(r"torch\b", d)).split(";")[0].strip())')" \
 && /opt/llmgw/bin/pip install --index-url "${TORCH_INDEX_URL}" "${TORCH_PIN}"
COPY proto ./proto
COPY services ./services
RUN /opt/llmgw/bin/pip install . \
 && /opt/llmgw/bin/python -c "import services.common.nats_server as n; print('nats-server:', n.find_binary())"

# --- runtime: the venv on a slim base, run as a non-root user ----------------------------------------------
FROM ${PYTHON_IMAGE} AS runtime
ARG TORCH_VARIANT=cpu
# A compiler at run time: Triton (CUDA images) compiles a small C launcher at first use, and the engine's
# CPU path compiles its fused decode attention once per machine (services/engine/kernels/cpu_attention.py;
# without g++ it falls back to the slower torch path and says so).
RUN apt-get update && apt-get install -y --no-install-recommends gcc g++ libc6-dev && rm -rf /var/lib/apt/lists/* \
 && groupadd --system --gid 10001 llmgw \
 && useradd --system --uid 10001 --gid llmgw --home-dir /var/lib/llmgw --shell /usr/sbin/nologin llmgw \
 && mkdir -p /var/lib/llmgw /models \
 && chown llmgw:llmgw /var/lib/llmgw
COPY --from=builder /opt/llmgw /opt/llmgw
ENV PATH=/opt/llmgw/bin:$PATH \
    LLMGW_DATA_DIR=/var/lib/llmgw \
    HOME=/var/lib/llmgw \
    TRITON_CACHE_DIR=/var/lib/llmgw/triton-cache \
    TORCH_EXTENSIONS_DIR=/var/lib/llmgw/torch-extensions \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
USER llmgw:llmgw
WORKDIR /var/lib/llmgw
EXPOSE 8080 8006
ENTRYPOINT ["llmgw"]
CMD ["--help"]
