"""`python -m kvshot <stage> ...`: the only entry point the Snakemake rules call."""
from __future__ import annotations

import argparse
import errno
import json
import sys
import traceback
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from .config import ConfigError, fill_defaults, runtime, typed_config
from .settings import Config
from kvshot.core.gguf import GGUFError
from kvshot.core.io import DataError
from kvshot.core import numerics
from kvshot.core.progress import quiet_library_bars


def _cmd_prepare_data(args, cfg) -> dict:
    from kvshot.data.split import prepare_data

    d = cfg.data
    n_train = args.train_samples if args.train_samples is not None else d.train_samples
    return prepare_data(d.sources, n_train, d.eval_samples, cfg.seed, args.out, val_samples=d.val_samples)


def _cmd_regenerate_data(args, cfg) -> dict:
    from kvshot.capture.regenerate import run_regenerate_stage

    return run_regenerate_stage(cfg, runtime(cfg), args.train, args.target, args.out)


def _cmd_train_tokenizer(args, cfg) -> dict:
    from kvshot.data.tokenizer import build_tokenizer

    return build_tokenizer(cfg.tokenizer, args.train, args.out)


def _cmd_target(args, cfg) -> dict:
    from kvshot.capture.target import run_target_stage

    m = run_target_stage(cfg, runtime(cfg), args.train, args.eval, args.tokenizer, args.out, args.metrics)
    return {k: m[k] for k in ("heldout_loss", "heldout_ppl", "parameters") if k in m}


def _cmd_capture_features(args, cfg) -> dict:
    from kvshot.capture.features import capture_split

    return capture_split(cfg, runtime(cfg), args.split, args.target, args.out)


def _cmd_train_drafter(args, cfg) -> dict:
    from kvshot.train.loop import STOP_EXIT_CODE, StoppedForRuntime, train_variant

    if args.seed is not None:
        cfg = replace(cfg, seed=args.seed)
    if len(args.variant) > 1:   # a group (drafters.group_training): one stream of batches for all
        from kvshot.train.group import train_group

        names = args.variant
        root = args.checkpoints or f"{args.out}.ckpt"   # each member's checkpoint: <root>/<variant>/seed<N>.ckpt
        try:
            ms = train_group(cfg, runtime(cfg), names, args.train_features, args.eval_features, args.target,
                             [str(Path(args.out) / n) for n in names], args.runtime_minutes,
                             val_dir=args.val_features,
                             ckpt_dirs=[str(Path(root) / n / f"seed{cfg.seed}.ckpt") for n in names])
        except StoppedForRuntime:
            sys.exit(STOP_EXIT_CODE)
        return {n: {k: m.get(k) for k in ("steps", "stopped_by", "train_seconds")} for n, m in ms.items()}
    (name,) = args.variant
    entry = next((v for v in cfg.drafters.variants if v.name == name), None)
    if entry is not None and entry.weights:   # a published head (variant `weights:`): imported, not trained
        from kvshot.interop.published import import_variant

        return import_variant(cfg, name, args.target, args.train_features, args.out)
    try:
        m = train_variant(cfg, runtime(cfg), name, args.train_features, args.eval_features, args.target,
                          args.out, args.runtime_minutes, val_dir=args.val_features)
    except StoppedForRuntime:   # checkpointed before the job's limit: a distinct code, so a retry resumes
        sys.exit(STOP_EXIT_CODE)
    return {k: m.get(k) for k in ("variant", "steps", "stopped_by", "train_seconds", "eval")}


def _cmd_export(args, cfg) -> dict:
    from kvshot.interop.dflash import export_dflash
    from kvshot.interop.export import export_eagle3

    # the features' aux layers; None: EAGLE-3's default for the target's depth (with --target)
    features = cfg.features if cfg else Config.from_dict(fill_defaults({"features": {"aux_layers": None}})).features
    aux, rule = features.aux_layers, features.aux_rule
    if args.format == "dflash":
        return export_dflash(args.drafter, args.out, args.target, aux, args.dtype, aux_rule=rule,
                             mask_token_id=args.mask_token_id)
    return export_eagle3(args.drafter, args.out, args.target, aux, args.dtype, aux_rule=rule)


