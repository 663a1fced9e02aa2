"""Draw docs/architecture.svg: the request path, the control loop and the contract between them, each box named
by the module that implements it (a test of the picture: every path in PATHS exists).

Run: `.venv/bin/python hack/diagram.py [out.svg]` (or `make diagram`). Matplotlib only, so the picture is
reproducible.
"""
from __future__ import annotations

import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
matplotlib.rcParams["svg.hashsalt"] = "metronome"  # stable ids: a redraw of the same picture is the same file
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SERVER, OPERATOR, SHARED, OUTSIDE = "#dbe9d8", "#f3d9d9", "#fff3c4", "#e8eef7"

# name: (x, y, w, h, title, repository path, colour)
BOXES = {
    "client": (0.2, 7.0, 2.2, 1.0, "clients", "OpenAI API, SSE", OUTSIDE),
    "api": (3.0, 7.0, 2.8, 1.0, "FastAPI routes", "server/api/app.py", SERVER),
    "engine": (6.4, 7.0, 3.2, 1.0, "engine step loop", "server/engine/engine.py", SERVER),
    "kv": (10.2, 7.0, 2.8, 1.0, "paged KV cache", "server/engine/block_manager.py", SERVER),
    "kernels": (10.2, 5.6, 2.8, 1.0, "attention kernels", "kernels/", SERVER),
    "watcher": (6.4, 5.6, 3.2, 1.0, "config watcher → reconfigure()", "server/api/config_watch.py", SERVER),
    "contract": (3.0, 5.6, 2.8, 1.0, "the contract: config schema,\nmetric names, errors, model sources",
                 "metronome/contract/", SHARED),
    "prom": (0.2, 5.6, 2.2, 1.0, "Prometheus", "TBT p99, tok/s, step time", OUTSIDE),
    "source": (3.0, 2.4, 2.8, 1.0, "PromQL → Observation", "operator/metrics_source.py", OPERATOR),
    "loop": (6.4, 2.4, 3.2, 1.0, "control loop tick", "operator/control_loop.py", OPERATOR),
    "controller": (6.4, 0.9, 3.2, 1.0, "tune(): decide → next server.yaml", "operator/tuning/", OPERATOR),
    "configmap": (10.2, 4.0, 2.8, 1.0, "ConfigMap server.yaml", "operator/configmap.py", OPERATOR),
    "status": (10.2, 2.4, 2.8, 1.0, "InferenceService status, Events", "operator/status.py", OPERATOR),
    "handlers": (10.2, 0.9, 2.8, 1.0, "kopf handlers (thin)", "operator/handlers.py", OPERATOR),
}
PATHS = [box[5] for box in BOXES.values() if box[6] in (SERVER, OPERATOR, SHARED)]
ARROWS = [  # (from, to, label, dashed)
    ("client", "api", "request", False), ("api", "engine", "add_request", False), ("engine", "kv", "blocks", False),
    ("engine", "kernels", "forward", False), ("api", "prom", "scrape /metrics", False),
    ("prom", "source", "query", False), ("source", "loop", "observation", False),
    ("loop", "controller", "reading", False),
    ("loop", "configmap", "budget, policy", False), ("loop", "status", "", False),
    ("handlers", "loop", "refresh", False), ("configmap", "watcher", "kubelet sync", False),
    ("watcher", "engine", "step boundary", False),
    ("contract", "api", "", True), ("contract", "watcher", "", True), ("contract", "source", "imports", True),
]


def _centre(name: str) -> tuple[float, float]:
    x, y, w, h = BOXES[name][:4]
    return x + w / 2, y + h / 2


def draw(path: Path) -> None:
    missing = [p for p in PATHS if not (ROOT / p).exists()]
    if missing:
        raise SystemExit(f"diagram names paths that do not exist: {', '.join(missing)}")
    fig, ax = plt.subplots(figsize=(13.4, 8.4))
    ax.set_xlim(0, 13.2)
    ax.set_ylim(0.6, 8.6)
    ax.axis("off")
    ax.text(0.2, 8.3, "Request path (every server pod: metronome.server, metronome.kernels)", fontsize=12,
            weight="bold")
    ax.text(0.2, 1.2, "Control loop\n(metronome.operator,\none thread for\nevery service)", fontsize=11,
            weight="bold", va="bottom")
    patches = {}
    for name, (x, y, w, h, title, where, colour) in BOXES.items():
        patches[name] = ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.05", fc=colour, ec="#444"))
        ax.text(x + w / 2, y + h / 2 + 0.14, title, ha="center", va="center", fontsize=9)
        ax.text(x + w / 2, y + 0.18, where, ha="center", va="center", fontsize=7.5, family="monospace",
                color="#333")
    for src, dst, label, dashed in ARROWS:
        (x0, y0), (x1, y1) = _centre(src), _centre(dst)
        rad = 0.0
        ax.add_patch(FancyArrowPatch((x0, y0), (x1, y1), arrowstyle="-|>", mutation_scale=14, color="#333",
                                     linestyle="--" if dashed else "-", patchA=patches[src], patchB=patches[dst],
                                     shrinkA=2, shrinkB=2, connectionstyle=f"arc3,rad={rad}"))
        if label:
            horizontal = abs(y1 - y0) < 0.01
            ax.text((x0 + x1) / 2 + (0 if horizontal else 0.08), (y0 + y1) / 2 + (0.56 if horizontal else 0.1),
                    label, fontsize=8, ha="center" if horizontal else "left", color="#333")
    ax.text(4.4, 8.12, "token events → SSE", fontsize=8, ha="center", color="#333")
    fig.savefig(path, format=path.suffix.lstrip("."), bbox_inches="tight", metadata={"Date": None})
    plt.close(fig)


if __name__ == "__main__":
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "docs" / "architecture.svg"
    draw(out)
    print(out)
