"""``python -m ckpt_cli``."""

from ckpt_cli.cli.app import main

main()
