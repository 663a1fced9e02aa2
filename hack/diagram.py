"""Draw docs/architecture.svg: the request path and the control loop, in one picture.

Run: `.venv/bin/python hack/diagram.py` (or `make diagram`). Matplotlib only, so the picture is reproducible.
"""
from __future__ import annotations

import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch  # noqa: E402

BOXES = {
    # name: (x, y, w, h, label, colour)
    "client": (0.2, 6.2, 2.0, 0.9, "clients\n(OpenAI API, SSE)", "#e8eef7"),
    "api": (3.0, 6.2, 2.6, 0.9, "FastAPI routes\n/v1/*  /metrics", "#dbe9d8"),
    "engine": (6.4, 6.2, 3.2, 0.9, "Engine step loop\nscheduler → runner → sampler", "#dbe9d8"),
    "kv": (10.3, 6.2, 2.4, 0.9, "paged KV cache\n(ref counts, prefix hash)", "#dbe9d8"),
    "watcher": (6.4, 4.6, 3.2, 0.9, "config watcher\n(..data swap) → reconfigure()", "#dbe9d8"),
    "prom": (3.0, 3.0, 2.6, 0.9, "Prometheus\nTBT p99, tok/s, step time", "#f6e7c8"),
    "source": (3.0, 1.4, 2.6, 0.9, "MetricsSource\n(PromQL) → Observation", "#f3d9d9"),
    "controller": (6.4, 1.4, 3.2, 0.9, "Controller.decide()\nmodel fit / ×0.9·×1.1", "#f3d9d9"),
    "configmap": (10.3, 3.0, 2.4, 0.9, "ConfigMap\nserver.yaml (generation)", "#e8e0f2"),
    "status": (10.3, 1.4, 2.4, 0.9, "InferenceService\nstatus, Events", "#e8e0f2"),
}
ARROWS = [
    ("client", "api", "request"), ("api", "engine", "add_request"), ("engine", "kv", "blocks"),
    ("engine", "api", ""), ("api", "prom", "scrape /metrics"), ("prom", "source", "query"),
    ("source", "controller", "observation"), ("controller", "configmap", "chunk, policy"),
    ("controller", "status", "decision"), ("configmap", "watcher", "kubelet sync"), ("watcher", "engine", "step boundary"),
]


def _centre(name: str) -> tuple[float, float]:
    x, y, w, h, _, _ = BOXES[name]
    return x + w / 2, y + h / 2


def draw(path: Path) -> None:
    fig, ax = plt.subplots(figsize=(13, 7.6))
    ax.set_xlim(0, 13)
    ax.set_ylim(0.7, 7.6)
    ax.axis("off")
    ax.text(0.2, 7.35, "Request path (every pod)", fontsize=12, weight="bold")
    ax.text(0.2, 0.95, "Control loop (operator, one timer per InferenceService)", fontsize=12, weight="bold")
    patches = {}
    for name, (x, y, w, h, label, colour) in BOXES.items():
        patches[name] = ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.05", fc=colour, ec="#444"))
        ax.text(x + w / 2, y + h / 2, label, ha="center", va="center", fontsize=9)
    for src, dst, label in ARROWS:
        (x0, y0), (x1, y1) = _centre(src), _centre(dst)
        rad = 0.25 if (src, dst) == ("engine", "api") else 0.0
        ax.add_patch(FancyArrowPatch((x0, y0), (x1, y1), arrowstyle="-|>", mutation_scale=14, color="#333",
                                     patchA=patches[src], patchB=patches[dst], shrinkA=2, shrinkB=2, connectionstyle=f"arc3,rad={rad}"))
        if label:
            horizontal = abs(y1 - y0) < 0.01
            ax.text((x0 + x1) / 2 + (0 if horizontal else 0.08), (y0 + y1) / 2 + (0.5 if horizontal else 0.1), label,
                    fontsize=8, ha="center" if horizontal else "left", color="#333")
    ax.text(7.9, 7.25, "token events → SSE", fontsize=8, ha="center", color="#333")
    fig.savefig(path, format=path.suffix.lstrip("."), bbox_inches="tight")
    plt.close(fig)


if __name__ == "__main__":
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parent.parent / "docs" / "architecture.svg"
    draw(out)
    print(out)
