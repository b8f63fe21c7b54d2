"""Relay processes for the acceptance tests: :class:`RelayProcess` runs
``python -m outbox.ops.cli run --app <module:attribute>`` as a subprocess with its output in a log
file; :class:`Fleet` starts, kills, counts and stops a scenario's relays."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from outbox.testing import wait_for

ROOT = Path(__file__).resolve().parents[2]
#: The fault suite's application: the workload module's registry factory.
WORKLOAD_APP = "tests.acceptance.workload:app"


class RelayProcess:
    """One ``python -m outbox.ops.cli run --app <app>`` subprocess (``app``: ``module:attribute``)
    on the database ``url``, with ``flags`` and the extra environment ``env``, its output in
    ``log_path``. ``cli``: the command line's module (an older release's, for a relay of it)."""

    def __init__(self, name: str, log_path: Path, url: str, flags: tuple[str, ...], env: dict[str, str],
                 app: str = WORKLOAD_APP, cli: str = "outbox.ops.cli") -> None:
        self.name = name
        self.log_path = log_path
        self._log = open(log_path, "wb")
        environ = {**os.environ, "OUTBOX_DATABASE_URL": url, "PYTHONUNBUFFERED": "1",
                   "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])), **env}
        environ.pop("OUTBOX_TEST_DATABASE_URL", None)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", cli, "run", "--app", app,
             "--database-url", url, *flags],
            cwd=log_path.parent, env=environ, stdout=self._log, stderr=subprocess.STDOUT)
        self.pid = self.proc.pid
        self.killed = False
        self.stopped = False

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def started(self) -> bool:
        return "relay started" in self.log

    def signal(self, signum: int) -> None:
        os.kill(self.pid, signum)
        self.stopped = signum == signal.SIGSTOP


class Fleet:
    """The relays of one scenario: started, killed on purpose, and counted. Each runs ``app``
    with ``base_flags`` before its own and ``env`` under its own."""

    def __init__(self, directory: Path, url: str, *, app: str = WORKLOAD_APP, base_flags: tuple[str, ...] = (),
                 env: dict[str, str] | None = None) -> None:
        self.directory = directory
        self.url = url
        self.app = app
        self.base_flags = base_flags
        self.env = dict(env or {})
        self.relays: list[RelayProcess] = []

    def start(self, *flags: str, env: dict[str, str] | None = None, wait: bool = True,
              url: str | None = None, cli: str = "outbox.ops.cli") -> RelayProcess:
        """Start a relay (on ``url``, default the scenario's database) with ``flags`` after
        the base flags, run by the command line module ``cli``; ``wait``: until it logged its start."""
        relay = RelayProcess(f"relay{len(self.relays)}", self.directory / f"relay{len(self.relays)}.log",
                             url or self.url, (*self.base_flags, *flags), {**self.env, **(env or {})}, self.app,
                             cli)
        self.relays.append(relay)
        if wait:
            wait_for(lambda: relay.started() or relay.proc.poll() is not None, timeout=30,
                     what=f"{relay.name} to start")
            assert relay.proc.poll() is None, relay.log
        return relay

    def kill(self, relay: RelayProcess) -> None:
        relay.killed = True
        relay.proc.kill()
        relay.proc.wait(10)

    def terminate(self, relay: RelayProcess, timeout: float) -> int:
        """SIGTERM ``relay`` on purpose and wait for it; returns its exit status."""
        relay.killed = True
        relay.proc.send_signal(signal.SIGTERM)
        return relay.proc.wait(timeout)

    def alive(self) -> list[RelayProcess]:
        return [r for r in self.relays if r.proc.poll() is None]

    def check_count(self) -> None:
        """The relays alive are exactly those started minus those killed or stopped on purpose."""
        crashed = [r for r in self.relays if not r.killed and r.proc.poll() is not None]
        assert not crashed, "relays exited on their own:\n" + "\n".join(
            f"--- {r.name} (exit {r.proc.returncode})\n{r.log[-3000:]}" for r in crashed)
        killed = sum(r.killed for r in self.relays)
        assert len(self.alive()) == len(self.relays) - killed

    def terminate_all(self, timeout: float = 20.0) -> None:
        """SIGTERM every live relay; each must exit 0 within ``timeout`` seconds."""
        live = self.alive()
        for relay in live:
            if relay.stopped:
                relay.signal(signal.SIGCONT)
            relay.proc.send_signal(signal.SIGTERM)
        for relay in live:
            code = relay.proc.wait(timeout)
            assert code == 0, f"{relay.name} exited {code}:\n{relay.log[-3000:]}"

    def logs(self) -> str:
        return "\n".join(f"=== {r.name} (pid {r.pid})\n{r.log}" for r in self.relays)

    def cleanup(self) -> None:
        for relay in self.relays:
            if relay.proc.poll() is None:
                if relay.stopped:
                    os.kill(relay.pid, signal.SIGCONT)
                relay.proc.kill()
                relay.proc.wait(10)
            relay._log.close()
