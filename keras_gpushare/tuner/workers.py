"""The "processes" executor: a gRPC chief in this process, K worker processes, restarts.

The chief serves the `ParallelOracle` with KerasTuner's own `Oracle` gRPC service, so any
KerasTuner worker can join it: the worker processes started here, and processes on other
machines started with `KERASTUNER_ORACLE_IP`, `KERASTUNER_ORACLE_PORT` and a unique
`KERASTUNER_TUNER_ID`. A worker runs one trial at a time with KerasTuner's own
`Tuner.run_trial`, so its results are exactly a plain KerasTuner worker's.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import pickle
import threading
import time
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import grpc
import keras_tuner
from keras_tuner.src import protos
from keras_tuner.src.distribute import oracle_chief
from keras_tuner.src.distribute import utils as dist_utils
from keras_tuner.src.engine import trial as trial_module

logger = logging.getLogger("keras_gpushare.tuner")

TrialStatus = trial_module.TrialStatus

_IDLE_WAIT_S = 1.0  # how long the chief holds a CreateTrial while the oracle is IDLE
_POLL_S = 0.2  # how often the chief checks its worker processes
_MAX_WORKER_DEATHS = 3  # deaths of one worker slot in a row (no trial ended) before it gives up
_REMOTE_WAIT_LOG_S = 30.0
_EXIT_UNGUARDED_MAIN = 78  # a worker re-ran the script's search: no `__main__` guard
_PROCESS_PREFIX = "keras_gpushare-tuner-"
_GUARD_ADVICE = (
    'executor="processes" starts its workers with multiprocessing\'s "spawn", which imports '
    "your script again in each worker; the script's search then ran again there. Put the "
    'search under `if __name__ == "__main__":` (the build function stays at module level).'
)


# Worker side ------------------------------------------------------------------------------


def run_worker(tuner: Any, fit_args: tuple, fit_kwargs: dict) -> None:
    """KerasTuner's worker loop, waiting (not spinning) while the oracle is IDLE."""
    tuner.on_search_begin()
    while True:
        tuner.pre_create_trial()
        trial = tuner.oracle.create_trial(tuner.tuner_id)
        if trial.status == TrialStatus.STOPPED:
            break
        if trial.status == TrialStatus.IDLE:
            # The chief already held the request up to _IDLE_WAIT_S; it answers at once
            # only when no trial is running, so do not ask again right away.
            time.sleep(_IDLE_WAIT_S)
            continue
        tuner.on_trial_begin(trial)
        tuner._try_run_and_update_trial(trial, *fit_args, **fit_kwargs)
        tuner.on_trial_end(trial)
    tuner.on_search_end()


class _ParentWatchdog(threading.Thread):
    """Ends this worker when the process that started it is gone (killed chief)."""

    def __init__(self, parent_pid: int, interval: float = 0.5) -> None:
        super().__init__(name="keras_gpushare-tuner-watchdog", daemon=True)
        self.parent_pid = parent_pid
        self.interval = interval
        self.stop_event = threading.Event()

    def run(self) -> None:
        while not self.stop_event.wait(self.interval):
            if os.getppid() != self.parent_pid:
                logger.error("The tuner's chief (pid %d) is gone; worker exits.", self.parent_pid)
                os._exit(3)


def _worker_main(spec: bytes, tuner_id: str, ip: str, port: int, parent_pid: int) -> None:
    """Entry point of a worker process started by the chief."""
    os.environ["KERASTUNER_TUNER_ID"] = tuner_id
    os.environ["KERASTUNER_ORACLE_IP"] = ip
    os.environ["KERASTUNER_ORACLE_PORT"] = str(port)
    watchdog = _ParentWatchdog(parent_pid)
    watchdog.start()
    settings = pickle.loads(spec)
    from keras_gpushare.devices import share_gpu

    try:
        share_gpu(memory_growth=True, memory_limit_mb=settings.memory_limit_mb)
    except RuntimeError as e:
        logger.warning("Worker %s could not configure GPU memory: %s", tuner_id, e)
    from keras_gpushare.tuner.tuner import ParallelTuner

    placeholder = keras_tuner.Oracle(objective=settings.objective, max_trials=settings.max_trials)
    tuner = ParallelTuner(
        settings.hypermodel,
        oracle=placeholder,
        executor="processes",
        parallel_trials=1,
        directory=settings.directory,
        project_name=settings.project_name,
        overwrite=False,
        **settings.tuner_kwargs,
    )
    tuner.search(*settings.fit_args, **settings.fit_kwargs)
    watchdog.stop_event.set()


