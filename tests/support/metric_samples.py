"""The daemon's Prometheus text, parsed by prometheus-client's own parser."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from rolloutd.metrics import Metrics


def samples(m: Metrics) -> dict[tuple[str, tuple], float]:
    body, content_type = m.render()
    assert content_type.startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out
