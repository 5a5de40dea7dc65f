"""The tuner's chief: KerasTuner's gRPC oracle service, and the "processes" executor's workers.

The chief serves the `ParallelOracle` with KerasTuner's own `Oracle` gRPC service, so any
KerasTuner worker can join it: the worker processes started here (executor="processes"),
and processes on other machines started with `KERASTUNER_ORACLE_IP`,
`KERASTUNER_ORACLE_PORT` and a unique `KERASTUNER_TUNER_ID`. A worker process rebuilds the
user's tuner (its class and arguments, sent by reference) and runs KerasTuner's worker loop;
`_process_worker` is its entry point.

KerasTuner's protocol sends a trial as a protocol buffer, which keeps neither the trial's
message (the traceback of a failed trial) nor the order of its hyperparameters, their
conditions or their space. Beside KerasTuner's service the chief serves
`keras_gpushare.tuner.Trials`, which sends a trial whole (`Trial.get_state()` as JSON);
`ChiefClient` uses it in this package's workers, and falls back to KerasTuner's own calls
with a chief that lacks it (a plain KerasTuner chief).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pickle
import subprocess
import sys
import tempfile
import time
import types
from concurrent import futures
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import grpc
import keras_tuner

from keras_gpushare import _upstream
from keras_gpushare.tuner._devices import worker_environment, worker_name
from keras_gpushare.tuner._executor import Executor, TrialFeed, error_line

logger = logging.getLogger("keras_gpushare.tuner")

if TYPE_CHECKING:
    from keras_tuner.engine.trial import Trial

trial_module = _upstream.kt_trial_module()
TrialStatus = trial_module.TrialStatus

_IDLE_WAIT_S = 1.0  # how long the chief holds a CreateTrial while the oracle is IDLE
_POLL_S = 0.2  # how often the chief checks its worker processes and the oracle
_MAX_WORKER_DEATHS = 3  # deaths of one worker slot in a row (no trial ended) before it gives up
_REMOTE_WAIT_LOG_S = 30.0
_RPC_TIMEOUT_S = 60 * 60  # as KerasTuner's client: workers may start long before the chief
_TRIALS_SERVICE = "keras_gpushare.tuner.Trials"
WORKER_ENTRY = "keras_gpushare.tuner._process_worker"
FATAL_EXIT_CODE = 80  # a worker's trial raised a `keras_tuner.errors.FatalError`


# What a worker needs -----------------------------------------------------------------------


@dataclass
class WorkerHeader:
    """How to set a worker process up before it unpickles anything of the user's."""

    sys_path: list
    cwd: str
    argv: list  # the chief's `sys.argv`, which the user's script may parse again
    main_path: str | None  # the user's script, to run as `__mp_main__`, when needed
    main_package: str | None  # its package, when it was run with `python -m`
    memory_limit_mb: int | None


def placeholder_oracle(objective: Any, max_trials: Any, allow_new: bool, tune_new: bool) -> Any:
    """Stands in a worker for the chief's oracle (KerasTuner replaces it by a client)."""
    return keras_tuner.Oracle(
        objective=objective,
        max_trials=max_trials,
        allow_new_entries=allow_new,
        tune_new_entries=tune_new,
    )


class _SpecPickler(pickle.Pickler):
    """Pickles the tuner's arguments; notes what is defined in `__main__`; swaps the oracle."""

    def __init__(self, file: Any, oracles: tuple, placeholder: tuple) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self._oracles = {id(o) for o in oracles}
        self._placeholder = placeholder
        self.main_names: list[str] = []

    def reducer_override(self, obj: Any) -> Any:
        if id(obj) in self._oracles:
            return placeholder_oracle, self._placeholder
        if isinstance(obj, (type, types.FunctionType)) and obj.__module__ == "__main__":
            self.main_names.append(obj.__qualname__)
        return NotImplemented


