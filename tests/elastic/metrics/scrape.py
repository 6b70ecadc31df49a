"""Parse Prometheus text exposition into ``{(name, labels): value}`` for assertions."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

Series = dict[tuple[str, frozenset[tuple[str, str]]], float]
Samples = dict[str, list[tuple[dict[str, str], float]]]  # by name: every series' labels and value


def parse(text: str) -> Series:
    out: Series = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def fetch(url: str, timeout: float = 2.0) -> Series | None:
    """One scrape over HTTP, or None while nothing listens yet."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return parse(resp.read().decode())
    except OSError:
        return None


def fetch_samples(url: str, timeout: float = 10.0) -> Samples:
    """One scrape over HTTP, grouped by metric name; raises OSError when it fails."""
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        text = resp.read().decode()
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def value(series: Series, name: str, **labels: str) -> float | None:
    return series.get((name, frozenset(labels.items())))


def names(series: Series) -> set[str]:
    return {name for name, _ in series}
