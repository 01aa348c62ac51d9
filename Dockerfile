# hail-guard in a container: every command (`serve` on stdio by default), the ledger on a volume at /data.
#   docker build -t hail-guard .
#   docker run -i --rm -v hail-guard:/data -e HAIL_API_KEY -e HAIL_GUARD_UPSTREAM_URL=https://mcp.hail.so hail-guard
#   docker run --rm -v hail-guard:/data hail-guard status      # or drill, ops list, ...
# Dependencies come from requirements.lock, every file checked against its hash. BASE may name the base by
# digest (docs/how-to/docker.md). A CA bundle for pip, if one is needed to reach PyPI, is mounted for the install
# only, never kept in the image: --secret id=ca_certificates,src=/etc/ssl/certs/ca-certificates.crt
ARG BASE=python:3.11-slim

FROM ${BASE} AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 PIP_ROOT_USER_ACTION=ignore
WORKDIR /src
COPY requirements.lock ./
RUN --mount=type=secret,id=ca_certificates \
    if [ -s /run/secrets/ca_certificates ]; then export PIP_CERT=/run/secrets/ca_certificates; fi \
 && python -m venv /opt/hail-guard \
 && /opt/hail-guard/bin/pip install --require-hashes --requirement requirements.lock
COPY pyproject.toml README.md ./
COPY hail_guard ./hail_guard
RUN /opt/hail-guard/bin/pip install --no-index --no-deps --no-build-isolation . \
 && /opt/hail-guard/bin/pip check

FROM ${BASE}
RUN groupadd --gid 10001 hailguard \
 && useradd --create-home --uid 10001 --gid 10001 hailguard \
 && mkdir /data && chown hailguard:hailguard /data
COPY --from=build /opt/hail-guard /opt/hail-guard
ENV PATH=/opt/hail-guard/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    HAIL_GUARD_LEDGER_URL=sqlite:////data/ledger.db \
    HAIL_GUARD_UPSTREAM_SIGNIN_DIR=/data/signin
USER hailguard
VOLUME ["/data"]
ENTRYPOINT ["hail-guard"]
CMD ["serve"]
