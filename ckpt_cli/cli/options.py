"""Option types shared by the commands (one definition, same help everywhere)."""

from __future__ import annotations

from typing import Annotated

import typer

JsonOpt = Annotated[bool, typer.Option("--json", help="Machine-readable JSON on stdout "
                                                      "(stable schema, see docs/json-schema.md).")]
InputFormatOpt = Annotated[str | None, typer.Option(
    "--input-format", "-F", metavar="NAME",
    help="Skip detection and read the input as this format: safetensors, hf-index, torch, dcp, "
         "deepspeed, megatron or dir.")]
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar or notes.")]
YesOpt = Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")]
DryRunOpt = Annotated[bool, typer.Option("--dry-run", "-n",
                                         help="Show what would be done and stop.")]
ForceOpt = Annotated[bool, typer.Option("--force", "--overwrite",
                                        help="Replace an existing output.")]
CastToOpt = Annotated[str, typer.Option("--to", metavar="fp16|bf16|fp32|keep",
                                        help="Cast floating-point model tensors.")]
OutputFormatOpt = Annotated[str | None, typer.Option(
    "--format", "-f", metavar="safetensors|pt",
    help="Output file format (default: from the output's suffix, else safetensors).")]
PartOpt = Annotated[str | None, typer.Option(
    "--part", metavar="K/N|auto",
    help="Do only part K of N of the work (auto: from torchrun's RANK/WORLD_SIZE or a SLURM "
         "array); the last part to finish completes the job (index, manifest, report).")]
FinalizeOpt = Annotated[bool, typer.Option(
    "--finalize", help="Complete a job split with --part from every part's receipt (exit 2 "
                       "naming the parts missing).")]
MaxMemoryOpt = Annotated[str | None, typer.Option(
    "--max-memory", metavar="SIZE",
    help="Budget for data read ahead and written behind, e.g. 512MB (default 256MB; the "
         "largest tensor may add to it).")]
