"""``qsched experiment-merge``: pool result folders of one setting run on different seeds.

A grid is often run in parts - the paper's seeds first, held-out seeds later, or on
two machines - and the question is what all the seeds say together. Merging rebuilds
every aggregate of ``results.json`` from the per-run records the parts keep, so a
merged folder is what one grid over all the seeds would have written (wall times
aside), comparison against the best fixed q included.

Folders run on the same seeds are joined first: a policy tried after the paper grid,
on the paper grid's seeds, joins that grid's fixed q runs, so held-out seeds of the
policy and of fixed q pool with both. A configuration in two such folders is refused
(it would be one run twice), and so are seed sets that overlap without being equal.

Only configurations present in every seed set are kept: a comparison whose fixed q was
run on other seeds than the policy would pair nothing and mix seed luck into the
means. The dropped ones are listed in ``results.json`` and ``results.md``. Seed sets
that all hold the first-order baseline pool it too, and parts of ``--grid baseline``
(the baseline alone) merge into the baseline over all their seeds. A folder written
before a JobSpec field existed counts as holding that field's default.
"""

from __future__ import annotations

import argparse
import copy
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from qsched.lab.experiment import ExperimentError, ExperimentResult, _stats, write_results
from qsched.lab.results import ResultsDocument, ResultsError, read_results
from qsched.protocol.jobspec import JobSpec

__all__ = ["main", "merge_documents"]

# Setting fields that may differ between parts of one setting: the seeds (the point of
# merging) and how long the shared backbone took to pretrain.
_VOLATILE = (("seeds",), ("transfer", "pretrain", "wall_s"))


