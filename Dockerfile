# pdserve image: the same CLI with a CPU torch; by default it launches configs/disagg.yaml.
#   docker build -t pdserve .
#   docker run --rm -p 8000:8000 pdserve
#   curl -s http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \
#        -d '{"model": "builtin:tiny-story", "prompt": "Hello", "max_tokens": 16}'
# Inside the container the router listens on 0.0.0.0: PDSERVE_HOSTNAME replaces the config's
# top-level `hostname` (only the router's address; the servers stay on the container's loopback).
# Another deployment: docker run ... pdserve pdserve launch configs/disagg_2x2.yaml
FROM python:3.11-slim

# Build-time only. scripts/install.sh (the README's install: serving only, no test extra) pins torch to TORCH_VERSION; the
# extra index makes pip pick the CPU wheel (2.x.y+cpu) instead of the multi-GB CUDA one.
ARG TORCH_VERSION=2.13.0
ARG PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG PIP_NO_CACHE_DIR=1
ARG PIP_DISABLE_PIP_VERSION_CHECK=1

RUN useradd --create-home --uid 10001 --shell /usr/sbin/nologin pdserve
WORKDIR /app
COPY . /app
RUN bash scripts/install.sh /opt/venv

ENV PATH=/opt/venv/bin:$PATH \
    PDSERVE_HOSTNAME=0.0.0.0 \
    PYTHONUNBUFFERED=1 \
    HF_HUB_OFFLINE=1
# built-in models are generated on first use under ~/.cache/pdserve of this user
USER pdserve
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=3s --start-period=300s \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=2)"]
CMD ["pdserve", "launch", "configs/disagg.yaml"]