@dataclass(frozen=True)
class WorkerLaunch:
    """The worker processes the chief starts on this machine.

    Args:
        count: worker processes to start; `0` for a chief that only serves (its workers
            run elsewhere).
        memory_limit_mb: each worker's GPU memory cap in MiB, or `None` for memory growth.
        tuner_class: the tuner's class, which each worker rebuilds.
        init_args: the positional arguments the tuner was made with.
        init_kwargs: the keyword arguments the tuner was made with.
        devices: one entry per worker (`ParallelTuner(devices=...)`): each worker is
            pinned to its device and streams its trials through the tuner's in-process
            executor; empty for workers that share the device, each running one trial at
            a time.
    """

    count: int
    memory_limit_mb: int | None
    tuner_class: type
    init_args: tuple
    init_kwargs: dict
    devices: tuple[str, ...] = ()


class ProcessExecutor(Executor):
    """The "processes" executor: the tuner's chief, and its K worker processes.

    In the tuner's own search, `run` is the chief: it serves the oracle over KerasTuner's
    gRPC protocol and starts `launch.count` worker processes, restarts those that die,
    and returns when the search is done, with the `"worker"` path recorded for the trials
    they ended. Each worker rebuilds the tuner from its class and arguments and runs
    `search` there, as a worker of the chief (`feed.remote`): `run` then runs its trials
    one at a time with KerasTuner's `run_trial`, as KerasTuner's worker loop does.

    Args:
        oracle: the tuner's `ParallelOracle`, which the chief serves.
        tuner_id: the tuner's id (a worker's names it in its trials' paths).
        launch: the worker processes the chief starts.
    """

    def __init__(self, oracle: Any, tuner_id: str, launch: WorkerLaunch) -> None:
        self.oracle = oracle
        self.tuner_id = tuner_id
        self.launch = launch

    def run(self, feed: TrialFeed, fit_args: tuple, fit_kwargs: dict) -> None:
        if feed.remote and self.launch.devices:
            # A machine joining a remote chief: its device workers join it too.
            _run_device_workers(self.oracle, self.tuner_id, self.launch, fit_args, fit_kwargs)
            return
        if feed.remote:
            why = f"worker process {self.tuner_id} ran it alone with KerasTuner's `run_trial`"
            feed.one_at_a_time({"path": "worker", "why": why}, fit_args, fit_kwargs)
            return
        paths = _run_chief(self.oracle, self.launch, fit_args, fit_kwargs)
        # The workers' paths are kept whether the search ran out of trials or an error
        # ended it (too many consecutive failed trials, a `FatalError`), as in this process.
        if self.launch.devices:
            why = "a device's worker process ran it; see its worker, program and slot"
        elif self.launch.count:
            why = (
                'a worker process (executor="processes") ran it alone with KerasTuner\'s '
                "`run_trial`"
            )
        else:
            why = "a worker of this chief ran it; that worker's `trial_paths()` says how"
        feed.record_ended({"path": "worker", "why": why}, paths)
        if self.oracle.fatal_error is not None:
            raise self.oracle.fatal_error


def _spec_bytes(
    launch: WorkerLaunch, oracle: Any, fit_args: tuple, fit_kwargs: dict
) -> tuple[bytes, list[str]]:
    import io

    inner = getattr(oracle, "oracle", oracle)
    placeholder = (
        inner.objective,
        inner.max_trials,
        inner.allow_new_entries,
        inner.tune_new_entries,
    )
    buffer = io.BytesIO()
    pickler = _SpecPickler(buffer, (oracle, inner), placeholder)
    try:
        pickler.dump(
            (launch.tuner_class, launch.init_args, launch.init_kwargs, fit_args, fit_kwargs)
        )
    except Exception as e:
        option, in_process = _in_process_way_out(launch)
        raise ValueError(
            f"{option} sends your tuner's class and arguments, the hypermodel and the "
            "arguments of `search` to the worker processes by pickling them, and pickling "
            f"failed: {e}. Define the build function at module level (not a lambda or a "
            "nested function) and pass NumPy arrays rather than tf.data datasets; or "
            f"{in_process}."
        ) from None
    return buffer.getvalue(), sorted(set(pickler.main_names))