def _comparable_setting(setting: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(setting)
    for path in _VOLATILE:
        node = out
        for name in path[:-1]:
            node = node.get(name) or {}
        node.pop(path[-1], None)
    if isinstance(out.get("spec"), dict):
        out["spec"] = _spec_with_defaults(out["spec"])
    return out


def _spec_with_defaults(spec: dict[str, Any]) -> dict[str, Any]:
    """The spec with each JobSpec field it lacks at the field's default.

    A folder written before a field existed ran as that field's default, so it must
    compare equal to a newer folder that records the default, and unequal to one that
    records another value.
    """
    defaults = JobSpec().model_dump(mode="json")
    return {**defaults, **spec}


def _check_parts(docs: Sequence[dict[str, Any]], names: Sequence[str]) -> None:
    if len(docs) < 2:
        raise ExperimentError("merging needs at least two result folders")
    reference = _comparable_setting(docs[0]["setting"])
    for doc, name in zip(docs[1:], names[1:], strict=True):
        if _comparable_setting(doc["setting"]) != reference:
            raise ExperimentError(
                f"{name}: its setting differs from {names[0]}'s; only seeds may differ"
            )


def _shared_keys(docs: Sequence[dict[str, Any]]) -> tuple[list[str], list[str]]:
    """Configuration keys in every part (in the first part's order), and the others."""
    key_sets = [{c["key"] for c in doc["configs"]} for doc in docs]
    shared = set.intersection(*key_sets)
    ordered = [c["key"] for c in docs[0]["configs"] if c["key"] in shared]
    dropped = sorted(set.union(*key_sets) - shared)
    return ordered, dropped


def _merge_config(parts: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One configuration over the union of its parts' seeds."""
    first = parts[0]
    for part in parts[1:]:
        if part["policy"] != first["policy"] or part["curve"]["step"] != first["curve"]["step"]:
            raise ExperimentError(
                f"{first['key']}: the folders differ in its policy config or validation schedule"
            )
    runs = sorted((r for p in parts for r in p["runs"]), key=lambda r: r["seed"])
    seeds = [r["seed"] for r in runs]
    if len(set(seeds)) != len(seeds):
        raise ExperimentError(f"{first['key']}: seed run twice across the parts ({seeds})")
    counts = np.asarray([len(p["runs"]) for p in parts], dtype=np.float64)
    acc = np.asarray([r["val_accuracy"] for r in runs], dtype=np.float64)
    passes = np.asarray([p["curve"]["forward_passes_mean"] for p in parts], dtype=np.float64)
    merged = {
        k: first[k]
        for k in ("key", "label", "policy", "numerics", "accumulator", "numerics_token", "steps")
    }
    merged.update(
        seeds=seeds,
        final_accuracy=_stats([r["final_accuracy"] for r in runs]),
        best_accuracy=_stats([r["best_accuracy"] for r in runs]),
        forward_passes=_stats([r["forward_passes"] for r in runs]),
        wall_s=_stats([r["wall_s"] for r in runs]),
        # Each part's mean is over its runs, so weighting by run count gives the pooled mean.
        mean_q=float(np.average([p["mean_q"] for p in parts], weights=counts)),
        curve={
            "step": first["curve"]["step"],
            "val_accuracy_mean": [float(v) for v in acc.mean(axis=0)],
            "val_accuracy_std": [float(v) for v in acc.std(axis=0, ddof=1)],
            "forward_passes_mean": [float(v) for v in np.average(passes, axis=0, weights=counts)],
        },
        q_trajectory=sorted((t for p in parts for t in p["q_trajectory"]), key=lambda t: t["seed"]),
        runs=runs,
    )
    return merged


def _join_same_seeds(docs: Sequence[dict[str, Any]], names: Sequence[str]) -> list[dict[str, Any]]:
    """One document per seed set: the configurations of folders run on the same seeds."""
    groups: dict[tuple[int, ...], dict[str, Any]] = {}
    first_name: dict[tuple[int, ...], str] = {}  # the folder each seed set was first seen in
    for doc, name in zip(docs, names, strict=True):
        seeds = tuple(doc["setting"]["seeds"])
        joined = groups.get(seeds)
        if joined is None:
            groups[seeds] = {**doc, "configs": list(doc["configs"])}
            first_name[seeds] = name
            continue
        have = {c["key"] for c in joined["configs"]}
        for config in doc["configs"]:
            if config["key"] in have:
                raise ExperimentError(
                    f"{config['key']}: run on seeds {list(seeds)} in both "
                    f"{first_name[seeds]} and {name}"
                )
            joined["configs"].append(config)
        joined["baseline"] = _same_baseline(joined, doc, first_name[seeds], name)
    return list(groups.values())


def _same_baseline(joined: dict[str, Any], doc: dict[str, Any], first: str, name: str) -> Any:
    """The baseline of two folders on the same seeds: whichever ran it; equal if both did."""
    kept, other = joined.get("baseline"), doc.get("baseline")
    if kept is None or other is None:
        return other if kept is None else kept
    if kept["final_accuracy"]["values"] != other["final_accuracy"]["values"]:
        # The baseline is a pure function of the setting and the seeds.
        raise ExperimentError(f"{name}: its first-order baseline differs from {first}'s")
    return kept


def _merge_baseline(docs: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """The first-order baseline over all seeds, when every part ran it."""
    if any(doc.get("baseline") is None for doc in docs):
        return None
    baselines: list[dict[str, Any]] = [doc["baseline"] for doc in docs]
    merged = {k: v for k, v in baselines[0].items() if not isinstance(v, dict)}
    for stat in ("final_accuracy", "best_accuracy", "wall_s"):
        # A part's values follow its seeds; the merged ones follow the sorted union.
        by_seed = sorted(
            (seed, value)
            for doc, b in zip(docs, baselines, strict=True)
            for seed, value in zip(doc["setting"]["seeds"], b[stat]["values"], strict=True)
        )
        merged[stat] = _stats([value for _, value in by_seed])
    return merged


def merge_documents(
    docs: Sequence[ResultsDocument], names: Sequence[str], command: str = ""
) -> ExperimentResult:
    """Pool ``results.json`` documents of one setting run on disjoint seeds.

    Args:
        docs: the parts' documents (``read_results``).
        names: where each came from, for messages and the record.
        command: the command line, recorded in the result.

    Returns:
        The merged result, with the configurations every part has.

    Raises:
        ExperimentError: fewer than two parts, settings that differ in more than the
            seeds, a seed in two seed sets, a configuration in two parts on the same
            seeds, or no configuration in common (unless every part holds the
            first-order baseline: ``--grid baseline``).
    """
    data = [doc.as_dict() for doc in docs]
    _check_parts(data, names)
    return _merge(data, names, command)


def _merge(docs: Sequence[dict[str, Any]], names: Sequence[str], command: str) -> ExperimentResult:
    parts = _join_same_seeds(docs, names)
    # Every run of a part is on that part's seeds: disjoint parts count no run twice.
    seeds = sorted(seed for part in parts for seed in part["setting"]["seeds"])
    if len(set(seeds)) != len(seeds):
        raise ExperimentError(f"seed run twice across the parts ({seeds})")
    keys, dropped = _shared_keys(parts)
    baseline = _merge_baseline(parts)
    if not keys and baseline is None:
        raise ExperimentError("the parts have no configuration in common")
    by_key = [{c["key"]: c for c in part["configs"]} for part in parts]
    configs = [_merge_config([part[key] for part in by_key]) for key in keys]
    setting = copy.deepcopy(docs[0]["setting"])
    setting["seeds"] = seeds
    environment = {
        "merged_from": [
            {"folder": n, "command": d.get("command", ""), "environment": d.get("environment")}
            for n, d in zip(names, docs, strict=True)
        ],
        "dropped_configs": dropped,
        "grid_wall_s": round(sum(d["environment"].get("grid_wall_s", 0.0) for d in docs), 1),
    }
    return ExperimentResult(
        setting=setting,
        configs=configs,
        baseline=baseline,
        environment=environment,
        command=command,
    )


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="qsched experiment-merge",
        description="Pool result folders of one "
        "setting run on different seeds into one folder, as if run as one grid; folders on "
        "the same seeds join their configurations first.",
    )
    p.add_argument(
        "folders", nargs="+", type=Path, help="result folders (each with a results.json)"
    )
    p.add_argument("--out", type=Path, required=True, help="output folder")
    p.add_argument("--no-plots", action="store_true")
    return p


def main(argv: list[str], *, stream: Any = None) -> int:
    """``qsched experiment-merge``: merge result folders and write the pooled results.

    Args:
        argv: the command line after ``experiment-merge``.
        stream: where messages and the summary go (default: stderr).

    Returns:
        0, or 2 when the folders cannot be merged.
    """
    args = _parser().parse_args(argv)
    out = stream or sys.stderr
    try:
        docs = [read_results(folder / "results.json") for folder in args.folders]
        command = shlex.join(["qsched", "experiment-merge", *argv])
        result = merge_documents(docs, [str(f) for f in args.folders], command=command)
    except (ResultsError, ExperimentError) as exc:
        print(f"qsched experiment-merge: {exc}", file=out)
        return 2
    files = write_results(result, args.out, plots=not args.no_plots)
    print((args.out / "results.md").read_text(), file=out)
    print("wrote " + ", ".join(str(f) for f in files), file=out)
    return 0
