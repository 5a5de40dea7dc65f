"""Entry point of a worker process of the tuner's "processes" executor.

    python -m keras_gpushare.tuner._process_worker SPEC_PATH CHIEF_PID

The chief starts it with `KERASTUNER_TUNER_ID`, `KERASTUNER_ORACLE_IP` and
`KERASTUNER_ORACLE_PORT` set. The worker sets up the chief's import path, folder and
`sys.argv` (so the script sees the arguments the user gave it), makes GPU memory
shareable, runs the user's script (as `__mp_main__`, as multiprocessing's "spawn" does)
when the hypermodel or tuner class is defined there, rebuilds the user's tuner from its
class and arguments, and runs `search` with the chief's arguments, which makes it
KerasTuner's worker loop.
"""

from __future__ import annotations

import logging
import os
import pickle
import sys
import threading
import types

logger = logging.getLogger("keras_gpushare.tuner")

# Kept in step with keras_gpushare.tuner.tuner and _process_executor, which this module
# does not import before the user's script has run.
_IMPORTING_MAIN_ENV = "KERAS_GPUSHARE_TUNER_IMPORTING_MAIN"
_STOP_IMPORT_CODE = 79
_FATAL_EXIT_CODE = 80


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


def _run_main_script(path: str, package: str | None) -> None:
    """Runs the user's script as `__mp_main__` up to its search, so pickles find its names.

    A script without an `if __name__ == "__main__":` guard reaches its own search here;
    `ParallelTuner.search` then stops the run (everything the search uses is defined by
    then), and the worker goes on with the chief's search. `package` is the script's
    package when it was run with `python -m` (its relative imports resolve there).
    """
    module = types.ModuleType("__mp_main__")
    module.__file__ = path
    module.__package__ = package
    sys.modules["__main__"] = sys.modules["__mp_main__"] = module
    with open(path, "rb") as f:
        code = compile(f.read(), path, "exec")
    os.environ[_IMPORTING_MAIN_ENV] = "1"
    try:
        exec(code, module.__dict__)
    except SystemExit as e:
        if e.code != _STOP_IMPORT_CODE:
            raise
    finally:
        del os.environ[_IMPORTING_MAIN_ENV]


def main(argv: list[str]) -> None:
    spec_path, parent_pid = argv[0], int(argv[1])
    tuner_id = os.environ["KERASTUNER_TUNER_ID"]
    watchdog = _ParentWatchdog(parent_pid)
    watchdog.start()
    with open(spec_path, "rb") as f:
        header = pickle.load(f)
        spec_offset = f.tell()
    sys.path[:] = header.sys_path
    sys.argv[:] = header.argv
    os.chdir(header.cwd)
    from keras_gpushare.devices import share_gpu

    try:
        share_gpu(memory_growth=True, memory_limit_mb=header.memory_limit_mb)
    except RuntimeError as e:
        logger.warning("Worker %s could not configure GPU memory: %s", tuner_id, e)
    if header.main_path is not None:
        _run_main_script(header.main_path, header.main_package)
    with open(spec_path, "rb") as f:
        f.seek(spec_offset)
        tuner_class, args, kwargs, fit_args, fit_kwargs = pickle.load(f)
    from keras_tuner import errors

    tuner = tuner_class(*args, **kwargs)
    try:
        tuner.search(*fit_args, **fit_kwargs)
    except errors.FatalError as e:
        logger.error("Worker %s: %s: %s", tuner_id, type(e).__name__, e)
        with open(f"{spec_path}.{tuner_id}.fatal", "wb") as f:
            pickle.dump(e, f)
        watchdog.stop_event.set()
        sys.exit(_FATAL_EXIT_CODE)
    watchdog.stop_event.set()


if __name__ == "__main__":
    main(sys.argv[1:])
