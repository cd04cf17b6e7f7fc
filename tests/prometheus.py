"""Reading a Prometheus ``/metrics`` page in tests."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families


class Metrics:
    """One scrape of ``/metrics``: ``value("loraplex_pool_pages", kind="kv")``."""

    def __init__(self, text: str) -> None:
        self.types = {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")}
        self.samples: dict[tuple[str, frozenset], float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                self.samples[(sample.name, frozenset(sample.labels.items()))] = sample.value

    def value(self, name: str, **labels: str) -> float:
        """The sample's value; 0 when it is absent (a counter not yet counted)."""
        return self.samples.get((name, frozenset(labels.items())), 0.0)

    def has(self, name: str, **labels: str) -> bool:
        return (name, frozenset(labels.items())) in self.samples
