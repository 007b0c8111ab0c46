"""``streamrl`` command line: run a config, validate one, report on a run, merge its timeline trace,
host reward servers, make CURVE keys."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import signal
import sys
from collections.abc import Sequence


def _cmd_run(args: argparse.Namespace) -> int:
    from streamrl.config import ConfigError
    from streamrl.runtime.launcher import RunFailed, run
    from streamrl.runtime.stage import StageError

    config, overrides = args.config, list(args.overrides)
    if args.resume is not None and config is not None and "=" in config and not config.endswith((".yaml", ".yml")):
        config, overrides = None, [config, *overrides]  # `--resume DIR key=value`: no config, overrides only
    if config is None and args.resume is None:
        print("streamrl: run needs a CONFIG file, or --resume RUN_DIR", file=sys.stderr)
        return 2
    try:
        result = run(config, overrides, resume=args.resume)
    except ConfigError as exc:
        print(f"streamrl: config error: {exc}", file=sys.stderr)
        return 2
    except (StageError, RunFailed) as exc:
        print(f"streamrl: run failed: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("streamrl: interrupted; every process was stopped", file=sys.stderr)
        return 130
    if args.print_result:
        import json

        print(json.dumps({"run_dir": str(result.run_dir), "steps": result.steps, "final_reward": result.final_reward,
                          "setup_s": result.setup_s, "train_s": result.train_s, "total_s": result.total_s,
                          "time_to_target_s": result.time_to_target_s, "stop_reason": result.stop_reason,
                          "resumed_from": result.resumed_from, "restarts": result.restarts}))
    return 0


def _cmd_validate(args: argparse.Namespace) -> int:
    from streamrl.config import ConfigError, dump_config, load_config
    from streamrl.runtime.pipeline import load_pipeline, resolve_run_length

    try:
        cfg = resolve_run_length(load_config(args.config, args.overrides))
        pipe = load_pipeline(cfg)
    except ConfigError as exc:
        print(f"streamrl: config error: {exc}", file=sys.stderr)
        return 2
    print(dump_config(cfg), end="")
    print(f"# pipeline {pipe.name} ({pipe.path}): " + " -> ".join(s.name for s in pipe.stages))
    return 0


def _cmd_report(args: argparse.Namespace) -> int:
    from streamrl.metrics.report import ReportError, write_report

    try:
        report = write_report(args.run_dir, args.out)
    except ReportError as exc:
        print(f"streamrl: report: {exc}", file=sys.stderr)
        return 2
    print(report.index)
    return 0


def _cmd_trace(args: argparse.Namespace) -> int:
    from streamrl.metrics.trace import TraceError, merge_trace

    try:
        path = merge_trace(args.run_dir, args.out)
    except TraceError as exc:
        print(f"streamrl: trace: {exc}", file=sys.stderr)
        return 2
    print(path)
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="streamrl", description="RL training of language models as a streaming dataflow")
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("run", help="run a config: streamrl run configs/grpo_digits.yaml [key=value ...]; "
                                   "continue one: streamrl run --resume runs/<run>")
    p.add_argument("config", nargs="?", default=None,
                   help="the run config (with --resume: optional, default RUN_DIR/config.yaml)")
    p.add_argument("overrides", nargs="*", help="field overrides, e.g. algo.lr=3e-4 resources.launch=inprocess")
    p.add_argument("--print-result", action="store_true", help="print a JSON summary line at the end")
    p.add_argument("--resume", metavar="RUN_DIR", default=None,
                   help="continue RUN_DIR from its newest checkpoint (output.checkpoint_every), in the same directory")
    p.set_defaults(func=_cmd_run)
    v = sub.add_parser("validate", help="check a config and its pipeline without running; print the resolved config")
    v.add_argument("config")
    v.add_argument("overrides", nargs="*")
    v.set_defaults(func=_cmd_validate)
    r = sub.add_parser("report", help="plots and an index.html summary of a run: streamrl report runs/<run>")
    r.add_argument("run_dir", help="a run directory (holds metrics.jsonl and config.yaml)")
    r.add_argument("--out", default=None, help="where to write the report (default: RUN_DIR/report)")
    r.set_defaults(func=_cmd_report)
    t = sub.add_parser("trace", help="merge a run's timeline (running, finished or crashed) into RUN_DIR/trace.json "
                                     "for ui.perfetto.dev or chrome://tracing: streamrl trace runs/<run>")
    t.add_argument("run_dir", help="a run directory (its workers write trace/<stage>-<worker>.json)")
    t.add_argument("--out", default=None, help="where to write the merged trace (default: RUN_DIR/trace.json)")
    t.set_defaults(func=_cmd_trace)
    try:  # reward servers and keys live with the rewards package
        importlib.import_module("streamrl.rewards.cli").register_commands(sub)
    except (ImportError, AttributeError):
        pass
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=os.environ.get("STREAMRL_LOG", "WARNING"), format="%(name)s: %(message)s")
    # SIGTERM behaves like Ctrl-C: re-raised as SIGINT, which the event loop turns into a clean
    # cancellation (raising inside the handler could land in the middle of a cancel scope)
    signal.signal(signal.SIGTERM, lambda *_: signal.raise_signal(signal.SIGINT))
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        # A command started with `&` from a script inherits SIGINT ignored: the re-raised SIGINT
        # would then vanish and SIGTERM would never stop the run (seen: a run kept training).
        # No terminal's Ctrl-C reaches a background job anyway, so nothing is lost by restoring it.
        signal.signal(signal.SIGINT, signal.default_int_handler)
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
