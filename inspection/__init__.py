"""Inspection: reading a store to understand a run, never writing it.

    sql.py, sql_sources.py,   `gagpo sql`: read-only DuckDB views over the store's
    sql_views.py,             committed files (steps, advantages, groups, learner
    sql_segments.py           metrics, drift), through a file system that can only read
    report.py, report_*.py    `gagpo report`: figures and a Markdown summary from the views
    intervals.py              binomial intervals of success rates
    cli.py                    the `gagpo sql` and `gagpo report` commands
    library.py                `gagpo.open_store`: the same views as Polars frames, and sql()
    view/                     `gagpo view`: the local web app over the same views

Imports schemas, storage and the advantage stage (gagpo.pipeline, to recompute a group's
credit); the learner and the actors never import this package.
"""
