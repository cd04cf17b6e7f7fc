"""What a fuzz run reached: every status each operation answered, as a table, and the operations it never
got through to (no 2xx or 3xx: the handler never did its work)."""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field


@dataclass
class RouteCoverage:
    operations: list[str]  # every operation of the schema, "METHOD /path"
    statuses: dict[str, Counter[int]] = field(default_factory=lambda: defaultdict(Counter))
    reached_by: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))  # stage -> operations

    def record(self, operation: str, status: int, stage: str) -> None:
        self.statuses[operation][status] += 1
        if 200 <= status < 400:
            self.reached_by[stage].add(operation)

    def unreached(self) -> list[str]:
        reached = set().union(*self.reached_by.values())
        return [op for op in self.operations if op not in reached]

    def server_errors(self) -> dict[str, list[int]]:
        found = {op: sorted(s for s in seen if s >= 500) for op, seen in self.statuses.items()}
        return {op: codes for op, codes in found.items() if codes}

    def render(self) -> str:
        width = max(len(op) for op in self.operations)
        total = len(self.operations)
        lines = [f"route coverage: {total - len(self.unreached())} of {total} operations got through (2xx or 3xx)"]
        lines += [f"  by {stage}: {len(ops)}" for stage, ops in self.reached_by.items()]
        lines += [f"  not by {stage}: {sorted(set(self.operations) - ops)}" for stage, ops in self.reached_by.items()]
        for op in sorted(self.operations, key=lambda o: (o.split(" ", 1)[1], o)):
            seen = self.statuses.get(op, Counter())
            codes = "  ".join(f"{status}×{count}" for status, count in sorted(seen.items())) or "never called"
            mark = " " if op not in self.unreached() else "!"
            lines.append(f"{mark} {op:<{width}}  {codes}")
        return "\n".join(lines)
