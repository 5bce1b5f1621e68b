"""``lmc run``: the paper's protocol end to end from one experiment config (paper Section 6).

1. pre-train on half A of the training split (or reuse ``protocol.pretrained``);
2. fine-tune ``protocol.seeds`` seeds on half B, re-initializing ``protocol.reinit`` and freezing
   everything else (:class:`~lmc.training.LMCModule`);
3. for every pair of seeds ``i < j`` and every listed alignment, align seed ``i`` to seed ``j``
   and sweep the naive and the aligned interpolation (25 points by default);
4. summarize every barrier and barrier ratio over the pairs (mean, spread, extremes).

Each stage is a job (:mod:`lmc.experiments.jobs`: processes on this machine by default, or a SLURM
cluster with ``cluster.executor slurm``): pre-training, then each seed's fine-tuning, then each
pair's alignments and sweeps, each pair once both its seeds are trained; the summary follows in
the command's own process. A run folder holds everything, so a rerun after a kill (of the command
or of one job) submits only the unfinished stages, skips finished sweep points and ends with
identical results::

    <output_dir>/
      pretrain/final.ckpt, seed<k>/final.ckpt   each with stage.json (its configuration key)
      pairs/<i>_<j>/<alignment>/                 lmc_results.{json,csv}, figure, sweep state
      pairs/<i>_<j>/robustness.json              with protocol.robustness: accuracy under corruptions
      pairs/<i>_<j>/pair.pkl                     the pair's finished results (its configuration key)
      jobs/                                      each job's log (submitit's <job id>_0_log.err, .out)
      tensorboard/                               training logs; lmc/ holds the curves
      summary.{json,csv,md}, summary_<alignment>.png
      progress.json                              the latest stage, for lmc demo and lmc repro to show

A stage folder made with another configuration is never reused: the run stops and names it
(``protocol.overwrite`` recomputes it and everything after it).
"""

from __future__ import annotations

import dataclasses
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch.utils.data import DataLoader, Dataset, Subset

from lmc.adapters import model_spec
from lmc.checkpoints import load_weights
from lmc.connectivity import (
    Evaluation,
    ResultsOutput,
    SweepHooks,
    data_identity,
    sweep_and_write,
    training_calibration,
)
from lmc.connectivity.interpolation import evenly_spaced
from lmc.connectivity.robustness import midpoint_robustness
from lmc.experiments.jobs import Cluster, Job, run_jobs
from lmc.experiments.progress import Display, Progress
from lmc.experiments.protocol import Protocol, RunError, alignment_labels, experiment_cli
from lmc.experiments.report.run_summary import log_curves, write_summary
from lmc.experiments.stages import Stage, Stages, seed_stage, stage_key, stage_label
from lmc.experiments.stats.summary import ROBUSTNESS, summarize_run
from lmc.experiments.table1 import (
    HEAD_ORDER_NOISE,
    HEAD_ORDERS,
    head_order_noise,
    head_orders,
    picked_orders,
    sweep_head_orders,
)
from lmc.io import atomic_write, folder_lock
from lmc.matching import AlignmentError, AlignOptions, align
from lmc.matching.checks import check_head_orders
from lmc.matching.layers import imposed_order
from lmc.symmetry import scope_blocks
from lmc.training.cli import instantiate_data
from lmc.training.module import LMCModule

#: Protocol fields that do not change a pair's curves (the stages' keys stand for the training).
_NOT_OF_A_PAIR = {"output_dir", "seeds", "pretrained", "pretrain", "finetune", "overwrite"}