def _in_process_way_out(launch: WorkerLaunch) -> tuple[str, str]:
    """The option that made the search use worker processes, and how to train in this
    process instead (an error's way out)."""
    if launch.devices:
        return "`devices`", "leave `devices` out to train the trials in this process"
    return 'executor="processes"', 'use executor="pack", which trains them in this process'


def _importable_main() -> str | None:
    """The path of the `__main__` script, when it is a file a worker can run again."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if path is None or not os.path.isfile(path) or not path.endswith(".py"):
        return None
    return os.path.abspath(path)


def _main_package() -> str | None:
    """The package of the `__main__` module run with `python -m`, for its relative imports."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    return getattr(spec, "parent", None) or None


def _check_main(main_names: list[str], launch: WorkerLaunch) -> str | None:
    """The script workers must import to find `main_names`, or a clear error."""
    if not main_names:
        return None
    path = _importable_main()
    if path is None:
        names = ", ".join(f"`{n}`" for n in main_names)
        option, in_process = _in_process_way_out(launch)
        raise ValueError(
            f"{option} trains the trials in worker processes, which cannot import {names}: "
            f"{'it is' if len(main_names) == 1 else 'they are'} defined in `__main__` of an "
            "interactive session (a notebook, `python -c` or a script read from standard "
            "input). Define it in a module file and import it from there (e.g. `from "
            f"my_search import build`) or run the search from a script file; or {in_process}."
        )
    return path


# Chief side -------------------------------------------------------------------------------


# mypy cannot check a base made at run time (KerasTuner's gRPC servicer, by `_upstream`).
class _ChiefServicer(_upstream.oracle_servicer_class()):  # type: ignore[misc]
    """KerasTuner's servicer, holding CreateTrial while the oracle is IDLE, and keeping the
    path each of this package's workers reports with a trial's end (`paths`)."""

    def __init__(self, oracle: Any) -> None:
        super().__init__(oracle)
        self.paths: dict[str, dict] = {}

    def CreateTrial(self, request: Any, context: Any) -> Any:
        trial = self.next_trial(request.tuner_id)
        return _upstream.kt_protos().get_service().CreateTrialResponse(trial=trial.to_proto())

    def next_trial(self, tuner_id: str) -> Trial:
        trial = self.oracle.wait_for_trial(tuner_id, timeout=_IDLE_WAIT_S)
        if trial.status == TrialStatus.STOPPED:
            self.stop_triggered = True
        return trial

    def handlers(self) -> grpc.GenericRpcHandler:
        """`keras_gpushare.tuner.Trials`: CreateTrial and EndTrial with whole trials.

        Once an error ends the search (the oracle raised in `end_trial`: too many
        consecutive failed trials, say), both answer with `"search_ended"`, the error's
        line, instead of raising it into gRPC: the worker stops as on STOPPED, and the
        chief raises the error when the trials still running have ended.
        """

        def create(request: bytes, context: Any) -> bytes:
            trial = self.next_trial(json.loads(request)["tuner_id"])
            state = trial.get_state()
            if trial.status == TrialStatus.STOPPED and self.oracle.fatal_error is not None:
                # `Trial.set_state` ignores the key: a worker of an earlier release reads it.
                state["search_ended"] = error_line(self.oracle.fatal_error)
            return json.dumps(state).encode()

        def end(request: bytes, context: Any) -> bytes:
            payload = json.loads(request)
            state = payload.get("trial", payload)  # a worker of an earlier release sends it bare
            if payload.get("path") is not None:
                self.paths[state["trial_id"]] = payload["path"]
            trial = trial_module.Trial.from_state(state)
            try:
                self.oracle.end_trial(trial)
            except Exception as e:
                if self.oracle.fatal_error is not e:
                    raise
                # The oracle ended the search: the chief raises the error, not this call.
                return json.dumps({"search_ended": error_line(e)}).encode()
            return b""

        return grpc.method_handlers_generic_handler(
            _TRIALS_SERVICE,
            {
                "CreateTrial": grpc.unary_unary_rpc_method_handler(create),
                "EndTrial": grpc.unary_unary_rpc_method_handler(end),
            },
        )


