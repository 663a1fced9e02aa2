# Metronome operator image: kopf and the Kubernetes client, no torch (the operator imports only
# metronome.operator and metronome.contract).
#
# Built by `make images` (hack/build_images.py): it stages the context this file expects (pins.txt with the venv's exact
# versions, src/ with the sources), picks BASE_IMAGE (Debian's public slim image, or one made from Debian
# packages where no registry is reachable) and tags the image by a hash of its inputs. Runs as UID 1000; needs
# no writable path.
ARG BASE_IMAGE=docker.io/library/debian:bookworm-slim
FROM ${BASE_IMAGE}

# Build time only: pip installs the pinned wheels from the wheel cache make images mounts at /tmp/wheels, without
# an index (pass --build-arg PIP_NO_INDEX=0 to let a build without that mount download them).
ARG PIP_NO_INDEX=1 PIP_FIND_LINKS=/tmp/wheels PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
ARG DEBIAN_FRONTEND=noninteractive
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
 && apt-get clean && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/metronome
ENV PATH=/opt/metronome/bin:$PATH

COPY pins.txt /opt/metronome/
RUN pip install --no-deps --requirement /opt/metronome/pins.txt && pip check

COPY src /tmp/metronome-src
RUN pip install --no-deps --no-build-isolation /tmp/metronome-src \
 && rm -rf /tmp/metronome-src \
 && useradd --uid 1000 --user-group --home-dir /tmp --no-create-home --shell /usr/sbin/nologin metronome \
 && metronome operator --help >/dev/null

ENV HOME=/tmp PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
USER 1000:1000
WORKDIR /tmp
EXPOSE 8080
ENTRYPOINT ["metronome"]
# No --standalone: inside a pod the operator elects a leader by default, so extra replicas stand by.
CMD ["operator", "--all-namespaces"]
