"""The ``mergekit-ext`` command line: one click command per concern.

``run``      merge a YAML config (a superset of ``mergekit-yaml``)
``methods``  list every merge method (mergekit's and ours)
``diagnose`` compare merged models, the base model and each expert, block by block
``card``     rebuild the model card of a finished merge
``publish``  upload a finished merge to the Hugging Face Hub

Importing this module imports ``mergekit_ext``, which registers our methods with mergekit
(mergekit has no plugin entry points).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any, Optional

import click
from mergekit.options import MergeOptions, PrettyPrintHelp, add_merge_options

import mergekit_ext

mergekit_ext._register()  # the command registers here: mergekit_ext.entry skipped it for speed

from mergekit_ext.cli_eval import run_eval_options  # noqa: E402
from mergekit_ext.cli_hub import publish_options  # noqa: E402
from mergekit_ext.config import load_config  # noqa: E402
from mergekit_ext.console import cli_errors  # noqa: E402
from mergekit_ext.errors import MergekitExtError, PluginError, plugin_exit_error  # noqa: E402
from mergekit_ext.methods.registry import all_method_names, describe_method  # noqa: E402

LOG = logging.getLogger(__name__)

# where the diagnose helpers live now (the Python API); the names stay importable from here
from mergekit_ext.api import _check_diagnose_outputs, write_diagnosis_json  # noqa: E402,F401


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP, handled like Ctrl-C: the temporary output and the lock are removed,
    the exit is 128 + the signal's number."""

    def __init__(self, signum: int = signal.SIGTERM) -> None:
        super().__init__(signum)
        self.signum = int(signum)


def _raise_terminated(signum: int, frame: Any) -> None:
    raise Terminated(signum)


