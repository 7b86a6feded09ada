"""``outbox demo``: the example shop, which lives in a source checkout, not in the wheel.

The ``outbox.commands`` entry point names this module so that an installed wheel (which
ships no ``examples`` package) still lists the command and explains in one line where
it runs, instead of failing to load.
"""

from __future__ import annotations

import click

SOURCE_ONLY = ("outbox demo runs from a source checkout of outbox: clone the repository "
               "and run `make demo` there")


@click.command("demo", add_help_option=False,
               context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
@click.pass_context
def command(ctx: click.Context) -> None:
    """Run the example shop end to end on an embedded PostgreSQL (from a source checkout)."""
    try:
        from examples.shop.demo import command as demo
    except ModuleNotFoundError as exc:
        if exc.name not in ("examples", "examples.shop", "examples.shop.demo"):
            raise
        if {"--help", "-h"} & set(ctx.args):  # asking is not a failure
            click.echo(f"Usage: {ctx.command_path} [OPTIONS]\n\n  {command.help}\n\n  "
                       f"{SOURCE_ONLY}.")
            return
        raise click.ClickException(SOURCE_ONLY) from None
    demo.main(ctx.args, prog_name=ctx.command_path)
