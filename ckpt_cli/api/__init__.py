"""The Python API: one function per command (``commands.py``), each returning the result the
CLI renders; the package root re-exports them (``ckpt_cli.validate(path)``), loading them on
first use. Documented in ``docs/python.md`` and in the functions' docstrings. Nothing here
imports torch, typer or rich."""