def _cmd_import(args, cfg) -> dict:
    from kvshot.interop.published import import_eagle3

    if args.format == "dflash":
        from kvshot.interop.dflash import import_dflash

        return import_dflash(args.checkpoint, args.target, args.out)

    # eagle3: either layout, found from config.json; speculators: vLLM's layout only
    layout = "auto" if args.format == "eagle3" else args.format
    overrides = {"norm_output_convention": args.norm_output_convention,
                 "norm_before_residual": None if args.norm_before_residual is None else args.norm_before_residual == "true"}
    return import_eagle3(args.checkpoint, args.target, args.out, layout=layout, aux_convention=args.aux_convention,
                         overrides={k: v for k, v in overrides.items() if v is not None})


def _cmd_target_continuations(args, cfg) -> dict:
    from kvshot.evaluate.references import run_continuations_stage

    return run_continuations_stage(cfg, runtime(cfg), args.eval, args.target, args.out, args.natural_out)


def _cmd_eval_stepwise(args, cfg) -> dict:
    from kvshot.evaluate.stepwise import run_stepwise_stage

    return run_stepwise_stage(cfg, runtime(cfg), args.drafter, args.target, args.continuations,
                              args.features_index, args.out, args.natural, args.natural_out)


def _cmd_eval_e2e(args, cfg) -> dict:
    from kvshot.evaluate.e2e import run_e2e_stage

    return run_e2e_stage(cfg, runtime(cfg), args.drafter, args.target, args.prompts, args.features_index, args.out)


def _cmd_eval_benchmarks(args, cfg) -> dict:
    from kvshot.evaluate.benchmarks import run_benchmarks_stage

    return run_benchmarks_stage(cfg, runtime(cfg), args.drafter, args.target, args.eval, args.features_index, args.out)


def _cmd_e2e_timing(args, cfg) -> dict:
    from kvshot.evaluate.e2e import run_e2e_timing_stage

    return run_e2e_timing_stage(cfg, runtime(cfg), args.reference, args.hybrid, args.target, args.prompts,
                                args.features_index, args.out)


def _cmd_report(args, cfg) -> dict:
    from .report import run_report

    names = [v.name for v in cfg.drafters.variants]
    verdicts = run_report(args.results, names, args.tables, args.figures, args.claims_md, args.claims_json,
                          with_benchmarks=args.benchmarks)
    if args.fingerprints:   # after the claims: they are the last stage hashed
        from .report.fingerprint import write_fingerprints

        run = write_fingerprints(args.results, args.fingerprints, numerics.describe(cfg.numerics))
        verdicts = {**verdicts, "fingerprint": run}
    return verdicts


def _cmd_compare_runs(args, cfg) -> dict:
    from .report.fingerprint import compare_runs, comparison_text

    report = compare_runs(args.first, args.second)
    text = comparison_text(report, args.first, args.second)
    print(text, end="")
    if args.out:
        from kvshot.core.io import write_text

        write_text(args.out, text)
    return {"first_difference": report["first"]}


def _cmd_serve(args, cfg) -> dict:
    from kvshot.serve.environment import have_vllm, rerun_in_venv

    if not have_vllm():   # the project's environment: the same command in vLLM's own (built once per machine)
        rerun_in_venv(sys.argv[1:])
    from kvshot.serve.stage import run_serve_stage

    return run_serve_stage(cfg, runtime(cfg), args.target, args.export, args.drafter, args.assistant, args.prompts,
                           args.features_index, args.out, args.table)


def _cmd_scaling_report(args, cfg) -> dict:
    from .report import run_scaling_report

    return run_scaling_report(args.results, list(cfg.scaling.train_samples), list(cfg.scaling.variants),
                              args.figure, args.table)


def _cmd_curve_report(args, cfg) -> dict:
    from .report.curve import run_curve_report

    c = cfg.curve
    if c is None:
        raise ConfigError("config: curve: missing (variants, tokens, points): the curve report needs it")
    from kvshot.train.curve import curve_seeds, unknown_variant

    problem = unknown_variant(c.variants, {v.name for v in cfg.drafters.variants})
    if problem:
        raise ConfigError(f"config: {problem}")
    seeds = curve_seeds(c.seeds, cfg.drafters.seeds, cfg.seed)
    return run_curve_report(args.results, list(c.variants), seeds, c.flat_gain, c.target_acc, args.figure, args.table)


