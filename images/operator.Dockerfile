# Metronome operator image: slim Python with kopf and the Kubernetes client; no torch (the operator imports only
# metronome.operator and the pydantic config schema).
#
#   docker build -f images/operator.Dockerfile -t ghcr.io/metronome-dev/metronome-operator:0.1.0 .
FROM python:3.12-slim AS builder
ENV PIP_NO_CACHE_DIR=1
RUN python -m venv /opt/metronome
ENV PATH=/opt/metronome/bin:$PATH
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY metronome ./metronome
COPY server ./server
COPY kernels ./kernels
COPY operator ./operator
# The [operator] extra only: the server's heavy extras (torch, triton, transformers) stay out.
RUN pip install --upgrade pip setuptools wheel && pip install '.[operator]'

FROM python:3.12-slim
COPY --from=builder /opt/metronome /opt/metronome
RUN useradd --uid 1000 --user-group --home-dir /tmp --no-create-home metronome
ENV PATH=/opt/metronome/bin:$PATH HOME=/tmp PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
USER 1000:1000
EXPOSE 8080
ENTRYPOINT ["metronome"]
CMD ["operator", "--all-namespaces", "--standalone"]
