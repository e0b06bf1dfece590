# One image for every service; the command picks the role (llmgw gateway | engine | telemetry | accounting).
FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY proto ./proto
COPY services ./services
RUN python -m venv /opt/llmgw && /opt/llmgw/bin/pip install --no-cache-dir .

FROM python:3.11-slim
COPY --from=build /opt/llmgw /opt/llmgw
RUN useradd --system --uid 10001 --home /var/lib/llmgw llmgw && mkdir -p /var/lib/llmgw && chown llmgw /var/lib/llmgw
USER llmgw
ENV PATH=/opt/llmgw/bin:$PATH LLMGW_DATA_DIR=/var/lib/llmgw PYTHONUNBUFFERED=1
WORKDIR /var/lib/llmgw
ENTRYPOINT ["llmgw"]