class ChiefClient:
    """A worker's KerasTuner `OracleClient` that sends and receives trials whole.

    Everything else is the wrapped client's. Against a chief without the
    `keras_gpushare.tuner.Trials` service, it makes KerasTuner's own calls.
    """

    def __init__(self, client: Any) -> None:
        self.client = client
        address = f"{os.environ['KERASTUNER_ORACLE_IP']}:{os.environ['KERASTUNER_ORACLE_PORT']}"
        channel = grpc.insecure_channel(address)
        self._create = channel.unary_unary(f"/{_TRIALS_SERVICE}/CreateTrial")
        self._end = channel.unary_unary(f"/{_TRIALS_SERVICE}/EndTrial")
        self._whole = True
        self._told_ended = False
        # Paths of trials this worker trained, sent with their ends (`record_path`).
        self._paths: dict[str, dict] = {}

    def __getattr__(self, name: str) -> Any:
        if name == "client":  # not set yet (a copy being made): no recursion
            raise AttributeError(name)
        return getattr(self.client, name)

    def _call(self, method: Any, payload: dict) -> bytes | None:
        if not self._whole:
            return None
        try:
            return method(json.dumps(payload).encode(), wait_for_ready=True, timeout=_RPC_TIMEOUT_S)
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.UNIMPLEMENTED:
                raise
            self._whole = False
            return None

    def create_trial(self, tuner_id: str) -> Trial:
        response = self._call(self._create, {"tuner_id": tuner_id})
        if response is None:
            return self.client.create_trial(tuner_id)
        state = json.loads(response)
        if "search_ended" in state:
            self._search_ended(state["search_ended"])
        return trial_module.Trial.from_state(state)

    def record_path(self, trial_id: str, path: dict) -> None:
        """Sends `path` (see `ParallelTuner.trial_paths`) to the chief with the trial's end."""
        self._paths[trial_id] = dict(path)

    def end_trial(self, trial: Trial) -> None:
        if not self.client.should_report:
            return
        payload = {"trial": trial.get_state(), "path": self._paths.pop(trial.trial_id, None)}
        response = self._call(self._end, payload)
        if response is None:
            self.client.end_trial(trial)
        elif response:
            self._search_ended(json.loads(response)["search_ended"])

    def _search_ended(self, error: str) -> None:
        """Says once that the chief ended the search: the chief raises `error` itself,
        once this worker's running trials have ended; this worker then stops."""
        if not self._told_ended:
            self._told_ended = True
            logger.info(
                "Worker %s: the chief ended the search (%s); this worker stops once its "
                "running trials have ended.",
                os.environ.get("KERASTUNER_TUNER_ID"),
                error,
            )


def chief_client(oracle: Any) -> Any:
    """`oracle` (a worker's `OracleClient`) as a `ChiefClient`; itself if it is one."""
    return oracle if isinstance(oracle, ChiefClient) else ChiefClient(oracle)


@dataclass
class _Slot:
    tuner_id: str
    device: str | None = None
    process: Any = None
    deaths: int = 0
    ended_at_death: int = -1
    finished: bool = False
    gave_up: bool = False
    history: list = field(default_factory=list)


def _chief_address() -> tuple[str, str]:
    """(address to bind, address local workers dial)."""
    if _upstream.is_chief_oracle():
        ip = os.environ["KERASTUNER_ORACLE_IP"]
        port = os.environ["KERASTUNER_ORACLE_PORT"]
        dial = "127.0.0.1" if ip in ("0.0.0.0", "::", "[::]") else ip
        return f"{ip}:{port}", dial
    return "127.0.0.1:0", "127.0.0.1"


