"""The Markdown of runs and studies: ``summary.md`` of a run, ``docs/results.md`` of a study.

It renders the statistics of :mod:`lmc.experiments.stats` and computes none.
"""
