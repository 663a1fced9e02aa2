"""What a benchmark client records about one request: plain data, times in seconds from the run's start."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class RequestRecord:
    index: int
    kind: str
    max_tokens: int
    prompt_tokens: int | None = None
    scheduled_s: float = 0.0  # when the load pattern wanted it sent
    sent_s: float | None = None  # when it was actually sent (None: never sent)
    token_times_s: list[float] = field(default_factory=list)  # one per streamed token chunk, monotonic
    output_tokens: int = 0
    end_s: float | None = None
    finish_reason: str | None = None
    error: str | None = None  # None: completed normally
    server: str = ""  # the base URL it was sent to, where a run spreads its load over several

    @property
    def ok(self) -> bool:
        return self.error is None and self.sent_s is not None and self.end_s is not None

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["token_times_s"] = [round(t, 6) for t in self.token_times_s]
        return data
