"""Container images for Metronome, built with podman (`make images`, i.e. hack/build_images.py; tests/integration).

pins.py     exact versions for an image, read from the venv the tests run in
context.py  the build context an image sees (Dockerfile, pins, sources) and its content hash = the image tag
base.py     the base image: the public default when it can be pulled, else one made here from Debian packages
podman.py   podman with the project's containers.conf, and the packages it needs
build.py    build (or reuse) an image; hack/build_images.py is the command line
"""
