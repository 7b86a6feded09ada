"""The example alert rules load in Prometheus and behave as their test cases say
(``deploy/prometheus/alerts.test.yml``): checked with Prometheus's own ``promtool``."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

RULES = Path(__file__).resolve().parents[2] / "deploy" / "prometheus"
PROMTOOL = shutil.which("promtool")

needs_promtool = pytest.mark.skipif(
    PROMTOOL is None,
    reason="promtool is missing: install Debian's prometheus package "
           "(apt-get install prometheus), as .ci/run does")


def promtool(*args: str) -> str:
    assert PROMTOOL is not None
    done = subprocess.run([PROMTOOL, *args], cwd=RULES, capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


@needs_promtool
def test_promtool_checks_the_rules() -> None:
    assert "SUCCESS" in promtool("check", "rules", "alerts.yml")


@needs_promtool
def test_promtool_runs_the_rule_test_cases() -> None:
    assert "SUCCESS" in promtool("test", "rules", "alerts.test.yml")


def test_the_cases_cover_the_scrape_and_volume_rules_and_name_real_alerts() -> None:
    import yaml

    rules = yaml.safe_load((RULES / "alerts.yml").read_text())
    cases = yaml.safe_load((RULES / "alerts.test.yml").read_text())
    alerts = {rule["alert"] for group in rules["groups"] for rule in group["rules"]}
    tested = {case["alertname"] for test in cases["tests"]
              for case in test.get("alert_rule_test", [])}
    assert {"OutboxDatabaseScrapeFailing", "OutboxDatabaseMetricsAbsent",
            "OutboxFailureRatioHigh", "OutboxNoClaimsWhileWorkIsDue"} <= tested <= alerts
