# hail-guard in a container: the MCP proxy on stdio by default, the ledger on a volume at /data.
#   docker build -t hail-guard .
#   docker run -i --rm -v hail-guard:/data -e HAIL_API_KEY -e HAIL_GUARD_UPSTREAM_URL=https://mcp.hail.so hail-guard

FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY hail_guard ./hail_guard
RUN python -m venv /opt/hail-guard \
 && /opt/hail-guard/bin/pip install --no-cache-dir --upgrade pip \
 && /opt/hail-guard/bin/pip install --no-cache-dir ".[postgres]"

FROM python:3.11-slim
RUN useradd --create-home --uid 10001 hailguard \
 && mkdir /data && chown hailguard:hailguard /data
COPY --from=build /opt/hail-guard /opt/hail-guard
ENV PATH=/opt/hail-guard/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    HAIL_GUARD_LEDGER_URL=sqlite:////data/ledger.db \
    HAIL_GUARD_UPSTREAM_SIGNIN_DIR=/data/signin
USER hailguard
VOLUME ["/data"]
ENTRYPOINT ["hail-guard", "serve"]