# SIGHUP: the terminal that started the merge was closed (an ssh session that dropped).
_TERMINATING = tuple(
    getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name)
)


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """While a merge runs, SIGTERM and SIGHUP raise :class:`Terminated` (the previous
    handlers after). A SIGHUP that was ignored when we started (``nohup``) stays ignored."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {}
    for signum in _TERMINATING:
        if signum != signal.SIGTERM and signal.getsignal(signum) == signal.SIG_IGN:
            continue
        previous[signum] = signal.signal(signum, _raise_terminated)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _friendly_errors(verbose_of: Callable[[dict[str, Any]], int]) -> Callable:
    """:func:`console.cli_errors` (logging through the progress bars, one-line ``error:``),
    plus interrupts: Ctrl-C, SIGTERM and SIGHUP exit with their code and say nothing was
    written."""

    def decorator(f: Callable) -> Callable:
        inner = cli_errors(verbose_of)(f)

        @functools.wraps(f)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            from mergekit_ext.output import placed_outputs

            earlier = len(placed_outputs())
            try:
                return inner(*args, **kwargs)
            except KeyboardInterrupt as e:
                what = (
                    f"terminated ({signal.Signals(e.signum).name})"
                    if isinstance(e, Terminated)
                    else "interrupted"
                )
                placed = placed_outputs()[earlier:]
                if placed:  # the signal came after the final rename
                    click.echo(
                        f"{what} after the merge was complete: {placed[-1]} is written and "
                        "whole (only the closing messages were cut short)",
                        err=True,
                    )
                else:
                    click.echo(f"{what}; no output was written", err=True)
                sys.exit(128 + e.signum if isinstance(e, Terminated) else 130)

        return wrapper

    return decorator


@click.group()
@click.version_option(mergekit_ext.__version__, prog_name="mergekit-ext")
def main() -> None:
    """mergekit-ext: ACE, Chain of Merges, QP projection, SyMerge and RegMean for mergekit."""


# `run` and `diagnose` import the same user code first (_import_plugin): one option, one help
plugin_option = click.option(
    "--plugin",
    "plugins",
    multiple=True,
    metavar="MODULE_OR_FILE",
    help="Import a Python module or .py file first (e.g. one that registers calibration sources)",
)


def _options_verbosity(kwargs: dict[str, Any]) -> int:
    options: Optional[MergeOptions] = kwargs.get("merge_options")
    return options.verbosity if options is not None else 0


@main.command("run", cls=PrettyPrintHelp)
@click.argument("config_file", type=click.Path(dir_okay=False))
@click.argument("out_path", type=click.Path(file_okay=False))
@click.option(
    "--overwrite",
    is_flag=True,
    help="Replace OUT_PATH if it is a mergekit-ext output (an empty folder is written in place "
    "without it)",
)
@click.option(
    "--allow-pickle", is_flag=True, help="Accept pickle (.bin/.pt) checkpoints (runs their code)"
)
@click.option("--dry-run", is_flag=True, help="Validate and print the plan, write nothing")
@click.option(
    "--world-size",
    "plan_world_size",
    type=click.IntRange(min=1),
    default=None,
    metavar="W",
    help="With --dry-run: plan the merge on W processes (as under torchrun "
    "--nproc-per-node W) and print the memory of each rank",
)
@click.option("--force", is_flag=True, help="SyMerge: run even above the memory estimate")
@click.option(
    "--task-layers-only",
    is_flag=True,
    help="SyMerge: save each task's adapted layer as a PEFT adapter instead of a full checkpoint",
)
@click.option(
    "--push-to-hub", metavar="REPO_ID", default=None, help="Publish the result to the Hub"
)
@publish_options
@run_eval_options
@plugin_option
@click.option(
    "--distributed-timeout",
    type=float,
    default=None,
    metavar="SECONDS",
    callback=lambda ctx, param, value: _check_distributed_timeout(value),
    help="With torchrun/accelerate launch: bound of every collective between the processes "
    "(default 1800, at least 1); a rank waits at most this long for the others, and at most "
    "this long (default 300) to join them",
)
@add_merge_options
@_friendly_errors(_options_verbosity)
def run_command(
    merge_options: MergeOptions,
    config_file: str,
    out_path: str,
    overwrite: bool,
    allow_pickle: bool,
    dry_run: bool,
    plan_world_size: Optional[int],
    force: bool,
    task_layers_only: bool,
    push_to_hub: Optional[str],
    private: bool,
    make_private: bool,
    revision: Optional[str],
    commit_message: Optional[str],
    create_pr: bool,
    token: Optional[str],
    endpoint: Optional[str],
    keep_card: bool,
    replace_card: bool,
    template_dir: Optional[str],
    hub_timeout: float,
    eval_tasks: tuple[str, ...],
    eval_include_path: tuple[str, ...],
    eval_limit: Optional[float],
    plugins: tuple[str, ...],
    distributed_timeout: Optional[float],
) -> None:
    """Merge the models of CONFIG_FILE into OUT_PATH (a superset of mergekit-yaml).

    Under ``torchrun --nproc-per-node W -m mergekit_ext run ...`` (or ``accelerate
    launch``) the W processes share one layerwise merge; only rank 0 writes.
    """
    from mergekit_ext import distributed
    from mergekit_ext.hub.actions import HubActions
    from mergekit_ext.preflight import World, check_world
    from mergekit_ext.runner import RunOptions, run_merge_config

    merge_options.apply_global_options()
    given = [
        name
        for name, value in (
            ("--private", private),
            ("--make-private", make_private),
            ("--revision", revision),
            ("--commit-message", commit_message),
            ("--create-pr", create_pr),
            ("--token", token),
            ("--endpoint", endpoint),
            ("--keep-card", keep_card),
            ("--replace-card", replace_card),
            ("--template-dir", template_dir),
        )
        if value
    ]
    if given and not push_to_hub:
        raise click.UsageError(f"{', '.join(given)} only apply with --push-to-hub REPO_ID")
    if (eval_include_path or eval_limit is not None) and not eval_tasks:
        raise click.UsageError("--eval-include-path and --eval-limit only apply with --eval TASKS")
    for plugin in plugins:
        _import_plugin(plugin)
    cfg = load_config(config_file)
    launched = distributed.world_size_from_env()
    if plan_world_size is not None:
        if not dry_run:
            raise click.UsageError(
                "--world-size plans a merge (with --dry-run); to merge on W processes, launch "
                "`torchrun --nproc-per-node W -m mergekit_ext run CONFIG OUT`"
            )
        if launched > 1 and launched != plan_world_size:
            raise click.UsageError(
                f"--world-size {plan_world_size} but the launcher started {launched} processes "
                "(WORLD_SIZE); give one of them"
            )
    # preflight's first step, here before any rendezvous (the run's preflight repeats it)
    check_world(cfg, World.of_run(plan_world_size))
    if not dry_run:  # a dry run plans every rank from rank 0 and needs no process group
        distributed.init_from_env(merge_options.device, distributed_timeout)
    published: list[str] = []  # shown after "merged model written" (the merge comes first)
    with _sigterm_as_interrupt(), contextlib.ExitStack() as stack, _no_exit_from(plugins):
        stack.callback(distributed.shutdown)
        result = run_merge_config(
            cfg,
            out_path,
            merge_options,
            RunOptions(
                overwrite=overwrite,
                allow_pickle=allow_pickle,
                dry_run=dry_run,
                plan_world_size=plan_world_size,
                force=force,
                task_layers_only=task_layers_only,
                push_to_hub=push_to_hub,
                hub_private=private,
                hub_token=token,
                hub_make_private=make_private,
                hub_revision=revision,
                hub_commit_message=commit_message,
                hub_create_pr=create_pr,
                hub_timeout=hub_timeout,
                hub_endpoint=endpoint,
                hub_keep_card=keep_card,
                hub_replace_card=replace_card,
                hub_template_dir=template_dir,
                plugins=plugins,
                eval_tasks=eval_tasks,
                eval_include_path=eval_include_path,
                eval_limit=eval_limit,
            ),
            hub=HubActions(),
            show_published=published.append,
        )
        if result is not None:  # a signal while this prints is still reported (issue #49.7)
            click.echo(f"merged model written to {result}")
            from mergekit_ext import merge_record
            from mergekit_ext.resources import summary_line

            line = summary_line(merge_record.load(result).get("resources"))
            if line:
                click.echo(line)
        for line in published:
            click.echo(line)


class _ShardSize(click.ParamType):
    """mergekit's ``--out-shard-size`` type raises a bare ``ValueError(value)`` (a traceback)."""

    name = "size"

    def convert(self, value: Any, param: Optional[click.Parameter], ctx: Any) -> int:
        from mergekit_ext.preflight import parse_shard_size

        try:
            return parse_shard_size(value)
        except ValueError as e:
            self.fail(str(e), param, ctx)