@dataclass
class WorkerSpec:
    """What a worker process needs to rebuild the tuner and run trials (pickled)."""

    hypermodel: Any
    objective: Any
    max_trials: int | None
    directory: str
    project_name: str
    memory_limit_mb: int | None
    tuner_kwargs: dict
    fit_args: tuple
    fit_kwargs: dict


# Chief side -------------------------------------------------------------------------------


class _ChiefServicer(oracle_chief.OracleServicer):
    """KerasTuner's servicer, holding CreateTrial while the oracle is IDLE."""

    def CreateTrial(self, request: Any, context: Any) -> Any:
        trial = self.oracle.wait_for_trial(request.tuner_id, timeout=_IDLE_WAIT_S)
        return protos.get_service().CreateTrialResponse(trial=trial.to_proto())


@dataclass
class _Slot:
    tuner_id: str
    process: Any = None
    deaths: int = 0
    ended_at_death: int = -1
    finished: bool = False
    gave_up: bool = False
    history: list = field(default_factory=list)


def _spec_bytes(tuner: Any, fit_args: tuple, fit_kwargs: dict) -> bytes:
    spec = WorkerSpec(
        hypermodel=tuner.hypermodel,
        objective=tuner.oracle.objective,
        max_trials=tuner.oracle.max_trials,
        directory=str(tuner.directory),
        project_name=tuner.project_name,
        memory_limit_mb=tuner.memory_limit_mb,
        tuner_kwargs=tuner._tuner_kwargs,
        fit_args=fit_args,
        fit_kwargs=fit_kwargs,
    )
    try:
        return pickle.dumps(spec)
    except Exception as e:
        raise ValueError(
            'executor="processes" sends the hypermodel and the arguments of `search` to the '
            f"worker processes by pickling them, and pickling failed: {e}. Define the build "
            "function at module level (not a lambda or a nested function), pass NumPy arrays "
            'rather than tf.data datasets, or use executor="pack".'
        ) from None


def _chief_address() -> tuple[str, str]:
    """(address to bind, address local workers dial)."""
    if dist_utils.is_chief_oracle():
        ip = os.environ["KERASTUNER_ORACLE_IP"]
        port = os.environ["KERASTUNER_ORACLE_PORT"]
        dial = "127.0.0.1" if ip in ("0.0.0.0", "::", "[::]") else ip
        return f"{ip}:{port}", dial
    return "127.0.0.1:0", "127.0.0.1"


def _start_server(oracle: Any, bind: str, threads: int) -> tuple[grpc.Server, int]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=threads))
    protos.get_service_grpc().add_OracleServicer_to_server(_ChiefServicer(oracle), server)
    try:
        port = server.add_insecure_port(bind)
    except RuntimeError as e:
        port, reason = 0, str(e)
    else:
        reason = "the address is in use or not valid here"
    if not port:
        raise RuntimeError(
            f"The tuner's chief could not listen on {bind}: {reason}. Set "
            "KERASTUNER_ORACLE_PORT to a free port (or unset KERASTUNER_ORACLE_IP to let the "
            "tuner pick one on 127.0.0.1)."
        )
    server.start()
    return server, port