def _cmd_blockwise_report(args, cfg) -> dict:
    from .report.blockwise import run_blockwise_report

    block = [v.name for v in cfg.blockwise.variants] if cfg.blockwise else []
    if not block:
        raise ConfigError("config: blockwise.variants: no block variants to report on")
    chains = [v.name for v in cfg.drafters.variants if v.paradigm == "kv"]
    remedies = [v.name for v in cfg.blockwise.remedies or ()]
    hybrids = [v.name for v in cfg.drafters.variants if v.paradigm == "hybrid"]
    main = [v.name for v in cfg.drafters.variants]
    return run_blockwise_report(args.results, block, chains, args.figure, args.table, args.claims_md, args.claims_json,
                                remedies, hybrids, main, args.decay_figure, args.depth_figure)


def _cmd_drift_report(args, cfg) -> dict:
    from .report.drift import run_drift_report

    from .checks import drift_name_problems

    drift = cfg.drift
    if not drift or not drift.variants:
        raise ConfigError("config: drift.variants: no EAGLE-3.1 variants to report on")
    for path, problem in drift_name_problems(cfg.to_dict())[:1]:   # the config checks read plain data
        raise ConfigError(f"config: {'.'.join(path)}: {problem}")
    return run_drift_report(args.results, [v.name for v in drift.variants], list(drift.compare or ()),
                            list(drift.blocks), args.figure, args.table, args.claims_md, args.claims_json)


def _cmd_published_table(args, cfg) -> dict:
    from .report.published import published_table

    if not cfg.published or not cfg.published.heads:
        raise ConfigError("config: published.heads: no published heads to tabulate")
    return published_table(cfg.published, args.results, args.table)


def _cmd_readme(args, cfg) -> dict:
    from .report import update_readme

    update_readme(args.results, [v.name for v in cfg.drafters.variants], args.readme, args.image, args.full, args.block,
                  args.rounding)
    return {"readme": args.readme, "image": args.image}


@dataclass(frozen=True)
class Stage:
    """One `python -m kvshot <stage>`: what it runs, the config sections it validates, its line in
    --help, the path flags it requires (described in PATH_HELP) and its other arguments."""

    run: Callable[[argparse.Namespace, Config | None], dict]
    sections: tuple[str, ...]
    help: str
    paths: tuple[str, ...] = ()
    options: tuple[tuple[str, dict], ...] = ()   # (flag or positional name, add_argument keywords)
    config: bool = True                          # --config required (export and import read none)


# what each path flag names
PATH_HELP = {
    "out": "output file or folder (written atomically)",
    "train": "train split JSONL (results/data/train.jsonl)",
    "eval": "eval split JSONL (results/data/eval.jsonl)",
    "tokenizer": "tokenizer folder (results/target/tokenizer)",
    "metrics": "where to write the target's metrics JSON",
    "split": "the split JSONL to capture features for",
    "target": "target folder (results/target)",
    "variant": "drafter variant name from drafters.variants (several: trained side by side on one stream of "
               "batches, each into <out>/<variant>)",
    "train-features": "train features folder (results/features/train)",
    "eval-features": "eval features folder (results/features/eval): the final teacher-forced metrics",
    "drafter": "the variant's drafter folders, one per training seed (results/drafters/<variant>/seed<N>)",
    "continuations": "target continuations JSON (results/eval/continuations.json)",
    "prompts": "the decoding prompts: the natural protocol's real prefixes (results/eval/natural.json)",
    "reference": "EAGLE-3's drafter folders, one per training seed (results/drafters/<variant>/seed<N>)",
    "hybrid": "the hybrid's drafter folders, one per training seed, in the same seed order",
    "features-index": "a features index.json (its aux layers are the drafter's inputs)",
    "results": "the results folder",
    "tables": "folder for the tables (csv, md, tex)",
    "figures": "folder for the figures (pdf)",
    "claims-md": "where to write the claims verdict (markdown)",
    "claims-json": "where to write the claims verdict (JSON)",
    "figure": "where to write the figure (scaling or block-wise)",
    "table": "where to write the table (scaling or block-wise)",
}
# nargs +: one variant's drafters, one per training seed; or a group of variants trained side by side
MANY = ("drafter", "reference", "hybrid", "variant")
REPORT_PATHS = ("results", "figure", "table", "claims-md", "claims-json")
THREADS = ("--threads", dict(type=int, default=None, help="torch threads"))