def _checked_merge_option(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
    """mergekit's options that fail late (``torch.device``, ``set_num_threads``) checked as
    they are parsed: a usage error naming the option."""
    from mergekit_ext.preflight import merge_option_problem

    problem = merge_option_problem(str(param.name), value)
    if problem is not None:
        raise click.BadParameter(problem, ctx=ctx, param=param)
    return value


for _param in run_command.params:
    if not isinstance(_param, click.Option):
        continue
    if _param.name == "verbosity":  # mergekit's option is `-v` only; `--verbose` as elsewhere
        _param.opts.append("--verbose")
    if _param.name == "out_shard_size":
        _param.type = _ShardSize()
    if _param.name in ("device", "num_threads", "write_threads", "random_seed"):
        _param.callback = _checked_merge_option


def _check_distributed_timeout(value: Optional[float]) -> Optional[float]:
    from mergekit_ext.distributed import DistributedError, check_timeout

    if value is None:
        return None
    try:
        return check_timeout(value)
    except DistributedError as e:
        raise click.BadParameter(
            str(e).removeprefix("--distributed-timeout "), param_hint="'--distributed-timeout'"
        ) from None


@contextlib.contextmanager
def _no_exit_from(plugins: tuple[str, ...]) -> Iterator[None]:
    """A ``sys.exit()`` during the merge comes from user code (mergekit-ext never exits
    there): a failure, never the silent exit 0 it would be."""
    try:
        yield
    except SystemExit as e:
        who = f"code loaded with --plugin {', '.join(plugins)}" if plugins else "user code"
        raise plugin_exit_error(e, who) from None
    except MergekitExtError:
        raise
    except Exception as e:  # raised inside a --plugin file: name it (was "error (X): boom")
        where = _plugin_frame(e, plugins)
        if where is None:
            raise
        raise PluginError(
            f"--plugin {where[0]} raised {type(e).__name__}: {e} (at {where[1]}); fix the "
            "plugin (run with -v for the traceback)"
        ) from e


def _plugin_frame(error: BaseException, plugins: tuple[str, ...]) -> Optional[tuple[str, str]]:
    """(the plugin, FILE:LINE) of the innermost traceback frame in a ``--plugin`` file."""
    files = {os.path.abspath(p): p for p in plugins if p.endswith(".py")}
    found = None
    tb = error.__traceback__
    while tb is not None:
        name = os.path.abspath(tb.tb_frame.f_code.co_filename)
        if name in files:
            found = (files[name], f"{tb.tb_frame.f_code.co_filename}:{tb.tb_lineno}")
        tb = tb.tb_next
    return found


def _import_plugin(spec: str) -> None:
    """Import ``spec``: a ``.py`` file path or a dotted module name."""
    import importlib
    import importlib.util
    import os

    if spec.endswith(".py"):
        if not os.path.isfile(spec):
            raise PluginError(f"--plugin file not found: {spec}")
        name = "mergekit_ext_plugin_" + os.path.splitext(os.path.basename(spec))[0]
        module_spec = importlib.util.spec_from_file_location(name, spec)
        assert module_spec is not None and module_spec.loader is not None
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[name] = module
        try:
            module_spec.loader.exec_module(module)
        except SystemExit as e:
            raise plugin_exit_error(e, f"--plugin {spec} (while imported)") from None
        except MergekitExtError:
            raise
        except Exception as e:
            where = _plugin_frame(e, (spec,))
            raise PluginError(
                f"--plugin {spec} failed while imported: {type(e).__name__}: {e}"
                f"{f' (at {where[1]})' if where else ''}; fix the plugin (run with -v for "
                "the traceback)"
            ) from e
    else:
        try:
            importlib.import_module(spec)
        except ModuleNotFoundError as e:
            raise PluginError(f"--plugin module {spec!r} cannot be imported: {e}") from e
        except SystemExit as e:
            raise plugin_exit_error(e, f"--plugin {spec} (while imported)") from None
        except MergekitExtError:
            raise
        except Exception as e:
            raise PluginError(
                f"--plugin {spec} failed while imported: {type(e).__name__}: {e}; fix the "
                "plugin (run with -v for the traceback)"
            ) from e


@main.command("methods")
@click.argument("name", required=False)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output")
@click.option("-v", "--verbose", count=True, help="Show logs (-vv: debug) and tracebacks")
@_friendly_errors(lambda kwargs: kwargs.get("verbose", 0))
def methods_command(name: Optional[str], as_json: bool, verbose: int) -> None:
    """List every merge method with its parameters (or describe NAME)."""
    names = [name] if name else all_method_names()
    if name and name not in all_method_names():
        from mergekit_ext.checks import check_method

        check_method(name)  # raises a MergekitExtError naming the nearest methods
    described = [describe_method(n) for n in names]
    if as_json:
        click.echo(json.dumps(described, indent=2))
        return
    for d in described:
        flags = [d["source"], d["kind"]]
        if d["needs_calibration"]:
            flags.append("needs calibration data")
        if d["needs_base_model"]:
            flags.append("needs base_model")
        click.echo(f"{d['name']}  ({d['pretty_name']}; {', '.join(flags)})")
        if d["paper"] or d["paper_url"]:
            click.echo(f"    paper: {' '.join(x for x in (d['paper'], d['paper_url']) if x)}")
        for p in d["parameters"]:
            default = "required" if p["required"] else f"default {p['default']!r}"
            scope = "" if p["scope"] == "shared" else f", per {p['scope'].replace('_', '-')}"
            allowed = p.get("allowed") or ""
            # plain choices are in the description; a range (alone or beside a choice) is not
            if allowed and (" | " not in allowed or any(c in allowed for c in "[(")):
                scope += f", in {allowed}"
            desc = f" — {p['description']}" if p["description"] else ""
            click.echo(f"    {p['name']} ({default}{scope}){desc}")
        if d["source"] == "mergekit-ext":  # the numbers behind the defaults live there
            click.echo("    equations, why the defaults, benchmark results: docs/methods.md")


@main.command("diagnose")
@click.argument("merged_dirs", nargs=-1, required=True, type=click.Path(file_okay=False))
@click.argument("config_file", type=click.Path(dir_okay=False))
@click.option(
    "--heldout",
    multiple=True,
    metavar="PATH | TASK=PATH | FILE.yml | '{...}'",
    help="Evaluation data instead of the default (each task's calibration examples the merge "
    "did not read): a data file or folder for every task, TASK=PATH for one task, or "
    "calibration-style fields (a YAML file or an inline mapping such as "
    "'{split: validation}'; per task under `tasks:`). Repeatable. See docs/methods.md, "
    '"Diagnose"',
)
@click.option(
    "--calibration-data",
    is_flag=True,
    help="Measure on the calibration data the merge read (optimistic; the old behaviour)",
)
@click.option(
    "--no-probe",
    is_flag=True,
    help="Skip the generic prose probe (text models; faster, but a merge broken outside its "
    "calibration template may then pass)",
)
@click.option(
    "--no-references",
    is_flag=True,
    help="Skip the reference rows (the base model and each expert alone): faster, no verdict "
    "against the base",
)
@click.option(
    "--json",
    "json_path",
    type=click.Path(dir_okay=False),
    help="Write the result here (a list for several merged folders)",
)
@click.option(
    "--plots", "plots_dir", type=click.Path(file_okay=False), help="Write the per-block plot here"
)
@click.option("--device", default="cpu", show_default=True, help="cpu | cuda[:n] | auto")
@plugin_option
@click.option("--trust-remote-code", is_flag=True, help="Trust remote code of tokenizers")
@click.option("-v", "--verbose", count=True, help="Show logs (-vv: debug) and tracebacks")
@_friendly_errors(lambda kwargs: kwargs.get("verbose", 0))
def diagnose_command(
    merged_dirs: tuple[str, ...],
    config_file: str,
    heldout: tuple[str, ...],
    calibration_data: bool,
    no_probe: bool,
    no_references: bool,
    json_path: Optional[str],
    plots_dir: Optional[str],
    device: str,
    plugins: tuple[str, ...],
    trust_remote_code: bool,
    verbose: int,
) -> None:
    """Compare each MERGED_DIR with each expert of CONFIG_FILE on held-out data.

    Block by block (streaming): the relative error of each block's output, and at the output
    the agreement with the expert (argmax / next-token top-1) and the mean KL(expert‖merged).
    The base model and each expert alone are measured the same way as reference rows, and
    each merged model gets a one-line verdict against the base model. Several MERGED_DIRs
    share the experts' passes. By default each task is measured on the examples of its
    calibration data that the merge did not read (docs/methods.md, "Diagnose").
    """
    from mergekit_ext.api import diagnose_merge
    from mergekit_ext.diagnose import format_report

    for plugin in plugins:
        _import_plugin(plugin)
    results = diagnose_merge(
        list(merged_dirs),
        load_config(config_file),
        heldout=list(heldout),
        calibration_data=calibration_data,
        references=not no_references,
        probe=not no_probe,
        device=device,
        trust_remote_code=trust_remote_code,
        json_path=json_path,
        plots_dir=plots_dir,
    )
    assert isinstance(results, list)
    click.echo(format_report(results))
    if json_path:
        click.echo(f"diagnosis written to {json_path}")
    if plots_dir:
        click.echo(f"plot written to {os.path.join(plots_dir, 'diagnose_block_errors.png')}")


def _register_hub_commands() -> None:
    from mergekit_ext.cli_hub import card_command, publish_command

    main.add_command(card_command, "card")
    main.add_command(publish_command, "publish")


_register_hub_commands()


def _register_eval_command() -> None:
    from mergekit_ext.cli_eval import eval_command

    main.add_command(eval_command, "eval")


_register_eval_command()


if __name__ == "__main__":
    main()
