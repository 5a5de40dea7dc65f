"""The one wall-clock limit the tests use: a guard against hangs, never a check of speed.

A test checks behaviour (issue 24 item 8). Where it must bound a wait (a subprocess, a
thread, a worker), it waits `HANG_GUARD_S`, far above the normal time (a minute at most on
a quiet 2-core machine), so a busy or twice-as-slow machine fails no test: only a hang does.
pytest-timeout's limit for a whole test (pyproject.toml) is above it, so the wait that hangs
reports itself first.
"""

HANG_GUARD_S = 900
