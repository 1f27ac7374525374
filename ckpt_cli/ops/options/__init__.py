"""The options dataclasses of the ops, one module per command, each field the single
declaration of one option (:mod:`ckpt_cli.optionspec`): the command line builds its flags and
the Python API its keywords from them. Light modules: ``ckpt --help`` imports them all, never
the ops themselves."""