STAGES = {
    "prepare-data": Stage(
        _cmd_prepare_data, ("data",),
        "read the configured sources, clean, dedupe and split them into train/eval/val JSONL + stats.json",
        ("out",),
        (("--train-samples", dict(type=int, default=None, help="override data.train_samples (scaling sweeps)")),)),
    "regenerate-data": Stage(
        _cmd_regenerate_data, ("data", "target"),
        "(optional) the target rewrites the train answers (data.regenerate)", ("train", "target", "out")),
    "train-tokenizer": Stage(
        _cmd_train_tokenizer, ("tokenizer",),
        "train the byte-level BPE on the train split, or save the pretrained target's tokenizer", ("train", "out")),
    "target": Stage(
        _cmd_target, ("data", "target"),
        "pretrain the small target (or load the pretrained one or the GGUF file) and score it on held-out text",
        ("train", "eval", "tokenizer", "out", "metrics")),
    "capture-features": Stage(
        _cmd_capture_features, ("data", "target", "features"),
        "run the target over a split and store hidden states and KV (offline) or tokens (online)",
        ("split", "target", "out")),
    "train-drafter": Stage(
        _cmd_train_drafter, ("drafters",),
        "train one drafter variant with the TTT objective (checkpoints, resume, DDP)",
        ("variant", "train-features", "eval-features", "target", "out"),
        (("--seed", dict(type=int, default=None,
                         help="the training seed (drafter init and data order; default: config `seed`)")),
         ("--val-features", dict(default=None, help="validation features folder (results/features/val), read by the "
                                 "held-out curve and plateau stop (default: --eval-features, recorded as metrics "
                                 "heldout_split: eval)")),
         ("--runtime-minutes", dict(type=float, default=None, help="the job's wall-clock limit: checkpoint and exit "
                                    "75 at this less drafters.train.stop_margin_minutes, counted from process start")),
         ("--checkpoints", dict(default=None, help="several variants: each member's checkpoint goes to "
                                "<this>/<variant>/seed<N>.ckpt (results/drafters: where it trains alone; default: "
                                "<out>.ckpt)")))),
    "target-continuations": Stage(
        _cmd_target_continuations, ("target", "eval"),
        "the target's greedy continuations of the eval prompts (the step-wise reference)", ("eval", "target", "out"),
        (("--natural-out", dict(default=None, help="natural protocol: where to write the target's rollouts "
                                "(target-continuations) or their step-wise results (eval-stepwise)")),)),
    "eval-stepwise": Stage(
        _cmd_eval_stepwise, ("target", "drafters", "eval"),
        "chain-drafting simulation: per-step acceptance alpha_k, MAT, retention, intervals",
        ("drafter", "target", "continuations", "features-index"),
        (("--out", dict(required=True, nargs="+", help=PATH_HELP["out"] + " (several: one per variant, in the order "
                        "of the drafters' variants, scored in one target pass)")),
         ("--natural-out", dict(default=None, nargs="+", help="natural protocol: where to write the target's rollouts "
                                "(target-continuations) or their step-wise results (eval-stepwise)")),
         ("--natural", dict(default=None, help="the target's rollouts at real anchors (results/eval/natural.json)")))),
    "eval-e2e": Stage(
        _cmd_eval_e2e, ("target", "drafters", "eval"),
        "real speculative decoding (chain and tree) against plain decoding: tau, speedup, lossless",
        ("drafter", "target", "prompts", "features-index", "out")),
    "eval-benchmarks": Stage(
        _cmd_eval_benchmarks, ("target", "drafters", "eval"),
        "speculative decoding per prompt set (eval.e2e.benchmarks) and temperature: tau, speedup",
        ("drafter", "target", "eval", "features-index", "out")),
    "e2e-timing": Stage(
        _cmd_e2e_timing, ("target", "drafters", "eval"),
        "EAGLE-3's and the hybrid's drafting time per round, timed alternately in one process",
        ("reference", "hybrid", "target", "prompts", "features-index", "out")),
    "serve": Stage(
        _cmd_serve, ("target", "drafters", "eval", "serve"),
        "the exported EAGLE-3 drafters in vLLM (its own environment) beside kvshot's decoder, HF generate, HF assisted "
        "generation and prompt lookup: lossless checks, vLLM's acceptance counters beside kvshot's, tokens/s",
        ("drafter", "target", "prompts", "features-index", "out", "table"),
        (("--export", dict(nargs="+", required=True, help="EAGLE-3 folders (kvshot export), one per --drafter, "
                                                         "in the same order")),
         ("--assistant", dict(default=None, help="the standalone drafter folder: HF assisted generation's draft "
                                                 "model (omitted: no assisted rows)")))),
    "scaling-report": Stage(
        _cmd_scaling_report, ("drafters", "scaling"),
        "MAT against the number of training samples (figures/scaling.pdf)", ("results", "figure", "table")),
    "curve-report": Stage(
        _cmd_curve_report, ("drafters", "curve"),
        "held-out acc_k against training tokens: the table (--table, .csv and .json beside), figures/curve.pdf, "
        "where each curve flattens", ("results", "figure", "table")),
    "blockwise-report": Stage(
        _cmd_blockwise_report, ("drafters", "blockwise"),
        "block-wise drafters vs the KV-only chains: figures/blockwise.pdf, table, verdicts", REPORT_PATHS,
        (("--decay-figure", dict(default=None, help="the decay figure with the block and remedy variants beside "
                                 "the default run's")),
         ("--depth-figure", dict(default=None, help="the depth figure with block-wise KV beside KV-only")))),
    "drift-report": Stage(
        _cmd_drift_report, ("drafters", "drift", "blockwise"),
        "EAGLE-3.1 and its ablations vs EAGLE-3, KV-only, hybrid, block-wise: figures/drift.pdf, table, verdicts",
        REPORT_PATHS),
    "published-table": Stage(
        _cmd_published_table, ("published",),
        "published heads' tau (results/published/<head>/e2e.json) beside the publishers' figures", ("results", "table")),
    "report": Stage(
        _cmd_report, ("drafters",), "tables, figures and the claims verdict from the result files",
        ("results", "tables", "figures", "claims-md", "claims-json"),
        (("--benchmarks", dict(action="store_true", help="also results/tables/benchmarks.* and figures/benchmarks.pdf "
                               "from results/eval/<variant>/benchmarks.json (eval.e2e.benchmarks)")),
         ("--fingerprints", dict(default=None, help="also write each stage's fingerprint, the run's and the machine's "
                                 "description here (results/fingerprints.json)")))),
    "compare-runs": Stage(
        _cmd_compare_runs, (), "two runs' results folders stage by stage: the first output that differs and the "
        "first tensor, field or line in it", (),
        (("first", dict(help="a results folder")), ("second", dict(help="another results folder")),
         ("--out", dict(default=None, help="also write the comparison here"))), config=False),
    "readme": Stage(
        _cmd_readme, ("drafters",), "regenerate the README's results block", (),
        (("--results", dict(default="results", help="the results folder of a finished run")),
         ("--readme", dict(default="README.md", help="the README whose results block is replaced")),
         ("--image", dict(default="docs/decay.png", help="where to copy the decay figure as PNG")),
         ("--full", dict(default=None, help="the full tables and verdicts (default: results.md beside --image)")),
         ("--block", dict(default="results", help="the README block to replace, between <!-- BLOCK:start --> and "
                          "<!-- BLOCK:end --> (smollm2: the real target's run)")),
         ("--rounding", dict(default=None, help="the results folder of the same run in the other numerics "
                             "(--config numerics=native): a verdict that differs there is marked fragile")))),
    # EAGLE-3 checkpoints (kvshot.interop.export); --config optional: only features.aux_layers is read
    "export": Stage(
        _cmd_export, ("features",), "write a drafter as a checkpoint serving engines load", (),
        (("drafter", dict(help="a trained drafter folder (results/drafters/<variant>/seed<N>)")),
         ("out", dict(help="the checkpoint folder to write")),
         ("--format", dict(choices=["eagle3", "dflash"], required=True,
                           help="checkpoint layout (docs/drafter_format.md): eagle3 (a one-layer hidden-only head) or "
                                "dflash (a block-dflash drafter, vLLM's DFlash folder)")),
         ("--target", dict(default=None, help="the target folder: max positions, aux layers, checks")),
         ("--mask-token-id", dict(type=int, default=None,
                                  help="dflash: the id vLLM's mask slots carry (default: the vocabulary's last)")),
         ("--dtype", dict(choices=["float32", "bfloat16", "float16"], default="float32",
                          help="dtype of the written weights")),
         ("--config", dict(action="append", default=None, help="optional: only features.aux_layers is read")),
         THREADS), config=False),
    "import": Stage(
        _cmd_import, (), "read an EAGLE-3 or DFlash checkpoint folder into a kvshot drafter", (),
        (("checkpoint", dict(help="an EAGLE-3 or DFlash checkpoint folder (config.json + weights)")),
         ("out", dict(help="the kvshot drafter folder to write")),
         ("--format", dict(choices=["eagle3", "speculators", "dflash"], required=True,
                           help="eagle3: an EAGLE-3 head in either layout (SpecForge/SGLang or speculators); "
                                "speculators: that one only; dflash: vLLM's DFlash folder (kvshot export --format dflash)")),
         ("--aux-convention", dict(choices=["vllm", "sglang"], default=None,
                                   help="override: how the head's aux layer ids count, vllm (input of layer i) or "
                                        "sglang (output of layer i); default: resolved from the file "
                                        "(docs/published-heads.md)")),
         ("--norm-output-convention", dict(choices=["vllm", "specforge"], default=None,
                                           help="override: whose norm_output the head follows, vllm (post-norm state "
                                                "carried) or specforge (the head's norm only); default: resolved from "
                                                "the file")),
         ("--norm-before-residual", dict(choices=["true", "false"], default=None,
                                         help="override: the first layer's residual is hidden_norm(h); default: the "
                                              "config's key, or when absent the engine's default for the layout")),
         ("--target", dict(required=True, help="the target folder (its embedding fills the drafter's)")),
         ("--config", dict(action="append", default=None, help="optional config (not read by import)")),
         THREADS), config=False),
}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvshot", description=__doc__ + " Each stage's --help lists its flags.")
    sub = p.add_subparsers(dest="stage", required=True, metavar="<stage>")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--config", action="append", required=True,
                        help="config file or inline JSON; repeat to overlay (later wins)")
    common.add_argument("--threads", type=int, default=None, help="torch threads (default: config `threads`)")
    for name, stage in STAGES.items():
        s = sub.add_parser(name, parents=[common] if stage.config else [], help=stage.help, description=stage.help)
        for path in stage.paths:
            s.add_argument(f"--{path}", required=True, help=PATH_HELP[path],
                           **({"nargs": "+"} if path in MANY else {}))
        for flag, kwargs in stage.options:
            s.add_argument(flag, **kwargs)
    return p


