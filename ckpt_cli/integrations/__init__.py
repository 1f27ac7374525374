"""Training-loop integrations (optional; each imports its framework, so import only the one
you use: ``ckpt_cli.integrations.hf`` or ``ckpt_cli.integrations.lightning``). The CLI never
imports them."""
