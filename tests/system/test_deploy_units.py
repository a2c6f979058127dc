"""What ships to deploy with: the Kubernetes manifests and the systemd unit, checked against
the server they start (its settings, `firsttoken check` on the files they mount) and by
`systemd-analyze verify`."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from firsttoken.config import Settings, env_var

ROOT = Path(__file__).resolve().parents[2]
KUBERNETES = ROOT / "deploy" / "kubernetes" / "firsttoken.yaml"
UNIT = ROOT / "deploy" / "systemd" / "firsttoken.service"


def manifests() -> dict[str, dict[str, Any]]:
    return {doc["kind"]: doc for doc in yaml.safe_load_all(KUBERNETES.read_text())}


def container() -> dict[str, Any]:
    (only,) = manifests()["Deployment"]["spec"]["template"]["spec"]["containers"]
    return only


def plain_env() -> dict[str, str]:
    return {e["name"]: e["value"] for e in container()["env"] if "value" in e}


def test_the_deployment_sets_only_settings_the_server_has_and_they_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    env = plain_env()
    known = {env_var(name) for name in Settings.__dataclass_fields__}
    ours = {name for name in env if name.startswith("FIRSTTOKEN_")}
    assert ours <= known, ours - known
    assert env["FIRSTTOKEN_HOST"] == "0.0.0.0"  # 127.0.0.1 is unreachable in a pod
    secret_env = {e["name"] for e in container()["env"] if "valueFrom" in e}
    assert env["FIRSTTOKEN_ADMIN_KEY_ENV"] in secret_env
    files = {"FIRSTTOKEN_ROUTES": "routes.toml", "FIRSTTOKEN_API_KEYS": "keys.toml"}
    mounted = {name: tmp_path / file for name, file in files.items()}
    mounted["FIRSTTOKEN_ROUTES"].write_text(manifests()["ConfigMap"]["data"]["routes.toml"])
    mounted["FIRSTTOKEN_API_KEYS"].write_text(manifests()["Secret"]["stringData"]["keys.toml"])
    given = {**env, **{name: str(path) for name, path in mounted.items()}}
    monkeypatch.setenv(env["FIRSTTOKEN_ADMIN_KEY_ENV"], "x")  # the Secret's, in the pod
    settings = Settings.from_args([], given)
    assert settings.redis == "redis://redis:6379/0" and settings.durable
    assert settings.usage_db is not None and settings.usage_db.startswith("postgresql://")
    assert "PGPASSWORD" in secret_env and "@postgres" in settings.usage_db
    assert ":" not in settings.usage_db.split("@")[0].removeprefix("postgresql://")


def test_a_pod_is_ready_on_readyz_and_outlives_its_drain() -> None:
    spec = manifests()["Deployment"]["spec"]["template"]["spec"]
    c = container()
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    pre_stop = int(c["lifecycle"]["preStop"]["exec"]["command"][-1])
    drain = float(plain_env()["FIRSTTOKEN_DRAIN_TIMEOUT_S"])
    assert spec["terminationGracePeriodSeconds"] > pre_stop + drain + 5
    assert spec["securityContext"]["runAsNonRoot"] is True


def test_the_mounted_routes_and_keys_pass_firsttoken_check(tmp_path: Path) -> None:
    routes = manifests()["ConfigMap"]["data"]["routes.toml"]
    keys = manifests()["Secret"]["stringData"]["keys.toml"]
    (tmp_path / "routes.toml").write_text(routes)
    (tmp_path / "keys.toml").write_text(keys)
    mounts = {m["name"]: m["mountPath"] for m in container()["volumeMounts"]}
    env = plain_env()
    assert env["FIRSTTOKEN_ROUTES"] == mounts["routes"] + "/routes.toml"
    assert env["FIRSTTOKEN_API_KEYS"] == mounts["keys"] + "/keys.toml"
    files = ["--routes", str(tmp_path / "routes.toml"), "--api-keys", str(tmp_path / "keys.toml")]
    checked = subprocess.run(
        [sys.executable, "-m", "firsttoken", "check", *files],
        env={**os.environ, "UPSTREAM_API_KEY": "x"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_the_systemd_unit_verifies_and_stops_after_the_drain(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    assert analyze is not None, "systemd-analyze is missing (apt-get install systemd)"
    text = UNIT.read_text()
    lines = dict(
        line.split("=", 1) for line in text.splitlines() if "=" in line and line[:1].isalpha()
    )
    assert lines["ExecReload"] == "/bin/kill -HUP $MAINPID"
    assert float(lines["TimeoutStopSec"]) > Settings().drain_timeout_s + 5
    assert lines["ExecStart"].endswith("firsttoken serve") and lines["User"] == "firsttoken"
    # Verified where its program exists: this checkout's.
    unit = tmp_path / "firsttoken.service"
    unit.write_text(text.replace("/opt/firsttoken/.venv/bin", str(Path(sys.executable).parent)))
    verified = subprocess.run(
        [analyze, "verify", str(unit)], capture_output=True, text=True, timeout=60
    )
    problems = [
        line
        for line in (verified.stdout + verified.stderr).splitlines()
        if "firsttoken.service" in line and "Documentation" not in line
    ]
    assert verified.returncode == 0 and not problems, verified.stdout + verified.stderr
