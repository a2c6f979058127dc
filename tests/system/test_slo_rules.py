"""The SLOs as Prometheus rules (deploy/prometheus/): promtool checks and unit-tests them, and a
real Prometheus scraping a real server raises the TTFT alert when the engine is slowed past
300 ms and clears it when it is not.

Needs the Debian package `prometheus` (scripts/test installs it): these tests fail without it.
"""

from __future__ import annotations

import re
import shutil
import socket
import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from tests.servers import ROOT, run_server, wait_for

RULES_DIR = ROOT / "deploy" / "prometheus"
RULES = RULES_DIR / "firsttoken.rules.yml"


def _tool(name: str) -> str:
    path = shutil.which(name) or f"/usr/bin/{name}"
    assert Path(path).exists(), f"{name} not found: install the Debian package prometheus"
    return path


def _promtool(*args: str | Path) -> str:
    done = subprocess.run(
        [_tool("promtool"), *map(str, args)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_rules_are_valid() -> None:
    out = _promtool("check", "rules", RULES)
    assert "SUCCESS" in out


def test_rules_unit_tests_pass() -> None:
    # Relative rule_files resolve against the working directory.
    done = subprocess.run(
        [_tool("promtool"), "test", "rules", "firsttoken.rules.test.yml"],
        cwd=RULES_DIR,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_sample_config_is_valid() -> None:
    _promtool("check", "config", RULES_DIR / "prometheus.yml")


def short_rules(text: str, window: str = "5s", hold: str = "1m") -> str:
    """The same rules on a test's time scale: every range window `window`, every `for:` `hold`
    (longer than the test, so a true condition shows as pending)."""
    text = re.sub(r"\[\d+[smh]\]", f"[{window}]", text)
    return re.sub(r"(?m)^(\s+for:) \S+$", rf"\1 {hold}", text)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def run_prometheus(tmp: Path, target: str, rules: Path, job: str = "") -> Iterator[str]:
    """A real Prometheus scraping `target`; `job`: more lines of its scrape job."""
    config = tmp / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        f"rule_files:\n  - {rules}\n"
        "scrape_configs:\n  - job_name: firsttoken\n"
        f"    static_configs:\n      - targets: ['{target}']\n" + job
    )
    _promtool("check", "config", config)
    port = _free_port()
    log = (tmp / "prometheus.log").open("w")
    proc = subprocess.Popen(
        [
            _tool("prometheus"),
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        assert proc.poll() is None, (tmp / "prometheus.log").read_text()
        try:
            return httpx.get(url + "/-/ready", timeout=1).status_code == 200
        except httpx.TransportError:
            return False

    try:
        wait_for(ready, timeout=30, interval=0.1)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def _alert_state(prometheus: str, name: str) -> str | None:
    alerts = httpx.get(prometheus + "/api/v1/alerts", timeout=5).json()["data"]["alerts"]
    states = [a["state"] for a in alerts if a["labels"]["alertname"] == name]
    return states[0] if states else None


def test_ttft_alert_pending_when_slow_and_cleared_when_not(tmp_path: Path) -> None:
    rules = tmp_path / "rules.yml"
    rules.write_text(short_rules(RULES.read_text()))
    _promtool("check", "rules", rules)
    ttft_ms = {"value": 400}  # past the 300 ms SLO, under --ttft-slo-ms (no shedding)
    stop = threading.Event()

    def traffic(url: str) -> None:
        with httpx.Client(timeout=10) as client:
            while not stop.is_set():
                client.post(
                    url + "/v1/chat/completions",
                    json={
                        "messages": [{"role": "user", "content": "slo"}],
                        "stream": True,
                        "max_tokens": 2,
                        "synthetic": {"ttft_ms": ttft_ms["value"], "itl_ms": 1},
                    },
                )

    # Two workers: Prometheus reads the merged exposition, as it would in production.
    with (
        run_server("--workers", "2") as server,
        run_prometheus(tmp_path, f"127.0.0.1:{server.port}", rules) as prom,
    ):
        threads = [threading.Thread(target=traffic, args=(server.url,)) for _ in range(3)]
        for t in threads:
            t.start()
        try:
            wait_for(lambda: _alert_state(prom, "FirsttokenTTFTHigh") == "pending", timeout=30)
            ttft_ms["value"] = 10
            wait_for(lambda: _alert_state(prom, "FirsttokenTTFTHigh") is None, timeout=30)
        finally:
            stop.set()
            for t in threads:
                t.join(timeout=15)
        assert _alert_state(prom, "FirsttokenInterTokenSlow") is None
        assert _alert_state(prom, "FirsttokenStreamCompletionLow") is None
        query = 'firsttoken_breaker_state{state="closed"}'
        result = httpx.get(prom + "/api/v1/query", params={"query": query}, timeout=5).json()
        assert result["data"]["result"][0]["value"][1] == "2"  # both workers in one scrape


def test_the_sample_configs_admin_key_lets_prometheus_scrape_guarded_metrics(
    tmp_path: Path,
) -> None:
    # The commented block of deploy/prometheus/prometheus.yml, uncommented as a reader would.
    sample = (RULES_DIR / "prometheus.yml").read_text()
    block = re.search(r"(?m)^    # authorization:\n(?:    #   .*\n)+", sample)
    assert block is not None, "no authorization example for --metrics-need-admin"
    key_file = tmp_path / "admin-key"
    key_file.write_text("admin-for-prometheus\n")  # a trailing newline, as editors leave
    job = (
        block.group(0)
        .replace("    # ", "    ")
        .replace("/etc/prometheus/firsttoken-admin-key", str(key_file))
    )
    env = {"PROM_ADMIN": "admin-for-prometheus"}
    with run_server("--admin-key-env", "PROM_ADMIN", "--metrics-need-admin", env=env) as server:
        assert httpx.get(server.url + "/metrics").status_code == 404  # guarded
        target = server.url.removeprefix("http://")
        with run_prometheus(tmp_path, target, RULES, job) as prometheus:

            def up() -> bool:
                found = httpx.get(prometheus + "/api/v1/targets", timeout=5).json()
                return [t["health"] for t in found["data"]["activeTargets"]] == ["up"]

            wait_for(up, timeout=20, interval=0.5)
