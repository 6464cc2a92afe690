"""deploy/: the Grafana dashboard and the Prometheus scrape config agree with the daemon.

No model and no HTTP server: the metric names come from rendering a bare
``Metrics`` registry, the address from ``config.LOOPBACK_METRICS``.
"""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path

import pytest

from tandem.daemon.config import LOOPBACK_METRICS
from tandem.daemon.front.metrics import Metrics

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
DASHBOARD = DEPLOY / "grafana-dashboard.json"
PROMETHEUS = DEPLOY / "prometheus.yml"
DATASOURCE = "${DS_PROMETHEUS}"

METRIC_NAME = re.compile(r"tandem_[a-z_]+")


def exported_names() -> set[str]:
    """Every series name the daemon's /metrics can carry, from its text exposition."""
    live = lambda: dict(queue_depth=0, active=0, ready=1, memory={"daemon": 1}, uptime=1.0)  # noqa: E731
    text = Metrics(live).render().decode()
    names: set[str] = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            if kind == "histogram":
                names.update(name + suffix for suffix in ("_bucket", "_sum", "_count"))
            elif kind == "counter":
                # a labelled counter with no child yet has only its TYPE line
                names.add(name if name.endswith("_total") else name + "_total")
            else:
                names.add(name)
        elif line and not line.startswith("#"):
            names.add(re.match(r"[a-zA-Z_:][a-zA-Z0-9_:]*", line).group(0))
    return names


def all_panels(panels: list[dict]) -> list[dict]:
    """Panels, with those inside collapsed rows."""
    out = []
    for p in panels:
        out.append(p)
        out.extend(all_panels(p.get("panels", [])))
    return out


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


@pytest.fixture(scope="module")
def panels(dashboard) -> list[dict]:
    return all_panels(dashboard["panels"])


def test_exported_names_sanity():
    names = exported_names()
    # a counter, a labelled counter with no samples yet, a histogram, a live gauge
    for name in (
        "tandem_requests_total",
        "tandem_accepted_tokens_by_position_total",
        "tandem_time_to_first_token_seconds_bucket",
        "tandem_resident_memory_bytes",
    ):
        assert name in names
    assert "tandem_time_to_first_token_seconds" not in names  # a histogram has no bare series


def test_dashboard_header(dashboard):
    assert dashboard["title"] == "tandem"
    assert dashboard["uid"] == "tandem"
    assert dashboard["refresh"] == "10s"
    assert dashboard["time"] == {"from": "now-1h", "to": "now"}
    assert dashboard["schemaVersion"] >= 36
    inputs = {i["name"]: i for i in dashboard["__inputs"]}
    assert inputs["DS_PROMETHEUS"]["type"] == "datasource"
    assert inputs["DS_PROMETHEUS"]["pluginId"] == "prometheus"


@pytest.mark.parametrize(
    "keywords",
    [
        ("throughput",),
        ("first token",),
        ("token latency",),
        ("acceptance",),
        ("acceptance", "position"),
        ("governor",),
        ("cache", "hit rate"),
        ("cache", "memory"),
        ("queue",),
        ("ready",),
        ("restarts",),
        ("memory",),
    ],
)
def test_dashboard_has_panel(panels, keywords):
    titles = [p.get("title", "").lower() for p in panels]
    assert any(all(k in t for k in keywords) for t in titles), f"no panel title with {keywords}: {titles}"


def test_every_panel_has_a_description_and_targets(panels):
    for p in panels:
        if p.get("type") == "row":
            continue
        assert p.get("description", "").strip(), p.get("title")
        assert p.get("targets"), p.get("title")


def test_every_panel_and_target_uses_the_input_datasource(panels):
    for p in panels:
        if p.get("type") == "row":
            continue
        assert p["datasource"]["uid"] == DATASOURCE, p["title"]
        assert p["datasource"]["type"] == "prometheus", p["title"]
        for t in p["targets"]:
            assert t["datasource"]["uid"] == DATASOURCE, (p["title"], t.get("refId"))
            assert t["datasource"]["type"] == "prometheus", (p["title"], t.get("refId"))


def test_panel_ids_are_unique(panels):
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))


def test_panels_tile_without_overlap(dashboard):
    # rows and the panels inside a collapsed row live in separate layouts; this dashboard has none of either
    grids = [(p["title"], p["gridPos"]) for p in dashboard["panels"]]
    for title, gp in grids:
        assert gp["w"] > 0 and gp["h"] > 0, title
        assert gp["x"] >= 0 and gp["y"] >= 0, title
        assert gp["x"] + gp["w"] <= 24, f"{title} is wider than the 24-column grid"
    for (ta, a), (tb, b) in itertools.combinations(grids, 2):
        overlap_x = a["x"] < b["x"] + b["w"] and b["x"] < a["x"] + a["w"]
        overlap_y = a["y"] < b["y"] + b["h"] and b["y"] < a["y"] + a["h"]
        overlap = overlap_x and overlap_y
        assert not overlap, f"{ta!r} {a} overlaps {tb!r} {b}"


def test_every_metric_in_the_dashboard_is_exported(panels):
    exported = exported_names()
    used: dict[str, str] = {}
    for p in panels:
        for t in p.get("targets", []):
            for name in METRIC_NAME.findall(t.get("expr", "")):
                used.setdefault(name, p["title"])
    assert used, "no tandem_ metric in any target"
    unknown = {name: title for name, title in used.items() if name not in exported}
    assert not unknown, f"metrics the daemon does not export (name: panel): {unknown}"


def test_prometheus_scrape_config_targets_the_default_address():
    text = PROMETHEUS.read_text()
    assert LOOPBACK_METRICS == "127.0.0.1:9464"
    try:
        import yaml
    except ImportError:
        yaml = None
    if yaml is not None:
        config = yaml.safe_load(text)
        jobs = {job["job_name"]: job for job in config["scrape_configs"]}
        job = jobs["tandem"]
        assert job["scrape_interval"] == "5s"
        assert job.get("metrics_path", "/metrics") == "/metrics"
        targets = [t for sc in job["static_configs"] for t in sc["targets"]]
        assert targets == [LOOPBACK_METRICS]
    else:
        body = [line.split("#", 1)[0].rstrip() for line in text.splitlines()]
        body = [line for line in body if line.strip()]
        assert body[0] == "scrape_configs:"
        assert any(re.fullmatch(r"\s*-\s*job_name:\s*['\"]?tandem['\"]?", line) for line in body)
        assert any(re.fullmatch(r"\s*scrape_interval:\s*['\"]?5s['\"]?", line) for line in body)
        assert any(re.fullmatch(r"\s*metrics_path:\s*['\"]?/metrics['\"]?", line) for line in body)
        assert any(line.strip() == "static_configs:" for line in body)
        targets = [
            re.findall(r"['\"]?([^'\"\s,\[\]]+)['\"]?", m.group(1))
            for line in body
            if (m := re.fullmatch(r"\s*-?\s*targets:\s*\[(.*)\]", line))
        ]
        assert targets == [[LOOPBACK_METRICS]]
    assert "tandem status" in text  # the comment says where to see the address in use
