"""`python hack/build_images.py [server] [operator] [--base-image REF] [--quiet]` (what `make images` runs): the
server and operator images with podman, through metronome_testing.images (the code path the image tests take)."""
from __future__ import annotations

import argparse
import sys

from metronome_testing.images.build import IMAGES, build_images


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hack/build_images.py", description="build Metronome's images with podman")
    parser.add_argument("images", nargs="*", metavar="IMAGE", help=f"{' | '.join(IMAGES)} (default: all)")
    parser.add_argument("--base-image", metavar="REF",
                        help="BASE_IMAGE for both Dockerfiles (default: Debian's slim image, else a local one)")
    parser.add_argument("--quiet", action="store_true", help="do not echo podman's build output")
    args = parser.parse_args(argv)
    try:
        built = build_images(args.images or list(IMAGES), args.base_image, echo=not args.quiet)
    except (RuntimeError, ValueError) as error:  # PodmanError, PinError, a failed download: say it, no traceback
        print(f"images: {error}", file=sys.stderr)
        return 1
    for image in built:
        how = f"built in {image.seconds:.0f} s" if image.built else "up to date"
        print(f"{image.ref}  {image.size_bytes / 1e9:.2f} GB  {how}  (base {image.base})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
