"""`keras-gpushare bench`: the seeds' workload timed as sequential fits, process pools and
packs (private; `benchmarks/` adds its own baselines on top of it)."""
