"""Local multi-worker runs: one training script started as N workers with `TF_CONFIG`.

`MultiWorkerMirroredStrategy` learns its cluster from the `TF_CONFIG` environment variable
of each worker process. `run_local_workers` starts those processes on this machine (loopback
ports), forwards their output, and supervises them the way a cluster manager would: when one
worker dies, the others cannot go on (their all-reduces wait for it), so the whole group is
stopped and started again, and a `keras.callbacks.BackupAndRestore` in the script resumes
training from its last backup.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO

logger = logging.getLogger(__name__)

ATTEMPT_VARIABLE = "KERAS_GPUSHARE_ATTEMPT"
_POLL_SECONDS = 0.2
_STOP_GRACE_SECONDS = 10.0


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """`count` distinct TCP ports free on `host` right now."""
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def tf_config(addresses: Sequence[str], index: int) -> str:
    """The `TF_CONFIG` text of worker `index` in a cluster of workers at `addresses`."""
    if not 0 <= index < len(addresses):
        raise ValueError(f"Invalid worker index {index}: the cluster has {len(addresses)} workers.")
    return json.dumps(
        {"cluster": {"worker": list(addresses)}, "task": {"type": "worker", "index": index}}
    )


def run_local_workers(
    command: Sequence[str],
    num_workers: int = 2,
    max_restarts: int = 0,
    timeout: float | None = None,
    log_dir: str | os.PathLike | None = None,
    env: Mapping[str, str] | None = None,
    host: str = "127.0.0.1",
) -> int:
    """Runs `command` as `num_workers` local workers of one `MultiWorkerMirroredStrategy`.

    Each worker gets `TF_CONFIG` (worker `i` of a cluster on `host`'s free ports) and
    `KERAS_GPUSHARE_ATTEMPT` (0, then 1 after the first restart, ...). When a worker fails
    (non-zero exit or a signal), the others are stopped and, while restarts are left, the
    whole group starts again on new ports.

    Args:
        command: the program and its arguments, e.g. `["python", "train.py"]`.
        num_workers: number of workers. Defaults to `2`.
        max_restarts: how many times the group may be restarted after a failure.
            Defaults to `0`.
        timeout: seconds before every worker is stopped and `TimeoutError` raised, or
            `None` for no limit. Defaults to `None`.
        log_dir: directory for `worker{i}.log` files (appended on restarts), or `None` to
            forward the workers' output to this process's standard output, each line
            prefixed `[worker{i}]`. Defaults to `None`.
        env: environment for the workers. Defaults to this process's environment.
        host: address the workers listen on. Defaults to `"127.0.0.1"`.

    Returns:
        0 when every worker ended successfully, else the failed worker's exit status
        (negative: the signal that ended it).

    Example:

    ```python
    import sys
    import keras_gpushare as kg

    code = kg.run_local_workers(
        [sys.executable, "-c", "import os; print(os.environ['TF_CONFIG'])"], num_workers=2
    )
    ```
    """
    command = _check_command(command)
    for name, value, low in (("num_workers", num_workers, 1), ("max_restarts", max_restarts, 0)):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ValueError(
                f"Invalid value for argument `{name}`: got {value!r}. Expected an integer >= {low}."
            )
    if timeout is not None and not timeout > 0:
        raise ValueError(
            f"Invalid value for argument `timeout`: got {timeout!r}. Expected seconds > 0 or None."
        )
    deadline = None if timeout is None else time.monotonic() + timeout
    base_env = dict(os.environ if env is None else env)
    attempt = 0
    while True:
        group = _WorkerGroup(command, num_workers, attempt, base_env, host, log_dir)
        try:
            failed = group.wait(deadline)
        finally:
            group.stop()
        if failed is None:
            logger.info("All %d workers finished.", num_workers)
            return 0
        index, code = failed
        if attempt >= max_restarts:
            logger.error(
                "Worker %d exited with status %d; no restarts left (max_restarts=%d).",
                index,
                code,
                max_restarts,
            )
            return code
        attempt += 1
        logger.warning(
            "Worker %d exited with status %d; restarting all %d workers (restart %d of %d).",
            index,
            code,
            num_workers,
            attempt,
            max_restarts,
        )


def _check_command(command: Sequence[str]) -> list[str]:
    if isinstance(command, (str, bytes)) or not command:
        raise ValueError(
            f"Invalid value for argument `command`: got {command!r}. Expected the program "
            'and its arguments as a non-empty list, e.g. ["python", "train.py"].'
        )
    return [str(part) for part in command]


class _WorkerGroup:
    """One start of all workers: the processes and the threads forwarding their output."""

    def __init__(
        self,
        command: list[str],
        num_workers: int,
        attempt: int,
        env: dict[str, str],
        host: str,
        log_dir: str | os.PathLike | None,
    ) -> None:
        addresses = [f"{host}:{port}" for port in free_ports(num_workers, host)]
        self.processes: list[subprocess.Popen] = []
        self._threads: list[threading.Thread] = []
        self._logs: list[IO[bytes]] = []
        if log_dir is not None:
            Path(log_dir).mkdir(parents=True, exist_ok=True)
        logger.info("Starting %d workers (attempt %d) at %s.", num_workers, attempt, addresses)
        for index in range(num_workers):
            worker_env = {
                **env,
                "TF_CONFIG": tf_config(addresses, index),
                ATTEMPT_VARIABLE: str(attempt),
            }
            if log_dir is None:
                process = subprocess.Popen(
                    command, env=worker_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
                )
                thread = threading.Thread(
                    target=_forward, args=(process.stdout, f"[worker{index}] "), daemon=True
                )
                thread.start()
                self._threads.append(thread)
            else:
                log = open(Path(log_dir) / f"worker{index}.log", "ab")  # noqa: SIM115
                self._logs.append(log)
                process = subprocess.Popen(
                    command, env=worker_env, stdout=log, stderr=subprocess.STDOUT
                )
            self.processes.append(process)

    def wait(self, deadline: float | None) -> tuple[int, int] | None:
        """Waits until all workers succeed (None) or one fails: `(index, exit status)`."""
        while True:
            codes = [p.poll() for p in self.processes]
            for index, code in enumerate(codes):
                if code is not None and code != 0:
                    return index, code
            if all(code == 0 for code in codes):
                return None
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(
                    "The workers did not finish within the timeout; all were stopped."
                )
            time.sleep(_POLL_SECONDS)

    def stop(self) -> None:
        """Ends the workers still running: SIGTERM, then SIGKILL after a grace period."""
        running = [p for p in self.processes if p.poll() is None]
        for process in running:
            process.send_signal(signal.SIGTERM)
        end = time.monotonic() + _STOP_GRACE_SECONDS
        for process in running:
            try:
                process.wait(timeout=max(0.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        for thread in self._threads:
            thread.join(timeout=5)
        for log in self._logs:
            log.close()


def _forward(stream: IO[bytes], prefix: str) -> None:
    for line in iter(stream.readline, b""):
        sys.stdout.write(prefix + line.decode(errors="replace"))
        sys.stdout.flush()
    stream.close()
