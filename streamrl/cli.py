"""``streamrl`` command line: run a config, validate one, explain the config's fields, show a run's
status, report on a run, merge its timeline trace, host reward servers, make CURVE keys."""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import importlib
import logging
import os
import signal
import sys
from collections.abc import Sequence

_ran = False  # a run (not another command) was made: console() then skips the interpreter's teardown


def _cmd_run(args: argparse.Namespace) -> int:
    global _ran
    _ran = True
    from streamrl.runtime import startup_gc
    from streamrl.runtime.forkserver import start_forkserver

    startup_gc.pause()  # until the workers are ready (supervision resumes it at Go)

    config, overrides = args.config, list(args.overrides)
    if args.resume is not None and config is not None and "=" in config and not config.endswith((".yaml", ".yml")):
        config, overrides = None, [config, *overrides]  # `--resume DIR key=value`: no config, overrides only
    if config is None and args.resume is None:
        print("streamrl: run needs a CONFIG file, or --resume RUN_DIR", file=sys.stderr)
        return 2
    # The workers' forkserver first: its imports (torch, transformers, the stages) then overlap the
    # launcher's own (torch among them: the config's algorithm registries); run(warm_start=True)
    # stops it again if the config or its checks fail.
    start_forkserver()
    from streamrl.config import ConfigError
    from streamrl.runtime.launcher import RunFailed, run
    from streamrl.runtime.stage import StageError

    try:
        result = run(config, overrides, resume=args.resume, warm_start=True)
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
    from streamrl.runtime.prerun import choose_pipeline, load_pipeline, resolve_run_length

    try:
        cfg = choose_pipeline(resolve_run_length(load_config(args.config, args.overrides)))
        pipe = load_pipeline(cfg)
    except ConfigError as exc:
        print(f"streamrl: config error: {exc}", file=sys.stderr)
        return 2
    print(dump_config(cfg), end="")
    print(f"# pipeline {pipe.name} ({pipe.path}): " + " -> ".join(s.name for s in pipe.stages))
    return 0


_CONFIG_USAGE = """\
usage: streamrl config --help [SECTION]   (or: streamrl config help [SECTION])
           the fields of SECTION with their type, default and description; without SECTION, the sections
       streamrl config show [CONFIG] [key=value ...]
           the resolved config (the defaults without CONFIG) as YAML, each field's description a comment
"""


def _cmd_config(args: argparse.Namespace) -> int:
    from streamrl.config import did_you_mean

    words = list(args.words)
    if args.help_section is not None:
        if args.help_section:  # streamrl config --help SECTION
            return _config_help(args.help_section, words)
        if words and words[0] in ("help", "show"):  # streamrl config show --help
            print(_CONFIG_USAGE, end="")
            return 0
        return _config_help(words[0] if words else "", words[1:])
    verb = words[0] if words else ""
    if verb == "help":
        return _config_help(words[1] if len(words) > 1 else "", words[2:])
    if verb == "show":
        return _config_show(words[1:])
    if not verb:
        print(_CONFIG_USAGE, end="", file=sys.stderr)
        return 2
    print(f"streamrl: config: unknown command {verb!r}{did_you_mean(verb, ['help', 'show'])}\n{_CONFIG_USAGE}",
          end="", file=sys.stderr)
    return 2


def _config_help(section: str, extra: list[str]) -> int:
    from streamrl.config_reference import find_section, render_section_list, render_section_text

    if extra:
        print(f"streamrl: config help takes one SECTION, got also {extra}", file=sys.stderr)
        return 2
    if not section:
        print(_CONFIG_USAGE + "\n" + render_section_list(), end="")
        return 0
    try:
        found = find_section(section)
    except KeyError as exc:
        print(f"streamrl: config: {exc.args[0]}; `streamrl config --help` lists them", file=sys.stderr)
        return 2
    print(render_section_text(found), end="")
    return 0


def _config_show(words: list[str]) -> int:
    from streamrl.config import ConfigError, load_config
    from streamrl.config_reference import commented_yaml

    config: str | None = None
    if words and ("=" not in words[0] or words[0].endswith((".yaml", ".yml"))):
        config, words = words[0], words[1:]
    try:
        cfg = load_config(config if config is not None else {}, words)
    except ConfigError as exc:
        print(f"streamrl: config error: {exc}", file=sys.stderr)
        return 2
    print(commented_yaml(cfg), end="")
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