def _start_server(oracle: Any, bind: str, threads: int) -> tuple[grpc.Server, int, Any]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=threads))
    servicer = _ChiefServicer(oracle)
    _upstream.kt_protos().get_service_grpc().add_OracleServicer_to_server(servicer, server)
    server.add_generic_rpc_handlers((servicer.handlers(),))
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
    return server, port, servicer


def _run_chief(
    oracle: Any, launch: WorkerLaunch, fit_args: tuple, fit_kwargs: dict
) -> dict[str, dict]:
    """Serves `oracle` until the search is done, with `launch.count` local workers; returns
    the paths the workers reported with their trials' ends, by trial id (also when an error
    ended the search: it is left in `oracle.fatal_error`).

    With none (KerasTuner's chief, `KERASTUNER_TUNER_ID=chief`, of an executor that runs
    trials in its own process), the chief only serves, as KerasTuner's does: its workers
    run the trials.
    """
    local = launch.count
    spec_path = _write_spec(launch, oracle, fit_args, fit_kwargs) if local else ""
    bind, dial = _chief_address()
    server, port, servicer = _start_server(oracle, bind, threads=max(local, 1) + 4)
    logger.info(
        "Tuner chief listening on %s (port %d)%s.",
        bind.rsplit(":", 1)[0],
        port,
        f"; starting {local} worker processes" if local else "",
    )
    if launch.devices:
        slots = [_Slot(worker_name(d), d) for d in launch.devices]
    else:
        slots = [_Slot(f"worker{i}") for i in range(local)]

    def start(slot: _Slot) -> None:
        chief = {"KERASTUNER_ORACLE_IP": dial, "KERASTUNER_ORACLE_PORT": str(port)}
        _start_worker(slot, spec_path, chief)

    try:
        if slots and _search_is_over(oracle, _first_ask(slots[0])):
            slots = []
        for slot in slots:
            start(slot)
        if slots:
            _supervise(oracle, slots, start, spec_path)
        elif not local:
            _serve_remote(oracle, servicer)
    finally:
        for slot in slots:
            _stop_process(slot.process)
        server.stop(grace=1.0)
        if spec_path:
            _remove_spec(spec_path, slots)
    return servicer.paths


def _write_spec(launch: WorkerLaunch, oracle: Any, fit_args: tuple, fit_kwargs: dict) -> str:
    """Writes what the workers need (`WorkerHeader`, then the pickled tuner and search
    arguments) to a temporary file; returns its path."""
    spec, main_names = _spec_bytes(launch, oracle, fit_args, fit_kwargs)
    main_path = _check_main(main_names, launch)
    header = WorkerHeader(
        sys_path=list(sys.path),
        cwd=os.getcwd(),
        argv=list(sys.argv),
        main_path=main_path,
        main_package=_main_package(),
        memory_limit_mb=launch.memory_limit_mb,
    )
    fd, spec_path = tempfile.mkstemp(prefix="kg-tuner-spec-", suffix=".pkl")
    with os.fdopen(fd, "wb") as f:
        pickle.dump(header, f)
        f.write(spec)
    return spec_path