def _spread_over(size: int, count: int) -> list[int]:
    """``count`` indices spread evenly over ``range(size)`` (all of it where ``count >= size``).

    Splits are stored in order (by class, by position in a text): their first samples would be one
    class or one passage, while evenly spaced ones keep every part of the split in proportion.
    """
    return list(range(size)) if count >= size else [k * size // count for k in range(count)]


class Experiment(Stages):
    """Runs :class:`Protocol` for one parsed experiment configuration: its training stages
    (:class:`~lmc.experiments.stages.Stages`), the alignments and sweeps of every pair of fine-tuned
    seeds, then their summary.

    Args:
        cli: A LightningCLI (``run=False``) holding the parsed experiment config and its parser.
        protocol: The protocol to run instead of the config's own (``lmc repro`` builds each
            run's); the stages' configs record it, as if it had been given in the config.
    """

    # -- alignment and sweeps ----------------------------------------------------------------

    def curve_data(self, datamodule) -> tuple[Dataset, dict[str, Any]]:
        """The samples the curves are measured on (``protocol.split``, ``eval_samples`` of it evenly
        spaced) and their identity in sweep keys and results."""
        dataset, data = datamodule.split(self.protocol.split), data_identity(datamodule)
        if self.protocol.eval_samples is not None:
            dataset = Subset(dataset, _spread_over(len(dataset), self.protocol.eval_samples))
            data = {**data, "eval_samples": len(dataset), "eval_spacing": "even"}
        return dataset, data

    def sweep_pair(self, stages: list[Stage], checkpoints: list[Path], i: int, j: int) -> dict[str, Any]:
        """Align seed ``i`` to seed ``j`` with every listed alignment and sweep both curves."""
        module, datamodule = self.trained(stages[j], checkpoints[j])
        reference = load_weights(module.build_model(), checkpoints[i]).eval()
        dataset, data = self.curve_data(datamodule)
        loader = DataLoader(dataset, batch_size=self.protocol.eval_batch_size or datamodule.batch_size)
        alphas = evenly_spaced(self.protocol.num_alphas)
        evaluation = Evaluation(
            module.sample_sums,
            loader,
            self.protocol.split,
            data,
            {k: module.hparams.get(k) for k in ("model", "model_config")},
        )
        pair = self.root / "pairs" / f"{i}_{j}"
        calibrations = {}  # calibration_batches -> batches of the fine-tuning half B's training split

        def calibration_for(options: AlignOptions):
            if not options.data_aware:
                return None
            count = options.calibration_batches
            if count not in calibrations:
                calibrations[count] = training_calibration(datamodule, module.model_loss, count)
            return calibrations[count]

        # Each alignment is computed once: a head order's screening and whole sweeps and the
        # robustness table use the same aligned model.
        aligned: dict[str, tuple[Any, Any]] = {}

        def alignment_for(options: AlignOptions):
            key = repr(options)
            if key not in aligned:
                aligned[key] = align(reference, module.model, self.protocol.reinit, options, calibration_for(options))
            return aligned[key]

        def sweep(
            options: AlignOptions, folder: Path, at: list[float] = alphas, figures: bool = True
        ) -> dict[str, Any]:
            # Every curve of the pair shares one naive curve (its points on every grid, end point A's among them).
            naive = pair / "naive_sweep_state.json"
            output = ResultsOutput(folder, str(checkpoints[j]), other_results="replace", figures=figures)
            swept = sweep_and_write(
                output,
                module.model,
                {checkpoints[i]: lambda: reference},
                self.protocol.reinit,
                options,
                at,
                evaluation,
                SweepHooks(naive_state_path=naive),
                calibration_for(options),
                alignment_for(options),
            )
            return swept["references"][str(checkpoints[i])]

        labels, alignments = alignment_labels(self.protocol.alignment_options), self.protocol.alignment_options
        results = {
            label: sweep(options, pair / label, self.protocol.alphas_of(options))
            for label, options in zip(labels, alignments)
        }
        if self.protocol.head_orders:
            orders = head_orders(model_spec(module.model).attention[0])
            picked = picked_orders(results)
            order_alphas = self.protocol.order_alphas
            results[HEAD_ORDERS] = sweep_head_orders(orders, results, order_alphas, pair / "orders", sweep)
            results[HEAD_ORDER_NOISE] = head_order_noise(results[HEAD_ORDERS], picked, pair / "orders", order_alphas)
        if self.protocol.robustness:
            results[ROBUSTNESS] = midpoint_robustness(
                module.model,
                reference,
                {label: alignment_for(options)[0] for label, options in zip(labels, alignments)},
                evaluation,
                datamodule.info,
                pair / "robustness.json",
            )
        return results

    def check_before_work(self) -> None:
        """Refuse, before any training, every setting that would otherwise fail a later stage: the head
        orders (``protocol.head_orders`` scores every order of the first layer; an alignment's
        ``head_orders`` names aligned layers with orders that fit them) and each phase's ``samples``
        (at most its half of the training split)."""
        protocol = self.protocol
        if protocol.head_orders or any(options.head_orders for options in protocol.alignment_options):
            module = LMCModule(self.config.model.model, self.config.model.model_config, self.data_info())
            spec = model_spec(module.model)
            if protocol.head_orders:
                head_orders(spec.attention[0])
            attention, _, _ = scope_blocks(spec, protocol.reinit)
            for label, options in zip(alignment_labels(protocol.alignment_options), protocol.alignment_options):
                try:
                    check_head_orders(options.head_orders, attention, protocol.reinit)
                    for index, order in (options.head_orders or {}).items():
                        imposed_order(order, spec.blocks[index].attention)
                except AlignmentError as error:
                    raise RunError(f"protocol.alignments ({label}): {error}") from None
        phases = {"finetune": self._stage_config(seed_stage(0), {"data.init_args.part": "B"}, protocol.finetune)}
        if protocol.pretrained is None:
            phases["pretrain"] = self.pretrain_stage().config
        for phase, config in phases.items():
            if getattr(protocol, phase).samples is not None:
                try:
                    instantiate_data(config).setup("fit")  # refuses more samples than the half holds
                except ValueError as error:
                    raise RunError(f"protocol.{phase}.samples: {error}") from None

    # -- the run as jobs ---------------------------------------------------------------------

    def pairs(self) -> list[tuple[int, int]]:
        """Every pair of seeds ``i < j``."""
        return [(i, j) for i in range(self.protocol.seeds) for j in range(i + 1, self.protocol.seeds)]

    def _pair_record(self, i: int, j: int) -> Path:
        return self.root / "pairs" / f"{i}_{j}" / "pair.pkl"

    def _pairstage_key(self, stages: list[Stage], i: int, j: int) -> str:
        protocol = {k: v for k, v in dataclasses.asdict(self.protocol).items() if k not in _NOT_OF_A_PAIR}
        return stage_key(stages[i].key, stages[j].key, protocol)

    def _pair_outputs(self, i: int, j: int) -> list[Path]:
        """The files a finished pair has written: each alignment's results, its robustness table."""
        pair = self.root / "pairs" / f"{i}_{j}"
        outputs = [pair / label / "lmc_results.json" for label in alignment_labels(self.protocol.alignment_options)]
        return outputs + ([pair / "robustness.json"] if self.protocol.robustness else [])

    def finished_pair(self, stages: list[Stage], i: int, j: int) -> dict[str, Any] | None:
        """The results of pair ``(i, j)`` if a job of this configuration finished it and its files are
        all there, else ``None`` (a deleted file makes the pair a job again)."""
        record = self._pair_record(i, j)
        if not record.is_file() or not all(path.is_file() for path in self._pair_outputs(i, j)):
            return None
        saved = pickle.loads(record.read_bytes())
        return saved["results"] if saved.get("key") == self._pairstage_key(stages, i, j) else None

    def run_pair(self, i: int, j: int) -> dict[str, Any]:
        """Align and sweep pair ``(i, j)`` of trained seeds and record its results (``pairs/<i>_<j>/pair.pkl``)."""
        stages = self.finetune_stages()
        checkpoints = [stage.checkpoint(self.root) for stage in stages]
        results = self.sweep_pair(stages, checkpoints, i, j)
        record = pickle.dumps({"key": self._pairstage_key(stages, i, j), "results": results})
        atomic_write(self._pair_record(i, j), lambda path: path.write_bytes(record))
        return results

    def run_job(self, name: str) -> None:
        """One job of :meth:`jobs` in this process: ``pretrain``, ``seed<k>`` or ``pair<i>_<j>``."""
        if name == "pretrain":
            self.fit(self.pretrain_stage())
        elif name.startswith("seed"):
            self.fit(self.finetune_stages()[int(name.removeprefix("seed"))])
        else:
            i, j = name.removeprefix("pair").split("_")
            self.run_pair(int(i), int(j))

    def jobs(self, pending_upstream: bool = False) -> list[Job]:
        """The run's jobs with their dependencies; those finished in an earlier run say so.

        Args:
            pending_upstream: The checkpoint the fine-tunings start from is still to be trained by a
                job that is not one of these (``lmc repro``'s pre-training of the family): no
                fine-tuning or pair counts as finished, and none of their keys is read (a
                ``protocol.pretrained`` key needs the file).

        Raises:
            RunError: A stage folder holds another configuration's results (and not ``protocol.overwrite``).
        """
        source = _ExperimentJob(self.parser.dump(self.config), self.config, self.protocol)
        jobs = []
        if self.protocol.pretrained is None:
            jobs.append(
                Job("pretrain", source.step("pretrain"), finished=self._finished(self.pretrain_stage()), fit=True)
            )
        after = ("pretrain",) if self.protocol.pretrained is None else ()
        stages = None if pending_upstream else self.finetune_stages()
        for seed in range(self.protocol.seeds):
            finished = stages is not None and self._finished(stages[seed])
            jobs.append(Job(seed_stage(seed), source.step(seed_stage(seed)), after, finished=finished, fit=True))
        for i, j in self.pairs():
            finished = stages is not None and self.finished_pair(stages, i, j) is not None
            name = f"pair{i}_{j}"
            jobs.append(Job(name, source.step(name), (seed_stage(i), seed_stage(j)), finished))
        return jobs

    def run(self, cluster: Cluster | None = None, display: Display | None = None) -> dict[str, Any]:
        """Every stage as a job on ``cluster`` (``None``: the config's ``cluster`` group), then the summary,
        holding the run folder's lock; returns the summary. Each change of the running stages goes to
        ``progress.json`` and to ``display`` (``None``: plain lines on standard error).

        Raises:
            FolderInUseError: Another ``lmc run`` is writing into the same folder.
            JobFailedError: A job failed (named with its log); the jobs after it were not run.
        """
        import torch

        cluster = cluster or self.cluster
        self.check_before_work()
        self._check_fit_tasks(cluster)
        with folder_lock(self.root, "lmc run"):
            jobs = self.jobs()
            progress = Progress(str(self.root), len(jobs) + 1, self.root, display or Display("plain"), stage_label)
            run_jobs(jobs, cluster, self.root / "jobs", torch.get_num_threads(), progress=progress)
            progress.update(["summarize"], len(jobs))
            summary = self._summarize()
            progress.update([], len(jobs) + 1)
            return summary

    def summarize(self) -> dict[str, Any]:
        """Summarize the finished run again, running nothing; returns the summary. Its measures read
        the pairs' results and recorded sweeps, so a run finished before a measure existed gets it.

        Raises:
            RunError: A stage of the run has not finished (run it first).
            FolderInUseError: Another ``lmc run`` is writing into the same folder.
        """
        if unfinished := [job.name for job in self.jobs() if not job.finished]:
            raise RunError(
                f"{self.root}: {', '.join(unfinished)} not finished, so there is nothing to summarize again: "
                "run it first (lmc run, or lmc repro without --summarize)"
            )
        with folder_lock(self.root, "lmc run"):
            return self._summarize()

    def _check_fit_tasks(self, cluster: Cluster) -> None:
        """Refuse a trainer that would not use the processes a fit's job starts: ``cluster.fit_tasks``
        on each of ``cluster.nodes`` nodes, which Lightning's DDP joins only when the trainer asks for as many."""
        if cluster.executor == "inline":
            return
        trainer, per_node = self.config.trainer, cluster.fit_tasks
        every_gpu = ("-1",) if cluster.gpus_per_job else ()  # devices -1: every GPU the job has
        devices_match = per_node == 1 or str(trainer.devices) in (str(per_node), *every_gpu)
        if trainer.num_nodes != cluster.nodes or not devices_match:
            raise RunError(
                f"each fit's job starts {cluster.nodes} node(s) x {per_node} process(es) (cluster.nodes, "
                f"cluster.tasks_per_node or cluster.gpus_per_job), but the trainer asks for num_nodes "
                f"{trainer.num_nodes} and devices {trainer.devices}: set --trainer.num_nodes {cluster.nodes} "
                f"--trainer.devices {per_node}{' (or -1)' if every_gpu else ''}"
            )

    def _summarize(self) -> dict[str, Any]:
        protocol = self.protocol
        stages = self.finetune_stages()
        pairs = {(i, j): self.finished_pair(stages, i, j) for i, j in self.pairs()}
        folders = {(i, j): self.root / "pairs" / f"{i}_{j}" for i, j in self.pairs()}
        summary = summarize_run(pairs, folders, protocol)
        datamodule = instantiate_data(stages[0].config)
        summary["protocol"] = {
            "output_dir": str(self.root),
            "reinit": protocol.reinit,
            "seeds": protocol.seeds,
            "split": protocol.split,
            "curve_samples": len(self.curve_data(datamodule)[0]),
            "split_samples": len(datamodule.split(protocol.split)),
            # What each seed was fine-tuned on, for the sensitivity study's tables.
            "finetune_samples": len(datamodule.split("train")),
            "finetune_epochs": stages[0].config.trainer.max_epochs,
        }
        write_summary(self.root, summary)
        log_curves(self.root / "tensorboard" / "lmc", pairs, summary)
        return summary


@dataclass(frozen=True)
class _ExperimentJob:
    """What a job process needs to rebuild the :class:`Experiment`: its config and its protocol."""

    dump: str  # the parsed experiment config as YAML, for the job's parser
    config: Any  # the parsed config itself: the stages' keys read it as the command parsed it
    protocol: Protocol

    def step(self, name: str) -> _Step:
        return _Step(self, name)


@dataclass(frozen=True)
class _Step:
    """One job of a run (picklable): rebuilds the experiment in its process and runs the step."""

    source: _ExperimentJob
    name: str

    def __call__(self) -> None:
        experiment = Experiment(experiment_cli(["--config", self.source.dump], run=False), self.source.protocol)
        # A dump loses where group files came from (``__path__``), which the stages' keys hold.
        experiment.config = self.source.config
        experiment.run_job(self.name)