def os_error_line(exc: OSError, output: str | None = None) -> str:
    """One line for a failed read or write: the file, the reason, what to do."""
    where = exc.filename or (f"writing {output}" if output else "<unknown file>")
    hint = {errno.ENOSPC: "free disk space, then rerun (completed outputs are kept)",
            errno.EDQUOT: "free quota, then rerun (completed outputs are kept)",
            errno.EROFS: "the file system is read-only: run from a writable folder",
            errno.EACCES: "no permission: fix the folder's permissions or run from a writable folder",
            errno.EPERM: "not permitted: run from a writable folder"}
    return f"{where}: {exc.strerror or exc}" + (f"; {hint[exc.errno]}" if exc.errno in hint else "")


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    quiet_library_bars()   # under Snakemake stderr is a log file: no tqdm redraws from transformers/hub
    stage = STAGES[args.stage]
    try:
        specs = getattr(args, "config", None)   # export/import: config optional; compare-runs reads none
        cfg = typed_config(specs, stage.sections) if specs else None
        if cfg is not None and args.threads is not None:
            cfg = replace(cfg, threads=args.threads)
        # before any stage imports torch: the libraries read these once (a config-less export: portable)
        mode = cfg.numerics if cfg is not None else "portable"
        set_here = numerics.apply(mode)
        if cfg is not None:   # a pipeline stage: the log's first line says what it computes with
            print(numerics.status_line(mode, set_here), flush=True)
        summary = stage.run(args, cfg)
    except (ConfigError, DataError, FileNotFoundError, GGUFError, numerics.NumericsError) as exc:
        print(f"kvshot {args.stage}: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:   # full disk, read-only or unreadable output: the traceback stays in the log
        traceback.print_exc()
        output = next((getattr(args, a) for a in ("out", "tables", "figure") if getattr(args, a, None)), None)
        output = ", ".join(output) if isinstance(output, list) else output   # eval-stepwise: one --out per variant
        print(f"kvshot {args.stage}: error: {os_error_line(exc, output)}", file=sys.stderr)
        return 2
    except FloatingPointError as exc:   # NaN/inf in training: the message names the step and the checkpoint
        traceback.print_exc()
        print(f"kvshot {args.stage}: error: {exc}", file=sys.stderr)
        return 2
    except RecursionError:
        traceback.print_exc()
        print(f"kvshot {args.stage}: error: an input file is nested too deeply to read (a damaged or hostile "
              f"JSON file?); see the traceback above for which", file=sys.stderr)
        return 2
    print(json.dumps(summary, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