def _run_device_workers(
    oracle: Any, tuner_id: str, launch: WorkerLaunch, fit_args: tuple, fit_kwargs: dict
) -> None:
    """Runs one worker per device of this machine, each a worker of the remote chief this
    process was pointed at (`KERASTUNER_ORACLE_IP`/`_PORT`) under `<tuner_id>-<device's
    worker>`, until each is done. A worker that dies is started again under the same id,
    and the chief gives it back the trials it was running, as KerasTuner's oracle does."""
    spec_path = _write_spec(launch, oracle, fit_args, fit_kwargs)
    slots = [_Slot(f"{tuner_id}-{worker_name(d)}", d) for d in launch.devices]
    try:
        for slot in slots:
            _start_worker(slot, spec_path)
        while not all(slot.finished for slot in slots):
            for slot in [s for s in slots if not s.finished]:
                code = slot.process.poll()
                if code is None:
                    continue
                if code in (0, FATAL_EXIT_CODE) or slot.deaths >= _MAX_WORKER_DEATHS:
                    slot.finished = True
                    if code == FATAL_EXIT_CODE:
                        raise _worker_fatal_error(fatal_path(spec_path, slot.tuner_id))
                    if code != 0:
                        logger.error(
                            "Worker %s died %d times; not restarting it.",
                            slot.tuner_id,
                            slot.deaths + 1,
                        )
                    continue
                slot.deaths += 1
                logger.warning("Worker %s exited with code %d; restarting it.", slot.tuner_id, code)
                _start_worker(slot, spec_path)
            time.sleep(_POLL_S)
    finally:
        for slot in slots:
            _stop_process(slot.process)
        _remove_spec(spec_path, slots)


def _start_worker(slot: _Slot, spec_path: str, env: dict[str, str] | None = None) -> None:
    """Starts `slot`'s worker process under its tuner id, with `env` besides this
    process's environment (the chief's address), pinned to its device if it has one."""
    env = {
        **os.environ,
        **(env or {}),
        "KERASTUNER_TUNER_ID": slot.tuner_id,
        "KERAS_GPUSHARE_TUNER_WORKER": slot.tuner_id,
        **({} if slot.device is None else worker_environment(slot.device)),
    }
    command = [sys.executable, "-m", WORKER_ENTRY, spec_path, str(os.getpid())]
    slot.process = subprocess.Popen(command, env=env)


def _remove_spec(spec_path: str, slots: list[_Slot]) -> None:
    """Removes the workers' spec file and the `FatalError`s they left beside it."""
    for path in [spec_path] + [fatal_path(spec_path, s.tuner_id) for s in slots]:
        if os.path.exists(path):
            os.remove(path)


def _first_ask(slot: _Slot) -> str:
    """The tuner id a worker first asks for a trial with: a device's worker asks for its
    slots (`<worker>-0`, ...), as an in-process executor does."""
    return slot.tuner_id if slot.device is None else f"{slot.tuner_id}-0"


def _owned(tuner_id: str, slot: _Slot) -> bool:
    """Whether the trials `tuner_id` asked for are `slot`'s worker's."""
    if tuner_id == slot.tuner_id:
        return True
    head, _, tail = tuner_id.rpartition("-")
    return slot.device is not None and head == slot.tuner_id and tail.isdigit()


def _search_is_over(oracle: Any, tuner_id: str) -> bool:
    """Whether the oracle has no trial left to run (a finished project, reloaded).

    Only when `max_trials` are made, the oracle is asked for a trial on behalf of the first
    worker: STOPPED spares starting the workers; a trial to run again is that worker's.
    """
    if oracle.remaining_trials() != 0 or oracle.ongoing_trials:
        return False
    return oracle.create_trial(tuner_id).status == TrialStatus.STOPPED


def _serve_remote(oracle: Any, servicer: Any) -> None:
    """KerasTuner's chief loop: until told to stop, no trial runs and every worker left."""
    last_log = time.monotonic()
    while True:
        if oracle.fatal_error is not None:
            return
        if servicer.stop_triggered and not oracle.ongoing_trials and not oracle.tuner_ids:
            return
        if time.monotonic() - last_log > _REMOTE_WAIT_LOG_S:
            logger.info(
                "Chief waiting for workers %s; trials running: %s",
                sorted(oracle.tuner_ids),
                {k: t.trial_id for k, t in oracle.ongoing_trials.items()},
            )
            last_log = time.monotonic()
        time.sleep(_POLL_S)