def run_chief(tuner: Any, fit_args: tuple, fit_kwargs: dict) -> None:
    """Serves the oracle, runs `parallel_trials` workers, restarts dead ones, waits for all."""
    if multiprocessing.current_process().name.startswith(_PROCESS_PREFIX):
        logger.error(_GUARD_ADVICE)
        raise SystemExit(_EXIT_UNGUARDED_MAIN)
    spec = _spec_bytes(tuner, fit_args, fit_kwargs)
    oracle = tuner.oracle
    bind, dial = _chief_address()
    server, port = _start_server(oracle, bind, threads=tuner.parallel_trials + 4)
    logger.info(
        "Tuner chief listening on %s (port %d); starting %d worker processes.",
        bind.rsplit(":", 1)[0],
        port,
        tuner.parallel_trials,
    )
    context = multiprocessing.get_context("spawn")
    slots = [_Slot(f"worker{i}") for i in range(tuner.parallel_trials)]

    def start(slot: _Slot) -> None:
        slot.process = context.Process(
            target=_worker_main,
            args=(spec, slot.tuner_id, dial, port, os.getpid()),
            name=f"{_PROCESS_PREFIX}{slot.tuner_id}",
            daemon=True,
        )
        slot.process.start()

    tuner.on_search_begin()
    try:
        for slot in slots:
            start(slot)
        _supervise(oracle, slots, start)
    finally:
        for slot in slots:
            _stop_process(slot.process)
        server.stop(grace=1.0)
    if oracle.fatal_error is not None:
        raise oracle.fatal_error
    tuner.on_search_end()


def _supervise(oracle: Any, slots: list[_Slot], start: Any) -> None:
    last_remote_log = time.monotonic()
    while True:
        if oracle.fatal_error is not None:
            return
        for slot in slots:
            if slot.finished or slot.process.exitcode is None:
                continue
            code = slot.process.exitcode
            slot.process.join()
            if code == 0:
                slot.finished = True
                continue
            if code == _EXIT_UNGUARDED_MAIN:
                raise RuntimeError(_GUARD_ADVICE)
            _handle_death(oracle, slot, code, start)
        if all(slot.finished for slot in slots):
            if not oracle.ongoing_trials:
                break
            if time.monotonic() - last_remote_log > _REMOTE_WAIT_LOG_S:
                logger.info("Waiting for trials on other workers: %s", dict(oracle.ongoing_trials))
                last_remote_log = time.monotonic()
        time.sleep(_POLL_S)
    unfinished = list(oracle._retry_queue)
    if any(slot.gave_up for slot in slots) and (
        unfinished or not any(s.finished and not s.gave_up for s in slots)
    ):
        raise RuntimeError(
            "The search stopped before it was done: every worker process died repeatedly "
            f"(exit codes {[s.history for s in slots]}); trials left to run: {unfinished}. "
            "See the workers' output above for the cause; run the same script again with "
            "overwrite=False to resume."
        )


def _handle_death(oracle: Any, slot: _Slot, code: int, start: Any) -> None:
    reason = (
        f"worker {slot.tuner_id} killed by signal {-code}"
        if code < 0
        else f"worker {slot.tuner_id} exited with code {code}"
    )
    slot.history.append(code)
    if oracle.fatal_error is not None:
        slot.finished = True
        return
    oracle.requeue(slot.tuner_id, reason)
    ended = len(oracle.end_order)
    slot.deaths = 1 if ended > slot.ended_at_death else slot.deaths + 1
    slot.ended_at_death = ended
    if slot.deaths > _MAX_WORKER_DEATHS:
        logger.error("%s; it died %d times in a row, not restarting it.", reason, slot.deaths)
        slot.finished = slot.gave_up = True
        oracle.release(slot.tuner_id)
        return
    logger.warning("%s; restarting it.", reason)
    start(slot)


def _stop_process(process: Any) -> None:
    if process is None or process.pid is None or process.exitcode is not None:
        return
    process.terminate()
    process.join(5)
    if process.exitcode is None:
        process.kill()
        process.join(5)
