"""The statistics of a run and of a study over pairs of fine-tuned seeds: spreads, Table 1, verdicts.

They read the pairs' results and recorded sweeps (:mod:`lmc.experiments.run`,
:mod:`lmc.experiments.table1`) and compute no Markdown: :mod:`lmc.experiments.report` renders them.
"""
