"""Everything decided before a process starts, without torch: config (compose, schema, recipes),
the rank layout, validation, what can train, the pipeline schedule simulator, the planner and the
terminal/JSON reports. `partrain train --dry-run` and `partrain plan` run on this package alone.

Never imports torch or transformers (an import contract in pyproject.toml, checked in CI): the
runtime packages (runtime, models, data, parallel, train, checkpoint, simulate, bench) sit above it.
"""
