"""A real Caddy for tests and benches: deploy/Caddyfile as shipped, on a free port.

The Caddyfile reads its site address and upstream from FIRSTTOKEN_SITE / FIRSTTOKEN_GATEWAY,
so nothing is rewritten: only the environment differs. Caddy's data (its local CA, the site's
certificate) and config directories live in a tmp dir, so nothing on the machine is touched,
and `localhost` gets its certificate from Caddy's own CA, offline. Also a self-signed pair
for HTTPS straight to the gateway (`self_signed`).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import shutil
import signal
import socket
import ssl
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
CADDYFILE = ROOT / "deploy" / "Caddyfile"


def caddy_binary() -> str:
    found = shutil.which("caddy")
    if found is None:  # no skip: ./scripts/test installs it, and CI must fail without it
        raise RuntimeError("caddy not installed (apt-get install -y caddy)")
    return found


def free_tcp_and_udp_port() -> int:
    """A port free for TCP and UDP both: Caddy serves HTTP/3 on the site's port over UDP."""
    for _ in range(50):
        with socket.socket() as tcp:
            tcp.bind(("127.0.0.1", 0))
            port = int(tcp.getsockname()[1])
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
                try:
                    udp.bind(("0.0.0.0", port))
                except OSError:
                    continue
            return port
    raise RuntimeError("no port free for both TCP and UDP")


class Caddy:
    def __init__(self, proc: subprocess.Popen[bytes], port: int, home: Path) -> None:
        self.proc = proc
        self.port = port
        self.home = home
        self.url = f"https://localhost:{port}"

    @property
    def root_ca(self) -> Path:
        """Caddy's local CA: what a client trusts to verify the site's certificate."""
        return self.home / "data/caddy/pki/authorities/local/root.crt"

    def tls(self) -> ssl.SSLContext:
        """A client context that trusts Caddy's local CA."""
        return ssl.create_default_context(cafile=self.root_ca)

    @property
    def leaf(self) -> Path:
        return self.home / "data/caddy/certificates/local/localhost/localhost.crt"

    def log(self) -> str:
        path = self.home / "caddy.log"
        return path.read_text(errors="replace") if path.exists() else ""


@contextmanager
def run_caddy(upstream: str, home: Path, timeout: float = 20.0) -> Iterator[Caddy]:
    """`caddy run` with deploy/Caddyfile in front of `upstream` (host:port); yields once the
    site answers over HTTPS."""
    binary = caddy_binary()
    home.mkdir(parents=True, exist_ok=True)
    port = free_tcp_and_udp_port()
    env = {
        **os.environ,
        "HOME": str(home),
        "XDG_DATA_HOME": str(home / "data"),
        "XDG_CONFIG_HOME": str(home / "config"),
        "FIRSTTOKEN_SITE": f"localhost:{port}",
        "FIRSTTOKEN_GATEWAY": upstream,
    }
    with (home / "caddy.log").open("wb") as log:
        proc = subprocess.Popen(
            [binary, "run", "--config", str(CADDYFILE), "--adapter", "caddyfile"],
            cwd=home,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    caddy = Caddy(proc, port, home)
    try:
        _wait_ready(caddy, timeout)
        yield caddy
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _wait_ready(caddy: Caddy, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if caddy.proc.poll() is not None:
            raise RuntimeError(f"caddy exited {caddy.proc.returncode}:\n{caddy.log()[-3000:]}")
        if caddy.root_ca.exists() and caddy.leaf.exists():
            try:
                httpx.get(caddy.url + "/healthz", verify=caddy.tls(), timeout=2)
                return
            except httpx.HTTPError:
                pass
        time.sleep(0.05)
    raise RuntimeError(f"caddy did not answer in {timeout:g} s:\n{caddy.log()[-3000:]}")


def self_signed(directory: Path, name: str = "localhost") -> tuple[Path, Path]:
    """A certificate for `name` and 127.0.0.1 signed by its own key: (cert.pem, key.pem)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName(name), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    directory.mkdir(parents=True, exist_ok=True)
    cert_path, key_path = directory / "cert.pem", directory / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_path, key_path
