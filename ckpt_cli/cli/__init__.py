"""The ``ckpt`` command line: typer wiring over :mod:`ckpt_cli.ops`."""