def _supervise(oracle: Any, slots: list[_Slot], start: Any, spec_path: str) -> None:
    """Restarts workers that die until the search is done. Once an error ends the search
    (`oracle.fatal_error`), no trial begins (the oracle answers STOPPED) and the trials
    running then end before this returns, so that none is left RUNNING in the project."""
    last_remote_log = time.monotonic()
    while True:
        # A worker that ended (a `FatalError` leaves its trial RUNNING, as in KerasTuner)
        # is not waited for; the others' trials are.
        ended = [slot for slot in slots if slot.finished]
        running = [t for t in oracle.ongoing_trials if not any(_owned(t, s) for s in ended)]
        if oracle.fatal_error is not None and not running:
            return
        for slot in slots:
            if slot.finished:
                continue
            code = slot.process.poll()
            if code is None:
                continue
            if code == 0:
                slot.finished = True
                continue
            if code == FATAL_EXIT_CODE:
                if oracle.fatal_error is None:
                    path = fatal_path(spec_path, slot.tuner_id)
                    oracle.fatal_error = _worker_fatal_error(path)
                slot.finished = True
                continue
            _handle_death(oracle, slot, code, start)
        if all(slot.finished for slot in slots):
            if not oracle.ongoing_trials:
                break
            if time.monotonic() - last_remote_log > _REMOTE_WAIT_LOG_S:
                logger.info("Waiting for trials on other workers: %s", dict(oracle.ongoing_trials))
                last_remote_log = time.monotonic()
        time.sleep(_POLL_S)
    unfinished = list(_upstream.retry_queue(oracle))
    if any(slot.gave_up for slot in slots) and (
        unfinished or not any(s.finished and not s.gave_up for s in slots)
    ):
        raise RuntimeError(
            "The search stopped before it was done: every worker process died repeatedly "
            f"(exit codes {[s.history for s in slots]}); trials left to run: {unfinished}. "
            "See the workers' output above for the cause; run the same script again with "
            "overwrite=False to resume."
        )


def fatal_path(spec_path: str, tuner_id: str) -> str:
    """Where worker `tuner_id` leaves the `FatalError` that ended it."""
    return f"{spec_path}.{tuner_id}.fatal"


def _worker_fatal_error(path: str) -> BaseException:
    from keras_tuner import errors

    try:
        with open(path, "rb") as f:
            error = pickle.load(f)
    except Exception as e:
        error = errors.FatalError(f"A worker process ended the search (its error is lost: {e}).")
    return error


def _handle_death(oracle: Any, slot: _Slot, code: int, start: Any) -> None:
    reason = (
        f"worker {slot.tuner_id} killed by signal {-code}"
        if code < 0
        else f"worker {slot.tuner_id} exited with code {code}"
    )
    slot.history.append(code)
    if oracle.fatal_error is not None:
        # The search is ending: the worker is not restarted, its trial (if it ran one) is
        # put back to run on resume.
        slot.finished = True
        with contextlib.suppress(RuntimeError):  # the wrapped oracle's own stop, again
            _requeue(oracle, slot, reason)
        return
    _requeue(oracle, slot, reason)
    ended = len(oracle.end_order)
    slot.deaths = 1 if ended > slot.ended_at_death else slot.deaths + 1
    slot.ended_at_death = ended
    if slot.deaths > _MAX_WORKER_DEATHS:
        logger.error("%s; it died %d times in a row, not restarting it.", reason, slot.deaths)
        slot.finished = slot.gave_up = True
        for tuner_id in [t for t in list(oracle.tuner_ids) if _owned(t, slot)]:
            oracle.release(tuner_id)
        return
    logger.warning("%s; restarting it.", reason)
    start(slot)


def _requeue(oracle: Any, slot: _Slot, reason: str) -> None:
    """Puts the trials `slot`'s dead worker was running back in the queue."""
    for tuner_id in [t for t in list(oracle.ongoing_trials) if _owned(t, slot)]:
        oracle.requeue(tuner_id, reason)


def _stop_process(process: Any) -> None:
    if process is None or process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(5)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(5)
