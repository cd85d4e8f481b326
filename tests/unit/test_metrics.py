"""ckptless.metrics: the agent's Prometheus endpoint, scraped over real HTTP (urllib), on a free port."""

from __future__ import annotations

import socket
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from ckptless.errors import ConfigError
from ckptless.goodput import analyze
from ckptless.metrics import RECOVERY_PHASES, MetricsExporter

from ..harness import report_fixtures as fx


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(url, timeout=10) as resp:
        assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/plain")
        text = resp.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_scrape_over_http_on_a_free_port() -> None:
    with MetricsExporter(job_id="j1", node_id="n0") as m:
        port = m.start(0)
        assert port > 0 and m.url == f"http://127.0.0.1:{port}/metrics"
        lab = (("job", "j1"), ("node", "n0"))
        got = scrape(m.url)
        assert got[("ckptless_generation", lab)] == 0.0  # every metric is there before any update
        assert got[("ckptless_incidents_total", lab)] == 0.0
        m.set_generation(2)
        m.record_incident()
        m.record_incident()
        m.set_committed_version(40)
        m.set_mirror_lag(1)
        m.set_replica_bytes(3 << 20)
        m.set_own_image_bytes(5 << 20)
        m.set_replacement_waiting(1_700_000_000.0)
        m.set_spares_free(1)
        m.record_recovery(analyze(fx.all_events()).incidents[0])
        got = scrape(m.url)
        assert got[("ckptless_generation", lab)] == 2.0
        assert got[("ckptless_incidents_total", lab)] == 2.0
        assert got[("ckptless_committed_version", lab)] == 40.0
        assert got[("ckptless_mirror_lag_versions", lab)] == 1.0
        assert got[("ckptless_replica_bytes_held", lab)] == float(3 << 20)
        assert got[("ckptless_own_image_bytes", lab)] == float(5 << 20)
        assert got[("ckptless_replacement_waiting_since", lab)] == 1_700_000_000.0
        assert got[("ckptless_spares_free", lab)] == 1.0
        rec = {p: got[("ckptless_last_recovery_seconds", (*lab, ("phase", p)))] for p in RECOVERY_PHASES}
        assert rec["reformation"] == pytest.approx(0.86, abs=1e-5)
        assert rec["total"] == pytest.approx(1.82, abs=1e-5) and rec["kill_to_first_step"] == pytest.approx(1.82, abs=1e-5)
        assert rec["reprotection"] == pytest.approx(0.51, abs=1e-5) and rec["disk_restore"] == 0.0
        m.set_last_recovery({"detection": 0.5})  # a new recovery: no stale phases from the previous one
        got = scrape(m.url)
        assert got[("ckptless_last_recovery_seconds", (*lab, ("phase", "reformation")))] == 0.0
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)


def test_updates_never_raise(caplog: pytest.LogCaptureFixture) -> None:
    """Telemetry never ends a job: a bad update is logged and dropped, the gauges keep their values."""
    m = MetricsExporter(job_id="j", node_id="n")
    m.set_last_recovery({"detection": 0.25, "decision": 0.03})  # the agent's own phase is a known one
    with caplog.at_level("WARNING", logger="ckptless.metrics"):
        m.set_last_recovery({"coffee": 1.0})
        m.set_mirror_lag("not a number")  # type: ignore[arg-type]
    assert "unknown recovery phase" in caplog.text and "set_mirror_lag" in caplog.text
    text = m.render().decode()
    assert 'phase="decision"} 0.03' in text and 'phase="detection"} 0.25' in text


def test_errors_are_typed() -> None:
    m = MetricsExporter()
    with pytest.raises(ConfigError, match="metrics_port"):
        m.start(70000)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        with pytest.raises(ConfigError, match="cannot listen"):
            m.start(busy.getsockname()[1])
    port = m.start(0)
    with pytest.raises(ConfigError, match="already started"):
        m.start(0)
    m.stop()
    m.stop()  # idempotent
    assert b"ckptless_generation" in m.render() and port > 0
