"""The embedded default: a local AWS endpoint (moto in server mode) on localhost.

Used by `make demo`, the integration tests and `trainstack ... --local`. Everything that is special
about the emulator lives here, visibly, so nothing real AWS gets is weakened to suit it. Its known
gaps and our workarounds (../shared/README.md section 7):

- the endpoint must be `localhost` (moto parses CDK's TemplateURL by host name);
- Step Functions executions only run after `POST /moto-api/config` enables them;
- it cannot run containers or Lambda: training jobs go straight to Completed, nothing trains.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path

from trainstack.errors import TrainstackError

REGION = "us-east-1"
ACCOUNT = "123456789012"  # moto's default account
# Dummy credentials: the emulator accepts any, and they keep a real profile from ever being used.
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_SESSION_TOKEN": "testing"}


def free_port() -> int:
    with closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Emulator:
    """A moto server process. Use as a context manager; it is always stopped on exit."""

    port: int = field(default_factory=free_port)
    log_path: Path | None = None
    _process: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"http://localhost:{self.port}"

    def env(self) -> dict[str, str]:
        """Environment for any AWS client (boto3, the CDK CLI) to talk to this emulator only."""
        return {
            **CREDENTIALS,
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_REGION": REGION,
            "AWS_DEFAULT_REGION": REGION,
            "CDK_DEFAULT_ACCOUNT": ACCOUNT,
            "CDK_DEFAULT_REGION": REGION,
            "AWS_EC2_METADATA_DISABLED": "true",
            "AWS_CONFIG_FILE": os.devnull,
            "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
        }

    def start(self, timeout_s: float = 30.0) -> Emulator:
        server = shutil.which("moto_server", path=str(Path(sys.executable).parent)) or shutil.which("moto_server")
        if server is None:
            raise TrainstackError("moto_server not found: run `make setup` (it installs moto[server])")
        log = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        self._process = subprocess.Popen(
            [server, "-H", "127.0.0.1", "-p", str(self.port)], stdout=log, stderr=subprocess.STDOUT
        )
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                urllib.request.urlopen(f"{self.endpoint}/moto-api/data.json", timeout=2).close()
                break
            except OSError:
                if self._process.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise TrainstackError(f"the local AWS emulator did not start on port {self.port}") from None
                time.sleep(0.2)
        self._configure({"stepfunctions": {"execute_state_machine": True}})
        return self

    def _configure(self, config: dict) -> None:
        request = urllib.request.Request(
            f"{self.endpoint}/moto-api/config", data=json.dumps(config).encode(), method="POST",
            headers={"Content-Type": "application/json"},
        )
        urllib.request.urlopen(request, timeout=10).close()

    def stop(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        self._process = None

    def __enter__(self) -> Emulator:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
