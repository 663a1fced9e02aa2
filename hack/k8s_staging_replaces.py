"""Prints the replace block that lets an outside module build k8s.io/kubernetes commands.

k8s.io/kubernetes requires its staging modules (k8s.io/api, k8s.io/apiserver, ...) at v0.0.0 and replaces them
with ./staging/src/...; a dependency's replace lines are ignored, so an outside module must replace each one
with its published v0.<minor>.<patch>. The set changes between minors, so it is read from the tag's own go.mod.

usage: python3 k8s_staging_replaces.py <path to k8s.io/kubernetes go.mod> <vX.Y.Z>
"""

import re
import sys

STAGING_LINE = re.compile(r"^\s*(k8s\.io/[A-Za-z0-9._/-]+)\s+=>\s+\./staging/src/\S+\s*$")
K8S_TAG = re.compile(r"^v1\.(\d+)\.(\d+)$")


def staging_modules(go_mod_text: str) -> list[str]:
    return [m.group(1) for line in go_mod_text.splitlines() if (m := STAGING_LINE.match(line))]


def published_version(k8s_tag: str) -> str:
    match = K8S_TAG.match(k8s_tag)
    if not match:
        raise ValueError(f"not a Kubernetes release tag: {k8s_tag!r} (expected v1.Y.Z)")
    return f"v0.{match.group(1)}.{match.group(2)}"


def replace_block(go_mod_text: str, k8s_tag: str) -> str:
    modules = staging_modules(go_mod_text)
    if not modules:
        raise ValueError("no './staging/src/' replace lines found in the given go.mod")
    version = published_version(k8s_tag)
    lines = [f"\t{module} => {module} {version}" for module in modules]
    return "\nreplace (\n" + "\n".join(lines) + "\n)\n"


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    try:
        with open(argv[1], encoding="utf-8") as handle:
            sys.stdout.write(replace_block(handle.read(), argv[2]))
    except (OSError, ValueError) as error:
        print(f"k8s_staging_replaces: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
