"""Contracts every layer shares; imports nothing of ours.

    columns.py, validate.py   the column contract of steps and advantages, and its checks
    layout.py                 the store's path grammar: ids, folders, file names
    config.py                 the actors' and environments' shared config models
    policy.py                 `--policy` values and the staleness rule
    errors.py                 GagpoError and its kinds: one line for the user
    cli.py, cli_models.py,    CLI plumbing: one-line errors, flags generated from pydantic
    overrides.py, suggest.py  models, `--set` overrides, "did you mean"
    extras.py, loader.py,     optional-dependency checks, `load_object`, `derive_seed`,
    seeds.py, cache.py,       the cache root, Ctrl-C handling of child processes
    signals.py
    lazy.py                   a package's names re-exported, each imported on first use

The storage engine that writes and reads these contracts is gagpo.storage.
"""