def _cmd_status(args: argparse.Namespace) -> int:
    import json
    import time

    from streamrl.runtime.run_status import render_text, snapshot

    while True:
        try:
            snap = snapshot(args.run_dir)
        except (OSError, ValueError) as exc:
            print(f"streamrl: status: {exc}", file=sys.stderr)
            return 2
        text = json.dumps(snap) if args.json else render_text(snap)
        if args.watch is None:
            print(text)
            return 0
        if sys.stdout.isatty():
            print("\x1b[H\x1b[2J", end="")
        print(text, flush=True)
        if not snap.get("live"):
            return 0  # the run is not (or no longer) live: nothing will change
        time.sleep(args.watch)


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
    v = sub.add_parser("validate", help="check a config and its pipeline without running; print the resolved config, or "
                                        "every problem in the config with its line")
    v.add_argument("config")
    v.add_argument("overrides", nargs="*")
    v.set_defaults(func=_cmd_validate)
    c = sub.add_parser("config", add_help=False, usage=_CONFIG_USAGE.removeprefix("usage: "),
                       help="the config's fields: streamrl config --help [SECTION]; a resolved config with "
                            "comments: streamrl config show [CONFIG] [key=value ...]")
    # its own --help: `streamrl config --help algo` prints a config section, not this parser's usage
    c.add_argument("-h", "--help", dest="help_section", nargs="?", const="", default=None, metavar="SECTION")
    c.add_argument("words", nargs="*")
    c.set_defaults(func=_cmd_config)
    r = sub.add_parser("report", help="plots and an index.html summary of a run: streamrl report runs/<run>")
    r.add_argument("run_dir", help="a run directory (holds metrics.jsonl and config.yaml)")
    r.add_argument("--out", default=None, help="where to write the report (default: RUN_DIR/report)")
    r.set_defaults(func=_cmd_report)
    st = sub.add_parser("status", help="a run's status: live from its launcher's status page, else from its files")
    st.add_argument("run_dir", help="a run directory (the launcher writes RUN_DIR/status.url while it runs)")
    st.add_argument("--watch", nargs="?", type=float, const=2.0, default=None, metavar="SECONDS",
                    help="print again every SECONDS (default 2) while the run is live")
    st.add_argument("--json", action="store_true", help="print the snapshot as JSON")
    st.set_defaults(func=_cmd_status)
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
    code = int(args.func(args))
    ray_cluster = sys.modules.get("streamrl.runtime.ray_cluster")  # imported only by runs that may use Ray
    if ray_cluster is not None and ray_cluster.join_abandoned():
        # a Ray cluster that could not be joined (or a signal during the join): the run has cleaned
        # up and said why; skip the interpreter's teardown, which Ray's stuck native threads break
        _exit_without_teardown(code)
    return code


def _exit_without_teardown(code: int) -> None:
    """Exit now, past the interpreter's teardown: logging and the standard streams flushed first, and
    multiprocessing's exit finalizers run (they remove the temporary directory of the forkserver's
    socket, a /tmp/pymp-* directory, which the skipped teardown would have removed)."""
    mp_util = sys.modules.get("multiprocessing.util")
    if mp_util is not None:
        mp_util._run_finalizers()  # what its atexit hook does first; no public name
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def console() -> None:
    """The ``streamrl`` command (and ``python -m streamrl.cli``): :func:`main`, then the exit. After
    ``run``, the workers' forkserver is stopped and the interpreter's teardown is skipped: its final
    garbage collection of the torch and transformers modules took about 2 s of a 17 s quickstart here,
    and by then the run has stopped every process and closed every file it wrote (logging and the
    standard streams are flushed first)."""
    # `kill -USR1 <pid>` writes every thread's Python stack to stderr, as each worker does to its log
    # (logs/pids.json names the launcher and the workers): where a hung run's launcher waits. Here and
    # not in main(), which callers (the tests) also run in their own process with other streams
    with contextlib.suppress(OSError, ValueError):  # a stderr without a file descriptor: no dumps
        faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
    code = main()
    if _ran:
        from streamrl.runtime.forkserver import stop_forkserver

        # The workers' forkserver would exit on its own once this process is gone, but only after its
        # own teardown of torch and transformers (about a second of CPU, holding the output pipe of a
        # `streamrl run ... | tee log` open): every worker was reaped, so it is stopped now.
        stop_forkserver()
        _exit_without_teardown(code)
    sys.exit(code)


if __name__ == "__main__":
    console()
