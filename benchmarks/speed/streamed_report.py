"""The Markdown of :mod:`benchmarks.speed.streamed_align`'s results JSON: its figures and sums of them only."""

from __future__ import annotations

from typing import Any

from benchmarks.speed.streamed_shapes import NAMES, SHAPES, SHARD_BYTES, TARGET


def _gb(value: float) -> str:
    return f"{value / 1e9:.2f} GB"


def _seconds(value: float) -> str:
    return f"{value:.1f} s"


def _shape_text(shape: str) -> str:
    width, layers, heads, kv_heads, intermediate, vocab, tied = SHAPES[shape]
    text = f"{layers} layers, width {width}, {heads} heads, {kv_heads} KV heads, d_h {width // heads}"
    return f"{NAMES.get(shape, shape)} ({text}{', tied' if tied else ''})"


def render(results: dict[str, dict[str, Any]], json_name: str = "streamed_align.json") -> str:
    """The Markdown of a results JSON (what :func:`main` writes beside it): its figures and sums of them only."""
    shapes = list(results)
    threads = sorted({row["threads"] for row in results.values()})
    lines = [
        "# Streamed alignment (`lmc.checkpoint_alignment.align_directories`): time and peak memory, bf16 Llama and "
        "GPT-NeoX shapes",
        "",
        f"Rendered by `python -m benchmarks streamed_align` from `{json_name}` beside this file: do not edit",
        "either by hand. Each row is one run of the script on that shape (rows of several runs are",
        "merged by shape), e.g.",
        "",
        f"    python -m benchmarks streamed_align --shapes {' '.join(shapes)} --threads {' '.join(map(str, threads))}",
        "",
        "Pairs: random bf16 weights (`N(0, 0.02)`, norms `N(0, 1)`), written by the benchmark as Hugging",
        f"Face `save_pretrained` folders with {SHARD_BYTES / 1e9:g} GB shards and an index; source and target",
        'equal outside attention. `all_attention`, `method="full"`. Gram-pass floor: read every attention',
        "tensor of both models through `safe_open` and form each layer's Gram blocks, nothing else. The",
        "rest of the streamed time is the write pass (read both models, transform, write one). I/O floor:",
        "the Gram pass with the I/O no streamed alignment avoids, every tensor of both models read once",
        "and one model written (`measure_io_floor`). Peak RSS: the measuring process's `VmHWM`",
        "(interpreter, torch and transformers included).",
        "",
    ]
    target = results.get(TARGET["shape"], {}).get("all_attention")
    if target is not None:
        met = target["seconds"] < TARGET["seconds"] and target["peak_rss"] < TARGET["peak_rss"]
        one = results[TARGET["shape"]]["model_bytes"]
        lines += [
            f"**{NAMES[TARGET['shape']]} at `all_attention`: {target['seconds'] / 60:.1f} minutes, "
            f"{_gb(target['peak_rss'])} peak RSS** (issue #9's target: under {TARGET['seconds'] / 60:g} minutes "
            f"and {TARGET['peak_rss'] / 1e9:g} GB; {'met' if met else 'missed'}). One model is {_gb(one)}, "
            f"so loading both would take {_gb(2 * one)}.",
            "",
        ]
    lines += [
        "## Streamed `all_attention`",
        "",
        "| shape | one model (bf16) | torch threads | writing the pair | Gram-pass floor | I/O floor | streamed (grams "
        "+ stage 1 + stage 2 + rest) | x Gram-pass floor | x I/O floor | stage 2 per layer | peak RSS | distance "
        "aligned / naive | worst layer probe error |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for shape, row in results.items():
        if "all_attention" not in row:  # measured with --full-model-only
            continue
        streamed, floor = row["all_attention"], row["floor"]
        stages = streamed["stages"]
        rest = streamed["seconds"] - sum(stages.values())
        parts = " + ".join(f"{stages[k]:.1f}" for k in ("grams", "stage1", "stage2")) + f" + {rest:.1f}"
        io_floor = row.get("io_floor")  # rows measured before the I/O floor have none
        io_text = ("-", "-")
        if io_floor:
            io_text = (_seconds(io_floor["seconds"]), f"{streamed['seconds'] / io_floor['seconds']:.2f}")
        lines.append(
            f"| {_shape_text(shape)} | {_gb(row['model_bytes'])} | {row['threads']} | {_seconds(row['write_seconds'])} "
            f"| {_seconds(floor['seconds'])} | {io_text[0]} | **{_seconds(streamed['seconds'])}** ({parts}) "
            f"| {streamed['seconds'] / floor['seconds']:.2f} | {io_text[1]} "
            f"| {stages['stage2'] / SHAPES[shape][1]:.2f} s "
            f"| **{_gb(streamed['peak_rss'])}** | {streamed['distance_ratio']:.4f} "
            f"| {streamed['probe_relative_error']:.1e} |"
        )
    floors = ", ".join(
        f"{NAMES.get(shape, shape)} {_gb(row['floor']['peak_rss'])}" for shape, row in results.items() if "floor" in row
    )
    lines += ["", f"Peak RSS of the Gram-pass floor alone: {floors}."]
    in_memory = {shape: row["full_model"] for shape, row in results.items() if "full_model" in row}
    if in_memory:
        lines += [
            "",
            "## `full_model` in memory",
            "",
            "Measured with `lmc.matching.align` after `from_pretrained` of both bf16 models, a pair independent",
            "everywhere, then `save_pretrained` of the aligned model (rows without a save time: runs of lmc",
            "d93479c and before, which did not save): the reference of the streamed `full_model` below.",
            "",
            "| shape | time (loading both; saving) | peak RSS | x one model | distance aligned / naive | probe "
            "relative error |",
            "|---|---|---|---|---|---|",
        ]
        for shape, run in in_memory.items():
            if "timed_out_after" in run:
                lines.append(
                    f"| {_shape_text(shape)} | not finished in {_seconds(run['timed_out_after'])} | - | - | - | - |"
                )
                continue
            lines.append(
                f"| {_shape_text(shape)} | **{_seconds(run['seconds'])}** ({_seconds(run['load_seconds'])}; "
                f"{_seconds(run['save_seconds']) if 'save_seconds' in run else '-'}) "
                f"| **{_gb(run['peak_rss'])}** | {run['peak_rss'] / results[shape]['model_bytes']:.1f} "
                f"| {run['distance_ratio']:.4f} | {run['probe_relative_error']:.1e} |"
            )
    streamed_full = {shape: row for shape, row in results.items() if "full_model_streamed" in row}
    if streamed_full:
        lines += [
            "",
            "## Streamed `full_model`",
            "",
            "`align_directories` at `full_model` on the independent pair. Floor of one round: read every tensor",
            "of both models once, layer by layer, and run the GEMMs a round needs (Grams, FFN correlations, the",
            "residual correlation). A round of the streamed descent reads each tensor of both models once (a",
            "block's head and residual steps share one read) and each FFN once more, a tensor pair at a time into",
            "its units' correlation, so that the correlation is never held beside both models' FFN (runs of lmc",
            "cf7c59d and before held it: one read); the whole run also reads the anchors before the rounds, each",
            "layer for Stage 2 and both models to write, so the ratio is given per round. Split:",
            "file reads, the assignments (`best_permutation`), the rest (GEMMs, Stage 2, transforms, writes).",
            "",
            "| shape | streamed | rounds | reads + assignments + rest | assignments (size: seconds) "
            "| floor of one round | x floor per round | peak RSS | x in-memory time | distance aligned / naive |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for shape, row in streamed_full.items():
            run, floor = row["full_model_streamed"], row["full_model_floor"]
            split = " + ".join(f"{run['split'][k]:.1f}" for k in ("read", "assignment", "rest"))
            sizes = ", ".join(f"{n}: {t:.1f}" for n, t in run["assignment_seconds_by_size"].items())
            per_round = run["seconds"] / max(1, run["rounds"]) / floor["seconds"]
            in_memory = row.get("full_model", {})
            ratio = f"{run['seconds'] / in_memory['seconds']:.2f}" if "seconds" in in_memory else "-"
            lines.append(
                f"| {_shape_text(shape)} | **{_seconds(run['seconds'])}** | {run['rounds']} | {split} "
                f"| {run['assignments']} ({sizes}) | {_seconds(floor['seconds'])} | {per_round:.2f} "
                f"| **{_gb(run['peak_rss'])}** | {ratio} | {run['distance_ratio']:.4f} |"
            )
        lines += _split_lines(streamed_full)
        lines += _memory_lines(streamed_full)
    lines += ["", "## Machines", ""]
    for shape, row in results.items():
        runs = [(NAMES.get(shape, shape), row)]
        if "full_model_run" in row:
            context = row["full_model_run"]
            runs.append(
                (f"{NAMES.get(shape, shape)}, streamed `full_model` ({context['threads']} torch threads)", context)
            )
        for name, run in runs:
            where = run.get("machine")
            if where is None:
                lines.append(f"- {name}: not recorded (measured before the script recorded it).")
                continue
            commit = f", lmc {where['lmc_commit']}" if "lmc_commit" in where else ""
            lines.append(
                f"- {name}: {where['cpu']}, {where['cores']} cores, {_gb(where['memory_bytes'])} of memory, torch "
                f"{where['torch']}{commit}, load average {where['load_average_before']:.2f} before the run"
                + (f"; {run['note']}." if run.get("note") else ".")
            )
    return "\n".join(lines) + "\n"


def _split_lines(rows: dict[str, dict[str, Any]]) -> list[str]:
    """The time of each streamed ``full_model`` run by phase (:class:`PhaseSplit`)."""
    lines = []
    for shape, row in rows.items():
        split = row["full_model_streamed"].get("split_by_phase")
        if split is None:  # measured before the script split it
            continue
        lines += [
            "",
            f"Time of {NAMES.get(shape, shape)}'s streamed run by phase (setup: the folders opened and the residual",
            "step on the tensors no other permutation moves; a round: the FFN, head and residual steps; GEMMs: the",
            "correlations and Grams; rest: Stage 2's solves, transforms, writes, probe checks):",
            "",
            "| phase | wall | file reads | GEMMs | assignments | rest |",
            "|---|---|---|---|---|---|",
        ]
        for phase, kinds in split.items():
            parts = " | ".join(_seconds(kinds.get(kind, 0.0)) for kind in ("read", "gemm", "assignment", "rest"))
            lines.append(f"| {phase} | {_seconds(kinds['seconds'])} | {parts} |")
    return lines


def _memory_lines(rows: dict[str, dict[str, Any]]) -> list[str]:
    """The memory traces of the streamed ``full_model`` runs (:class:`MemoryTrace`), and what releasing the freed
    memory saved where a run without it was measured beside."""
    lines = []
    for shape, row in rows.items():
        runs = [(key, row[key]) for key in ("full_model_streamed_unreleased", "full_model_streamed") if key in row]
        runs = [(key, run) for key, run in runs if "memory" in run]
        if not runs:
            continue
        lines += [
            "",
            f"Memory of {NAMES.get(shape, shape)} by phase (`RssAnon`, sampled every 0.05 s; peak RSS is `VmHWM`):",
            "",
        ]
        for key, run in runs:
            memory = run["memory"]
            peaks = ", ".join(f"{phase} {_gb(value)}" for phase, value in memory["peak_by_phase"].items())
            kept = "; ".join(
                f"{phase}: {' '.join(f'{value / 1e9:.2f}' for value in values)}"
                for phase, values in memory["after_steps"].items()
            )
            how = "without releasing freed memory" if key.endswith("unreleased") else "as lmc runs it"
            lines.append(
                f"- {how} ({_seconds(run['seconds'])}, peak RSS {_gb(run['peak_rss'])}): peaks {peaks}; "
                f"kept after each step (GB) {kept}."
            )
    return lines
